"""The decoder's run (layer 4): TextRun, a decoder of any family on token windows or packed
samples, all its weights or LoRA adapters, plain or preference losses (`ggtrain train`, `ggtrain
finetune`), on the step engine (core/step.py) and the one run loop (core/fit.py): its graph and
TrainStep, its data (`draw`), its report fields (`describe`) and its evaluation. (The classifier's
run is core/train_classifier.py's.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ggtrain.core import ops
from ggtrain.core.distributed import World
from ggtrain.core.fit import Run, check_early_stop, fit_updates
from ggtrain.core.graph import Graph
from ggtrain.core.models import losses
from ggtrain.core.models.config import trainable
from ggtrain.core.models.decoder import Inputs, Net, Options, forward
from ggtrain.core.models.inference import frozen_params, lora_fused
from ggtrain.core.models.lora import Adapter, factor_names
from ggtrain.core.optim import LBFGS, ConstantLR, CosineLR, make_optimizer
from ggtrain.core.preference import PairLoss, PreferenceConfig
from ggtrain.core.step import TrainStep
from ggtrain.core.tensor import Tensor
from ggtrain.errors import ConfigError


@dataclass(frozen=True)
class TextConfig:
    """Hyperparameters of a language-model run (see `ggtrain train --help`)."""

    steps: int
    batch: int = 8
    grad_acc: int = 1
    lr: float = 1e-3
    lr_min: float = 1e-4
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpointing: bool = True
    eval_every: int = 0
    eval_batches: int = 8
    seed: int = 0
    world: int = 1              # processes; batch is each one's share, batch x world the global batch
    optimizer: str = "adamw"    # one of optim.OPTIMIZERS
    momentum: float = 0.0       # SGD
    early_stop_patience: int = 0
    min_delta: float = 0.0
    moe_aux_loss: float = 0.0   # the routed layers' load-balancing loss's weight (ffns.load_balance_loss)

    def __post_init__(self):
        if not self.moe_aux_loss >= 0:
            raise ConfigError(f"--moe-aux-loss must be >= 0, got {self.moe_aux_loss}")
        if self.world < 1:
            raise ConfigError(f"world must be >= 1 processes, got {self.world}")
        check_early_stop(self.early_stop_patience, self.min_delta)
        if self.early_stop_patience and not self.eval_every:
            raise ConfigError("--early-stop-patience counts evaluations: it needs --eval-every N")
        if self.steps < 1:
            raise ConfigError(f"--steps must be >= 1, got {self.steps}")
        if self.batch < 1 or self.grad_acc < 1:
            raise ConfigError(f"--batch and --grad-acc must be >= 1, got {self.batch}, {self.grad_acc}")
        if self.lr <= 0 or self.lr_min < 0 or self.lr_min > self.lr:
            raise ConfigError(f"need 0 <= --lr-min <= --lr and --lr > 0, got {self.lr_min}, {self.lr}")
        if self.warmup < 0 or self.weight_decay < 0 or self.grad_clip < 0 or self.eval_every < 0:
            raise ConfigError("--warmup, --weight-decay, --grad-clip and --eval-every must be >= 0")

    @property
    def global_batch(self) -> int:
        return self.batch * self.world

    def on(self, world: int) -> "TextConfig":
        """The same run on `world` processes: the global batch kept, each process's share
        recomputed (resuming on another number of processes). Raises ConfigError when the
        global batch does not split evenly."""
        if self.global_batch % world:
            raise ConfigError(f"the run's global batch of {self.global_batch} windows ({self.batch} on "
                              f"each of {self.world} processes) cannot be split over {world} processes")
        return dataclasses.replace(self, batch=self.global_batch // world, world=world)


def _sum(terms: list) -> Tensor:
    """The sum of scalar tensors, in order."""
    out = terms[0]
    for t in terms[1:]:
        out = ops.add(out, t)
    return out


def _frozen_product(t: Tensor) -> bool:
    """Selective checkpointing for LoRA: the products with frozen weights are most of a
    block's forward work, so their outputs are kept instead of recomputed; so is attention's
    output (with its row statistics, which its backward reads): on SmolLM2 (ctx 256, b4) that
    is 68 MiB more planned memory for 4% less time a step. The adapters, norms and
    activations are recomputed. (A frozen product with its adapter's summed in, matmul_lora,
    is kept likewise: the frozen product is its work.)"""
    return (t.op in ("matmul", "matmul_lora") and t.srcs[1].root.kind == "param" and not t.srcs[1].requires_grad) \
        or t.op == "attention"


class TextRun(Run):
    """Trains a llama on batches of token windows: all of its weights (`ggtrain train`,
    `ggtrain finetune --full`), or LoRA adapters on frozen weights (`ggtrain finetune`).

    init: {name: f32 array} of what is trained: the model's parameters, or with `lora`
    the adapter factors ("<weight>.lora_a"/".lora_b", core/models/lora.py); frozen:
    {name: f32 array or StoredTensor} of the base weights the adapters sit on. ctx: the
    training window (default the model's context). packed: batches carry per-row
    positions and sample ids ("pos", "seg", (batch, ctx) each), several samples sharing a
    row, each attending only to itself. loss_rows: when > 0, logits are computed only at the
    positions that have a target, at most that many per physical batch (chat data trains on
    a fraction of its tokens: the output projection and the (positions, vocabulary) logits
    shrink alike).

    preference (core/preference.py: DPO or ORPO): the loss compares each pair's chosen and
    rejected answers instead (batches then carry "pair" codes, see data.pack_pairs; `pairs`
    slots a physical batch; DPO's reference comes from compute_reference or a checkpoint),
    and each update's info and evaluation also carry TRL's rewards (preference.METRICS).

    A batch source has next() -> {"tokens", "targets"[, "pos", "seg"]: (batch, ctx) i32}
    (or a (batch, ctx + 1) window array) and `epoch` (progress in passes over the data).
    Reports through callbacks: on_step(info) after each update, on_eval(info) after each
    evaluation; `request_stop()` ends after the current update. `state()` / `load_state()` carry
    everything a bit-identical resume needs.
    """

    def __init__(self, model, init: dict, config: TextConfig, backend,
                 frozen: dict | None = None, lora=None, ctx: int | None = None, packed: bool = False,
                 loss_rows: int = 0, world: World | None = None, preference: PreferenceConfig | None = None,
                 pairs: int = 0):

        super().__init__(config, world, config.early_stop_patience, config.min_delta)
        self.model, self.lora = model, lora
        if config.world != self.world.size:
            raise ConfigError(f"the run is configured for {config.world} processes, {self.world.size} "
                              f"were started")
        self.ctx = ctx or model.ctx
        if not 1 <= self.ctx <= model.ctx:
            raise ConfigError(f"--ctx {self.ctx} must be in 1..{model.ctx} (the model's context)")
        g = Graph()
        self.graph = g
        b = config.batch
        # what is trained; a model's constants (rope factors) ride along untrained
        self.params = {k: g.param(v.shape, v, name=k, trainable=trainable(k)) for k, v in init.items()}
        weights, adapters, bind = dict(self.params), {}, {}
        self.dropout_seed = None
        if lora is not None:
            weights, bind = frozen_params(g, frozen or {})
            if lora.dropout > 0:    # a fresh mask per physical batch, drawn from (seed, batch number)
                self.dropout_seed = g.input((), "i32", name="dropout_seed")
            for salt, w in enumerate(lora.weights(model)):
                a, b_ = factor_names(w)
                if a not in self.params or b_ not in self.params:
                    raise ConfigError(f"LoRA: no initial factors for {w}")
                drop = (lora.dropout, self.dropout_seed, salt) if self.dropout_seed is not None else None
                adapters[w] = Adapter(self.params[a], self.params[b_], lora.scale, drop,
                                      lora_fused(backend, weights[w]))
        net = Net(model, weights, adapters)
        self.tokens = g.input((b, self.ctx), "i32", name="tokens")
        self.targets = g.input((b, self.ctx), "i32", name="targets")
        self.packed = packed
        if packed:
            self.pos = g.input((b, self.ctx), "i32", name="pos")
            self.seg = g.input((b, self.ctx), "i32", name="seg")
        else:
            self.pos, self.seg = g.input((self.ctx,), "i32", name="pos"), None
        self.loss_rows = loss_rows
        rows, targets = None, self.targets
        if loss_rows:
            rows = g.input((loss_rows,), "i32", name="loss_rows")
            targets = self.row_targets = g.input((loss_rows,), "i32", name="row_targets")
        self._rows = rows
        # the loss over the output projection in chunks of rows when the logits would be large
        # (losses.chunked_loss): under LoRA (a frozen output matrix) each chunk's input
        # gradient is taken in the forward, so one chunk's logits at a time, none recomputed
        # With the output matrix frozen and the kernel at hand, one linear_cross_entropy takes
        # all rows (losses.fused_loss_available): no logits at all, the matrix read once
        fused = lora is not None and losses.fused_loss_available(net, backend)
        n_chunks = 1 if fused else losses.loss_chunks(model, loss_rows or b * self.ctx, head_trained=lora is None)
        self.chunks = g.input((n_chunks,), name="chunk_weights")
        self.pair_loss = None
        self.reference = None    # DPO: (pair ids, 2) reference NLL of each pair's sides
        if preference is not None:
            if not (packed and loss_rows):
                raise ConfigError("preference pairs train on packed rows with planned loss rows")
            self.pair_loss = PairLoss(g, preference, pairs, loss_rows)

        inputs = Inputs(self.tokens, self.pos, seg=self.seg, rows=rows)
        if config.moe_aux_loss:
            if not model.experts:
                raise ConfigError(f"--moe-aux-loss: a {model.arch} model has no routed experts to balance")
            if lora is not None or preference is not None:
                raise ConfigError("--moe-aux-loss balances a router trained whole on text (train, finetune --full), "
                                  "not under LoRA or a preference objective")
            net = dataclasses.replace(net, aux=[])

        def objective(net_, grad, train=True):
            opt = Options(checkpoint=g if train and config.checkpointing else None, head=False, n_ctx=self.ctx)
            hidden = forward(net_, inputs, opt)
            if self.pair_loss is None:
                return losses.chunked_loss(net_, hidden, targets, self.chunks, grad=grad, fused=fused), []
            nll = losses.sequence_nll(net_, hidden, targets, self.pair_loss.select, n_chunks, grad=grad, fused=fused)
            return self.pair_loss.loss(nll)

        self.loss, self.outputs = objective(net, lora is not None)
        self.eval_loss, self.eval_outputs = self.loss, self.outputs
        if net.aux:     # trained on the NLL plus the weighted mean of the layers' balance losses; evaluated on the NLL
            self.loss = ops.add(self.loss, ops.scale(_sum(net.aux), config.moe_aux_loss / len(net.aux)))
        if self.dropout_seed is not None:   # evaluation without dropout: the same weights, no masks
            still = {w: dataclasses.replace(ad, dropout=None) for w, ad in adapters.items()}
            self.eval_loss, self.eval_outputs = objective(dataclasses.replace(net, lora=still), False, train=False)
        self.optimizer = make_optimizer(config.optimizer, config.lr, weight_decay=config.weight_decay,
                                        max_grad_norm=config.grad_clip, momentum=config.momentum)
        if isinstance(self.optimizer, LBFGS):   # lr is its first trial step, the line search scales it
            self.schedule = ConstantLR(config.lr)
        else:
            self.schedule = CosineLR(config.lr, config.lr_min, min(config.warmup, config.steps), config.steps)
        self.step = TrainStep(self.loss, [t for t in self.params.values() if t.requires_grad], self.optimizer, backend,
                              grad_acc=config.grad_acc, checkpointing=config.checkpointing,
                              bind=bind, keep=_frozen_product if lora is not None else None,
                              world=self.world, extra_outputs=self.outputs)
        if not packed:
            self.step.runtime.set(self.pos, np.arange(self.ctx, dtype=np.int32))
        self._eval = self.step.runtime.compile([self.eval_loss] + self.eval_outputs)
        self.last_eval_metrics = {}   # preference metrics of the last evaluate()
        self.tokens_seen = 0

    def flop_per_token(self, counted: float = 1.0) -> float:
        """FLOPs of one update (products: forward, backward, recomputation) per token (the same
        per process) when a fraction `counted` of the loss head's rows (loss_rows, else every
        position) have a target that counts on average: the head multiplies those only (a
        batch's trained positions come first in its loss rows, the padding after them)."""
        flops = self.step.flops - (1.0 - counted) * self.step.row_flops
        return flops / (self.config.batch * self.config.grad_acc * self.ctx)

    def _state(self) -> dict:
        """"tokens_seen"; for DPO "reference"."""
        state = {"tokens_seen": self.tokens_seen}
        if self.reference is not None:
            state["reference"] = self.reference
        return state

    def _load_state(self, state: dict) -> None:
        self.tokens_seen = int(state["tokens_seen"])
        if self.pair_loss is not None and self.pair_loss.config.method == "dpo":
            if state.get("reference") is None:
                raise ConfigError("the checkpoint has no reference log-probabilities (a DPO run's)")
            self.reference = np.asarray(state["reference"], np.float32)

    def validate(self, val_batches: list) -> dict:
        """{"val_loss"[, preference metrics]} on the validation batches."""
        return {"val_loss": self.evaluate(val_batches), **self.last_eval_metrics}

    def seen(self) -> dict:
        return {"tokens_seen": self.tokens_seen}

    def total_updates(self, batches) -> int:
        return self.config.steps

    @property
    def drawn(self) -> int:
        """What the batch source has drawn after self.updates: windows (or rows)."""
        return self.updates * self.config.global_batch * self.config.grad_acc

    def feed(self, batch, number: int = 0) -> dict:
        """{input tensor: array} of a batch (a dict, or a (batch, ctx + 1) window array), what
        `step.step` takes: tokens and targets, and what the run derives from them (the loss
        chunks' weights, loss rows, pair codes, dropout seed); number: the physical batch's
        index in the run (seeds its dropout masks, a different one in each process)."""
        if isinstance(batch, np.ndarray):
            batch = {"tokens": batch[:, :-1], "targets": batch[:, 1:]}
        feed = {self.tokens: batch["tokens"], self.targets: batch["targets"]}
        if self.loss_rows:
            flat = np.asarray(batch["targets"], np.int32).reshape(-1)
            where = np.flatnonzero(flat >= 0)
            if where.size > self.loss_rows:
                raise ConfigError(f"a batch has {where.size} positions with a target, more than the "
                                  f"{self.loss_rows} planned (loss_rows)")
            rows = np.zeros(self.loss_rows, np.int32)
            tgt = np.full(self.loss_rows, -1, np.int32)
            rows[:where.size], tgt[:where.size] = where, flat[where]
            feed[self._rows], feed[self.row_targets] = rows, tgt
        used = feed[self.row_targets] if self.loss_rows else batch["targets"]
        feed[self.chunks] = losses.chunk_weights(used, self.chunks.shape[0])
        if self.pair_loss is not None:
            codes = np.full(self.loss_rows, -1, np.int64)
            codes[:where.size] = np.asarray(batch["pair"]).reshape(-1)[where]
            feed.update(self.pair_loss.feed(codes, self.reference))
        if self.packed:
            feed[self.pos], feed[self.seg] = batch["pos"], batch["seg"]
        if self.dropout_seed is not None:
            number = number * self.world.size + self.world.rank
            feed[self.dropout_seed] = np.int32((self.config.seed * 1_000_003 + number) % (2**31 - 1))
        return feed

    def evaluate(self, batches: list) -> float:
        """Mean validation loss over batches (dicts or (batch, ctx + 1) window arrays): with
        several processes, each passes its shares of the same global batches."""
        losses, seen = [], []
        for batch in batches:
            loss, outputs, feed = self._run_eval(batch)
            losses.append(loss)
            seen.append((outputs, feed))
        if not losses:
            return float("nan")
        if self.pair_loss is not None:
            sums = self.world.sum(self.pair_loss.sums(seen))
            self.last_eval_metrics = {f"val_{k}": v for k, v in self.pair_loss.metrics(sums).items()}
        total = self.world.sum([sum(losses)])[0]
        return float(total / (len(losses) * self.world.size))

    def _run_eval(self, batch) -> tuple:
        """(loss, [values of eval_outputs], feed) of one batch through the evaluation plan."""
        rt = self.step.runtime
        feed = self.feed(batch)
        for t, v in feed.items():
            if t is not self.dropout_seed:
                rt.set(t, v)
        rt.run(self._eval)
        return float(self._eval.read(self.eval_loss)), [self._eval.read(t) for t in self.eval_outputs], feed

    def compute_reference(self, datasets: list, n_pairs: int, progress=None) -> None:
        """DPO: every pair's reference NLL (summed over each side's completion), from the
        model as it is now (before training: LoRA's factors start with B = 0, so it is the
        base; --full: the initial weights), by the evaluation plan over the packed rows of
        datasets (PackedData with `pair`, ids below n_pairs), `batch` rows at a time.
        Stored in self.reference (and in checkpoints); progress(rows) after each batch."""
        ref = np.full((n_pairs, 2), np.nan, np.float32)
        self.reference = None
        b = self.config.batch
        for data in datasets:
            fields = data.fields()
            for start in range(0, data.rows, b):
                part = {k: v[start:start + b] for k, v in fields.items()}
                short = b - len(part["tokens"])
                if short:
                    pad = {"tokens": 0, "targets": -1, "pos": 0, "seg": -1, "pair": -1}
                    part = {k: np.concatenate([v, np.full((short, data.ctx), pad[k], np.int32)])
                            for k, v in part.items()}
                _, outputs, feed = self._run_eval(part)
                ids = np.unique(part["pair"][part["pair"] >= 0] // 2)
                chosen, rejected = self.pair_loss.sides(outputs, feed)
                ref[ids, 0], ref[ids, 1] = -chosen, -rejected   # outputs are logp - 0
                if progress is not None:
                    progress(len(part["tokens"]) - short)
        if np.isnan(ref).any():
            raise ConfigError(f"the reference pass left {int(np.isnan(ref).any(axis=1).sum())} of {n_pairs} "
                              f"pairs without a value")
        self.reference = ref

    def fit(self, batches, val_batches: list, on_step=None, on_eval=None) -> None:
        """Run updates until config.steps (continuing from self.updates), drawing physical
        batches from `batches` (see the class docstring)."""
        cfg = self.config
        if cfg.early_stop_patience and not val_batches:
            raise ConfigError("--early-stop-patience needs validation data (--val-split > 0)")
        per_update = cfg.global_batch * cfg.grad_acc * self.ctx

        def draw(u: int) -> tuple:
            first = u * cfg.grad_acc
            return [self.feed(batches.next(), first + j) for j in range(cfg.grad_acc)], self.schedule(u), False

        def describe(feeds: list, loss: float, seconds: float) -> dict:
            self.tokens_seen += per_update
            info = {"epoch": batches.epoch, "tokens_per_s": per_update / max(seconds, 1e-9)}
            if self.pair_loss is not None:
                # (every process's pairs: one more sum of five numbers per update)
                sums = self.world.sum(self.pair_loss.sums(list(zip(self.step.last_outputs, feeds))))
                info.update(self.pair_loss.metrics(sums))
            return info

        def evaluate(u: int) -> dict:
            return {"step": u, "val_loss": self.evaluate(val_batches), **self.last_eval_metrics}

        self.stop_reason = fit_updates(self, self.step.updates, cfg.steps, draw, describe, every=cfg.eval_every,
                                       evaluate=evaluate if val_batches else None, on_step=on_step,
                                       on_eval=on_eval)
