"""Benchmark of the CPU matmul kernel against numpy (OpenBLAS), side by side.

For each shape M x K . K x N and each operand layout used in training
    A.B    plain              (dx = g @ W)
    At.B   src0 a transposed view of a (K, M) array   (dW = g.T @ x)
    A.Bt   src1 a transposed view of an (N, K) array  (y = x @ W.T)
it prints our GFLOP/s and numpy's at 1 and 2 threads, the ratio ours/numpy and ours as a
percentage of the FP32 peak of that many cores (bench/peak.py, measured in the same sitting).
Extra lines (not in the worst ratio): attention-like batches, and the skinny
products of the MNIST CNN with the time per call of both sides.

Ours runs through a plan compiled once (CpuBackend.compile / run), numpy through
np.matmul(a, b, out=c) on the very same arrays, so neither side pays Python
allocation. Best-of-N timing after a warm-up, with ours and numpy measured in
alternating rounds so that noise from a shared machine hits both alike.

Frozen weights in their stored type (issue 8): for Q4_0, Q4_1, Q8_0, Q6_K and F16
weights W (R, C) of the fine-tuning shapes, with 512 rows of x, both products
    x @ W.T   src1 the transposed view of W   (the forward of a linear layer)
    g @ W     src1 W itself                   (its input gradient)
it prints gt_matmul_fwd_f32_<w> against gt_matmul_fwd_f32 on the dequantized f32
matrix in the same layout (measured alternately in the same run), the ratio (target
>= 0.8) and the fraction of the machine's FP32 peak (bench/peak.py: measured, not looked
up, on as many threads as the line uses).
Then the generation products (M = 1, x @ W.T, the row-dot path): GB/s of weight bytes
read and GFLOP/s, SmolLM2-135M's per-token products (30 blocks of Q4_1 q, k, v, o,
gate, up, down and the tied Q8_0 output projection 49152 x 576) summed into an upper
bound on tokens/s, and, when llama-cpp-python and ../shared/data's SmolLM2 file are
there, llama.cpp's own generation speed on that model for comparison.

Usage (repo root, after `pip install -e .`):
    python bench/bench_matmul.py [--quick] [--threads 1,2] [--rounds N] [--only f32|weights|gen]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

from ggtrain.core.backend import KernelCall, TensorRef
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.native import lib
from ggtrain.native.dtypes import dtype

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peak import Peak  # noqa: E402

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # no silent fallback: numpy would use every core on the 1-thread lines
    sys.exit("bench_matmul needs threadpoolctl to pin numpy's BLAS threads: "
             "pip install threadpoolctl (or pip install -e '.[bench]')")

SHAPES = [(500, 784, 500), (2048, 256, 768), (2048, 768, 256)]
# extra lines, for information (not part of the worst ratio): attention-like
# batches of small products, (batch, M, K, N), plain layout
BATCHED = [(64, 128, 32, 128), (64, 128, 128, 32)]
# extra lines: the skinny products of an im2col MNIST CNN (2 x 500 images; conv2d now
# convolves directly), (M, K, N, layout): conv1 weight grad, conv2 weight grad, conv2
# forward, conv2 input grad, conv1 forward
SKINNY = [(9, 392000, 8, "At.B"), (72, 98000, 16, "At.B"), (98000, 72, 16, "A.Bt"),
          (98000, 16, 72, "A.B"), (392000, 9, 8, "A.Bt")]
LAYOUTS = ["A.B", "At.B", "A.Bt"]
_OPENBLAS_SPIN_S = 0.15
_POOL_SPIN_S = 0.02


def _blas_threads(n: int):
    return threadpool_limits(limits=n, user_api="blas")


def _operands(backend, M, K, N, layout, rng, batch=0):
    """Arrays living in backend buffers, plus the TensorRefs the kernel gets."""
    if batch:
        out = []
        for shape in ((batch, M, K), (batch, K, N), (batch, M, N)):
            buf = backend.alloc(int(np.prod(shape)) * 4)
            arr = buf.view(0, "f32", shape)
            arr[...] = rng.standard_normal(shape, dtype=np.float32)
            out.append((arr, buf, TensorRef(buf, 0, "f32", shape, (shape[1] * shape[2], shape[2], 1))))
        (a, ab, aref), (b, bb, bref), (c, cb, cref) = out
        return a, b, c, aref, bref, cref, (ab, bb, cb)

    def buf_array(shape):
        buf = backend.alloc(int(np.prod(shape)) * 4)
        arr = buf.view(0, "f32", shape)
        arr[...] = rng.standard_normal(shape, dtype=np.float32)
        return buf, arr

    if layout == "At.B":
        abuf, abase = buf_array((K, M))
        a, aref = abase.T, TensorRef(abuf, 0, "f32", (M, K), (1, M))
    else:
        abuf, a = buf_array((M, K))
        aref = TensorRef(abuf, 0, "f32", (M, K), (K, 1))
    if layout == "A.Bt":
        bbuf, bbase = buf_array((N, K))
        b, bref = bbase.T, TensorRef(bbuf, 0, "f32", (K, N), (1, K))
    else:
        bbuf, b = buf_array((K, N))
        bref = TensorRef(bbuf, 0, "f32", (K, N), (N, 1))
    cbuf = backend.alloc(M * N * 4)
    c = cbuf.view(0, "f32", (M, N))
    cref = TensorRef(cbuf, 0, "f32", (M, N), (N, 1))
    keep = (abuf, bbuf, cbuf)
    return a, b, c, aref, bref, cref, keep


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


_BACKENDS: dict = {}


def _threads(n: int) -> CpuBackend:
    """The CPU backend of n threads (plans run on their own backend's threads; every CPU
    backend's buffers are host memory, so one backend's operands serve them all)."""
    return _BACKENDS.setdefault(n, CpuBackend(n))


def bench_line(backend, M, K, N, layout, n_threads, rounds, reps, rng, batch=0):
    a, b, c, aref, bref, cref, _keep = _operands(backend, M, K, N, layout, rng, batch)
    call = KernelCall("matmul_fwd_f32", cref, (aref, bref))
    call = KernelCall(call.kernel, cref, (aref, bref), work_bytes=backend.kernel_sizes(call)[1])
    plan = _threads(n_threads).compile([call])
    ref = np.empty_like(c)
    with _blas_threads(n_threads):
        np.matmul(a, b, out=ref)
        backend.run(plan)
        err = float(np.abs(c - ref).max() / (np.abs(ref).max() + 1e-30))
        ours_fn = lambda: backend.run(plan)  # noqa: E731
        numpy_fn = lambda: np.matmul(a, b, out=ref)  # noqa: E731
        t_ours = t_np = float("inf")
        for _ in range(rounds):  # interleaved rounds, best of all
            # Idle threads of either side busy-wait for a while after a call
            # (OpenBLAS's for up to 2^28 cycles, ~0.1 s; our pool's for ~1 ms)
            # and would steal a core from the other side: let them fall asleep.
            time.sleep(_OPENBLAS_SPIN_S)
            t_ours = min(t_ours, _best(ours_fn, reps))
            time.sleep(_POOL_SPIN_S)
            t_np = min(t_np, _best(numpy_fn, reps))
    flops = 2.0 * M * N * K * max(1, batch)
    return flops / t_ours / 1e9, flops / t_np / 1e9, err


# ---- frozen weights in their stored type ---------------------------------------------

WEIGHT_TYPES = ["q4_0", "q4_1", "q8_0", "q6_k", "f16"]
WEIGHT_SHAPES = [(576, 576), (1536, 576), (576, 1536), (2048, 2048)]   # W (R, C)
WEIGHT_ROWS = 512
GEN_SHAPES = [(576, 576), (1536, 576), (576, 1536)]
GEN_TYPES = ["q4_1", "q4_0", "q8_0", "q6_k", "f16"]
OUTPUT_PROJ = ("q8_0", 49152, 576)
SMOLLM2 = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "models" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-135M's matrices per block (R, C): q, k, v, o, gate, up, down
SMOLLM2_BLOCK = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]

def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _stored_weight(backend, w, R, C, rng):
    """W (R, C) in type w in a backend buffer, and its dequantization (f32) in another."""
    from gguf import GGMLQuantizationType, quants

    x = rng.standard_normal((R, C)).astype(np.float32)
    t = GGMLQuantizationType[w.upper()]
    if w == "q6_k":   # gguf-py cannot write K-quants: random bytes with sane f16 scales
        raw = rng.integers(0, 256, (R, C // 256, 210), dtype=np.uint8)
        raw[:, :, 208:210] = rng.uniform(0.001, 0.01, (R, C // 256, 1)).astype(np.float16).view(np.uint8)
        raw = raw.reshape(R, -1)
    else:
        raw = quants.quantize(x, t)
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    deq = quants.dequantize(raw.reshape(R, -1), t).astype(np.float32).reshape(R, C)
    wbuf = backend.alloc(raw.size)
    wbuf.bytes[:] = raw
    fbuf = backend.alloc(R * C * 4)
    fbuf.view(0, "f32", (R, C))[...] = deq
    return wbuf, fbuf, raw.size


def _weight_calls(backend, w, R, C, M, transposed, rng):
    """(ours, f32 reference) KernelCalls for x (M, K) @ W.T or g (M, R) @ W, and buffers."""
    wbuf, fbuf, nbytes = _stored_weight(backend, w, R, C, rng)
    K, N = (C, R) if transposed else (R, C)
    view = ((C, R), (1, C)) if transposed else ((R, C), (C, 1))
    xbuf = backend.alloc(M * K * 4)
    xbuf.view(0, "f32", (M, K))[...] = rng.standard_normal((M, K), dtype=np.float32)
    ybuf, rbuf = backend.alloc(M * N * 4), backend.alloc(M * N * 4)
    xref = TensorRef(xbuf, 0, "f32", (M, K), (K, 1))
    calls = []
    for kernel, buf, dt, out in ((f"matmul_fwd_f32_{w}", wbuf, w, ybuf), ("matmul_fwd_f32", fbuf, "f32", rbuf)):
        call = KernelCall(kernel, TensorRef(out, 0, "f32", (M, N), (N, 1)), (xref, TensorRef(buf, 0, dt, *view)))
        calls.append(KernelCall(kernel, call.dst, call.srcs, work_bytes=backend.kernel_sizes(call)[1]))
    outs = (ybuf.view(0, "f32", (M, N)), rbuf.view(0, "f32", (M, N)))
    return calls, outs, nbytes, (wbuf, fbuf, xbuf, ybuf, rbuf)


def _alternate(backend, plans, n_threads, rounds, reps):
    """Best time of each plan, measured in alternating rounds."""
    best = [float("inf")] * len(plans)
    for p in plans:
        backend.run(p)
    for _ in range(rounds):
        for i, p in enumerate(plans):
            time.sleep(_POOL_SPIN_S)
            best[i] = min(best[i], _best(lambda: backend.run(p), reps))  # noqa: B023
    return best


def bench_weights(backend, threads, rounds, reps, rng, peaks) -> None:
    print(f"\nfrozen weights: gt_matmul_fwd_f32_<w> vs gt_matmul_fwd_f32 on the dequantized matrix, "
          f"M = {WEIGHT_ROWS} rows of x")
    print(f"{'weight':<7} {'W (R x C)':<11} {'product':<7} {'thr':>3} {'ours GF/s':>10} {'f32 GF/s':>9} "
          f"{'ratio':>6} {'%peak':>6} {'same bits':>9}")
    worst = float("inf")
    for w in WEIGHT_TYPES:
        for R, C in WEIGHT_SHAPES:
            if C % dtype(w).block:
                print(f"{w:<7} {f'{R}x{C}':<11} (C = {C} is not whole {dtype(w).block}-element blocks)")
                continue
            for transposed in (True, False):
                calls, (ours, ref), _, _keep = _weight_calls(backend, w, R, C, WEIGHT_ROWS, transposed, rng)
                for nt in threads:
                    plans = [_threads(nt).compile([c]) for c in calls]
                    t_ours, t_f32 = _alternate(backend, plans, nt, rounds, reps)
                    same = np.array_equal(ours, ref)
                    flops = 2.0 * WEIGHT_ROWS * R * C
                    g_ours, g_f32 = flops / t_ours / 1e9, flops / t_f32 / 1e9
                    worst = min(worst, g_ours / g_f32)
                    flag = "" if g_ours / g_f32 >= 0.8 else "  <0.8"
                    print(f"{w:<7} {f'{R}x{C}':<11} {'x@W.T' if transposed else 'g@W':<7} {nt:>3} "
                          f"{g_ours:>10.1f} {g_f32:>9.1f} {g_ours / g_f32:>6.2f} "
                          f"{peaks[nt].percent(g_ours):>5.0f}% {'yes' if same else 'NO':>9}{flag}", flush=True)
    print(f"worst ratio stored weight / f32: {worst:.2f}")


def _gen_plan(backend, w, R, C, nt, rng):
    calls, _, nbytes, keep = _weight_calls(backend, w, R, C, 1, True, rng)
    return [_threads(nt).compile([c]) for c in calls], nbytes, keep


def bench_generation(backend, threads, rounds, reps, rng) -> None:
    print("\ngeneration: x (1, C) @ W.T, the row-dot path; f32 = gt_matmul_fwd_f32 on the dequantized W")
    print(f"{'weight':<7} {'W (R x C)':<12} {'thr':>3} {'us':>8} {'GB/s of W':>10} {'GF/s':>7} {'f32 us':>8}")
    lines = [(w, R, C) for w in GEN_TYPES for R, C in GEN_SHAPES if C % dtype(w).block == 0] + [OUTPUT_PROJ]
    for w, R, C in lines:
        for nt in threads:
            plans, nbytes, _keep = _gen_plan(backend, w, R, C, nt, rng)
            r = max(1, reps * (4 if R * C < 10**6 else 1))
            t_ours, t_f32 = _alternate(backend, plans, nt, rounds, r)
            print(f"{w:<7} {f'{R}x{C}':<12} {nt:>3} {t_ours * 1e6:>8.1f} {nbytes / t_ours / 1e9:>10.1f} "
                  f"{2.0 * R * C / t_ours / 1e9:>7.1f} {t_f32 * 1e6:>8.1f}", flush=True)
    # SmolLM2-135M, one token: 30 blocks of Q4_1 products and the tied Q8_0 output projection
    for nt in threads:
        total = 0.0
        for R, C in SMOLLM2_BLOCK:
            plans, _, _keep = _gen_plan(backend, "q4_1", R, C, nt, rng)
            total += 30 * _alternate(backend, plans[:1], nt, rounds, reps * 4)[0]
        plans, _, _keep = _gen_plan(backend, *OUTPUT_PROJ, nt, rng)
        total += _alternate(backend, plans[:1], nt, rounds, reps)[0]
        ref = _llama_cpp_tokens_per_s(nt)
        ref_s = f"; llama.cpp on the real file: {ref:.0f} tokens/s (ours/llama.cpp {1 / total / ref:.2f})" \
            if ref else f"; llama.cpp: {_LLAMA_SKIP}"
        print(f"SmolLM2-135M per token, products only, {nt} thr: {total * 1e3:.2f} ms = at most "
              f"{1 / total:.0f} tokens/s{ref_s}", flush=True)


_LLAMA_SKIP = "not measured (needs `pip install -e '.[interop]'` and ../shared/data/models)"


def _llama_cpp_tokens_per_s(n_threads: int) -> float | None:
    """llama.cpp's generation speed (eval tokens/s, prompt excluded) on SmolLM2-135M Q4_1."""
    try:
        import llama_cpp
    except ImportError:
        return None
    if not SMOLLM2.is_file():
        return None
    llm = llama_cpp.Llama(model_path=str(SMOLLM2), n_threads=n_threads, n_ctx=256, verbose=False)
    prompt = llm.tokenize(b"The capital of France is")
    best = 0.0
    for _ in range(3):
        llm.reset()
        llm.eval(prompt)
        n, t0 = 64, time.perf_counter()
        for _ in range(n):
            tok = llm.sample(temp=0.0)
            llm.eval([tok])
        best = max(best, n / (time.perf_counter() - t0))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma separated")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per line")
    ap.add_argument("--only", choices=["f32", "weights", "gen"], default=None,
                    help="run one part: the f32 lines, the stored-weight lines or the generation lines")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    rounds = args.rounds or (3 if args.quick else 8)
    reps = 3 if args.quick else 5
    rng = np.random.default_rng(0)
    backend = CpuBackend(max(threads))
    feats = lib.gt_cpu_features()
    level = "avx512" if feats & 2 else "avx2" if feats & 1 else "scalar"
    blas = "threadpoolctl"
    peaks = {nt: Peak(nt) for nt in threads}
    if args.only in ("weights", "gen"):
        print(f"ggtrain ({level}); {'; '.join(p.describe() for p in peaks.values())}; best of {rounds}x{reps}")
        if args.only == "weights":
            bench_weights(backend, threads, rounds, reps, rng, peaks)
        else:
            bench_generation(backend, threads, rounds, reps, rng)
        return
    print(f"matmul f32, ggtrain ({level}) vs numpy {np.__version__} (BLAS threads via {blas}); "
          f"best of {rounds}x{reps}")
    print(f"{'shape MxK.KxN':<18} {'layout':<6} {'thr':>3} {'ours GF/s':>10} {'numpy GF/s':>11} "
          f"{'ratio':>6} {'%peak':>6} {'relerr':>8}")
    worst = float("inf")
    for M, K, N in SHAPES:
        for layout in LAYOUTS:
            for nt in threads:
                ours, ref, err = bench_line(backend, M, K, N, layout, nt, rounds, reps, rng)
                ratio = ours / ref
                worst = min(worst, ratio)
                flag = "" if ratio >= 0.7 else "  <0.7"
                print(f"{f'{M}x{K}.{K}x{N}':<18} {layout:<6} {nt:>3} {ours:>10.1f} {ref:>11.1f} "
                      f"{ratio:>6.2f} {peaks[nt].percent(ours):>5.0f}% {err:>8.1e}{flag}", flush=True)
        for p in peaks.values():
            p.sample()
    print(f"worst ratio ours/numpy: {worst:.2f}; {'; '.join(p.describe() for p in peaks.values())}")
    for B, M, K, N in BATCHED:
        for nt in threads:
            ours, ref, err = bench_line(backend, M, K, N, "A.B", nt, rounds, reps, rng, batch=B)
            print(f"{f'{B}x({M}x{K}.{K}x{N})':<18} {'batch':<6} {nt:>3} {ours:>10.1f} {ref:>11.1f} "
                  f"{ours / ref:>6.2f} {err:>8.1e}  (extra)", flush=True)
    for M, K, N, layout in SKINNY:
        for nt in threads:
            ours, ref, err = bench_line(backend, M, K, N, layout, nt, rounds, reps, rng)
            ms = 2.0 * M * N * K / 1e6
            print(f"{f'{M}x{K}.{K}x{N}':<18} {layout:<6} {nt:>3} {ours:>10.1f} {ref:>11.1f} "
                  f"{ours / ref:>6.2f} {err:>8.1e}  (extra: {ms / ours:.2f} ms vs {ms / ref:.2f} ms)",
                  flush=True)
    if args.only == "f32":
        return
    bench_weights(backend, threads, rounds, reps, rng, peaks)
    bench_generation(backend, threads, rounds, reps, rng)


if __name__ == "__main__":
    main()
