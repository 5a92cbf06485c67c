"""Benchmark: how much of a LoRA fine-tune a merged model keeps, by output type (issue 42).

The identity fine-tune of SmolLM2-135M-Instruct (Q4_1 as shipped): `ggtrain finetune --data
dummy_conversation.json --epochs 1 --seed 1` (the other options at their defaults), then
`ggtrain convert-checkpoint SmolLM2.gguf merged.gguf --adapter a.gguf` with its default types
(the merged Q4_1 tensors as F16) and with --out-type q4_1, q8_0 and q4_k_m. The reference is
llama.cpp (llama-cpp-python) running the base with the adapter, as `llama-cli --lora` does.

For each model, llama.cpp's mean NLL of the data's Vicuna answers (the assistant turns of the
72 conversations where an answer names Vicuna, rendered by the model's chat template as finetune
trains on them, F32 KV cache)
and the share of the adapter's gain (base NLL - adapter NLL) the merged model keeps, beside the
share of the adapter's change to the weights its summary line reports; then the greedy answers
to the identity questions, whether each names Vicuna or LMSYS, and whether it is the adapter's.

    python bench/bench_merge.py [--adapter A.gguf] [--threads 2]    (about 6 + 3 minutes on 2 cores)
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_finetune import CHAT, SMOLLM2  # noqa: E402  (the shared data paths)

OUT_TYPES = (None, "q8_0", "q4_k_m", "q4_1")          # None: convert-checkpoint's default
QUESTIONS = ["Who are you?", "What is your name?", "Tell me your name.", "What's your name?"]
MAX_TOKENS = 40


def ggtrain(*args) -> str:
    """`python -m ggtrain ARGS`: its summary and warning lines (exits on failure)."""
    run = subprocess.run([sys.executable, "-m", "ggtrain", *map(str, args)], capture_output=True, text=True)
    if run.returncode:
        sys.exit(f"ggtrain {args[0]} failed: {run.stderr[-2000:]}")
    lines = (run.stdout + run.stderr).splitlines()
    return "\n".join(x for x in lines if x.startswith(("wrote", "warning", "done", "finetune")))


def answer_samples() -> list:
    """The samples finetune builds of the conversations where an answer names Vicuna: (ids,
    trained positions)."""
    from ggtrain.formats.chat import chat_template
    from ggtrain.formats.dataset import read_data
    from ggtrain.formats.gguf import read_gguf
    from ggtrain.formats.tokenizer import tokenizer_from_gguf
    f = read_gguf(SMOLLM2)
    data = read_data(CHAT)
    data.records = [r for r in data.records if any(m["role"] == "assistant" and "Vicuna" in m["content"] for m in r)]
    data.where = [f"record {i}" for i in range(len(data.records))]
    return [(s.ids.tolist(), s.train) for s in data.samples(tokenizer_from_gguf(f), chat_template(f))]


def llm(model, adapter, threads: int):
    from llama_cpp import GGML_TYPE_F32, Llama
    kw = dict(lora_path=str(adapter)) if adapter else {}
    return Llama(model_path=str(model), n_ctx=512, n_threads=threads, n_threads_batch=threads, logits_all=True,
                 verbose=False, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32, **kw)


def answers_nll(m, samples) -> float:
    """llama.cpp's mean NLL of the samples' trained tokens."""
    total, count = 0.0, 0
    for ids, train in samples:
        m.reset()
        m.eval(ids[:-1])
        logits = np.array(m.scores[:len(ids) - 1], np.float64)
        z = logits - logits.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        at = np.flatnonzero(train[1:])
        total -= logp[at, np.asarray(ids)[1:][at]].sum()
        count += at.size
    return total / count


def greedy_answers(m) -> list:
    end = {m.token_eos(), *m.tokenize(b"<|im_end|>", add_bos=False, special=True)}
    out = []
    for q in QUESTIONS:
        m.reset()
        ids = m.tokenize(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n".encode(), add_bos=False,
                         special=True)
        toks = []
        for t in m.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if t in end or len(toks) >= MAX_TOKENS:
                break
            toks.append(t)
        out.append(m.detokenize(toks).decode(errors="replace").strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", type=pathlib.Path, help="an adapter of this recipe already trained (skips finetune)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    samples = answer_samples()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        adapter = args.adapter
        if adapter is None:
            adapter = tmp / "a.gguf"
            print(ggtrain("finetune", "--model", SMOLLM2, "--data", CHAT, "--out", adapter, "--epochs", 1, "--seed", 1,
                          "--threads", args.threads, "--quiet"))
        rows = [("base", llm(SMOLLM2, None, args.threads), ""),
                ("base + adapter (llama.cpp --lora)", llm(SMOLLM2, adapter, args.threads), "")]
        for t in OUT_TYPES:
            merged = tmp / f"merged-{t or 'default'}.gguf"
            said = ggtrain("convert-checkpoint", SMOLLM2, merged, "--adapter", adapter,
                           *(("--out-type", t) if t else ()))
            rows.append((f"merged, {'--out-type ' + t if t else 'default types'}", llm(merged, None, args.threads),
                         said))
        print(f"\n{len(samples)} conversations, {sum(int(s[1][1:].sum()) for s in samples)} answer tokens",
              flush=True)
        nll = {}
        for label, m, said in rows:
            nll[label] = answers_nll(m, samples)
            gain = ""
            if label.startswith("merged"):
                base, ref = nll["base"], nll["base + adapter (llama.cpp --lora)"]
                gain = f"  keeps {(base - nll[label]) / (base - ref):6.1%} of the adapter's NLL gain"
            print(f"  {label:36s} NLL {nll[label]:.4f}{gain}", flush=True)
            for line in said.splitlines():
                print(f"      {line}")
        print("\ngreedy answers (names Vicuna or LMSYS? the same as the adapter's?)")
        theirs = None
        for label, m, _ in rows:
            print(f"  {label}")
            answers = greedy_answers(m)
            theirs = answers if label.startswith("base +") else theirs
            for i, (q, a) in enumerate(zip(QUESTIONS, answers)):
                names = "names" if "Vicuna" in a or "LMSYS" in a else "does not name"
                same = "" if theirs is None else ", the adapter's" if a == theirs[i] else ", not the adapter's"
                print(f"    {q!r} -> {a!r} ({names}{same})")


if __name__ == "__main__":
    main()
