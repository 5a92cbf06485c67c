"""Record files as kept samples (layer 5): the samples of JSON lines, JSON, Parquet and CSV
records made once, in parallel, and the rows packed from them, in the token cache of
formats/corpus.py.

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
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggtrain.core.data import PackedData, PackStats, allocate_packed
from ggtrain.formats import datafile
from ggtrain.formats.corpus import _VERSION, _fork_pool, _key, _map, _map_mask
from ggtrain.formats.dataset import Sample, open_records, samples
from ggtrain.formats.files import commit, discard, open_temporary, remove_stale_temporaries, write_atomic
from ggtrain.formats.tokenizer import Tokenizer

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


