"""Optimizers and learning-rate schedules (layer 4).

An optimizer appends one in-place step node per parameter after the backward pass;
its hyperparameters live in a small `hyper` input vector that the host refills
before each update (learning rate from the schedule, bias corrections from the step
count), so changing them never recompiles the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggtrain.core import ops
from ggtrain.core.ops import (HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2, HYPER_COUNT, HYPER_EPS,
                              HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.tensor import Tensor
from ggtrain.errors import ConfigError


def decays(p: Tensor) -> bool:
    """Whether weight decay applies to p: its own setting, else matrices (>= 2 dims) only."""
    return p.weight_decay if p.weight_decay is not None else p.ndim >= 2


@dataclass(frozen=True)
class AdamW:
    """AdamW with decoupled weight decay and optional global-norm gradient clipping."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0   # 0 disables clipping

    def __post_init__(self):
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ConfigError(f"AdamW: betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.eps <= 0 or self.weight_decay < 0 or self.max_grad_norm < 0 or self.lr < 0:
            raise ConfigError("AdamW: lr, eps, weight_decay, max_grad_norm must be >= 0 (eps > 0)")

    def build(self, graph, params: list, grads: list, hyper: Tensor, grad_norm: Tensor) -> tuple:
        """Append the step nodes; returns (step nodes, state tensors {name: tensor})."""
        steps, state = [], {}
        for p, g in zip(params, grads):
            m = graph.state(p.shape, name=f"{p.name}.adam_m")
            v = graph.state(p.shape, name=f"{p.name}.adam_v")
            state[m.name], state[v.name] = m, v
            s = ops.adamw_step(p, g, hyper, grad_norm, m, v, decays(p))
            s.out = p
            steps.append(s)
        return steps, state

    def hyper(self, step: int, lr: float) -> np.ndarray:
        """The hyper vector for update number `step` (1-based) at learning rate lr."""
        if step < 1:
            raise ConfigError(f"AdamW: update number must be >= 1, got {step}")
        h = np.zeros(HYPER_COUNT, dtype=np.float32)
        h[HYPER_LR], h[HYPER_BETA1], h[HYPER_BETA2] = lr, self.beta1, self.beta2
        h[HYPER_EPS], h[HYPER_WD] = self.eps, self.weight_decay
        h[HYPER_BC1] = 1.0 - self.beta1 ** step
        h[HYPER_BC2] = 1.0 - self.beta2 ** step
        h[HYPER_MAX_NORM] = self.max_grad_norm
        return h


@dataclass(frozen=True)
class SGD:
    """SGD with optional momentum, L2 weight decay and global-norm clipping (as PyTorch)."""

    lr: float = 1e-2
    momentum: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0

    def __post_init__(self):
        if self.lr < 0 or self.momentum < 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ConfigError("SGD: lr, momentum, weight_decay and max_grad_norm must be >= 0")

    def build(self, graph, params: list, grads: list, hyper: Tensor, grad_norm: Tensor) -> tuple:
        steps, state = [], {}
        for p, g in zip(params, grads):
            buf = graph.state(p.shape, name=f"{p.name}.momentum")
            state[buf.name] = buf
            s = ops.sgd_step(p, g, hyper, grad_norm, buf, decays(p))
            s.out = p
            steps.append(s)
        return steps, state

    def hyper(self, step: int, lr: float) -> np.ndarray:
        h = np.zeros(HYPER_COUNT, dtype=np.float32)
        h[HYPER_LR], h[HYPER_WD] = lr, self.weight_decay
        h[HYPER_MAX_NORM], h[HYPER_MOMENTUM] = self.max_grad_norm, self.momentum
        h[HYPER_BC1] = h[HYPER_BC2] = 1.0
        return h


# ---- schedules: step (0-based update index) -> learning rate ------------------------------


@dataclass(frozen=True)
class ConstantLR:
    lr: float

    def __call__(self, step: int) -> float:
        return self.lr


@dataclass(frozen=True)
class CosineLR:
    """Linear warmup from 0 to lr_max over `warmup` updates, then cosine down to lr_min
    at `total` updates; with restarts > 1 the cosine part is cut into that many equal
    cycles, each starting again at lr_max. After `total`: lr_min."""

    lr_max: float
    lr_min: float
    warmup: int
    total: int
    restarts: int = 1

    def __post_init__(self):
        if self.warmup < 0 or self.total < 1 or self.restarts < 1 or self.lr_min > self.lr_max:
            raise ConfigError(f"CosineLR: bad schedule {self}")

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.lr_max * (step + 1) / self.warmup
        if step >= self.total:
            return self.lr_min
        span = max(1, self.total - self.warmup)
        cycle = span / self.restarts
        t = ((step - self.warmup) % cycle) / cycle
        return self.lr_min + 0.5 * (self.lr_max - self.lr_min) * (1.0 + math.cos(math.pi * t))
