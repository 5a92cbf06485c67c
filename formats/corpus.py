"""Data files as token files (layer 5): plain-text corpora tokenized once, as a stream, in
parallel, into a memory-mapped file, and the samples of record files made once, in parallel;
later runs, and resumed ones, open them in a moment.

`corpus_tokens(path, tokenizer, add_bos=..., cache_dir=..., progress=...)` returns a
`TokenFile` whose `ids` (n,) int32 are exactly `tokenizer.encode(text, add_bos)` of the whole
file read as text (a leading UTF-8 byte order mark dropped), without ever holding the text or
a Python list of its ids. The file must be plain text (formats/datafile.py): records, a binary
file or bytes that are not UTF-8 are a FormatError naming the line and column, found in one
pass over the bytes before anything is tokenized (about 2 s/GB; none on a cache hit).

- the file is read in blocks of BLOCK bytes; a character cut by a block's end waits for the
  next block, and the text is cut only where the tokenizer allows (`Tokenizer.cut`: no token
  can span the cut), so encoding the pieces one after another gives the ids of the whole;
- pieces are encoded by `workers` forked processes, in order, at most 2 per worker in
  flight, so memory holds a few blocks; the ids go straight to the token file.

Cache: `<cache_dir>/<key>.tokens` (the ids, int32 little-endian) with `<key>.json` beside it
(what they are: source, sizes, the ids' sha256, which is also the data fingerprint a
checkpoint keeps), where key hashes the file's bytes, the tokenizer's vocabulary
(`Tokenizer.fingerprint`) and add_bos. Both are written under temporary names and renamed,
the .json last, so a .tokens file without its .json is never read; temporary files left by a
killed run are removed by the next one (formats/files.py). With no cache directory the ids go to an
unnamed temporary file (unlinked once mapped).

The samples of record files and their packed rows are kept in the same cache by
formats/sample_cache.py, with the helpers below.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ggtrain.errors import ConfigError
from ggtrain.formats import datafile
from ggtrain.formats.datafile import Utf8Stream
from ggtrain.formats.files import commit, discard, open_temporary, remove_stale_temporaries, write_atomic
from ggtrain.formats.tokenizer import ByteTokenizer, Tokenizer

BLOCK = 4 << 20              # bytes read at a time
_REACH = 1 << 16             # a cut is looked for in the last _REACH characters first
_VERSION = 2                 # of the token files; a change makes every cached file a miss
_BOM = b"\xef\xbb\xbf"


@dataclass
class TokenFile:
    """The ids of a corpus: ids (n,) int32 (memory-mapped); fingerprint: sha256 of their
    bytes; path: the cache file (None without a cache); cached: found in the cache rather
    than tokenized now; source_bytes: the corpus's size."""
    ids: np.ndarray
    fingerprint: str
    path: str | None
    cached: bool
    source_bytes: int


def default_cache_dir() -> str:
    """GGTRAIN_TOKEN_CACHE, else $GGTRAIN_CACHE/tokens, else ~/.cache/ggtrain/tokens."""
    if os.environ.get("GGTRAIN_TOKEN_CACHE"):
        return os.environ["GGTRAIN_TOKEN_CACHE"]
    root = os.environ.get("GGTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ggtrain")
    return os.path.join(root, "tokens")


def corpus_tokens(path, tokenizer: Tokenizer, add_bos: bool = False, cache_dir: str | None = None,
                  progress: Callable[[int, int, int], None] | None = None,
                  workers: int | None = None) -> TokenFile:
    """The ids of the text file `path` (see the module docstring), from the cache when there.

    progress(bytes_done, bytes_total, tokens) is called as the file is tokenized (not on a
    cache hit). workers: processes that encode (default: the CPUs this process may use).
    Raises FileNotFoundError for a missing file, ConfigError for one with no text (empty or
    only whitespace), FormatError (naming the file, and the line and column) for one that is
    not plain text: records, a format ggtrain does not read, or bytes that are not UTF-8
    text, all found before any is tokenized (not looked for again on a cache hit: the key
    is the bytes').
    """
    path = os.fspath(path)
    datafile.require_text(path)
    size = os.path.getsize(path)
    key = _key(path, tokenizer, add_bos)
    if cache_dir is not None:
        found = _open_cached(cache_dir, key)
        if found is not None:
            return found
    datafile.check_utf8(path)       # every byte, before any is tokenized (a pass of ~2 s/GB)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if isinstance(tokenizer, ByteTokenizer):
        workers = 1        # numpy turns bytes into ids faster than they could be sent to a worker
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        remove_stale_temporaries(cache_dir)
        final = os.path.join(cache_dir, key + ".tokens")
        fd, tmp = open_temporary(final)
    else:
        fd, tmp = tempfile.mkstemp(prefix="ggtrain-tokens.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            n, digest, text_seen = _tokenize(path, size, tokenizer, add_bos, out, progress, workers)
            out.flush()
            os.fsync(out.fileno())
        if not text_seen:
            raise ConfigError(f"{path}: the file is empty")
        if cache_dir is None:
            ids = _map(tmp, n)
            os.unlink(tmp)      # the mapping stays valid; the file goes when it is closed
            return TokenFile(ids, digest, None, False, size)
        commit(tmp, final)
        meta = {"version": _VERSION, "source": os.path.abspath(path), "source_bytes": size,
                "tokens": n, "sha256": digest, "tokenizer": repr(tokenizer), "add_bos": add_bos}
        write_atomic(os.path.join(cache_dir, key + ".json"), json.dumps(meta, indent=1).encode())
        return TokenFile(_map(final, n), digest, final, False, size)
    except BaseException:
        discard(tmp)
        raise


# ---- the stream -------------------------------------------------------------------------------

def _blocks(path: str) -> Iterator[tuple]:
    """(bytes read so far, text) of each block, decoded strictly (FormatError naming the line
    and column of a byte that is not UTF-8 text); a UTF-8 sequence cut by the block's end is
    held back for the next block."""
    stream = Utf8Stream(path)
    done = 0
    with open(path, "rb") as f:
        first = True
        while True:
            raw = f.read(BLOCK)
            if not raw:
                break
            done += len(raw)
            if first and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            first = False
            yield done, stream.feed(raw)
    tail = stream.feed(b"", final=True)
    if tail:
        yield done, tail


def _pieces(path: str, tokenizer: Tokenizer) -> Iterator[tuple]:
    """(bytes read so far, piece, continued) of the file, cut where `tokenizer.cut` allows."""
    text = ""
    done = 0
    searched = 1                             # text[:searched] holds no cut (but near its end)
    for done, block in _blocks(path):
        text += block
        tail = max(searched, len(text) - _REACH)
        p = tokenizer.cut(text, tail)
        if p is None and searched < tail:
            p = tokenizer.cut(text, searched, limit=tail - searched)
        if p is None:
            searched = max(1, len(text) - _REACH)   # the end is searched again with what follows
            continue                         # no place to cut yet: read on
        yield done, text[:p]
        text = text[p:]
        searched = 1
    if text:
        yield done, text


_WORKER: Tokenizer | None = None             # the tokenizer of a forked worker


def _encode(tokenizer: Tokenizer, piece: str, add_bos: bool, continued: bool) -> np.ndarray:
    return tokenizer.encode(piece, add_bos=add_bos, continued=continued)


def _encode_in_worker(piece: str, add_bos: bool, continued: bool) -> np.ndarray:
    return _encode(_WORKER, piece, add_bos, continued)


def _tokenize(path, size, tokenizer, add_bos, out, progress, workers) -> tuple:
    """Encodes the file's pieces into `out`: (tokens, sha256 of their bytes, any non-space)."""
    global _WORKER
    digest = hashlib.sha256()
    n = 0
    text_seen = False

    def write(ids: np.ndarray, done: int) -> None:
        nonlocal n
        data = np.ascontiguousarray(ids, dtype="<i4").tobytes()
        out.write(data)
        digest.update(data)
        n += len(ids)
        if progress is not None:
            progress(done, size, n)

    # piece k: BOS before the first only; every later one continues the text before it
    jobs = ((done, piece, add_bos and k == 0, k > 0) for k, (done, piece) in enumerate(_pieces(path, tokenizer)))
    if workers <= 1:
        for done, piece, bos, continued in jobs:
            text_seen = text_seen or bool(piece.strip())
            write(_encode(tokenizer, piece, bos, continued), done)
        return n, digest.hexdigest(), text_seen
    _WORKER = tokenizer
    pool = _fork_pool(workers)
    try:
        with pool:
            flight: deque = deque()
            for done, piece, bos, continued in jobs:
                text_seen = text_seen or bool(piece.strip())
                flight.append((done, pool.apply_async(_encode_in_worker, (piece, bos, continued))))
                while len(flight) >= 2 * workers:
                    d, r = flight.popleft()
                    write(r.get(), d)
            while flight:
                d, r = flight.popleft()
                write(r.get(), d)
    finally:
        _WORKER = None
    return n, digest.hexdigest(), text_seen


# ---- the cache --------------------------------------------------------------------------------

def _key(path: str, tokenizer: Tokenizer, add_bos: bool, extra: str = "") -> str:
    """A cache key over the bytes of a data file (every shard of a folder, by its name in it),
    the vocabulary, add_bos and `extra`."""
    h = hashlib.sha256()
    for file in datafile.data_files(path):
        if file != path:
            h.update(f"{os.path.relpath(file, path)}\0{os.path.getsize(file)}\0".encode())
        with open(file, "rb") as f:
            while chunk := f.read(BLOCK):
                h.update(chunk)
    h.update(f"|{tokenizer.fingerprint()}|bos={int(add_bos)}|v{_VERSION}|{extra}".encode())
    return h.hexdigest()[:40]


def _open_cached(cache_dir: str, key: str) -> TokenFile | None:
    meta_path = os.path.join(cache_dir, key + ".json")
    tokens_path = os.path.join(cache_dir, key + ".tokens")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
        n = int(meta["tokens"])
        if meta.get("version") != _VERSION or os.path.getsize(tokens_path) != 4 * n:
            return None
        return TokenFile(_map(tokens_path, n), str(meta["sha256"]), tokens_path, True,
                         int(meta["source_bytes"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None          # absent or damaged: tokenized again and rewritten


def _map_mask(path: str, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=bool)
    return np.memmap(path, dtype=np.bool_, mode="r", shape=(n,))


def _map(path: str, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    return np.memmap(path, dtype="<i4", mode="r", shape=(n,))


def _fork_pool(workers: int):
    """A pool of forked workers (`tokenizers` never runs threads in a ggtrain process, which would
    make the fork unsafe: formats/tokenizer_bpe.py)."""
    return multiprocessing.get_context("fork").Pool(workers)
