"""The dtype table of the native core (layer 1), read once from C; every size comes from here.

C owns the facts (native/cpu/dtype.c: name, ggml type id, block size, bytes per block,
what the kernels can do with the type); this module only turns the table into Python
records and answers `nbytes(shape, dtype)`, the one way a tensor's size is computed.

Names are ggml's in lower case: element types "f32", "f16", "bf16", "i32" (and the
storage-only "i8", "i16", "i64", "f64"), block types "q4_0" ... "q6_k" (and the types
GGUF files may hold that no kernel reads, "iq2_xxs", ...). `dtype()` also accepts ggml's
upper-case names, type ids and gguf.GGMLQuantizationType members.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ggtrain.errors import DTypeError, ShapeError
from ggtrain.native import ffi, lib


@dataclass(frozen=True)
class DType:
    """One row of the table: a tensor of this type stores `block` elements per
    `block_bytes` bytes, in rows of whole blocks along its last dim."""

    name: str
    id: int
    block: int
    block_bytes: int
    flags: int

    @property
    def is_block(self) -> bool:
        return bool(self.flags & lib.GT_DTYPE_BLOCK)

    @property
    def is_float(self) -> bool:
        return bool(self.flags & lib.GT_DTYPE_FLOAT)

    @property
    def is_int(self) -> bool:
        return bool(self.flags & lib.GT_DTYPE_INT)

    @property
    def can_dequantize(self) -> bool:
        """Kernels read it (gt_dequantize_row turns it into f32)."""
        return bool(self.flags & lib.GT_DTYPE_DEQUANTIZE)

    @property
    def can_quantize(self) -> bool:
        """gt_quantize_row writes it from f32."""
        return bool(self.flags & lib.GT_DTYPE_QUANTIZE)

    @property
    def bits(self) -> float:
        """Bits per element (Q4_1: 5.0, Q8_0: 8.5, Q6_K: 6.5625)."""
        return 8 * self.block_bytes / self.block

    @property
    def itemsize(self) -> int:
        """Bytes per element of an element type; DTypeError for a block type."""
        if self.block != 1:
            raise DTypeError(f"{self.name} is a block type ({self.block} elements in "
                             f"{self.block_bytes} bytes): it has no per-element size")
        return self.block_bytes

    @property
    def numpy(self) -> np.dtype:
        """How numpy holds it: the element dtype (bf16 as its uint16 bits), uint8 bytes
        for block types."""
        if self.block != 1:
            return np.dtype(np.uint8)
        kind = "f" if self.is_float and self.name != "bf16" else ("u" if self.name == "bf16" else "i")
        return np.dtype(f"<{kind}{self.block_bytes}")

    def __str__(self) -> str:
        return self.name


def _read_table() -> dict:
    table = {}
    for i in range(lib.gt_dtype_count()):
        t = lib.gt_dtype_at(i)
        name = ffi.string(t.name).decode("ascii")
        table[name] = DType(name, int(t.id), int(t.block), int(t.block_bytes), int(t.flags))
    return table


DTYPES: dict = _read_table()          # name -> DType, in the table's order
_BY_ID = {d.id: d for d in DTYPES.values()}
# the element types graph tensors compute in (kernels have them as inputs and outputs)
ELEMENT_TYPES = ("f32", "f16", "bf16", "i32")
# types a frozen weight may be stored in and kernels read (matmul, get_rows)
WEIGHT_TYPES = tuple(n for n, d in DTYPES.items() if d.can_dequantize)


def dtype(t) -> DType:
    """The DType of a name ("q4_0" or "Q4_0"), a ggml type id or enum member, or a DType.

    Raises DTypeError naming the unknown type.
    """
    if isinstance(t, DType):
        return t
    if isinstance(t, str):
        d = DTYPES.get(t.lower())
        if d is None:
            raise DTypeError(f"unknown dtype {t!r} (known: {', '.join(DTYPES)})")
        return d
    try:
        d = _BY_ID.get(int(t))
    except (TypeError, ValueError):
        d = None
    if d is None:
        raise DTypeError(f"unknown ggml type {t!r}")
    return d


def nbytes(shape: Sequence[int], t) -> int:
    """Bytes of a tensor of `shape` (numpy order) stored as dtype `t`.

    A block type needs the last dim to be a whole number of blocks (ShapeError otherwise);
    a scalar counts as one element.
    """
    d = dtype(t)
    n, inner = 1, 1
    for s in shape:
        n *= int(s)
    if len(shape):
        inner = int(shape[-1])
    if inner % d.block:
        raise ShapeError(f"{d.name} stores rows of whole {d.block}-element blocks: the last dim "
                         f"of shape {tuple(shape)} is not a multiple of {d.block}")
    return n // d.block * d.block_bytes
