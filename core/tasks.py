"""Multiple-choice scoring (layer 4), as lm-evaluation-harness scores it: for each item the
log-likelihood of every choice's continuation given its context; accuracy (the gold choice
has the highest log-likelihood) and normalised accuracy (log-likelihood divided by the
choice's length in characters), each with its standard error (the sample standard
deviation of the per-item 0/1 scores over sqrt(n)).

Items come as token ids: for each choice (context ids, continuation ids, length), where the
context starts with BOS where the vocabulary adds one. Two ways to score them, equal to float
rounding:

- score_items: many choices in one plan, as training packs samples: each choice's context and
  continuation is a sample of a packed row (positions restart, it attends only to itself), the
  rows of a batch go through the decoder at once, and the log-likelihood of each continuation is
  the sum of its positions' log-probabilities (losses.sequence_nll with a selection matrix, the
  logits never held whole). One plan serves every batch of a task.
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


def score_item(decoder, choices: list, gold: int) -> Scored:
    """Score one item: choices [(context ids, continuation ids, norm_len)], each id list
    non-empty. The longest token prefix every choice's context + continuation shares (up to
    its shortest context) is fed once; each choice continues from it.
    Raises ConfigError when a choice does not fit the decoder's context."""
    check_fits(choices, decoder.n_ctx)
    seqs = [np.concatenate([c, t]).astype(np.int32) for c, t, _ in choices]
    shared = min(len(c) for c, _, _ in choices)
    for s in seqs[1:]:
        same = np.flatnonzero(s[:shared] != seqs[0][:shared])
        shared = int(same[0]) if same.size else shared
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
    """Packed choices: tokens, pos, seg (rows, length) i32; loss rows (flat positions of the
    continuations' predictions) with their targets; owner (item, choice) of each sample."""
    tokens: np.ndarray
    pos: np.ndarray
    seg: np.ndarray
    rows: list
    targets: list
    samples: list      # per sample: (item, choice, first loss row, loss row count)


def _pack(encoded: list, length: int, n_rows: int) -> list:
    """The choices of encoded items [(choices, gold)] packed into batches of n_rows rows of
    `length` positions, in order: a sample takes its context and continuation but the last
    token, and predicts the continuation from its context's last position on."""
    batches, batch, row, at = [], None, n_rows, length

    def new_batch():
        return _Batch(np.zeros((n_rows, length), np.int32), np.zeros((n_rows, length), np.int32),
                      np.full((n_rows, length), -1, np.int32), [], [], [])

    for i, (choices, _) in enumerate(encoded):
        for j, (c, t, _) in enumerate(choices):
            s = np.concatenate([c, t]).astype(np.int32)
            n = len(s) - 1
            if at + n > length:           # the next row (of this batch or a new one)
                row, at = row + 1, 0
                if row >= n_rows:
                    batch = new_batch()
                    batches.append(batch)
                    row = 0
            batch.tokens[row, at:at + n] = s[:-1]
            batch.pos[row, at:at + n] = np.arange(n)
            batch.seg[row, at:at + n] = len(batch.samples)
            first = len(batch.rows)
            lo = at + len(c) - 1                       # predicts t[0]
            batch.rows.extend(range(row * length + lo, row * length + lo + len(t)))
            batch.targets.extend(int(x) for x in t)
            batch.samples.append((i, j, first, len(t)))
            at += n
    return batches


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
    length = min(n_ctx, max(64, -(-longest // 32) * 32))
    n_rows = max(1, BATCH_TOKENS // length)
    batches = _pack(encoded, length, n_rows)
    if not batches:
        return []
    n_loss = max(len(b.rows) for b in batches)
    n_seq = max(len(b.samples) for b in batches)
    g = Graph()
    net, stored = frozen_net(cfg, g, weights, adapters)
    tokens, pos, seg = (g.input((n_rows, length), "i32", name=name) for name in ("tokens", "pos", "seg"))
    rows = g.input((n_loss,), "i32", name="loss_rows")
    targets = g.input((n_loss,), "i32", name="row_targets")
    select = g.input((n_seq, n_loss), name="select")
    hidden = forward(net, Inputs(tokens, pos, seg=seg, rows=rows), Options(head=False, n_ctx=n_ctx))
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
