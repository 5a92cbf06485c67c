"""Llama model files (layer 5): loading config, weights (in their stored types, or as f32) and
tokenizer; writing clean models."""
from __future__ import annotations

import numpy as np

from ggtrain.core.backend import StoredTensor
from ggtrain.errors import FormatError
from ggtrain.formats.gguf import read_gguf, write_gguf
from ggtrain.formats.llama import LlamaHParams, hparams_to_kv, tensor_shapes, validate_model
from ggtrain.formats.tokenizer import tokenizer_from_gguf
from ggtrain.native.dtypes import WEIGHT_TYPES, dtype


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


def save_llama(path, config: dict, weights: dict, tokenizer, name: str = "ggtrain") -> None:
    """Write a clean llama.cpp model (hparams, tokenizer keys, F32 tensors in llama.cpp's
    order; nothing else, since llama.cpp refuses extra tensors), atomically.

    config: LlamaConfig-style keyword arguments; weights: {tensor name: f32 array} in
    numpy order; tokenizer: anything with gguf_kv() (formats.tokenizer).
    """
    hp = config_to_hparams(config)
    tied = bool(config.get("tied", False))
    shapes = tensor_shapes(hp, tied)
    tensors = []
    for tname, shape in shapes.items():
        w = weights.get(tname)
        if w is None:
            raise FormatError(f"{path}: no weights for tensor {tname}")
        w = np.ascontiguousarray(w, dtype=np.float32)
        if w.shape != tuple(shape):
            raise FormatError(f"{path}: tensor {tname} has shape {w.shape}, expected {shape}")
        tensors.append((tname, w, "F32"))
    kv = hparams_to_kv(hp, name, file_type=0) + list(tokenizer.gguf_kv())
    write_gguf(path, kv, tensors)
