"""The mixers a block's layer may be (layer 4), by the name Family.layer_kinds gives: "attention"
(q/k/v projections, + biases (qwen2), RMSNorm of q and k per head (qwen3) or over all heads
(olmoe), rope (adjacent pairs or NEOX halves, llama 3's frequency factors, linear scaling),
grouped KV heads, causal, 1/sqrt(D) scale, Qwen3.5's output gate), "shortconv" (LFM2) or
"deltanet" (Qwen3.5's gated DeltaNet), the last two recurrent; and what incremental decoding
keeps of each (MIXER_CACHE).

Attention is one fused op (ops.attention): q, k, v are read in the (B, T, heads, D)
layout the projections give, query heads h = kv*G + g sharing kv head `kv` (grouped
KV heads), and its output is already the (B, T, H*D) input of attn_output.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from ggtrain.core import ops
from ggtrain.core.models.family import ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, ROPE_FREQS
from ggtrain.core.models.net import Inputs, Net, Options, linear, norm
from ggtrain.core.numerics import LLAMA
from ggtrain.errors import ConfigError


def _rope_factors(net: Net, n_ctx: int):
    """The per-pair frequency divisors a run of context n_ctx rotates with, or None."""
    cfg = net.cfg
    if cfg.rope_long:     # llama.cpp: the long factors when the context passes the original one
        return net.params[ROPE_FACTORS_LONG if n_ctx > (cfg.rope_orig_ctx or cfg.ctx) else ROPE_FACTORS_SHORT]
    return net.params.get(ROPE_FREQS)



def _yarn(cfg, n_dims: int, base: float) -> dict:
    """The rope options of YaRN as llama.cpp sets them (llama_context): ext_factor 1, ggml's
    correction dims for beta_fast 32 and beta_slow 1 (llama.cpp's defaults; it reads no key
    for them) over rope_orig_ctx positions (0: ctx), and its attention factor, in f32:
    (0.1 ln s + 1) / (1 + 0.1 ln s) of the factor s (one, to rounding) times rope_attn_factor
    (the rope kernel multiplies by 1 + 0.1 ln s again, as ggml's rope_yarn)."""
    f = np.float32
    s = f(cfg.rope_scale)
    m = f(f(0.1) * np.log(s) + f(1.0)) if s > 1 else f(1.0)
    m = f(m * f(f(1.0) / f(f(1.0) + f(0.1) * np.log(s))))
    return dict(ext_factor=1.0, corr_dims=ops.yarn_corr_dims(n_dims, cfg.rope_orig_ctx or cfg.ctx, base),
                attn_factor=float(f(m * f(cfg.rope_attn_factor))))


def attention(net: Net, x, layer: int, inp: Inputs, opt: Options, keep: Callable | None):
    """Self-attention of x (B, T, C), causal, over the window (inp.seg: packed samples) or
    the KV cache (inp.cache). keep: called with the fused attention node (Graph.keep under
    checkpointing). A sliding-window layer has its window, its head size, rotated dims and
    rope base, and no rope scaling; a NoPE layer no rope. A layer sharing an earlier layer's
    keys and values (ModelConfig.kv_source) projects only q and attends over those (inp.kv)."""
    cfg = net.cfg
    b, t, c = x.shape
    fam = cfg.family
    p = f"blk.{layer}."
    local = cfg.local(layer)
    h, hkv, d = cfg.heads, cfg.at("kv_heads", layer), cfg.head(layer)
    source = cfg.kv_source(layer)
    gate = None
    if fam.q_gate:      # Qwen3.5: q | gate per head from attn_q; k, v their own
        qg = linear(net, x, p + "attn_q.weight")                                          # (B, T, H*2D)
        q = ops.view(qg, (b, t, h, d), (t * 2 * h * d, 2 * h * d, 2 * d, 1))
        gate = ops.view(qg, (b, t, h, d), (t * 2 * h * d, 2 * h * d, 2 * d, 1), d)
        k = ops.reshape(linear(net, x, p + "attn_k.weight"), (b, t, hkv, d))
        v = ops.reshape(linear(net, x, p + "attn_v.weight"), (b, t, hkv, d))
    elif fam.fused_qkv:   # one product, its q | k | v columns read as views
        qkv = linear(net, x, p + "attn_qkv.weight")                                      # (B, T, (H+2Hkv)*D)
        n = qkv.shape[-1]
        q = ops.view(qkv, (b, t, h, d), (t * n, n, d, 1))
        k = ops.view(qkv, (b, t, hkv, d), (t * n, n, d, 1), h * d)
        v = ops.view(qkv, (b, t, hkv, d), (t * n, n, d, 1), (h + hkv) * d)
    else:
        q = linear(net, x, p + "attn_q.weight")       # normed over all heads at once where the family says
        q = ops.reshape(norm(net, q, p + "attn_q_norm.weight") if fam.qk_norm_full else q, (b, t, h, d))
        if source == layer:
            kp = linear(net, x, p + "attn_k.weight")
            k = ops.reshape(norm(net, kp, p + "attn_k_norm.weight") if fam.qk_norm_full else kp, (b, t, hkv, d))
            v = ops.reshape(kp, (b, t, hkv, d)) if cfg.at("v_from_k", layer) else \
                ops.reshape(linear(net, x, p + "attn_v.weight"), (b, t, hkv, d))
    if fam.qk_norm:   # RMSNorm over each head's D values
        q = norm(net, q, p + "attn_q_norm.weight")
        if source == layer:
            k = norm(net, k, p + "attn_k_norm.weight")
    if fam.v_norm and source == layer:
        v = ops.rms_norm(v, cfg.norm_eps, numerics=net.numerics)
    nope = fam.no_rope_every and (layer + 1) % fam.no_rope_every == 0      # smollm3's NoPE layers
    if not nope:
        factors = None if local and fam.global_rope_freqs else _rope_factors(net, opt.n_ctx or t)
        plain = local and not fam.swa_rope_global       # a local layer's own base, no scaling
        rope = dict(n_dims=cfg.rot(layer), freq_base=cfg.rope_base_swa if plain else cfg.rope_base,
                    mode=fam.rope_mode, freq_scale=1.0 if plain else 1.0 / cfg.rope_scale, factors=factors,
                    attn_factor=cfg.rope_attn_factor, numerics=net.numerics)
        if cfg.rope_yarn:
            rope.update(_yarn(cfg, rope["n_dims"], rope["freq_base"]))
        q = ops.rope(q, inp.pos, **rope)
        if source == layer:
            k = ops.rope(k, inp.pos, **rope)
    scale = fam.attention_scale(cfg)
    window = cfg.window if local else 0
    sinks = net.params.get(p + "attn_sinks.weight") if fam.sinks else None
    # llama.cpp's numbers (no segment mask there: packed windows are training's)
    llama = dict(numerics=LLAMA, scale_q=fam.scale_q, kv_f16=net.kv_f16) if net.llama and inp.seg is None else {}
    if llama and sinks is not None:     # the sinks inside the softmax, as llama.cpp's soft_max adds them
        llama["sinks"], sinks = sinks, None
    if inp.cache is None:
        if source == layer:
            inp.kv[layer] = (k, v)
        k, v = inp.kv[source]
        out = ops.attention(q, k, v, scale, causal=inp.seg is None, seg=inp.seg, window=window,   # (B, T, H, D)
                            parent=inp.parent, with_lse=sinks is not None, **llama)
        if keep is not None:
            keep((out[0] if sinks is not None else out).root)
    else:
        if b != 1:
            raise ConfigError(f"{cfg.arch}: a KV cache serves one sequence, got a batch of {b}")
        if source == layer:
            kv = inp.cache[layer]
            inp.kv[layer] = (ops.set_rows(kv[0], ops.reshape(k, (t, hkv * d)), inp.pos),            # (S, Hkv*D)
                             ops.set_rows(kv[1], ops.reshape(v, (t, hkv * d)), inp.pos))
        cache_k, cache_v = inp.kv[source]
        k = ops.view(cache_k, (1, inp.n_kv, hkv, d))                                    # rows 0..n_kv-1
        v = ops.view(cache_v, (1, inp.n_kv, hkv, d))
        out = ops.attention(q, k, v, scale, pos=inp.pos, window=window, with_lse=sinks is not None, **llama)
    if sinks is not None:
        out = ops.attention_sinks(*out, sinks)
    if gate is not None:    # the output gated head by head: sigmoid(gate) (B, T, H, D)
        out = ops.mul(ops.reshape(out, (b, t, h, d)), ops.sigmoid(gate))
    return linear(net, ops.reshape(out, (b, t, h * d)), p + "attn_output.weight")


def shortconv(net: Net, x, layer: int, inp: Inputs, opt: Options, keep: Callable | None):
    """LFM2's gated short convolution of x (B, T, C): in_proj to B | C | x' (views of one
    product), B * x' convolved causally over time, each channel with its own L taps
    (ops.causal_conv1d; packed samples by inp.seg), times C, out_proj. With a cache (one
    sequence) the convolution's input starts with the state, the L - 1 rows of B * x' before
    this step, and the step's last L - 1 rows replace it (a write in inp.writes)."""
    b, t, c = x.shape
    p = f"blk.{layer}."
    _no_tree(net, inp, "short convolution")
    bcx = linear(net, x, p + "shortconv.in_proj.weight")                                # (B, T, 3C)
    gate_b, gate_c, xs = (ops.view(bcx, (b, t, c), (3 * t * c, 3 * c, 1), j * c) for j in range(3))
    bx = ops.mul(gate_b, xs)                                                             # (B, T, C)
    conv = _causal_conv(net, inp, layer, bx, net.params[p + "shortconv.conv.weight"], "convolution")
    return linear(net, ops.mul(gate_c, conv), p + "shortconv.out_proj.weight")


def _no_tree(net: Net, inp: Inputs, what: str):
    """ConfigError for a tree mask (Inputs.parent): a recurrent layer cannot continue a prefix
    in several branches at once."""
    if inp.parent is not None:
        raise ConfigError(f"{net.cfg.arch}: a {what} layer takes packed samples, not a tree of them (Inputs.parent)")


def _causal_conv(net: Net, inp: Inputs, layer: int, x, w, state: str):
    """ops.causal_conv1d of x (B, T, C) with each channel's taps w (C, L): over the window
    (packed samples by inp.seg), or with a cache over the layer's state then x (one sequence;
    `state` names that state in the ConfigError for a batch). Returns (B, T, C)."""
    if inp.cache is None:
        return ops.causal_conv1d(x, w, seg=inp.seg, numerics=net.numerics)
    b = x.shape[0]
    if b != 1:
        raise ConfigError(f"{net.cfg.arch}: a {state} state serves one sequence, got a batch of {b}")
    return _conv_over_state(inp, layer, x, w, net.numerics)


def _conv_over_state(inp: Inputs, layer: int, x, w, numerics: str):
    """causal_conv1d of x (1, T, C) after the L - 1 rows before this step (the layer's state
    inp.cache[layer][0], (L-1, C)); the step's last L - 1 rows replace the state (a write in
    inp.writes). Returns this step's rows (1, T, C)."""
    state = inp.cache[layer][0]
    n, c = state.shape
    t = x.shape[1]
    full = (n + t, c)     # the state's rows, then this step's: zeros around each, added
    rows = ops.add(ops.view_bwd(state, full, (c, 1), 0), ops.view_bwd(ops.reshape(x, (t, c)), full, (c, 1), n * c))
    last = ops.view(rows, (n, c), (c, 1), t * c)
    inp.writes.append(ops.set_rows(state, last, state.graph.const(np.arange(n, dtype=np.int32), dtype="i32")))
    conv = ops.causal_conv1d(ops.reshape(rows, (1, n + t, c)), w, numerics=numerics)
    return ops.view(conv, (1, t, c), (t * c, c, 1), n * c)


def deltanet(net: Net, x, layer: int, inp: Inputs, opt: Options, keep: Callable | None):
    """Qwen3.5's gated DeltaNet of x (B, T, C), as llama.cpp's qwen35 graph: attn_qkv to q | k
    | v (K heads of ssm_state for q and k, V heads for v), convolved causally over time with
    each channel's ssm_conv1d taps then silu; q and k L2-normalised per head (llama.cpp's
    rms_norm(x, eps / n) / sqrt(n)); beta = sigmoid(ssm_beta x), the log decay g =
    softplus(ssm_alpha x + ssm_dt.bias) * ssm_a (ssm_a = -exp(A_log)); the delta rule
    (ops.delta_rule: V head h reads K head h % K heads, o = S^T q / sqrt(ssm_state)); each V
    head's o RMS-normed times ssm_norm times silu(z), z = attn_gate x; ssm_out. Packed samples
    (inp.seg) restart the convolution and the state. With a cache (one sequence): the
    convolution's last L - 1 input rows and the state S (MIXER_CACHE), both replaced
    by the step's (writes in inp.writes)."""
    cfg = net.cfg
    b, t, _ = x.shape
    p = f"blk.{layer}."
    hk, hv, d = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state
    ch = cfg.ssm_channels
    _no_tree(net, inp, "DeltaNet")
    qkv = linear(net, x, p + "attn_qkv.weight")                                          # (B, T, ch)
    z = linear(net, x, p + "attn_gate.weight")                                           # (B, T, Hv*D)
    beta = ops.sigmoid(linear(net, x, p + "ssm_beta.weight"))                            # (B, T, Hv)
    alpha = ops.add(linear(net, x, p + "ssm_alpha.weight"), net.params[p + "ssm_dt.bias"])
    g = ops.mul(ops.softplus(alpha), net.params[p + "ssm_a"])                            # (B, T, Hv)
    conv = ops.silu(_causal_conv(net, inp, layer, qkv, net.params[p + "ssm_conv1d.weight"], "recurrent"))
    rows = (t * ch, ch, d, 1)
    # L2 norms as llama.cpp writes them (the eps inside the root: sum of squares + eps)
    l2 = (lambda y: ops.scale(ops.rms_norm(ops.cont(y), cfg.norm_eps / d, numerics=net.numerics),
                              float(np.float32(1.0) / np.sqrt(np.float32(d)))))
    q = l2(ops.view(conv, (b, t, hk, d), rows, 0))
    k = l2(ops.view(conv, (b, t, hk, d), rows, hk * d))
    v = ops.cont(ops.view(conv, (b, t, hv, d), rows, 2 * hk * d))
    if inp.cache is None:
        o = ops.delta_rule(q, k, v, g, beta, seg=inp.seg)                                # (B, T, Hv, D)
    else:
        state = inp.cache[layer][1]                                                      # (Hv*D, D)
        o, last = ops.delta_rule_state(q, k, v, g, beta, ops.reshape(state, (1, hv, d, d)))
        every = state.graph.const(np.arange(hv * d, dtype=np.int32), dtype="i32")
        inp.writes.append(ops.set_rows(state, ops.reshape(ops.cont(last), (hv * d, d)), every))
    o = ops.mul(norm(net, o, p + "ssm_norm.weight"), ops.silu(ops.reshape(z, (b, t, hv, d))))
    return linear(net, ops.reshape(o, (b, t, hv * d)), p + "ssm_out.weight")


# the mixers a family's layer_kinds may name: mixer(net, x, layer, inputs, options, keep),
# (B, T, C) -> (B, T, C)
MIXERS = {"attention": attention, "shortconv": shortconv, "deltanet": deltanet}
# what incremental decoding keeps of each mixer's layer: (cfg, layer, n_ctx) -> the shapes of
# its persistent tensors (Inputs.cache), and the mixers whose cache is a recurrent state
# (zeros before the first token; it cannot be cut back to an earlier position)
MIXER_CACHE = {
    "attention": lambda cfg, i, n_ctx: [(n_ctx, cfg.at("kv_heads", i) * cfg.head(i))] * 2 if cfg.kv_source(i) == i else [],
    "shortconv": lambda cfg, i, n_ctx: [(cfg.shortconv_l - 1, cfg.dim)],
    "deltanet": lambda cfg, i, n_ctx: [(cfg.ssm_conv - 1, cfg.ssm_channels),
                                       (cfg.ssm_heads * cfg.ssm_state, cfg.ssm_state)],
}
RECURRENT = ("shortconv", "deltanet")
