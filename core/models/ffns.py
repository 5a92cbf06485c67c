"""The FFNs a block's layer may take (layer 4), by the name Family.layer_kinds gives: "glu"
(SwiGLU or GeGLU), "moe" (routed experts), "moe_shared" (routed experts plus a gated shared
expert: Qwen3.5-MoE) or "glu_moe" (Gemma 4's dense FFN beside routed experts). Each is
ffn(net, x, layer, resid): x the ffn_norm of the residual stream resid,
(B, T, C) -> (B, T, C).
"""
from __future__ import annotations

import math

from ggtrain.core import ops
from ggtrain.core.models.family import SELECTION_BIAS
from ggtrain.core.models.net import Net, linear, norm, tap


def glu(net: Net, x, layer: int, resid=None):
    """The gated FFN of x (B, T, C): down(act(gate x) * up x), act silu (SwiGLU) or gelu's
    tanh form (GeGLU) as the family says; gate and up from one product where the family
    fuses them (stored as ffn_up: gate | up rows)."""
    p = f"blk.{layer}."
    if net.cfg.family.fused_gate_up:   # one product, gate | up columns
        gu = linear(net, x, p + "ffn_up.weight")                                          # (B, T, 2F)
        b, t, f2 = gu.shape
        gate = ops.view(gu, (b, t, f2 // 2), (t * f2, f2, 1))
        up = ops.view(gu, (b, t, f2 // 2), (t * f2, f2, 1), f2 // 2)
    else:
        gate = linear(net, x, p + "ffn_gate.weight")
        up = linear(net, x, p + "ffn_up.weight")
    return linear(net, _act(net, gate, up), p + "ffn_down.weight")


def _act(net: Net, gate, up):
    """act(gate) * up, act the family's: silu (SwiGLU), gelu's tanh form (GeGLU; in llama.cpp's
    numbers its f16-table gelu) or gpt-oss's clamped SwiGLU (ops.swiglu_oai; in llama.cpp's
    numbers its float order, ops.swiglu_oai_ggml)."""
    if net.cfg.family.act == "swiglu_oai":
        return ops.swiglu_oai_ggml(gate, up) if net.llama else ops.swiglu_oai(gate, up)
    if net.cfg.family.act != "gelu":
        return ops.swiglu_ggml(gate, up) if net.llama else ops.swiglu(gate, up)
    return ops.geglu_f16(gate, up) if net.llama else ops.geglu(gate, up)


def moe(net: Net, x, layer: int, resid=None):
    """The routed-expert FFN of x (B, T, C), llama.cpp's build_moe_ffn with softmax gating,
    routed by the router's logits of x (ffn_gate_inp, one an expert): see `experts`."""
    return experts(net, x, layer, linear(net, x, f"blk.{layer}.ffn_gate_inp.weight"))


def experts(net: Net, x, layer: int, logits):
    """Routed experts of x (B, T, C) by router logits (B, T, E): each token's experts_used
    largest (ops.moe_topk), their softmax probabilities as gate weights (divided by their sum
    where the family says: Family.moe_norm), or with sigmoid gating (ModelConfig.gating: the
    file's expert_gating_func) their sigmoids, the selection by the sigmoids plus the block's
    exp_probs_b.bias where it has one; each chosen expert's gated FFN (SwiGLU or GeGLU, as
    the family's act; gpt-oss's clamped swiglu_oai) over only its tokens, each product plus the
    expert's bias where the block has them (gpt-oss) (ops.moe_matmul on the stacked ffn_gate/up/down_exps,
    or gate | up rows of one ffn_gate_up_exps),
    times its ffn_down_exps.scale where the block has one (Gemma 4), times its weight, the k
    summed in slot order (as llama.cpp adds its views). Each product with its LoRA update where
    net.lora has one (expert_product)."""
    cfg = net.cfg
    p = f"blk.{layer}."
    b, t, c = x.shape
    k = cfg.experts_used
    numerics = net.numerics
    ids = ops.reshape(ops.moe_topk(logits, k, cfg.gating, net.params.get(p + SELECTION_BIAS)), (b * t, k))
    if net.aux is not None:
        net.aux.append(load_balance_loss(ops.reshape(logits, (b * t, logits.shape[-1])), ids, cfg.gating))
    weights = ops.moe_weights(logits, ops.reshape(ids, (b, t, k)), cfg.family.moe_norm, numerics, cfg.gating)
    weights = ops.reshape(weights, (b * t, k, 1))
    xs = ops.reshape(x, (b * t, 1, c))
    if p + "ffn_gate_up_exps.weight" in net.params:     # gate | up rows of each expert (gemma4), one product
        gu = expert_product(net, xs, p + "ffn_gate_up_exps.weight", ids)                  # (N, k, 2F)
        f = gu.shape[-1] // 2
        gate, up = (ops.view(gu, (b * t, k, f), (k * 2 * f, 2 * f, 1), j * f) for j in (0, 1))
    else:
        gate = _bias(net, expert_product(net, xs, p + "ffn_gate_exps.weight", ids),           # (N, k, F)
                     p + "ffn_gate_exps.bias", ids)
        up = _bias(net, expert_product(net, xs, p + "ffn_up_exps.weight", ids), p + "ffn_up_exps.bias", ids)
    down = _bias(net, expert_product(net, _act(net, gate, up), p + "ffn_down_exps.weight", ids,
                                     p + "ffn_down_exps.scale"), p + "ffn_down_exps.bias", ids)   # (N, k, C)
    down = ops.mul(down, weights)
    out = None
    for s in range(k):
        part = ops.view(down, (b * t, c), (k * c, 1), s * c)
        out = part if out is None else ops.add(out, part)
    return ops.reshape(out if k > 1 else ops.cont(out), (b, t, c))


def load_balance_loss(logits, ids, gating: str = "softmax"):
    """The Switch Transformer's load-balancing loss of one routed layer: E * sum_e f_e P_e,
    f_e the share of the N * k routed slots that go to expert e (ids (N, k), no gradient),
    P_e the mean over the N tokens of the router's probability of e, before the top-k:
    softmax(logits (N, E))[e], or with sigmoid gating (the router's own scores) the sigmoids
    normalised to sum 1 over the experts (DeepSeek-V3's normalised affinities). 1 when the
    routing is uniform, E / k at worst (every token's k experts the same k, with all their
    probability); its gradient pushes the router's probability away from the experts that
    take more than their share. Computed as E / (N^2 k) * sum over the slots of S[ids] with
    S_e = sum_n P[n, e]."""
    n, e = logits.shape
    k = ids.shape[1]
    if gating == "sigmoid":
        s = ops.sigmoid(logits)
        p = ops.div(s, ops.sum_rows(s))                                               # (N, E)
    else:
        p = ops.softmax(logits)                                                        # (N, E)
    s = ops.sum_rows(ops.cont(ops.transpose(p, 0, 1)))                               # (E, 1)
    return ops.scale(ops.sum(ops.get_rows(s, ids)), e / (n * n * k))


def expert_product(net: Net, x, name: str, ids, scale: str | None = None):
    """The stacked experts `name`'s product with x (N, 1 or k, n_in) routed by ids (N, k):
    ops.moe_matmul (N, k, n_out), times each expert's scalar where the block has the tensor
    `scale` (Gemma 4's ffn_down_exps.scale), plus its LoRA update where net.lora has one:
    lora.Adapter a (E, r, n_in), b (E, n_out, r), expert e's s * B[e] (A[e] x) over its routed
    rows (two moe_matmul products), added after the scalar, as llama.cpp's build_lora_mm_id
    does; its dropout drops the adapter's input out in training. In llama numbers the scale
    goes on B (A x), as llama.cpp's graph applies it; else on A x (r columns)."""
    tap(net, name, x, ids)
    y = ops.moe_matmul(x, net.params[name], ids, net.numerics)
    s = net.params.get(scale) if scale is not None else None
    if s is not None:
        e = s.shape[0]
        y = ops.mul(y, ops.reshape(ops.get_rows(ops.reshape(s, (e, 1)), ids), (ids.shape[0], ids.shape[1], 1)))
    ad = net.lora.get(name)
    if ad is None:
        return y
    if net.llama:
        d = ops.scale(ops.moe_matmul(ops.moe_matmul(x, ad.a, ids, net.numerics), ad.b, ids, net.numerics), ad.scale)
    else:
        xa = ops.dropout(x, *ad.dropout) if ad.dropout is not None else x
        d = ops.moe_matmul(ops.scale(ops.moe_matmul(xa, ad.a, ids), ad.scale), ad.b, ids)
    return ops.add(y, d)


def moe_shared(net: Net, x, layer: int, resid=None):
    """Routed experts of x (B, T, C) (`moe`) plus the shared expert, as llama.cpp's qwen35moe
    graph: a gated FFN of x (ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp) times
    sigmoid(ffn_gate_inp_shexp . x), one gate a token."""
    p = f"blk.{layer}."
    gate, up = linear(net, x, p + "ffn_gate_shexp.weight"), linear(net, x, p + "ffn_up_shexp.weight")
    shared = linear(net, _act(net, gate, up), p + "ffn_down_shexp.weight")
    weight = ops.sigmoid(linear(net, x, p + "ffn_gate_inp_shexp.weight"))                # (B, T, 1)
    return ops.add(moe(net, x, layer), ops.mul(shared, weight))


def _bias(net: Net, y, name: str, ids):
    """y (N, k, F) plus each chosen expert's bias row (name: (E, F), gpt-oss) where the block
    has one (llama.cpp's ggml_add_id)."""
    bias = net.params.get(name)
    return y if bias is None else ops.add(y, ops.get_rows(bias, ids))


def glu_moe(net: Net, x, layer: int, resid):
    """Gemma 4's FFN with experts: its dense GeGLU FFN of x (the ffn_norm of the residual
    stream resid), normed by post_ffw_norm_1, plus routed experts of pre_ffw_norm_2(resid),
    routed by ffn_gate_inp's logits of resid RMS-normed (no weight), times 1/sqrt(n_embd) and
    ffn_gate_inp.scale, normed by post_ffw_norm_2."""
    cfg = net.cfg
    p = f"blk.{layer}."
    dense = norm(net, glu(net, x, layer), p + "post_ffw_norm_1.weight")
    route = ops.scale(ops.rms_norm(resid, cfg.norm_eps, numerics=net.numerics), 1.0 / math.sqrt(cfg.dim))
    logits = linear(net, ops.mul(route, net.params[p + "ffn_gate_inp.scale"]), p + "ffn_gate_inp.weight")
    routed = experts(net, norm(net, resid, p + "pre_ffw_norm_2.weight"), layer, logits)
    return ops.add(dense, norm(net, routed, p + "post_ffw_norm_2.weight"))


# the FFNs a family's layer_kinds may name
FFNS = {"glu": glu, "moe": moe, "moe_shared": moe_shared, "glu_moe": glu_moe}
