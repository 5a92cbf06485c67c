"""The classifier run (layer 4): a classifier graph on arrays, epoch by epoch (`ggtrain mnist
train`), on the step engine (core/step.py) and the one run loop (core/fit.py): its graph and
TrainStep, its data (`draw`), its report fields (`describe`) and its evaluation. (The decoder's
run, TextRun, is core/train.py's.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ggtrain.core import ops
from ggtrain.core.data import ImageBatches
from ggtrain.core.distributed import World
from ggtrain.core.fit import Run, check_early_stop, fit_updates
from ggtrain.core.graph import Graph, Rows
from ggtrain.core.optim import make_optimizer
from ggtrain.core.step import TrainStep
from ggtrain.errors import ConfigError
from ggtrain.words import count


@dataclass(frozen=True)
class ClassifierConfig:
    """Hyperparameters of a classifier run (defaults: ggml's MNIST trainer)."""

    epochs: float = 30     # passes over the training split (a fraction ends mid-epoch)
    steps: int = 0          # updates instead of epochs (0: from epochs)
    batch: int = 1000           # logical batch (one optimizer update)
    physical_batch: int = 500   # rows per native run; batch must be a multiple
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    val_split: float = 0.05
    seed: int = 0
    optimizer: str = "adamw"    # one of optim.OPTIMIZERS
    momentum: float = 0.0       # SGD
    early_stop_patience: int = 0
    min_delta: float = 0.0

    def __post_init__(self):
        if self.epochs < 0 or self.steps < 0:
            raise ConfigError(f"--epochs and --steps must be >= 0, got {self.epochs:g}, {self.steps}")
        check_early_stop(self.early_stop_patience, self.min_delta)
        if self.physical_batch < 1 or self.batch < 1 or self.batch % self.physical_batch:
            raise ConfigError(f"--batch ({self.batch}) must be a positive multiple of "
                              f"--physical-batch ({self.physical_batch})")
        if not 0.0 <= self.val_split < 1.0:
            raise ConfigError(f"--val-split must be in [0, 1), got {self.val_split}")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")


def split_train_val(n: int, val_split: float, seed: int) -> tuple:
    """A fixed random split of range(n): (train indices, validation indices)."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val = int(round(n * val_split))
    return perm[n_val:], perm[:n_val]


def _log_softmax_loss(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return -logp[np.arange(len(labels)), labels]


def classifier_data(images: np.ndarray, labels: np.ndarray, config: ClassifierConfig, world: World) -> tuple:
    """(ImageBatches, validation (images, labels) or None) of a classifier run: a fixed
    random split (config.val_split, config.seed), every update config.batch x processes
    samples of the training part."""
    train_idx, val_idx = split_train_val(len(labels), config.val_split, config.seed)
    if config.early_stop_patience and not len(val_idx):
        raise ConfigError("--early-stop-patience needs validation data (--val-split > 0)")
    batches = ImageBatches(images, labels, train_idx, config.batch * world.size,
                           config.batch // config.physical_batch, config.seed + 1)
    return batches, ((images[val_idx], labels[val_idx]) if len(val_idx) else None)


class ClassifierRun(Run):
    """Trains a classifier graph built by `forward(params, x) -> logits` on arrays.

    Reports through callbacks: on_step({"step", "epoch", "loss", "lr", "grad_norm",
    "samples_per_s", "elapsed_s", ...}) after each update and on_eval({"step", "epoch",
    train/val loss and accuracy...}) after each epoch. `request_stop()` may be called from a
    callback (or a signal handler) to end after the current update. `state()` /
    `load_state()` carry everything a bit-identical resume needs, mid-epoch too.

    world: with several processes config's batches are each one's share; every update
    takes the next batch x size samples of the shuffled order, as one process with
    batch x size (and physical_batch x size) would, and each process its rows of them.
    """

    def __init__(self, forward, init: dict, input_shape: tuple, config: ClassifierConfig, backend,
                 world: World | None = None):
        super().__init__(config, world, config.early_stop_patience, config.min_delta, unit="epoch")
        grad_acc = config.batch // config.physical_batch
        g = Graph()
        self.graph = g
        self.x = g.input((config.physical_batch,) + tuple(input_shape), name="x")
        self.y = g.input((config.physical_batch,), "i32", name="y")
        self.params = {name: g.param(value.shape, value, name=name) for name, value in init.items()}
        self.logits = forward(self.params, self.x)
        self.loss = ops.cross_entropy(self.logits, self.y)
        self.optimizer = make_optimizer(config.optimizer, config.lr, weight_decay=config.weight_decay,
                                        momentum=config.momentum, beta1=config.beta1, beta2=config.beta2,
                                        eps=config.eps)
        self.step = TrainStep(self.loss, [t for t in self.params.values() if t.requires_grad], self.optimizer, backend,
                              grad_acc=grad_acc, checkpointing=False,
                              extra_outputs=[self.logits], world=self.world)
        self._eval = self.step.runtime.compile([self.logits])
        self.best = None            # the summary of the best epoch (early stopping)
        self.last = None            # the summary of the last epoch evaluated
        self.samples_seen = 0
        self._epoch = {"loss": 0.0, "hits": 0, "n": 0}   # the current epoch's training totals

    @property
    def flop_per_sample(self) -> float:
        """FLOPs of one update (products and convolutions, forward and backward) per sample."""
        return self.step.flops / self.config.batch

    def _state(self) -> dict:
        """"run": the samples seen, the current epoch's training totals and the best and last
        epochs' summaries."""
        return {"tokens_seen": 0, "run": {"samples_seen": self.samples_seen, "epoch": dict(self._epoch),
                                          "best": self.best, "last": self.last}}

    def _load_state(self, state: dict) -> None:
        run = state.get("run") or {}
        self.samples_seen = int(run.get("samples_seen", 0))
        self._epoch = dict(run.get("epoch") or {"loss": 0.0, "hits": 0, "n": 0})
        self.best, self.last = run.get("best"), run.get("last")

    def evaluate(self, images: np.ndarray, labels: np.ndarray) -> dict:
        """Loss and accuracy with standard errors: {"loss", "loss_se", "accuracy", "accuracy_se", "n"}."""
        p = self.config.physical_batch
        rt = self.step.runtime
        losses, correct = [], []
        for start in range(0, len(labels), p):
            xb = images[start:start + p]
            n = len(xb)
            if n < p:  # pad the last batch; padded rows are not scored
                xb = np.concatenate([xb, np.zeros((p - n,) + xb.shape[1:], xb.dtype)])
            rt.set(self.x, xb)
            rt.run(self._eval)
            logits = self._eval.read(self.logits)[:n]
            yb = labels[start:start + n]
            losses.append(_log_softmax_loss(logits, yb))
            correct.append(logits.argmax(axis=1) == yb)
        loss = np.concatenate(losses) if losses else np.zeros(0)
        hits = np.concatenate(correct) if correct else np.zeros(0, bool)
        n = max(1, len(loss))
        acc = float(hits.mean()) if len(hits) else float("nan")
        return {"loss": float(loss.mean()) if len(loss) else float("nan"),
                "loss_se": float(loss.std(ddof=1) / np.sqrt(n)) if len(loss) > 1 else float("nan"),
                "accuracy": acc,
                "accuracy_se": float(np.sqrt(acc * (1 - acc) / n)) if len(hits) else float("nan"),
                "n": len(loss)}

    def validate(self, val) -> dict:
        """{"val_loss", "val_accuracy"} on the validation (images, labels)."""
        ev = self.evaluate(*val)
        return {"val_loss": ev["loss"], "val_accuracy": ev["accuracy"]}

    def seen(self) -> dict:
        return {"samples_seen": self.samples_seen}

    def total_updates(self, batches) -> int:
        return self.config.steps or round(self.config.epochs * batches.updates_per_epoch)

    @property
    def drawn(self) -> int:
        """What the batch source has drawn after self.updates: updates."""
        return self.updates

    def fit(self, batches, val, on_step=None, on_eval=None) -> list:
        """Train until config.epochs (continuing from self.updates) on `batches` (an
        ImageBatches: classifier_data), evaluating on `val` ((images, labels) or None) after
        each epoch; returns this call's per-epoch summaries.

        A batch that covers the whole training split (full batch) keeps one order, so every
        update sees the same batch (L-BFGS then reuses the evaluation it ended an update
        with). With early stopping the best epoch's parameters are restored at the end.
        `stop_reason` (one of STOP_REASONS) says why the run ended.
        """
        world = self.world
        n_updates = batches.updates_per_epoch
        batch = batches.batch     # samples per update, over every process
        history = []
        t_epoch = [time.perf_counter()]

        def draw(u: int) -> tuple:
            if u % n_updates == 0:    # a new epoch
                self._epoch = {"loss": 0.0, "hits": 0, "n": 0}
                t_epoch[0] = time.perf_counter()
            feeds = []
            for idx in batches.next():
                idx = world.shard(idx)
                feeds.append({self.x: Rows(batches.images, idx), self.y: batches.labels[idx]})
            return feeds, self.config.lr, batches.full and u > 0

        def describe(feeds: list, loss: float, seconds: float) -> dict:
            for (logits,), b in zip(self.step.last_outputs, feeds):
                self._epoch["hits"] += int((logits.argmax(axis=1) == b[self.y]).sum())
            self._epoch["loss"] += loss * batch
            self._epoch["n"] += batch
            self.samples_seen += batch
            u = self.step.updates - 1
            return {"epoch": u // n_updates + 1, "samples_per_s": batch / max(seconds, 1e-9),
                    "update_in_epoch": u % n_updates + 1, "updates_per_epoch": n_updates}

        def evaluate(u: int) -> dict:
            e = self._epoch
            hits = int(world.sum([e["hits"]])[0])    # each process counted its rows
            summary = {"epoch": (u - 1) // n_updates + 1, "step": u,
                       "train_loss": e["loss"] / max(1, e["n"]),
                       "train_accuracy": hits / max(1, e["n"]), "epoch_s": time.perf_counter() - t_epoch[0]}
            if val is not None:
                summary.update(self.validate(val))
            history.append(summary)
            self.last = summary
            return summary

        def on_eval_(summary: dict) -> None:
            if self.early_stopping.best_step == summary["epoch"] and "val_loss" in summary:
                self.best = summary   # the epoch whose parameters early stopping keeps
            if on_eval is not None:
                on_eval(summary)

        self.stop_reason = fit_updates(self, self.step.updates, self.total_updates(batches), draw, describe,
                                       every=n_updates, evaluate=evaluate, on_step=on_step, on_eval=on_eval_,
                                       evaluate_on_break=True)
        return history

    def kept(self) -> dict | None:
        """The summary of the epoch whose model the run ends with (after fit): the best
        epoch's with early stopping (unless interrupted), else the last one evaluated."""
        if self.best_params and self.stop_reason != "interrupted" and self.best is not None:
            return self.best
        return self.last

    @property
    def progress(self) -> int:
        """The epochs done (the last evaluated)."""
        return self.last["epoch"] if self.last else 0

    def why_stopped(self) -> str:
        """As Run's; a run of --steps that ran them all says so in updates (its epochs may be 0)."""
        if self.stop_reason == "finished" and self.config.steps:
            return f"ran all {count(self.updates, 'update')}"
        return super().why_stopped()
