"""Conversion of tensor data between f32 and the ggml types (layer 5), over the native kernels.

`quantize` and `dequantize` call the C library's row converters; what each ggml type can
do (`QUANTIZABLE`, `DEQUANTIZABLE`) and how many bytes a tensor takes (`tensor_nbytes`) come
from the native dtype table (ggtrain.native.dtypes), the one source of those facts.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
from gguf.constants import GGMLQuantizationType

from ggtrain.errors import UnsupportedOpError
from ggtrain.native import _check, ffi, lib
from ggtrain.native.dtypes import DTYPES, dtype as _dtype, nbytes as _nbytes

_QUANT_THREADS = os.cpu_count() or 1           # quantize converts on this many threads ...
_QUANT_SLAB = 1 << 18                          # ... each at least this many elements

# what the native dtype table says the core can do with each ggml type
# types gt_dequantize_row turns into f32 (and kernels read as frozen weights)
DEQUANTIZABLE = frozenset(GGMLQuantizationType(d.id) for d in DTYPES.values() if d.can_dequantize)
# types the writer can produce from f32 data
QUANTIZABLE = frozenset(GGMLQuantizationType(d.id) for d in DTYPES.values() if d.can_quantize)


def ggml_type(t) -> GGMLQuantizationType:
    """A GGMLQuantizationType from an enum member, its id or its name ("Q8_0")."""
    if isinstance(t, str):
        try:
            return GGMLQuantizationType[t.upper()]
        except KeyError:
            raise ValueError(f"unknown ggml type {t!r}") from None
    return GGMLQuantizationType(t)


def tensor_nbytes(shape: Sequence[int], type_) -> int:
    """Bytes of a tensor of `shape` (numpy order) stored as ggml type `type_` (ValueError
    when the last dim is not a whole number of blocks)."""
    return _nbytes(shape, _dtype(int(ggml_type(type_))))



def dequantize(raw: np.ndarray, type_, shape: Sequence[int]) -> np.ndarray:
    """f32 array of `shape` from the raw bytes of a tensor of ggml type `type_`."""
    t = ggml_type(type_)
    if t not in DEQUANTIZABLE:
        raise UnsupportedOpError(f"no dequantize kernel for ggml type {t.name}")
    shape = tuple(int(s) for s in shape)
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    src = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if src.size != tensor_nbytes(shape, t):
        raise ValueError(f"{src.size} bytes do not hold a {t.name} tensor of shape {shape}")
    out = np.empty(shape, dtype=np.float32)
    _check(lib.gt_dequantize_row(ffi.cast("float *", out.ctypes.data),
                                 ffi.cast("void *", src.ctypes.data), int(t), n),
           f"dequantize {t.name}")
    return out


def quantize(x: np.ndarray, type_, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Raw bytes (uint8, (..., bytes per row)) of f32 `x` stored as a type in QUANTIZABLE. Big
    arrays are converted a slab of rows per thread (the native call releases the GIL; the
    K-quants' scale searches cost ~50-100 ns an element on one core).

    imatrix: (x.shape[-1],) f32 importance of each column (llama.cpp's importance matrix
    values, formats.imatrix; for 3-D x (experts, rows, cols) one row of it per expert), which
    weights the scale searches of the types ggml weights (the K-quants, Q4_0, Q4_1, Q5_0,
    Q5_1) as llama.cpp's quantizer does; ValueError when its length is not x's columns."""
    t = ggml_type(type_)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if t not in QUANTIZABLE:
        can = ", ".join(q.name for q in sorted(QUANTIZABLE, key=int))
        raise UnsupportedOpError(f"cannot quantize to ggml type {t.name} ({can} can)")
    out = np.empty(tensor_nbytes(x.shape, t), dtype=np.uint8)
    cols = x.shape[-1] if x.ndim else 1
    n_rows = x.size // cols if cols else 0
    row_bytes = out.size // n_rows if n_rows else 0
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.ndim == 2 and x.ndim == 3 and imatrix.shape == (x.shape[0], cols):   # one per expert
            return np.stack([quantize(x[e], t, imatrix[e]) for e in range(x.shape[0])])
        if x.ndim < 2 or imatrix.shape != (cols,):
            raise ValueError(f"quantize {t.name}: importance of shape {imatrix.shape} for rows of {x.shape}")

    def run(lo: int, hi: int) -> None:     # rows [lo, hi): all of x when it has no rows
        src, dst = ffi.cast("float *", x.ctypes.data + lo * cols * 4), ffi.cast("void *", out.ctypes.data + lo * row_bytes)
        if imatrix is not None:
            rc = lib.gt_quantize_rows_imatrix(dst, src, ffi.cast("float *", imatrix.ctypes.data), int(t), hi - lo, cols)
        else:
            rc = lib.gt_quantize_row(dst, src, int(t), (hi - lo) * cols if n_rows else x.size)
        _check(rc, f"quantize {t.name}")

    n_threads = min(_QUANT_THREADS, n_rows, max(1, x.size // _QUANT_SLAB))
    if n_threads <= 1:
        run(0, n_rows)
    else:
        bounds = [n_rows * i // n_threads for i in range(n_threads + 1)]
        with ThreadPoolExecutor(n_threads) as pool:
            for _ in pool.map(run, bounds[:-1], bounds[1:]):
                pass
    return out.reshape(x.shape[:-1] + (-1,)) if x.ndim else out
