"""The llama model layout of llama.cpp (layer 5): hyperparameters <-> GGUF keys,
parameters <-> tensors, and validation of a model file.

Names, keys, value types and shapes are llama.cpp's, so a file written with these
loads in llama.cpp: counts are UINT32, the RMS epsilon and RoPE base FLOAT32.
Parameters are named by their GGUF tensor names (`token_embd.weight`,
`blk.{i}.attn_q.weight`, ...) everywhere in ggtrain; shapes are numpy order, so a
linear weight is (out_features, in_features) and `y = x @ W.T`:

    token_embd.weight     (n_vocab, n_embd)      output_norm.weight   (n_embd,)
    output.weight         (n_vocab, n_embd)      absent when tied to token_embd
    blk.{i}.attn_norm     (n_embd,)              blk.{i}.ffn_norm     (n_embd,)
    blk.{i}.attn_q        (n_embd, n_embd)       blk.{i}.attn_output  (n_embd, n_embd)
    blk.{i}.attn_k/_v     (n_embd_kv, n_embd)    n_embd_kv = n_head_kv * head_dim (GQA)
    blk.{i}.ffn_gate/_up  (n_ff, n_embd)         blk.{i}.ffn_down     (n_embd, n_ff)
    (every blk name ends in .weight)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gguf.constants import (
    MODEL_ARCH,
    MODEL_ARCH_NAMES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFValueType,
    Keys,
    LlamaFileType,
)

from ggtrain.errors import FormatError
from ggtrain.formats.gguf import GGUFFile

ARCH = MODEL_ARCH_NAMES[MODEL_ARCH.LLAMA]          # "llama"
VT = GGUFValueType


def _key(template: str) -> str:
    return template.format(arch=ARCH)


# hparams field -> (GGUF key, value type written); read back from any integer type
_INT_KEYS = {
    "n_ctx": _key(Keys.LLM.CONTEXT_LENGTH),
    "n_embd": _key(Keys.LLM.EMBEDDING_LENGTH),
    "n_ff": _key(Keys.LLM.FEED_FORWARD_LENGTH),
    "n_layer": _key(Keys.LLM.BLOCK_COUNT),
    "n_head": _key(Keys.Attention.HEAD_COUNT),
    "n_head_kv": _key(Keys.Attention.HEAD_COUNT_KV),
    "n_rot": _key(Keys.Rope.DIMENSION_COUNT),
    "n_vocab": _key(Keys.LLM.VOCAB_SIZE),
}
_FLOAT_KEYS = {
    "rms_eps": _key(Keys.Attention.LAYERNORM_RMS_EPS),
    "rope_freq_base": _key(Keys.Rope.FREQ_BASE),
}
_REQUIRED = ("n_ctx", "n_embd", "n_ff", "n_layer", "n_head", "rms_eps")
_INT_TYPES = (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64)

TOKEN_EMBD = TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight"
OUTPUT_NORM = TENSOR_NAMES[MODEL_TENSOR.OUTPUT_NORM] + ".weight"
OUTPUT = TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight"
ROPE_FREQS = TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight"
_BLOCK_TENSORS = (MODEL_TENSOR.ATTN_NORM, MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_K, MODEL_TENSOR.ATTN_V,
                  MODEL_TENSOR.ATTN_OUT, MODEL_TENSOR.FFN_NORM, MODEL_TENSOR.FFN_GATE,
                  MODEL_TENSOR.FFN_DOWN, MODEL_TENSOR.FFN_UP)

# the key that marks a ggtrain training checkpoint (formats/checkpoint.py)
CHECKPOINT_KEY = "ggtrain.checkpoint.version"

# llama.cpp's general.file_type for a model whose matrices are of one type
FILE_TYPES = {
    GGMLQuantizationType.F32: LlamaFileType.ALL_F32, GGMLQuantizationType.F16: LlamaFileType.MOSTLY_F16,
    GGMLQuantizationType.BF16: LlamaFileType.MOSTLY_BF16, GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q4_0: LlamaFileType.MOSTLY_Q4_0, GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1,
}


@dataclass(frozen=True)
class LlamaHParams:
    """llama hyperparameters, named as in llama.cpp's llama_hparams.

    n_rot defaults to the head size (all of each head is rotated);
    n_head_kv < n_head is grouped-query attention.
    """

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    n_ctx: int
    n_head_kv: int | None = None
    n_rot: int | None = None
    rms_eps: float = 1e-5
    rope_freq_base: float = 10000.0

    def __post_init__(self):
        if self.n_head_kv is None:
            object.__setattr__(self, "n_head_kv", self.n_head)
        for field in ("n_vocab", "n_embd", "n_layer", "n_head", "n_ff", "n_ctx", "n_head_kv"):
            v = getattr(self, field)
            if not isinstance(v, int) or v <= 0:
                raise FormatError(f"llama hparams: {field} must be a positive integer, got {v!r}")
        if self.n_embd % self.n_head:
            raise FormatError(f"llama hparams: n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if self.n_head % self.n_head_kv:
            raise FormatError(f"llama hparams: n_head {self.n_head} is not a multiple of "
                              f"n_head_kv {self.n_head_kv}")
        if self.n_rot is None:
            object.__setattr__(self, "n_rot", self.head_dim)
        if not isinstance(self.n_rot, int) or self.n_rot <= 0 or self.n_rot % 2 or self.n_rot > self.head_dim:
            raise FormatError(f"llama hparams: n_rot {self.n_rot!r} must be even and at most the "
                              f"head size {self.head_dim}")
        if not self.rms_eps > 0 or not self.rope_freq_base > 0:
            raise FormatError("llama hparams: rms_eps and rope_freq_base must be positive")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        return self.head_dim * self.n_head_kv

    @property
    def n_params(self) -> int:
        """Parameters with the output tied to the embedding."""
        return sum(_numel(s) for s in tensor_shapes(self, tied=True).values())


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def block_name(tensor: MODEL_TENSOR, i: int) -> str:
    return TENSOR_NAMES[tensor].format(bid=i) + ".weight"


def tensor_shapes(hp: LlamaHParams, tied: bool = False) -> dict:
    """{tensor name: numpy-order shape} of a llama model, in llama.cpp's order."""
    e, kv, ff, v = hp.n_embd, hp.n_embd_kv, hp.n_ff, hp.n_vocab
    shapes = {TOKEN_EMBD: (v, e), OUTPUT_NORM: (e,)}
    if not tied:
        shapes[OUTPUT] = (v, e)
    per_block = {
        MODEL_TENSOR.ATTN_NORM: (e,), MODEL_TENSOR.ATTN_Q: (e, e), MODEL_TENSOR.ATTN_K: (kv, e),
        MODEL_TENSOR.ATTN_V: (kv, e), MODEL_TENSOR.ATTN_OUT: (e, e), MODEL_TENSOR.FFN_NORM: (e,),
        MODEL_TENSOR.FFN_GATE: (ff, e), MODEL_TENSOR.FFN_DOWN: (e, ff), MODEL_TENSOR.FFN_UP: (ff, e),
    }
    for i in range(hp.n_layer):
        for t in _BLOCK_TENSORS:
            shapes[block_name(t, i)] = per_block[t]
    return shapes


def hparams_to_kv(hp: LlamaHParams, name: str = "ggtrain", file_type: int | None = None) -> list:
    """The model's GGUF key/values as (key, value, type) tuples, with llama.cpp's types."""
    kv = [
        (Keys.General.ARCHITECTURE, ARCH, VT.STRING),
        (Keys.General.NAME, name, VT.STRING),
    ]
    for field in ("n_vocab", "n_ctx", "n_embd", "n_ff", "n_layer", "n_head", "n_head_kv", "n_rot"):
        kv.append((_INT_KEYS[field], getattr(hp, field), VT.UINT32))
    for field, key in _FLOAT_KEYS.items():
        kv.append((key, float(getattr(hp, field)), VT.FLOAT32))
    if file_type is not None:
        kv.append((Keys.General.FILE_TYPE, int(file_type), VT.UINT32))
    return kv


def check_architecture(f: GGUFFile) -> None:
    """FormatError unless f is a llama model file (with tensors)."""
    arch = f.kv.get(Keys.General.ARCHITECTURE)
    if not f.tensors:
        what = f"architecture {arch.value!r}, " if arch is not None and arch.type == VT.STRING else ""
        raise FormatError(f"{f.path}: a vocab-only GGUF ({what}{len(f.kv)} keys, no tensors): "
                          f"it holds a tokenizer but no model weights")
    if arch is None:
        raise FormatError(f"{f.path}: key {Keys.General.ARCHITECTURE!r} is missing")
    if arch.type != VT.STRING:
        raise FormatError(f"{f.path}: {Keys.General.ARCHITECTURE} has type {arch.type.name}, expected STRING")
    if arch.value != ARCH:
        raise FormatError(f"{f.path}: architecture {arch.value!r} is not supported (ggtrain reads {ARCH!r})")


def hparams_from_kv(f: GGUFFile) -> LlamaHParams:
    """The hyperparameters of a llama model file (architecture checked).

    n_vocab: llama.vocab_size, else the length of tokenizer.ggml.tokens, else the
    rows of token_embd.weight; n_head_kv defaults to n_head, n_rot to the head
    size, rope_freq_base to 10000 (as in llama.cpp).
    """
    check_architecture(f)
    values = {}
    for field, key in _INT_KEYS.items():
        v = f.kv.get(key)
        if v is None:
            continue
        if v.type not in _INT_TYPES:
            raise FormatError(f"{f.path}: {key} has type {v.type.name}, expected an integer (UINT32)")
        values[field] = int(v.value)
    for field, key in _FLOAT_KEYS.items():
        v = f.kv.get(key)
        if v is None:
            continue
        if v.type not in (VT.FLOAT32, VT.FLOAT64):
            raise FormatError(f"{f.path}: {key} has type {v.type.name}, expected FLOAT32")
        # the shortest decimal that is this float32 (1e-05, not 9.999999747378752e-06)
        values[field] = float(str(np.float32(v.value))) if v.type == VT.FLOAT32 else float(v.value)
    missing = [_INT_KEYS.get(k) or _FLOAT_KEYS[k] for k in _REQUIRED if k not in values]
    if missing:
        raise FormatError(f"{f.path}: llama key {missing[0]!r} is missing"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if "n_vocab" not in values:
        tokens = f.kv.get(Keys.Tokenizer.LIST)
        if tokens is not None and tokens.type == VT.ARRAY:
            values["n_vocab"] = len(tokens.value)
        elif TOKEN_EMBD in f.tensors and len(f.tensors[TOKEN_EMBD].shape) == 2:
            values["n_vocab"] = f.tensors[TOKEN_EMBD].shape[0]
        else:
            raise FormatError(f"{f.path}: cannot tell the vocabulary size (no {_INT_KEYS['n_vocab']}, "
                              f"no {Keys.Tokenizer.LIST}, no {TOKEN_EMBD})")
    try:
        return LlamaHParams(**values)
    except FormatError as exc:
        raise FormatError(f"{f.path}: {exc}") from None


@dataclass(frozen=True)
class LlamaLayout:
    """A validated llama model file: hparams, whether output is tied to the
    embedding, and the parameter shapes (numpy order) by tensor name."""

    hparams: LlamaHParams
    tied: bool
    shapes: dict


def validate_model(f: GGUFFile) -> LlamaLayout:
    """Check a GGUF model file against the llama layout; FormatError names the
    first problem (vocab-only file, architecture, missing key, missing tensor,
    wrong shape, unexpected tensor)."""
    hp = hparams_from_kv(f)
    tied = OUTPUT not in f.tensors
    shapes = tensor_shapes(hp, tied)
    for name, shape in shapes.items():
        info = f.tensors.get(name)
        if info is None:
            raise FormatError(f"{f.path}: missing tensor {name!r} (expected shape {shape} for "
                              f"n_layer={hp.n_layer}, n_embd={hp.n_embd})")
        if tuple(info.shape) != shape:
            raise FormatError(f"{f.path}: tensor {name!r} has shape {info.shape}, expected {shape} "
                              f"(n_vocab={hp.n_vocab}, n_embd={hp.n_embd}, n_ff={hp.n_ff}, "
                              f"n_head={hp.n_head}, n_head_kv={hp.n_head_kv})")
    extra = [n for n in f.tensors if n not in shapes and n != ROPE_FREQS]
    if extra and CHECKPOINT_KEY in f.kv:
        raise FormatError(f"{f.path}: a ggtrain training checkpoint, not a model (it holds optimizer state); "
                          f"`ggtrain convert-checkpoint {f.path} MODEL.gguf` writes its model")
    if extra:
        raise FormatError(f"{f.path}: unexpected tensor {extra[0]!r} for a llama model with "
                          f"{hp.n_layer} layers" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    return LlamaLayout(hp, tied, shapes)
