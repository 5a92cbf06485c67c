"""Data files as token files (layer 5): plain-text corpora tokenized once, as a stream, in
parallel, into a memory-mapped file, and the samples of record files made once, in parallel;
later runs, and resumed ones, open them in a moment.

`corpus_tokens(path, tokenizer, add_bos=..., cache_dir=..., progress=...)` returns a
`TokenFile` whose `ids` (n,) int32 are exactly `tokenizer.encode(text, add_bos)` of the whole
file read as `ggtrain train` reads text (a leading UTF-8 byte order mark dropped, undecodable
bytes kept as surrogates), without ever holding the text or a Python list of its ids:

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

Record files (JSON lines or arrays of records, formats/dataset.py): `sample_records` makes the
samples of their records in forked workers (slices of the records, in order) and keeps them
as `<key>.tokens` (every sample's ids, one after another), `<key>.train` (their masks, one byte
a token), `<key>.lengths` (int64 a sample; a preference pair is two, chosen first) and
`<key>.json` (kind, layout, each record's place), where key also covers the chat template
and train_on_inputs (`samples_key`); `cached_samples` gives them back without reading the
records.
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
from ggtrain.formats.dataset import Sample, samples
from ggtrain.formats.files import commit, discard, open_temporary, remove_stale_temporaries, write_atomic
from ggtrain.formats.tokenizer import ByteTokenizer, Tokenizer

BLOCK = 4 << 20              # bytes read at a time
_REACH = 1 << 16             # a cut is looked for in the last _REACH characters first
_VERSION = 1                 # of the token files; a change makes every cached file a miss
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
    only whitespace).
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    key = _key(path, tokenizer, add_bos)
    if cache_dir is not None:
        found = _open_cached(cache_dir, key)
        if found is not None:
            return found
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
    """(bytes read so far, text) of each block: decoded with surrogateescape, a UTF-8
    sequence cut by the block's end held back for the next block."""
    held = b""
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
            raw = held + raw
            end = _complete(raw)
            held = raw[end:]
            yield done, raw[:end].decode("utf-8", errors="surrogateescape")
    if held:
        yield done, held.decode("utf-8", errors="surrogateescape")


def _complete(raw: bytes) -> int:
    """The length of `raw` without a UTF-8 sequence its end cuts short (which the next
    bytes may complete); invalid bytes are left in, they decode the same either way."""
    for back in range(1, min(3, len(raw)) + 1):
        b = raw[-back]
        if b & 0xC0 == 0x80:
            continue                         # a continuation byte: look further back
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            if back < need:
                return len(raw) - back
        break
    return len(raw)


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
    h = hashlib.sha256()
    with open(path, "rb") as f:
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


def _map(path: str, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    return np.memmap(path, dtype="<i4", mode="r", shape=(n,))


# ---- record files: their samples, made in parallel and kept ------------------------------------

@dataclass
class SampleSet:
    """The samples of a record file (formats/dataset.py): samples: [Sample], or for preference
    pairs [(chosen, rejected)]; where: each record's place; kind, layout; conversational:
    preference pairs given as messages; cached: found in the cache rather than made now."""
    samples: list
    where: list
    kind: str
    layout: str
    conversational: bool
    cached: bool


def samples_key(path, tokenizer: Tokenizer, template_id: str, train_on_inputs: bool) -> str:
    """The cache key of a record file's samples: its bytes, the vocabulary, the chat template
    that would render it (`formats.chat.template_id`) and train_on_inputs."""
    return _key(path, tokenizer, False, f"samples|{template_id}|tio={int(train_on_inputs)}")


def cached_samples(cache_dir: str | None, key: str) -> SampleSet | None:
    """The samples stored under `key`, or None (absent, damaged or unfinished)."""
    if cache_dir is None:
        return None
    base = os.path.join(cache_dir, key)
    try:
        with open(base + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("version") != _VERSION or meta.get("what") != "samples":
            return None
        lengths = np.fromfile(base + ".lengths", dtype="<i8")
        total = int(lengths.sum())
        if len(lengths) != meta["samples"] or os.path.getsize(base + ".tokens") != 4 * total \
                or os.path.getsize(base + ".train") != total:
            return None
        ids, train = _map(base + ".tokens", total), _map_mask(base + ".train", total)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return SampleSet(_unflatten(ids, train, lengths, meta["kind"] == "preference"), meta["where"],
                     meta["kind"], meta["layout"], bool(meta["conversational"]), True)


def sample_records(data, tokenizer: Tokenizer, template, train_on_inputs: bool, cache_dir: str | None,
                   key: str | None, progress: Callable[[int, int], None] | None = None,
                   workers: int | None = None) -> SampleSet:
    """The samples of `data` (a dataset.Data of records), made by `workers` forked processes
    over slices of the records, and stored under `key` in cache_dir (when given).

    progress(records done, records) is called as slices finish. Raises what
    `dataset.samples` raises (FormatError naming the record)."""
    global _RECORDS
    n = len(data.records)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    step = max(1, min(2000, -(-n // (4 * workers))))
    ranges = [(i, min(n, i + step)) for i in range(0, n, step)]
    parts = []
    _RECORDS = (data, tokenizer, template, train_on_inputs)
    try:
        if workers <= 1 or len(ranges) == 1:
            for r in ranges:
                parts.append(_sample_range(*r))
                if progress is not None:
                    progress(r[1], n)
        else:
            pool = _fork_pool(workers)
            with pool:
                for r, part in zip(ranges, pool.imap(_sample_range_args, ranges)):
                    parts.append(part)
                    if progress is not None:
                        progress(r[1], n)
    finally:
        _RECORDS = None
    ids = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int32)
    train = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.uint8)
    lengths = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, np.int64)
    pairs = data.kind == "preference"
    conversational = pairs and n > 0 and isinstance(data.records[0][0], list)
    if cache_dir is not None and key is not None:
        os.makedirs(cache_dir, exist_ok=True)
        remove_stale_temporaries(cache_dir)
        base = os.path.join(cache_dir, key)
        write_atomic(base + ".tokens", ids.astype("<i4").tobytes())
        write_atomic(base + ".train", train.astype(np.uint8).tobytes())
        write_atomic(base + ".lengths", lengths.astype("<i8").tobytes())
        meta = {"version": _VERSION, "what": "samples", "source": os.path.abspath(data.path),
                "samples": len(lengths), "kind": data.kind, "layout": data.layout,
                "conversational": conversational, "tokenizer": repr(tokenizer), "where": list(data.where)}
        write_atomic(base + ".json", json.dumps(meta).encode())
    return SampleSet(_unflatten(ids, train.astype(bool), lengths, pairs), list(data.where), data.kind,
                     data.layout, conversational, False)


_RECORDS: tuple | None = None        # (data, tokenizer, template, train_on_inputs) of forked workers


def _sample_range_args(r: tuple) -> tuple:
    return _sample_range(*r)


def _sample_range(lo: int, hi: int) -> tuple:
    """(ids, train as uint8, lengths) of records lo..hi, their samples one after another
    (a pair: chosen then rejected)."""
    data, tokenizer, template, train_on_inputs = _RECORDS
    got = samples(data.records[lo:hi], data.kind, tokenizer, template, train_on_inputs, data.where[lo:hi])
    flat = [s for item in got for s in (item if isinstance(item, tuple) else (item,))]
    if not flat:
        return np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int64)
    return (np.concatenate([s.ids for s in flat]).astype(np.int32),
            np.concatenate([s.train for s in flat]).astype(np.uint8),
            np.array([len(s.ids) for s in flat], dtype=np.int64))


def _unflatten(ids: np.ndarray, train: np.ndarray, lengths: np.ndarray, pairs: bool) -> list:
    ids, train = np.asarray(ids), np.asarray(train)    # plain views of a map: slicing them is cheap
    ends = np.cumsum(lengths)
    starts = ends - lengths
    out = [Sample(ids[a:b], train[a:b]) for a, b in zip(starts.tolist(), ends.tolist())]
    return list(zip(out[0::2], out[1::2])) if pairs else out


def _map_mask(path: str, n: int) -> np.ndarray:
    if n == 0:
        return np.zeros(0, dtype=bool)
    return np.memmap(path, dtype=np.bool_, mode="r", shape=(n,))


def _fork_pool(workers: int):
    """A pool of forked workers; `tokenizers` keeps to one thread in them, without a warning
    about its thread pool, when the variable is set as they start."""
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return multiprocessing.get_context("fork").Pool(workers)
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
