"""Peak memory of llama training with and without gradient checkpointing (one process each).

Configs: "deep": dim 256, 12 layers, 8 heads, ff 768, ctx 256, batch 8 (the llama issue's
setting); "long": dim 256, 4 layers, 8 heads, ff 768, ctx 2048, batch 1 (issue 12: fused
attention keeps no T x T tensor), also run in PyTorch (bench_llama's model, fused SDPA, its
own process) for its peak RSS. Prints the planner's predicted peak, the measured peak RSS,
the ratios checkpointing/plain and ours/PyTorch, the losses of the first steps (which
must be identical with and without checkpointing), and the speed of the steps after the
first: tokens/s, the time ratio checkpointing/plain, and GFLOP/s (the graph's count,
recomputation included) as a percentage of the FP32 peak (bench/peak.py, same sitting).

    python bench/bench_memory.py [--steps 5] [--configs deep,long]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

CONFIGS = {
    "deep": (dict(vocab=256, dim=256, layers=12, heads=8, kv_heads=8, ff=768, ctx=256), 8),
    "long": (dict(vocab=256, dim=256, layers=4, heads=8, kv_heads=8, ff=768, ctx=2048), 1),
}
TORCH = ("long",)   # configs also measured in PyTorch


def child(config: str, checkpointing: bool, steps: int) -> None:
    import numpy as np

    from ggtrain.core.backend_cpu import CpuBackend
    from ggtrain.core.models.config import ModelConfig, init_params
    from ggtrain.core.train import TextConfig, TextRun

    cfg, batch = CONFIGS[config]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = ModelConfig(**cfg)
    run = TextRun(model, init_params(model, 0), TextConfig(steps=10**6, batch=batch, checkpointing=checkpointing),
                  CpuBackend(2))
    rng = np.random.default_rng(0)
    losses, times = [], []
    for _ in range(steps):
        w = rng.integers(0, cfg["vocab"], (batch, cfg["ctx"] + 1)).astype(np.int32)
        t0 = time.perf_counter()
        losses.append(run.step.step([run.feed(w)], 1e-3))
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_kib": peak, "import_kib": base, "planned": run.step.memory.peak, "losses": losses,
                      "step_s": min(times[1:] or times), "flop_per_token": run.flop_per_token()}))


def torch_peak(config: str, checkpointing: bool, steps: int, tmp: str) -> int:
    """PyTorch's peak RSS (KiB) training the same model (bench_llama's script)."""
    import numpy as np

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from bench_llama import TorchSide

    from ggtrain.core.models.config import ModelConfig, init_params

    cfg, batch = CONFIGS[config]
    init = init_params(ModelConfig(**cfg), 0)
    windows = np.random.default_rng(0).integers(0, cfg["vocab"], (steps, batch, cfg["ctx"] + 1)).astype(np.int32)
    side = TorchSide(dict(cfg, batch=batch), init, windows, 2, checkpointing, tmp)
    for s in range(steps):
        side.step(s)
    peak = side.peak_kib()
    side.close()
    return peak


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5,
                    help="steps per side (the first is not timed; the best of the rest)")
    ap.add_argument("--configs", default="deep,long")
    ap.add_argument("--child", choices=["on", "off"])
    ap.add_argument("--config", choices=list(CONFIGS), default="deep")
    args = ap.parse_args()
    if args.child:
        child(args.config, args.child == "on", args.steps)
        return
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from peak import Peak
    peak = Peak(2)
    for config in args.configs.split(","):
        cfg, batch = CONFIGS[config]
        print(f"{config}: dim {cfg['dim']}, {cfg['layers']} layers, ctx {cfg['ctx']}, batch {batch}")
        res, torch = {}, {}
        for mode in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--config", config, "--steps",
                                  str(args.steps)], capture_output=True, text=True, check=True)
            res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            peak.sample()
            if config in TORCH:
                with tempfile.TemporaryDirectory() as tmp:
                    torch[mode] = torch_peak(config, mode == "on", args.steps, tmp)
        tokens = batch * cfg["ctx"]
        print(f"{'checkpointing':<14} {'planned MiB':>12} {'peak RSS MiB':>13} {'torch MiB':>10} {'ratio':>6} "
              f"{'tokens/s':>9} {'GFLOP/s':>8} {'%peak':>6}  losses")
        for mode in ("off", "on"):
            r = res[mode]
            t = f"{torch[mode] / 1024:>10.1f} {r['peak_kib'] / torch[mode]:>6.2f}" if mode in torch else f"{'':>17}"
            gf = r["flop_per_token"] * tokens / r["step_s"] / 1e9
            print(f"{mode:<14} {r['planned'] / 2**20:>12.1f} {r['peak_kib'] / 1024:>13.1f} {t} "
                  f"{tokens / r['step_s']:>9.0f} {gf:>8.1f} {peak.percent(gf):>5.0f}%  {r['losses']}")
        print(f"ratio on/off: planned {res['on']['planned'] / res['off']['planned']:.2f}, "
              f"peak RSS {res['on']['peak_kib'] / res['off']['peak_kib']:.2f}, "
              f"step time {res['on']['step_s'] / res['off']['step_s']:.2f}; "
              f"losses identical: {res['on']['losses'] == res['off']['losses']}", flush=True)
    print(peak.describe())


if __name__ == "__main__":
    main()
