"""Loading llama model files for inference (layer 5): config, f32 weights, tokenizer."""
from __future__ import annotations

import numpy as np

from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.llama import validate_model
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
