"""Llama model files (layer 5): loading config, f32 weights and tokenizer; writing clean models."""
from __future__ import annotations

import numpy as np

from ggtrain.errors import FormatError
from ggtrain.formats.gguf import read_gguf, write_gguf
from ggtrain.formats.llama import LlamaHParams, hparams_to_kv, tensor_shapes, validate_model
from ggtrain.formats.tokenizer import tokenizer_from_gguf


def load_llama(path) -> tuple:
    """(LlamaConfig kwargs, {name: f32 weights}, tokenizer) of a llama GGUF model.

    Quantized tensors (F16, Q8_0, Q4_0, ...) are dequantized to f32 by the native
    kernels. Raises FormatError for files that are not llama models.
    """
    f = read_gguf(path)
    layout = validate_model(f)
    hp = layout.hparams
    config = dict(vocab=hp.n_vocab, dim=hp.n_embd, layers=hp.n_layer, heads=hp.n_head,
                  kv_heads=hp.n_head_kv, ff=hp.n_ff, ctx=hp.n_ctx, rope_dims=hp.n_rot,
                  rope_base=hp.rope_freq_base, norm_eps=hp.rms_eps, tied=layout.tied)
    weights = {name: np.ascontiguousarray(f.tensor_f32(name).reshape(shape), np.float32)
               for name, shape in layout.shapes.items()}
    return config, weights, tokenizer_from_gguf(f)


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
