"""Choosing the next token from logits (layer 4): llama.cpp's default sampler chain.

The order is llama.cpp's (common/sampling): repetition penalty over the last
`repeat_last_n` tokens, then top-k, top-p and min-p filters, then the temperature, then
a draw from the softmax with a seeded generator. A temperature of 0 is greedy: the
argmax of the (penalized) logits, which is what llama.cpp's greedy sampling picks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ggtrain.errors import ConfigError


@dataclass
class Sampler:
    """sampler(logits (V,), history of ids) -> next id. Defaults: llama.cpp's."""

    temp: float = 0.8
    top_k: int = 40              # <= 0: off
    top_p: float = 0.95          # >= 1: off
    min_p: float = 0.05          # <= 0: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64
    seed: int = 0
    _rng: np.random.Generator = field(init=False, repr=False)

    def __post_init__(self):
        if self.temp < 0:
            raise ConfigError(f"--temp must be >= 0, got {self.temp}")
        if self.top_p <= 0:
            raise ConfigError(f"--top-p must be > 0 (1 or more: off), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"--min-p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ConfigError(f"--repeat-penalty must be > 0, got {self.repeat_penalty}")
        if self.repeat_last_n < 0:
            raise ConfigError(f"--repeat-last-n must be >= 0, got {self.repeat_last_n}")
        self._rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray, history=()) -> int:
        if self.temp == 0 and (self.repeat_penalty == 1.0 or not self.repeat_last_n or not len(history)):
            return int(np.argmax(logits))       # (f64 would change no order: skip the copy)
        z = np.asarray(logits, dtype=np.float64).reshape(-1).copy()
        if self.repeat_penalty != 1.0 and self.repeat_last_n and len(history):
            seen = np.unique(np.asarray(history[-self.repeat_last_n:], dtype=np.int64))
            seen = seen[(seen >= 0) & (seen < z.size)]
            # llama.cpp: divide positive logits, multiply negative ones
            z[seen] = np.where(z[seen] > 0, z[seen] / self.repeat_penalty, z[seen] * self.repeat_penalty)
        if self.temp == 0:
            return int(np.argmax(z))
        keep = np.ones(z.size, dtype=bool)
        if 0 < self.top_k < z.size:
            cut = np.partition(z, -self.top_k)[-self.top_k]
            keep &= z >= cut
        if self.top_p < 1.0:
            keep &= _top_p_mask(np.where(keep, z, -np.inf), self.top_p)
        if self.min_p > 0:
            # relative to the most likely token: p_i >= min_p * p_max
            keep &= z >= z[keep].max() + np.log(self.min_p)
        z = np.where(keep, z / self.temp, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        return int(self._rng.choice(z.size, p=p))


def _top_p_mask(z: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest set of most likely tokens whose probability reaches top_p (at least one)."""
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    n = int(np.searchsorted(np.cumsum(p), top_p)) + 1
    mask = np.zeros(z.size, dtype=bool)
    mask[order[:min(n, z.size)]] = True
    return mask
