"""Benchmark: `ggtrain generate` against llama.cpp (llama-cpp-python) on the same model, prompt
and length: generation speed (tokens/s after the prompt), peak RSS, and whether the greedy
continuations agree: with llama.cpp as timed (its default F16 KV cache, which rounds attention
to f16, as ours does by default), and untimed with both on an F32 KV cache (--cache-type f32).

Each side runs in its own fresh process, measured in alternating rounds (ours, theirs,
ours, theirs, ...) so that noise on a shared machine hits both alike; speed is the best
round, peak RSS (ru_maxrss of the process, from wait4) the largest. llama.cpp runs as a
user runs it: default F16 KV cache, mmap, greedy sampling; both get the same thread count
and context (--ctx; ours keeps an f32 cache of that many positions).

    python bench/bench_generate.py [--model PATH ...] [--tinyllama] [--requant TYPE ...] [-n 48]
                                   [--threads 2] [--rounds 3] [--prompt TEXT] [--exact]

Ours runs `ggtrain generate --numerics llama`: quantized weights times activations rounded
to 8 bits, llama.cpp's numerics (--exact adds a row of ours with --numerics exact, the
default of the command: f32 activations).

Default model: SmolLM2-135M-Instruct Q4_1 from ../shared/data. --tinyllama adds the
TinyLlama-1.1B-shaped Q4_0 model of bench/tinyllama.py (built on first use); --requant f16
(or q5_k_m, ...) adds SmolLM2 requantized to that type by llama.cpp's quantizer.
Targets (issue 8): tokens/s ratio ours/llama.cpp >= 0.5, peak RSS ratio <= 1.5.
Also our GFLOP/s (2 per weight element per token: the products with the model's matrices)
as a percentage of the FP32 peak measured in the same sitting (bench/peak.py); generation
is bound by reading the weights, so this stays far below the peak.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from peak import Peak  # noqa: E402
SHARED = HERE.parents[1] / "shared" / "data"
SMOLLM2 = SHARED / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

_THEIRS = r"""
import json, sys, time
import llama_cpp
path, prompt, n, threads, ctx = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
f32 = dict(type_k=0, type_v=0, flash_attn=False) if sys.argv[6:] == ["f32"] else {}
t0 = time.perf_counter()
llm = llama_cpp.Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_threads_batch=threads,
                      verbose=False, seed=0, **f32)
ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
llm.n_ctx() >= len(ids) + n or sys.exit("context too small")
t1 = time.perf_counter()
out, stamps = [], []
for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
    stamps.append(time.perf_counter())
    if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), t):
        break
    out.append(int(t))
    if len(out) == n:
        break
rate = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else 0.0
print(json.dumps({"text": llm.detokenize(out).decode("utf-8", "replace"), "load_s": t1 - t0,
                  "prompt_tokens": len(ids), "prompt_s": stamps[0] - t1, "tokens": len(stamps),
                  "tokens_per_s": rate}))
"""


def _measured(cmd: list) -> tuple:
    """Run cmd; (stdout, stderr, returncode, peak RSS MiB) with ru_maxrss from wait4."""
    r_fd, w_fd = os.pipe()
    e_r, e_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.dup2(w_fd, 1)
        os.dup2(e_w, 2)
        os.close(r_fd)
        os.close(e_r)
        os.execvp(cmd[0], cmd)
    os.close(w_fd)
    os.close(e_w)
    with os.fdopen(r_fd) as fo, os.fdopen(e_r) as fe:
        out = fo.read()
        err = fe.read()
    _, status, usage = os.wait4(pid, 0)
    return out, err, os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024


def active_params(model) -> float:
    """The elements of the matrices a token is multiplied by: every 2-D tensor but the
    embedding table, which counts only when it is also the output projection (tied), and of
    the experts' stacked 3-D tensors the share a token is routed to (expert_used_count of
    expert_count)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(model))
    used = {f.name.rsplit(".", 1)[1]: int(f.contents()) for f in reader.fields.values()
            if f.name.endswith((".expert_count", ".expert_used_count"))}
    tensors = {t.name: int(t.n_elements) for t in reader.tensors if len(t.shape) == 2}
    experts = sum(int(t.n_elements) for t in reader.tensors if len(t.shape) == 3 and "_exps." in t.name)
    embd = tensors.pop("token_embd.weight", 0)
    routed = experts * used["expert_used_count"] / used["expert_count"] if experts else 0
    return sum(tensors.values()) + (0 if "output.weight" in tensors else embd) + routed


def flop_per_token(model) -> float:
    """2 x the active parameters (active_params): a token's products in generation."""
    return 2.0 * active_params(model)


def ours(model, prompt, n, threads, ctx, exact=False, f32_cache=False) -> dict:
    out, err, rc, rss = _measured([sys.executable, "-m", "ggtrain", "generate", "--model", str(model),
                                   "--prompt", prompt, "-n", str(n), "--temp", "0", "--threads",
                                   str(threads), "--ctx", str(ctx), "--timings",
                                   "--numerics", "exact" if exact else "llama"]
                                  + (["--cache-type", "f32"] if f32_cache else []))
    if rc != 0:
        sys.exit(f"ggtrain generate failed: {err}")
    res = json.loads(err.strip().splitlines()[-1])
    res.update(text=out[:-1] if out.endswith("\n") else out, rss_mib=rss)
    return res


def theirs(model, prompt, n, threads, ctx, f32_cache=False) -> dict:
    out, err, rc, rss = _measured([sys.executable, "-c", _THEIRS, str(model), prompt, str(n), str(threads),
                                   str(ctx)] + (["f32"] if f32_cache else []))
    if rc != 0:
        sys.exit(f"llama.cpp run failed: {err}")
    res = json.loads(out)
    res["rss_mib"] = rss
    return res


def _requantized(ftype: str) -> pathlib.Path:
    """SmolLM2 (Q4_1) requantized to a llama.cpp ftype (f16, q5_k_m, ...) by its own quantizer,
    cached: the weights are SmolLM2's as stored, in another type (576 columns are not whole
    K-quant super-blocks, so a K-quant mix falls back to legacy types for most matrices)."""
    import llama_cpp

    out = HERE / ".cache" / f"SmolLM2-135M-Instruct.{ftype.upper()}.gguf"
    if out.is_file():
        return out
    name = f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}"
    if not hasattr(llama_cpp, name):
        sys.exit(f"--requant {ftype}: llama.cpp has no ftype {name}")
    out.parent.mkdir(exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    params.allow_requantize = True
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(SMOLLM2).encode(), str(tmp).encode(), params) != 0:
        sys.exit(f"--requant {ftype}: llama.cpp's quantizer failed")
    os.replace(tmp, out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", type=pathlib.Path, help="GGUF model (repeatable)")
    ap.add_argument("--tinyllama", action="store_true", help="also the TinyLlama-1.1B-shaped Q4_0 model")
    ap.add_argument("--requant", action="append", default=[], metavar="TYPE",
                    help="also SmolLM2 requantized to TYPE (f16, q5_k_m, ...: a llama.cpp ftype) by llama.cpp's "
                         "quantizer, cached under bench/.cache (repeatable)")
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("-n", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--exact", action="store_true",
                    help="also ours with --numerics exact (f32 activations), in the same alternation "
                         "(the others run --numerics llama)")
    ap.add_argument("--ctx", type=int, default=256,
                    help="context (KV cache positions) of both sides; llama.cpp pads to 256")
    args = ap.parse_args()
    models = list(args.model or [SMOLLM2])
    if args.tinyllama:
        from tinyllama import tinyllama_q4_0
        models.append(tinyllama_q4_0())
    models += [_requantized(t) for t in args.requant]
    peak = Peak(args.threads)
    rows, same_f32 = [], {}
    for model in models:
        if not model.is_file():
            sys.exit(f"{model}: no such file")
        a, b, c = [], [], []
        for _ in range(args.rounds):
            a.append(ours(model, args.prompt, args.n, args.threads, args.ctx))
            b.append(theirs(model, args.prompt, args.n, args.threads, args.ctx))
            if args.exact:
                c.append(ours(model, args.prompt, args.n, args.threads, args.ctx, exact=True))
            peak.sample()
        best_a = max(r["tokens_per_s"] for r in a)
        best_b = max(r["tokens_per_s"] for r in b)
        rss_a = max(r["rss_mib"] for r in a)
        rss_b = max(r["rss_mib"] for r in b)
        same = a[0]["text"] == b[0]["text"]
        common = os.path.commonprefix([a[0]["text"], b[0]["text"]])
        f32_text = theirs(model, args.prompt, args.n, args.threads, args.ctx, f32_cache=True)["text"]
        same_f32[model.name] = ours(model, args.prompt, args.n, args.threads, args.ctx, f32_cache=True)["text"] \
            == f32_text
        gf = flop_per_token(model) * best_a / 1e9
        rows.append((model.name, best_a, best_b, rss_a, rss_b, same, gf, a[0], b[0], len(common)))
        if c:
            best_c = max(r["tokens_per_s"] for r in c)
            common_c = os.path.commonprefix([c[0]["text"], b[0]["text"]])
            rows.append((model.name + " --exact", best_c, best_b, max(r["rss_mib"] for r in c), rss_b,
                         c[0]["text"] == b[0]["text"], flop_per_token(model) * best_c / 1e9, c[0], b[0],
                         len(common_c)))
    print(f"generate: {args.n} tokens after {args.prompt!r}, greedy, {args.threads} threads, context "
          f"{args.ctx}, best of {args.rounds} alternating rounds; {peak.describe()}")
    print(f"{'model':38s} {'ours t/s':>9s} {'llama.cpp':>9s} {'ratio':>6s} | {'ours MiB':>8s} "
          f"{'llama.cpp':>9s} {'ratio':>6s} | {'GFLOP/s':>7s} {'%peak':>6s} | same text (F16 KV; F32 KV)")
    for name, ta, tb, ra, rb, same, gf, ra0, rb0, common in rows:
        f32 = "" if name.endswith("--exact") else "; " + ("yes" if same_f32[name] else "no")
        print(f"{name:38s} {ta:9.1f} {tb:9.1f} {ta / tb:6.2f} | {ra:8.0f} {rb:9.0f} {ra / rb:6.2f} | "
              f"{gf:7.1f} {peak.percent(gf):5.1f}% | {'yes' if same else f'first {common} chars'}{f32}")
    for name, *_, ra0, rb0, _ in rows:
        print(f"\n{name}: load {ra0['load_s']:.2f} s (llama.cpp {rb0['load_s']:.2f} s), prompt of "
              f"{ra0['prompt_tokens']} tokens {ra0['prompt_s']:.3f} s (llama.cpp {rb0['prompt_s']:.3f} s)")
        print(f"  ours:      {ra0['text']!r}")
        print(f"  llama.cpp: {rb0['text']!r}")


if __name__ == "__main__":
    main()
