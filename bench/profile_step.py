"""Per-node time of one training update (in-plan profiling), grouped by kernel and shapes.

    python bench/profile_step.py [fc|cnn|llama-a|llama-b|llama-c|llama-d|smollm2|gemma] [threads] [--ckpt]

MNIST: a 1000-image update of two 500-image micro-batches. llama-X: bench_llama.py's
config X, one update (checkpointing with --ckpt). smollm2, gemma: one LoRA update as
bench_finetune.py runs it (r 16, all targets, AdamW, checkpointing; SmolLM2 Q4_1 ctx 256
batch 4, Gemma 3 270M Q4_K_M ctx 512 batch 2) on random token windows."""
import collections
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from ggtrain.core.backend_cpu import CpuBackend  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
arch = args[0] if args else "cnn"
nt = int(args[1]) if len(args) > 1 else 2
ckpt = "--ckpt" in sys.argv
be = CpuBackend(nt)
if arch.startswith("llama-"):
    from bench_llama import CONFIGS
    from ggtrain.core.models.config import ModelConfig, init_params
    from ggtrain.core.train import TextConfig, TextRun
    cfg = CONFIGS[arch[6:]]
    model = ModelConfig(**{k: v for k, v in cfg.items() if k != "batch"})
    run = TextRun(model, init_params(model, 0), TextConfig(steps=10**6, batch=cfg["batch"], lr=1e-3, warmup=0,
                                                           checkpointing=ckpt), be)
    w = np.random.default_rng(0).integers(0, cfg["vocab"], (cfg["batch"], cfg["ctx"] + 1)).astype(np.int32)
    feed = [run.feed(w)]
    per_epoch, unit = None, "update"
elif arch in ("smollm2", "gemma"):
    from bench_finetune import SMOLLM2
    from ggtrain.core.models.config import ModelConfig
    from ggtrain.core.models.lora import LoraConfig, init_lora
    from ggtrain.core.train import TextConfig, TextRun
    from ggtrain.formats.model_file import open_model
    if arch == "gemma":
        sys.path.insert(1, str(pathlib.Path(__file__).resolve().parents[1]))
        from tests.real_models import gemma3_270m_path
        path, ctx, batch = gemma3_270m_path(), 512, 2
    else:
        path, ctx, batch = SMOLLM2, 256, 4
    hp, weights, _ = open_model(path, be)
    model = ModelConfig(**hp)
    lora = LoraConfig(rank=16, alpha=32)
    names = lora.weights(model)
    run = TextRun(model, init_lora(lora, {w: weights[w].shape for w in names}, 0),
                  TextConfig(steps=10**6, batch=batch, lr=2e-4, warmup=0, weight_decay=0.01, grad_clip=1.0),
                  be, frozen=weights, lora=lora, ctx=ctx)
    w = np.random.default_rng(0).integers(0, model.vocab, (batch, ctx + 1)).astype(np.int32)
    feed = [run.feed(w)]
    per_epoch, unit = None, "update"
else:
    from ggtrain.core.models import mnist as model
    from ggtrain.core.train_classifier import ClassifierConfig, ClassifierRun
    run = ClassifierRun(lambda p, t: model.forward(arch, p, t), model.init_params(arch, 0), (28, 28),
                        ClassifierConfig(epochs=1), be)
    x = np.random.rand(500, 28, 28).astype(np.float32)
    y = np.random.randint(0, 10, 500).astype(np.int32)
    feed = [{run.x: x, run.y: y}] * 2
    per_epoch = 57
st = run.step
st.step(feed, 1e-3)
plans = [p for p in (st._micro, st._update) if p is not None]
for plan in plans:
    plan.plan.profile()
N = 5
t = time.perf_counter()
for _ in range(N):
    st.step(feed, 1e-3)
step = (time.perf_counter() - t) / N
tot = collections.Counter()
kern = collections.Counter()
fl = collections.Counter()
cnt = collections.Counter()
for plan in plans:
    for call, sec in zip(plan.plan.calls, plan.plan.node_seconds()):
        shapes = ", ".join("x".join(map(str, s.shape)) + ("T" if len(s.strides) > 1 and s.strides[-1] != 1 else "")
                           for s in call.srcs)
        key = f"{call.kernel} {'x'.join(map(str, call.dst.shape))} <- {shapes}"
        tot[key] += sec / N
        cnt[key] += 1
        if call.kernel.startswith("matmul"):     # (matmul_lora: the adapter's r columns too)
            fl[key] += 2 * int(np.prod(call.dst.shape)) * sum(s.shape[-1] for s in call.srcs[0:3:2])
        elif call.kernel.startswith("linear_cross_entropy"):   # the logits, and with grad (ip[1]) dx
            (n, c), v = call.srcs[0].shape, call.srcs[1].shape[0]
            fl[key] += 2 * n * v * c * (1 + bool(call.ip[1]))
        kern[call.kernel] += sec / N
print(f"full update: {step * 1e3:.1f} ms" + (f"  -> epoch {step * per_epoch:.2f} s" if per_epoch else "")
      + f"; sum of nodes {sum(tot.values()) * 1e3:.1f} ms; {st.flops / step / 1e9:.1f} GFLOP/s")
print("by kernel:")
for k, v in kern.most_common(12):
    print(f"{v * 1e3:8.2f} ms {100 * v / step:5.1f}%  {k}")
print("by node:")
for k, v in tot.most_common(25):
    rate = f"{fl[k] / v / 1e9:6.1f} GF/s" if fl[k] else " " * 11
    print(f"{v * 1e3:8.2f} ms {rate} x{cnt[k]:<3} {k}")
