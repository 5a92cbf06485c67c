"""Benchmark: a big plain-text corpus, tokenized as a stream into the token cache, then trained
on (issue 23): speed, memory, and how soon a second run starts.

The corpus: real lines (../shared/data/text/tinyshakespeare.txt and the turns of
../shared/data/chat/dummy_conversation.json) shuffled with a fixed seed until it has --mb
megabytes, written once into $GGTRAIN_CACHE/bench (default ~/.cache/ggtrain).

Lines, each in its own process, in one sitting:
- whole: the path before the stream (read the whole file, encode it in one call through
  `tokenizers`, the ids as one array), on the first --whole-mb megabytes: MB/s, peak RSS;
- stream, cold: `corpus_tokens` (SmolLM2's tokenizer, an empty cache): MB/s, peak memory of
  the process and its workers (the sum of their proportional set sizes, sampled every 0.1 s,
  so shared pages count once), against the token file's size;
- stream, warm: the same call again (a cache hit): seconds;
- finetune / train: `ggtrain finetune --model SmolLM2 --data CORPUS --steps 2` and `ggtrain
  train --tokenizer byte --steps 2` on the cached tokens: seconds to the end of the run, peak
  memory against token file + model + planned memory (the issue's bound: 1.2x).

Chat records (--records 100000, the Vicuna conversations of dummy_conversation.json repeated):
the path before (read the file, render, tokenize and mask every conversation in one process)
against `ggtrain finetune --data RECORDS --steps 1` with an empty token cache (samples made by
worker processes and kept), then again (the samples read from the cache): seconds, peak memory;
then the same records as one Parquet file (row groups of 1000, as Hugging Face datasets writes
them) with an empty cache: seconds, peak memory.

    python bench/bench_corpus.py [--mb 1024] [--whole-mb 100] [--records 100000] [--only text|chat]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared" / "data"
SMOLLM2 = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = pathlib.Path(os.environ.get("GGTRAIN_CACHE", pathlib.Path.home() / ".cache" / "ggtrain"))


def make_corpus(mb: int) -> pathlib.Path:
    path = CACHE / "bench" / f"corpus-{mb}mb.txt"
    if path.exists() and path.stat().st_size >= mb << 20:
        return path
    lines = (SHARED / "text" / "tinyshakespeare.txt").read_text().split("\n")
    for conv in json.loads((SHARED / "chat" / "dummy_conversation.json").read_text()):
        lines += [t["value"].replace("\n", " ") for t in conv["conversations"]]
    rng = random.Random(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    size = 0
    with open(tmp, "w", encoding="utf-8") as f:
        while size < mb << 20:
            rng.shuffle(lines)
            chunk = "\n".join(lines) + "\n"
            f.write(chunk)
            size += len(chunk.encode("utf-8"))
    os.replace(tmp, path)
    return path


def _tree(pid: int) -> list:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _pss_mib(pids: list) -> float:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                m = re.search(r"^Pss:\s+(\d+) kB", f.read(), re.M)
                total += int(m.group(1)) if m else 0
        except OSError:
            pass
    return total / 1024


def measured(cmd: list, env: dict | None = None) -> dict:
    """Run cmd: wall seconds, peak PSS of its process tree (MiB), stdout, stderr."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    peak = [0.0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], _pss_mib(_tree(proc.pid)))
            time.sleep(0.1)
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    out, err = proc.communicate()
    t.join()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{err[-3000:]}")
    return {"s": time.perf_counter() - t0, "peak_mib": peak[0], "out": out, "err": err}


WHOLE = """
import json, sys, time
from ggtrain.formats.tokenizer import tokenizer_from_gguf
tok = tokenizer_from_gguf(sys.argv[1]); tok._fast = None      # the path before: tokenizers alone
raw = open(sys.argv[2], 'rb').read(int(sys.argv[3]))
t = time.perf_counter()
ids = tok.encode(raw.decode('utf-8', errors='surrogateescape'), add_bos=True)
print(json.dumps({"encode_s": time.perf_counter() - t, "tokens": len(ids)}))
"""

STREAM = """
import json, sys, time
from ggtrain.formats.corpus import corpus_tokens
from ggtrain.formats.tokenizer import tokenizer_from_gguf
tok = tokenizer_from_gguf(sys.argv[1])
t = time.perf_counter()
got = corpus_tokens(sys.argv[2], tok, add_bos=tok.add_bos, cache_dir=sys.argv[3])   # as finetune reads it
print(json.dumps({"s": time.perf_counter() - t, "tokens": len(got.ids), "cached": got.cached,
                  "file_mib": len(got.ids) * 4 / 2**20}))
"""


SAMPLES = """
import json, sys, time
from ggtrain.formats.chat import chat_template
from ggtrain.formats.dataset import read_data
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.tokenizer import tokenizer_from_gguf
model = read_gguf(sys.argv[1]); tok = tokenizer_from_gguf(model); template = chat_template(model)
t = time.perf_counter()
data = read_data(sys.argv[2]); got = data.samples(tok, template)
print(json.dumps({"s": time.perf_counter() - t, "samples": len(got)}))
"""


def make_records(n: int) -> pathlib.Path:
    path = CACHE / "bench" / f"chat-{n}.jsonl"
    if not path.exists():
        convs = json.loads((SHARED / "chat" / "dummy_conversation.json").read_text())
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(json.dumps({"conversations": convs[i % len(convs)]["conversations"]}) + "\n")
        os.replace(tmp, path)
    return path


def make_parquet(n: int) -> pathlib.Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = CACHE / "bench" / f"chat-{n}.parquet"
    if not path.exists():
        convs = json.loads((SHARED / "chat" / "dummy_conversation.json").read_text())
        rows = [{"conversations": convs[i % len(convs)]["conversations"]} for i in range(n)]
        tmp = path.with_suffix(".tmp")
        pq.write_table(pa.Table.from_pylist(rows), tmp, row_group_size=1000)
        os.replace(tmp, path)
    return path


def chat(n: int, threads: int) -> None:
    records = make_records(n)
    py = sys.executable
    before = measured([py, "-c", SAMPLES, str(SMOLLM2), str(records)])
    br = json.loads(before["out"])
    print(f"{n:,} chat records ({records.stat().st_size / 1e6:.0f} MB): the path before (one process) "
          f"{br['s']:.1f} s, peak {before['peak_mib']:.0f} MiB")
    cache = tempfile.mkdtemp(prefix="ggtrain-bench-samples-")
    env = {"GGTRAIN_TOKEN_CACHE": cache}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [py, "-m", "ggtrain", "finetune", "--model", str(SMOLLM2), "--data", str(records),
               "--out", f"{tmp}/a.gguf", "--steps", "1", "--ctx", "512", "--batch", "1", "--quiet",
               "--threads", str(threads)]
        cold = measured(cmd, env)
        warm = measured(cmd, env)
    plan = float(re.search(r"planned memory ([\d.]+) MiB", warm["err"]).group(1))
    model = SMOLLM2.stat().st_size / 2**20
    kept = pathlib.Path(cache)
    tokens = sum(f.stat().st_size for f in kept.iterdir() if f.suffix in (".tokens", ".train")) / 2**20
    rows = sum(f.stat().st_size for f in kept.glob("*.rows")) / 2**20
    bound = tokens + model + plan
    parquet = make_parquet(n)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [py, "-m", "ggtrain", "finetune", "--model", str(SMOLLM2), "--data", str(parquet),
               "--out", f"{tmp}/a.gguf", "--steps", "1", "--ctx", "512", "--batch", "1", "--quiet",
               "--threads", str(threads)]
        pcold = measured(cmd, {"GGTRAIN_TOKEN_CACHE": tempfile.mkdtemp(prefix="ggtrain-bench-samples-")})
    print(f"the same records in Parquet ({parquet.stat().st_size / 1e6:.0f} MB), finetune --steps 1 with an "
          f"empty cache: {pcold['s']:.1f} s, peak {pcold['peak_mib']:.0f} MiB")
    print(f"finetune --steps 1, samples made by workers and kept: {cold['s']:.1f} s, peak {cold['peak_mib']:.0f} "
          f"MiB = {cold['peak_mib'] / bound:.2f}x; again, samples and packed rows from the cache: {warm['s']:.1f} s, "
          f"peak {warm['peak_mib']:.0f} MiB = {warm['peak_mib'] / bound:.2f}x (the bound: token files {tokens:.0f} + "
          f"model {model:.0f} + plan {plan:.0f} MiB; packed rows kept: {rows:.0f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--whole-mb", type=int, default=100)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--only", choices=["text", "chat"])
    args = ap.parse_args()
    if not SMOLLM2.exists():
        sys.exit(f"{SMOLLM2} is not there (../shared/data)")
    if args.only != "text":
        chat(args.records, args.threads)
    if args.only == "chat":
        return
    corpus = make_corpus(args.mb)
    mb = corpus.stat().st_size / 1e6
    cache = tempfile.mkdtemp(prefix="ggtrain-bench-tokens-")
    py = sys.executable
    print(f"corpus {corpus} ({mb:.0f} MB), SmolLM2's tokenizer, {args.threads} cores; token cache {cache}")

    whole_bytes = min(args.whole_mb << 20, corpus.stat().st_size)
    w = measured([py, "-c", WHOLE, str(SMOLLM2), str(corpus), str(whole_bytes)])
    wr = json.loads(w["out"])
    whole_rate = whole_bytes / 1e6 / wr["encode_s"]
    print(f"whole text, tokenizers alone ({whole_bytes / 1e6:.0f} MB): {whole_rate:.2f} MB/s, "
          f"peak {w['peak_mib']:.0f} MiB ({w['peak_mib'] * 2**20 / whole_bytes:.1f}x the text)")

    cold = measured([py, "-c", STREAM, str(SMOLLM2), str(corpus), cache])
    cr = json.loads(cold["out"])
    rate = mb / cr["s"]
    print(f"stream, cold: {rate:.2f} MB/s ({cr['s']:.1f} s, {cr['tokens']:,} tokens); peak "
          f"{cold['peak_mib']:.0f} MiB = {cold['peak_mib'] / cr['file_mib']:.2f}x the token file "
          f"({cr['file_mib']:.0f} MiB); {rate / whole_rate:.2f}x the whole-text path's speed")
    warm = measured([py, "-c", STREAM, str(SMOLLM2), str(corpus), cache])
    wm = json.loads(warm["out"])
    assert wm["cached"], "the second call did not find the cache"
    print(f"stream, warm (cached): {wm['s']:.2f} s in the call, {warm['s']:.2f} s with Python's start")

    env = {"GGTRAIN_TOKEN_CACHE": cache}
    with tempfile.TemporaryDirectory() as tmp:
        ft = measured([py, "-m", "ggtrain", "finetune", "--model", str(SMOLLM2), "--data", str(corpus),
                       "--out", f"{tmp}/a.gguf", "--steps", "2", "--ctx", "256", "--batch", "1", "--quiet",
                       "--threads", str(args.threads)], env)
        plan = float(re.search(r"planned memory ([\d.]+) MiB", ft["err"]).group(1))
        model = SMOLLM2.stat().st_size / 2**20
        bound = cr["file_mib"] + model + plan
        print(f"finetune (cached tokens, 2 steps): {ft['s']:.1f} s; peak {ft['peak_mib']:.0f} MiB = "
              f"{ft['peak_mib'] / bound:.2f}x (token file {cr['file_mib']:.0f} + model {model:.0f} + "
              f"plan {plan:.0f} MiB)")
        tr_cold = measured([py, "-m", "ggtrain", "train", "--data", str(corpus), "--out", f"{tmp}/b.gguf",
                            "--steps", "2", "--quiet", "--threads", str(args.threads)], env)
        tr = measured([py, "-m", "ggtrain", "train", "--data", str(corpus), "--out", f"{tmp}/b.gguf",
                       "--steps", "2", "--quiet", "--threads", str(args.threads)], env)
        plan = float(re.search(r"planned memory ([\d.]+) MiB", tr["err"]).group(1))
        file_mib = sum(f.stat().st_size for f in pathlib.Path(cache).glob("*.tokens")) / 2**20 - cr["file_mib"]
        bound = file_mib + plan
        print(f"train --tokenizer byte: tokenizing + 2 steps {tr_cold['s']:.1f} s (peak "
              f"{tr_cold['peak_mib']:.0f} MiB), again from the cache {tr['s']:.1f} s; peak {tr['peak_mib']:.0f} MiB "
              f"= {tr['peak_mib'] / bound:.2f}x (token file {file_mib:.0f} + plan {plan:.0f} MiB)")


if __name__ == "__main__":
    main()
