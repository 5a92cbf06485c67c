"""Reverse-mode differentiation of graphs (layer 3), with gradient checkpointing.

backward(loss, wrt) appends the backward nodes to loss's graph and returns each
wanted tensor's gradient. Gradients flow only through nodes that lead to a tensor
in `wrt`; when a tensor receives several contributions they are summed as they
come (_accumulate, which also fuses a LoRA layer's two input-gradient products into
one matmul_lora). With checkpointing, each segment marked by Graph.checkpoint is
recomputed from its kept input just before its backward nodes, so the forward
intermediates of all segments but the last die right after the forward pass.
"""
from __future__ import annotations

from ggtrain.core import ops
from ggtrain.core.tensor import Tensor
from ggtrain.errors import ShapeError


def backward(loss: Tensor, wrt: list, seed: float = 1.0, checkpointing: bool = True,
             keep=None) -> dict:
    """Gradients of loss * seed with respect to each tensor in wrt: {tensor: grad}.

    loss must hold one element. A tensor loss does not depend on gets a zero gradient. wrt
    may hold op nodes too (the gradient of a chunk of the loss with respect to its input rows).
    keep: with checkpointing, a predicate on forward nodes whose outputs are kept rather
    than recomputed (selective checkpointing: e.g. the products with frozen weights, which
    cost most to recompute), besides those the graph marks (Graph.keep); with neither,
    whole segments are recomputed.
    Raises ShapeError for a non-scalar loss.
    """
    if loss.size != 1:
        raise ShapeError(f"backward: loss must hold one element, got shape {loss.shape}")
    graph = loss.graph
    wanted = {t.id for t in wrt}
    fwd = graph.ancestors([loss])
    needs = set()
    for t in fwd:  # creation order: sources before users
        if t.id in wanted:
            needs.add(t.id)
        elif t.kind == "op":
            opdef = ops.OPS[t.op]
            if any(s.id in needs for i, s in enumerate(t.srcs) if i in opdef.differentiable):
                needs.add(t.id)

    grads: dict = {loss.id: [graph.const(float(seed), name="loss seed").reshape(loss.shape)
                             if loss.shape else graph.const(float(seed), name="loss seed")]}
    op_nodes = [t for t in fwd if t.kind == "op" and t.id in needs]
    segments: dict = {}
    for t in op_nodes:
        segments.setdefault(t.segment, []).append(t)
    last = max(segments) if segments else 0
    done = {}   # wanted op nodes (not leaves): their gradient, taken before it flows on
    fusions = _Fusions()
    for seg in sorted(segments, reverse=True):
        nodes = segments[seg]
        clones = {}
        if checkpointing and seg != last:
            clones = _recompute(graph, nodes, lambda t: t.id in graph.kept or (keep is not None and keep(t)))
        for t in reversed(nodes):
            contribs = grads.pop(t.id, None)
            if contribs is None:
                continue
            g = _total(contribs)
            if t.id in wanted:
                done[t.id] = g
            opdef = ops.OPS[t.op]
            if opdef.backward is None:
                raise ShapeError(f"backward: op {t.op} has no backward rule")
            y = clones.get(t.id, t)
            mark = len(graph.nodes)
            src_grads = opdef.backward(y, g)
            fusions.tag(t, src_grads, mark)
            for s, gs in zip(t.srcs, src_grads):
                if gs is None or s.id not in needs:
                    continue
                if gs.shape != s.shape:
                    raise ShapeError(f"backward of {t.op}: gradient {gs.shape} for input {s.shape}")
                # summed as they come (the order _total would take): a partial sum frees its
                # parts, so K contributions (chunked logits' weight gradients) never live at once
                grads[s.id] = [_accumulate(grads[s.id][0], gs, fusions)] if s.id in grads else [gs]
    result = {}
    for t in wrt:
        contribs = grads.get(t.id)
        result[t] = done[t.id] if t.id in done else _total(contribs) if contribs else ops.fill(graph, t.shape, 0.0)
    return result


class _Fusions:
    """What _accumulate may fuse within one backward: the fresh product contributions
    (tensor id -> "frozen" or "adapter", see tag) and the partial sums it made."""

    def __init__(self):
        self.kinds: dict = {}
        self.sums: set = set()

    def tag(self, t, src_grads, mark: int) -> None:
        """Mark the input gradients of t's backward that may be fused: its first input's when
        it is a product this backward made (node id >= mark: nothing else reads it yet). A
        frozen layer's with an adapter (t a matmul_lora: g @ W; the backend has matmul_lora
        for W's type, or the forward would not have used it) is "frozen"; a plain f32
        product's, g_h @ A through an adapter's factor A (r, n), is "adapter"."""
        gx = src_grads[0] if src_grads else None
        if gx is None or gx.op != "matmul" or gx.id < mark or any(s is gx for s in src_grads[1:]):
            return
        if t.op == "matmul_lora":
            self.kinds[gx.id] = "frozen"
        elif t.op == "matmul":
            h, a = gx.srcs
            if h.dtype == "f32" and a.dtype == "f32" and a.ndim == 2 and h.is_contiguous() \
                    and 1 in a.strides:
                self.kinds[gx.id] = "adapter"

    def pair(self, u: Tensor, v: Tensor):
        """matmul_lora(x, W, h, A) for u and v a "frozen" x @ W and an "adapter" h @ A (either
        order) of one shape; else None."""
        kinds = {self.kinds.get(u.id): u, self.kinds.get(v.id): v}
        if "frozen" not in kinds or "adapter" not in kinds:
            return None
        p, q = kinds["frozen"], kinds["adapter"]
        (x, w), (h, a) = p.srcs, q.srcs
        if a.shape[1] != p.shape[-1] or h.shape[:-1] != p.shape[:-1] or h.shape[-1] != a.shape[0]:
            return None
        return ops.apply("matmul_lora", [x, w, h, a])

    def add(self, a: Tensor, b: Tensor) -> Tensor:
        y = ops.add(a, b)
        self.sums.add(y.id)
        return y


def _accumulate(acc: Tensor, g: Tensor, fusions: _Fusions) -> Tensor:
    """acc + g: the sum of a tensor's gradient contributions so far and the next one. A
    frozen layer's input gradient g @ W and an adapter's g_h @ A meeting in one sum (the input
    gradient of a LoRA layer's x) become one matmul_lora, g @ W + g_h @ A in one pass over
    the output (no temporary of x's size, no add), whether acc is one of the two or a partial
    sum ending in one (then S + (P + Q) for (S + P) + Q)."""
    fused = fusions.pair(acc, g)
    if fused is not None:
        return fused
    if acc.id in fusions.sums:
        s, last = acc.srcs
        fused = fusions.pair(last, g)
        if fused is not None:
            return fusions.add(s, fused)
    return fusions.add(acc, g)


def _total(contribs: list) -> Tensor:
    """The one place where gradient contributions are summed."""
    g = contribs[0]
    for c in contribs[1:]:
        g = ops.add(g, c)
    return g


def _recompute(graph, nodes: list, keep=None) -> dict:
    """Clone a segment's forward nodes (original id -> clone) reading the kept inputs; a node
    `keep` selects is not cloned (its forward output stays alive until its readers' backward,
    and so do the inputs its own backward reads).
    Only the clones some gradient reads are ever run (plans take the outputs' ancestors)."""
    clones: dict = {}
    for t in nodes:
        if keep is not None and keep(t):
            continue   # read where the forward left it
        srcs = [clones.get(s.id, s) for s in t.srcs]
        if t.op == "fill":
            c = ops.fill(graph, t.shape, t.params["value"])
        else:
            c = ops.apply(t.op, srcs, **t.params)
        if c.shape != t.shape:  # pragma: no cover - a registry bug
            raise ShapeError(f"recompute of {t.op} changed shape {t.shape} -> {c.shape}")
        clones[t.id] = c
    return clones
