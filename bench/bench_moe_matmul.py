"""Benchmark of the routed-expert products (moe.c) against the ordinary matmul at the same shapes.

For the expert products of a MoE FFN, x (N, X, K) with ids (N, k) routing each token to k of E
experts w (E, M, K), it times
    fwd     moe_matmul_fwd_f32            y (N, k, M) = w[ids] @ x          (gate/up: X = 1; down: X = k)
    dx      moe_matmul_input_bwd_f32      dx (N, X, K) = sum of g @ w[ids]
    dw      moe_matmul_weight_bwd_f32     dw (E, M, K) = g^T @ x per expert
(2 N k M K flops each) and the ordinary f32 matmul of the same work, (N k, K) @ (K, M) as
x @ W^T (fwd), g @ W (dx) and g^T @ x (dw), and prints GFLOP/s, the matmul's over ours (target
<= 1.5) and the fraction of the FP32 peak (bench/peak.py, measured in the same sitting). Exact
numerics; the ids are random (each token's k distinct experts, uniform), as a router early in
training spreads them.

--baseline LIB times the same lines with another build of the extension (e.g. main's
native/_cpu.abi3.so, before the grouped products) in a subprocess of this sitting and adds
its GFLOP/s and our speed-up over it.

Default shapes: bench/bench_families.py's Qwen3-MoE (hidden 512, expert FFN 256, 16 experts,
top 2; batch 4 x ctx 256 = 1024 tokens), gate/up and down.

Usage (repo root, after `pip install -e .`):
    python bench/bench_moe_matmul.py [--threads 2] [--tokens 1024] [--baseline /work/main/native/_cpu.abi3.so]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from ggtrain.core.backend import KernelCall, TensorRef
from ggtrain.core.backend_cpu import CpuBackend

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peak import Peak  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
# (name, X is k, K, E, M, k): bench_families' qwen3moe, hidden 512, moe_intermediate 256
SHAPES = [("gate/up", False, 512, 16, 256, 2), ("down", True, 256, 16, 512, 2)]


def _ref(backend, arr):
    buf = backend.alloc(max(arr.nbytes, 4))
    view = buf.view(0, "f32" if arr.dtype == np.float32 else "i32", arr.shape)
    view[...] = arr
    strides = tuple(s // arr.itemsize for s in arr.strides)
    return buf, TensorRef(buf, 0, "f32" if arr.dtype == np.float32 else "i32", arr.shape, strides)


def _call(backend, kernel, dst, srcs, ip=()):
    call = KernelCall(kernel, dst, srcs, ip=ip)
    sizer = backend.kernel_sizes(call)
    return KernelCall(kernel, dst, srcs, ip=ip, work_bytes=sizer[1])


def _time(backend, plan, reps, rounds) -> float:
    backend.run(plan)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            backend.run(plan)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def lines(threads: int, tokens: int, reps: int, rounds: int, matmul: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    backend = CpuBackend(threads)
    out = []
    keep = []
    for name, xk, K, E, M, k in SHAPES:
        N, X = tokens, (k if xk else 1)
        ids = np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.int32)
        x = rng.standard_normal((N, X, K), dtype=np.float32)
        w = rng.standard_normal((E, M, K), dtype=np.float32) * 0.05
        g = rng.standard_normal((N, k, M), dtype=np.float32)
        bufs = {n: _ref(backend, a) for n, a in (("x", x), ("w", w), ("ids", ids), ("g", g),
                                                ("y", np.zeros((N, k, M), np.float32)),
                                                ("dx", np.zeros((N, X, K), np.float32)),
                                                ("dw", np.zeros((E, M, K), np.float32)))}
        keep.append(bufs)
        r = {n: b[1] for n, b in bufs.items()}
        flops = 2.0 * N * k * M * K
        calls = {"fwd": _call(backend, "moe_matmul_fwd_f32", r["y"], (r["x"], r["w"], r["ids"]), ip=(0,)),
                 "dx": _call(backend, "moe_matmul_input_bwd_f32", r["dx"], (r["w"], r["ids"], r["g"])),
                 "dw": _call(backend, "moe_matmul_weight_bwd_f32", r["dw"], (r["x"], r["ids"], r["g"]))}
        if matmul:   # the same work as one ordinary product: (N k, K) @ (K, M) in the three layouts
            R = N * k
            a = rng.standard_normal((R, K), dtype=np.float32)
            wm = rng.standard_normal((M, K), dtype=np.float32)
            gm = rng.standard_normal((R, M), dtype=np.float32)
            mb = {n: _ref(backend, v) for n, v in (("a", a), ("w", wm), ("g", gm), ("y", np.zeros((R, M), np.float32)),
                                                    ("dx", np.zeros((R, K), np.float32)),
                                                    ("dw", np.zeros((M, K), np.float32)))}
            keep.append(mb)
            wT = TensorRef(mb["w"][0], 0, "f32", (K, M), (1, K))
            gT = TensorRef(mb["g"][0], 0, "f32", (M, R), (1, M))
            mm = {"fwd": _call(backend, "matmul_fwd_f32", mb["y"][1], (mb["a"][1], wT)),
                  "dx": _call(backend, "matmul_fwd_f32", mb["dx"][1], (mb["g"][1], mb["w"][1])),
                  "dw": _call(backend, "matmul_fwd_f32", mb["dw"][1], (gT, mb["a"][1]))}
        for op, call in calls.items():
            plan = backend.compile([call])
            t = _time(backend, plan, reps, rounds)
            line = {"shape": name, "op": op, "N": N, "X": X, "K": K, "E": E, "M": M, "k": k,
                    "gflops": flops / t / 1e9}
            if matmul:
                tm = _time(backend, backend.compile([mm[op]]), reps, rounds)
                line["matmul_gflops"] = flops / tm / 1e9
            out.append(line)
    return out


def _baseline(lib: str, args) -> list[dict]:
    """The same lines (no matmul) with the extension lib in place of ours: a package tree of
    links to this checkout's files with lib as the extension, imported first."""
    import ggtrain
    root = pathlib.Path(ggtrain.__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="ggtrain-baseline-") as tmp:
        pkg = pathlib.Path(tmp) / "ggtrain"
        pkg.mkdir()
        for f in (root / "ggtrain").iterdir():
            (pkg / f.name).symlink_to(f)
        for sub in ("core", "cli", "formats"):
            (pkg / sub).symlink_to(root / sub)
        (pkg / "native").mkdir()
        for f in (root / "native").iterdir():
            if not f.name.startswith("_cpu"):
                (pkg / "native" / f.name).symlink_to(f)
        (pkg / "native" / pathlib.Path(lib).name).symlink_to(pathlib.Path(lib).resolve())
        env = dict(os.environ, PYTHONPATH=tmp)
        cmd = [sys.executable, str(HERE / "bench_moe_matmul.py"), "--json", "--threads", str(args.threads),
               "--tokens", str(args.tokens), "--reps", str(args.reps), "--rounds", str(args.rounds)]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tmp)
        return json.loads(res.stdout)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", help="another build's native/_cpu*.so to compare with")
    p.add_argument("--json", action="store_true", help="print the lines as JSON (no matmul, no peak)")
    args = p.parse_args()
    if args.json:
        print(json.dumps(lines(args.threads, args.tokens, args.reps, args.rounds, matmul=False)))
        return
    peak = Peak(args.threads)
    base = _baseline(args.baseline, args) if args.baseline else None
    ours = lines(args.threads, args.tokens, args.reps, args.rounds, matmul=True)
    peak.sample()
    print(f"routed-expert products, {args.tokens} tokens, {args.threads} threads; {peak.describe()}")
    head = f"{'shape':8} {'op':4} {'(N, X, K) x (E, M, K), k':28} {'ours':>7} {'matmul':>7} {'mm/ours':>7} {'peak':>5}"
    print(head + (f" {'before':>7} {'speedup':>7}" if base else ""))
    worst = 0.0
    for i, ln in enumerate(ours):
        ratio = ln["matmul_gflops"] / ln["gflops"]
        worst = max(worst, ratio)
        dims = f"({ln['N']}, {ln['X']}, {ln['K']}) x ({ln['E']}, {ln['M']}, {ln['K']}), {ln['k']}"
        s = (f"{ln['shape']:8} {ln['op']:4} {dims:28} {ln['gflops']:7.1f} {ln['matmul_gflops']:7.1f} "
             f"{ratio:7.2f} {peak.percent(ln['gflops']):4.0f}%")
        if base:
            s += f" {base[i]['gflops']:7.1f} {ln['gflops'] / base[i]['gflops']:6.1f}x"
        print(s)
    print(f"worst matmul/ours: {worst:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
