"""`ggtrain convert-checkpoint IN OUT` (layer 6): checkpoint ⇄ model ⇄ adapter, merged models,
other output types, llama2.c import.

What happens is decided by what IN is and the options:
    checkpoint (train, finetune --full, model)  → a llama.cpp model (--to model, the default)
    checkpoint (finetune, LoRA)                 → its adapter; with --base, the merged model
    checkpoint (mnist train)                    → the MNIST model (F32)
    model + --adapter A (or --base B --adapter A OUT) → the merged model
    model + --out-type T                        → the model in type T
    model + --to checkpoint                     → a checkpoint `train --resume` and
                                                  `finetune --full --resume` start from
    llama2.c checkpoint (--from llama2c --tokenizer tok.bin) → a llama.cpp model
Every output is written atomically; one summary line says what was written.
"""
from __future__ import annotations

import pathlib

import typer

from ggtrain.cli.common import file_errors, imatrix_option, imatrix_words
from ggtrain.cli.common import progress_bar
from ggtrain.cli.loop import check_apart, check_out
from ggtrain.cli.main import app
from ggtrain.cli.options import choice, opt_imatrix
from ggtrain.core.models import mnist
from ggtrain.core.models.lora import factor_names
from ggtrain.errors import ConfigError
from ggtrain.formats.checkpoint import Checkpoint, is_checkpoint, load_checkpoint, save_checkpoint
from ggtrain.formats.gguf import GGUFFile, read_gguf
from ggtrain.formats.llama2c import read_llama2c, read_llama2c_tokenizer
from ggtrain.formats.mixture import OUT_TYPES
from ggtrain.formats.model_file import (carried_kv, check_write_type, default_out_type, load_model, requantized,
                                       rewrite_model, save_model)
from ggtrain.formats.lora import read_lora, write_lora, write_merged
from ggtrain.formats.mnist import save_mnist_model
from ggtrain.native.dtypes import dtype

TO = ("model", "checkpoint")
SOURCES = ("gguf", "llama2c")


def _bar():
    """A progress callback for the writers: a tqdm bar of tensors written, on stderr."""
    state = {}

    def update(i: int, n: int) -> None:
        if "bar" not in state:
            state["bar"] = progress_bar(total=n, unit="tensor", leave=False, mininterval=0.5)
        state["bar"].update(i - state["bar"].n)
        if i == n:
            state["bar"].close()
    return update


def _is_adapter(f: GGUFFile) -> bool:
    return f.value("general.type", None) == "adapter"


def _open(path: pathlib.Path, option: str) -> GGUFFile:
    with file_errors(f"{option} {path}", "GGUF file"):
        return read_gguf(path)


def _summary(out: pathlib.Path, what: str) -> str:
    f = read_gguf(out)
    by_type = {}
    for t in f.tensors.values():
        by_type[t.type.name] = by_type.get(t.type.name, 0) + 1
    kinds = ", ".join(f"{n} {k}" for k, n in by_type.items())
    return f"wrote {out}: {what}, {len(f.tensors)} tensors ({kinds}), {f.file_size:,} bytes"


def _default_type(ckpt: Checkpoint) -> str:
    """A checkpoint's model is written in its base's type where that keeps what training changed
    (default_out_type: 8 bits or more, else F16), f32 for a model trained from scratch."""
    base = ckpt.run_config.get("base_type")
    return "f32" if base is None else default_out_type(base)


def _stored(f: GGUFFile, merged=()) -> dict:
    """{name: type} of f's tensors as they come in (merged ones as f32: they are computed)."""
    return {n: "f32" if n in merged else dtype(int(i.type)).name for n, i in f.tensors.items()}


def _requantized_words(f: GGUFFile, types: dict, merged=()) -> str:
    """"; requantizes N tensors from Q4_1" for the input's block-type tensors written in another type."""
    stored = {n: dtype(int(i.type)).name for n, i in f.tensors.items() if n not in merged}
    req = requantized(stored, types)
    if not req:
        return ""
    froms = ", ".join(sorted({s.upper() for _, s, _ in req}))
    return (f"; requantizes {len(req)} tensors from {froms} (llama.cpp's quantizer asks --allow-requantize for "
            f"this: both roundings stay)")


def _lora_pairs(ckpt: Checkpoint) -> tuple:
    """(alpha, {weight: (A, B)}) of a finetune-lora checkpoint."""
    lora = ckpt.run_config["lora"]
    params = ckpt.state["params"]
    pairs = {}
    for name in params:
        if name.endswith(".lora_a"):
            w = name[:-len(".lora_a")]
            a_name, b_name = factor_names(w)
            pairs[w] = (params[a_name], params[b_name])
    return float(lora["alpha"]), pairs


To, TO_OPTION = choice(None, "--to", values=TO, panel="Options", show_default=False,
                       help="model (a checkpoint becomes its model or adapter, the default) or checkpoint (a model "
                            "becomes a checkpoint to train from).")
From, FROM_OPTION = choice("gguf", "--from", values=SOURCES, panel="Options",
                           help="gguf, or llama2c (Karpathy's llama2.c version 0 checkpoint; needs --tokenizer).")


@app.command("convert-checkpoint", rich_help_panel="Files")
def convert_checkpoint(
    first: pathlib.Path = typer.Argument(..., metavar="IN", show_default=False,
                                         help="The file to convert (with --base and one path: OUT)."),
    second: pathlib.Path = typer.Argument(None, metavar="OUT", show_default=False, help="Where to write."),
    to: To = TO_OPTION,
    base: pathlib.Path = typer.Option(None, "--base", help="The base model to merge an adapter (or a LoRA "
                                      "checkpoint) into."),
    adapter: pathlib.Path = typer.Option(None, "--adapter", help="A llama.cpp LoRA adapter to merge into the base."),
    scale: float = typer.Option(1.0, "--scale", help="Scale of the merged adapter (as llama.cpp's --lora-scaled): "
                                "W + scale * alpha / r * B A."),
    out_type: str = typer.Option(None, "--out-type", metavar="TYPE", help=f"Type of the written model, as llama.cpp's quantizer "
                                 f"names and mixes them (q4_k_m: Q4_K with Q6_K for the output, half the attn_v "
                                 f"and ffn_down, ...): {', '.join(OUT_TYPES)} (default: the input's types; merged "
                                 f"tensors and trained models keep their base's type where it has 8 bits or more, "
                                 f"else f16; f32 for models trained from scratch and llama2.c imports). 1-D "
                                 f"tensors keep their type, as llama.cpp keeps them."),
    imatrix: str = opt_imatrix("Options"),
    source: From = FROM_OPTION,
    tokenizer: pathlib.Path = typer.Option(None, "--tokenizer", help="With --from llama2c: its tokenizer.bin."),
):
    """Convert between checkpoints, models and adapters; merge adapters; change types; import llama2.c."""
    if to is not None and to not in TO:
        raise ConfigError(f"--to {to}: expected one of {', '.join(TO)}")
    if source not in SOURCES:
        raise ConfigError(f"--from {source}: expected one of {', '.join(SOURCES)}")
    if out_type is not None:
        out_type = check_write_type(out_type)
    if second is not None:
        inp, out = first, second
    elif base is not None:
        inp, out = None, first
    else:
        raise ConfigError("give IN and OUT (with --base, OUT alone merges --adapter into it)")
    check_out(out, "OUT")
    check_apart({"OUT": out}, {"IN": inp, "--base": base, "--adapter": adapter, "--tokenizer": tokenizer,
                               "--imatrix": imatrix and pathlib.Path(imatrix)})
    im = imatrix_option(imatrix, out_type)

    if source == "llama2c":
        what = _from_llama2c(inp, out, tokenizer, to, adapter, base, out_type, im)
    elif tokenizer is not None:
        raise ConfigError("--tokenizer is for --from llama2c (a GGUF file has its own vocabulary)")
    elif adapter is not None or base is not None:
        what = _merge(inp, out, base, adapter, scale, to, out_type, im)
    else:
        f = _open(inp, "IN")
        if _is_adapter(f):
            raise ConfigError(f"IN {inp}: a LoRA adapter; merge it into its model with "
                              f"`convert-checkpoint BASE.gguf OUT --adapter {inp}`")
        what = _from_checkpoint(inp, out, to, out_type, im) if is_checkpoint(f) else _from_model(f, out, to, out_type, im)
    typer.echo(_summary(out, what))


def _from_llama2c(inp, out, tokenizer, to, adapter, base, out_type, im) -> str:
    if inp is None:
        raise ConfigError("--from llama2c: give IN (the llama2.c checkpoint) and OUT")
    if tokenizer is None:
        raise ConfigError("--from llama2c needs --tokenizer tokenizer.bin (llama2.c's vocabulary)")
    if to == "checkpoint" or adapter is not None or base is not None:
        raise ConfigError("--from llama2c writes a model (convert that to a checkpoint or merge into it afterwards)")
    config, weights = read_llama2c(inp)
    tok = read_llama2c_tokenizer(tokenizer, config["vocab"])
    t = out_type or "f32"
    types = save_model(out, config, weights, tok, name=inp.stem, out_type=t, progress=_bar(), imatrix=im)
    return f"llama model ({t}) from llama2.c {inp.name}{imatrix_words(im, {}, types)}"


def _merge(inp, out, base, adapter, scale, to, out_type, im) -> str:
    if to == "checkpoint":
        raise ConfigError("--adapter/--base write a merged model, not a checkpoint (drop --to checkpoint)")
    if base is not None and adapter is not None and inp is not None:
        raise ConfigError("give the base as IN or as --base, not both")
    if base is not None and adapter is None:        # IN: a LoRA checkpoint
        f = _open(inp, "IN")
        if not is_checkpoint(f):
            raise ConfigError(f"--base: IN {inp} should be a LoRA checkpoint (or give --adapter)")
        ckpt = load_checkpoint(inp)
        if ckpt.kind != "finetune-lora":
            raise ConfigError(f"IN {inp}: a {ckpt.kind} checkpoint has no adapter to merge into --base")
        alpha, pairs = _lora_pairs(ckpt)
        src, label = inp, f"checkpoint {inp.name}"
    else:
        if base is None:
            base = inp
        fa = _open(adapter, "--adapter")
        if not _is_adapter(fa):
            kind = "checkpoint" if is_checkpoint(fa) else "model"
            raise ConfigError(f"--adapter {adapter}: a {kind}, not a LoRA adapter")
        alpha, arch, pairs = read_lora(adapter)
        src, label = adapter, f"adapter {adapter.name}"
    fb = _open(base, "--base" if inp is None or base != inp else "IN")
    if is_checkpoint(fb) or _is_adapter(fb):
        raise ConfigError(f"{base}: the base must be a model, not a {'checkpoint' if is_checkpoint(fb) else 'LoRA adapter'}")
    base_arch = fb.value("general.architecture", None)
    if adapter is not None and arch not in (None, base_arch):
        raise ConfigError(f"--adapter {adapter}: an adapter for architecture {arch!r}; the base is a {base_arch}")
    result = write_merged(out, fb, pairs, alpha, scale, out_type, src=src, progress=_bar(), imatrix=im)
    if result.warning():
        typer.echo(result.warning(), err=True)
    return (f"{base.name} with {label} merged (scale {scale:g}){f', as {out_type}' if out_type else ''}; "
            f"{result.words()}{_requantized_words(fb, result.types, result.merged)}"
            f"{imatrix_words(im, _stored(fb, result.merged), result.types)}")


def _from_checkpoint(inp, out, to, out_type, im) -> str:
    if to == "checkpoint":
        raise ConfigError(f"IN {inp} is already a checkpoint (--to checkpoint converts a model)")
    ckpt = load_checkpoint(inp)
    step = ckpt.state["updates"]
    if ckpt.kind == "mnist":
        if out_type not in (None, "f32") or im is not None:
            raise ConfigError(f"IN {inp}: an MNIST model is F32 (--out-type and --imatrix are for language models)")
        arch = ckpt.model_config["arch"]
        save_mnist_model(out, arch, ckpt.state["params"], mnist.PARAM_SHAPES[arch])
        return f"mnist-{arch} model from checkpoint {inp.name} at update {step}"
    if ckpt.kind == "finetune-lora":
        if out_type is not None:
            raise ConfigError(f"IN {inp}: a LoRA checkpoint becomes an adapter (F32); --out-type is for models "
                              f"(add --base BASE.gguf to write the merged model)")
        alpha, pairs = _lora_pairs(ckpt)
        write_lora(out, ckpt.model_config.get("arch", "llama"), alpha, pairs, progress=_bar())
        return f"LoRA adapter (rank {ckpt.run_config['lora']['rank']}) from checkpoint {inp.name} at update {step}"
    t = out_type or _default_type(ckpt)
    types = save_model(out, ckpt.model_config, ckpt.state["params"], ckpt.tokenizer,
                       name=f"ggtrain {ckpt.kind}", out_type=t, extra_kv=ckpt.extra_kv, progress=_bar(), imatrix=im)
    return (f"{ckpt.model_config.get('arch', 'llama')} model ({t}) from {ckpt.kind} checkpoint {inp.name} at update "
            f"{step}{imatrix_words(im, {}, types)}")


def _from_model(f: GGUFFile, out, to, out_type, im) -> str:
    inp = pathlib.Path(f.path)
    if to == "checkpoint":
        if out_type is not None:
            raise ConfigError("--out-type is for models; a checkpoint holds f32 weights")
        config, weights, tok = load_model(inp)
        state = {"params": weights, "optimizer": {}, "updates": 0, "tokens_seen": 0}
        save_checkpoint(out, Checkpoint("model", config, {}, state, tok, run_config={"base": str(inp)},
                                        extra_kv=carried_kv(f)), progress=_bar())
        return f"model checkpoint (f32, update 0) of {inp.name}"
    if out_type is None:
        raise ConfigError(f"IN {inp} is already a model: give --out-type, --adapter or --to checkpoint")
    types = rewrite_model(out, f, out_type=out_type, progress=_bar(), imatrix=im)
    return f"{inp.name} as {out_type}{_requantized_words(f, types)}{imatrix_words(im, _stored(f), types)}"
