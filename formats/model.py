"""The model layouts of llama.cpp (layer 5): a ModelConfig <-> GGUF keys, parameters <->
tensors, and validation of a model file, for every family in core/models/families/.

Names, keys, value types and shapes are llama.cpp's, so a file written with these loads in
llama.cpp: counts are UINT32, the RMS epsilon, RoPE base and scale FLOAT32, keys prefixed
with the architecture ("qwen3.embedding_length"). Parameters are named by their GGUF tensor
names (`token_embd.weight`, `blk.{i}.attn_q.weight`, ...) everywhere in ggtrain; shapes are
numpy order, so a linear weight is (out_features, in_features) and `y = x @ W.T`; the shape
of each tensor is the family's (core/models/family.py, BLOCK_SHAPES).

Nothing a file asks for is dropped silently: an "{arch}." key the family neither reads nor
lists as ignorable, a rope scaling type the decoder does not apply, experts (MoE), a tensor
the family does not have: each is a FormatError naming it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gguf.constants import GGMLQuantizationType, GGUFValueType, Keys

from ggtrain.core.models.config import ModelConfig, param_shapes
from ggtrain.core.models.families import FAMILIES, NAMES
from ggtrain.core.models.family import (OUTPUT, OUTPUT_NORM, ROPE_FACTORS_LONG,
                                        ROPE_FREQS, ROPE_SCALING, TOKEN_EMBD, Family)
from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.gguf import GGUFFile
from ggtrain.formats.mixture import MIXTURES

__all__ = ["CHECKPOINT_KEY", "FILE_TYPES", "OUTPUT", "OUTPUT_NORM", "ROPE_FREQS", "TOKEN_EMBD", "ModelLayout",
           "check_architecture", "config_from_kv", "config_to_kv", "tensor_shapes", "validate_model"]

VT = GGUFValueType
_INT_TYPES = (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64)
_VALUE_TYPES = {"u32": VT.UINT32, "f32": VT.FLOAT32, "bool": VT.BOOL}     # a family.Key's type as GGUF's
_ITEM_TYPES = {"u32": VT.INT32, "f32": VT.FLOAT32, "bool": VT.BOOL}      # a per-layer key's items

# "{arch}." keys besides the family's own that change nothing the decoder computes, or that
# are checked by hand below
_SCALING_TYPE, _SCALING_FACTOR, _SCALE_LINEAR = "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear"
_VALUE_LENGTH = "attention.value_length"
_VALUE_LENGTHS = {_VALUE_LENGTH: "head_dim", "attention.value_length_swa": "head_dim_swa"}   # = the key lengths
_RECURRENT_LAYERS = "attention.recurrent_layers"     # qwen35: one bool a layer, True where recurrent
_EXPERTS = ("expert_count", "expert_used_count")
_ROPE_FINETUNED = "rope.scaling.finetuned"
_HARMLESS = ("rope.scaling.original_context_length",   # read by YaRN only (refused below; a family
                                                       # that computes YaRN reads it as its key)
             _ROPE_FINETUNED)                          # a note of the converter's (granite: see its check)

# the key that marks a ggtrain training checkpoint (formats/checkpoint.py)
CHECKPOINT_KEY = "ggtrain.checkpoint.version"

# llama.cpp's general.file_type for a model whose matrices are of one type (the mixtures named
# after their type, formats.mixture)
FILE_TYPES = {GGMLQuantizationType[m.base.upper()]: m.file_type for m in MIXTURES.values() if m.name == m.base}


def tensor_shapes(cfg: ModelConfig) -> dict:
    """{tensor name: numpy-order shape} of a model, in llama.cpp's order."""
    return param_shapes(cfg)


def config_to_kv(cfg: ModelConfig, name: str = "ggtrain", file_type: int | None = None) -> list:
    """The model's GGUF key/values as (key, value, type) tuples, with llama.cpp's types: every
    key of its family (family.Key) whose value differs from what a file without it means, in
    the family's order. The head size is written (attention.key_length and value_length) where
    it is not n_embd / n_head, the rope scaling where there is one."""
    a = cfg.arch
    kv = [(Keys.General.ARCHITECTURE, a, VT.STRING), (Keys.General.NAME, name, VT.STRING)]
    for k in cfg.family.all_keys.values():
        value = getattr(cfg, k.field)
        if k.field == "head_dim":
            if cfg.dim % cfg.heads == 0 and value == cfg.dim // cfg.heads:
                continue
        elif k.unset is not None and value == k.unset and not k.required:
            continue
        if k.type == "bool" and k.per_layer:    # flags, one a layer always (llama.cpp reads an array)
            value = tuple(cfg.at(k.field, i) for i in range(cfg.layers))
        if isinstance(value, tuple):    # a per-layer key, as the converters write one (INT32 items)
            cast = {"u32": int, "f32": float, "bool": bool}[k.type]
            kv.append((f"{a}.{k.key}", [cast(x) for x in value], VT.ARRAY, _ITEM_TYPES[k.type]))
            continue
        kv.append((f"{a}.{k.key}", {"u32": int, "f32": float, "bool": bool}[k.type](value), _VALUE_TYPES[k.type]))
        value_length = next((key for key, field in _VALUE_LENGTHS.items() if field == k.field), None)
        if value_length is not None:    # values are as long as keys (ggtrain's attention)
            kv.append((f"{a}.{value_length}", value, VT.UINT32))
    if cfg.rope_long:
        kv.append((f"{a}.{_SCALING_TYPE}", "longrope", VT.STRING))
    if cfg.rope_scale != 1.0:
        kv.append((f"{a}.{_SCALING_TYPE}", "yarn" if cfg.rope_yarn else "linear", VT.STRING))
        kv.append((f"{a}.{_SCALING_FACTOR}", float(cfg.rope_scale), VT.FLOAT32))
    if file_type is not None:
        kv.append((Keys.General.FILE_TYPE, int(file_type), VT.UINT32))
    return kv


def check_architecture(f: GGUFFile) -> Family:
    """The Family of model file f; FormatError for a vocab-only file, a missing or unsupported
    architecture (naming the supported ones)."""
    arch = f.kv.get(Keys.General.ARCHITECTURE)
    if not f.tensors:
        what = f"architecture {arch.value!r}, " if arch is not None and arch.type == VT.STRING else ""
        raise FormatError(f"{f.path}: a vocab-only GGUF ({what}{len(f.kv)} keys, no tensors): "
                          f"it holds a tokenizer but no model weights")
    if arch is None:
        raise FormatError(f"{f.path}: key {Keys.General.ARCHITECTURE!r} is missing")
    if arch.type != VT.STRING:
        raise FormatError(f"{f.path}: {Keys.General.ARCHITECTURE} has type {arch.type.name}, expected STRING")
    fam = FAMILIES.get(arch.value)
    if fam is None:
        raise FormatError(f"{f.path}: architecture {arch.value!r} is not supported (ggtrain computes "
                          f"{NAMES})")
    return fam


def _number(f: GGUFFile, key: str, type_: str):
    v = f.kv[key]
    if type_ == "bool":
        if v.type != VT.BOOL:
            raise FormatError(f"{f.path}: {key} has type {v.type.name}, expected BOOL")
        return int(v.value)
    if type_ == "f32":
        if v.type not in (VT.FLOAT32, VT.FLOAT64):
            raise FormatError(f"{f.path}: {key} has type {v.type.name}, expected FLOAT32")
        # the shortest decimal that is this float32 (1e-05, not 9.999999747378752e-06)
        return float(str(np.float32(v.value))) if v.type == VT.FLOAT32 else float(v.value)
    if v.type not in _INT_TYPES:
        raise FormatError(f"{f.path}: {key} has type {v.type.name}, expected an integer (UINT32)")
    return int(v.value)


def _numbers(f: GGUFFile, key: str, type_: str) -> tuple:
    """A per-layer key's array (one value a layer; ModelConfig checks the count)."""
    v = f.kv[key]
    item = getattr(v, "item_type", None)
    floating = type_ == "f32"
    allowed = (VT.FLOAT32, VT.FLOAT64) if floating else _INT_TYPES + ((VT.BOOL,) if type_ == "bool" else ())
    if item not in allowed:
        raise FormatError(f"{f.path}: {key} is an array of {getattr(item, 'name', item)}, expected "
                          f"{'FLOAT32' if floating else 'BOOL' if type_ == 'bool' else 'integers (one a layer)'}")
    return tuple(float(x) if floating else int(x) for x in v.value)


def _pattern(f: GGUFFile, key: str) -> int:
    """A sliding-window pattern given as one bool per layer (True: local), as the n of "every
    n-th layer is global" it repeats; FormatError for another pattern."""
    local = [bool(x) for x in f.kv[key].value]
    for n in range(0, len(local) + 1):
        if local == [n == 0 or i % n < n - 1 for i in range(len(local))]:
            return n
    raise FormatError(f"{f.path}: {key} = {local}: a sliding-window pattern ggtrain does not apply (it applies "
                      f"every n-th layer global, the rest local)")


def _interval(f: GGUFFile, key: str) -> int:
    """Recurrent layers given as one bool per layer (True: recurrent, qwen35's
    attention.recurrent_layers), as the n of "every n-th layer attends"; FormatError for
    another pattern."""
    recurrent = [bool(x) for x in f.kv[key].value]
    for n in range(1, len(recurrent) + 1):
        if recurrent == [(i + 1) % n != 0 for i in range(len(recurrent))]:
            return n
    raise FormatError(f"{f.path}: {key} = {recurrent}: a layout of recurrent layers ggtrain does not apply (it "
                      f"applies every n-th layer attending, the rest recurrent)")


def config_from_kv(f: GGUFFile) -> dict:
    """ModelConfig keyword arguments from the keys of model file f (architecture checked),
    without `tied` and `rope_freqs` (the tensors say those).

    vocab: {arch}.vocab_size, else the length of tokenizer.ggml.tokens, else the rows of
    token_embd.weight; kv_heads defaults to heads, the head size to n_embd / n_head, the
    rotated dims to the head size, rope_base to 10000 (as in llama.cpp).
    """
    fam = check_architecture(f)
    a = fam.arch
    by_key = {f"{a}.{k.key}": k for k in fam.all_keys.values()}
    values = {"arch": a}
    scaling, factor = "linear", None     # llama.cpp's default type when a factor is given
    lengths = {}                         # the value lengths stated
    recurrent = None
    for key in f.kv:
        if not key.startswith(a + "."):
            continue
        rest = key[len(a) + 1:]
        if key in by_key and by_key[key].field == "window_pattern" and f.kv[key].type == VT.ARRAY:
            values["window_pattern"] = _pattern(f, key)
        elif key in by_key and (by_key[key].per_layer or by_key[key].array) and f.kv[key].type == VT.ARRAY:
            values[by_key[key].field] = _numbers(f, key, by_key[key].type)
        elif key in by_key:
            values[by_key[key].field] = _number(f, key, by_key[key].type)
        elif rest == _RECURRENT_LAYERS and "attn_interval" in fam.all_keys and f.kv[key].type == VT.ARRAY:
            recurrent = _interval(f, key)    # llama.cpp reads it before full_attention_interval
        elif rest == _SCALING_TYPE:
            v = f.kv[key]
            scaling = str(v.value) if v.type == VT.STRING else None
            applied = ROPE_SCALING + (("longrope",) if fam.long_rope else ()) + (("yarn",) if fam.yarn else ())
            if scaling not in applied:
                raise FormatError(f"{f.path}: {key} = {v.value!r}: a rope scaling ggtrain does not implement "
                                  f"for {a} (it applies {', '.join(applied)})")
        elif rest in (_SCALING_FACTOR, _SCALE_LINEAR):
            factor = _number(f, key, "f32")
        elif rest in _EXPERTS:
            if _number(f, key, "u32") > 0:
                raise FormatError(f"{f.path}: {key} = {f.kv[key].value}: a mixture-of-experts model, which "
                                  f"ggtrain does not compute (dense {NAMES} only)")
        elif rest in _VALUE_LENGTHS and _VALUE_LENGTHS[rest] in fam.all_keys:
            lengths[rest] = _number(f, key, "u32")
        elif rest == _ROPE_FINETUNED and fam.rope_switch and not f.kv[key].value:
            raise FormatError(f"{f.path}: {key} = false: {a} without rope, which ggtrain does not compute")
        elif rest not in _HARMLESS and rest not in fam.ignored_keys:
            raise FormatError(f"{f.path}: key {key!r} is not applied by ggtrain's {a} decoder, so the "
                              f"model would be computed wrongly (it reads {', '.join(sorted(by_key))})")
    if recurrent is not None:
        values["attn_interval"] = recurrent
    missing = [f"{a}.{k.key}" for k in fam.all_keys.values() if k.required and k.field not in values]
    if missing:
        raise FormatError(f"{f.path}: {a} key {missing[0]!r} is missing"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if scaling == "yarn" and factor not in (None, 0.0, 1.0):     # YaRN's factor (llama.cpp: ext_factor 1)
        values["rope_yarn"] = True
        values["rope_scale"] = factor
    elif factor not in (None, 0.0, 1.0):
        if scaling != "linear":    # llama.cpp would scale the frequencies as well as the rest
            raise FormatError(f"{f.path}: a rope scaling factor {factor:g} with {a}.{_SCALING_TYPE} {scaling!r}: "
                              f"ggtrain applies a factor with linear scaling only")
        values["rope_scale"] = factor
    if "vocab" not in values:
        tokens = f.kv.get(Keys.Tokenizer.LIST)
        if tokens is not None and tokens.type == VT.ARRAY:
            values["vocab"] = len(tokens.value)
        elif TOKEN_EMBD in f.tensors and len(f.tensors[TOKEN_EMBD].shape) == 2:
            values["vocab"] = f.tensors[TOKEN_EMBD].shape[0]
        else:
            raise FormatError(f"{f.path}: cannot tell the vocabulary size (no {a}.{fam.all_keys['vocab'].key}, "
                              f"no {Keys.Tokenizer.LIST}, no {TOKEN_EMBD})")
    values.setdefault("kv_heads", values["heads"])
    try:
        cfg = ModelConfig(**values)
    except ConfigError as exc:
        raise FormatError(f"{f.path}: {exc}") from None
    for key, length in lengths.items():
        head = getattr(cfg, _VALUE_LENGTHS[key]) or cfg.head_dim
        if length != head:
            raise FormatError(f"{f.path}: {a}.{key} {length} differs from the key head size {head}: "
                              f"ggtrain's attention needs them equal")
    return values


@dataclass(frozen=True)
class ModelLayout:
    """A validated model file: its ModelConfig and the parameter shapes (numpy order) by
    tensor name."""

    config: ModelConfig
    shapes: dict

    @property
    def tied(self) -> bool:
        return self.config.tied


def validate_model(f: GGUFFile) -> ModelLayout:
    """Check a GGUF model file against its family's layout; FormatError names the first
    problem (vocab-only file, architecture, key, missing tensor, wrong shape, a tensor the
    family does not have)."""
    values = config_from_kv(f)
    fam = FAMILIES[values["arch"]]
    own = dict(tied=OUTPUT not in f.tensors, rope_freqs=fam.rope_freqs and ROPE_FREQS in f.tensors,
               rope_long=fam.long_rope and ROPE_FACTORS_LONG in f.tensors)
    if fam.v_from_k:    # the layers (of those with keys of their own) without attn_v
        computing = values["layers"] - values.get("shared_kv", 0)
        own["v_from_k"] = tuple(i < computing and f"blk.{i}.attn_v.weight" not in f.tensors
                                for i in range(values["layers"]))
    try:
        cfg = ModelConfig(**values, **own)
    except ConfigError as exc:
        raise FormatError(f"{f.path}: {exc}") from None
    shapes = tensor_shapes(cfg)
    for name, shape in shapes.items():
        info = f.tensors.get(name)
        if info is None:
            raise FormatError(f"{f.path}: missing tensor {name!r} (expected shape {shape} for a {cfg.arch} model "
                              f"with n_layer={cfg.layers}, n_embd={cfg.dim})")
        if tuple(info.shape) != shape:
            # the family's own counts too (lfm2's shortconv.l_cache sizes its kernels)
            own = "".join(f", {cfg.arch}.{k.key}={getattr(cfg, k.field)}" for k in cfg.family.keys
                          if k.required and k.type == "u32")
            raise FormatError(f"{f.path}: tensor {name!r} has shape {info.shape}, expected {shape} "
                              f"(n_vocab={cfg.vocab}, n_embd={cfg.dim}, n_ff={cfg.ff}, n_head={cfg.heads}, "
                              f"n_head_kv={cfg.kv_heads}, head_dim={cfg.head_dim}{own})")
    extra = [n for n in f.tensors if n not in shapes]
    if extra and CHECKPOINT_KEY in f.kv:
        raise FormatError(f"{f.path}: a ggtrain training checkpoint, not a model (it holds optimizer state); "
                          f"`ggtrain convert-checkpoint {f.path} MODEL.gguf` writes its model")
    long_rope = [n for n in extra if n.startswith("rope_factors_")]
    if long_rope:
        raise FormatError(f"{f.path}: tensor {long_rope[0]!r}: long-context rope factors, which ggtrain applies "
                          f"to phi3 models only (this is {cfg.arch}; both _long and _short are needed)")
    experts = [n for n in extra if "_exps." in n or ".ffn_gate_inp." in n]
    if experts:
        raise FormatError(f"{f.path}: tensor {experts[0]!r}: a mixture-of-experts model, which ggtrain does not "
                          f"compute (dense {NAMES} only)")
    if extra:
        raise FormatError(f"{f.path}: tensor {extra[0]!r} is not part of a {cfg.arch} model with {cfg.layers} "
                          f"layers, and ggtrain would not apply it"
                          + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return ModelLayout(cfg, shapes)
