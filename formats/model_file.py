"""Model files of every family (layer 5): loading config, weights (in their stored types, or as
f32) and tokenizer; writing clean models."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from gguf import GGUFValueType as VT
from gguf.constants import GGML_QUANT_VERSION as QUANTIZATION_VERSION, GGMLQuantizationType

from ggtrain.core.backend import StoredTensor
from ggtrain.core.models.config import ModelConfig
from ggtrain.errors import FormatError
from ggtrain.formats.gguf import GGUFFile, dequantize, read_gguf, write_gguf
from ggtrain.formats.model import FILE_TYPES, OUTPUT, TOKEN_EMBD, config_to_kv, tensor_shapes, validate_model
from ggtrain.formats.tokenizer import tokenizer_from_gguf
from ggtrain.native.dtypes import DTYPES, WEIGHT_TYPES, dtype, nbytes as _nbytes


def _config(layout) -> dict:
    return dataclasses.asdict(layout.config)


def open_model(path, backend) -> tuple:
    """(ModelConfig kwargs, {name: weights}, tokenizer) of a GGUF model of any family, its weights
    read from the file straight into `backend` buffers in the types the file stores them in
    (no f32 copy, no second copy of any kind): matrices as StoredTensor (F32, F16, BF16,
    Q4_0 ... Q6_K), the 1-D norm weights as f32 (StoredTensor when the file has them in
    F32, else a small f32 array).

    Raises FormatError for files that are not models of a family ggtrain computes, and for a tensor in a type no
    kernel reads (naming the tensor, its type and the supported ones).
    """
    f = read_gguf(path)
    layout = validate_model(f)
    for name in layout.shapes:
        info = f.tensors[name]
        if not dtype(int(info.type)).can_dequantize:
            readable = ", ".join(t.upper() for t in WEIGHT_TYPES)
            raise FormatError(f"{f.path}: tensor {name!r} is stored as {info.type.name}, a type ggtrain "
                              f"cannot compute with (it reads {readable})")
    direct = [n for n, shape in layout.shapes.items()
              if len(shape) == 2 or dtype(int(f.tensors[n].type)).name == "f32"]
    loaded = f.load_tensors(direct, backend)
    weights = {}
    for name, shape in layout.shapes.items():
        if name in loaded:
            weights[name] = StoredTensor(loaded[name].buffer, dtype(int(f.tensors[name].type)).name, shape)
        else:  # a norm weight not in F32: small, converted once
            weights[name] = np.ascontiguousarray(f.tensor_f32(name).reshape(shape), np.float32)
    return _config(layout), weights, tokenizer_from_gguf(f)


def load_model(path) -> tuple:
    """(ModelConfig kwargs, {name: f32 weights}, tokenizer) of a GGUF model.

    Quantized tensors (F16, Q8_0, Q4_0, ...) are dequantized to f32 by the native
    kernels. Raises FormatError for files that are not models ggtrain computes.
    """
    f = read_gguf(path)
    layout = validate_model(f)
    weights = {name: np.ascontiguousarray(f.tensor_f32(name).reshape(shape), np.float32)
               for name, shape in layout.shapes.items()}
    return _config(layout), weights, tokenizer_from_gguf(f)


# ---- writing ---------------------------------------------------------------------------

WRITE_TYPES = tuple(n for n, d in DTYPES.items() if d.can_quantize)   # the types ggtrain writes
# keys of a model that are not hparams or vocabulary but that llama.cpp uses: carried from a
# base model into what is trained from it (the merged model, a --full fine-tune, checkpoints)
CARRIED_PREFIXES = ("tokenizer.chat_template",)
_OWN_KEYS = ("general.file_type", "general.quantization_version", "general.alignment")


@dataclass(frozen=True)
class FileTensor:
    """A tensor of a GGUF file, read only when it is written elsewhere."""

    file: GGUFFile
    name: str

    @property
    def dtype(self) -> str:
        return dtype(int(self.file.tensors[self.name].type)).name

    @property
    def shape(self) -> tuple:
        return tuple(self.file.tensors[self.name].shape)


def carried_kv(f: GGUFFile) -> list:
    """The key/values of f that trained models keep (the chat template), as (key, GGUFValue)."""
    return [(k, v) for k, v in f.kv.items() if k.startswith(CARRIED_PREFIXES)]


def check_write_type(out_type: str, what: str = "--out-type") -> str:
    """out_type lower-cased, or FormatError naming the types ggtrain writes."""
    t = str(out_type).lower()
    if t not in WRITE_TYPES:
        raise FormatError(f"{what} {out_type}: not a type ggtrain writes (it writes {', '.join(WRITE_TYPES)})")
    return t


def tensor_type(name: str, shape: tuple, out_type: str, tied: bool = False) -> str:
    """The type a model tensor is written in when a model is written as `out_type`, by
    llama.cpp's quantizer's rules: 1-D tensors stay F32; the output matrix (the embedding
    when it is tied) keeps 8 bits under a 4-bit out_type (llama.cpp's Q6_K, which falls
    back to Q8_0 where rows are not whole Q6_K blocks; ggtrain does not write Q6_K); a
    matrix whose rows are not whole blocks of its type falls back to F16."""
    if len(shape) < 2:
        return "f32"
    t = out_type
    if (name == OUTPUT or (tied and name == TOKEN_EMBD)) and dtype(t).block > 1 and t != "q8_0":
        t = "q8_0"
    if shape[-1] % dtype(t).block:
        t = "f16"
    return t


def _tensor_spec(path, name: str, shape: tuple, value, t: str) -> tuple:
    """(name, read, TYPE, shape) for write_gguf: `value` (an f32 array, a callable returning
    one, a StoredTensor or a FileTensor) written as type t: stored bytes copied when they
    already are t, else converted through f32."""
    shape = tuple(shape)
    if isinstance(value, (StoredTensor, FileTensor)):
        if tuple(value.shape) != shape:
            raise FormatError(f"{path}: tensor {name} has shape {tuple(value.shape)}, expected {shape}")
        if isinstance(value, FileTensor):
            raw = (lambda v=value: v.file.read_tensor(v.name))
        else:
            raw = (lambda v=value: v.buffer.host(_nbytes(v.shape, v.dtype)))
        if value.dtype == t:
            return name, raw, t.upper(), shape
        stored = value.dtype
        value = (lambda raw=raw, stored=stored: dequantize(raw(), stored, shape))
    elif not callable(value) and np.shape(value) != shape:
        raise FormatError(f"{path}: tensor {name} has shape {np.shape(value)}, expected {shape}")

    def read(value=value):
        a = np.ascontiguousarray(value() if callable(value) else value, dtype=np.float32)
        if a.shape != shape:
            raise FormatError(f"{path}: tensor {name} has shape {a.shape}, expected {shape}")
        return a
    return name, read, t.upper(), shape


def _type_kv(types: list, file_type_of: str | None) -> list:
    """general.quantization_version (when a block type is written) and general.file_type."""
    kv = []
    if any(dtype(t).block > 1 for t in types):
        kv.append(("general.quantization_version", QUANTIZATION_VERSION, VT.UINT32))
    if file_type_of is not None:
        ft = FILE_TYPES.get(GGMLQuantizationType[file_type_of.upper()])
        if ft is not None:
            kv.append(("general.file_type", int(ft), VT.UINT32))
    return kv


def save_model(path, config: dict, weights: dict, tokenizer, name: str = "ggtrain",
               out_type: str = "f32", extra_kv=(), progress=None) -> dict:
    """Write a clean llama.cpp model (hparams, tokenizer keys, extra_kv (e.g. carried_kv
    of its base), tensors in llama.cpp's order; nothing else, since llama.cpp refuses extra
    tensors), atomically, one tensor at a time. Returns {tensor name: type written}.

    config: ModelConfig-style keyword arguments; tokenizer: anything with gguf_kv()
    (formats.tokenizer); weights: {tensor name: value} in numpy order, a value being an f32
    array, a zero-argument callable returning one (computed only when that tensor is
    written), a StoredTensor or a FileTensor. out_type: one of WRITE_TYPES; each tensor's
    type is tensor_type(name, shape, out_type). progress: as write_gguf's.
    """
    cfg = ModelConfig(**config)
    tied = cfg.tied
    out_type = check_write_type(out_type, f"{path}: out_type")
    specs, types = [], {}
    for tname, shape in tensor_shapes(cfg).items():
        w = weights.get(tname)
        if w is None:
            raise FormatError(f"{path}: no weights for tensor {tname}")
        types[tname] = tensor_type(tname, shape, out_type, tied)
        specs.append(_tensor_spec(path, tname, shape, w, types[tname]))
    kv = config_to_kv(cfg, name) + _type_kv(list(types.values()), out_type)
    write_gguf(path, kv + list(tokenizer.gguf_kv()) + list(extra_kv), specs, progress=progress)
    return types


def rewrite_model(path, base, replace: dict | None = None, out_type: str | None = None,
                  progress=None) -> dict:
    """Write the model `base` (a path or GGUFFile) again, atomically, with the tensors
    in `replace` ({name: f32 array or callable}, e.g. merged weights) and every tensor as
    tensor_type(out_type) when out_type is given. Without out_type every tensor keeps its
    type: stored bytes are copied, a replaced tensor is written in its base type where
    ggtrain writes that type, else F16 (F32 for 1-D). The base's key/values are kept (its
    tokenizer, chat template, ...), general.file_type follows out_type. Returns {tensor
    name: type written}.
    """
    f = base if isinstance(base, GGUFFile) else read_gguf(base)
    layout = validate_model(f)
    replace = replace or {}
    unknown = [n for n in replace if n not in f.tensors]
    if unknown:
        raise FormatError(f"{f.path}: the model has no tensor {unknown[0]!r}")
    if out_type is not None:
        out_type = check_write_type(out_type)
    specs, types = [], {}
    for tname, info in f.tensors.items():
        shape = tuple(info.shape)
        stored = dtype(int(info.type)).name
        if out_type is not None:
            t = tensor_type(tname, shape, out_type, layout.tied)
        elif tname not in replace:
            t = stored
        else:
            t = stored if stored in WRITE_TYPES else ("f16" if len(shape) > 1 else "f32")
        types[tname] = t
        specs.append(_tensor_spec(path, tname, shape, replace.get(tname, FileTensor(f, tname)), t))
    if out_type is None:    # the base's keys as they are (the writer adds the alignment)
        kv = [(k, v) for k, v in f.kv.items() if k != "general.alignment"]
    else:
        kv = [(k, v) for k, v in f.kv.items() if k not in _OWN_KEYS] + _type_kv(list(types.values()), out_type)
    write_gguf(path, kv, specs, alignment=f.alignment, progress=progress)
    return types
