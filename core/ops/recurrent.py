"""Recurrences over time (layer 3): the gated delta rule of Qwen3.5's gated DeltaNet layers
(llama.cpp's gated_delta_net), step by step, with its exact backward by the reverse recurrence."""
from __future__ import annotations

from ggtrain.core.ops.registry import OpDef, _f32, _need, apply, register
from ggtrain.core.ops.views import view
from ggtrain.core.tensor import Tensor
from ggtrain.errors import DTypeError


def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, seg: Tensor | None = None,
               chunked: bool | None = None) -> Tensor:
    """The gated delta rule: per V head h (reading K head h % Hk), a state S (Dk, Dv) from 0,
    at each row S = e^g S; S = S + k (beta (v - S^T k))^T; o = S^T q / sqrt(Dk).

    q, k (B, T, Hk, Dk), v (B, T, Hv, Dv), g (the log decay) and beta (B, T, Hv), all f32;
    seg (B, T) i32 or None: with packed samples the state restarts from 0 where the segment
    changes. Returns o (B, T, Hv, Dv). Raises ShapeError / DTypeError for bad shapes or types.

    chunked: the CPU kernels' form, forward and backward. False: row by row (the recurrence
    itself); True: in chunks of 64 rows, matrix products within a chunk and the state carried
    across (native/cpu/deltachunk.c; equal in real arithmetic, ~1e-6 apart in f32). None, the
    rule: chunked where T >= CHUNKED_MIN_T and Dk * Dv >= CHUNKED_MIN_STATE (heads of 64 x 64
    and up), where bench/bench_deltarule.py measured it faster (Qwen3.5-0.8B's 16 heads of
    128, T = 512 .. 2048: 3-5x forward + backward on 2 cores); narrow heads stay row by row.
    The CUDA kernels run row by row either way (no chunked CUDA kernel yet).
    """
    if chunked is None:
        chunked = q.shape[1] >= CHUNKED_MIN_T and q.shape[3] * v.shape[3] >= CHUNKED_MIN_STATE
    return apply("delta_rule", [q, k, v, g, beta] + ([seg] if seg is not None else []), seg=seg is not None,
                 chunked=bool(chunked))


CHUNKED_MIN_T = 32            # delta_rule's rule (see there)
CHUNKED_MIN_STATE = 64 * 64


def delta_rule_state(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s0: Tensor) -> tuple:
    """delta_rule from the state s0 (B, Hv, Dv, Dk) (row j of a head's block: column j of S):
    returns (o (B, T, Hv, Dv), the state after the last row (B, Hv, Dv, Dk)); generation carries
    it from call to call. No gradient."""
    b, t, hv, dv = v.shape
    dk = q.shape[3]
    out = apply("delta_rule", [q, k, v, g, beta, s0], seg=False, state=True)
    width = t * hv * dv + hv * dv * dk
    o = view(out, (b, t, hv, dv), (width, hv * dv, dv, 1), 0)
    s1 = view(out, (b, hv, dv, dk), (width, dv * dk, dk, 1), t * hv * dv)
    return o, s1


def _infer(name):
    def infer(srcs, params):
        _f32(name, *srcs[:5])
        q, k, v, g, beta = srcs[:5]
        _need(q.ndim == 4 and k.shape == q.shape and v.ndim == 4 and v.shape[:2] == q.shape[:2]
              and q.shape[2] >= 1 and v.shape[2] % q.shape[2] == 0,
              f"{name}: expected q, k (B, T, Hk, Dk) and v (B, T, Hv, Dv) with Hv a multiple of Hk, "
              f"got q {q.shape}, k {k.shape}, v {v.shape}")
        b, t, hk, dk = q.shape
        hv, dv = v.shape[2], v.shape[3]
        _need(g.shape == (b, t, hv) and beta.shape == (b, t, hv),
              f"{name}: expected g and beta ({b}, {t}, {hv}), got {g.shape} and {beta.shape}")
        at = 5
        if name == "delta_rule_bwd":
            _f32(name, srcs[5])
            _need(srcs[5].shape == v.shape, f"{name}: go {srcs[5].shape} does not match v {v.shape}")
            at = 6
        if params.get("seg"):
            seg = srcs[at]
            if seg.dtype != "i32":
                raise DTypeError(f"{name}: segments must be i32, got {seg.dtype}")
            _need(seg.shape == (b, t), f"{name}: segments {seg.shape} do not match (B, T) = {(b, t)}")
            at += 1
        if params.get("state"):
            _f32(name, srcs[at])
            _need(srcs[at].shape == (b, hv, dv, dk), f"{name}: expected s0 {(b, hv, dv, dk)}, got {srcs[at].shape}")
            return (b, t * hv * dv + hv * dv * dk), "f32"
        if name == "delta_rule_bwd":
            return (b, t, 2 * hk * dk + hv * dv + 2 * hv), "f32"
        return v.shape, "f32"
    return infer


def _delta_rule_bwd(y, go):
    _need(not y.params.get("state"), "delta_rule: no gradient through a carried state (generation only)")
    q, k, v, g, beta = y.srcs[:5]
    seg = list(y.srcs[5:])
    packed = apply("delta_rule_bwd", [q, k, v, g, beta, go] + seg, seg=bool(seg), chunked=y.params.get("chunked", False))
    t, hk, dk = q.shape[1:]
    hv, dv = v.shape[2], v.shape[3]
    width = 2 * hk * dk + hv * dv + 2 * hv
    rows = (t * width, width)
    dq = view(packed, q.shape, rows + (dk, 1), 0)
    dkk = view(packed, k.shape, rows + (dk, 1), hk * dk)
    dvv = view(packed, v.shape, rows + (dv, 1), 2 * hk * dk)
    dg = view(packed, g.shape, rows + (1,), 2 * hk * dk + hv * dv)
    db = view(packed, beta.shape, rows + (1,), 2 * hk * dk + hv * dv + hv)
    return [dq, dkk, dvv, dg, db] + [None] * len(seg)


def _lower(y):
    return (int(bool(y.params.get("seg"))), int(bool(y.params.get("state"))), int(bool(y.params.get("chunked")))), ()


register(OpDef("delta_rule", _infer("delta_rule"), "delta_rule_fwd", contiguous=(0, 1, 2, 3, 4, 5, 6),
               backward=_delta_rule_bwd, differentiable=(0, 1, 2, 3, 4), lower=_lower))
register(OpDef("delta_rule_bwd", _infer("delta_rule_bwd"), "delta_rule_bwd", contiguous=(0, 1, 2, 3, 4, 5, 6),
               lower=_lower))
