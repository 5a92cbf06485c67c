"""Peak memory of llama training with and without gradient checkpointing (one process each).

dim 256, 12 layers, 8 heads, ff 768, ctx 256, batch 8 (the llama issue's setting). Prints
the planner's predicted peak, the measured peak RSS, the ratio checkpointing/plain, and the
losses of the first steps (which must be identical).

    python bench/bench_memory.py [--steps 2]
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

CFG = dict(vocab=256, dim=256, layers=12, heads=8, kv_heads=8, ff=768, ctx=256)
BATCH = 8


def child(checkpointing: bool, steps: int) -> None:
    import numpy as np

    from ggtrain.core.backend_cpu import CpuBackend
    from ggtrain.core.models.llama import LlamaConfig, init_params
    from ggtrain.core.train import TextConfig, TextRun

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = LlamaConfig(**CFG)
    run = TextRun(model, init_params(model, 0), TextConfig(steps=10**6, batch=BATCH, checkpointing=checkpointing),
                  CpuBackend(2))
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        w = rng.integers(0, CFG["vocab"], (BATCH, CFG["ctx"] + 1)).astype(np.int32)
        losses.append(run.step.step([{run.tokens: w[:, :-1], run.targets: w[:, 1:]}], 1e-3))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_kib": peak, "import_kib": base, "planned": run.step.memory.peak, "losses": losses}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--child", choices=["on", "off"])
    args = ap.parse_args()
    if args.child:
        child(args.child == "on", args.steps)
        return
    res = {}
    for mode in ("off", "on"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--steps", str(args.steps)],
                             capture_output=True, text=True, check=True)
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"{'checkpointing':<14} {'planned MiB':>12} {'peak RSS MiB':>13}  losses")
    for mode in ("off", "on"):
        r = res[mode]
        print(f"{mode:<14} {r['planned'] / 2**20:>12.1f} {r['peak_kib'] / 1024:>13.1f}  {r['losses']}")
    print(f"ratio on/off: planned {res['on']['planned'] / res['off']['planned']:.2f}, "
          f"peak RSS {res['on']['peak_kib'] / res['off']['peak_kib']:.2f}; "
          f"losses identical: {res['on']['losses'] == res['off']['losses']}")


if __name__ == "__main__":
    main()
