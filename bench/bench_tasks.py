"""Benchmark: multiple-choice scoring (`eval --task`) against llama.cpp on the same items: items/s,
and the largest difference of a choice's log-likelihood between the two.

Three ways to score, alternated in rounds on one HellaSwag-format file, each best of the rounds:
- ours, batched: `core.tasks.score_items`, what `eval --task` runs (every choice of many items
  packed into the rows of one plan);
- ours, item by item: `core.tasks.score_item` through the KV-cached decoder (the shared prefix fed
  once, each choice continued from it; what `eval --task` ran before, and runs for --numerics llama);
- llama.cpp (llama-cpp-python): each choice as one batch of its tokens (reset, eval, its logits),
  as a user scores with its Python API, the same threads.

The file: `--task FILE` (llama-perplexity's HellaSwag format: 6 lines an item), else one made
from the bundled tiny shakespeare text in that format (a 40-word context, the true 20-word
continuation and three others drawn from elsewhere), so the suite's data is all it needs.

    python bench/bench_tasks.py [--model PATH] [--task FILE] [--items 40] [--threads 2] [--rounds 2]
                                [--filing-day DIR]

--filing-day DIR: a built checkout of the commit issue 42 was filed on, whose `eval --task` scored
item by item (`git worktree add DIR d13d9a3 && cd DIR && python setup.py build_ext --inplace`):
its core.tasks.score_item runs on the same items in a child process (its own ggtrain imported
from DIR), alternated in the rounds with the others, timed inside the child.

Default model: SmolLM2-135M-Instruct Q4_1 from ../shared/data. Target (issue 42): ours batched
>= 3x the items/s of the day the issue was filed (measured with --filing-day; without it, the
proxy: that day's path ran at 2x llama.cpp, so >= 6x llama.cpp), >= 4x llama.cpp, with equal
per-choice log-likelihoods (to rounding). Speed is also
printed as a fraction of the machine's FP32 peak (bench/peak.py), counting 2 FLOPs per weight of
the blocks' products and the head for every choice token (what llama.cpp computes; the batched
path's shared prefixes, fed once, show as speed).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# llama.cpp's OpenMP threads spin while idle: on a machine doing other work (or running our side
# between its calls) they cost it most of its speed, so they wait passively here, as in the tests
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from peak import Peak  # noqa: E402
SHARED = HERE.parents[1] / "shared" / "data"
SMOLLM2 = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = HERE.parent / "cli" / "data" / "tinyshakespeare.txt"


def make_hellaswag(path: pathlib.Path, n: int, seed: int = 0) -> None:
    """n items in llama-perplexity's HellaSwag format from the tiny shakespeare text."""
    words = TEXT.read_text(encoding="utf-8").split()
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        o = int(rng.integers(0, len(words) - 100))
        gold = int(rng.integers(0, 4))
        ends = [" ".join(words[p:p + 20]) for p in rng.integers(0, len(words) - 30, 4)]
        ends[gold] = " ".join(words[o + 40:o + 60])
        lines += ["Scene: " + " ".join(words[o:o + 40]), str(gold)] + ends
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


# the filing day's scoring, in a child process importing ggtrain from that checkout
_FILING_CHILD = r"""
import json, os, pathlib, sys, tempfile, time
root = pathlib.Path(tempfile.mkdtemp())
(root / "ggtrain").mkdir()     # a package whose modules are the checkout's (its root has no __init__)
(root / "ggtrain" / "__init__.py").write_text(f"__path__ = [{str(pathlib.Path(sys.argv[1]).resolve())!r}]")
sys.path.insert(0, str(root))
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.inference import Decoder
from ggtrain.core.tasks import score_item
from ggtrain.formats.model_file import open_model
from ggtrain.formats.tasks import encode_items, read_task
assert pathlib.Path(sys.modules["ggtrain.core.tasks"].__file__).resolve().is_relative_to(pathlib.Path(sys.argv[1]).resolve())
be = CpuBackend(int(sys.argv[5]))
config, weights, tok = open_model(sys.argv[2], be)
cfg = ModelConfig(**config)
encoded = encode_items(tok, read_task(sys.argv[3], "hellaswag")[:int(sys.argv[4])])
best, out = float("inf"), None
for _ in range(int(sys.argv[7])):
    t0 = time.perf_counter()
    dec = Decoder(cfg, weights, be, n_ctx=int(sys.argv[6]))
    out = [score_item(dec, c, g) for c, g in encoded]
    best = min(best, time.perf_counter() - t0)
print(json.dumps({"seconds": best, "logliks": [list(s.logliks) for s in out]}))
"""


def _filing_day(checkout: pathlib.Path, model, task, items: int, threads: int, n_ctx: int) -> tuple:
    """(seconds, per-item log-likelihoods) of the filing day's item-by-item scoring."""
    import json
    import subprocess
    r = subprocess.run([sys.executable, "-c", _FILING_CHILD, str(checkout), str(model), str(task), str(items),
                        str(threads), str(n_ctx), "1"], capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"--filing-day {checkout}: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["seconds"], out["logliks"]


def _theirs(llm, encoded) -> tuple:
    out = []
    t0 = time.perf_counter()
    for choices, _ in encoded:
        lls = []
        for c, t, _ in choices:
            ids = [int(x) for x in c] + [int(x) for x in t]
            llm.reset()
            llm.eval(ids)
            s = np.array(llm.scores[:len(ids)], np.float64)
            s -= s.max(-1, keepdims=True)
            lp = s - np.log(np.exp(s).sum(-1, keepdims=True))
            lls.append(float(sum(lp[len(c) - 1 + j, int(x)] for j, x in enumerate(t))))
        out.append(lls)
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=pathlib.Path, default=SMOLLM2)
    ap.add_argument("--task", type=pathlib.Path, default=None)
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--filing-day", type=pathlib.Path, default=None,
                    help="a built checkout of the commit issue 42 was filed on (d13d9a3)")
    args = ap.parse_args()
    if not args.model.exists():
        sys.exit(f"{args.model}: no such model (the default lives in ../shared/data)")
    import llama_cpp

    from ggtrain.core.backend_cpu import CpuBackend
    from ggtrain.core.models.config import ModelConfig
    from ggtrain.core.models.inference import Decoder
    from ggtrain.core.numerics import LLAMA
    from ggtrain.core.tasks import score_item, score_items, summarize
    from ggtrain.formats.model_file import open_model
    from ggtrain.formats.tasks import encode_items, read_task

    task = args.task
    if task is None:
        task = pathlib.Path(tempfile.mkdtemp()) / "hellaswag.txt"
        make_hellaswag(task, args.items)
    items = read_task(task, "hellaswag")[:args.items]
    be = CpuBackend(args.threads)
    config, weights, tok = open_model(args.model, be)
    cfg = ModelConfig(**config)
    encoded = encode_items(tok, items)
    n_ctx = min(cfg.ctx, 512)
    llm = llama_cpp.Llama(model_path=str(args.model), n_ctx=n_ctx, n_threads=args.threads,
                          n_threads_batch=args.threads, logits_all=True, verbose=False, seed=0)
    tokens = sum(len(c) + len(t) - 1 for choices, _ in encoded for c, t, _ in choices)
    from ggtrain.core.models.config import param_shapes
    from ggtrain.core.models.decoder import head_name
    shapes = param_shapes(cfg)
    weights_n = sum(int(np.prod(s)) for n, s in shapes.items() if n.startswith("blk.") and len(s) >= 2)
    weights_n += int(np.prod(shapes[head_name(cfg)]))
    flops = 2.0 * weights_n * tokens
    # the items' own work: each item's tree (shared prefix once, then each choice's rest) through
    # the blocks, each continuation token through the head: what no way of scoring can skip
    from ggtrain.core.tasks import _Item
    head_n = int(np.prod(shapes[head_name(cfg)]))
    own = sum(2.0 * (weights_n - head_n) * _Item(choices, True).tree + 2.0 * head_n * sum(len(t) for _, t, _ in choices)
              for choices, _ in encoded)
    peak = Peak(args.threads)
    print(f"{args.model.name}, {len(items)} items, {tokens} choice tokens, {args.threads} threads, "
          f"{args.rounds} rounds alternated")
    best = {"batched": float("inf"), "item by item": float("inf"), "llama.cpp": float("inf")}
    if args.filing_day:
        best["filing day"] = float("inf")
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        batched = score_items(cfg, weights, be, encoded, n_ctx=n_ctx)
        best["batched"] = min(best["batched"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        dec = Decoder(cfg, weights, be, n_ctx=n_ctx)
        one = [score_item(dec, c, g) for c, g in encoded]
        best["item by item"] = min(best["item by item"], time.perf_counter() - t0)
        theirs, dt = _theirs(llm, encoded)
        best["llama.cpp"] = min(best["llama.cpp"], dt)
        if args.filing_day:
            dt, filed = _filing_day(args.filing_day, args.model, task, len(items), args.threads, n_ctx)
            best["filing day"] = min(best["filing day"], dt)
        peak.sample()
    rate = {k: len(items) / v for k, v in best.items()}
    print(f"  {peak.describe()}; {flops / 1e9:.1f} GFLOP counted")
    for k in best:
        gf = flops / best[k] / 1e9
        print(f"  {k:<13} {rate[k]:7.2f} items/s  ({best[k]:.2f} s, {gf:6.1f} GFLOP/s, {peak.percent(gf):4.1f}% of peak)")
    print(f"  batched / item by item: {rate['batched'] / rate['item by item']:.2f}x; "
          f"batched / llama.cpp: {rate['batched'] / rate['llama.cpp']:.2f}x (filing day: item by item at 2x "
          f"llama.cpp, so {rate['batched'] / rate['llama.cpp'] / 2:.2f}x that day's items/s)")
    fastest = peak.gflops * 1e9 / own * len(items)
    print(f"  the items' own work (prefixes once, the head on continuation tokens): {own / 1e9:.1f} GFLOP; at the "
          f"peak, {fastest:.2f} items/s at most; batched computes it at {peak.percent(own / best['batched'] / 1e9):.0f}% "
          f"of peak" + (f", the filing day at {peak.percent(own / best['filing day'] / 1e9):.0f}% (3x it needs "
                        f"{3 * peak.percent(own / best['filing day'] / 1e9):.0f}%)" if args.filing_day else ""))
    if args.filing_day:
        d_filed = max(abs(a - b) for s, o in zip(batched, filed) for a, b in zip(s.logliks, o))
        print(f"  batched / filing day: {rate['batched'] / rate['filing day']:.2f}x (measured; target >= 3x); "
              f"largest log-likelihood difference {d_filed:.2e}")
    d_one = max(abs(a - b) for s, o in zip(batched, one) for a, b in zip(s.logliks, o.logliks))
    d_them = max(abs(a - b) for s, o in zip(batched, theirs) for a, b in zip(s.logliks, o))
    print(f"  largest |log-likelihood difference|: batched vs item by item {d_one:.2e}, "
          f"vs llama.cpp {d_them:.2e}")
    # the same items item by item in llama.cpp's numbers (F16 KV cache, its default): its own scores
    dec = Decoder(cfg, weights, be, n_ctx=n_ctx, numerics=LLAMA, kv_f16=True)
    as_llama = [score_item(dec, c, g) for c, g in encoded]
    d_llama = max(abs(a - b) for s, o in zip(as_llama, theirs) for a, b in zip(s.logliks, o))
    print(f"  with --numerics llama (item by item) vs llama.cpp: {d_llama:.2e} (the difference above is the "
          f"exact default's f32 activations against llama.cpp's 8-bit ones)")
    sb, so = summarize(batched), summarize(one)
    print(f"  accuracy batched {sb['acc']:.4f} (norm {sb['acc_norm']:.4f}), item by item {so['acc']:.4f} "
          f"(norm {so['acc_norm']:.4f})")


if __name__ == "__main__":
    main()
