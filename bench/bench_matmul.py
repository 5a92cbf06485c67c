"""Benchmark of the CPU matmul kernel against numpy (OpenBLAS), side by side.

For each shape M x K . K x N and each operand layout used in training
    A.B    plain              (dx = g @ W)
    At.B   src0 a transposed view of a (K, M) array   (dW = g.T @ x)
    A.Bt   src1 a transposed view of an (N, K) array  (y = x @ W.T)
it prints our GFLOP/s and numpy's at 1 and 2 threads and the ratio ours/numpy.
Extra lines (not in the worst ratio): attention-like batches, and the skinny
products of the MNIST CNN with the time per call of both sides.

Ours runs through a plan compiled once (CpuBackend.compile / run), numpy through
np.matmul(a, b, out=c) on the very same arrays, so neither side pays Python
allocation. Best-of-N timing after a warm-up, with ours and numpy measured in
alternating rounds so that noise from a shared machine hits both alike.

Usage (repo root, after `pip install -e .`):
    python bench/bench_matmul.py [--quick] [--threads 1,2] [--rounds N]
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from ggtrain.core.backend import KernelCall, TensorRef
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.native import lib

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # no silent fallback: numpy would use every core on the 1-thread lines
    sys.exit("bench_matmul needs threadpoolctl to pin numpy's BLAS threads: "
             "pip install threadpoolctl (or pip install -e '.[bench]')")

SHAPES = [(500, 784, 500), (2048, 256, 768), (2048, 768, 256)]
# extra lines, for information (not part of the worst ratio): attention-like
# batches of small products, (batch, M, K, N), plain layout
BATCHED = [(64, 128, 32, 128), (64, 128, 128, 32)]
# extra lines: the skinny products of the MNIST CNN (2 x 500 images), (M, K, N, layout):
# conv1 weight grad, conv2 weight grad, conv2 forward, conv2 input grad, conv1 forward
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


def bench_line(backend, M, K, N, layout, n_threads, rounds, reps, rng, batch=0):
    a, b, c, aref, bref, cref, _keep = _operands(backend, M, K, N, layout, rng, batch)
    call = KernelCall("matmul_fwd_f32", cref, (aref, bref))
    call = KernelCall(call.kernel, cref, (aref, bref), work_bytes=backend.kernel_sizes(call)[1])
    plan = backend.compile([call], n_threads)
    ref = np.empty_like(c)
    with _blas_threads(n_threads):
        np.matmul(a, b, out=ref)
        backend.run(plan, n_threads)
        err = float(np.abs(c - ref).max() / (np.abs(ref).max() + 1e-30))
        ours_fn = lambda: backend.run(plan, n_threads)  # noqa: E731
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds (about 10 s)")
    ap.add_argument("--threads", default="1,2", help="thread counts, comma separated")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per line")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    rounds = args.rounds or (3 if args.quick else 8)
    reps = 3 if args.quick else 5
    rng = np.random.default_rng(0)
    backend = CpuBackend(max(threads))
    feats = lib.gt_cpu_features()
    level = "avx512" if feats & 2 else "avx2" if feats & 1 else "scalar"
    blas = "threadpoolctl"
    print(f"matmul f32, ggtrain ({level}) vs numpy {np.__version__} (BLAS threads via {blas}); "
          f"best of {rounds}x{reps}")
    print(f"{'shape MxK.KxN':<18} {'layout':<6} {'thr':>3} {'ours GF/s':>10} {'numpy GF/s':>11} "
          f"{'ratio':>6} {'relerr':>8}")
    worst = float("inf")
    for M, K, N in SHAPES:
        for layout in LAYOUTS:
            for nt in threads:
                ours, ref, err = bench_line(backend, M, K, N, layout, nt, rounds, reps, rng)
                ratio = ours / ref
                worst = min(worst, ratio)
                flag = "" if ratio >= 0.7 else "  <0.7"
                print(f"{f'{M}x{K}.{K}x{N}':<18} {layout:<6} {nt:>3} {ours:>10.1f} {ref:>11.1f} "
                      f"{ratio:>6.2f} {err:>8.1e}{flag}", flush=True)
    print(f"worst ratio ours/numpy: {worst:.2f}")
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


if __name__ == "__main__":
    main()
