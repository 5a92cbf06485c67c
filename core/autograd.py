"""Reverse-mode differentiation of graphs (layer 3), with gradient checkpointing.

backward(loss, wrt) appends the backward nodes to loss's graph and returns each
wanted tensor's gradient. Gradients flow only through nodes that lead to a tensor
in `wrt`; when a tensor receives several contributions they are summed in one
place (_total). With checkpointing, each segment marked by Graph.checkpoint is
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
            src_grads = opdef.backward(y, g)
            for s, gs in zip(t.srcs, src_grads):
                if gs is None or s.id not in needs:
                    continue
                if gs.shape != s.shape:
                    raise ShapeError(f"backward of {t.op}: gradient {gs.shape} for input {s.shape}")
                # summed as they come (the order _total would take): a partial sum frees its
                # parts, so K contributions (chunked logits' weight gradients) never live at once
                grads[s.id] = [ops.add(grads[s.id][0], gs)] if s.id in grads else [gs]
    result = {}
    for t in wrt:
        contribs = grads.get(t.id)
        result[t] = done[t.id] if t.id in done else _total(contribs) if contribs else ops.fill(graph, t.shape, 0.0)
    return result


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
