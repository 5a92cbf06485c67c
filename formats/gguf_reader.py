"""Reading GGUF files (layer 5): a bounds-checked parser and tensor loading without copies.

`read_gguf` parses the header, the key/value pairs and the tensor infos from a read-only
map of the file, checking every count, length, offset and size against the file before
using it: a damaged or foreign file raises FormatError naming what is wrong and where (byte
offset, key or tensor name). Tensor bytes are not touched until asked for:
`GGUFFile.load_tensors(names, backend)` allocates one backend buffer per wanted tensor and
reads its bytes straight into it.

GGUF's innermost-first `ne` order becomes numpy order in `_read_tensor_infos` (the writer's
`_tensor_info_bytes` turns it back). Type ids and value types come from the `gguf` package,
block sizes from the native dtype table.
"""
from __future__ import annotations

import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

from ggtrain.errors import DTypeError, FormatError
from ggtrain.formats.gguf_values import (
    GGUF_MAGIC,
    MAX_DIMS,
    SCALARS,
    VT,
    GGUFValue,
    StringArray,
    TensorInfo,
)
from ggtrain.formats.quants import dequantize
from ggtrain.native import _check, ffi, lib
from ggtrain.native.dtypes import dtype as _dtype

READ_VERSIONS = (2, 3)
HEADER_BYTES = 24            # magic, version, tensor count, kv count
MAX_NAME_BYTES = 65536       # sane limit on key and tensor-name lengths when reading
MAX_ARRAY_DEPTH = 4          # arrays of arrays of ...
_READ_CHUNK = 1 << 30        # largest single read (Linux caps one read near 2 GiB)
_PIECE = 64 << 20            # load_tensors reads in pieces of this size ...
_READ_THREADS = min(4, os.cpu_count() or 1)   # ... on this many threads


def _numpy_view(raw: np.ndarray, shape: tuple, t: GGMLQuantizationType) -> np.ndarray:
    """Raw tensor bytes as numpy: elements for plain types (bf16 as uint16), else
    uint8 (..., bytes per row) for block types."""
    d = _dtype(int(t))
    if not d.is_block:
        return raw.view(d.numpy).reshape(shape)
    if not shape:
        return raw
    return raw.reshape(tuple(shape[:-1]) + (shape[-1] // d.block * d.block_bytes,))


# ---- reading ------------------------------------------------------------------

@dataclass
class LoadedTensor:
    """A tensor read into a backend buffer: its raw file bytes, starting at byte 0."""

    info: TensorInfo
    buffer: Any

    def array(self) -> np.ndarray:
        """Numpy view of the buffer (CPU buffers): see GGUFFile.read_tensor."""
        return _numpy_view(self.buffer.host(self.info.nbytes), self.info.shape, self.info.type)


class _Parser:
    """Bounds-checked little-endian reads from a buffer; errors name the byte offset."""

    def __init__(self, buf, size: int, path: str):
        self.buf = buf
        self.size = size
        self.pos = 0
        self.path = path

    def fail(self, msg: str, at: int | None = None) -> FormatError:
        return FormatError(f"{self.path}: {msg} (at byte {self.pos if at is None else at})")

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain; "
                            f"the file is truncated or damaged")

    def scalar(self, code: str, what: str):
        n = struct.calcsize("<" + code)
        self.need(n, what)
        v = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar("I", what)

    def u64(self, what: str) -> int:
        return self.scalar("Q", what)

    def string(self, what: str, limit: int | None = None) -> str:
        start = self.pos
        n = self.u64(f"length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long, more than the limit of {limit}", start)
        self.need(n, what)
        raw = bytes(self.buf[self.pos:self.pos + n])
        try:
            s = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8", self.pos) from None
        self.pos += n
        return s


class GGUFFile:
    """The parsed metadata of a GGUF file; tensor bytes are read on request.

    path, version, alignment, data_offset (absolute), file_size;
    kv: {key: GGUFValue} in file order; tensors: {name: TensorInfo} in file order.
    """

    def __init__(self, path, version, alignment, data_offset, file_size, kv, tensors):
        self.path = os.fspath(path)
        self.version = version
        self.alignment = alignment
        self.data_offset = data_offset
        self.file_size = file_size
        self.kv: dict[str, GGUFValue] = kv
        self.tensors: dict[str, TensorInfo] = tensors

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, v{self.version}, {len(self.kv)} KV, "
                f"{len(self.tensors)} tensors)")

    def value(self, key: str, default: Any = KeyError) -> Any:
        """The plain Python value of `key` (see GGUFValue.to_python), or `default`."""
        v = self.kv.get(key)
        if v is None:
            if default is KeyError:
                raise FormatError(f"{self.path}: key {key!r} is missing")
            return default
        return v.to_python()

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor named {name!r}") from None

    # -- tensor data --
    def _read_into(self, fd: int, info: TensorInfo, view: memoryview) -> None:
        pos = self.data_offset + info.offset
        done = 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:done + min(_READ_CHUNK, info.nbytes - done)]], pos + done)
            if n <= 0:
                raise FormatError(f"{self.path}: tensor {info.name!r}: file ended after "
                                  f"{done} of {info.nbytes} bytes (was it truncated since it was opened?)")
            done += n

    def _read_many(self, fd: int, jobs: list) -> None:
        """Read (info, memoryview) jobs; big ones in 64 MiB pieces on a few threads
        (the reads release the GIL, and filling fresh pages is what costs)."""
        pieces = []
        for info, view in jobs:
            for start in range(0, max(info.nbytes, 1), _PIECE):
                n = min(_PIECE, info.nbytes - start)
                if n > 0:
                    pieces.append((info, view, start, n))
        total = sum(p[3] for p in pieces)
        n_threads = min(_READ_THREADS, len(pieces), max(1, total // _PIECE))

        def read(piece):
            info, view, start, n = piece
            sub = TensorInfo(info.name, info.type, info.shape, info.offset + start, n)
            self._read_into(fd, sub, view[start:start + n])

        if n_threads <= 1:
            for piece in pieces:
                read(piece)
            return
        with ThreadPoolExecutor(n_threads) as pool:
            for _ in pool.map(read, pieces):
                pass

    def read_tensor(self, name: str) -> np.ndarray:
        """A tensor's raw data as a new numpy array in numpy order: elements for
        F32/F16/F64/I8..I64 (BF16 as uint16), else uint8 (..., bytes per row)."""
        info = self.info(name)
        raw = np.empty(info.nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            self._read_into(f.fileno(), info, memoryview(raw))
        return _numpy_view(raw, info.shape, info.type)

    def tensor_f32(self, name: str) -> np.ndarray:
        """A tensor converted to f32 by the native dequantize kernels."""
        info = self.info(name)
        return dequantize(self.read_tensor(name), info.type, info.shape)

    def load_tensors(self, names: Iterable[str] | None, backend) -> dict:
        """Allocate a backend buffer for each wanted tensor (all when names is None)
        and read its bytes straight into it: {name: LoadedTensor}.

        Bytes go from the file into the buffer's memory (one read per tensor, no
        intermediate copy); backends without host-visible buffers get them through
        copy_in of one tensor at a time.
        """
        infos = [self.info(n) for n in (self.tensors if names is None else names)]
        out = {}
        with open(self.path, "rb", buffering=0) as f:
            fd = f.fileno()
            if os.fstat(fd).st_size < self.file_size:
                raise FormatError(f"{self.path}: the file shrank since it was opened")
            jobs = []
            for info in infos:
                buf = backend.alloc(max(info.nbytes, 1))
                host = getattr(buf, "bytes", None)
                if host is not None:
                    jobs.append((info, memoryview(host)[:info.nbytes]))
                else:  # device memory: stage through host, one tensor at a time
                    tmp = np.empty(info.nbytes, dtype=np.uint8)
                    self._read_many(fd, [(info, memoryview(tmp))])
                    backend.copy_in(buf, 0, tmp)
                    del tmp
                out[info.name] = LoadedTensor(info, buf)
            self._read_many(fd, jobs)
        return out


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF file's header, key/values and tensor infos (no tensor data).

    Raises FormatError for anything that is not a well-formed GGUF v2/v3 file,
    OSError (FileNotFoundError, ...) when the file cannot be opened.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_BYTES:
            head = f.read(4)
            if not head:
                raise FormatError(f"{path}: not a GGUF file (it is empty)")
            if head[:4] != GGUF_MAGIC[:len(head)] or len(head) < 4:
                raise FormatError(_not_gguf(path, head))
            raise FormatError(f"{path}: truncated GGUF file: {size} bytes, "
                              f"the header alone is {HEADER_BYTES}")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(mm, size, path)
    finally:
        try:
            mm.close()
        except BufferError:  # a view is still alive (e.g. in a traceback): unmapped when collected
            pass


def _not_gguf(path: str, head: bytes) -> str:
    """The message for a file whose first bytes are not GGUF's magic (shown as text)."""
    shown = head[:4].decode("latin-1").encode("unicode_escape").decode("ascii").replace('"', '\\"')
    return f'{path}: not a GGUF file (it starts with "{shown}", a GGUF file with "GGUF")'


def _parse(mm, size: int, path: str) -> GGUFFile:
    p = _Parser(mm, size, path)
    magic = bytes(mm[0:4])
    if magic != GGUF_MAGIC:
        raise FormatError(_not_gguf(path, magic))
    p.pos = 4
    version = p.u32("version")
    if version not in READ_VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        if swapped in READ_VERSIONS:
            raise FormatError(f"{path}: big-endian GGUF (version {swapped}) is not supported")
        if version == 1:
            raise FormatError(f"{path}: GGUF version 1 is obsolete and not supported; "
                              f"re-convert the model (versions 2 and 3 are read)")
        raise FormatError(f"{path}: unknown GGUF version {version} (versions 2 and 3 are read)")
    n_tensors = p.u64("tensor count")
    n_kv = p.u64("key/value count")
    # each KV needs >= 13 bytes (key length, type, a u8), each tensor info >= 24
    if n_kv > (size - p.pos) // 13:
        raise p.fail(f"key/value count {n_kv} cannot fit in a {size}-byte file", 16)
    if n_tensors > (size - p.pos) // 24:
        raise p.fail(f"tensor count {n_tensors} cannot fit in a {size}-byte file", 8)

    kv: dict[str, GGUFValue] = {}
    for i in range(n_kv):
        at = p.pos
        key = p.string(f"key of key/value pair {i}", MAX_NAME_BYTES)
        if key in kv:
            raise p.fail(f"duplicate key {key!r}", at)
        vtype = p.u32(f"value type of {key!r}")
        kv[key] = _read_value(p, vtype, key, 0)

    alignment = GGUF_DEFAULT_ALIGNMENT
    if "general.alignment" in kv:
        a = kv["general.alignment"]
        if a.type != VT.UINT32:
            raise FormatError(f"{path}: general.alignment has type {a.type.name}, expected UINT32")
        alignment = a.value
        if alignment == 0 or alignment & (alignment - 1):
            raise FormatError(f"{path}: general.alignment {alignment} is not a power of two")

    tensors = _read_tensor_infos(p, n_tensors)
    data_offset = -(-p.pos // alignment) * alignment
    if tensors:
        if data_offset > size:
            raise FormatError(f"{path}: the data section would start at byte {data_offset}, "
                              f"past the end of the {size}-byte file")
        _check_tensor_layout(tensors, data_offset, size, alignment, path)
    return GGUFFile(path, version, alignment, data_offset, size, kv, tensors)


def _read_value(p: _Parser, vtype: int, key: str, depth: int) -> GGUFValue:
    at = p.pos
    try:
        t = VT(vtype)
    except ValueError:
        raise p.fail(f"key {key!r}: unknown value type {vtype}", at - 4) from None
    if t == VT.STRING:
        return GGUFValue(p.string(f"value of {key!r}"), t)
    if t != VT.ARRAY:
        code, _ = SCALARS[t]
        v = p.scalar(code, f"value of {key!r}")
        return GGUFValue(bool(v) if t == VT.BOOL else v, t)
    # arrays
    if depth >= MAX_ARRAY_DEPTH:
        raise p.fail(f"key {key!r}: arrays nested more than {MAX_ARRAY_DEPTH} deep", at)
    raw_item = p.u32(f"item type of array {key!r}")
    try:
        it = VT(raw_item)
    except ValueError:
        raise p.fail(f"key {key!r}: unknown array item type {raw_item}", p.pos - 4) from None
    n = p.u64(f"length of array {key!r}")
    remain = p.size - p.pos
    if it == VT.STRING:
        if n > remain // 8:
            raise p.fail(f"key {key!r}: array of {n} strings cannot fit in the {remain} bytes left", p.pos - 8)
        start = p.pos
        end = ffi.new("int64_t *")
        view = ffi.from_buffer(p.buf)
        try:
            data = ffi.cast("uint8_t *", view) + start
            # first pass validates (so a damaged count cannot make us allocate), second records
            rc = lib.gt_scan_strings(ffi.NULL, data, remain, n, end)
            if rc == 0:
                bounds = np.empty((n, 2), dtype=np.int64)
                rc = lib.gt_scan_strings(ffi.cast("int64_t *", bounds.ctypes.data), data, remain, n, end)
        finally:
            ffi.release(view)
        if rc:
            try:
                _check(rc)
            except ValueError as exc:
                raise p.fail(f"key {key!r}: {exc}", start) from None
        stop = start + end[0]
        p.pos = stop
        return GGUFValue(StringArray(bytes(p.buf[start:stop]), bounds), VT.ARRAY, it)
    if it == VT.ARRAY:
        if n > remain // 12:
            raise p.fail(f"key {key!r}: array of {n} arrays cannot fit in the {remain} bytes left", p.pos - 8)
        items = []
        for _ in range(n):
            items.append(_read_value(p, VT.ARRAY, key, depth + 1))
        return GGUFValue(items, VT.ARRAY, it)
    _, dtype = SCALARS[it]
    isz = np.dtype(dtype).itemsize
    if n > remain // isz:
        raise p.fail(f"key {key!r}: array of {n} {it.name} values cannot fit in the {remain} bytes left",
                     p.pos - 8)
    arr = np.frombuffer(p.buf, dtype=np.dtype(dtype).newbyteorder("<"), count=n, offset=p.pos)
    arr = arr.astype(np.dtype(dtype)) if it != VT.BOOL else arr != 0
    p.pos += n * isz
    return GGUFValue(arr, VT.ARRAY, it)


def _read_tensor_infos(p: _Parser, n: int) -> dict:
    tensors: dict[str, TensorInfo] = {}
    for i in range(n):
        at = p.pos
        name = p.string(f"name of tensor {i}", MAX_NAME_BYTES)
        if name in tensors:
            raise p.fail(f"duplicate tensor name {name!r}", at)
        n_dims = p.u32(f"dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise p.fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})", p.pos - 4)
        p.need(8 * n_dims, f"dimensions of tensor {name!r}")
        ne = struct.unpack_from(f"<{n_dims}Q", p.buf, p.pos)
        p.pos += 8 * n_dims
        numel = 1
        for d in ne:
            if d >= 2**63:
                raise p.fail(f"tensor {name!r} has a dimension of {d}", at)
            numel *= d
        raw_type = p.u32(f"type of tensor {name!r}")
        try:
            t = GGMLQuantizationType(raw_type)
            d = _dtype(raw_type)
            block, tsize = d.block, d.block_bytes
        except (ValueError, DTypeError):
            raise p.fail(f"tensor {name!r} has unknown ggml type {raw_type}", p.pos - 4) from None
        inner = ne[0] if n_dims else 1
        if inner % block:
            raise p.fail(f"tensor {name!r}: its first dimension {inner} is not a multiple of "
                         f"the {t.name} block size {block}", at)
        offset = p.u64(f"offset of tensor {name!r}")
        shape = tuple(reversed(ne))             # ggml ne (innermost first) -> numpy order
        tensors[name] = TensorInfo(name, t, shape, offset, numel // block * tsize)
    return tensors


def _check_tensor_layout(tensors: dict, data_offset: int, size: int, alignment: int, path: str) -> None:
    data_size = size - data_offset
    for t in tensors.values():
        if t.offset % alignment:
            raise FormatError(f"{path}: tensor {t.name!r}: offset {t.offset} is not a multiple "
                              f"of the alignment {alignment}")
        if t.nbytes > data_size or t.offset > data_size - t.nbytes:
            raise FormatError(f"{path}: tensor {t.name!r}: its {t.nbytes} bytes at data offset "
                              f"{t.offset} (byte {data_offset + t.offset}) run past the end of the "
                              f"{size}-byte file")
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset and a.nbytes and b.nbytes:
            raise FormatError(f"{path}: tensors {a.name!r} (bytes {a.offset}..{a.offset + a.nbytes}) "
                              f"and {b.name!r} (from {b.offset}) overlap")
