"""Llama training speed: ggtrain vs an equivalent PyTorch CPU model, measured in one run.

Same architecture (RMSNorm, RoPE on adjacent pairs, causal attention, SwiGLU, untied
output), same initial weights (ours, copied into PyTorch), same batches, AdamW with
weight decay 0.1 on matrices and global-norm clipping 1.0, 2 threads. PyTorch runs in
its own venv (bench/.venv-torch, torch==2.13.0; never a ggtrain dependency).
Prints tokens/s and the ratio ours/PyTorch (higher is better), with gradient
checkpointing off and on (torch.utils.checkpoint per block on the PyTorch side), our
GFLOP/s (the graph's count of an update's products, recomputation included) as a
percentage of the FP32 peak measured in the same sitting (bench/peak.py, sampled between
the steps), and on the checkpointing lines what it costs: our step time with it over
without. The two sides alternate step by step (PyTorch in a process that stays up, one
step per command), so that a noisy moment of a shared machine hits both; step times are
each side's best of the timed steps, as in bench_mnist and bench_matmul.

    python bench/bench_llama.py [--steps 8] [--threads 2] [--configs a,b,c,d]

Configs c and d are long contexts (2048 and 4096 tokens, batch 1), where attention dominates
(fused on both sides).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peak import Peak  # noqa: E402
from torch_venv import TorchProcess  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
# a side's idle threads spin a while after its step (PyTorch's pool, ours): let them sleep
_SPIN_S = 0.2
CONFIGS = {
    "a": dict(vocab=256, dim=256, layers=4, heads=8, kv_heads=8, ff=768, ctx=128, batch=8),
    "b": dict(vocab=256, dim=512, layers=8, heads=8, kv_heads=8, ff=1376, ctx=256, batch=4),
    "c": dict(vocab=256, dim=256, layers=4, heads=8, kv_heads=8, ff=768, ctx=2048, batch=1),   # long context
    "d": dict(vocab=256, dim=256, layers=4, heads=8, kv_heads=8, ff=768, ctx=4096, batch=1),   # longer
}

TORCH_SCRIPT = r"""
import json, sys, time, math, resource
import numpy as np, torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint as ckpt
a = json.loads(sys.argv[1])
torch.set_num_threads(a["threads"])
d = np.load(a["data"])
c = a["config"]; C, H, Hkv, L = c["dim"], c["heads"], c["kv_heads"], c["layers"]; D = C // H
P = {k[2:]: torch.nn.Parameter(torch.from_numpy(d[k].copy())) for k in d.files if k.startswith("w:")}
windows = torch.from_numpy(d["windows"]).long()
T = c["ctx"]
i = torch.arange(D // 2, dtype=torch.float64)
theta = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * i / D)
cos, sin = torch.cos(theta).float()[None, :, None, :], torch.sin(theta).float()[None, :, None, :]

def rms(x, w):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w

def rope(x):
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)

def block(x, l):
    p = f"blk.{l}."
    b, t, _ = x.shape
    h = rms(x, P[p + "attn_norm.weight"])
    q = rope((h @ P[p + "attn_q.weight"].T).view(b, t, H, D)).transpose(1, 2)
    k = rope((h @ P[p + "attn_k.weight"].T).view(b, t, Hkv, D)).transpose(1, 2)
    v = (h @ P[p + "attn_v.weight"].T).view(b, t, Hkv, D).transpose(1, 2)
    if Hkv != H:
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, C)
    x = x + o @ P[p + "attn_output.weight"].T
    h = rms(x, P[p + "ffn_norm.weight"])
    return x + (F.silu(h @ P[p + "ffn_gate.weight"].T) * (h @ P[p + "ffn_up.weight"].T)) @ P[p + "ffn_down.weight"].T

def loss_fn(w):
    x = P["token_embd.weight"][w[:, :-1]]
    for l in range(L):
        x = ckpt(block, x, l, use_reentrant=False) if a["checkpointing"] else block(x, l)
    logits = rms(x, P["output_norm.weight"]) @ P["output.weight"].T
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))

decay = [p for n, p in P.items() if p.ndim >= 2]; rest = [p for n, p in P.items() if p.ndim < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                        lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
print("ready", flush=True)
for line in sys.stdin:  # one timed step per command: the index of its window (or "peak": peak RSS)
    if line.strip() == "peak":
        print(json.dumps({"peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}), flush=True)
        continue
    s = int(line)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    loss = loss_fn(windows[s])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
    opt.step()
    print(json.dumps({"time": time.perf_counter() - t0, "loss": float(loss.detach())}), flush=True)
"""


class OursSide:
    """Our TextRun for a config, set up once; one timed step per call."""

    def __init__(self, cfg: dict, init: dict, windows: np.ndarray, threads: int, checkpointing: bool):
        from ggtrain.core.backend_cpu import CpuBackend
        from ggtrain.core.models.config import ModelConfig
        from ggtrain.core.train import TextConfig, TextRun

        model = ModelConfig(**{k: v for k, v in cfg.items() if k != "batch"})
        tc = TextConfig(steps=10**6, batch=cfg["batch"], lr=1e-3, lr_min=1e-3, warmup=0, weight_decay=0.1,
                        grad_clip=1.0, checkpointing=checkpointing)
        self.run = TextRun(model, init, tc, CpuBackend(threads))
        self.windows = windows

    def step(self, s: int) -> tuple:
        w, run = self.windows[s], self.run
        t0 = time.perf_counter()
        loss = run.step.step([run.feed(w)], 1e-3)
        return time.perf_counter() - t0, loss

    def close(self):
        self.run = None


class TorchSide(TorchProcess):
    """The PyTorch process for a config, set up once; one timed step per call."""

    def __init__(self, cfg, init, windows, threads, checkpointing, tmp):
        path = os.path.join(tmp, "data.npz")
        np.savez(path, windows=windows, **{f"w:{k}": v for k, v in init.items()})
        super().__init__(TORCH_SCRIPT, {"threads": threads, "data": path, "config": cfg,
                                        "checkpointing": checkpointing}, threads)

    def step(self, s: int) -> tuple:
        out = self.ask(str(s))
        return out["time"], out["loss"]

    def peak_kib(self) -> int:
        """This process's peak RSS so far (KiB)."""
        return self.ask("peak")["peak_kib"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="a,b,c,d", help=f"comma-separated, of {','.join(CONFIGS)}")
    args = ap.parse_args()
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        ap.error(f"--configs: unknown {','.join(unknown)} (configs: {','.join(CONFIGS)})")
    from ggtrain.core.models.config import ModelConfig, init_params

    peak = Peak(args.threads)
    print(f"{'config':<7} {'ckpt':<5} {'ours tok/s':>11} {'torch tok/s':>12} {'ratio':>6} {'GFLOP/s':>8} "
          f"{'%peak':>6} {'ckpt cost':>9}  first losses ours / torch")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs.split(","):
            cfg = CONFIGS[name]
            model = ModelConfig(**{k: v for k, v in cfg.items() if k != "batch"})
            init = init_params(model, 0)
            rng = np.random.default_rng(0)
            windows = rng.integers(0, cfg["vocab"], (args.steps + 2, cfg["batch"], cfg["ctx"] + 1)).astype(np.int32)
            tokens = cfg["batch"] * cfg["ctx"]
            t_off = None
            for checkpointing in (False, True):
                ours = OursSide(cfg, init, windows, args.threads, checkpointing)
                theirs = TorchSide(cfg, init, windows, args.threads, checkpointing, tmp)
                times = {"ours": [], "torch": []}
                losses = {"ours": [], "torch": []}
                for s in range(len(windows)):   # step by step, alternating: a noisy moment hits both
                    for side, runner in (("ours", ours), ("torch", theirs)):
                        time.sleep(_SPIN_S)      # the other side's idle threads stop spinning
                        t, loss = runner.step(s)
                        times[side].append(t)
                        losses[side].append(loss)
                    if s % 3 == 2:
                        peak.sample()
                theirs.close()
                t_ours = float(np.min(times["ours"][2:]))
                t_torch = float(np.min(times["torch"][2:]))
                gf = ours.run.flop_per_token() * tokens / t_ours / 1e9
                ours.close()
                cost = f"{t_ours / t_off:>8.2f}x" if checkpointing else " " * 9
                t_off = t_off or t_ours
                print(f"{name:<7} {'on' if checkpointing else 'off':<5} {tokens / t_ours:>11.0f} "
                      f"{tokens / t_torch:>12.0f} {t_torch / t_ours:>6.2f} {gf:>8.1f} {peak.percent(gf):>5.0f}% "
                      f"{cost}  {losses['ours'][0]:.4f} / {losses['torch'][0]:.4f}", flush=True)
    print(peak.describe())


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
