"""Benchmark: loading a ~1 GB GGUF model into backend buffers.

Generates a llama-layout F32 model of about --size-mb MiB in a temporary directory
(streamed by our writer, never whole in memory), then measures, with the file in
the page cache:
  * wall time of `ggtrain` metadata parsing + load_tensors (all tensors, CPU
    backend) vs `cat FILE > /dev/null` of the same file (the reference);
  * peak RSS of the loading process minus its RSS before loading vs the tensor
    bytes (target <= 1.1: no second copy of the file).
Each load runs in a fresh process so its peak RSS is its own. The generated file
is deleted at the end.

    python bench/bench_load.py [--size-mb 1024] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from ggtrain.core.models.config import ModelConfig
from ggtrain.formats import model as layouts
from ggtrain.formats.gguf import write_gguf

_CHILD = r"""
import json, resource, sys, time
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.formats.gguf import read_gguf

def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])

backend = CpuBackend(1)
base = rss_kib()
t0 = time.perf_counter()
f = read_gguf(sys.argv[1])
t1 = time.perf_counter()
loaded = f.load_tensors(None, backend)
t2 = time.perf_counter()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss      # KiB on Linux
print(json.dumps({"meta_s": t1 - t0, "load_s": t2 - t0, "base_kib": base, "peak_kib": peak,
                  "tensor_bytes": f.tensor_bytes, "n": len(loaded)}))
"""


def _hparams(size_mb: int) -> ModelConfig:
    """llama hparams whose F32 weights come to about size_mb MiB."""
    n_embd, n_ff, n_vocab = 1024, 2816, 32000
    per_layer = 4 * (4 * n_embd * n_embd + 3 * n_embd * n_ff + 2 * n_embd)
    fixed = 4 * (2 * n_vocab * n_embd + n_embd)
    n_layer = max(1, round((size_mb * 2**20 - fixed) / per_layer))
    return ModelConfig(vocab=n_vocab, dim=n_embd, layers=n_layer, heads=16, kv_heads=16, ff=n_ff, ctx=2048)


def generate(path: str, size_mb: int) -> None:
    hp = _hparams(size_mb)
    rng = np.random.default_rng(0)
    noise = rng.standard_normal(1 << 20).astype(np.float32)

    def data(shape):
        n = int(np.prod(shape))
        return lambda: np.resize(noise, n).reshape(shape)

    tensors = [(name, data(shape), "F32", shape) for name, shape in layouts.tensor_shapes(hp).items()]
    write_gguf(path, layouts.config_to_kv(hp, "bench"), tensors)


def time_cat(path: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(f"cat '{path}' > /dev/null", shell=True, check=True)
    return time.perf_counter() - t0


def time_load(path: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, path], check=True, capture_output=True, text=True)
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to put the generated file (default: a temp dir)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_load_") as tmp:
        path = os.path.join(tmp, "model.gguf")
        t0 = time.perf_counter()
        generate(path, args.size_mb)
        size = os.path.getsize(path)
        print(f"generated {size / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f} s: {path}")
        time_cat(path)                                   # warm the page cache
        cats, loads = [], []
        for _ in range(args.repeat):
            cats.append(time_cat(path))
            loads.append(time_load(path))
        cat_s = min(cats)
        best = min(loads, key=lambda r: r["load_s"])
        extra = (max(r["peak_kib"] for r in loads) - best["base_kib"]) * 1024
        tb = best["tensor_bytes"]
        print(f"cat > /dev/null      : {cat_s:.3f} s  ({size / cat_s / 2**30:.2f} GiB/s)")
        print(f"read_gguf (metadata) : {best['meta_s'] * 1000:.1f} ms")
        print(f"read_gguf+load_tensors: {best['load_s']:.3f} s  ({tb / best['load_s'] / 2**30:.2f} GiB/s), "
              f"{best['n']} tensors")
        print(f"ratio load / cat     : {best['load_s'] / cat_s:.2f}x")
        print(f"peak RSS - baseline  : {extra / 2**20:.0f} MiB for {tb / 2**20:.0f} MiB of tensors "
              f"= {extra / tb:.3f}x (target <= 1.1x); baseline {best['base_kib'] / 1024:.0f} MiB")
    print("generated file deleted")


if __name__ == "__main__":
    main()
