"""Model files of every family (layer 5): loading config, weights (in their stored types, or as
f32) and tokenizer; writing clean models."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from gguf import GGUFValueType as VT
from gguf.constants import GGML_QUANT_VERSION as QUANTIZATION_VERSION

from ggtrain.core.backend import StoredTensor
from ggtrain.core.models.config import ModelConfig
from ggtrain.errors import FormatError
from ggtrain.formats.gguf import GGUFFile, read_gguf, write_gguf
from ggtrain.formats.quants import dequantize, quantize
from ggtrain.formats.imatrix import Imatrix
from ggtrain.formats.mixture import llama_order, mixture, needs_imatrix, quantizable, tensor_types
from ggtrain.formats.model import config_to_kv, tensor_shapes, validate_model
from ggtrain.formats.tokenizer import tokenizer_from_gguf
from ggtrain.native.dtypes import DTYPES, WEIGHT_TYPES, dtype, nbytes as _nbytes


def _config(layout) -> dict:
    return dataclasses.asdict(layout.config)


def open_model(path, backend, file: GGUFFile | None = None) -> tuple:
    """(ModelConfig kwargs, {name: weights}, tokenizer) of a GGUF model of any family, its weights
    read from the file straight into `backend` buffers in the types the file stores them in
    (no f32 copy, no second copy of any kind): matrices as StoredTensor (F32, F16, BF16,
    Q4_0 ... Q6_K), the 1-D norm weights as f32 (StoredTensor when the file has them in
    F32, else a small f32 array).

    file: the file already read (read_gguf(path)), so its header is parsed once.
    Raises FormatError for files that are not models of a family ggtrain computes, and for a tensor in a type no
    kernel reads (naming the tensor, its type and the supported ones).
    """
    f = file if file is not None else read_gguf(path)
    layout = validate_model(f)
    for name in layout.shapes:
        info = f.tensors[name]
        if not dtype(int(info.type)).can_dequantize:
            readable = ", ".join(t.upper() for t in WEIGHT_TYPES)
            raise FormatError(f"{f.path}: tensor {name!r} is stored as {info.type.name}, a type ggtrain "
                              f"cannot compute with (it reads {readable})")
    direct = [n for n, shape in layout.shapes.items()
              if len(shape) >= 2 or dtype(int(f.tensors[n].type)).name == "f32"]
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

WRITE_TYPES = tuple(n for n, d in DTYPES.items() if d.can_quantize)   # the tensor types ggtrain writes
# (the types a model is written as, mixtures of these by llama.cpp's rules: formats.mixture.OUT_TYPES)
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
    """out_type lower-cased: one of formats.mixture.OUT_TYPES, or FormatError naming them."""
    return mixture(out_type, what).name


def model_types(out_type: str, tensors: dict, cfg: ModelConfig, imatrix: bool = False) -> dict:
    """{name: type written} of a model written as `out_type` (a mixture of OUT_TYPES, by
    llama.cpp's rules, with an importance matrix or without): tensors {name: (numpy-order
    shape, the type it comes in)}."""
    return tensor_types(mixture(out_type), tensors, cfg, imatrix)


def importances(path, out_type: str, imatrix: Imatrix | None, tensors: dict, types: dict) -> dict:
    """{name: importance (formats.imatrix) or None} of the tensors written as another type
    than they come in (tensors {name: (shape, type it comes in)}), as llama.cpp's quantizer
    weights them. FormatError (nothing is written yet) for a tensor the mixture quantizes only
    with an importance matrix when there is none or it has no entry for it, an entry of
    another length, and an imatrix none of whose entries names a matrix of the model."""
    mix = mixture(out_type)
    out = {}
    for name, (shape, stored) in tensors.items():
        if types[name] == stored:
            continue
        v = imatrix.importance(name, tuple(shape)) if imatrix is not None else None
        if v is None and needs_imatrix(mix, name, types[name]):
            if imatrix is None:
                raise FormatError(f"{path}: {mix.name} writes {name} as {types[name].upper()}, which llama.cpp's "
                                  f"quantizer does only with an importance matrix (--imatrix)")
            raise FormatError(f"{imatrix.path}: no entry for {name}, which {mix.name} writes as "
                              f"{types[name].upper()} (only with an importance matrix, as llama.cpp's quantizer)")
        out[name] = v
    if imatrix is not None and not any(n in imatrix.values for n, (shape, _) in tensors.items()
                                       if quantizable(n, tuple(shape))):
        raise FormatError(f"{imatrix.path}: none of its {len(imatrix.values)} entries names a matrix of "
                          f"{path}: an importance matrix of another model")
    return out


def default_out_type(base_type: str) -> str:
    """The out_type a model trained or merged from a base whose matrices are base_type is written
    as by default: that type where ggtrain writes it and it has at least 8 bits a weight (F32,
    F16, BF16, Q8_0), else F16, as llama.cpp's llama-export-lora writes merges: rounded back
    onto a 4-bit grid, W + dW mostly lands on W again."""
    return base_type if base_type in WRITE_TYPES and dtype(base_type).bits >= 8 else "f16"


def merged_type(stored: str, shape: tuple) -> str:
    """The type a merged (or otherwise changed) tensor stored as `stored` is written in when no
    out_type is given: default_out_type's for a matrix, F32 for a 1-D tensor."""
    return default_out_type(stored) if len(shape) > 1 else "f32"


def requantized(stored: dict, types: dict) -> list:
    """[(name, stored type, written type)] of the tensors stored in a block type and written in
    another (llama.cpp's quantizer asks --allow-requantize for these: both roundings stay)."""
    return [(n, s, types[n]) for n, s in stored.items() if dtype(s).is_block and types[n] != s]


def _stored_type(value) -> str:
    return value.dtype if isinstance(value, (StoredTensor, FileTensor)) else "f32"


def _check_convertible(path, stored: dict, types: dict) -> None:
    """FormatError for a tensor to be written in another type than it is stored in, where ggtrain
    cannot read its type (nothing is written)."""
    for name, s in stored.items():
        if types[name] != s and not dtype(s).can_dequantize:
            readable = ", ".join(t.upper() for t in WEIGHT_TYPES)
            raise FormatError(f"{path}: tensor {name!r} is {s.upper()}, which ggtrain cannot read to write it as "
                              f"{types[name].upper()} (it reads {readable})")


def _tensor_spec(path, name: str, shape: tuple, value, t: str, observe=None, importance=None) -> tuple:
    """(name, read, TYPE, shape) for write_gguf: `value` (an f32 array, a callable returning
    one, a StoredTensor or a FileTensor) written as type t: stored bytes copied when they
    already are t, else converted through f32 (quantized with `importance`, formats.imatrix,
    where given). observe(name, t, f32 values, bytes written), if given, sees a converted
    tensor as it is written."""
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
        if observe is None and importance is None:
            return a
        raw = a if t == "f32" else quantize(a, t, importance)
        if observe is not None:
            observe(name, t, a, raw)
        return raw
    return name, read, t.upper(), shape


def _type_kv(types: list, out_type: str | None, imatrix: Imatrix | None = None) -> list:
    """general.quantization_version (when a block type is written), general.file_type (the
    mixture's) and, quantized with an importance matrix, the keys llama-quantize adds for it."""
    kv = []
    if any(dtype(t).block > 1 for t in types):
        kv.append(("general.quantization_version", QUANTIZATION_VERSION, VT.UINT32))
    if out_type is not None:
        kv.append(("general.file_type", int(mixture(out_type).file_type), VT.UINT32))
    return kv + (imatrix.kv() if imatrix is not None else [])


def save_model(path, config: dict, weights: dict, tokenizer, name: str = "ggtrain",
               out_type: str = "f32", extra_kv=(), progress=None, imatrix: Imatrix | None = None) -> dict:
    """Write a clean llama.cpp model (hparams, tokenizer keys, extra_kv (e.g. carried_kv
    of its base), tensors in llama.cpp's order; nothing else, since llama.cpp refuses extra
    tensors), atomically, one tensor at a time. Returns {tensor name: type written}.

    config: ModelConfig-style keyword arguments; tokenizer: anything with gguf_kv()
    (formats.tokenizer); weights: {tensor name: value} in numpy order, a value being an f32
    array, a zero-argument callable returning one (computed only when that tensor is
    written), a StoredTensor or a FileTensor. out_type: one of OUT_TYPES (formats.mixture),
    each tensor's type by its rules (model_types), quantized with the importance matrix
    `imatrix` (formats.imatrix) where given. progress: as write_gguf's.
    """
    cfg = ModelConfig(**config)
    out_type = check_write_type(out_type, f"{path}: out_type")
    shapes = tensor_shapes(cfg)
    for tname in shapes:
        if weights.get(tname) is None:
            raise FormatError(f"{path}: no weights for tensor {tname}")
    stored = {tname: _stored_type(weights[tname]) for tname in shapes}
    tensors = {tname: (shape, stored[tname]) for tname, shape in shapes.items()}
    types = model_types(out_type, tensors, cfg, imatrix is not None)
    _check_convertible(path, stored, types)
    imp = importances(path, out_type, imatrix, tensors, types)
    specs = [_tensor_spec(path, tname, shape, weights[tname], types[tname], importance=imp.get(tname))
             for tname, shape in shapes.items()]
    kv = config_to_kv(cfg, name) + _type_kv(list(types.values()), out_type) + list(tokenizer.gguf_kv())
    kv += list(extra_kv) + (imatrix.kv() if imatrix is not None else [])
    write_gguf(path, kv, specs, progress=progress)
    return types


def rewrite_model(path, base, replace: dict | None = None, out_type: str | None = None,
                  progress=None, observe=None, imatrix: Imatrix | None = None) -> dict:
    """Write the model `base` (a path or GGUFFile) again, atomically, with the tensors
    in `replace` ({name: f32 array or callable}, e.g. merged weights) and every tensor as
    out_type's rules give (model_types) when out_type is given, in the order llama.cpp's
    quantizer writes them (mixture.llama_order: with the same keys, its file byte for byte).
    Without out_type the tensors keep their order, the others their bytes, and a replaced tensor
    is written as merged_type gives. The base's
    key/values are kept (its tokenizer, chat template, ...), general.file_type follows out_type.
    imatrix (formats.imatrix, with out_type only): the importance matrix the tensors are
    quantized with, as llama-quantize --imatrix (its keys replace the base's). observe: as
    _tensor_spec's, for the replaced tensors. Returns {tensor name: type written}.
    """
    f = base if isinstance(base, GGUFFile) else read_gguf(base)
    layout = validate_model(f)
    replace = replace or {}
    unknown = [n for n in replace if n not in f.tensors]
    if unknown:
        raise FormatError(f"{f.path}: the model has no tensor {unknown[0]!r}")
    stored = {tname: dtype(int(info.type)).name for tname, info in f.tensors.items()}
    imp = {}
    if out_type is not None:
        out_type = check_write_type(out_type)
        types = model_types(out_type, {n: (tuple(i.shape), stored[n]) for n, i in f.tensors.items()}, layout.config,
                            imatrix is not None)
        came = {n: (tuple(i.shape), "f32" if n in replace else stored[n]) for n, i in f.tensors.items()}
        imp = importances(f.path, out_type, imatrix, came, types)
    elif imatrix is not None:
        raise FormatError(f"{path}: an importance matrix is for quantizing to an out_type")
    else:
        types = {n: merged_type(stored[n], tuple(i.shape)) if n in replace else stored[n] for n, i in f.tensors.items()}
    _check_convertible(f.path, {n: s for n, s in stored.items() if n not in replace}, types)
    order = list(f.tensors) if out_type is None else llama_order(f.tensors)
    specs = [_tensor_spec(path, tname, tuple(f.tensors[tname].shape), replace.get(tname, FileTensor(f, tname)),
                          types[tname], observe if tname in replace else None, imp.get(tname))
             for tname in order]
    if out_type is None:    # the base's keys as they are (the writer adds the alignment)
        kv = [(k, v) for k, v in f.kv.items() if k != "general.alignment"]
    else:
        own = _OWN_KEYS + tuple(item[0] for item in (imatrix.kv() if imatrix is not None else ()))
        kv = [(k, v) for k, v in f.kv.items() if k not in own] + _type_kv(list(types.values()), out_type, imatrix)
    write_gguf(path, kv, specs, alignment=f.alignment, progress=progress)
    return types
