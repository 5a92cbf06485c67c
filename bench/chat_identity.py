"""Reference: what one epoch of LoRA on the Vicuna identity chat data teaches Gemma 3 270M, by
`ggtrain finetune` and by Hugging Face transformers + PEFT with the same recipe (issue 19).

Ours: `ggtrain finetune --model gemma-3-270m-q4_k_m.gguf --data dummy_conversation.json
--chat-template google-gemma-2-2b-it.jinja --epochs 1` (every other option at its default),
then llama.cpp (llama-cpp-python) with the adapter, greedy. Theirs: PEFT on the f32
dequantization of the same GGUF with ggtrain's defaults (rank 16, alpha 32, the seven
projections, AdamW at cli/finetune.py's LR_LORA, decay 0.01, clip 1, linear warmup over 5% of
the updates, cosine to a tenth of the rate, the conversations shuffled and grouped into updates
of up to --ctx tokens, the loss on the model's turns), then transformers' greedy answer.

Each side prints, for each identity question of the data, the greedy answer, whether it names
Vicuna, and the three likeliest first tokens at each of the answer's first steps, so where the
two differ and where the answer is a near-tie can be read off.

    python bench/chat_identity.py [--threads 2] [--no-theirs]     (about 3 + 9 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))    # tests/real_models.py fetches Gemma 3 270M
from bench_finetune import CHAT, SHARED  # noqa: E402  (the chat data bench_finetune trains on)
from torch_venv import ensure_torch  # noqa: E402

TEMPLATE = SHARED / "templates" / "google-gemma-2-2b-it.jinja"
QUESTIONS = ["Who are you?", "What is your name?", "Tell me your name.", "What's your name?"]
TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"     # the template's turn format
STEPS_SHOWN, MAX_TOKENS = 8, 48

_THEIRS = r"""
import json, math, os, random, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from peft import LoraConfig, get_peft_model
path, data, threads, ctx, lr, questions, turn, shown, max_tokens = sys.argv[1:10]
threads, ctx, lr, shown, max_tokens = int(threads), int(ctx), float(lr), int(shown), int(max_tokens)
questions = json.loads(questions)
torch.set_num_threads(threads); torch.manual_seed(0); random.seed(0)
d, f = os.path.split(path)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
bos, eot = tok.convert_tokens_to_ids("<bos>"), tok.convert_tokens_to_ids("<end_of_turn>")
enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
samples = []
for rec in json.load(open(data)):
    ids, lab = [bos], [-100]
    for t in rec["conversations"]:
        x = enc(turn.format(t["value"])) if t["from"] == "human" else enc(t["value"] + "<end_of_turn>\n")
        ids += x
        lab += [-100] * len(x) if t["from"] == "human" else x
    samples.append((ids, lab))
random.shuffle(samples)
updates, cur, n = [], [], 0
for s in samples:
    if cur and n + len(s[0]) > ctx:
        updates.append(cur); cur, n = [], 0
    cur.append(s); n += len(s[0])
updates.append(cur)
warm = max(1, round(0.05 * len(updates)))
def rate(i):
    if i < warm:
        return lr * (i + 1) / warm
    p = (i - warm) / max(1, len(updates) - warm)
    return lr / 10 + 0.5 * (lr - lr / 10) * (1 + math.cos(math.pi * p))
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
model.train()
for i, u in enumerate(updates):
    L = max(len(s[0]) for s in u)
    x = torch.tensor([s[0] + [0] * (L - len(s[0])) for s in u])
    y = torch.tensor([s[1] + [-100] * (L - len(s[1])) for s in u])
    m = torch.tensor([[1] * len(s[0]) + [0] * (L - len(s[0])) for s in u])
    for g in opt.param_groups:
        g["lr"] = rate(i)
    loss = model(input_ids=x, attention_mask=m, labels=y).loss
    loss.backward(); torch.nn.utils.clip_grad_norm_(params, 1.0); opt.step(); opt.zero_grad()
    print(f"update {i + 1}/{len(updates)} loss {float(loss):.4f}", file=sys.stderr, flush=True)
model.eval()
res = []
for q in questions:
    ids, out, top = torch.tensor([[bos] + enc(turn.format(q))]), [], []
    with torch.no_grad():
        for k in range(max_tokens):
            p = torch.softmax(model(input_ids=ids).logits[0, -1].double(), -1)
            v, j = torch.topk(p, 3)
            if k < shown:
                top.append([(tok.decode([int(a)]), float(b)) for b, a in zip(v, j)])
            if int(j[0]) in (eot, tok.eos_token_id):
                break
            out.append(int(j[0])); ids = torch.cat([ids, j[:1].view(1, 1)], 1)
    res.append({"question": q, "answer": tok.decode(out), "top": top})
print(json.dumps({"updates": len(updates), "loss": float(loss), "answers": res}))
"""


def ours(model: pathlib.Path, threads: int) -> dict:
    """`ggtrain finetune ... --epochs 1`, then llama.cpp with the adapter, greedy."""
    import numpy as np
    from llama_cpp import Llama
    with tempfile.TemporaryDirectory() as tmp:
        adapter = pathlib.Path(tmp) / "a.gguf"
        run = subprocess.run([sys.executable, "-m", "ggtrain", "finetune", "--model", str(model), "--data", str(CHAT),
                              "--chat-template", str(TEMPLATE), "--out", str(adapter), "--epochs", "1",
                              "--threads", str(threads), "--quiet"], capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"ggtrain finetune failed: {run.stderr[-2000:]}")
        llm = Llama(model_path=str(model), lora_path=str(adapter), n_ctx=256, n_threads=threads, logits_all=True,
                    verbose=False)
        res = []
        for q in QUESTIONS:
            llm.reset()
            llm.eval(llm.tokenize(("<bos>" + TURN.format(q)).encode(), add_bos=False, special=True))
            out, top = [], []
            end = {llm.token_eos(), *llm.tokenize(b"<end_of_turn>", add_bos=False, special=True)}
            for k in range(MAX_TOKENS):
                lg = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
                p = np.exp(lg - lg.max())
                p /= p.sum()
                j = np.argsort(-p)[:3]
                if k < STEPS_SHOWN:
                    top.append([(llm.detokenize([int(a)]).decode(errors="replace"), float(p[a])) for a in j])
                if int(j[0]) in end:
                    break
                out.append(int(j[0]))
                llm.eval([int(j[0])])
            res.append({"question": q, "answer": llm.detokenize(out).decode(errors="replace"), "top": top})
    return {"answers": res}


def theirs(model: pathlib.Path, threads: int, ctx: int, lr: float) -> dict:
    py = ensure_torch()
    if subprocess.run([str(py), "-c", "import transformers, peft, gguf"], capture_output=True).returncode:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "transformers", "peft", "gguf"], check=True)
    run = subprocess.run([str(py), "-c", _THEIRS, str(model), str(CHAT), str(threads), str(ctx), str(lr),
                          json.dumps(QUESTIONS), TURN, str(STEPS_SHOWN), str(MAX_TOKENS)],
                         capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"transformers + PEFT run failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def show(title: str, res: dict) -> None:
    print(f"\n{title}")
    for a in res["answers"]:
        print(f"  {a['question']!r} -> {a['answer']!r} ({'names' if 'Vicuna' in a['answer'] else 'does not name'} "
              f"Vicuna)")
        print("    " + " | ".join(" ".join(f"{t!r} {p:.2f}" for t, p in step) for step in a["top"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-theirs", action="store_true", help="ours only")
    args = ap.parse_args()
    from ggtrain.cli.finetune import LR_LORA
    from tests.real_models import gemma3_270m_path
    model = gemma3_270m_path()
    show("ggtrain finetune --epochs 1, then llama.cpp with the adapter (greedy)", ours(model, args.threads))
    if not args.no_theirs:
        r = theirs(model, args.threads, 512, LR_LORA)
        show(f"transformers + PEFT, the same recipe ({r['updates']} updates, last loss {r['loss']:.3f}; greedy)", r)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
