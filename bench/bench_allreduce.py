"""What data parallelism buys: the all-reduce of the flat gradient buffer against the step time.

For each llama config of bench_llama.py (and optionally SmolLM2-135M's shape, full training):
the time of one training update on one process (ggtrain, `--threads`), and the time of one
in-place MPI all-reduce (SUM, f32) of a buffer of the model's parameter count between 2
processes started by the `dp` extra's mpiexec on this machine (what `ggtrain train` does once
per update). From those two numbers, a model of the speed-up on N machines at a fixed
per-process batch (`--batch` is per process): ggtrain does the all-reduce after backward,
without overlapping it with compute, so

    time per update(N) = step + allreduce(N),   speed-up(N) = N * step / (step + allreduce(N))

with a ring all-reduce, allreduce(N) = 2 (N - 1) / N * bytes / bandwidth + 2 (N - 1) * latency.
bandwidth and latency are fitted to the measured 2-process times (a tiny and a full buffer;
shared memory here, so an upper bound for machines on a network); the table is repeated for
networks of the given Gbit/s (with 20 us latency per hop).

    python bench/bench_allreduce.py [--configs a,b] [--smollm] [--threads 2] [--gbps 10,100]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_llama import CONFIGS  # noqa: E402  (one list of bench configs)

SMOLLM2 = dict(vocab=49152, dim=576, layers=30, heads=9, kv_heads=3, ff=1536, ctx=256, batch=1)
NETWORK_LATENCY_S = 20e-6
MACHINES = (2, 4, 8, 16, 64)


def worker(counts: list, repeats: int) -> None:
    """Run under mpiexec: time an in-place all-reduce of each count of f32; rank 0 prints JSON."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    out = {}
    for n in counts:
        buf = np.ones(n, np.float32)
        times = []
        for i in range(repeats + 2):     # two warm-up rounds
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            times.append(time.perf_counter() - t0)
        out[n] = float(np.median(times[2:]))
    if comm.Get_rank() == 0:
        print(json.dumps(out))


def allreduce_times(counts: list, repeats: int) -> dict:
    exe = pathlib.Path(sys.executable).parent / "mpiexec"
    exe = str(exe) if exe.exists() else shutil.which("mpiexec")
    if exe is None:
        sys.exit("no mpiexec: install the dp extra (pip install -e '.[dp]')")
    r = subprocess.run([exe, "-n", "2", sys.executable, __file__, "--worker", ",".join(map(str, counts)),
                        "--repeats", str(repeats)], capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def step_time(cfg: dict, threads: int, steps: int) -> tuple:
    """(median seconds per update, parameter count) of ggtrain training cfg on one process."""
    from ggtrain.core.backend_cpu import CpuBackend
    from ggtrain.core.models.config import ModelConfig, init_params
    from ggtrain.core.train import TextConfig, TextRun

    model = ModelConfig(**{k: v for k, v in cfg.items() if k != "batch"})
    init = init_params(model, 0)
    n_params = sum(v.size for v in init.values())
    tc = TextConfig(steps=10**6, batch=cfg["batch"], lr=1e-3, lr_min=1e-3, warmup=0, weight_decay=0.1)
    run = TextRun(model, init, tc, CpuBackend(threads))
    rng = np.random.default_rng(0)
    times = []
    for _ in range(steps + 1):     # the first is a warm-up
        w = rng.integers(0, cfg["vocab"], (cfg["batch"], cfg["ctx"] + 1)).astype(np.int32)
        t0 = time.perf_counter()
        run.step.step([run.feed(w)], 1e-3)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[1:])), n_params


def ring(n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce of nbytes over n processes."""
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def table(step: float, nbytes: float, bandwidth: float, latency: float) -> str:
    cells = []
    for n in MACHINES:
        t = ring(n, nbytes, bandwidth, latency)
        cells.append(f"N={n}: {n * step / (step + t):.1f}x")
    return ", ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="a,b")
    ap.add_argument("--smollm", action="store_true", help="also SmolLM2-135M's shape (135M parameters)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--gbps", default="10,100", help="networks to model, Gbit/s")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker([int(c) for c in args.worker.split(",")], args.repeats)
        return
    configs = {k: CONFIGS[k] for k in args.configs.split(",") if k}
    if args.smollm:
        configs["smollm2-135m"] = SMOLLM2
    measured = {name: step_time(cfg, args.threads, args.steps) for name, cfg in configs.items()}
    counts = sorted({n for _, n in measured.values()})
    ar = allreduce_times([1] + counts, args.repeats)
    latency = ar[1] / 2                    # 2 processes: 2 (N - 1) = 2 latencies, no bytes to speak of
    print(f"all-reduce of the flat f32 gradient buffer, 2 processes on this machine (mpiexec); "
          f"{args.threads} threads per step; noisy on a shared machine")
    print(f"latency of a 4-byte all-reduce: {ar[1] * 1e6:.1f} us")
    for name, (step, n) in measured.items():
        nbytes = 4.0 * n
        t = ar[n]
        bandwidth = nbytes / max(t - 2 * latency, 1e-9)
        print(f"\nconfig {name}: {n / 1e6:.2f} M parameters ({nbytes / 2**20:.1f} MiB of gradients), "
              f"batch {configs[name]['batch']} x ctx {configs[name]['ctx']} per process")
        print(f"  step {step * 1e3:.1f} ms on one process; all-reduce {t * 1e3:.2f} ms "
              f"({100 * t / step:.1f}% of a step; {bandwidth / 1e9:.2f} GB/s fitted)")
        print(f"  {'speed-up at this link:':26s}{table(step, nbytes, bandwidth, latency)}")
        for g in (float(x) for x in args.gbps.split(",") if x):
            print(f"  {f'speed-up at {g:g} Gbit/s:':26s}{table(step, nbytes, g * 1e9 / 8, NETWORK_LATENCY_S)}")


if __name__ == "__main__":
    main()
