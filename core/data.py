"""Datasets (layer 4): token streams cut into training windows, with resumable order.

A TokenWindows sampler draws windows of ctx + 1 tokens at random offsets from the
training part of a token stream (inputs are the first ctx, targets the last ctx);
its numpy Generator state is part of a checkpoint, so a resumed run draws exactly
the windows the uninterrupted run would have drawn.
"""
from __future__ import annotations

import json

import numpy as np

from ggtrain.errors import ConfigError


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


def eval_windows(ids: np.ndarray, ctx: int, batch: int, max_batches: int) -> list:
    """Consecutive non-overlapping windows (batch, ctx + 1) from the start of ids."""
    n = min((len(ids) - 1) // ctx, batch * max_batches)
    wins = [ids[i * ctx:i * ctx + ctx + 1] for i in range(n)]
    out = []
    for i in range(0, len(wins) - batch + 1, batch):
        out.append(np.stack(wins[i:i + batch]))
    return out
