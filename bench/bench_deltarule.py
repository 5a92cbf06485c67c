"""delta_rule forward + backward, row by row against the chunked form, on a Qwen3.5-0.8B-like
gated DeltaNet layer (16 K and 16 V heads of 128, B = 1) over T = 512 .. 2048 rows.

Each line times the graph o = delta_rule(q, k, v, g, beta); grads of sum(o * go) in q, k, v,
g, beta (the forward and delta_rule_bwd), best of --reps runs, both forms in the same sitting,
and prints their ratio and each one's speed as a fraction of the machine's FP32 peak
(bench/peak.py, measured now and sampled again between the lines). The FLOPs counted are the
recurrence's own, the same for both forms: per row and V head the three Dk x Dv products
(S^T k, the rank-1 update, S^T q) forward, 6 Dk Dv, and twice that backward, 12 Dk Dv. The
outputs of the two forms are compared too (max difference over the largest value).

    python bench/bench_deltarule.py [--threads 2] [--lengths 512,1024,2048] [--heads 16 --dim 128]
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peak import Peak  # noqa: E402


def _plan(backend, arrays, go, chunked):
    g = Graph()
    ts = [g.param(a.shape, a) for a in arrays]
    out = ops.delta_rule(*ts, chunked=chunked)
    grads = backward(ops.sum(ops.mul(out, g.const(go))), ts, checkpointing=False)
    rt = Runtime(g, backend)
    plan = rt.compile([out] + [grads[t] for t in ts])
    return rt, plan, [out] + [grads[t] for t in ts]


def _best(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_line(backend, peak, t, hk, hv, d, reps, rng):
    q = rng.normal(size=(1, t, hk, d)).astype(np.float32)
    k = rng.normal(size=(1, t, hk, d))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)
    v = rng.normal(size=(1, t, hv, d)).astype(np.float32)
    g = -np.log1p(np.exp(rng.normal(0.0, 1.0, (1, t, hv)))).astype(np.float32) * 0.5   # -softplus: decays < 1
    beta = (1 / (1 + np.exp(-rng.normal(size=(1, t, hv))))).astype(np.float32)
    go = rng.normal(size=v.shape).astype(np.float32)
    flops = 18.0 * t * hv * d * d
    res = {}
    for chunked in (False, True):
        rt, plan, outs = _plan(backend, [q, k, v, g, beta], go, chunked)
        rt.run(plan)                                  # warm
        peak.sample()
        res[chunked] = _best(lambda: rt.run(plan), reps), [plan.read(o) for o in outs]
    (ts, outs_s), (tc, outs_c) = res[False], res[True]
    diff = max(float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) for a, b in zip(outs_s, outs_c))
    gs, gc = flops / ts / 1e9, flops / tc / 1e9
    print(f"T={t:5d} Hk={hk} Hv={hv} d={d}: stepwise {ts * 1e3:8.1f} ms ({peak.percent(gs):4.1f}% of peak)  "
          f"chunked {tc * 1e3:8.1f} ms ({peak.percent(gc):4.1f}% of peak)  stepwise/chunked {ts / tc:5.2f}x  "
          f"max rel diff {diff:.1e}", flush=True)
    return ts / tc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="512,1024,2048")
    ap.add_argument("--heads", type=int, default=16, help="V heads (K heads: --k-heads)")
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    peak = Peak(args.threads)
    print(peak.describe(), flush=True)
    backend = CpuBackend(args.threads)
    rng = np.random.default_rng(0)
    for t in (int(x) for x in args.lengths.split(",")):
        bench_line(backend, peak, t, args.k_heads, args.heads, args.dim, args.reps, rng)


if __name__ == "__main__":
    main()
