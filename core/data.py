"""Datasets (layer 4): token windows and packed samples, batched in a resumable order.

A TokenWindows sampler draws windows of ctx + 1 tokens at random offsets from the
training part of a token stream (inputs are the first ctx, targets the last ctx);
its numpy Generator state is part of a checkpoint, so a resumed run draws exactly
the windows the uninterrupted run would have drawn.

`ImageBatches` draws the batches of a classifier run (MNIST) the same way.

Fine-tuning data comes as samples, each a token sequence with a mask of the tokens to
train on: `pack` lays them into rows (several to a row, each with its own positions and
segment id), `PackedBatches` draws the rows in a seeded order per epoch, resumably, and
`split_samples` holds out whole samples for validation.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Callable

import numpy as np

from ggtrain.errors import ConfigError, ShapeError


def split_tokens(ids: np.ndarray, val_split: float, ctx: int) -> tuple:
    """(train, validation) parts of a token stream: the last val_split of it is held out.

    Raises ConfigError when either part is shorter than one window of ctx + 1 tokens.
    """
    if not 0.0 <= val_split < 1.0:
        raise ConfigError(f"--val-split must be in [0, 1), got {val_split}")
    ids = np.asarray(ids, dtype=np.int32)
    n_val = int(len(ids) * val_split)
    train, val = ids[:len(ids) - n_val], ids[len(ids) - n_val:]
    if len(train) < ctx + 1:
        raise ConfigError(f"the training text has {len(train)} tokens, fewer than one window of "
                          f"--ctx {ctx} + 1; use more text or a smaller --ctx")
    if n_val and len(val) < ctx + 1:
        raise ConfigError(f"the validation split has {len(val)} tokens, fewer than one window of "
                          f"--ctx {ctx} + 1; use a larger --val-split, more text, or --val-split 0")
    return train, val


class TokenWindows:
    """Random windows (batch, ctx + 1) from a token stream, reproducibly."""

    def __init__(self, ids: np.ndarray, ctx: int, batch: int, seed: int):
        self.ids, self.ctx, self.batch = ids, ctx, batch
        self.rng = np.random.default_rng(seed)
        self.drawn = 0            # windows drawn (restored with the state)

    @property
    def epoch(self) -> float:
        """Passes over the stream so far, counting ctx tokens per window drawn."""
        return self.drawn * self.ctx / max(1, len(self.ids) - 1)

    @property
    def windows_per_epoch(self) -> int:
        """Batches that cover the stream about once."""
        return max(1, (len(self.ids) - 1) // (self.ctx * self.batch))

    def next(self) -> np.ndarray:
        starts = self.rng.integers(0, len(self.ids) - self.ctx, self.batch)
        self.drawn += self.batch
        return np.stack([self.ids[s:s + self.ctx + 1] for s in starts])

    def state(self) -> str:
        return json.dumps(self.rng.bit_generator.state)

    def set_state(self, text: str, drawn: int = 0) -> None:
        self.rng.bit_generator.state = json.loads(text)
        self.drawn = drawn


class ImageBatches:
    """The updates of a classifier run over arrays (MNIST): every update takes the next
    `batch` samples of the training indices in a seeded order per epoch (epoch e's order a
    permutation seeded by (seed, e); a batch that is the whole training split keeps one
    order, so every update sees the same batch), as `grad_acc` physical batches. The
    remainder of an epoch that does not fill a batch is left out. The state is the updates
    drawn (with the seed): a run resumed from it draws exactly the batches the uninterrupted
    run would have drawn."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, train: np.ndarray, batch: int,
                 grad_acc: int, seed: int):
        if len(train) < batch:
            raise ConfigError(f"{len(train)} training samples is fewer than one batch ({batch})")
        self.images = np.ascontiguousarray(images, dtype=np.float32)   # batches gather rows of it
        self.labels, self.train, self.batch, self.grad_acc, self.seed = labels, train, batch, grad_acc, seed
        self.updates_per_epoch = len(train) // batch
        self.full = self.updates_per_epoch == 1 and batch == len(train)
        self.drawn = 0                       # updates drawn so far
        self._order: tuple = (-1, None)      # (epoch, its order of the training indices)

    @property
    def epoch(self) -> float:
        return self.drawn / self.updates_per_epoch

    def _indices(self, epoch: int) -> np.ndarray:
        if self.full:
            return self.train
        if self._order[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.train))
            self._order = (epoch, self.train[perm])
        return self._order[1]

    def next(self) -> list:
        """The next update's physical batches: grad_acc arrays of sample indices."""
        epoch, u = divmod(self.drawn, self.updates_per_epoch)
        self.drawn += 1
        order = self._indices(epoch)[u * self.batch:(u + 1) * self.batch]
        return np.split(order, self.grad_acc)

    def state(self) -> str:
        return json.dumps({"drawn": self.drawn, "seed": self.seed, "train": len(self.train)})

    def set_state(self, text: str, drawn: int | None = None) -> None:
        """Continue from `state()`; raises ConfigError when it was taken on another split."""
        s = json.loads(text)
        if s["train"] != len(self.train):
            raise ConfigError(f"the checkpoint was trained on {s['train']} training samples, this data "
                              f"splits into {len(self.train)}: resume with the same data and --limit")
        self.drawn, self.seed = int(s["drawn"]), int(s["seed"])
        self._order = (-1, None)


def eval_windows(ids: np.ndarray, ctx: int, batch: int, max_batches: int) -> list:
    """Consecutive non-overlapping windows (batch, ctx + 1) from the start of ids."""
    n = min((len(ids) - 1) // ctx, batch * max_batches)
    wins = [ids[i * ctx:i * ctx + ctx + 1] for i in range(n)]
    out = []
    for i in range(0, len(wins) - batch + 1, batch):
        out.append(np.stack(wins[i:i + batch]))
    return out


def fingerprint_arrays(*arrays) -> str:
    """sha256 over the arrays' bytes, each as it is (contiguous: hashed in place): the data
    fingerprint a checkpoint keeps (finetune: packed int32 rows; mnist: float32 images and
    their labels)."""
    h = hashlib.sha256()
    for a in arrays:
        h.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    return h.hexdigest()


# ---- packed samples (fine-tuning) ------------------------------------------------------------
#
# A sample is a token sequence ids (n,) with a mask train (n,): train[i] says that ids[i] is a
# prediction target (its loss counts when it is predicted from ids[:i]). Packed into a row of
# ctx positions, a sample of n tokens takes n - 1 positions: its inputs ids[:-1], whose targets
# are ids[1:] where trained, else -1. Its last token is only ever a target, so the first token
# of the next sample in the row is never one: every target belongs to its own sample.


@dataclass
class PackedData:
    """Samples packed into rows of ctx positions, all (rows, ctx) int32.

    tokens: the input token at each position (0 in padding); targets: the token to predict
    there, or -1 (not trained, or padding); pos: the position within its own sample (0 at
    each sample's first token, 0 in padding); seg: the sample's index within its row (0, 1,
    ...; -1 in padding). Attention stays within a segment: position t sees t' <= t with
    seg[t'] == seg[t].
    """
    tokens: np.ndarray
    targets: np.ndarray
    pos: np.ndarray
    seg: np.ndarray
    pair: np.ndarray | None = None   # preference pairs: 2 * pair id + side (0 chosen), -1 elsewhere
    trained: np.ndarray | None = None   # targets in each row, where known without reading them

    def trained_per_row(self) -> np.ndarray:
        """The number of targets (>= 0) in each row."""
        return self.trained if self.trained is not None else (self.targets >= 0).sum(axis=1)

    def fields(self) -> dict:
        """{name: (rows, ctx) array} of what a batch carries ("pair" only for pairs)."""
        out = {"tokens": self.tokens, "targets": self.targets, "pos": self.pos, "seg": self.seg}
        if self.pair is not None:
            out["pair"] = self.pair
        return out

    def fingerprint(self) -> str:
        """sha256 of the rows (every field in order): the data fingerprint a checkpoint keeps."""
        return fingerprint_arrays(*self.fields().values())

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def ctx(self) -> int:
        return self.tokens.shape[1]


@dataclass(frozen=True)
class PackStats:
    """What `pack` did: samples given; packed (placed in rows); truncated (longer than
    ctx + 1 tokens, cut to that); dropped (longer, left out with drop_long); empty (left out:
    no trained target, e.g. an assistant turn cut off by truncation); rows; tokens (positions
    holding a sample's token), trained (positions with a target), padding (empty positions)."""
    samples: int
    packed: int
    truncated: int
    dropped: int
    empty: int
    rows: int
    tokens: int
    trained: int
    padding: int

    def as_dict(self) -> dict:
        return asdict(self)


def _sample_fields(sample) -> tuple:
    """(ids, train) of a sample object with .ids and .train, or of an (ids, train) pair."""
    if hasattr(sample, "ids") and hasattr(sample, "train"):
        ids, train = sample.ids, sample.train
    else:
        ids, train = sample
    ids = np.asarray(ids).reshape(-1)
    train = np.asarray(train).reshape(-1)
    if ids.shape != train.shape:
        raise ShapeError(f"a sample's ids {ids.shape} and train mask {train.shape} differ in length")
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0):
        raise ShapeError(f"a sample's ids must be non-negative integers, got {ids.dtype} "
                         f"(min {ids.min()})")
    return ids.astype(np.int32), train.astype(bool)


def _cut(sample, ctx: int) -> tuple:
    """(inputs, targets) of a sample of at most ctx + 1 tokens: its n - 1 positions."""
    ids, train = sample
    return ids[:-1], np.where(train[1:], ids[1:], -1).astype(np.int32)


def _no_targets(n_samples: int, empty: int, truncated: int, dropped: int, ctx: int, what: str) -> ConfigError:
    parts = [f"{empty} have no trained token"]
    if truncated:
        parts.append(f"{truncated} were cut to fit --ctx {ctx}")
    if dropped:
        parts.append(f"{dropped} longer than that were dropped (--drop-long)")
    return ConfigError(f"no token to train on: of {n_samples} {what}, {', '.join(parts)} "
                       f"(chat data trains on assistant turns, prompt/completion data on "
                       f"completions)")


def allocate_packed(rows: int, ctx: int, pairs: bool) -> PackedData:
    """Empty rows in memory: tokens and pos 0, targets, seg (and pair) -1."""
    return PackedData(np.zeros((rows, ctx), np.int32), np.full((rows, ctx), -1, np.int32),
                      np.zeros((rows, ctx), np.int32), np.full((rows, ctx), -1, np.int32),
                      np.full((rows, ctx), -1, np.int32) if pairs else None)


def pack(samples, ctx: int, packing: bool = True, drop_long: bool = False,
         allocate: Callable[[int, int, bool], PackedData] = allocate_packed) -> tuple:
    """Pack samples into rows of ctx positions: (PackedData, PackStats).

    samples: a sequence (len, [k]) of objects with .ids (n,) int and .train (n,) bool, or of
    (ids, train) pairs; it is read twice, one sample at a time, and nothing of it is kept (a
    lazy sequence over memory-mapped tokens stays unread). A sample longer than ctx + 1
    tokens is cut to its first ctx + 1 (or left out with drop_long); one without a trained
    target (after cutting) is left out. With packing, samples are placed greedily in the
    given order, each into the first row with room for it (first fit), so a row holds several
    whole samples; without, one sample per row. allocate(rows, ctx, pairs) gives the empty
    rows to fill (allocate_packed; a memory map of a cache file, formats/corpus.py).
    Raises ConfigError when no sample has a token to train on.
    """
    if ctx < 1:
        raise ConfigError(f"--ctx must be at least 1, got {ctx}")
    kept, sizes, truncated, dropped, empty = [], [], 0, 0, 0
    for k in range(len(samples)):
        ids, train = _sample_fields(samples[k])
        n = len(ids)
        if n > ctx + 1:
            if drop_long:
                dropped += 1
                continue
            n = ctx + 1
            truncated += 1
        if not train[1:n].any():       # (ids are >= 0: a trained target is a target)
            empty += 1
            continue
        kept.append(k)
        sizes.append((n - 1,))
    if not kept:
        raise _no_targets(len(samples), empty, truncated, dropped, ctx, "samples")

    def items(j: int) -> list:
        ids, train = _sample_fields(samples[kept[j]])
        n = sizes[j][0] + 1
        return [_cut((ids[:n], train[:n]), ctx)]
    return _lay_out(sizes, items, ctx, packing, len(samples), truncated, dropped, empty, allocate=allocate)


def pack_pairs(pairs, ctx: int, packing: bool = True, drop_long: bool = False, first_id: int = 0,
               where=None, allocate: Callable[[int, int, bool], PackedData] = allocate_packed) -> tuple:
    """Pack preference pairs into rows of ctx positions: (PackedData with `pair`, PackStats
    counting pairs).

    pairs: a sequence of (chosen, rejected) samples (as `pack` takes them, read twice); pair
    k gets id first_id + k. Both sequences of a pair go in one row, side by side (a batch
    then holds both): a pair longer than ctx positions has its longer side cut first, down to
    half the row (or is left out with drop_long). Raises ConfigError naming the pair
    (where[k]) when a side has no trained token left (its prompt fills its share of --ctx),
    or when no pair is left.
    """
    if ctx < 2:
        raise ConfigError(f"--ctx must be at least 2 for preference pairs, got {ctx}")
    kept, sizes, truncated, dropped = [], [], 0, 0
    for k in range(len(pairs)):
        sides = [_sample_fields(side) for side in pairs[k]]
        la, lb = (len(ids) - 1 for ids, _ in sides)
        if la + lb > ctx:
            if drop_long:
                dropped += 1
                continue
            half = ctx // 2
            la2 = min(la, max(ctx - lb, half))
            la, lb = la2, min(lb, ctx - la2)
            truncated += 1
        for name, (ids, train), n in zip(("chosen", "rejected"), sides, (la, lb)):
            if not train[1:n + 1].any():
                at = where[k] if where is not None else f"pair {k}"
                raise ConfigError(f"{at}: the prompt leaves no {name} token to train on within --ctx {ctx} "
                                  f"(a pair's two sequences share one window); use a larger --ctx, or "
                                  f"--drop-long to leave such pairs out")
        kept.append(k)
        sizes.append((la, lb))
    if not kept:
        raise _no_targets(len(pairs), 0, truncated, dropped, ctx, "pairs")

    def items(j: int) -> list:
        sides = [_sample_fields(side) for side in pairs[kept[j]]]
        return [_cut((ids[:n + 1], train[:n + 1]), ctx) for (ids, train), n in zip(sides, sizes[j])]
    return _lay_out(sizes, items, ctx, packing, len(pairs), truncated, dropped, 0,
                    pair_ids=[first_id + k for k in kept], allocate=allocate)


def _lay_out(sizes: list, items: Callable[[int], list], ctx: int, packing: bool, n_samples: int, truncated: int,
             dropped: int, empty: int, pair_ids: list | None = None,
             allocate: Callable[[int, int, bool], PackedData] = allocate_packed) -> tuple:
    """PackedData and PackStats of groups of (inputs, targets) items: group k has items of
    sizes[k] positions, made by items(k); each group's items side by side in one row (first
    fit with packing, else a row each); with pair_ids, group k is the pair pair_ids[k] (its
    items the chosen and rejected sides)."""
    row_of = _first_fit([sum(g) for g in sizes], ctx) if packing else list(range(len(sizes)))
    rows = max(row_of) + 1
    data = allocate(rows, ctx, pair_ids is not None)
    fill = np.zeros(rows, np.int64)          # positions used in each row
    n_seg = np.zeros(rows, np.int64)         # samples placed in each row
    trained = 0
    for k, r in enumerate(row_of):
        for side, (inputs, targets) in enumerate(items(k)):
            a, b = fill[r], fill[r] + len(inputs)
            data.tokens[r, a:b] = inputs
            data.targets[r, a:b] = targets
            data.pos[r, a:b] = np.arange(len(inputs))
            data.seg[r, a:b] = n_seg[r]
            if pair_ids is not None:
                data.pair[r, a:b] = 2 * pair_ids[k] + side
            fill[r], n_seg[r] = b, n_seg[r] + 1
            trained += int((targets >= 0).sum())
    tokens = int(fill.sum())
    stats = PackStats(samples=n_samples, packed=len(sizes), truncated=truncated, dropped=dropped,
                      empty=empty, rows=rows, tokens=tokens, trained=trained, padding=rows * ctx - tokens)
    return data, stats


def _first_fit(lengths: list, ctx: int) -> list:
    """The row of each item under first fit: the lowest-numbered row with room for it.

    A max-tree over the free space of len(lengths) rows (enough for one item each) finds
    that row in O(log n) per item.
    """
    size = 1
    while size < len(lengths):
        size *= 2
    free = [0] * (2 * size)                  # free[size + r]: free positions of row r
    for r in range(len(lengths)):
        free[size + r] = ctx
    for i in range(size - 1, 0, -1):
        free[i] = max(free[2 * i], free[2 * i + 1])
    rows = []
    for n in lengths:
        i = 1
        while i < size:                      # descend to the leftmost leaf with room
            i = 2 * i if free[2 * i] >= n else 2 * i + 1
        rows.append(i - size)
        free[i] -= n
        i //= 2
        while i:
            free[i] = max(free[2 * i], free[2 * i + 1])
            i //= 2
    return rows


class PackedBatches:
    """Batches of packed rows, every row once per epoch in a seeded random order.

    The rows drawn form one stream: epoch e's order is a permutation seeded by (seed, e), and
    batch k takes the stream's rows k * batch .. (k + 1) * batch - 1, so a batch may span two
    epochs. The state is the number of rows drawn (with the seed): a run resumed from it
    draws exactly the batches the uninterrupted run would have drawn.
    """

    def __init__(self, data: PackedData, batch: int, seed: int):
        if batch < 1:
            raise ConfigError(f"--batch must be at least 1, got {batch}")
        self.data, self.batch, self.seed = data, batch, seed
        self.drawn = 0                       # rows drawn so far
        self._order: tuple = (-1, None)      # (epoch, its permutation of the rows)

    @property
    def batches_per_epoch(self) -> int:
        """Batches that draw every row at least once: ceil(rows / batch)."""
        return -(-self.data.rows // self.batch)

    @property
    def epoch(self) -> float:
        """Epochs drawn so far (rows drawn / rows)."""
        return self.drawn / self.data.rows

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.data.rows))
        return self._order[1]

    def next(self) -> dict:
        """The next batch: {"tokens", "targets", "pos", "seg"[, "pair"]}, each (batch, ctx) int32."""
        rows = self.data.rows
        idx = np.empty(self.batch, np.int64)
        done = 0
        while done < self.batch:
            epoch, r = divmod(self.drawn, rows)
            take = min(self.batch - done, rows - r)
            idx[done:done + take] = self._permutation(epoch)[r:r + take]
            done += take
            self.drawn += take
        return {k: v[idx] for k, v in self.data.fields().items()}

    def state(self) -> str:
        return json.dumps({"drawn": self.drawn, "seed": self.seed, "rows": self.data.rows})

    def set_state(self, text: str, drawn: int | None = None) -> None:
        """Continue from `state()` (which holds the rows drawn: `drawn`, the count a run would
        give TokenWindows, is not needed); raises ConfigError when it was taken on other data."""
        s = json.loads(text)
        if s["rows"] != self.data.rows:
            raise ConfigError(f"the checkpoint was trained on {s['rows']} packed rows, this data "
                              f"packs into {self.data.rows}: resume with the same data, --ctx "
                              f"and packing options")
        self.drawn, self.seed = int(s["drawn"]), int(s["seed"])
        self._order = (-1, None)


class Picked(Sequence):
    """Items `idx` of a sequence, in that order, read when asked for."""

    def __init__(self, base, idx: np.ndarray):
        self.base, self.idx = base, idx

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self.base[int(i)] for i in self.idx[k]]
        return self.base[int(self.idx[k])]


def split_samples(samples, val_split: float, seed: int) -> tuple:
    """(train, validation) of a sequence of samples (or pairs) as Picked sequences of whole
    samples: a seeded random val_split of them is held out (both keep the given order).
    Raises ConfigError when val_split is not in [0, 1) or leaves either part empty."""
    if not 0.0 <= val_split < 1.0:
        raise ConfigError(f"--val-split must be in [0, 1), got {val_split}")
    n = len(samples)
    n_val = int(n * val_split)
    if val_split > 0 and n_val == 0:
        raise ConfigError(f"--val-split {val_split} of {n} samples holds no sample; use a larger "
                          f"--val-split, more data, or --val-split 0")
    held = np.zeros(n, bool)
    held[np.random.default_rng(seed).permutation(n)[:n_val]] = True
    if held.all():
        raise ConfigError(f"--val-split {val_split} leaves no training sample of {n}")
    return Picked(samples, np.flatnonzero(~held)), Picked(samples, np.flatnonzero(held))
