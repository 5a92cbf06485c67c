"""The numerics a model computes in (layer 3): one value, one name, from the command line's
`--numerics` through the decoder's options and the op table to the kernels.

    exact   f32 everywhere, every product and sum as written (training always computes so;
            the reference the gradients are checked against)
    llama   llama.cpp's CPU numbers, bit for bit: products with quantized weights take
            activations rounded to 8 bits (blocks of 32, 256 for the K-quants) and integer
            dots, F32/F16 weights its float orders (tinyBLAS' 16 lanes, vec_dot's 64), its
            norms' double sums, rope angles, attention order and exp, swiglu, Gemma's f16-table
            gelu, and optionally its F16 KV cache's rounding. Inference only (no gradient);
            only the CPU backend has these kernels (a GPU has no reason to copy a CPU's rounding).

An op that exists only for llama numbers says so in its OpDef (`numerics=LLAMA`); an op with
both modes takes `numerics=` as a parameter.
"""
from __future__ import annotations

EXACT = "exact"
LLAMA = "llama"
NUMERICS = (EXACT, LLAMA)


def check_numerics(value: str) -> str:
    """value when it names a numerics; ValueError listing them otherwise."""
    if value not in NUMERICS:
        raise ValueError(f"numerics {value!r}: expected {' or '.join(NUMERICS)}")
    return value
