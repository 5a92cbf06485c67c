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

Record files (JSON lines, JSON arrays, Parquet, CSV, or a folder of such shards;
formats/dataset.py): `sample_records` makes the samples of their records in forked workers and
keeps them as `<key>.tokens` (every sample's ids, one after another), `<key>.train` (their
masks, one byte a token), `<key>.lengths` (int64 a sample; a preference pair is two, chosen
first), `<key>.places` (two int64 a record: its shard, and its line, index or row there) and
`<key>.json` (kind, layout, the shards' names), where key covers every shard's name and bytes,
the chat template and train_on_inputs (`samples_key`); `cached_samples` gives them back,
memory-mapped, without reading the records. The records are cut into parts (ranges of whole
lines of JSON lines and CSV, rows of one Parquet row group) that the workers read, parse and
sample themselves, so no process holds more than a part of the records (and a worker one row
group); a JSON array is read whole and its records sliced among the workers.

`packed_rows` keeps what `core.data.pack` / `pack_pairs` make of them as `<key2>.rows` (every
field's rows, int32) and `<key2>.json` (the stats, the rows' sha256, the targets in each row),
key2 covering the samples' key and what decides the packing (ctx, options, the split), so a
later run maps the rows it draws and reads nothing else.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ggtrain.core.data import PackedData, PackStats, allocate_packed
from ggtrain.errors import ConfigError
from ggtrain.formats import datafile
from ggtrain.formats.datafile import Utf8Stream
from ggtrain.formats.dataset import Sample, open_records, samples
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


# ---- record files: their samples, made in parallel and kept ------------------------------------

# the arrays of a SampleSet, one file each (places: two int64 a record, its shard and number)
_SAMPLE_FILES = ("tokens", "train", "lengths", "places")


class RecordSamples(Sequence):
    """The samples of a SampleSet as a sequence: item k is record k's Sample, or its
    (chosen, rejected) pair; each made when asked for, as views of the token maps."""

    def __init__(self, ids: np.ndarray, train: np.ndarray, lengths: np.ndarray, pairs: bool):
        self.ids, self.train, self.pairs = ids, train, pairs
        self.ends = np.cumsum(lengths)
        self.starts = self.ends - lengths

    def __len__(self) -> int:
        return len(self.ends) // 2 if self.pairs else len(self.ends)

    def _sample(self, j: int) -> Sample:
        a, b = int(self.starts[j]), int(self.ends[j])
        return Sample(self.ids[a:b], self.train[a:b])

    def __getitem__(self, k: int):
        if not -len(self) <= k < len(self):
            raise IndexError(k)
        k %= len(self)
        return (self._sample(2 * k), self._sample(2 * k + 1)) if self.pairs else self._sample(k)


class Places(Sequence):
    """Where each record is, as errors name it ("data.jsonl line 7", "chat.json record 12",
    "chat.parquet row 3"): places (n, 2) int64, each record's shard and its line, index or
    row there; shards: (path, word) of each shard."""

    def __init__(self, shards: Sequence, places: np.ndarray):
        self.shards, self.places = shards, places

    def __len__(self) -> int:
        return len(self.places)

    def __getitem__(self, k: int) -> str:
        shard, number = (int(x) for x in self.places[k])
        path, word = self.shards[shard]
        return f"{path} {word} {number}"


@dataclass
class SampleSet:
    """The samples of a record file or folder (formats/dataset.py): ids, train (bool): every
    sample's tokens and mask one after another (memory-mapped from the cache, or in memory);
    lengths: each sample's (a preference pair: two, chosen first); places (n, 2): each
    record's shard and line, index or row; kind, layout; conversational: preference pairs
    given as messages; cached: found in the cache rather than made now; key: the cache key
    (samples_key); cache_dir: where they are kept (None: nowhere); shards: (path, word) of
    each shard, for `where`."""
    ids: np.ndarray
    train: np.ndarray
    lengths: np.ndarray
    places: np.ndarray
    path: str
    kind: str
    layout: str
    conversational: bool
    cached: bool
    key: str
    cache_dir: str | None = None
    shards: tuple = ()

    @property
    def samples(self) -> RecordSamples:
        return RecordSamples(self.ids, self.train, self.lengths, self.kind == "preference")

    @property
    def where(self) -> Places:
        return Places(self.shards, self.places)


def samples_key(path, tokenizer: Tokenizer, template_id: str, train_on_inputs: bool) -> str:
    """The cache key of a record file's (or folder's: every shard's) samples: its bytes, the
    vocabulary, the chat template that would render it (`formats.chat.template_id`) and
    train_on_inputs."""
    return _key(os.fspath(path), tokenizer, False, f"samples|{template_id}|tio={int(train_on_inputs)}")


def _shard_words(path: str, shards: Sequence) -> list:
    """[(name, word)] of the shards kept with samples: names relative to the data path (a
    folder moved or renamed still names its files right)."""
    return [(os.path.relpath(s.path, path) if s.path != path else "", datafile.WORDS[s.format]) for s in shards]


def cached_samples(cache_dir: str | None, key: str, path) -> SampleSet | None:
    """The samples of the record file or folder `path` stored under `key`, or None (absent,
    damaged or unfinished)."""
    if cache_dir is None:
        return None
    path = os.fspath(path)
    base = os.path.join(cache_dir, key)
    try:
        with open(base + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("version") != _VERSION or meta.get("what") != "samples":
            return None
        lengths = np.fromfile(base + ".lengths", dtype="<i8")
        places = np.fromfile(base + ".places", dtype="<i8").reshape(-1, 2)
        total = int(lengths.sum())
        if len(lengths) != meta["samples"] or len(places) != meta["records"] \
                or os.path.getsize(base + ".tokens") != 4 * total or os.path.getsize(base + ".train") != total:
            return None
        ids, train = _map(base + ".tokens", total), _map_mask(base + ".train", total)
        shards = tuple((os.path.join(path, name) if name else path, word) for name, word in meta["shards"])
        return SampleSet(ids, train, lengths, places, path, meta["kind"], meta["layout"],
                         bool(meta["conversational"]), True, key, cache_dir, shards)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sample_records(path, tokenizer: Tokenizer, template_of: Callable, train_on_inputs: bool,
                   cache_dir: str | None, key: str, progress: Callable[[int, int, str], None] | None = None,
                   workers: int | None = None, check: Callable[[str, str], None] | None = None) -> SampleSet:
    """The samples of the record file or folder `path`, made by `workers` forked processes
    and stored under `key` in cache_dir (when given).

    The records are read in parts (formats/datafile.py: ranges of whole lines of JSON lines
    and CSV, rows of a Parquet row group, slices of a JSON array, which alone is read whole
    here) that each worker reads, parses and samples itself, so this process holds only the
    shards' first records (their layout). check(kind, layout) runs on the first record, before
    any sampling; template_of(kind, conversational) gives the chat template the records need,
    or None. progress(done, total, "B") is called as parts finish (bytes of the files). Raises
    FormatError naming the file and line (record, row) of a bad record, ConfigError for a
    cache that cannot be written."""
    global _RECORDS
    path = os.fspath(path)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    records = open_records(path)
    head = records.head
    kind, layout = head.kind, head.layout
    conversational = kind == "preference" and isinstance(head.records[0][0], list)
    if check is not None:
        check(kind, layout)
    template = template_of(kind, conversational)
    parts = records.parts(workers)
    total = sum(p.size for p in parts)
    out = _SampleWriter(cache_dir, key)
    _RECORDS = (records, tokenizer, template, train_on_inputs)
    try:
        if workers <= 1 or len(parts) == 1:
            made = map(_sample_part, parts)
        else:
            pool = _fork_pool(workers)
            made = pool.imap(_sample_part, parts)
        try:
            done = 0
            for part, arrays in zip(parts, made):
                out.write(*arrays)
                done += part.size
                if progress is not None:
                    progress(done, total, "B")
        finally:
            if workers > 1 and len(parts) > 1:
                pool.terminate()
        shards = _shard_words(path, records.shards)
        meta = {"version": _VERSION, "what": "samples", "source": os.path.abspath(path), "kind": kind,
                "layout": layout, "conversational": conversational, "shards": shards,
                "tokenizer": repr(tokenizer)}
        ids, train, lengths, places = out.finish(meta)
    except BaseException:
        out.discard()
        raise
    finally:
        _RECORDS = None
    shards = tuple((os.path.join(path, name) if name else path, word) for name, word in shards)
    return SampleSet(ids, train, lengths, places, path, kind, layout, conversational, False, key,
                     cache_dir, shards)


class _SampleWriter:
    """The arrays of a SampleSet as they come, part by part: into temporaries beside their
    cache files (committed by finish, the .json last), or, without a cache, into memory."""

    def __init__(self, cache_dir: str | None, key: str):
        self.base = os.path.join(cache_dir, key) if cache_dir is not None else None
        self.parts: dict = {name: [] for name in _SAMPLE_FILES}
        self.files: dict = {}
        if self.base is not None:
            os.makedirs(cache_dir, exist_ok=True)
            remove_stale_temporaries(cache_dir)
            for name in _SAMPLE_FILES:
                fd, tmp = open_temporary(f"{self.base}.{name}")
                self.files[name] = (os.fdopen(fd, "wb"), tmp)

    def write(self, *arrays) -> None:
        for name, a, dt in zip(_SAMPLE_FILES, arrays, ("<i4", "u1", "<i8", "<i8")):
            a = np.ascontiguousarray(a, dtype=dt)
            if self.base is None:
                self.parts[name].append(a)
            else:
                self.files[name][0].write(a.tobytes())

    def finish(self, meta: dict) -> tuple:
        """(ids, train, lengths, places): maps of the committed files, or the arrays."""
        if self.base is None:
            ids, train, lengths, places = (np.concatenate(self.parts[n]) if self.parts[n] else
                                           np.zeros(0, dt) for n, dt in zip(_SAMPLE_FILES, (np.int32, np.uint8,
                                                                                           np.int64, np.int64)))
            return ids, train.astype(bool), lengths, places.reshape(-1, 2)
        for name, (f, tmp) in self.files.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            commit(tmp, f"{self.base}.{name}")
        self.files = {}
        lengths = np.fromfile(self.base + ".lengths", dtype="<i8")
        places = np.fromfile(self.base + ".places", dtype="<i8").reshape(-1, 2)
        total = int(lengths.sum())
        write_atomic(self.base + ".json", json.dumps({**meta, "samples": len(lengths), "records": len(places)}).encode())
        return _map(self.base + ".tokens", total), _map_mask(self.base + ".train", total), lengths, places

    def discard(self) -> None:
        for f, tmp in self.files.values():
            f.close()
            discard(tmp)
        self.files = {}


_RECORDS: tuple | None = None   # (records, tokenizer, template, train_on_inputs) of forked workers


def _flatten(got: list, places: np.ndarray) -> tuple:
    """(ids, train as uint8, lengths, places) of samples (a pair: chosen then rejected)."""
    flat = [s for item in got for s in (item if isinstance(item, tuple) else (item,))]
    if not flat:
        return np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int64), places
    return (np.concatenate([s.ids for s in flat]).astype(np.int32),
            np.concatenate([s.train for s in flat]).astype(np.uint8),
            np.array([len(s.ids) for s in flat], dtype=np.int64), places)


def _sample_part(part: datafile.Part) -> tuple:
    """The samples of a part of the record files (read here: in a worker, or serially)."""
    records, tokenizer, template, train_on_inputs = _RECORDS
    data, numbers = records.read(part)
    got = samples(data.records, data.kind, tokenizer, template, train_on_inputs, data.where)
    places = np.array([(part.shard, n) for n in numbers], np.int64).reshape(-1, 2)
    return _flatten(got, places)


# ---- packed rows, kept ------------------------------------------------------------------------

_PACKED_FIELDS = ("tokens", "targets", "pos", "seg", "pair")


def packed_rows(cache_dir: str | None, key: str, spec: str, make: Callable) -> tuple:
    """(PackedData, PackStats, fingerprint, cached) of samples packed by make(allocate)
    (-> (PackedData, PackStats), e.g. `lambda allocate: data.pack(..., allocate=allocate)`),
    kept in cache_dir as one memory-mapped file of every field's rows under a key of the
    samples' `key` and `spec` (what decides the packing: ctx, options, the split), so a later
    run maps them without packing or reading them: the fingerprint (PackedData.fingerprint)
    and the stats are kept beside. Without cache_dir the rows are packed in memory."""
    if cache_dir is None:
        packed, stats = make(allocate_packed)
        return packed, stats, packed.fingerprint(), False
    base = os.path.join(cache_dir, hashlib.sha256(f"{key}|packed|{spec}".encode()).hexdigest()[:40])
    found = _open_packed(base)
    if found is not None:
        return found
    made: dict = {}

    def allocate(rows: int, ctx: int, pairs: bool) -> PackedData:
        fields = 5 if pairs else 4
        fd, tmp = open_temporary(base + ".rows")
        made.update(tmp=tmp, shape=(fields, rows, ctx))
        with os.fdopen(fd, "wb") as f:
            f.truncate(4 * fields * rows * ctx)
        rows_map = np.memmap(tmp, dtype="<i4", mode="r+", shape=(fields, rows, ctx))
        for i, name in enumerate(_PACKED_FIELDS[:fields]):
            rows_map[i] = -1 if name in ("targets", "seg", "pair") else 0
        made["map"] = rows_map
        return PackedData(*rows_map)

    try:
        packed, stats = make(allocate)
        rows_map = made.pop("map")
        rows_map.flush()
        fingerprint = packed.fingerprint()
        trained = packed.trained_per_row()
        del packed, rows_map
        with open(made["tmp"], "rb+") as f:
            os.fsync(f.fileno())
        commit(made["tmp"], base + ".rows")
        made.pop("tmp")
        write_atomic(base + ".json", json.dumps({"version": _VERSION, "what": "packed", "shape": made["shape"],
                                                 "stats": stats.as_dict(), "fingerprint": fingerprint,
                                                 "trained_per_row": trained.tolist()}).encode())
    except BaseException:
        discard(made.get("tmp"))
        raise
    packed, stats, fingerprint, _ = _open_packed(base)
    return packed, stats, fingerprint, False


def _open_packed(base: str) -> tuple | None:
    try:
        with open(base + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("version") != _VERSION or meta.get("what") != "packed":
            return None
        shape = tuple(int(n) for n in meta["shape"])
        if os.path.getsize(base + ".rows") != 4 * shape[0] * shape[1] * shape[2]:
            return None
        rows_map = np.memmap(base + ".rows", dtype="<i4", mode="r", shape=shape)
        packed = PackedData(*rows_map)
        packed.trained = np.asarray(meta["trained_per_row"], np.int64)
        return packed, PackStats(**meta["stats"]), str(meta["fingerprint"]), True
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
