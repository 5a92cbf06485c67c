"""Training runs and their one loop (layer 4): the Run base every run is (TextRun in
core/train.py, ClassifierRun in core/train_classifier.py), and updates of a run until its last,
with evaluations, early stopping and stop requests, reporting through callbacks.

`fit_updates` is the loop of every run (`TextRun.fit`: train and finetune; `ClassifierRun.fit`:
mnist). The run gives its data and its own fields of each update's report through two
functions, `draw(u) -> (physical batches, lr, same_batch)` and `describe(feeds, seconds) ->
dict`; the loop steps the engine (core/step.py), stops on a NaN or an infinity, reports,
evaluates every `every` updates (early stopping keeps the best parameters), and ends on the
last update, early stopping, L-BFGS's convergence or a stop request (Ctrl-C). The callers
(cli/loop.py `drive`, cli/mnist.py) add the bar, the log and the checkpoints.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ggtrain.core.distributed import World
from ggtrain.core.step import TrainStep, search_fields
from ggtrain.errors import ConfigError, NumericError
from ggtrain.words import count


def check_early_stop(patience: int, min_delta: float) -> None:
    if patience < 0 or min_delta < 0:
        raise ConfigError(f"--early-stop-patience and --min-delta must be >= 0, got {patience}, {min_delta}")
    if min_delta and not patience:
        raise ConfigError("--min-delta needs --early-stop-patience")


@dataclass
class EarlyStopping:
    """Stopping on convergence of the validation loss: `update` after each evaluation;
    the run should stop once `patience` evaluations in a row have not improved on the best
    by more than min_delta."""

    patience: int
    min_delta: float = 0.0
    unit: str = "update"  # what the steps passed to update count (ClassifierRun: epochs)
    best: float = float("inf")
    best_step: int = 0
    bad: int = 0          # evaluations since the best

    def update(self, step: int, val_loss: float) -> bool:
        """Record an evaluation; True when it is a new best."""
        if val_loss < self.best - self.min_delta:
            self.best, self.best_step, self.bad = float(val_loss), step, 0
            return True
        self.bad += 1
        return False

    @property
    def exhausted(self) -> bool:
        return self.patience > 0 and self.bad >= self.patience

    def reason(self) -> str:
        return (f"validation loss did not improve by more than {self.min_delta:g} for {self.bad} "
                f"evaluations (best {self.best:.4f} at {self.unit} {self.best_step})")



# Why a run ended (the summary and the log's "done" line say it): ran its --steps/--epochs,
# early stopping, L-BFGS found no step that lowers the loss, Ctrl-C.
STOP_REASONS = ("finished", "early_stop", "converged", "interrupted")


def stop_message(reason: str, stopping: EarlyStopping, done: int) -> str:
    """The summary's words for a STOP_REASONS entry; done: the updates (epochs for
    ClassifierRun: stopping.unit) the run did."""
    at = f"{stopping.unit} {done:,}"
    if reason == "early_stop":
        return f"stopped early at {at}: {stopping.reason()}; kept the best model"
    if reason == "converged":
        return f"stopped at {at}: L-BFGS found no step that lowers the loss (converged)"
    if reason == "interrupted":
        return f"interrupted at {at}"
    kept = (f"; kept the best model ({stopping.unit} {stopping.best_step}, validation loss {stopping.best:.4f})"
            if stopping.patience and stopping.best_step else "")
    return f"ran all {count(done, stopping.unit)}{kept}"


class Run(ABC):
    """What a training run is, to the loop (fit_updates) and to the commands' driver
    (cli/loop.py drive): its engine (`step`, a TrainStep, and `params`, {name: Tensor} of what is
    trained), its processes (`world`), `config` (with eval_every), early stopping and the best
    parameters it keeps, one stop request, its resumable state and why it ended.

    A subclass builds its graph and step in __init__ (after Run.__init__) and gives fit,
    validate, seen, total_updates and drawn; `progress` is what why_stopped counts (updates,
    or ClassifierRun's epochs), and _state/_load_state its own part of the state.
    """

    step: TrainStep
    params: dict

    def __init__(self, config, world: World | None, patience: int, min_delta: float, unit: str = "update"):
        self.config = config
        self.world = world or World()
        self.early_stopping = EarlyStopping(patience, min_delta, unit=unit)
        self.best_params = None     # with early stopping: the parameters of the best evaluation
        self.stop_reason = None     # one of STOP_REASONS once fit has ended
        self.elapsed_offset = 0.0   # seconds the run had trained before this process (a resumed run)
        self._stop_requested = False

    # ---- the stop request (Ctrl-C): asked, voted on by every process, answered ---------------

    def request_stop(self) -> None:
        """End after the current update (a signal handler may call it)."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested

    @property
    def interrupted(self) -> bool:
        """Whether the run stopped on request before its last update, or (one process) got
        the request after it. Several processes stop together, as the last update's vote said
        (a request that came later is not seen by the others)."""
        return self.step.stop_voted or (self.world.size == 1 and self._stop_requested)

    # ---- what it trained ------------------------------------------------------------------------

    @property
    def updates(self) -> int:
        return self.step.updates

    def param_values(self) -> dict:
        """{name: f32 array} of what is trained."""
        return {name: self.step.get(t) for name, t in self.params.items()}

    @property
    def progress(self) -> int:
        """What the run has done, in early stopping's unit (updates here)."""
        return self.updates

    def why_stopped(self) -> str:
        """One line on why fit ended (after fit)."""
        return stop_message(self.stop_reason, self.early_stopping, self.progress)

    # ---- resumable state ------------------------------------------------------------------------

    def state(self) -> dict:
        """{"params", "optimizer" ({state name: array}), "updates"} and the run's own part;
        with early stopping also "early_stop" ({"best", "best_step", "bad"}) and "best_params":
        everything a bit-identical resume needs."""
        state = {"params": self.param_values(), "optimizer": self.step.optimizer_state(),
                 "updates": self.step.updates, **self._state()}
        if self.early_stopping.patience:
            es = self.early_stopping
            state["early_stop"] = {"best": es.best, "best_step": es.best_step, "bad": es.bad}
            state["best_params"] = self.best_params or {}
        return state

    def load_state(self, state: dict) -> None:
        for k, t in self.params.items():
            if k not in state["params"]:
                raise ConfigError(f"the checkpoint has no tensor {k}")
            self.step.set(t, state["params"][k])
        self.step.load_optimizer_state(state["optimizer"])
        self.step.updates = int(state["updates"])
        if self.early_stopping.patience and state.get("early_stop"):
            es = state["early_stop"]
            self.early_stopping.best, self.early_stopping.best_step = float(es["best"]), int(es["best_step"])
            self.early_stopping.bad = int(es["bad"])
            self.best_params = dict(state.get("best_params") or {}) or None
        self._load_state(state)

    def _state(self) -> dict:
        return {}

    def _load_state(self, state: dict) -> None:
        """The run's own part of a state (after the common part is loaded)."""

    # ---- what each run gives ----------------------------------------------------------------------

    @abstractmethod
    def fit(self, batches, val, on_step=None, on_eval=None):
        """Updates until the run's last (continuing from self.updates), through fit_updates."""

    @abstractmethod
    def validate(self, val) -> dict:
        """{"val_loss", ...} on the validation data."""

    @abstractmethod
    def seen(self) -> dict:
        """{"tokens_seen"} or {"samples_seen"}: what the run has trained on."""

    @abstractmethod
    def total_updates(self, batches) -> int:
        """The update the run ends at."""

    @property
    @abstractmethod
    def drawn(self) -> int:
        """What its batch source has drawn after self.updates (for resuming it)."""


def fit_updates(run: Run, first: int, total: int, draw: Callable, describe: Callable, every: int = 0,
                evaluate: Callable[[int], dict] | None = None, on_step=None, on_eval=None,
                evaluate_on_break: bool = False) -> str:
    """Run updates first..total-1 of `run`; returns why it ended (one of STOP_REASONS).

    run: a Run; its best_params are set here to the best evaluation's parameters and restored
    at the end unless interrupted. draw(u): (physical batches as
    feeds, lr, same_batch) of update u; describe(feeds, loss, seconds): the run's own fields of the
    update's report (merged into {"step", "loss", "lr", "grad_norm", "elapsed_s"} and
    L-BFGS's search fields). evaluate(u): a report after update u, every `every` updates
    (and, with evaluate_on_break, after an update with which L-BFGS converged: the run ends
    there; not after a stop request, whose checkpoint resumes the epoch), with "val_loss"
    when there is validation data; early stopping counts it by its "step", or by its
    "epoch" when the stopping unit is epochs.
    """
    stopping = run.early_stopping
    t0 = time.perf_counter()
    reason = None
    u = first
    while u < total and reason is None:
        t_step = time.perf_counter()
        feeds, lr, same_batch = draw(u)
        loss = run.step.step(feeds, lr, stop=lambda: run.stop_requested, same_batch=same_batch)
        u += 1
        grad_norm = run.step.last_grad_norm
        if not np.isfinite(loss) or not np.isfinite(grad_norm):
            raise NumericError(f"loss {loss}, gradient norm {grad_norm} at update {u}: training diverged "
                               f"(try a lower --lr)")
        now = time.perf_counter()
        info = {"step": u, "loss": loss, "lr": lr, "grad_norm": grad_norm, "elapsed_s": run.elapsed_offset + now - t0,
                **describe(feeds, loss, now - t_step), **search_fields(run.step)}
        if on_step is not None:
            on_step(info)
        converged = run.step.converged
        exhausted = False
        due = every and u % every == 0
        if evaluate is not None and (due or (converged and evaluate_on_break)):
            ev = evaluate(u)
            if stopping.patience and "val_loss" in ev:
                at = ev["epoch"] if stopping.unit == "epoch" else ev["step"]
                if stopping.update(at, ev["val_loss"]):
                    run.best_params = run.param_values()
            if on_eval is not None:
                on_eval(ev)
            exhausted = stopping.exhausted
        reason = ("interrupted" if run.interrupted else "early_stop" if exhausted else
                  "converged" if converged else None)   # (a stop request during the evaluation counts)
    reason = reason or "finished"
    if run.best_params and reason != "interrupted":
        for k, value in run.best_params.items():   # keep the best model, not the last
            run.step.set(run.params[k], value)
    return reason
