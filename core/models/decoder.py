"""The one decoder graph of every model family (layer 4), as llama.cpp computes each.

token embedding -> L x [RMSNorm -> mixer -> residual -> RMSNorm -> FFN -> residual] ->
RMSNorm -> output projection (or the embedding, tied, when there is no output.weight).

The layers a block builds are the family's choice (Family.layer_kinds), looked up by name in
MIXERS and FFNS, never branches on a family's name: a mixer is "attention" (q/k/v projections,
+ biases (qwen2), RMSNorm of q and k per head (qwen3) or over all heads (olmoe), rope (adjacent
pairs or NEOX halves, llama 3's frequency factors, linear scaling), grouped KV heads, causal,
1/sqrt(D) scale, Qwen3.5's output gate), "shortconv" (LFM2) or "deltanet" (Qwen3.5's gated
DeltaNet), the last two recurrent; an FFN "glu" (SwiGLU or GeGLU), "moe" (routed experts) or
"glu_moe" (Gemma 4's dense FFN beside routed experts).

What a graph is built from is explicit: a Net (config, parameter tensors, LoRA adapters and
the numerics it computes in), an Inputs record (token ids, positions, packed segments, the
KV cache) and an Options record (checkpointing, which logits, the run's context).

Attention is one fused op (ops.attention): q, k, v are read in the (B, T, heads, D)
layout the projections give, query heads h = kv*G + g sharing kv head `kv` (grouped
KV heads), and its output is already the (B, T, H*D) input of attn_output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggtrain.core import ops
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.family import (PER_LAYER_MODEL_PROJ, PER_LAYER_PROJ_NORM, PER_LAYER_TOKEN_EMBD,
                                        ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT, ROPE_FREQS)
from ggtrain.core.numerics import EXACT, LLAMA, check_numerics
from ggtrain.errors import ConfigError


@dataclass(frozen=True)
class Net:
    """A model as the graph sees it. params: {tensor name: Tensor} as config.param_shapes
    (weights f32, or frozen in their stored types); lora: {weight name: lora.Adapter} added to
    those weights (see `linear`); numerics: core/numerics.py (EXACT, or LLAMA: llama.cpp's CPU
    numbers, inference only); kv_f16 (LLAMA only): attention rounds as llama.cpp's F16 KV cache
    (its default) does. taps: where given, `linear` records there {weight name: the tensor it
    multiplies} for every weight of the blocks ("blk.*"), the activations whose squares
    llama-imatrix sums (core/models/importance.py)."""

    cfg: ModelConfig
    params: dict
    lora: dict = field(default_factory=dict)
    numerics: str = EXACT
    kv_f16: bool = False
    taps: dict | None = None

    def __post_init__(self):
        check_numerics(self.numerics)
        if self.kv_f16 and self.numerics != LLAMA:
            raise ValueError("Net: kv_f16 is a mode of llama numerics")

    @property
    def llama(self) -> bool:
        return self.numerics == LLAMA


@dataclass(frozen=True)
class Inputs:
    """What a forward pass reads. tokens (B, T) i32; pos (T,) i32, or (B, T) with seg (B, T)
    i32 for packed samples (query i sees key j only when j <= i and seg[., j] == seg[., i];
    pos restarts per sample); rows (M,) i32: only those flat positions of (B*T) go on past
    the blocks (the ones a loss needs); cache: per layer the persistent tensors of
    incremental decoding (B = 1) that MIXER_CACHE names: an attention layer's (k_cache,
    v_cache) (S, Hkv*D), this step's keys and values written at rows pos, queries attending
    over cache rows 0..n_kv-1, query i seeing rows <= pos[i]; a recurrent layer's state,
    which the step replaces: the write nodes go in `writes`, which the caller compiles with
    the logits (nothing the logits read depends on them). kv: filled by the attention layers
    as the graph is built, {layer: its keys and values} (the cache after this step's writes),
    for the layers that attend over an earlier layer's (ModelConfig.kv_source)."""

    tokens: object
    pos: object
    seg: object = None
    rows: object = None
    cache: list | None = None
    n_kv: int = 0
    writes: list | None = None
    kv: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    """How forward builds its graph. checkpoint: the graph whose segments end at each block
    (gradient checkpointing; see `forward`), None for none. last_only: logits of the last
    position only, (B, 1, V). head=False: the normed hidden states the output projection reads
    instead of logits ((..., C); losses.chunked_loss takes them). n_ctx: the run's context (the
    window, or the KV cache's positions; 0: T), which picks phi3's long or short rope factors
    as llama.cpp's context size does."""

    checkpoint: object = None
    last_only: bool = False
    head: bool = True
    n_ctx: int = 0


def linear(net: Net, x, name: str):
    """x @ W.T for the weight `name`, plus its LoRA update where net.lora has one, plus the
    bias "<name without .weight>.bias" where net.params has one (after the LoRA update, as
    llama.cpp adds it).

    The adapter (lora.Adapter: A (r, n_in), B (n_out, r), scale) adds scale * (x @ A.T) @ B.T,
    as llama.cpp applies an adapter (scale = user scale * alpha / r); its dropout drops the
    adapter's input out in training (ops.dropout; PEFT's lora_dropout), never the base
    product's; fused sums the adapter's product onto the frozen one's in one op
    (ops.matmul_lora, where the backend has it: inference.lora_fused). In llama numbers, a
    weight of an ops.ACT8_TYPES type multiplies x quantized to 8 bits (ops.matmul_q8), an f32
    or f16 one (and the adapter's factors) takes its float order (ops.matmul_ggml), and the
    adapter's scale goes on B (A x), as llama.cpp's graph applies it. (bf16 weights multiply
    exactly: llama.cpp's bf16 products are not emulated.)"""
    if net.taps is not None and name.startswith("blk."):
        net.taps[name] = x
    w = net.params[name]
    ad = net.lora.get(name)
    if net.llama:
        if w.dtype in ops.ACT8_TYPES:
            y = ops.matmul_q8(x, ops.transpose(w, -1, -2))
        elif w.dtype in ops.GGML_FLOAT_TYPES:
            y = ops.matmul_ggml(x, ops.transpose(w, -1, -2))
        else:
            y = ops.linear(x, w)
        if ad is not None:
            ab = ops.matmul_ggml(ops.matmul_ggml(x, ops.transpose(ad.a, -1, -2)), ops.transpose(ad.b, -1, -2))
            y = ops.add(y, ops.scale(ab, ad.scale))
        return _bias(net, y, name)
    if ad is None:
        return _bias(net, ops.linear(x, w), name)
    y = None if ad.fused else ops.linear(x, w)
    xa = ops.dropout(x, *ad.dropout) if ad.dropout is not None else x
    h = ops.scale(ops.linear(xa, ad.a), ad.scale)     # the scale on the rank-r product (r columns)
    if ad.fused:      # the adapter's product summed onto the frozen one's
        return _bias(net, ops.matmul_lora(x, w, h, ad.b), name)
    return _bias(net, ops.add(y, ops.linear(h, ad.b)), name)


def _bias(net: Net, y, name: str):
    """y plus the bias of weight `name` where the net has one."""
    bias = net.params.get(name[:-len("weight")] + "bias")
    return y if bias is None else ops.add(y, bias)


def _norm(net: Net, x, weight: str):
    """rms_norm of x times the norm weight `weight` (in llama.cpp's numbers where the net's are)."""
    return ops.mul(ops.rms_norm(x, net.cfg.norm_eps, numerics=net.numerics), net.params[weight])


def _rope_factors(net: Net, n_ctx: int):
    """The per-pair frequency divisors a run of context n_ctx rotates with, or None."""
    cfg = net.cfg
    if cfg.rope_long:     # llama.cpp: the long factors when the context passes the original one
        return net.params[ROPE_FACTORS_LONG if n_ctx > (cfg.rope_orig_ctx or cfg.ctx) else ROPE_FACTORS_SHORT]
    return net.params.get(ROPE_FREQS)


# ---- the layers a block builds (the family names them: Family.layer_kinds) ----------------


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
        q = ops.reshape(_norm(net, q, p + "attn_q_norm.weight") if fam.qk_norm_full else q, (b, t, h, d))
        if source == layer:
            kp = linear(net, x, p + "attn_k.weight")
            k = ops.reshape(_norm(net, kp, p + "attn_k_norm.weight") if fam.qk_norm_full else kp, (b, t, hkv, d))
            v = ops.reshape(kp, (b, t, hkv, d)) if cfg.at("v_from_k", layer) else \
                ops.reshape(linear(net, x, p + "attn_v.weight"), (b, t, hkv, d))
    if fam.qk_norm:   # RMSNorm over each head's D values
        q = _norm(net, q, p + "attn_q_norm.weight")
        if source == layer:
            k = _norm(net, k, p + "attn_k_norm.weight")
    if fam.v_norm and source == layer:
        v = ops.rms_norm(v, cfg.norm_eps, numerics=net.numerics)
    nope = fam.no_rope_every and (layer + 1) % fam.no_rope_every == 0      # smollm3's NoPE layers
    if not nope:
        factors = None if local and fam.global_rope_freqs else _rope_factors(net, opt.n_ctx or t)
        rope = dict(n_dims=cfg.rot(layer), freq_base=cfg.rope_base_swa if local else cfg.rope_base,
                    mode=fam.rope_mode, freq_scale=1.0 if local else 1.0 / cfg.rope_scale, factors=factors,
                    attn_factor=cfg.rope_attn_factor, numerics=net.numerics)
        q = ops.rope(q, inp.pos, **rope)
        if source == layer:
            k = ops.rope(k, inp.pos, **rope)
    scale = fam.attention_scale(cfg)
    window = cfg.window if local else 0
    # llama.cpp's numbers (no segment mask there: packed windows are training's)
    llama = dict(numerics=LLAMA, scale_q=fam.scale_q, kv_f16=net.kv_f16) if net.llama and inp.seg is None else {}
    if inp.cache is None:
        if source == layer:
            inp.kv[layer] = (k, v)
        k, v = inp.kv[source]
        out = ops.attention(q, k, v, scale, causal=inp.seg is None, seg=inp.seg, window=window,   # (B, T, H, D)
                            **llama)
        if keep is not None:
            keep(out.root)
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
        out = ops.attention(q, k, v, scale, pos=inp.pos, window=window, **llama)
    if gate is not None:    # the output gated head by head: sigmoid(gate) (B, T, H, D)
        out = ops.mul(ops.reshape(out, (b, t, h, d)), ops.sigmoid(gate))
    return linear(net, ops.reshape(out, (b, t, h * d)), p + "attn_output.weight")


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
    if net.cfg.family.act != "gelu":
        act = ops.swiglu_ggml(gate, up) if net.llama else ops.swiglu(gate, up)
    else:       # (llama.cpp's f16-table gelu with its 8-bit products: its numbers)
        act = ops.geglu_f16(gate, up) if net.llama else ops.geglu(gate, up)
    return linear(net, act, p + "ffn_down.weight")


def shortconv(net: Net, x, layer: int, inp: Inputs, opt: Options, keep: Callable | None):
    """LFM2's gated short convolution of x (B, T, C): in_proj to B | C | x' (views of one
    product), B * x' convolved causally over time, each channel with its own L taps
    (ops.causal_conv1d; packed samples by inp.seg), times C, out_proj. With a cache (one
    sequence) the convolution's input starts with the state, the L - 1 rows of B * x' before
    this step, and the step's last L - 1 rows replace it (a write in inp.writes)."""
    b, t, c = x.shape
    p = f"blk.{layer}."
    bcx = linear(net, x, p + "shortconv.in_proj.weight")                                # (B, T, 3C)
    gate_b, gate_c, xs = (ops.view(bcx, (b, t, c), (3 * t * c, 3 * c, 1), j * c) for j in range(3))
    bx = ops.mul(gate_b, xs)                                                             # (B, T, C)
    w = net.params[p + "shortconv.conv.weight"]                                         # (C, L)
    if inp.cache is None:
        conv = ops.causal_conv1d(bx, w, seg=inp.seg, numerics=net.numerics)
    else:
        if b != 1:
            raise ConfigError(f"{net.cfg.arch}: a convolution state serves one sequence, got a batch of {b}")
        conv = _conv_over_state(inp, layer, bx, w, net.numerics)
    return linear(net, ops.mul(gate_c, conv), p + "shortconv.out_proj.weight")


def moe(net: Net, x, layer: int, resid=None):
    """The routed-expert FFN of x (B, T, C), llama.cpp's build_moe_ffn with softmax gating,
    routed by the router's logits of x (ffn_gate_inp, one an expert): see `experts`."""
    return experts(net, x, layer, linear(net, x, f"blk.{layer}.ffn_gate_inp.weight"))


def experts(net: Net, x, layer: int, logits):
    """Routed experts of x (B, T, C) by router logits (B, T, E): each token's experts_used
    largest (ops.moe_topk), their softmax probabilities as gate weights (divided by their sum
    where the family says: Family.moe_norm); each chosen expert's gated FFN (SwiGLU or GeGLU, as
    the family's act) over only its tokens (ops.moe_matmul on the stacked ffn_gate/up/down_exps,
    or gate | up rows of one ffn_gate_up_exps),
    times its ffn_down_exps.scale where the block has one (Gemma 4), times its weight, the k
    summed in slot order (as llama.cpp adds its views)."""
    cfg = net.cfg
    p = f"blk.{layer}."
    b, t, c = x.shape
    k = cfg.experts_used
    numerics = net.numerics
    ids = ops.reshape(ops.moe_topk(logits, k), (b * t, k))
    weights = ops.reshape(ops.moe_weights(logits, ops.reshape(ids, (b, t, k)), cfg.family.moe_norm, numerics),
                          (b * t, k, 1))
    xs = ops.reshape(x, (b * t, 1, c))
    fused = net.params.get(p + "ffn_gate_up_exps.weight")
    if fused is not None:     # gate | up rows of each expert (gemma4), one product, read as views
        gu = ops.moe_matmul(xs, fused, ids, numerics)                                        # (N, k, 2F)
        f = gu.shape[-1] // 2
        gate, up = (ops.view(gu, (b * t, k, f), (k * 2 * f, 2 * f, 1), j * f) for j in (0, 1))
    else:
        gate = ops.moe_matmul(xs, net.params[p + "ffn_gate_exps.weight"], ids, numerics)  # (N, k, F)
        up = ops.moe_matmul(xs, net.params[p + "ffn_up_exps.weight"], ids, numerics)
    if cfg.family.act == "gelu":
        act = ops.geglu_f16(gate, up) if net.llama else ops.geglu(gate, up)
    else:
        act = ops.swiglu_ggml(gate, up) if net.llama else ops.swiglu(gate, up)
    down = ops.moe_matmul(act, net.params[p + "ffn_down_exps.weight"], ids, numerics)    # (N, k, C)
    scale = net.params.get(p + "ffn_down_exps.scale")
    if scale is not None:       # each expert's output times its scalar
        down = ops.mul(down, ops.reshape(ops.get_rows(ops.reshape(scale, (cfg.experts, 1)), ids), (b * t, k, 1)))
    down = ops.mul(down, weights)
    out = None
    for s in range(k):
        part = ops.view(down, (b * t, c), (k * c, 1), s * c)
        out = part if out is None else ops.add(out, part)
    return ops.reshape(out if k > 1 else ops.cont(out), (b, t, c))


def glu_moe(net: Net, x, layer: int, resid):
    """Gemma 4's FFN with experts: its dense GeGLU FFN of x (the ffn_norm of the residual
    stream resid), normed by post_ffw_norm_1, plus routed experts of pre_ffw_norm_2(resid),
    routed by ffn_gate_inp's logits of resid RMS-normed (no weight), times 1/sqrt(n_embd) and
    ffn_gate_inp.scale, normed by post_ffw_norm_2."""
    cfg = net.cfg
    p = f"blk.{layer}."
    dense = _norm(net, glu(net, x, layer), p + "post_ffw_norm_1.weight")
    route = ops.scale(ops.rms_norm(resid, cfg.norm_eps, numerics=net.numerics), 1.0 / math.sqrt(cfg.dim))
    logits = linear(net, ops.mul(route, net.params[p + "ffn_gate_inp.scale"]), p + "ffn_gate_inp.weight")
    routed = experts(net, _norm(net, resid, p + "pre_ffw_norm_2.weight"), layer, logits)
    return ops.add(dense, _norm(net, routed, p + "post_ffw_norm_2.weight"))


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
    convolution's last L - 1 input rows and the state S (decoder.MIXER_CACHE), both replaced
    by the step's (writes in inp.writes)."""
    cfg = net.cfg
    b, t, _ = x.shape
    p = f"blk.{layer}."
    hk, hv, d = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state
    ch = cfg.ssm_channels
    qkv = linear(net, x, p + "attn_qkv.weight")                                          # (B, T, ch)
    z = linear(net, x, p + "attn_gate.weight")                                           # (B, T, Hv*D)
    beta = ops.sigmoid(linear(net, x, p + "ssm_beta.weight"))                            # (B, T, Hv)
    alpha = ops.add(linear(net, x, p + "ssm_alpha.weight"), net.params[p + "ssm_dt.bias"])
    g = ops.mul(ops.softplus(alpha), net.params[p + "ssm_a"])                            # (B, T, Hv)
    w = net.params[p + "ssm_conv1d.weight"]                                              # (ch, L)
    if inp.cache is None:
        conv = ops.causal_conv1d(qkv, w, seg=inp.seg, numerics=net.numerics)
    else:
        if b != 1:
            raise ConfigError(f"{cfg.arch}: a recurrent state serves one sequence, got a batch of {b}")
        conv = _conv_over_state(inp, layer, qkv, w, net.numerics)
    conv = ops.silu(conv)
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
    o = ops.mul(_norm(net, o, p + "ssm_norm.weight"), ops.silu(ops.reshape(z, (b, t, hv, d))))
    return linear(net, ops.reshape(o, (b, t, hv * d)), p + "ssm_out.weight")


# the mixers and FFNs a family's layer_kinds may name: mixer(net, x, layer, inputs, options,
# keep) and ffn(net, x, layer, resid) (x the ffn_norm of the residual stream resid), each
# (B, T, C) -> (B, T, C)
MIXERS = {"attention": attention, "shortconv": shortconv, "deltanet": deltanet}
FFNS = {"glu": glu, "moe": moe, "glu_moe": glu_moe}
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


def per_layer_inputs(net: Net, x, tokens):
    """Gemma 4's per-layer embeddings (B, T, L*P) of tokens (B, T), x their scaled token
    embeddings (B, T, C): per_layer_token_embd's rows times sqrt(P), plus the projection of x
    times 1/sqrt(C) RMS-normed per layer (per_layer_proj_norm), the sum times 1/sqrt(2)."""
    cfg = net.cfg
    b, t = tokens.shape
    lp, p = cfg.layers * cfg.per_layer_dim, cfg.per_layer_dim
    rows = ops.scale(ops.get_rows(net.params[PER_LAYER_TOKEN_EMBD], tokens), math.sqrt(p))        # (B, T, L*P)
    proj = ops.scale(linear(net, x, PER_LAYER_MODEL_PROJ), 1.0 / math.sqrt(cfg.dim))
    proj = _norm(net, ops.reshape(proj, (b, t, cfg.layers, p)), PER_LAYER_PROJ_NORM)
    return ops.scale(ops.add(ops.reshape(proj, (b, t, lp)), rows), 1.0 / math.sqrt(2.0))


def _per_layer(net: Net, x, layer: int, pl):
    """What layer `layer` adds to x (B, T, C) from its per-layer embeddings (its P columns of
    pl, (B, T, L*P)): post_norm(proj(gelu(inp_gate x) * them))."""
    b, t, _ = x.shape
    p, lp = net.cfg.per_layer_dim, net.cfg.layers * net.cfg.per_layer_dim
    mine = ops.view(pl, (b, t, p), (t * lp, lp, 1), layer * p)
    gate = linear(net, x, f"blk.{layer}.inp_gate.weight")
    act = ops.geglu_f16(gate, mine) if net.llama else ops.geglu(gate, mine)
    return _norm(net, linear(net, act, f"blk.{layer}.proj.weight"), f"blk.{layer}.post_norm.weight")


def block(net: Net, x, layer: int, inp: Inputs, opt: Options, pl=None):
    """One block on the residual stream x (B, T, C): the family's mixer and FFN, each after
    an RMSNorm, each (post-normed and scaled where the family says) added to x; then what
    the layer's per-layer embeddings add (pl: per_layer_inputs) and its output scale."""
    cfg, fam = net.cfg, net.cfg.family
    p = f"blk.{layer}."
    mixer, ffn = fam.layer_kinds(cfg, layer)
    graph = opt.checkpoint
    keep = graph.keep if graph is not None and not net.lora else None
    a = MIXERS[mixer](net, _norm(net, x, p + "attn_norm.weight"), layer, inp, opt, keep)
    if fam.post_norms:
        a = _norm(net, a, p + "post_attention_norm.weight")
    if cfg.residual_scale:
        a = ops.scale(a, cfg.residual_scale)
    t = x.shape[1]
    if opt.last_only and t > 1 and layer == cfg.layers - 1:
        # as llama.cpp's graphs (inp_out_ids): the last block's FFN, like the head, takes
        # only the row whose logits are wanted, so its products have llama.cpp's row count
        a, x = _last_row(a), _last_row(x)
    x = ops.add(x, a)
    if keep is not None:
        keep(x)
    f = FFNS[ffn](net, _norm(net, x, p + fam.ffn_norm), layer, x)
    if fam.post_norms:
        f = _norm(net, f, p + "post_ffw_norm.weight")
    if cfg.residual_scale:
        f = ops.scale(f, cfg.residual_scale)
    x = ops.add(x, f)
    if pl is not None:
        if opt.last_only and t > 1 and layer == cfg.layers - 1:
            pl = _last_row(pl)
        x = ops.add(x, _per_layer(net, x, layer, pl))
    out_scale = net.params.get(p + "layer_output_scale.weight")
    if out_scale is not None:      # gemma4: the block's output times a learned scalar
        x = ops.mul(x, out_scale)
    if graph is not None:
        graph.checkpoint(x)
    return x


def forward(net: Net, inp: Inputs, opt: Options = Options()):
    """Logits (B, T, V) for inp.tokens (B, T) i32 at positions inp.pos.

    With opt.checkpoint (a Graph), each block ends a segment of it (gradient checkpointing
    recomputes blocks in backward), except what Graph.keep marks: the fused attention node
    (so its output and the q, k, v its backward reads stay, and neither attention nor the q,
    k, v products run again) and the residual after it (so the output projection does not
    either). Backward then recomputes only the norms and the FFN's gate and up products: ~40%
    of a block's forward (less at long contexts), for ~5 (B, T, C) tensors a block instead of
    the ~6 C + 4 ff per token that no checkpointing keeps. (With adapters, TrainStep's own
    selective policy keeps the frozen products instead, and attention is recomputed:
    fine-tuning large models is short of memory, not time.) See Inputs and Options for the
    rest: opt.last_only gives (B, 1, V), inp.rows (M, V), opt.head=False hidden states.
    """
    cfg = net.cfg
    b, t = inp.tokens.shape
    if t > cfg.ctx:
        raise ConfigError(f"{cfg.arch}: sequence of {t} tokens exceeds the context {cfg.ctx}")
    x = ops.get_rows(net.params["token_embd.weight"], inp.tokens)                     # (B, T, C)
    if cfg.family.embed_scale:
        x = ops.scale(x, math.sqrt(cfg.dim))
    if cfg.embedding_scale:
        x = ops.scale(x, cfg.embedding_scale)
    pl = per_layer_inputs(net, x, inp.tokens) if cfg.per_layer_dim else None
    for i in range(cfg.layers):
        x = block(net, x, i, inp, opt, pl)
    if opt.last_only and t > 1 and not cfg.layers:
        x = _last_row(x)
    if inp.rows is not None:
        x = ops.get_rows(ops.reshape(x, (b * t, x.shape[-1])), inp.rows)             # (M, C)
    x = _norm(net, x, cfg.family.output_norm)
    return output(net, x) if opt.head else x


def _last_row(x):
    """The last position of x (B, T, C) contiguous, as (B, 1, C)."""
    b, t, c = x.shape
    return ops.view(x, (b, 1, c), (t * c, c, 1), (t - 1) * c)


def head_name(cfg: ModelConfig) -> str:
    """The output matrix's tensor: the embedding when tied."""
    return "token_embd.weight" if cfg.tied else "output.weight"


def output(net: Net, x):
    """Logits (..., V) of normed hidden states x (..., C): the output projection (the
    embedding when tied), divided by logit_scale and soft-capped where the model says."""
    cfg = net.cfg
    logits = linear(net, x, head_name(cfg))
    if cfg.logit_scale != 1.0:
        logits = ops.scale(logits, 1.0 / cfg.logit_scale)
    if cfg.logit_softcap:
        c = cfg.logit_softcap
        logits = ops.scale(ops.tanh(ops.scale(logits, 1.0 / c)), c)
    return logits
