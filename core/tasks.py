"""Multiple-choice scoring (layer 4), as lm-evaluation-harness scores it: for each item the
log-likelihood of every choice's continuation given its context; accuracy (the gold choice
has the highest log-likelihood) and normalised accuracy (log-likelihood divided by the
choice's length in characters), each with its standard error (the sample standard
deviation of the per-item 0/1 scores over sqrt(n)).

Items come as token ids: for each choice (context ids, continuation ids, length), where the
context starts with BOS where the vocabulary adds one. Two ways to score them, equal to float
rounding:

- score_items: many items in one plan, as training packs samples: an item's shared prefix (the
  tokens all its choices start with, up to the shortest context) once, then each choice's
  remaining tokens, each a segment of a packed row that sees itself and the prefix (attention's
  tree mask; positions go on from the prefix's). The rows of a batch go through the decoder at
  once, and the log-likelihood of each continuation is the sum of its positions'
  log-probabilities (losses.sequence_nll with a selection matrix, the logits never held whole).
  One plan serves every batch of a task, its shape chosen for the task (_shape): the row length
  (from the longest choice to the model's context) and rows a batch that compute the fewest positions,
  pieces placed first fit, the rows spread evenly over the batches. Where the model has recurrent
  layers (a state cannot branch), in rows longer than a sliding window (it counts rows), and for
  an item longer than a row, each choice is a whole sample of its own instead.
- score_item: one item through the KV-cached decoder: the tokens its choices share (the context,
  or Winogrande's sentence start) fed once, each choice continuing from there. llama.cpp's
  numerics take this way (their float order depends on a product's row count, so a choice must be
  fed as llama.cpp feeds it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.decoder import Inputs, Options, forward
from ggtrain.core.models.inference import frozen_net
from ggtrain.core.models.losses import fused_loss_available, loss_chunks, sequence_nll
from ggtrain.errors import ConfigError

# tokens a batch of packed choices holds (rows x row length): big enough for the products to run
# at GEMM speed, small enough that a task's plan holds little memory
BATCH_TOKENS = 4096
# the rows still open while packing (first fit among them): more fill rows better, fewer pack faster
OPEN_ROWS = 8


@dataclass(frozen=True)
class Scored:
    """One item's result: log-likelihood and token count of each choice, the gold index."""
    logliks: tuple
    tokens: tuple
    gold: int
    norm_lens: tuple

    @property
    def correct(self) -> bool:
        return int(np.argmax(self.logliks)) == self.gold

    @property
    def correct_norm(self) -> bool:
        return int(np.argmax([ll / max(1, n) for ll, n in zip(self.logliks, self.norm_lens)])) == self.gold


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _shared_prefix(choices: list) -> tuple:
    """(each choice's context + continuation ids (i32), the length of the longest prefix they
    all share, up to the shortest context)."""
    seqs = [np.concatenate([c, t]).astype(np.int32) for c, t, _ in choices]
    shared = min(len(c) for c, _, _ in choices)
    for s in seqs[1:]:
        same = np.flatnonzero(s[:shared] != seqs[0][:shared])
        shared = int(same[0]) if same.size else shared
    return seqs, shared


def score_item(decoder, choices: list, gold: int) -> Scored:
    """Score one item: choices [(context ids, continuation ids, norm_len)], each id list
    non-empty. The longest token prefix every choice's context + continuation shares (up to
    its shortest context) is fed once; each choice continues from it.
    Raises ConfigError when a choice does not fit the decoder's context."""
    check_fits(choices, decoder.n_ctx)
    seqs, shared = _shared_prefix(choices)
    decoder.reset()
    last = decoder.feed(seqs[0][:shared]) if shared else None    # logits after position shared - 1
    logliks, counts = [], []
    for (c, t, _), s in zip(choices, seqs):
        decoder.rewind(shared)
        rest = s[shared:-1]
        parts = ([last[None]] if shared else []) + ([decoder.feed(rest, every=True)] if rest.size else [])
        logits = np.concatenate(parts)                     # after positions shared - 1 .. len(s) - 2
        first = len(c) - 1 - (shared - 1 if shared else 0)  # row of the logits before t[0]
        lp = _log_softmax(logits[first:first + len(t)])
        logliks.append(float(lp[np.arange(len(t)), t].sum()))
        counts.append(len(t))
    return Scored(tuple(logliks), tuple(counts), int(gold), tuple(n for _, _, n in choices))


def summarize(scored: list) -> dict:
    """{"items", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} of scored items; None where
    a value is undefined (an accuracy of no items, a standard error of fewer than 2), so the dict
    is valid JSON."""
    n = len(scored)
    out = {"items": n}
    for key, values in (("acc", [s.correct for s in scored]), ("acc_norm", [s.correct_norm for s in scored])):
        v = np.asarray(values, np.float64)
        out[key] = float(v.mean()) if n else None
        out[f"{key}_stderr"] = float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else None
    return out


def check_fits(choices: list, n_ctx: int) -> None:
    """ConfigError when a choice is empty or does not fit a context of n_ctx positions."""
    for c, t, _ in choices:
        if len(c) == 0 or len(t) == 0:
            raise ConfigError("a choice needs a non-empty context and continuation (in tokens)")
        if len(c) + len(t) - 1 > n_ctx:
            raise ConfigError(f"a choice takes {len(c) + len(t) - 1} tokens, more than the context of {n_ctx}")


@dataclass
class _Batch:
    """Packed items: tokens, pos, seg, parent (rows, length) i32 (parent: the segment a
    position's row also sees, its own but in a choice after a shared prefix; padding -1); loss
    rows (flat positions of the continuations' predictions) with their targets; owner (item,
    choice) of each sample; segments: how many segment values are taken."""
    tokens: np.ndarray
    pos: np.ndarray
    seg: np.ndarray
    parent: np.ndarray
    rows: list
    targets: list
    samples: list      # per sample: (item, choice, first loss row, loss row count)
    segments: int = 0


class _Item:
    """An item as packing sees it: each choice's context + continuation ids (i32) and context
    length; the positions its choices take whole, and as a tree (its shared prefix once, then
    each choice's rest), with the prefix's length (0: no tree)."""

    def __init__(self, choices: list, tree: bool):
        if tree:
            self.seqs, self.shared = _shared_prefix(choices)
        else:
            self.seqs, self.shared = [np.concatenate([c, t]).astype(np.int32) for c, t, _ in choices], 0
        self.contexts = [len(c) for c, _, _ in choices]
        self.whole = sum(len(s) - 1 for s in self.seqs)
        self.tree = self.whole - (len(self.seqs) - 1) * self.shared

    def as_tree(self, length: int, tree: bool) -> bool:
        """Whether it is packed as its tree in rows of `length` (tree: trees are wanted)."""
        return bool(tree and self.shared and self.tree <= length)

    def pieces(self, length: int, tree: bool) -> list:
        """The positions of each piece it is packed as in rows of `length`: the tree whole, or
        each choice."""
        return [self.tree] if self.as_tree(length, tree) else [len(s) - 1 for s in self.seqs]


def _place(sizes, length: int) -> tuple:
    """([(row, start)] of each piece of `sizes` positions, rows taken): first fit into the last
    OPEN_ROWS rows that still have room, else a new row."""
    open_rows, where, n = [], [], 0
    for s in sizes:
        for k, (r, at) in enumerate(open_rows):
            if at + s <= length:
                where.append((r, at))
                open_rows[k] = (r, at + s)
                break
        else:
            where.append((n, 0))
            open_rows.append((n, s))
            n += 1
            if len(open_rows) > OPEN_ROWS:
                open_rows.pop(0)
    return where, n


def _shape(items: list, limit: int, tree: bool, window: int) -> tuple:
    """(row length, rows a batch, tree) that compute the fewest positions for the task's items:
    each row length from the longest choice (rounded up to 32) to `limit` (the model's context)
    or BATCH_TOKENS, a batch at most BATCH_TOKENS positions (one row at least), the rows spread
    evenly over the batches (no nearly empty last batch). A row is longer than a choice may be
    (n_ctx) where that packs better: positions count within a segment, and attention skips the
    blocks of other segments. With a window (local layers), trees only in rows no longer than it
    (the window counts rows)."""
    longest = max(len(s) - 1 for item in items for s in item.seqs)
    first = min(-(-longest // 32) * 32, limit)
    best = None
    for length in range(first, max(first, min(limit, BATCH_TOKENS)) + 1, 32):
        here = tree and (not window or length <= window)
        _, rows = _place((s for item in items for s in item.pieces(length, here)), length)
        batches = -(-rows // max(1, BATCH_TOKENS // length))
        n_rows = -(-rows // batches)
        cost = batches * n_rows * length
        if best is None or cost < best[0]:
            best = (cost, length, n_rows, here)
    return best[1:]


def _pack(items: list, length: int, n_rows: int, tree: bool = False) -> list:
    """The choices of items (_Item) packed into batches of n_rows rows of `length` positions,
    _place's rows in order. A choice takes its context and continuation but the last token and
    predicts the continuation from its context's last position on. With tree, an item's shared
    prefix is one segment, and each choice's rest a segment whose parent is the prefix, all one
    piece of a row; else (and for an item whose tree does not fit a row) each choice is a piece
    and a segment of its own. A batch's samples go item by item, in order."""
    pieces = [item.pieces(length, tree) for item in items]
    where, n = _place((s for p in pieces for s in p), length)
    batches = [_Batch(*(np.zeros((n_rows, length), np.int32) for _ in range(2)),
                      *(np.full((n_rows, length), -1, np.int32) for _ in range(2)), [], [], [])
               for _ in range(-(-n // n_rows))]

    def segment(b: _Batch, r: int, start: int, ids, first_pos: int, parent: int | None) -> int:
        """Write ids at row r from start, positions from first_pos; the new segment's value."""
        n = len(ids)
        value = b.segments
        b.segments += 1
        b.tokens[r, start:start + n] = ids
        b.pos[r, start:start + n] = np.arange(first_pos, first_pos + n)
        b.seg[r, start:start + n] = value
        b.parent[r, start:start + n] = value if parent is None else parent
        return value

    places = iter(where)
    for i, item in enumerate(items):
        as_tree = item.as_tree(length, tree)
        if as_tree:    # the prefix, then each choice's rest
            row, p0 = next(places)
            b, r = batches[row // n_rows], row % n_rows
            prefix = segment(b, r, p0, item.seqs[0][:item.shared], 0, None)
            at_rest = p0 + item.shared
        for j, (s, c) in enumerate(zip(item.seqs, item.contexts)):
            if as_tree:
                n = len(s) - 1 - item.shared
                if n:
                    segment(b, r, at_rest, s[item.shared:-1], item.shared, prefix)
                # position p of the choice's sequence is at the prefix's p0 + p, or past it here
                at = [p0 + p if p < item.shared else at_rest + p - item.shared for p in range(c - 1, len(s) - 1)]
                at_rest += n
            else:
                row, start = next(places)
                b, r = batches[row // n_rows], row % n_rows
                segment(b, r, start, s[:-1], 0, None)
                at = [start + p for p in range(c - 1, len(s) - 1)]
            b.samples.append((i, j, len(b.rows), len(s) - c))
            b.rows.extend(r * length + w for w in at)
            b.targets.extend(int(x) for x in s[c:])
    return batches


def _tree_fits(cfg: ModelConfig) -> bool:
    """Whether every layer of the model attends (a recurrent layer's state cannot branch)."""
    return all(cfg.family.layer_kinds(cfg, i)[0] == "attention" for i in range(cfg.layers))


def score_items(cfg: ModelConfig, weights: dict, backend, encoded: list, adapters: dict | None = None,
                n_ctx: int = 0, progress=None) -> list:
    """Scored of every item of encoded [(choices [(context ids, continuation ids, norm_len)],
    gold)], their choices packed into batches of one plan (see the module docstring), in exact
    numbers. n_ctx: the most positions a choice may take (default the model's context; it also
    picks phi3's rope factors); progress(items done) after each batch. Raises ConfigError
    (with the index of the item, as "item i: ...") when a choice does not fit."""
    n_ctx = min(n_ctx or cfg.ctx, cfg.ctx)
    for i, (choices, _) in enumerate(encoded):
        try:
            check_fits(choices, n_ctx)
        except ConfigError as exc:
            raise ConfigError(f"item {i}: {exc}") from None
    if not encoded:
        return []
    tree = _tree_fits(cfg)
    items = [_Item(choices, tree) for choices, _ in encoded]
    window = cfg.window if any(cfg.local(i) for i in range(cfg.layers)) else 0
    length, n_rows, tree = _shape(items, cfg.ctx, tree, window)
    batches = _pack(items, length, n_rows, tree)
    if not batches:
        return []
    n_loss = max(len(b.rows) for b in batches)
    n_seq = max(len(b.samples) for b in batches)
    g = Graph()
    net, stored = frozen_net(cfg, g, weights, adapters)
    tokens, pos, seg = (g.input((n_rows, length), "i32", name=name) for name in ("tokens", "pos", "seg"))
    par = g.input((n_rows, length), "i32", name="parent") if tree else None
    rows = g.input((n_loss,), "i32", name="loss_rows")
    targets = g.input((n_loss,), "i32", name="row_targets")
    select = g.input((n_seq, n_loss), name="select")
    hidden = forward(net, Inputs(tokens, pos, seg=seg, parent=par, rows=rows),
                     Options(head=False, n_ctx=n_ctx))
    fused = fused_loss_available(net, backend)
    nll = sequence_nll(net, hidden, targets, select, 1 if fused else loss_chunks(cfg, n_loss), fused=fused)
    rt = Runtime(g, backend)
    for t, buf in stored.items():
        rt.bind(t, buf)
    plan = rt.compile([nll])
    logliks = [[0.0] * len(choices) for choices, _ in encoded]
    last = {i: k for k, b in enumerate(batches) for i, _, _, _ in b.samples}   # each item's last batch
    ends = np.bincount(list(last.values()), minlength=len(batches))
    for b, finished in zip(batches, ends):
        r = np.zeros(n_loss, np.int32)
        tgt = np.full(n_loss, -1, np.int32)
        r[:len(b.rows)], tgt[:len(b.targets)] = b.rows, b.targets
        sel = np.zeros((n_seq, n_loss), np.float32)
        for k, (_, _, first, count) in enumerate(b.samples):
            sel[k, first:first + count] = 1.0
        for t, v in ((tokens, b.tokens), (pos, b.pos), (seg, b.seg), (rows, r), (targets, tgt), (select, sel)):
            rt.set(t, v)
        if tree:
            rt.set(par, b.parent)
        rt.run(plan)
        sums = plan.read(nll)
        for k, (i, j, _, _) in enumerate(b.samples):
            logliks[i][j] = -float(sums[k])
        if progress is not None and finished:
            progress(int(finished))
    return [Scored(tuple(ll), tuple(len(t) for _, t, _ in choices), int(gold), tuple(n for _, _, n in choices))
            for ll, (choices, gold) in zip(logliks, encoded)]
