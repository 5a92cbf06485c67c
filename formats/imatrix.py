"""llama.cpp's importance-matrix files (layer 5), read as llama-quantize reads them, and the
importance each weight matrix is quantized with.

llama-imatrix sums, for every matrix product x @ W^T of the model's blocks, the squares of
the activations x entering it per column, over the tokens of its chunks. Its file (GGUF):
for each weight W, `W.in_sum2` (F32, (n_matrices, n_cols): the sums) and `W.counts` (F32,
(n_matrices, 1): the tokens summed; a 3-D expert tensor's per expert, over the tokens routed
to it), with the keys imatrix.datasets (strings),
imatrix.chunk_count and imatrix.chunk_size (u32). The legacy .dat file it wrote before: i32
n_entries, then per entry i32 name length, the name, i32 ncall, i32 n_values, n_values f32
(means times ncall), then optionally i32 chunk count, i32 length and the dataset's name.

A weight's importance is in_sum2 / count per column (f32; 1 where the count is 0), or for a
legacy entry its values / ncall. llama.cpp's quantizer weights a tensor's scale searches with
its entry when there is one of the tensor's columns (times experts), quantizes a tensor without
an entry as if there were no file, and refuses an entry of another length (except for the token
embedding) and a non-finite value; llama-quantize writes four quantize.imatrix.* keys naming
the file into the model (QuantizeImatrix.kv).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType as VT

from ggtrain.core.models.family import TOKEN_EMBD
from ggtrain.errors import FormatError
from ggtrain.formats.gguf import read_gguf, write_gguf
from ggtrain.native.dtypes import dtype

SUMS, COUNTS = ".in_sum2", ".counts"
KV_DATASETS, KV_CHUNK_COUNT, KV_CHUNK_SIZE = "imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"
META_KEYS = (KV_DATASETS, KV_CHUNK_COUNT, KV_CHUNK_SIZE)
# the keys llama-quantize adds to a model quantized with an imatrix (as kv overrides: strings cut to 127 bytes)
KV_FILE, KV_DATASET = "quantize.imatrix.file", "quantize.imatrix.dataset"
KV_ENTRIES, KV_CHUNKS = "quantize.imatrix.entries_count", "quantize.imatrix.chunks_count"
KV_KEYS = (KV_FILE, KV_DATASET, KV_ENTRIES, KV_CHUNKS)
_KV_STR_MAX = 127


@dataclass(frozen=True)
class Imatrix:
    """An importance-matrix file: path as given, values {weight name: (n_matrices * n_cols,)
    f32 importance}, its datasets and chunk count."""

    path: str
    values: dict
    datasets: tuple = ()
    chunk_count: int = 0

    def importance(self, name: str, shape: tuple) -> np.ndarray | None:
        """The importance a tensor of `shape` (numpy order) is quantized with: (n_cols,), or
        (n_experts, n_cols) for a 3-D tensor; None where the file has no entry (llama.cpp then
        quantizes it without) or, for the token embedding, one of another length. FormatError
        naming the file and the tensor for an entry of another length."""
        v = self.values.get(name)
        if v is None:
            return None
        n_mat = int(np.prod(shape[:-2], dtype=np.int64)) if len(shape) > 2 else 1
        if v.size != n_mat * int(shape[-1]):
            if name == TOKEN_EMBD:
                return None
            raise FormatError(f"{self.path}: entry {name!r} has {v.size} values, the tensor has "
                              f"{n_mat * int(shape[-1])} columns{' (times experts)' if n_mat > 1 else ''}: "
                              f"an importance matrix of another model")
        return v.reshape(n_mat, -1) if len(shape) > 2 else v

    def kv(self) -> list:
        """The (key, value, type) pairs llama-quantize adds to the model: the file as named,
        the first dataset, the number of entries, the chunk count (where known)."""
        out = [(KV_FILE, _cut(self.path), VT.STRING)]
        if self.datasets:
            out.append((KV_DATASET, _cut(self.datasets[0]), VT.STRING))
        out.append((KV_ENTRIES, len(self.values), VT.UINT32))
        if self.chunk_count > 0:
            out.append((KV_CHUNKS, self.chunk_count, VT.UINT32))
        return out


def _cut(s: str) -> str:
    """s as llama-quantize's 128-byte override field keeps it (127 bytes; a UTF-8 sequence cut
    in the middle is dropped, as a Python string cannot hold half a character)."""
    return s.encode()[:_KV_STR_MAX].decode(errors="ignore")


def read_imatrix(path) -> Imatrix:
    """The importance matrix in `path` (GGUF or legacy). FormatError naming the file (and the
    entry) for a file llama-quantize would refuse: not an imatrix, no entries, GGUF without
    llama-imatrix's keys, sums without counts, a non-F32 entry, a non-finite importance."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(4)
    im = _read_gguf(path) if head == b"GGUF" else _read_legacy(path)
    for name, v in im.values.items():
        if not np.isfinite(v).all():
            raise FormatError(f"{path}: entry {name!r} has a non-finite importance "
                              f"({v[~np.isfinite(v)][0]}); llama.cpp refuses it")
    return im


def _read_gguf(path: str) -> Imatrix:
    f = read_gguf(path)
    if not f.tensors:
        raise FormatError(f"{path}: a GGUF file without tensors, not an importance matrix")
    missing = [k for k in META_KEYS if k not in f.kv]
    if missing:
        raise FormatError(f"{path}: not an importance matrix of llama-imatrix (no key {missing[0]}; "
                          f"it writes {', '.join(META_KEYS)})")
    datasets = f.value(KV_DATASETS)
    if not isinstance(datasets, list) or not all(isinstance(d, str) for d in datasets):
        datasets = []
    for key in META_KEYS[1:]:
        if f.kv[key].type != VT.UINT32:
            raise FormatError(f"{path}: key {key} is {f.kv[key].type.name}, expected UINT32")
    pairs = {}
    for tname, info in f.tensors.items():
        for suffix, slot in ((SUMS, 0), (COUNTS, 1)):
            if tname.endswith(suffix) and len(tname) > len(suffix):
                pairs.setdefault(tname[:-len(suffix)], [None, None])[slot] = tname
    values = {}
    for name, (sums_name, counts_name) in sorted(pairs.items()):
        if sums_name is None or counts_name is None:
            raise FormatError(f"{path}: entry {name!r} has {'no sums' if sums_name is None else 'no counts'} "
                              f"({name}{SUMS} and {name}{COUNTS} go together)")
        for t in (sums_name, counts_name):
            if dtype(int(f.tensors[t].type)).name != "f32":
                raise FormatError(f"{path}: tensor {t!r} is {f.tensors[t].type.name}, expected F32")
        sums = f.read_tensor(sums_name).reshape(-1)
        counts = f.read_tensor(counts_name).reshape(-1).astype(np.float64)
        if counts.size == 0 or sums.size % counts.size:
            raise FormatError(f"{path}: entry {name!r}: {sums.size} sums for {counts.size} counts")
        # C's lround, then the count as a float: sums / count per matrix, 1 where it is 0
        n = (np.sign(counts) * np.floor(np.abs(counts) + 0.5)).astype(np.float32)
        per = sums.reshape(counts.size, -1)
        safe = np.where(n > 0, n, np.float32(1))[:, None]
        values[name] = np.where(n[:, None] > 0, per / safe, np.float32(1)).astype(np.float32).reshape(-1)
    return Imatrix(path, values, tuple(datasets), int(f.value(KV_CHUNK_COUNT)))


def _read_legacy(path: str) -> Imatrix:
    with open(path, "rb") as fh:
        data = fh.read()
    pos = 0

    def take(n: int, what: str) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > len(data):
            raise FormatError(f"{path}: not an importance matrix (GGUF or llama-imatrix's legacy .dat): "
                              f"the file ends in {what} (byte {pos} of {len(data)})")
        pos += n
        return data[pos - n:pos]

    (n_entries,) = struct.unpack("<i", take(4, "the entry count"))
    if n_entries < 1 or 16 * n_entries > len(data):     # an entry takes 16 bytes at least
        raise FormatError(f"{path}: not an importance matrix (neither GGUF nor llama-imatrix's legacy .dat: "
                          f"its first 4 bytes would count {n_entries} entries in {len(data)} bytes)")
    values = {}
    for i in range(n_entries):
        (n,) = struct.unpack("<i", take(4, f"entry {i + 1}'s name"))
        name = take(n, f"entry {i + 1}'s name").split(b"\0", 1)[0].decode(errors="replace")
        ncall, nval = struct.unpack("<ii", take(8, f"entry {name!r}"))
        if nval < 1:
            raise FormatError(f"{path}: entry {name!r} has {nval} values")
        sums = np.frombuffer(take(4 * nval, f"entry {name!r}'s values"), "<f4").astype(np.float32)
        values[name] = (sums / np.float32(ncall)).astype(np.float32) if ncall > 0 else sums.copy()
    chunk_count, datasets = 0, ()
    if pos + 4 <= len(data):
        (chunk_count,) = struct.unpack("<i", take(4, "the chunk count"))
        if pos + 4 <= len(data):
            (n,) = struct.unpack("<i", take(4, "the dataset name"))
            if 0 < n <= len(data) - pos:
                datasets = (take(n, "the dataset name").split(b"\0", 1)[0].decode(errors="replace"),)
    return Imatrix(path, values, datasets, chunk_count)


def write_imatrix(path, sums: dict, counts: dict, datasets=(), chunk_count: int = 0, chunk_size: int = 0) -> None:
    """Write llama-imatrix's GGUF file, atomically: sums {weight name: f32 sums of squared
    inputs, (n_cols,) for a matrix, (n_experts, n_cols) for experts} as W.in_sum2 and counts
    {weight name: (n_mat,) rows summed} as W.counts, in name order (ggml's (n_cols, n_mat)
    and (1, n_mat) with a trailing 1 dropped, as gguf stores them), with general.type
    "imatrix" and its three keys."""
    kv = [("general.type", "imatrix"), (KV_DATASETS, [str(d) for d in datasets], VT.ARRAY, VT.STRING),
          (KV_CHUNK_COUNT, int(chunk_count), VT.UINT32), (KV_CHUNK_SIZE, int(chunk_size), VT.UINT32)]
    tensors = []
    for name in sorted(sums):
        n = np.asarray(counts[name], np.float32).reshape(-1)
        v = np.asarray(sums[name], np.float32)
        if v.size % n.size:
            raise ValueError(f"write_imatrix: {name}: {v.size} sums for {n.size} counts")
        tensors.append((name + SUMS, v.reshape(n.size, -1) if n.size > 1 else v.reshape(-1)))
        tensors.append((name + COUNTS, n.reshape(-1, 1) if n.size > 1 else n))
    write_gguf(path, kv, tensors)
