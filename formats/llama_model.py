"""Llama model files (layer 5): loading config, weights (in their stored types, or as f32) and
tokenizer; writing clean models."""
from __future__ import annotations

import numpy as np
from gguf.constants import GGMLQuantizationType

from ggtrain.core.backend import StoredTensor
from ggtrain.errors import FormatError
from ggtrain.formats.gguf import read_gguf, write_gguf
from ggtrain.formats.llama import FILE_TYPES, LlamaHParams, hparams_to_kv, tensor_shapes, validate_model
from ggtrain.formats.tokenizer import tokenizer_from_gguf
from ggtrain.native.dtypes import DTYPES, WEIGHT_TYPES, dtype, nbytes as _nbytes


def _config(layout) -> dict:
    hp = layout.hparams
    return dict(vocab=hp.n_vocab, dim=hp.n_embd, layers=hp.n_layer, heads=hp.n_head,
                kv_heads=hp.n_head_kv, ff=hp.n_ff, ctx=hp.n_ctx, rope_dims=hp.n_rot,
                rope_base=hp.rope_freq_base, norm_eps=hp.rms_eps, tied=layout.tied)


def open_llama(path, backend) -> tuple:
    """(LlamaConfig kwargs, {name: weights}, tokenizer) of a llama GGUF model, its weights
    read from the file straight into `backend` buffers in the types the file stores them in
    (no f32 copy, no second copy of any kind): matrices as StoredTensor (F32, F16, BF16,
    Q4_0 ... Q6_K), the 1-D norm weights as f32 (StoredTensor when the file has them in
    F32, else a small f32 array).

    Raises FormatError for files that are not llama models, and for a tensor in a type no
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


def load_llama(path) -> tuple:
    """(LlamaConfig kwargs, {name: f32 weights}, tokenizer) of a llama GGUF model.

    Quantized tensors (F16, Q8_0, Q4_0, ...) are dequantized to f32 by the native
    kernels. Raises FormatError for files that are not llama models.
    """
    f = read_gguf(path)
    layout = validate_model(f)
    weights = {name: np.ascontiguousarray(f.tensor_f32(name).reshape(shape), np.float32)
               for name, shape in layout.shapes.items()}
    return _config(layout), weights, tokenizer_from_gguf(f)


def config_to_hparams(config: dict) -> LlamaHParams:
    """LlamaHParams for LlamaConfig-style keyword arguments (vocab, dim, layers, ...)."""
    return LlamaHParams(n_vocab=config["vocab"], n_embd=config["dim"], n_layer=config["layers"],
                        n_head=config["heads"], n_ff=config["ff"], n_ctx=config["ctx"],
                        n_head_kv=config.get("kv_heads") or config["heads"],
                        n_rot=config.get("rope_dims") or None,
                        rms_eps=float(config.get("norm_eps", 1e-5)),
                        rope_freq_base=float(config.get("rope_base", 10000.0)))


def save_llama(path, config: dict, weights: dict, tokenizer, name: str = "ggtrain",
               out_type: str = "f32") -> None:
    """Write a clean llama.cpp model (hparams, tokenizer keys, tensors in llama.cpp's order;
    nothing else, since llama.cpp refuses extra tensors), atomically, one tensor at a time.

    config: LlamaConfig-style keyword arguments; tokenizer: anything with gguf_kv()
    (formats.tokenizer); weights: {tensor name: value} in numpy order, a value being an f32
    array, a zero-argument callable returning one (computed only when that tensor is
    written), or a StoredTensor (its bytes copied in their stored type). out_type: the type
    f32 matrices are written in (f32, f16, bf16, q8_0, q4_0); 1-D tensors stay F32, and a
    matrix whose rows are not whole blocks of out_type falls back to F16, as llama.cpp's
    quantizer does.
    """
    hp = config_to_hparams(config)
    tied = bool(config.get("tied", False))
    shapes = tensor_shapes(hp, tied)
    target = dtype(out_type)
    if not target.can_quantize:
        writable = ", ".join(n for n, d in DTYPES.items() if d.can_quantize)
        raise FormatError(f"{path}: cannot write tensors as {out_type} (ggtrain writes {writable})")
    tensors = []
    for tname, shape in shapes.items():
        w = weights.get(tname)
        if w is None:
            raise FormatError(f"{path}: no weights for tensor {tname}")
        shape = tuple(shape)
        if isinstance(w, StoredTensor):
            if tuple(w.shape) != shape:
                raise FormatError(f"{path}: tensor {tname} has shape {w.shape}, expected {shape}")
            nbytes = _nbytes(shape, w.dtype)
            tensors.append((tname, lambda w=w, n=nbytes: w.buffer.bytes[:n], w.dtype.upper(), shape))
            continue
        t = target if len(shape) == 2 else dtype("f32")
        if shape[-1] % t.block:
            t = dtype("f16")

        def value(w=w, tname=tname, shape=shape):
            a = np.ascontiguousarray(w() if callable(w) else w, dtype=np.float32)
            if a.shape != shape:
                raise FormatError(f"{path}: tensor {tname} has shape {a.shape}, expected {shape}")
            return a
        if not callable(w) and np.shape(w) != shape:
            raise FormatError(f"{path}: tensor {tname} has shape {np.shape(w)}, expected {shape}")
        tensors.append((tname, value, t.name.upper(), shape))
    file_type = FILE_TYPES.get(GGMLQuantizationType[target.name.upper()])
    kv = hparams_to_kv(hp, name, file_type=int(file_type) if file_type is not None else None)
    write_gguf(path, kv + list(tokenizer.gguf_kv()), tensors)
