"""The step engine (layer 4): a loss turned into native plans once, run one update at a time.

TrainStep turns a loss into native plans once: forward + backward (+ gradient
accumulation into persistent buffers) + optimizer update. Each call to `step`
copies the batch in, runs one native call per physical batch and one for the
update (fused into a single call when there is no accumulation and one process),
and reads the loss and gradient norm back. With several processes
(core/distributed.py) the gradient buffer is summed over them between the last
backward and the update.
"""
from __future__ import annotations

import numpy as np

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.distributed import World
from ggtrain.core.graph import Rows, Runtime, assign
from ggtrain.core.optim import LBFGS, LBFGSSearch
from ggtrain.core.ops import HYPER_COUNT
from ggtrain.core.tensor import Tensor
from ggtrain.errors import ConfigError, ShapeError


class TrainStep:
    """Compiled training step for `loss` over trainable `params`.

    grad_acc: physical batches per optimizer update; their gradients add up in
    persistent buffers and each physical loss is scaled by 1/grad_acc, so an update
    equals one over a batch grad_acc times larger (to float rounding).

    Plans: the gradient plans (`_micro`, forward + backward of one physical batch into the
    flat gradient buffer, accumulating when grad_acc > 1) and the update (`_update`: the
    optimizer's step nodes). AdamW and SGD without accumulation fuse both into one plan.
    L-BFGS (optim.LBFGS) runs the gradient plans once per line-search evaluation and its
    own plans in between (optim.LBFGSSearch); `_gradients` is the one place an update's
    gradient is computed. With several processes it ends with the gradient all-reduce
    (`_reduce`), so every plan that reads the gradient reads the sum: AdamW and SGD then
    never fuse (one all-reduce and, after the update, one sum of losses and stop votes per
    update); each L-BFGS evaluation also sums the loss, so every process's line search
    takes the same decisions (plus one sum of stop votes per update).
    """

    def __init__(self, loss: Tensor, params: list, optimizer, backend, grad_acc: int = 1,
                 checkpointing: bool = True, extra_outputs=(),
                 bind: dict | None = None, keep=None, world: World | None = None):
        """bind: {persistent tensor: backend buffer already holding its bytes} (frozen
        weights read straight from a file), adopted before anything is allocated. keep:
        selective checkpointing (see autograd.backward). world: the processes that train
        together (core/distributed.py); each brings the gradients of its share of the batch
        and one all-reduce sums them before the update."""
        if grad_acc < 1:
            raise ConfigError(f"grad_acc must be >= 1, got {grad_acc}")
        if not params:
            raise ConfigError("TrainStep: no parameters to train")
        graph = loss.graph
        self.graph, self.loss, self.params = graph, loss, list(params)
        self.optimizer, self.grad_acc = optimizer, grad_acc
        self.world = world or World()
        self.backend = backend
        self.runtime = Runtime(graph, backend)
        for t, buf in (bind or {}).items():
            self.runtime.bind(t, buf)
        self.updates = 0  # optimizer updates done
        self.stop_voted = False  # whether some process asked to stop with the last update

        # each of the grad_acc x size physical batches of an update adds its share of the mean
        n_batches = grad_acc * self.world.size
        grads = backward(loss, self.params, seed=1.0 / n_batches, checkpointing=checkpointing, keep=keep)
        # One flat persistent buffer holds every gradient (each parameter's is a view
        # into it): the global norm is one reduction and zeroing is one fill.
        total = sum(p.size for p in self.params)
        self.grad_flat = graph.state((total,), name="grads")
        self.grad_bufs, offset = {}, 0
        for p in self.params:
            self.grad_bufs[p.id] = ops.view(self.grad_flat, p.shape, None, offset)
            offset += p.size
        bufs = [self.grad_bufs[p.id] for p in self.params]
        self.hyper = graph.input((HYPER_COUNT,), name="hyper")
        outs = [loss] + list(extra_outputs)
        if grad_acc == 1:   # the gradients are written, not added
            written = [assign(grads[p], self.grad_bufs[p.id]) for p in self.params]
        else:
            written = []
            for p in self.params:
                buf = self.grad_bufs[p.id]
                a = ops.add(buf, grads[p])
                a.out = buf
                written.append(a)
        # created after every gradient is written, so it reads the finished buffer
        self.grad_norm = ops.sqrt(ops.sumsq(self.grad_flat))
        self._micro = self._zero = self._search = None
        if isinstance(optimizer, LBFGS):
            self._micro = self.runtime.compile(outs + written)
            if grad_acc > 1:
                self._zero = self.runtime.compile([self._zero_grads()])
            self._search = LBFGSSearch(optimizer, graph, self.params, self.grad_flat, self.grad_norm)
            self._search.compile(self.runtime)
            self.state = self._search.buffers
            self._update = None
        else:
            steps, self.state = optimizer.build(graph, self.params, bufs, self.hyper, self.grad_norm)
            if n_batches == 1:   # one plan: forward, backward and update fused
                self._update = self.runtime.compile(outs + written + steps + [self.grad_norm])
            else:   # split between backward and update: accumulation, the all-reduce (_reduce)
                self._micro = self.runtime.compile(outs + written)
                # the steps read the norm and gradients before the fill (when the micro plan
                # accumulates, the update zeroes the buffer): creation order
                zero = [self._zero_grads()] if grad_acc > 1 else []
                self._update = self.runtime.compile(steps + zero + [self.grad_norm])
        self.extra_outputs = list(extra_outputs)
        self.last_outputs = []   # per physical batch: [value of each extra output]
        self.last_grad_norm = float("nan")
        self.last_search = {}    # L-BFGS: "evals", "step_size", "converged" of the last update

    def _zero_grads(self) -> Tensor:
        """A node filling the flat gradient buffer with zeros (runs after the nodes made before it)."""
        zero = ops.fill(self.graph, self.grad_flat.shape, 0.0)
        zero.out = self.grad_flat
        return zero

    @property
    def memory(self):
        """Planned bytes of the runtime: its one arena (shared by the step's plans and any
        compiled on it since, e.g. evaluation), persistent buffers and every plan's work."""
        return self.runtime.memory

    @property
    def flops(self) -> int:
        """FLOPs of the products and convolutions (ops.product_flops) of one update (of one
        evaluation for L-BFGS, whose updates take several): forward, backward, recomputation,
        the physical-batch plan counted grad_acc times."""
        flops = self._update.flops if self._update is not None else 0
        return flops + (self._micro.flops * self.grad_acc if self._micro is not None else 0)

    @property
    def row_flops(self) -> int:
        """The part of flops done only for loss rows whose target counts (ops.row_flops), all
        of them counted."""
        flops = self._update.row_flops if self._update is not None else 0
        return flops + (self._micro.row_flops * self.grad_acc if self._micro is not None else 0)

    def _set_inputs(self, batch: dict) -> None:
        for t, value in batch.items():
            if not isinstance(t, Tensor) or t.kind != "input":
                raise ShapeError(f"step: {t!r} is not an input tensor of the graph")
            if isinstance(value, Rows):
                self.runtime.gather_rows(t, value.source, value.index)
            else:
                self.runtime.set(t, value)

    def _gradients(self, batches: list) -> tuple:
        """Forward + backward of each physical batch into the flat gradient buffer (zeroed
        first when it accumulates and the update plan does not zero it), then, with several
        processes, the all-reduce that sums theirs (`_reduce`). Returns ([loss of each of
        this process's physical batches], [[value of each extra output] per physical batch])."""
        if self._zero is not None:
            self.runtime.run(self._zero)
        losses, outputs = [], []
        for batch in batches:
            self._set_inputs(batch)
            self.runtime.run(self._micro)
            losses.append(float(self._micro.read(self.loss)))
            outputs.append([self._micro.read(t) for t in self.extra_outputs])
        self._reduce()
        return losses, outputs

    def _evaluation(self, batches: list) -> tuple:
        """One L-BFGS evaluation at the current parameters: `_gradients`, and the loss summed
        over the processes too, so that every process's line search sees the same numbers
        (the summed gradient and loss) and takes the same decisions. Returns (mean loss of
        the update's batch over every process, outputs as _gradients)."""
        losses, outputs = self._gradients(batches)
        if self.world.size == 1:
            return float(np.mean(losses)), outputs
        return float(self.world.sum([sum(losses)])[0] / (len(losses) * self.world.size)), outputs

    def step(self, batches: list, lr: float, stop=None, same_batch: bool = False) -> float:
        """One optimizer update over grad_acc physical batches ({input tensor: array} each).

        Returns the mean loss over the physical batches (of every process; before the
        update). stop: asked after the update, whether this process wants to stop (e.g.
        Ctrl-C came); `self.stop_voted` then says whether any process did, so that all stop after
        the same update. same_batch: the batches are the previous update's (full-batch
        training); L-BFGS then starts from the evaluation it ended that update with.
        """
        if len(batches) != self.grad_acc:
            raise ConfigError(f"step: expected {self.grad_acc} physical batches, got {len(batches)}")
        self.updates += 1
        wants = (lambda: bool(stop())) if stop is not None else (lambda: False)
        if self._search is not None:
            res = self._search.step(lambda: self._evaluation(batches), lr, reuse=same_batch)
            self.last_outputs = res.pop("payload")
            self.last_grad_norm = res.pop("grad_norm")
            self.last_search = res
            # the loss is every process's already; the vote is the one more sum
            self.stop_voted = wants() if self.world.size == 1 else self.world.sum([float(wants())])[0] > 0
            return res["loss"]
        self.runtime.set(self.hyper, self.optimizer.hyper(self.updates, lr))
        if self._micro is None:
            self._set_inputs(batches[0])
            self.runtime.run(self._update)
            losses = [float(self._update.read(self.loss))]
            self.last_outputs = [[self._update.read(t) for t in self.extra_outputs]]
        else:
            losses, self.last_outputs = self._gradients(batches)
            self.runtime.run(self._update)
        self.last_grad_norm = float(self._update.read(self.grad_norm))
        if self.world.size == 1:
            self.stop_voted = wants()
            return float(np.mean(losses))
        # one sum after the update: the losses and the stop vote
        total, votes = self.world.sum([sum(losses), float(wants())])
        self.stop_voted = votes > 0
        return float(total / (len(losses) * self.world.size))

    def _reduce(self) -> None:
        """Between backward and update (each L-BFGS evaluation): sum the processes'
        gradients (their shares of the update's mean) in the flat buffer, in place."""
        if self.world.size > 1:
            self.world.allreduce(self.backend, self.runtime.buffer(self.grad_flat), self.grad_flat.size)

    @property
    def converged(self) -> bool:
        """L-BFGS found no step that lowers the loss in its last update (every process
        alike: their searches see the same numbers)."""
        return bool(self.last_search.get("converged"))

    def optimizer_state(self) -> dict:
        """{name: f32 array} of everything the optimizer carries between updates."""
        state = {name: self.get(t) for name, t in self.state.items()}
        if self._search is not None:
            state.update(self._search.host_state())
        return state

    def load_optimizer_state(self, state: dict) -> None:
        """Restore optimizer_state(); ConfigError naming a missing entry."""
        want = list(self.state) + (list(self._search.host_state()) if self._search is not None else [])
        for name in want:
            if name not in state:
                raise ConfigError(f"checkpoint has no optimizer state {name}")
        if self._search is not None:   # first: it checks the history length
            self._search.load_host_state(state)
        for name, t in self.state.items():
            self.set(t, state[name])

    def get(self, t: Tensor) -> np.ndarray:
        """Current value of a parameter or state tensor."""
        return self.runtime.get(t)

    def set(self, t: Tensor, value) -> None:
        self.runtime.set(t, value)


def search_fields(step: TrainStep) -> dict:
    """The log fields of an L-BFGS update (evaluations, accepted step); none for the others."""
    s = step.last_search
    return {"evals": s["evals"], "step_size": s["step_size"]} if s else {}
