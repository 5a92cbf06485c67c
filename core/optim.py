"""Optimizers and learning-rate schedules (layer 4).

AdamW and SGD append one in-place step node per parameter after the backward pass;
their hyperparameters live in a small `hyper` input vector that the host refills
before each update (learning rate from the schedule, bias corrections from the step
count), so changing them never recompiles the plan.

L-BFGS is different in kind: one update is a line search, several forward + backward
evaluations along a direction made from the last few steps. Its direction, moves and
history updates are graph nodes too (compiled once into small plans over the flat
gradient buffer and persistent history buffers); the host only does the line search's
scalar arithmetic between plan runs (LBFGSSearch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggtrain.core import ops
from ggtrain.core.graph import assign
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


# ---- L-BFGS -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LBFGS:
    """Limited-memory BFGS (Nocedal & Wright, Numerical Optimization, ch. 6-7) over all the
    parameters as one flat vector, with a line search for the strong Wolfe conditions.

    One update costs several forward + backward evaluations (the line search's), each a run
    of the gradient plans on the same batch: L-BFGS suits full-batch or large-batch problems,
    where the loss it sees is the loss to minimise; on small noisy batches its curvature
    pairs mislead it. lr: the first trial step of each line search (1 is the quasi-Newton
    step; without history the direction is -g and the first trial lr / |g|). history: the
    number m of (step, gradient change) pairs kept. max_evals: evaluations of the Wolfe
    search per update, after which the best point with sufficient decrease is taken, else
    the step is halved up to `backtracks` more times (the backtracking fallback). No
    weight decay or clipping: the line search needs the plain loss and gradient.
    """

    lr: float = 1.0
    history: int = 6
    max_evals: int = 10
    backtracks: int = 10
    c1: float = 1e-4    # sufficient decrease
    c2: float = 0.9     # curvature (strong Wolfe: |g(t).d| <= c2 |g(0).d|)

    def __post_init__(self):
        if not self.lr > 0 or self.history < 1 or self.max_evals < 1 or self.backtracks < 0:
            raise ConfigError(f"L-BFGS: need lr > 0, history >= 1, max_evals >= 1, got {self}")
        if not 0 < self.c1 < self.c2 < 1:
            raise ConfigError(f"L-BFGS: need 0 < c1 < c2 < 1, got c1 {self.c1}, c2 {self.c2}")


@dataclass(frozen=True)
class LineSearchResult:
    """What line_search found: the accepted step t (None: no step tried decreased the loss
    enough), the loss f and directional derivative gd there, the evaluations it took, and
    how: "wolfe", "armijo" (the best point with sufficient decrease, the Wolfe search having
    run out of evaluations), "backtrack" or "failed"."""

    t: float | None
    f: float
    gd: float
    evals: int
    how: str


def _cubic_min(a: tuple, b: tuple) -> float:
    """Minimiser of the cubic through points (t, f, f') a and b (nan when it has none)."""
    (ta, fa, ga), (tb, fb, gb) = a, b
    if ta == tb or not all(map(math.isfinite, (fa, ga, fb, gb))):
        return math.nan
    d1 = ga + gb - 3.0 * (fa - fb) / (ta - tb)
    disc = d1 * d1 - ga * gb
    if disc < 0:
        return math.nan
    d2 = math.copysign(math.sqrt(disc), tb - ta)
    den = gb - ga + 2.0 * d2
    return tb - (tb - ta) * (gb + d2 - d1) / den if den != 0 else math.nan


def line_search(phi: Callable[[float], tuple], f0: float, gd0: float, t: float, c1: float = 1e-4,
                c2: float = 0.9, max_evals: int = 10, backtracks: int = 10) -> LineSearchResult:
    """A step t along a descent direction satisfying the strong Wolfe conditions
        f(t) <= f0 + c1 t gd0   and   |gd(t)| <= c2 |gd0|
    (Nocedal & Wright, algorithms 3.5 and 3.6: expand until the minimum is bracketed, then
    zoom with safeguarded cubic interpolation). phi(t) -> (f, gd): the loss and directional
    derivative at step t; a non-finite loss counts as too far. With max_evals used up and
    no Wolfe point: the tried point with the lowest loss among those with sufficient
    decrease, else backtracking (halving the smallest step tried) up to `backtracks` times.

    NOTE: near a minimum the loss changes by less than its rounding (f32 sums), and the
    first condition can no longer be tested on f. Within `noise` = 1e-6 |f0| of f0 it is
    tested on the derivative instead (Hager and Zhang's approximate Wolfe condition:
    gd(t) <= (2 c1 - 1) gd0, the same condition for a quadratic), and losses closer than
    noise count as equal.
    """
    if not gd0 < 0:
        raise ValueError(f"line_search: not a descent direction (gd0 = {gd0})")
    tried = []

    def evaluate(t):
        f, gd = phi(t)
        tried.append((t, f, gd))
        return tried[-1]

    noise = 1e-6 * abs(f0)

    def sufficient(p):
        if not math.isfinite(p[1]):
            return False
        return p[1] <= f0 + c1 * p[0] * gd0 or (p[1] <= f0 + noise and p[2] <= (2 * c1 - 1) * gd0)

    def wolfe(p):
        return abs(p[2]) <= -c2 * gd0

    prev, lo, hi = (0.0, f0, gd0), None, None
    while len(tried) < max_evals:                       # expand until the minimum is bracketed
        p = evaluate(t)
        if not sufficient(p) or not math.isfinite(p[2]) or (len(tried) > 1 and p[1] > prev[1] + noise):
            lo, hi = prev, p
            break
        if wolfe(p):
            return LineSearchResult(p[0], p[1], p[2], len(tried), "wolfe")
        if p[2] >= 0:
            lo, hi = p, prev
            break
        step = t - prev[0]
        c = _cubic_min(prev, p)
        prev = p
        t = min(max(c, t + step), t + 10 * step) if math.isfinite(c) else t + step
    if lo is not None:
        while len(tried) < max_evals:                   # zoom into [lo, hi]
            a, b = min(lo[0], hi[0]), max(lo[0], hi[0])
            if b - a <= 1e-10 * b:                      # the interval is down to rounding
                break
            t = _cubic_min(lo, hi)
            if not (a + 0.1 * (b - a) <= t <= b - 0.1 * (b - a)):
                t = 0.5 * (a + b)
            p = evaluate(t)
            if not sufficient(p) or not math.isfinite(p[2]) or p[1] > lo[1] + noise:
                hi = p
            else:
                if wolfe(p):
                    return LineSearchResult(p[0], p[1], p[2], len(tried), "wolfe")
                if p[2] * (hi[0] - lo[0]) >= 0:
                    hi = lo
                lo = p
    good = [p for p in tried if sufficient(p)]
    if good:
        p = min(good, key=lambda q: q[1])
        return LineSearchResult(p[0], p[1], p[2], len(tried), "armijo")
    t = min(p[0] for p in tried)
    for _ in range(backtracks):
        t *= 0.5
        p = evaluate(t)
        if sufficient(p):
            return LineSearchResult(p[0], p[1], p[2], len(tried), "backtrack")
    return LineSearchResult(None, f0, gd0, len(tried), "failed")


class LBFGSSearch:
    """L-BFGS on one graph: its buffers, plans and the host side of each update.

    Persistent buffers (graph state, n = number of trained values): the history s and y
    (m, n) (a ring: slot `newest` is the latest pair), the start point x0 and gradient g0
    of the current update and the direction d (n each). The host keeps the ring's pair
    count, newest slot, and each pair's y.s and y.y (which decide gamma = y.s / y.y, the
    scale of the initial Hessian, and rho = 1 / y.s). Plans, compiled once:
      direction[r]  x0 = x, g0 = g, d = -H g by the two-loop recursion with the newest pair
                    in slot r (slots without a pair have rho 0 and drop out exactly);
                    reads out g.d
      move          x = x0 + t d, parameter by parameter (views of the flat buffers)
      probe         g.d and |g| after an evaluation
      accept[j]     s_j = t d, y_j = g - g0; reads out y.s and y.y
    t, gamma and every rho come in one small input vector (coef), so nothing recompiles.
    """

    def __init__(self, config: LBFGS, graph, params: list, grad_flat: Tensor, grad_norm: Tensor):
        m, n = config.history, grad_flat.size
        self.config, self.m = config, m
        self.s = graph.state((m, n), name="lbfgs.s")
        self.y = graph.state((m, n), name="lbfgs.y")
        x0 = graph.state((n,), name="lbfgs.x0")
        g0 = graph.state((n,), name="lbfgs.g0")
        d = graph.state((n,), name="lbfgs.d")
        self.coef = graph.input((m + 2,), name="lbfgs.coef")   # t, gamma, rho of each slot
        t = ops.view(self.coef, (), None, 0)
        gamma = ops.view(self.coef, (), None, 1)
        rho = [ops.view(self.coef, (), None, 2 + i) for i in range(m)]
        s_rows = [ops.view(self.s, (n,), None, i * n) for i in range(m)]
        y_rows = [ops.view(self.y, (n,), None, i * n) for i in range(m)]
        offsets, off = [], 0
        for p in params:
            offsets.append(off)
            off += p.size
        save = [assign(p, ops.view(x0, p.shape, None, o)) for p, o in zip(params, offsets)]
        save.append(assign(grad_flat, g0))
        self._direction_outs = []
        for newest in range(m):
            order = [(newest - k) % m for k in range(m)]        # newest first
            q, alpha = grad_flat, {}
            for i in order:
                alpha[i] = ops.mul(rho[i], ops.sum(ops.mul(s_rows[i], q)))
                q = ops.sub(q, ops.mul(y_rows[i], alpha[i]))
            r = ops.mul(q, gamma)
            for i in reversed(order):
                beta = ops.mul(rho[i], ops.sum(ops.mul(y_rows[i], r)))
                r = ops.add(r, ops.mul(s_rows[i], ops.sub(alpha[i], beta)))
            direction = assign(ops.scale(r, -1.0), d)
            self._direction_outs.append(save + [direction, ops.sum(ops.mul(grad_flat, direction))])
        self._move_outs = [assign(ops.add(ops.view(x0, p.shape, None, o),
                                          ops.mul(ops.view(d, p.shape, None, o), t)), p)
                           for p, o in zip(params, offsets)]
        self._restore_outs = self._move_outs + [assign(g0, grad_flat)]   # with t = 0: back to x0
        self.gd = ops.sum(ops.mul(grad_flat, d))
        self.grad_norm = grad_norm
        self._accept_outs = []
        for j in range(m):
            s_new = assign(ops.mul(d, t), s_rows[j])
            y_new = assign(ops.sub(grad_flat, g0), y_rows[j])
            self._accept_outs.append((ops.sum(ops.mul(s_new, y_new)), ops.sumsq(y_new)))
        # host side of the ring
        self.curv = np.zeros((m, 2), np.float32)   # y.s, y.y of each slot
        self.count, self.newest = 0, m - 1
        self._here = None   # (loss, grad norm, payload) of the evaluation at the current point
        self.runtime = None

    def compile(self, runtime) -> None:
        self.runtime = runtime
        self._direction = [runtime.compile(outs) for outs in self._direction_outs]
        self._move = runtime.compile(self._move_outs)
        self._restore = runtime.compile(self._restore_outs)
        self._probe = runtime.compile([self.gd, self.grad_norm])
        self._accept = [runtime.compile(list(outs)) for outs in self._accept_outs]

    # ---- state (checkpoints) -------------------------------------------------------------

    @property
    def buffers(self) -> dict:
        """{name: persistent tensor} of the history a resume needs."""
        return {"lbfgs.s": self.s, "lbfgs.y": self.y}

    def host_state(self) -> dict:
        """{name: f32 array} of the ring's host side (exact in f32: small integers, f32 reads)."""
        return {"lbfgs.curv": self.curv.copy(),
                "lbfgs.ring": np.array([self.count, self.newest], np.float32)}

    def load_host_state(self, state: dict) -> None:
        curv, ring = np.asarray(state["lbfgs.curv"], np.float32), np.asarray(state["lbfgs.ring"])
        if curv.shape != (self.m, 2) or ring.shape != (2,):
            raise ConfigError(f"L-BFGS state for history {curv.shape[0]}, this run keeps {self.m}")
        self.curv = curv.copy()
        self.count, self.newest = int(ring[0]), int(ring[1])
        self._here = None

    # ---- one update ---------------------------------------------------------------------

    def _set_coef(self, t: float) -> None:
        c = np.zeros(self.m + 2, np.float32)
        c[0] = t
        c[1] = 1.0
        for k in range(self.count):
            i = (self.newest - k) % self.m
            c[2 + i] = 1.0 / np.float64(self.curv[i, 0])
        if self.count:
            ys, yy = self.curv[self.newest].astype(np.float64)
            c[1] = ys / yy
        self.runtime.set(self.coef, c)

    def _run(self, plan) -> None:
        self.runtime.run(plan)

    def _probe_run(self) -> tuple:
        self._run(self._probe)
        return float(self._probe.read(self.gd)), float(self._probe.read(self.grad_norm))

    def step(self, evaluate: Callable[[], tuple], lr: float, reuse: bool = False) -> dict:
        """One update from the current parameters, lr the first trial step (see LBFGS).
        evaluate() runs forward and backward at
        the current parameters on this update's batch, leaves the gradient in the flat
        gradient buffer and returns (loss, payload) (payload: whatever the caller keeps of
        an evaluation). reuse: the batch is the previous update's, so the evaluation that
        update ended with stands for the first one (full-batch training).

        Returns {"loss", "grad_norm", "payload"} at the start point, "evals" (forward +
        backward runs), "step_size" (the accepted t, 0 when none) and "converged" (no step
        along steepest descent lowers the loss, or the gradient is 0: the parameters are
        left where they were).
        """
        cfg = self.config
        evals = 0
        if reuse and self._here is not None:
            f0, gnorm, start = self._here
        else:
            f0, start = evaluate()
            gnorm = self._probe_run()[1]
            evals = 1
        out = {"loss": f0, "grad_norm": gnorm, "payload": start, "evals": evals, "step_size": 0.0,
               "converged": False}
        self._here = None
        if not (math.isfinite(f0) and math.isfinite(gnorm)):
            return out                                  # the caller reports the divergence
        if gnorm == 0.0:
            out["converged"] = True
            self._here = (f0, gnorm, start)
            return out
        last = {}

        def phi(t):
            self._set_coef(t)
            self._run(self._move)
            f, payload = evaluate()
            gd, gn = self._probe_run()
            last.update(t=t, f=f, grad_norm=gn, payload=payload)
            return f, gd

        while True:
            steepest = self.count == 0
            self._set_coef(0.0)
            plan = self._direction[self.newest]
            self._run(plan)
            gd0 = float(plan.read(self._direction_outs[self.newest][-1]))
            found = None
            if gd0 < 0 and math.isfinite(gd0):
                t1 = lr if not steepest else lr * min(1.0, 1.0 / gnorm)
                found = line_search(phi, f0, gd0, t1, cfg.c1, cfg.c2, cfg.max_evals, cfg.backtracks)
                evals += found.evals
                if found.t is not None:
                    break
                self._set_coef(0.0)                     # back to x0, g0
                self._run(self._restore)
            self.count = 0                              # forget the history, retry along -g
            if steepest:
                out.update(evals=evals, converged=True)
                self._here = (f0, gnorm, start)
                return out
        if last["t"] != found.t:                        # the accepted point was not the last tried
            self._set_coef(found.t)
            self._run(self._move)
            f, payload = evaluate()
            last.update(t=found.t, f=f, grad_norm=self._probe_run()[1], payload=payload)
            evals += 1
        slot = (self.newest + 1) % self.m
        self._set_coef(found.t)
        plan = self._accept[slot]
        self._run(plan)
        ys, yy = (float(plan.read(v)) for v in self._accept_outs[slot])
        if ys > 1e-10 * yy and yy > 0:                 # keep only pairs of positive curvature
            self.curv[slot] = ys, yy
            self.newest, self.count = slot, min(self.count + 1, self.m)
        self._here = (last["f"], last["grad_norm"], last["payload"])
        out.update(evals=evals, step_size=found.t)
        return out


OPTIMIZERS = ("adamw", "sgd", "lbfgs")


def make_optimizer(name: str, lr: float, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                   momentum: float = 0.0, history: int = 6, **adam):
    """The optimizer `name` (one of OPTIMIZERS) with the training commands' settings; adam:
    beta1, beta2, eps. L-BFGS takes no weight decay, clipping or momentum (ConfigError)."""
    if name == "adamw":
        return AdamW(lr=lr, weight_decay=weight_decay, max_grad_norm=max_grad_norm, **adam)
    if name == "sgd":
        return SGD(lr=lr, momentum=momentum, weight_decay=weight_decay, max_grad_norm=max_grad_norm)
    if name == "lbfgs":
        for option, value in (("--weight-decay", weight_decay), ("--grad-clip", max_grad_norm),
                              ("--momentum", momentum)):
            if value:
                raise ConfigError(f"{option} {value:g}: L-BFGS minimises the plain loss (its line "
                                  f"search needs it); use 0")
        return LBFGS(lr=lr, history=history)
    raise ConfigError(f"--optimizer {name!r}: expected one of {', '.join(OPTIMIZERS)}")


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
