"""IDX files (MNIST's format), raw or gzip-compressed (layer 5).

An IDX file is: two zero bytes, a type byte (0x08 unsigned byte, 0x09 signed byte,
0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64), a dimension count, then one
big-endian uint32 per dimension, then the data, big-endian, row-major. Every check
failure raises FormatError naming the file and what was wrong.
"""
from __future__ import annotations

import gzip
import pathlib
import zlib

import numpy as np

from ggtrain.errors import FormatError

_TYPES = {0x08: np.dtype("u1"), 0x09: np.dtype("i1"), 0x0B: np.dtype(">i2"),
          0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_MAX_BYTES = 1 << 32


def read_idx(path) -> np.ndarray:
    """The array stored in IDX file `path` (.gz decompressed on the fly).

    Raises FormatError for a bad magic number, dimension count, sizes that do not
    match the data, or a damaged gzip stream; FileNotFoundError if absent.
    """
    path = pathlib.Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise FormatError(f"{path}: damaged gzip data ({exc})") from None
    if len(raw) < 4:
        raise FormatError(f"{path}: {len(raw)} bytes is too short for an IDX header")
    if raw[0] != 0 or raw[1] != 0:
        raise FormatError(f"{path}: not an IDX file (magic bytes {raw[:4].hex()}, expected 0000xxNN)")
    dtype = _TYPES.get(raw[2])
    if dtype is None:
        raise FormatError(f"{path}: unknown IDX element type 0x{raw[2]:02x}")
    ndim = raw[3]
    if not 1 <= ndim <= 4:
        raise FormatError(f"{path}: IDX dimension count {ndim} not in 1..4")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise FormatError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header})")
    shape = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, 4))
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    if nbytes > _MAX_BYTES:
        raise FormatError(f"{path}: IDX dimensions {shape} claim {nbytes} bytes")
    if len(raw) - header != nbytes:
        raise FormatError(f"{path}: IDX dimensions {shape} need {nbytes} data bytes, file has {len(raw) - header}")
    return np.frombuffer(raw, dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


_SPLITS = {"train": "train", "test": "t10k"}


def _find(folder: pathlib.Path, stem: str, kind: str) -> pathlib.Path:
    names = [f"{stem}-{kind}-idx{3 if kind == 'images' else 1}-ubyte",
             f"{stem}-{kind}.idx{3 if kind == 'images' else 1}-ubyte"]
    for name in names:
        for candidate in (folder / name, folder / (name + ".gz")):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(f"{folder}: no {stem} {kind} file (looked for {names[0]}[.gz])")


def load_mnist(folder, split: str = "train") -> tuple:
    """MNIST images (N, 28, 28) float32 scaled to [0, 1] and labels (N,) int32.

    split: "train" (train-*) or "test" (t10k-*). Raises FormatError if the files
    do not look like MNIST (shapes, counts, label values).
    """
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: MNIST data folder does not exist")
    stem = _SPLITS[split]
    ipath, lpath = _find(folder, stem, "images"), _find(folder, stem, "labels")
    images, labels = read_idx(ipath), read_idx(lpath)
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise FormatError(f"{ipath}: expected uint8 images of shape (N, 28, 28), got {images.dtype} {images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise FormatError(f"{lpath}: expected uint8 labels of shape (N,), got {labels.dtype} {labels.shape}")
    if labels.shape[0] != images.shape[0]:
        raise FormatError(f"{lpath}: {labels.shape[0]} labels for {images.shape[0]} images in {ipath}")
    if labels.size and labels.max() > 9:
        raise FormatError(f"{lpath}: label {int(labels.max())} is not a digit 0..9")
    return images.astype(np.float32) / 255.0, labels.astype(np.int32)
