"""Multiple-choice scoring (layer 4), as lm-evaluation-harness scores it: for each item the
log-likelihood of every choice's continuation given its context; accuracy (the gold choice
has the highest log-likelihood) and normalised accuracy (log-likelihood divided by the
choice's length in characters), each with its standard error (the sample standard
deviation of the per-item 0/1 scores over sqrt(n)).

Items come as token ids: for each choice (context ids, continuation ids, length), where the
context starts with BOS where the vocabulary adds one. The tokens every choice of an item
shares (the context, or Winogrande's sentence start) are fed to the KV-cached decoder once;
each choice then continues from there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggtrain.errors import ConfigError


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
    seqs = [np.concatenate([c, t]).astype(np.int32) for c, t, _ in choices]
    for (c, t, _), s in zip(choices, seqs):
        if len(c) == 0 or len(t) == 0:
            raise ConfigError("a choice needs a non-empty context and continuation (in tokens)")
        if len(s) - 1 > decoder.n_ctx:
            raise ConfigError(f"a choice takes {len(s) - 1} tokens, more than the context of {decoder.n_ctx}")
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
