"""`ggtrain info FILE [--json]` (layer 6): what a GGUF file holds.

Text: version, key/value pairs (long arrays summarized: item type, length, first
items), tensors (name, type, shape in numpy order, bytes) and totals.
--json: one object {"version", "alignment", "data_offset", "kv", "tensors",
"n_tensors", "tensor_bytes"}; "kv" maps each key to its value, except arrays
longer than --max-items, which become {"type": "array", "item_type", "length",
"head"} (use --max-items 0 for every array in full); "tensors" is a list of
{"name", "type", "shape", "nbytes", "offset"}. A ggtrain checkpoint is described first
(text) or under "checkpoint" (--json): its kind, updates, tokens seen, optimizer, base model.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import typer

from ggtrain.cli.common import file_errors
from ggtrain.cli.main import app
from ggtrain.core.models.families import FAMILIES
from ggtrain.formats.checkpoint import checkpoint_summary, is_checkpoint
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.gguf_values import GGUFValue, StringArray

_HEAD = 6            # items shown of a long array


def _scalar(v, vtype_name: str):
    """JSON-able scalar; float32 values as their shortest float32 repr (1e-05, not 9.99e-06)."""
    if isinstance(v, (np.generic,)):
        v = v.item()
    if vtype_name == "FLOAT32" and isinstance(v, float) and math.isfinite(v):
        return float(str(np.float32(v)))
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _items(v: GGUFValue, start: int, stop: int) -> list:
    if isinstance(v.value, StringArray):
        return v.value[start:stop]
    if isinstance(v.value, np.ndarray):
        return [_scalar(x, v.item_type.name) for x in v.value[start:stop].tolist()]
    return [_json_value(x, 0) for x in v.value[start:stop]]


def _json_value(v: GGUFValue, max_items: int):
    if v.type.name != "ARRAY":
        return _scalar(v.value, v.type.name)
    n = len(v.value)
    if max_items and n > max_items:
        return {"type": "array", "item_type": v.item_type.name, "length": n, "head": _items(v, 0, _HEAD)}
    return _items(v, 0, n)


def _text_value(v: GGUFValue, width: int = 100) -> str:
    if v.type.name != "ARRAY":
        s = json.dumps(_scalar(v.value, v.type.name), ensure_ascii=False)
        return s if len(s) <= width else s[:width - 3] + "..."
    n = len(v.value)
    head = ", ".join(json.dumps(x, ensure_ascii=False) for x in _items(v, 0, min(n, _HEAD)))
    more = ", ..." if n > _HEAD else ""
    s = f"[{head}{more}]"
    if len(s) > width:
        s = s[:width - 4] + "...]"
    return s


def _type_label(v: GGUFValue) -> str:
    if v.type.name == "ARRAY":
        return f"{v.item_type.name}[{len(v.value)}]"
    return v.type.name


@app.command("info", rich_help_panel="Files")
def info(
    file: Path = typer.Argument(..., help="A GGUF file.", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of text."),
    max_items: int = typer.Option(64, "--max-items", min=0,
                                  help="With --json, arrays longer than this are summarized (0: never)."),
):
    """Show what a GGUF file holds: version, key/value pairs, tensors, data size."""
    with file_errors(str(file), "GGUF file"):
        f = read_gguf(file)

    tensors = list(f.tensors.values())
    total = f.tensor_bytes
    ckpt = checkpoint_summary(f) if is_checkpoint(f) else None
    if as_json:
        out = {
            "file": str(file),
            "version": f.version,
            "alignment": f.alignment,
            "data_offset": f.data_offset,
            "kv": {k: _json_value(v, max_items) for k, v in f.kv.items()},
            "tensors": [{"name": t.name, "type": t.type.name, "shape": list(t.shape),
                         "nbytes": t.nbytes, "offset": t.offset} for t in tensors],
            "n_tensors": len(tensors),
            "tensor_bytes": total,
        }
        if ckpt is not None:
            out["checkpoint"] = ckpt
        typer.echo(json.dumps(out, ensure_ascii=False))
        return

    typer.echo(f"{file}: GGUF v{f.version}, {len(f.kv)} key/value pairs, {len(tensors)} tensors, "
               f"alignment {f.alignment}, {f.file_size} bytes")
    if ckpt is not None:
        for line in _checkpoint_lines(ckpt):
            typer.echo(line)
    if f.kv:
        typer.echo("key/value pairs:")
        kw = max(len(k) for k in f.kv)
        tw = max(len(_type_label(v)) for v in f.kv.values())
        for k, v in f.kv.items():
            typer.echo(f"  {k:<{kw}}  {_type_label(v):<{tw}}  {_text_value(v)}")
    if tensors:
        typer.echo("tensors:")
        nw = max(len(t.name) for t in tensors)
        yw = max(len(t.type.name) for t in tensors)
        sw = max(len(str(t.shape)) for t in tensors)
        for t in tensors:
            typer.echo(f"  {t.name:<{nw}}  {t.type.name:<{yw}}  {str(t.shape):<{sw}}  {t.nbytes:>12,} bytes")
        n_el = sum(t.n_elements for t in tensors)
        by_type = {}
        for t in tensors:
            by_type[t.type.name] = by_type.get(t.type.name, 0) + 1
        kinds = ", ".join(f"{n} {k}" for k, n in by_type.items())
        typer.echo(f"total: {len(tensors)} tensors ({kinds}), {n_el:,} elements, {total:,} bytes of data "
                   f"from byte {f.data_offset}")
    else:
        typer.echo("no tensors (a vocabulary-only file)")


def _checkpoint_lines(c: dict) -> list:
    what = {"train": "a llama trained from scratch (`ggtrain train --resume` continues it)",
            "finetune-lora": "LoRA adapters on a frozen base (`ggtrain finetune --resume` continues it)",
            "finetune-full": "a full fine-tune (`ggtrain finetune --full --resume` continues it)",
            "model": "a model's weights before any training (`ggtrain train --resume` or "
                     "`ggtrain finetune --full --resume` start from it)",
            "mnist": "an MNIST classifier in training (`ggtrain mnist train --resume` continues it)"}[c["kind"]]
    m = c["model"]
    model = (f"  model: mnist-{m.get('arch')}" if c["kind"] == "mnist" else
             f"  model: {m.get('layers')} layers, dim {m.get('dim')}, {m.get('heads')} heads "
             f"({m.get('kv_heads')} kv), ff {m.get('ff')}, vocab {m.get('vocab')}, ctx {m.get('ctx')}")
    lines = [f"ggtrain checkpoint (v{c['version']}): {what}", model,
             f"  trained: {c['trained_tensors']} tensors, {c['trained_parameters']:,} parameters"]
    if c["kind"] == "mnist":
        lines.append(f"  progress: {c['updates']} updates of {c['epochs']:g} epochs; optimizer {c['optimizer']}, "
                     f"lr {c['lr']}")
    elif c["kind"] != "model":
        planned = f" of {c['steps']}" if c["steps"] else ""
        lines.append(f"  progress: {c['updates']}{planned} updates, {c['tokens_seen']:,} tokens seen; "
                     f"optimizer {c['optimizer']}, peak lr {c['lr']}")
    if c["lora"]:
        lo = c["lora"]
        family = FAMILIES.get(m.get("arch"))
        targets = (",".join(lo["targets"]) if lo.get("targets") else
                   f"{','.join(family.lora_targets)} (the family's default)" if family else "the family's default")
        lines.append(f"  lora: rank {lo.get('rank')}, alpha {lo.get('alpha')}, targets {targets}")
    if c["base"]:
        lines.append(f"  base model: {c['base']['path']} (sha256 of its weights {c['base']['fingerprint'][:16]}...)")
    if c["data_fingerprint"]:
        lines.append(f"  data: sha256 {c['data_fingerprint'][:16]}...")
    return lines
