"""What a GGUF file holds, as Python values (layer 5): typed key/values and tensor infos.

A key's value keeps its exact GGUF type (`GGUFValue`; `make_value` builds one from a Python
value and checks that it fits), arrays of strings stay raw bytes until read (`StringArray`),
and a tensor is described by `TensorInfo` (numpy-order shape, ggml type, data offset). The
numbers of the format that both the reader and the writer obey live here too.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType

GGUF_MAGIC = b"GGUF"
MAX_DIMS = 4                 # ggml's GGML_MAX_DIMS

VT = GGUFValueType
SCALARS = {  # value type -> (struct code, numpy dtype)
    VT.UINT8: ("B", np.uint8), VT.INT8: ("b", np.int8), VT.UINT16: ("H", np.uint16),
    VT.INT16: ("h", np.int16), VT.UINT32: ("I", np.uint32), VT.INT32: ("i", np.int32),
    VT.FLOAT32: ("f", np.float32), VT.BOOL: ("B", np.uint8), VT.UINT64: ("Q", np.uint64),
    VT.INT64: ("q", np.int64), VT.FLOAT64: ("d", np.float64),
}
_INT_RANGE = {
    VT.UINT8: (0, 2**8 - 1), VT.INT8: (-2**7, 2**7 - 1), VT.UINT16: (0, 2**16 - 1),
    VT.INT16: (-2**15, 2**15 - 1), VT.UINT32: (0, 2**32 - 1), VT.INT32: (-2**31, 2**31 - 1),
    VT.UINT64: (0, 2**64 - 1), VT.INT64: (-2**63, 2**63 - 1),
}
_NP_TO_VT = {np.dtype(v[1]): k for k, v in SCALARS.items() if k != VT.BOOL}
_NP_TO_VT[np.dtype(np.bool_)] = VT.BOOL


# ---- values -----------------------------------------------------------------

class StringArray(Sequence):
    """A GGUF array of strings, decoded on access.

    Holds the raw array bytes (length prefixes included) and each string's byte
    range, found and UTF-8-checked in one native call, so reading a 150k-token
    vocabulary costs no Python loop; `list(arr)` decodes everything.
    """

    def __init__(self, raw: bytes, bounds: np.ndarray):
        self.raw = raw
        self.bounds = bounds          # (n, 2) int64: [start, stop) of each string in raw

    @classmethod
    def from_strings(cls, items: Iterable[str]) -> "StringArray":
        parts, bounds, pos = [], [], 0
        for s in items:
            b = s.encode("utf-8")
            parts.append(struct.pack("<Q", len(b)))
            parts.append(b)
            bounds.append((pos + 8, pos + 8 + len(b)))
            pos += 8 + len(b)
        arr = np.array(bounds, dtype=np.int64).reshape(-1, 2)
        return cls(b"".join(parts), arr)

    def __len__(self) -> int:
        return len(self.bounds)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        start, stop = self.bounds[i]
        return self.raw[start:stop].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        raw = self.raw
        for start, stop in self.bounds.tolist():
            yield raw[start:stop].decode("utf-8")

    def tolist(self) -> list:
        return list(self)

    def __eq__(self, other) -> bool:
        if isinstance(other, StringArray):
            return self.raw == other.raw
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:4])
        return f"StringArray([{head}{', ...' if len(self) > 4 else ''}], n={len(self)})"


@dataclass(frozen=True)
class GGUFValue:
    """A key's value with its exact GGUF type.

    value: int/float/bool/str for scalars; for arrays a numpy array (numbers,
    bools), a StringArray (strings) or a list of GGUFValue (arrays of arrays).
    item_type: the element type of an array (None for scalars).
    """

    value: Any
    type: GGUFValueType
    item_type: GGUFValueType | None = None

    def to_python(self) -> Any:
        """Plain Python value: numbers, str, bool, or (nested) lists."""
        v = self.value
        if self.type != VT.ARRAY:
            return v
        if isinstance(v, np.ndarray):
            return v.tolist()
        if isinstance(v, StringArray):
            return v.tolist()
        return [x.to_python() for x in v]


def make_value(value: Any, type: GGUFValueType | None = None,
               item_type: GGUFValueType | None = None) -> GGUFValue:
    """A GGUFValue from a Python value, checking it fits `type`.

    Types are inferred only where unambiguous: str -> STRING, bool -> BOOL,
    float -> FLOAT32, a numpy array -> ARRAY of its dtype, a list of str ->
    ARRAY of STRING. Integers need an explicit type (llama.cpp checks u32 vs
    i32), e.g. make_value(32, VT.UINT32), make_value(ids, VT.ARRAY, VT.INT32).
    """
    if isinstance(value, GGUFValue):
        return value
    if type is None:
        if isinstance(value, bool):
            type = VT.BOOL
        elif isinstance(value, str):
            type = VT.STRING
        elif isinstance(value, float):
            type = VT.FLOAT32
        elif isinstance(value, (list, tuple, np.ndarray, StringArray)):
            type = VT.ARRAY
        else:
            raise TypeError(f"GGUF value {value!r}: give its type (integers are ambiguous)")
    type = VT(type)
    if type == VT.ARRAY:
        return _make_array(value, item_type)
    if type == VT.STRING:
        if not isinstance(value, str):
            raise TypeError(f"GGUF STRING value must be str, got {value!r}")
        return GGUFValue(value, type)
    if type == VT.BOOL:
        return GGUFValue(bool(value), type)
    if type in (VT.FLOAT32, VT.FLOAT64):
        return GGUFValue(float(value), type)
    if type in _INT_RANGE:
        if isinstance(value, float) or int(value) != value:
            raise TypeError(f"GGUF {type.name} value must be an integer, got {value!r}")
        lo, hi = _INT_RANGE[type]
        if not lo <= int(value) <= hi:
            raise ValueError(f"GGUF value {value} does not fit {type.name}")
        return GGUFValue(int(value), type)
    raise TypeError(f"unknown GGUF value type {type!r}")


def _make_array(value: Any, item_type: GGUFValueType | None) -> GGUFValue:
    if isinstance(value, StringArray):
        return GGUFValue(value, VT.ARRAY, VT.STRING)
    if item_type is None:
        if isinstance(value, np.ndarray):
            if value.dtype not in _NP_TO_VT:
                raise TypeError(f"GGUF array of dtype {value.dtype} is not supported")
            item_type = _NP_TO_VT[value.dtype]
        elif len(value) and all(isinstance(v, str) for v in value):
            item_type = VT.STRING
        elif len(value) and all(isinstance(v, bool) for v in value):
            item_type = VT.BOOL
        elif len(value) and all(isinstance(v, float) for v in value):
            item_type = VT.FLOAT32
        else:
            raise TypeError("GGUF array: give its item_type (integers and empty arrays are ambiguous)")
    item_type = VT(item_type)
    if item_type == VT.STRING:
        return GGUFValue(StringArray.from_strings(value), VT.ARRAY, VT.STRING)
    if item_type == VT.ARRAY:
        items = [v if isinstance(v, GGUFValue) else make_value(v, VT.ARRAY) for v in value]
        return GGUFValue(items, VT.ARRAY, VT.ARRAY)
    if item_type == VT.BOOL:
        return GGUFValue(np.asarray(value, dtype=np.bool_).reshape(-1), VT.ARRAY, VT.BOOL)
    dtype = np.dtype(SCALARS[item_type][1])
    if isinstance(value, (list, tuple)) and dtype.kind in "iu":
        if not all(isinstance(v, (int, np.integer)) for v in value):
            raise TypeError(f"GGUF {item_type.name} array must hold integers")
        lo, hi = _INT_RANGE[item_type]
        if value and (min(value) < lo or max(value) > hi):
            raise ValueError(f"GGUF array values do not fit {item_type.name}")
        value = np.array(value, dtype=dtype)
    arr = np.asarray(value)
    if arr.size and arr.dtype.kind in "iub" and dtype.kind in "iu":
        lo, hi = _INT_RANGE[item_type]
        if arr.min() < lo or arr.max() > hi:
            raise ValueError(f"GGUF array values do not fit {item_type.name}")
    elif arr.size and arr.dtype.kind == "f" and dtype.kind in "iu":
        raise TypeError(f"GGUF {item_type.name} array given floats")
    return GGUFValue(arr.astype(dtype).reshape(-1), VT.ARRAY, item_type)


# ---- tensors ----------------------------------------------------------------

@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file: shape in numpy order, offset from the data section."""

    name: str
    type: GGMLQuantizationType
    shape: tuple
    offset: int
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n
