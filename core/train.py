"""Training steps and the training loop (layer 4).

TrainStep turns a loss into native plans once: forward + backward (+ gradient
accumulation into persistent buffers) + optimizer update. Each call to `step`
copies the batch in, runs one native call per physical batch and one for the
update (fused into a single call when there is no accumulation), and reads the
loss and gradient norm back.
"""
from __future__ import annotations

import numpy as np

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.graph import Runtime, assign
from ggtrain.core.optim import global_norm
from ggtrain.core.ops import HYPER_COUNT
from ggtrain.core.tensor import Tensor
from ggtrain.errors import ConfigError, ShapeError


class TrainStep:
    """Compiled training step for `loss` over trainable `params`.

    grad_acc: physical batches per optimizer update; their gradients add up in
    persistent buffers and each physical loss is scaled by 1/grad_acc, so an update
    equals one over a batch grad_acc times larger (to float rounding).
    """

    def __init__(self, loss: Tensor, params: list, optimizer, backend, grad_acc: int = 1,
                 checkpointing: bool = True, n_threads: int | None = None, extra_outputs=()):
        if grad_acc < 1:
            raise ConfigError(f"grad_acc must be >= 1, got {grad_acc}")
        if not params:
            raise ConfigError("TrainStep: no parameters to train")
        graph = loss.graph
        self.graph, self.loss, self.params = graph, loss, list(params)
        self.optimizer, self.grad_acc = optimizer, grad_acc
        self.runtime = Runtime(graph, backend)
        self.n_threads = n_threads or getattr(backend, "n_threads", 1)
        self.updates = 0  # optimizer updates done

        grads = backward(loss, self.params, seed=1.0 / grad_acc, checkpointing=checkpointing)
        self.grad_bufs = {p.id: graph.state(p.shape, name=f"{p.name}.grad") for p in self.params}
        self.hyper = graph.input((HYPER_COUNT,), name="hyper")
        outs = [loss] + list(extra_outputs)
        if grad_acc == 1:
            written = [assign(grads[p], self.grad_bufs[p.id]) for p in self.params]
            bufs = [self.grad_bufs[p.id] for p in self.params]
            # the update reads the persistent buffers the gradients were written to
            self.grad_norm = global_norm(written)
            steps, self.state = optimizer.build(graph, self.params, bufs, self.hyper, self.grad_norm)
            self._micro = None
            self._update = self.runtime.compile(outs + written + steps + [self.grad_norm], self.n_threads)
        else:
            acc = []
            for p in self.params:
                buf = self.grad_bufs[p.id]
                a = ops.add(buf, grads[p])
                a.out = buf
                acc.append(a)
            self._micro = self.runtime.compile(outs + acc, self.n_threads)
            bufs = [self.grad_bufs[p.id] for p in self.params]
            self.grad_norm = global_norm(bufs)
            steps, self.state = optimizer.build(graph, self.params, bufs, self.hyper, self.grad_norm)
            zeros = []
            for p in self.params:
                z = ops.fill(graph, p.shape, 0.0)
                z.out = self.grad_bufs[p.id]
                zeros.append(z)
            # steps must read the norm before zeroing: creation order guarantees it
            self._update = self.runtime.compile(steps + zeros + [self.grad_norm], self.n_threads)
        self.last_grad_norm = float("nan")

    @property
    def memory(self):
        """Planned bytes of the larger plan (arena + persistent + scratch)."""
        plans = [p for p in (self._micro, self._update) if p is not None]
        return max((p.report for p in plans), key=lambda r: r.peak)

    def _set_inputs(self, batch: dict) -> None:
        for t, value in batch.items():
            if not isinstance(t, Tensor) or t.kind != "input":
                raise ShapeError(f"step: {t!r} is not an input tensor of the graph")
            self.runtime.set(t, value)

    def step(self, batches: list, lr: float) -> float:
        """One optimizer update over grad_acc physical batches ({input tensor: array} each).

        Returns the mean loss over the physical batches.
        """
        if len(batches) != self.grad_acc:
            raise ConfigError(f"step: expected {self.grad_acc} physical batches, got {len(batches)}")
        self.updates += 1
        self.runtime.set(self.hyper, self.optimizer.hyper(self.updates, lr))
        losses = []
        if self._micro is None:
            self._set_inputs(batches[0])
            self.runtime.run(self._update, self.n_threads)
            losses.append(float(self._update.read(self.loss)))
            self.last_grad_norm = float(self._update.read(self.grad_norm))
        else:
            for batch in batches:
                self._set_inputs(batch)
                self.runtime.run(self._micro, self.n_threads)
                losses.append(float(self._micro.read(self.loss)))
            self.runtime.run(self._update, self.n_threads)
            self.last_grad_norm = float(self._update.read(self.grad_norm))
        return float(np.mean(losses))

    def get(self, t: Tensor) -> np.ndarray:
        """Current value of a parameter or state tensor."""
        return self.runtime.get(t)

    def set(self, t: Tensor, value) -> None:
        self.runtime.set(t, value)
