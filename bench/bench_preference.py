"""Benchmark and real run: preference tuning (DPO, ORPO) of SmolLM2-135M-Instruct (Q4_1) on
pairs built from the Vicuna identity data, ggtrain against TRL's DPOTrainer + PEFT (the
tool a user would run instead) on the same pairs, in the same sitting.

Pairs: for each conversation of ../shared/data/chat/dummy_conversation.json, its first user
turn is the prompt (conversational form), the Vicuna answer the chosen side, and the base
model's own greedy answer (ggtrain's KV decoder, the model's chat template, at most 64
tokens) the rejected side; built once into ~/.cache/ggtrain (GGTRAIN_CACHE).

Ours: `ggtrain finetune --method dpo|orpo` (and dpo with --rpo-alpha 1), LoRA r 16 / alpha 32 on the seven projections,
--val-split 0.1 (held-back pairs), packed windows of --ctx 512, batch 1, one epoch by
default, lr 5e-5 (DPO) / 2e-4 (DPO + RPO) / 5e-4 (ORPO). Checks (issue 22): the preference accuracy on the held-back pairs is above
0.9; real llama.cpp (llama-cpp-python) with the adapter prefers the chosen answer of the
held-back pairs (summed log-probabilities) and its greedy answers to them say what the chosen
side says (Vicuna, LMSYS).

Theirs: TRL's DPOTrainer with a PEFT LoRA of the same shape on transformers' f32
dequantization of the same GGUF (the reference: the model with the adapter disabled),
beta 0.1, batch 1 pair per step, DPO's lr, on the same training pairs rendered by the same
chat template; tokens/s counts the pairs' real tokens (prompt + both answers, no padding)
per second, the median step after two warm-up steps; peak RSS from wait4 of each process.

    python bench/bench_preference.py [--threads 2] [--epochs 1] [--trl-steps 30] [--no-trl]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_generate import _measured  # noqa: E402  (fork + wait4: peak RSS of one child)
from peak import Peak  # noqa: E402
from torch_venv import ensure_torch  # noqa: E402

SHARED = HERE.parents[1] / "shared" / "data"
SMOLLM2 = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT = SHARED / "chat" / "dummy_conversation.json"
CACHE = pathlib.Path(os.environ.get("GGTRAIN_CACHE", pathlib.Path.home() / ".cache" / "ggtrain"))
RANK, ALPHA, CTX, BETA, VAL, SEED = 16, 32, 512, 0.1, 0.1, 0
# DPO moves a LoRA far with finetune's SFT rate (5e-4: the rejected answers' log-probabilities
# fall by ~200 nats and the answers degenerate); 5e-5 is in the range TRL's LoRA examples use.
# ORPO's SFT term keeps the chosen answers likely: the SFT rate.
# DPO + RPO (--rpo-alpha 1: the chosen answers' SFT loss added) between the two.
LR = {"dpo": 5e-5, "dpo-rpo": 2e-4, "orpo": 5e-4}
METHOD_ARGS = {"dpo": ["--method", "dpo"], "dpo-rpo": ["--method", "dpo", "--rpo-alpha", "1"],
               "orpo": ["--method", "orpo"]}
SAYS = ("Vicuna", "LMSYS")    # who the chosen answers say is answering


def build_pairs(threads: int) -> pathlib.Path:
    """The pairs file (JSON lines, TRL's conversational form), built once."""
    path = CACHE / "smollm2-identity-pairs.jsonl"
    if path.exists():
        return path
    from ggtrain.core.backend_cpu import CpuBackend
    from ggtrain.core.models.inference import Decoder, generate
    from ggtrain.core.models.config import ModelConfig
    from ggtrain.core.sampling import Sampler
    from ggtrain.formats.chat import chat_template
    from ggtrain.formats.dataset import chat_prompt
    from ggtrain.formats.gguf import read_gguf
    from ggtrain.formats.model_file import open_model

    be = CpuBackend(threads)
    config, weights, tok = open_model(SMOLLM2, be)
    template = chat_template(read_gguf(SMOLLM2), None)
    decoder = Decoder(ModelConfig(**config), weights, be, n_ctx=256)
    stop = frozenset(tok.eog_ids)
    lines, answers = [], {}
    records = json.loads(CHAT.read_text())
    for k, rec in enumerate(records):
        turns = rec["conversations"]
        question, chosen = turns[0]["value"], turns[1]["value"]
        if question not in answers:    # the same question asked again: the same greedy answer
            prompt = [{"role": "user", "content": question}]
            ids = chat_prompt(prompt, tok, template).tolist()
            out = []
            for t in generate(decoder, ids, 64, Sampler(temp=0.0), stop):
                if t in stop:
                    break
                out.append(t)
            answers[question] = tok.decode(out).strip()
        rejected = answers[question]
        if rejected == chosen:
            continue
        lines.append(json.dumps({"prompt": [{"role": "user", "content": question}],
                                 "chosen": [{"role": "assistant", "content": chosen}],
                                 "rejected": [{"role": "assistant", "content": rejected}]}))
        print(f"\rpairs: {k + 1}/{len(records)} ({len(answers)} greedy answers)", end="", file=sys.stderr)
    print(file=sys.stderr)
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    return path


def ours(method: str, pairs: pathlib.Path, epochs: float, threads: int, out: pathlib.Path) -> dict:
    """A ggtrain run (a fresh process): its done record, speed and peak RSS."""
    log = out.with_suffix(".jsonl")
    cmd = [sys.executable, "-m", "ggtrain", "finetune", "--model", str(SMOLLM2), "--data", str(pairs),
           "--out", str(out), *METHOD_ARGS[method], "--epochs", str(epochs), "--ctx", str(CTX), "--batch", "1",
           "--lora-rank", str(RANK), "--lora-alpha", str(ALPHA), "--lr", str(LR[method]), "--beta", str(BETA),
           "--val-split", str(VAL), "--seed", str(SEED), "--threads", str(threads), "--log", str(log), "--quiet"]
    _, err, rc, rss = _measured(cmd)
    if rc != 0:
        sys.exit(f"ggtrain finetune --method {method} failed: {err[-2000:]}")
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    steps = [x for x in lines if "tokens_per_s" in x]
    done = lines[-1]
    # the share of a window's positions that hold a token (the run's packing summary)
    m = re.search(r"(\d+) trained of (\d+) tokens in (\d+) windows", err)
    fill = int(m.group(2)) / (int(m.group(3)) * CTX)
    window = statistics.median(x["tokens_per_s"] for x in steps[2:])
    return {"done": done, "rss_mib": rss, "first": steps[0], "last": steps[-1], "fill": fill,
            "window_tokens_per_s": window, "tokens_per_s": window * fill, "updates": len(steps),
            "elapsed_s": done["elapsed_s"], "flop_per_token": lines[1].get("flop_per_token")}


def held_back(pairs: pathlib.Path) -> list:
    """The pairs --val-split held back (the same seeded draw as finetune's)."""
    from ggtrain.core.data import split_samples
    records = [json.loads(x) for x in pairs.read_text().splitlines() if x.strip()]
    _, val = split_samples(records, VAL, SEED)
    return val


def llama_cpp_check(adapter: pathlib.Path, val: list) -> dict:
    """llama.cpp with the adapter on the held-back pairs: the fraction whose chosen answer
    it finds more likely, and the fraction of its greedy answers that say what the chosen
    side says (name Vicuna or LMSYS, of the pairs whose chosen answer does)."""
    import llama_cpp
    from ggtrain.formats.chat import chat_template
    from ggtrain.formats.dataset import chat_prompt
    from ggtrain.formats.gguf import read_gguf
    from ggtrain.formats.model_file import load_model

    _, _, tok = load_model(SMOLLM2)
    template = chat_template(read_gguf(SMOLLM2), None)
    llm = llama_cpp.Llama(model_path=str(SMOLLM2), lora_path=str(adapter), n_ctx=512, n_threads=2,
                          n_threads_batch=2, logits_all=True, verbose=False, seed=0)

    def logp(prompt_ids, answer):
        full = chat_prompt(prompt_ids, tok, template).tolist()
        ids = tok.encode(answer + "<|im_end|>", parse_special=True).tolist()
        llm.reset()
        llm.eval(full + ids)
        s = np.array(llm.scores[:len(full) + len(ids)], np.float64)
        s -= s.max(-1, keepdims=True)
        lp = s - np.log(np.exp(s).sum(-1, keepdims=True))
        return sum(lp[len(full) - 1 + j, t] for j, t in enumerate(ids))

    prefer, named, naming = 0, 0, 0
    for rec in val:
        c, r = rec["chosen"][0]["content"], rec["rejected"][0]["content"]
        prefer += logp(rec["prompt"], c) > logp(rec["prompt"], r)
        if any(w in c for w in SAYS):
            naming += 1
            ids = chat_prompt(rec["prompt"], tok, template).tolist()
            llm.reset()
            out = []
            for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                if t in tok.eog_ids or len(out) >= 48:
                    break
                out.append(t)
            named += any(w in tok.decode(out) for w in SAYS)
    return {"prefer": prefer / len(val), "named": named / max(1, naming), "naming": naming}


_TRL = r"""
import json, os, sys, time
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer
path, data, steps, threads, lr, beta, rank, alpha, val_split, seed = sys.argv[1:11]
torch.set_num_threads(int(threads))
torch.manual_seed(0)
d, f = os.path.split(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
# transformers' Trainer refuses a model loaded from GGUF as "quantized", though its weights are
# the f32 dequantization: drop the marker
model.hf_quantizer = None
model.is_quantized = False
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
records = [json.loads(x) for x in open(data) if x.strip()]
held = set(json.loads(sys.argv[11]))
train = Dataset.from_list([r for i, r in enumerate(records) if i not in held])
times, tokens = [], []
class Timer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.t = time.perf_counter()
    def on_step_end(self, args, state, control, **kw):
        times.append(time.perf_counter() - self.t)
cfg = DPOConfig(output_dir=os.environ["TRL_OUT"], per_device_train_batch_size=1, max_steps=int(steps),
                learning_rate=float(lr), beta=float(beta), max_length=512, logging_steps=1, report_to="none",
                use_cpu=True, save_strategy="no", lr_scheduler_type="constant", seed=int(seed),
                dataloader_num_workers=0)
peft = LoraConfig(r=int(rank), lora_alpha=int(alpha), lora_dropout=0.0, task_type="CAUSAL_LM",
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
trainer = DPOTrainer(model=model, args=cfg, train_dataset=train, processing_class=tok, peft_config=peft,
                     callbacks=[Timer()])
ds = trainer.train_dataset
for i in range(int(steps)):   # the order of a seeded sampler is not ours to know: a step's pair, on average
    row = ds[i % len(ds)]
    tokens.append(2 * len(row["prompt_ids"]) + len(row["chosen_ids"]) + len(row["rejected_ids"]))
mean_tokens = sum(tokens) / len(tokens)
tokens = [mean_tokens] * len(tokens)
trainer.train()
print(json.dumps({"step_s": times, "tokens": tokens, "log": trainer.state.log_history[-2:]}))
"""


def theirs(pairs: pathlib.Path, steps: int, threads: int, held: list) -> dict:
    py = ensure_torch()
    if subprocess.run([str(py), "-c", "import trl, peft, transformers, gguf, datasets"], capture_output=True).returncode:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "trl", "transformers", "peft", "gguf", "datasets"],
                       check=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRL_OUT"] = tmp
        out, err, rc, rss = _measured([str(py), "-c", _TRL, str(SMOLLM2), str(pairs), str(steps), str(threads),
                                       str(LR["dpo"]), str(BETA), str(RANK), str(ALPHA), str(VAL), str(SEED),
                                       json.dumps(held)])
    if rc != 0:
        sys.exit(f"TRL DPOTrainer run failed: {err[-3000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    res["rss_mib"] = rss
    rates = [n / s for n, s in zip(res["tokens"][2:], res["step_s"][2:])]
    res["tokens_per_s"] = statistics.median(rates)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--trl-steps", type=int, default=30)
    ap.add_argument("--no-trl", action="store_true")
    ap.add_argument("--methods", default="dpo,dpo-rpo,orpo", help="of dpo, dpo-rpo (--rpo-alpha 1), orpo")
    args = ap.parse_args()
    peak = Peak(args.threads)
    pairs = build_pairs(args.threads)
    val = held_back(pairs)
    records = [json.loads(x) for x in pairs.read_text().splitlines() if x.strip()]
    print(f"{len(records)} pairs from {CHAT.name} ({len(val)} held back); {peak.describe()}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for method in filter(None, args.methods.split(",")):
            adapter = pathlib.Path(tmp) / f"{method}.gguf"
            r = ours(method, pairs, args.epochs, args.threads, adapter)
            peak.sample()
            check = llama_cpp_check(adapter, val)
            results[method] = r
            d = r["done"]
            gf = (r["flop_per_token"] or 0) * r["window_tokens_per_s"] / 1e9
            print(f"ours {method}: {r['updates']} updates in {r['elapsed_s']:.0f} s, {r['tokens_per_s']:.0f} pair "
                  f"tokens/s ({r['window_tokens_per_s']:.0f} window positions/s, {100 * r['fill']:.0f}% filled; "
                  f"{gf:.0f} GFLOP/s = {peak.percent(gf):.0f}% of peak), peak RSS {r['rss_mib']:.0f} MiB; loss "
                  f"{r['first']['loss']:.4f} -> {r['last']['loss']:.4f}; held-back pairs: preference accuracy "
                  f"{d['val_rewards_accuracy']:.3f} (target > 0.9), reward margin {d['val_rewards_margin']:.3f}; "
                  f"llama.cpp with the adapter prefers the chosen answer on {check['prefer']:.3f} of them and "
                  f"says Vicuna/LMSYS in {check['named']:.3f} of its greedy answers where the chosen does "
                  f"({check['naming']})")
    if not args.no_trl:
        from ggtrain.core.data import split_samples
        idx = list(range(len(records)))
        held = split_samples(idx, VAL, SEED)[1]
        t = theirs(pairs, args.trl_steps, args.threads, held)
        peak.sample()
        r = results.get("dpo")
        print(f"TRL DPOTrainer + PEFT (f32): {t['tokens_per_s']:.0f} pair tokens/s (median of "
              f"{len(t['step_s']) - 2} steps), peak RSS {t['rss_mib']:.0f} MiB")
        if r is not None:
            print(f"ratio ours/TRL: {r['tokens_per_s'] / t['tokens_per_s']:.2f}x pair tokens/s, "
                  f"{r['rss_mib'] / t['rss_mib']:.2f}x peak RSS")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
