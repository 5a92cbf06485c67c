"""A TinyLlama-1.1B-shaped Q4_0 model for the scale benchmarks (random weights).

Shape of TinyLlama-1.1B (22 blocks, dim 2048, 32 heads on 4 KV heads, FFN 5632, context
2048) with the Llama 2 SPM vocabulary of ../shared/data/gguf/ggml-vocab-llama-spm.gguf.
Written F16 in llama.cpp's layout by gguf-py, then quantized to Q4_0 by llama.cpp's own
quantizer (llama_model_quantize, through llama-cpp-python: the `interop` extra), as a
user's model would be. The result (~640 MB) is cached under bench/.cache/.

    python bench/tinyllama.py          # builds it if needed, prints its path
"""
from __future__ import annotations

import os
import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
CACHE = HERE / ".cache"
SHARED = HERE.parents[1] / "shared" / "data"
VOCAB = SHARED / "gguf" / "ggml-vocab-llama-spm.gguf"
HPARAMS = dict(vocab=32000, dim=2048, layers=22, heads=32, kv_heads=4, ff=5632, ctx=2048)


def _write_f16(path: pathlib.Path) -> None:
    import gguf

    from ggtrain.formats.gguf import read_gguf
    from ggtrain.core.models.config import ModelConfig
    from ggtrain.formats.model import config_to_kv, tensor_shapes

    hp = ModelConfig(**HPARAMS)
    vocab = read_gguf(VOCAB)
    w = gguf.GGUFWriter(str(path), hp.arch)
    for key, value, vt in config_to_kv(hp, "tinyllama-shaped", file_type=1):
        if key == "general.architecture":
            continue
        if vt == gguf.GGUFValueType.STRING:
            w.add_string(key, value)
        elif vt == gguf.GGUFValueType.UINT32:
            w.add_uint32(key, value)
        else:
            w.add_float32(key, value)
    for key, v in vocab.kv.items():
        if key.startswith("tokenizer."):
            value = v.to_python()
            if v.type == gguf.GGUFValueType.ARRAY:
                w.add_array(key, value) if v.item_type != gguf.GGUFValueType.STRING else w.add_array(key, list(value))
            else:
                w.add_key_value(key, value, v.type)
    rng = np.random.default_rng(0)
    for name, shape in tensor_shapes(hp).items():
        if len(shape) == 1:
            w.add_tensor(name, np.ones(shape, np.float32))
        else:
            w.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tinyllama_q4_0() -> pathlib.Path:
    """The path of the cached Q4_0 model, building it first if needed (a few minutes)."""
    out = CACHE / "tinyllama-shaped-Q4_0.gguf"
    if out.is_file():
        return out
    try:
        import llama_cpp
    except ImportError:
        sys.exit("the TinyLlama-shaped model is quantized by llama.cpp: pip install -e '.[interop]'")
    if not VOCAB.is_file():
        sys.exit(f"{VOCAB} is missing (../shared/data beside the repository)")
    CACHE.mkdir(exist_ok=True)
    f16 = CACHE / "tinyllama-shaped-F16.gguf"
    print(f"writing {f16} (random weights, ~2.2 GB) ...", file=sys.stderr)
    _write_f16(f16)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.nthread = 2
    tmp = out.with_suffix(".tmp")
    print(f"quantizing to {out} with llama.cpp ...", file=sys.stderr)
    rc = llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), params)
    if rc != 0:
        sys.exit(f"llama_model_quantize failed ({rc})")
    os.replace(tmp, out)
    f16.unlink()
    return out


if __name__ == "__main__":
    print(tinyllama_q4_0())
