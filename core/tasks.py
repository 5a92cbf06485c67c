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
  One plan serves every batch of a task. Where the model has recurrent layers (a state cannot
  branch) or a sliding window shorter than a row (it counts rows), and for an item longer than a
  row, each choice is a whole sample of its own instead.
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
# the shortest row a batch packs items into (fewer positions left over at a row's end than in short rows)
ROW_MIN = 64


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
    """{"items", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} of scored items."""
    n = len(scored)
    out = {"items": n}
    for key, values in (("acc", [s.correct for s in scored]), ("acc_norm", [s.correct_norm for s in scored])):
        v = np.asarray(values, np.float64)
        out[key] = float(v.mean()) if n else float("nan")
        out[f"{key}_stderr"] = float(v.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
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


def _item_size(choices: list, tree: bool, length: int) -> tuple:
    """(the positions an item takes packed, its shared prefix's length: 0 when its choices are
    packed whole, as without a tree mask or where the tree would not fit a row of `length`)."""
    seqs, shared = _shared_prefix(choices) if tree else ([np.concatenate([c, t]) for c, t, _ in choices], 0)
    whole = sum(len(s) - 1 for s in seqs)
    size = whole - (len(seqs) - 1) * shared
    return (size, shared) if shared and size <= length else (whole, 0)


def _pack(encoded: list, length: int, n_rows: int, tree: bool = False) -> list:
    """The choices of encoded items [(choices, gold)] packed into batches of n_rows rows of
    `length` positions, in order. A choice takes its context and continuation but the last
    token and predicts the continuation from its context's last position on. With tree, an
    item's shared prefix (_item_size) is one segment, and each choice's rest a segment whose
    parent is the prefix, all in one row; else (and for an item whose tree does not fit a row)
    each choice is a segment of its own."""
    batches, batch, row, at = [], None, n_rows, length

    def room(n: int) -> tuple:
        """(batch, row, start) of n free positions: this row's, or the next row's."""
        nonlocal batch, row, at
        if at + n > length:
            row, at = row + 1, 0
            if row >= n_rows:
                batch = _Batch(*(np.zeros((n_rows, length), np.int32) for _ in range(2)),
                               *(np.full((n_rows, length), -1, np.int32) for _ in range(2)), [], [], [])
                batches.append(batch)
                row = 0
        start, at = at, at + n
        return batch, row, start

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

    for i, (choices, _) in enumerate(encoded):
        size, shared = _item_size(choices, tree, length)
        seqs = [np.concatenate([c, t]).astype(np.int32) for c, t, _ in choices]
        if shared:     # the prefix at [p0, p0 + shared), then each choice's rest
            b, r, p0 = room(size)
            prefix = segment(b, r, p0, seqs[0][:shared], 0, None)
            at_rest = p0 + shared
        for j, ((c, t, _), s) in enumerate(zip(choices, seqs)):
            if shared:
                n = len(s) - 1 - shared
                if n:
                    segment(b, r, at_rest, s[shared:-1], shared, prefix)
                # position p of the choice's sequence is at the prefix's p0 + p, or past it here
                where = [p0 + p if p < shared else at_rest + p - shared for p in range(len(c) - 1, len(s) - 1)]
                at_rest += n
            else:
                b, r, start = room(len(s) - 1)
                segment(b, r, start, s[:-1], 0, None)
                where = [start + p for p in range(len(c) - 1, len(s) - 1)]
            b.samples.append((i, j, len(b.rows), len(t)))
            b.rows.extend(r * length + w for w in where)
            b.targets.extend(int(x) for x in t)
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
    longest = 1
    for i, (choices, _) in enumerate(encoded):
        try:
            check_fits(choices, n_ctx)
        except ConfigError as exc:
            raise ConfigError(f"item {i}: {exc}") from None
        longest = max([longest] + [len(c) + len(t) - 1 for c, t, _ in choices])
    tree = _tree_fits(cfg)
    if tree:      # rows long enough for the trees that fit the context
        sizes = [_item_size(choices, True, n_ctx)[0] for choices, _ in encoded]
        longest = max([longest] + [n for n in sizes if n <= n_ctx])
    length = min(n_ctx, max(ROW_MIN, -(-longest // 32) * 32))
    tree = tree and (not any(cfg.local(i) for i in range(cfg.layers)) or cfg.window >= length)
    n_rows = max(1, BATCH_TOKENS // length)
    batches = _pack(encoded, length, n_rows, tree)
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
    done = 0
    for b in batches:
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
        finished = b.samples[-1][0] + (b.samples[-1][1] == len(encoded[b.samples[-1][0]][0]) - 1)
        if progress is not None and finished > done:
            progress(finished - done)
            done = finished
    if progress is not None and done < len(encoded):
        progress(len(encoded) - done)
    return [Scored(tuple(ll), tuple(len(t) for _, t, _ in choices), int(gold), tuple(n for _, _, n in choices))
            for ll, (choices, gold) in zip(logliks, encoded)]
