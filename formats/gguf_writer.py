"""Writing GGUF files atomically (layer 5): key/value encoding, tensor infos, alignment, tensor data.

`GGUFWriter` and `write_gguf` declare the key/values and tensor infos first, then stream
tensor data one tensor at a time into a temporary file in the target's directory; the file
is flushed, fsynced and renamed over the final name only when every tensor has been
written. On an exception the temporary file is removed. f32 data given for another type is
converted by formats.quants.

Numpy-order shapes become GGUF's innermost-first `ne` order only in `_tensor_info_bytes`
(the reader's `_read_tensor_infos` turns it back).
"""
from __future__ import annotations

import contextlib
import os
import struct
from typing import Any, Iterable, Sequence

import numpy as np
from gguf.constants import (
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
)

from ggtrain.errors import WriteError
from ggtrain.formats.files import commit, discard, open_temporary
from ggtrain.formats.gguf_values import (
    GGUF_MAGIC,
    MAX_DIMS,
    SCALARS,
    VT,
    GGUFValue,
    TensorInfo,
    make_value,
)
from ggtrain.formats.quants import ggml_type, quantize, tensor_nbytes
from ggtrain.native.dtypes import DTYPES

WRITE_VERSION = 3
MAX_TENSOR_NAME = 63         # llama.cpp's limit (GGML_MAX_NAME - 1), enforced when writing


# ---- writing ------------------------------------------------------------------

def _value_bytes(v: GGUFValue) -> bytes:
    t = v.type
    if t == VT.STRING:
        b = v.value.encode("utf-8")
        return struct.pack("<Q", len(b)) + b
    if t != VT.ARRAY:
        code, _ = SCALARS[t]
        return struct.pack("<" + code, int(v.value) if t == VT.BOOL else v.value)
    it = v.item_type
    n = len(v.value)
    head = struct.pack("<IQ", int(it), n)
    if it == VT.STRING:
        return head + v.value.raw
    if it == VT.ARRAY:
        return head + b"".join(_value_bytes(x) for x in v.value)
    _, dtype = SCALARS[it]
    arr = np.asarray(v.value)
    arr = arr.astype(np.uint8) if it == VT.BOOL else arr.astype(np.dtype(dtype).newbyteorder("<"))
    return head + arr.tobytes()


def _string_bytes(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _tensor_info_bytes(name: str, shape: tuple, t: GGMLQuantizationType, offset: int) -> bytes:
    ne = tuple(reversed(shape))                 # numpy order -> ggml ne (innermost first)
    return (_string_bytes(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
            + struct.pack("<IQ", int(t), offset))


class GGUFWriter:
    """Streams a GGUF file to `path` atomically.

        with GGUFWriter(path) as w:
            w.add_kv("general.architecture", "llama")
            w.add_kv("llama.block_count", 5, VT.UINT32)
            w.add_tensor_info("token_embd.weight", (512, 64), "Q8_0")
            w.write_tensor("token_embd.weight", emb)      # f32 -> quantized here
        # now the file exists under `path`; on an exception nothing replaced it

    Tensors are written in the order they were declared, each as soon as it is
    given (f32 data is converted to the declared type in chunks), so a model
    never needs to be in memory twice. The header is written when the first
    tensor arrives (or at the end when there are none).
    """

    def __init__(self, path, alignment: int = GGUF_DEFAULT_ALIGNMENT):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment} is not a power of two")
        self.path = os.fspath(path)
        self.alignment = alignment
        self.kv: dict[str, GGUFValue] = {}
        self.infos: list[TensorInfo] = []
        self._next = 0            # index of the next tensor to write
        self._file = None
        self._tmp = None
        self._done = False
        if alignment != GGUF_DEFAULT_ALIGNMENT:
            self.add_kv("general.alignment", alignment, VT.UINT32)

    # -- declaring --
    def add_kv(self, key: str, value: Any, type: GGUFValueType | None = None,
               item_type: GGUFValueType | None = None) -> None:
        """Add a key/value pair (see make_value for types); keys are unique."""
        if self._file is not None:
            raise RuntimeError("add_kv after tensor data has started")
        if key in self.kv:
            raise ValueError(f"duplicate GGUF key {key!r}")
        self.kv[key] = make_value(value, type, item_type)

    def add_tensor_info(self, name: str, shape: Sequence[int], type_="F32") -> TensorInfo:
        """Declare a tensor (numpy-order shape, ggml type); its data comes later."""
        if self._file is not None:
            raise RuntimeError("add_tensor_info after tensor data has started")
        if any(i.name == name for i in self.infos):
            raise ValueError(f"duplicate tensor name {name!r}")
        if len(name.encode("utf-8")) > MAX_TENSOR_NAME:
            raise ValueError(f"tensor name {name!r} is longer than {MAX_TENSOR_NAME} bytes (llama.cpp's limit)")
        shape = tuple(int(s) for s in shape)
        if len(shape) > MAX_DIMS or any(s < 0 for s in shape):
            raise ValueError(f"tensor {name!r}: bad shape {shape} (at most {MAX_DIMS} dims)")
        t = ggml_type(type_)
        nbytes = tensor_nbytes(shape, t)
        offset = 0
        if self.infos:
            last = self.infos[-1]
            offset = -(-(last.offset + last.nbytes) // self.alignment) * self.alignment
        info = TensorInfo(name, t, shape, offset, nbytes)
        self.infos.append(info)
        return info

    # -- writing --
    def _open(self) -> None:
        fd, self._tmp = open_temporary(self.path)
        self._file = os.fdopen(fd, "wb", buffering=1 << 20)

    @contextlib.contextmanager
    def _io(self):
        """OSErrors of writing (a full disk, a folder not writable) as one WriteError naming the file."""
        try:
            yield
        except OSError as e:
            raise WriteError(f"{self.path}: cannot write: {e.strerror or e}") from e

    def _write_header(self) -> None:
        self._open()
        f = self._file
        f.write(GGUF_MAGIC + struct.pack("<IQQ", WRITE_VERSION, len(self.infos), len(self.kv)))
        for key, v in self.kv.items():
            f.write(_string_bytes(key) + struct.pack("<I", int(v.type)) + _value_bytes(v))
        for info in self.infos:
            f.write(_tensor_info_bytes(info.name, info.shape, info.type, info.offset))
        if self.infos:  # a file without tensors ends right after its metadata (as gguf-py writes it)
            self._pad()
        self._data_start = f.tell()

    def _pad(self) -> None:
        pos = self._file.tell()
        self._file.write(b"\0" * (-pos % self.alignment))

    def write_tensor(self, name: str, data) -> None:
        """Write the next declared tensor's data: raw bytes of the declared type
        (any array/bytes of exactly nbytes), or a float32 array of its shape to be
        converted (F16, BF16, Q8_0, Q4_0 natively)."""
        if self._done:
            raise RuntimeError("the writer is closed")
        if self._next >= len(self.infos):
            raise ValueError(f"tensor {name!r} was not declared (or was already written)")
        info = self.infos[self._next]
        if info.name != name:
            raise ValueError(f"tensors are written in declaration order: expected {info.name!r}, got {name!r}")
        with self._io():
            self._write_data(info, name, data)

    def _write_data(self, info: TensorInfo, name: str, data) -> None:
        if self._file is None:
            self._write_header()
        f = self._file
        assert f.tell() - self._data_start == info.offset
        arr = data if isinstance(data, np.ndarray) else np.frombuffer(memoryview(data), dtype=np.uint8)
        if arr.dtype == np.float32 and info.type != GGMLQuantizationType.F32 and arr.size == info.n_elements:
            if tuple(arr.shape) != info.shape:
                raise ValueError(f"tensor {name!r}: data of shape {arr.shape}, declared {info.shape}")
            rows = arr.reshape(-1, info.shape[-1] if info.shape else 1)
            step = max(1, (16 << 20) // max(1, rows.shape[1] * 4))
            for r in range(0, rows.shape[0], step):
                f.write(quantize(rows[r:r + step], info.type).reshape(-1).data)
        else:
            if arr.dtype == np.float32 and info.type == GGMLQuantizationType.F32 and arr.size == info.n_elements \
                    and tuple(arr.shape) != info.shape:
                raise ValueError(f"tensor {name!r}: data of shape {arr.shape}, declared {info.shape}")
            arr = np.ascontiguousarray(arr)
            if arr.nbytes != info.nbytes:
                raise ValueError(f"tensor {name!r}: {arr.nbytes} bytes given, {info.type.name} "
                                 f"{info.shape} needs {info.nbytes}")
            if arr.dtype.byteorder == ">":
                raise ValueError(f"tensor {name!r}: big-endian data")
            f.write(arr.reshape(-1).view(np.uint8).data)
        self._pad()
        self._next += 1

    def close(self) -> None:
        """Finish: every declared tensor must have been written; fsync and rename."""
        if self._done:
            return
        if self._next != len(self.infos):
            missing = [i.name for i in self.infos[self._next:]]
            raise ValueError(f"{len(missing)} declared tensors were not written: {missing[:5]}")
        with self._io():
            if self._file is None:
                self._write_header()
            f = self._file
            f.flush()
            os.fsync(f.fileno())
            f.close()
            commit(self._tmp, self.path)
        self._done = True

    def abort(self) -> None:
        """Drop the temporary file; the final name is left as it was."""
        self._done = True
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # pragma: no cover
                pass
        discard(self._tmp)

    def __enter__(self) -> "GGUFWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                self.abort()
                raise
        else:
            self.abort()


def write_gguf(path, kv: dict | Iterable, tensors: Iterable, alignment: int = GGUF_DEFAULT_ALIGNMENT,
               progress=None) -> None:
    """Write a whole GGUF file atomically; progress(i, n), if given, is called after each of
    the n tensors is written.

    kv: {key: value or GGUFValue} or (key, value[, type[, item_type]]) tuples.
    tensors: (name, data[, type]) tuples; data is a numpy array (f32 data is
    converted to `type`, default its own: F32/F16/...) or a zero-argument callable
    returning one, called only when that tensor is written (so a model need not
    be in memory at once); for a callable give (name, fn, type, shape).
    """
    items = kv.items() if isinstance(kv, dict) else kv
    specs = list(tensors)
    with GGUFWriter(path, alignment) as w:
        for item in items:
            if isinstance(item, tuple) and len(item) > 2:
                w.add_kv(*item)
            else:
                key, value = item
                w.add_kv(key, value)
        plan = []
        for spec in specs:
            name, data = spec[0], spec[1]
            if callable(data):
                t, shape = spec[2], spec[3]
            else:
                t = spec[2] if len(spec) > 2 else _default_type(data)
                shape = data.shape
            w.add_tensor_info(name, shape, t)
            plan.append((name, data))
        for i, (name, data) in enumerate(plan):
            w.write_tensor(name, data() if callable(data) else data)
            if progress is not None:
                progress(i + 1, len(plan))


def _default_type(arr: np.ndarray) -> GGMLQuantizationType:
    for d in DTYPES.values():
        if d.block == 1 and d.name != "bf16" and arr.dtype == d.numpy:
            return GGMLQuantizationType(d.id)
    raise TypeError(f"no ggml type for dtype {arr.dtype}; give the type")
