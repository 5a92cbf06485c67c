"""A self-contained float64 numpy forward pass of every family's decoder (the oracle for
core/models/decoder.py).

Written from the architectures' definitions (llama.cpp's graphs), independent of ggtrain's
ops: RMSNorm, rope with adjacent pairs (llama) or NEOX halves (qwen2, qwen3), llama 3's
frequency factors and linear scaling, q/k/v biases (qwen2), per-head q/k RMSNorm (qwen3),
causal attention with grouped KV heads and any head size, SwiGLU; gemma3's scaled
embedding, post-attention and post-FFN norms, GeGLU (tanh gelu), sliding-window local
layers with their own rope base, and logit soft-capping; granite's embedding, residual,
attention and logit multipliers; LFM2's gated short convolution (in_proj to B | C | x,
B * x convolved causally over time per channel, times C, out_proj) in the layers that have
its tensors, and its final norm's name; Gemma 4's per-layer local flags with their own head
size, rotated dims and base, rope factors on the global layers only, unscaled q.k, values
RMS-normed without a weight (the keys' projection where a layer has no attn_v), the last
layers attending over an earlier layer's keys and values, the per-layer embeddings, the
block's output scale; routed experts (qwen3moe, olmoe) where a block has a router, with a
gated shared expert (qwen35moe), with sigmoid gating and a selection bias (lfm2moe); q/k norms
over all heads (olmoe). What sets each family apart is its row of
tests/family_cases.py's ORACLE (or what its tensors and config say), never its name here.
"""
import numpy as np

from tests import refs
from tests.family_cases import ORACLE


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def ggml_gelu_f16(x):
    """llama.cpp's CPU gelu (GGML_GELU_FP16): x rounded to f16 indexes a table of gelu values
    rounded to f16; x itself past 10, 0 below -10. Only to explain llama.cpp's numbers."""
    x16 = x.astype(np.float16).astype(np.float64)
    table = gelu_tanh(x16).astype(np.float32).astype(np.float16).astype(np.float64)
    return np.where(x <= -10, 0.0, np.where(x >= 10, x, table))


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, n_rot, base, neox=False, scale=1.0, factors=None, mscale=1.0, yarn_ctx=0):
    # x (B, T, H, D); pair i < n_rot/2 turns by pos / scale * base^(-2i/n_rot) / factors[i];
    # YaRN over yarn_ctx original positions (> 0): pair i's 1 / scale mixed with 1 by the ramp
    # between the correction dims (1 below, 0 above), the magnitude times 1 + 0.1 ln scale
    out = x.copy()
    i = np.arange(n_rot // 2)
    freq = base ** (-2.0 * i / n_rot) / scale
    if yarn_ctx and scale != 1.0:
        low, high = refs.yarn_corr_dims(n_rot, yarn_ctx, base)
        mix = 1 - np.clip((i - low) / max(0.001, high - low), 0, 1)
        freq = base ** (-2.0 * i / n_rot) * ((1 - mix) / scale + mix)
        mscale = mscale * (1 + 0.1 * np.log(scale))
    if factors is not None:
        freq = freq / factors
    theta = pos[:, None] * freq                                   # (T, n_rot/2)
    c, s = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
    if neox:
        a, b = slice(0, n_rot // 2), slice(n_rot // 2, n_rot)
    else:
        a, b = slice(0, n_rot, 2), slice(1, n_rot, 2)
    x0, x1 = x[..., a], x[..., b]
    out[..., a] = (x0 * c - x1 * s) * mscale
    out[..., b] = (x0 * s + x1 * c) * mscale
    return out


def ffn(f, p, q_, facts, gelu, cfg=None):
    """The gated FFN of normed f: SwiGLU, or GeGLU where the family's facts say; routed experts
    where the block has a router (ffn_gate_inp): each token's experts_used experts of largest
    softmax probability (sigmoid where the file's expert_gating_func is 2, plus the selection
    bias exp_probs_b where the block has one), those probabilities (divided by their sum where the facts say
    moe_norm) weighting each expert's SwiGLU FFN (gpt-oss's clamped one where the facts say
    swiglu_oai), summed; the router's and the experts' biases where the block has them; plus a
    shared expert's SwiGLU FFN times sigmoid of its gate vector's product where the block has one
    (ffn_gate_inp_shexp)."""
    def bias(name, e=None):
        b = p.get(q_ + name)
        return 0.0 if b is None else b if e is None else b[e]
    if q_ + "ffn_gate_inp.weight" in p:
        z = f @ p[q_ + "ffn_gate_inp.weight"].T + bias("ffn_gate_inp.bias")       # (..., E)
        if getattr(cfg, "expert_gating", 0) == 2:                     # sigmoid gating (lfm2moe)
            prob = 1 / (1 + np.exp(-z))
        else:
            prob = np.exp(z - z.max(-1, keepdims=True))
            prob /= prob.sum(-1, keepdims=True)
        score = prob + p.get(q_ + "exp_probs_b.bias", 0.0)             # the selection bias (lfm2moe)
        top = np.argsort(-score, axis=-1, kind="stable")[..., :cfg.experts_used]
        w = np.take_along_axis(prob, top, axis=-1)
        if facts.get("moe_norm"):
            w = w / w.sum(-1, keepdims=True)
        out = np.zeros_like(f)
        for idx in np.ndindex(f.shape[:-1]):
            for s, e in enumerate(top[idx]):
                gate = p[q_ + "ffn_gate_exps.weight"][e] @ f[idx] + bias("ffn_gate_exps.bias", e)
                up = p[q_ + "ffn_up_exps.weight"][e] @ f[idx] + bias("ffn_up_exps.bias", e)
                if facts.get("swiglu_oai"):      # gate clamped above at 7, up to +-7, alpha 1.702
                    g7, u7 = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
                    act = g7 / (1 + np.exp(-1.702 * g7)) * (u7 + 1)
                else:
                    act = gate / (1 + np.exp(-gate)) * up
                out[idx] += w[idx][s] * (p[q_ + "ffn_down_exps.weight"][e] @ act + bias("ffn_down_exps.bias", e))
        if q_ + "ffn_gate_inp_shexp.weight" in p:     # qwen35moe: the shared expert, gated by a sigmoid
            gate, up = f @ p[q_ + "ffn_gate_shexp.weight"].T, f @ p[q_ + "ffn_up_shexp.weight"].T
            shared = (gate / (1 + np.exp(-gate)) * up) @ p[q_ + "ffn_down_shexp.weight"].T
            out += shared / (1 + np.exp(-(f @ p[q_ + "ffn_gate_inp_shexp.weight"])))[..., None]
        return out
    if q_ + "ffn_gate.weight" in p:
        gate, up = f @ p[q_ + "ffn_gate.weight"].T, f @ p[q_ + "ffn_up.weight"].T
    else:                                # phi3: gate | up rows of ffn_up
        gate, up = np.split(f @ p[q_ + "ffn_up.weight"].T, 2, axis=-1)
    act = gelu(gate) if facts.get("gelu") else gate / (1 + np.exp(-gate))
    return (act * up) @ p[q_ + "ffn_down.weight"].T


def gemma4_experts(x, p, q_, facts, gelu, cfg):
    """Gemma 4's FFN with experts of the residual stream x: its dense GeGLU FFN of ffn_norm(x)
    normed by post_ffw_norm_1, plus the experts of pre_ffw_norm_2(x) routed by softmax over the
    router's logits of x / rms(x) / sqrt(C) * ffn_gate_inp.scale (the k weights summing to 1),
    each a GeGLU FFN times its down scale, normed by post_ffw_norm_2."""
    eps = cfg.norm_eps
    f = rms_norm(x, p[q_ + "ffn_norm.weight"], eps)
    gate, up = f @ p[q_ + "ffn_gate.weight"].T, f @ p[q_ + "ffn_up.weight"].T
    dense = rms_norm((gelu(gate) * up) @ p[q_ + "ffn_down.weight"].T, p[q_ + "post_ffw_norm_1.weight"], eps)
    h = rms_norm(x, p[q_ + "pre_ffw_norm_2.weight"], eps)
    z = (rms_norm(x, 1.0, eps) / np.sqrt(cfg.dim) * p[q_ + "ffn_gate_inp.scale"]) @ p[q_ + "ffn_gate_inp.weight"].T
    prob = np.exp(z - z.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    top = np.argsort(-prob, axis=-1, kind="stable")[..., :cfg.experts_used]
    w = np.take_along_axis(prob, top, axis=-1)
    w = w / w.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for idx in np.ndindex(h.shape[:-1]):
        for s, e in enumerate(top[idx]):
            g, u = np.split(p[q_ + "ffn_gate_up_exps.weight"][e] @ h[idx], 2)      # gate | up rows
            out[idx] += w[idx][s] * p[q_ + "ffn_down_exps.scale"][e] * (p[q_ + "ffn_down_exps.weight"][e] @ (gelu(g) * u))
    return dense + rms_norm(out, p[q_ + "post_ffw_norm_2.weight"], eps)


def short_conv(a, p, q_):
    """LFM2's short convolution of normed a (B, T, C): y = C * conv(B * x) with each channel's
    kernel w[c] (L taps, the last on the current row, zeros before the first row)."""
    b_gate, c_gate, xs = np.split(a @ p[q_ + "shortconv.in_proj.weight"].T, 3, axis=-1)
    w = p[q_ + "shortconv.conv.weight"]                           # (C, L)
    taps = w.shape[1]
    bx = b_gate * xs
    padded = np.concatenate([np.zeros((bx.shape[0], taps - 1, bx.shape[2])), bx], axis=1)
    conv = sum(padded[:, k:k + bx.shape[1]] * w[:, k] for k in range(taps))
    return (c_gate * conv) @ p[q_ + "shortconv.out_proj.weight"].T


class _Tapped(np.ndarray):
    """A weight matrix whose products x @ W.T append x to its list `inputs` (taps)."""

    def __array_finalize__(self, obj):
        self.inputs = getattr(obj, "inputs", None)

    def __rmatmul__(self, x):
        self.inputs.append(np.asarray(x))
        return np.asarray(x) @ np.asarray(self)


class _TappedExperts(np.ndarray):
    """Stacked expert matrices (E, n_out, n_in) whose expert e's products W[e] @ x append x to
    the list inputs[e] (taps)."""

    def __array_finalize__(self, obj):
        self.inputs = getattr(obj, "inputs", None)

    def __getitem__(self, e):
        return _Expert(np.asarray(self)[e], self.inputs[int(e)])


class _Expert:
    def __init__(self, w, inputs):
        self.w, self.inputs = w, inputs

    def __matmul__(self, x):
        self.inputs.append(np.asarray(x))
        return self.w @ x


def deltanet(a, p, q_, cfg):
    """Qwen3.5's gated DeltaNet of normed a (B, T, C) in float64: causal conv of q | k | v then
    silu, L2 norms (eps inside the root), the delta rule (tests/refs.py), the gated norm."""
    hk, hv, d = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state
    b, t, _ = a.shape
    mixed = a @ p[q_ + "attn_qkv.weight"].T
    w = p[q_ + "ssm_conv1d.weight"]
    taps = w.shape[1]
    padded = np.concatenate([np.zeros((b, taps - 1, mixed.shape[2])), mixed], axis=1)
    conv = sum(padded[:, k:k + t] * w[:, k] for k in range(taps))
    conv = conv / (1 + np.exp(-conv))
    q = conv[..., :hk * d].reshape(b, t, hk, d)
    k = conv[..., hk * d:2 * hk * d].reshape(b, t, hk, d)
    v = conv[..., 2 * hk * d:].reshape(b, t, hv, d)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + cfg.norm_eps)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + cfg.norm_eps)
    beta = 1 / (1 + np.exp(-(a @ p[q_ + "ssm_beta.weight"].T)))
    g = np.logaddexp(0, a @ p[q_ + "ssm_alpha.weight"].T + p[q_ + "ssm_dt.bias"]) * p[q_ + "ssm_a"]
    o = refs.delta_rule(q, k, v, g, beta)
    z = (a @ p[q_ + "attn_gate.weight"].T).reshape(b, t, hv, d)
    o = rms_norm(o, p[q_ + "ssm_norm.weight"], cfg.norm_eps) * z / (1 + np.exp(-z))
    return o.reshape(b, t, hv * d) @ p[q_ + "ssm_out.weight"].T


def forward(cfg, p, tokens, pos, gelu=gelu_tanh, n_ctx=None, taps=None):
    """Logits (B, T, V). taps: a dict that gets {weight name: [the input of each of its
    products]} for the block matrices (blk.*, 2-D, not a convolution's kernel), and for the
    stacked experts (*_exps.weight) {weight name: [per expert, [the input of each of its
    products (one token's row)]]}."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    if taps is not None:
        for k, v in p.items():
            # (qwen35moe's shared-expert gate is a vector, which llama.cpp multiplies as a one-row
            # matrix; gpt-oss's expert biases, (E, F), are added, not multiplied)
            if k.startswith("blk.") and (v.ndim == 2 and not k.endswith(("conv.weight", "conv1d.weight", ".bias"))
                                         or k.endswith("ffn_gate_inp_shexp.weight")):
                p[k] = v.view(_Tapped)
                p[k].inputs = taps.setdefault(k, [])
            elif k.startswith("blk.") and k.endswith("_exps.weight"):
                p[k] = v.view(_TappedExperts)
                p[k].inputs = taps.setdefault(k, [[] for _ in range(v.shape[0])])
    b, t = tokens.shape
    facts = ORACLE[getattr(cfg, "arch", "llama")]
    h = cfg.heads
    d = getattr(cfg, "head_dim", 0) or cfg.dim // cfg.heads
    factors = p.get("rope_freqs.weight")
    if getattr(cfg, "rope_long", False):    # phi3: long factors past the original context
        long = (n_ctx or t) > (cfg.rope_orig_ctx or cfg.ctx)
        factors = p["rope_factors_long.weight" if long else "rope_factors_short.weight"]
    rot = dict(neox=facts.get("neox", False), scale=getattr(cfg, "rope_scale", 1.0), factors=factors,
               mscale=getattr(cfg, "rope_attn_factor", 1.0),
               yarn_ctx=(cfg.rope_orig_ctx or cfg.ctx) if getattr(cfg, "rope_yarn", False) else 0)
    post_norms = facts.get("post_norms", False)
    x = p["token_embd.weight"][tokens]
    if facts.get("embed_scale"):
        x = x * np.sqrt(cfg.dim)
    residual = getattr(cfg, "residual_scale", 0.0) or 1.0        # granite's multipliers (0: none)
    if getattr(cfg, "embedding_scale", 0.0):
        x = x * cfg.embedding_scale
    causal = np.triu(np.full((t, t), -np.inf), 1)
    swa = getattr(cfg, "swa_layers", ())
    n_pl = getattr(cfg, "per_layer_dim", 0)
    if n_pl:                                                      # gemma4's per-layer embeddings
        L = cfg.layers
        pe = p["per_layer_token_embd.weight"][tokens].reshape(b, t, L, n_pl) * np.sqrt(n_pl)
        pr = (x @ p["per_layer_model_proj.weight"].T / np.sqrt(cfg.dim)).reshape(b, t, L, n_pl)
        per_layer = (rms_norm(pr, p["per_layer_proj_norm.weight"], cfg.norm_eps) + pe) / np.sqrt(2)
    n_layers = cfg.layers
    shared = getattr(cfg, "shared_kv", 0)
    kv_of = {}                                                    # layer -> its (k, v) after norm and rope
    for i in range(cfg.layers):
        q_ = f"blk.{i}."
        hkv = cfg.kv_heads[i] if isinstance(cfg.kv_heads, tuple) else cfg.kv_heads     # per layer (lfm2)
        if q_ + "shortconv.in_proj.weight" in p:     # lfm2's short-convolution layer
            x = x + short_conv(rms_norm(x, p[q_ + "attn_norm.weight"], cfg.norm_eps), p, q_)
            x = x + ffn(rms_norm(x, p[q_ + "ffn_norm.weight"], cfg.norm_eps), p, q_, facts, gelu, cfg)
            continue
        ffn_norm = q_ + facts.get("ffn_norm", "ffn_norm.weight")
        if q_ + "ssm_conv1d.weight" in p:            # qwen35's gated DeltaNet layer
            x = x + deltanet(rms_norm(x, p[q_ + "attn_norm.weight"], cfg.norm_eps), p, q_, cfg)
            x = x + ffn(rms_norm(x, p[ffn_norm], cfg.norm_eps), p, q_, facts, gelu, cfg)
            continue
        window, pattern = getattr(cfg, "window", 0), getattr(cfg, "window_pattern", 0)
        if swa != ():                                             # gemma4: a flag a layer
            flag = swa[i] if isinstance(swa, tuple) else swa
            local = window > 0 and bool(flag)
        else:
            local = window > 0 and (pattern == 0 or i % pattern < pattern - 1)
        plain = local and not facts.get("swa_rope_global")    # gpt-oss: local layers rotate as global ones
        base = cfg.rope_base_swa if plain else cfg.rope_base
        rot_i = dict(rot, scale=1.0) if plain else rot
        if local and facts.get("global_rope_freqs"):
            rot_i = dict(rot_i, factors=None)
        d_i = (getattr(cfg, "head_dim_swa", 0) or d) if local else d
        n_rot = (getattr(cfg, "rope_dims_swa", 0) or cfg.n_rot) if local else cfg.n_rot
        mask = causal + np.where(np.arange(t)[:, None] - np.arange(t)[None, :] >= window, -np.inf, 0) \
            if local else causal

        def proj(a, name):
            y = a @ p[q_ + name + ".weight"].T
            return y + p[q_ + name + ".bias"] if q_ + name + ".bias" in p else y
        a = rms_norm(x, p[q_ + "attn_norm.weight"], cfg.norm_eps)
        if q_ + "attn_qkv.weight" in p:      # phi3: q | k | v rows of one matrix
            qkv = a @ p[q_ + "attn_qkv.weight"].T
            q = qkv[..., :h * d].reshape(b, t, h, d)
            k = qkv[..., h * d:(h + hkv) * d].reshape(b, t, hkv, d)
            v = qkv[..., (h + hkv) * d:].reshape(b, t, hkv, d)
        elif p[q_ + "attn_q.weight"].shape[0] == 2 * h * d:    # qwen35: q | gate rows per head
            qg = proj(a, "attn_q").reshape(b, t, h, 2 * d)
            q, gate = qg[..., :d], qg[..., d:]
            k = proj(a, "attn_k").reshape(b, t, hkv, d)
            v = proj(a, "attn_v").reshape(b, t, hkv, d)
        else:
            full = facts.get("qk_norm_full")             # olmoe: q and k normed over all heads at once
            qp = proj(a, "attn_q")
            q = (rms_norm(qp, p[q_ + "attn_q_norm.weight"], cfg.norm_eps) if full else qp).reshape(b, t, h, d_i)
            if i < n_layers - shared:
                kp = proj(a, "attn_k")
                k = (rms_norm(kp, p[q_ + "attn_k_norm.weight"], cfg.norm_eps) if full else kp).reshape(b, t, hkv, d_i)
                v = proj(a, "attn_v").reshape(b, t, hkv, d_i) if q_ + "attn_v.weight" in p else \
                    kp.reshape(b, t, hkv, d_i)                                           # gemma4: V = K
        if q_ + "attn_q_norm.weight" in p and not facts.get("qk_norm_full"):
            q = rms_norm(q, p[q_ + "attn_q_norm.weight"], cfg.norm_eps)
            if i < n_layers - shared:
                k = rms_norm(k, p[q_ + "attn_k_norm.weight"], cfg.norm_eps)
        if facts.get("v_norm") and i < n_layers - shared:
            v = rms_norm(v, 1.0, cfg.norm_eps)
        no_rope = facts.get("no_rope_every", 0)
        if not (no_rope and (i + 1) % no_rope == 0):           # smollm3: every 4th layer has no rope
            q = rope(q, pos, n_rot, base, **rot_i)
            if i < n_layers - shared:
                k = rope(k, pos, n_rot, base, **rot_i)
        if i < n_layers - shared:
            kv_of[local] = (k, v)                                 # the last layer of each kind's
        else:                                                     # gemma4: an earlier layer's
            k, v = kv_of[local]
        k = np.repeat(k, h // hkv, axis=2)                      # q head j uses kv head j // G
        v = np.repeat(v, h // hkv, axis=2)
        at_62 = facts.get("scale_62") and cfg.layers == 62
        scale = getattr(cfg, "attn_scale", 0.0) or 1 / np.sqrt(cfg.dim // h if at_62 else d_i)
        if facts.get("unit_scale"):                               # gemma4: q.k unscaled
            scale = 1.0
        s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale + mask
        sink = p.get(q_ + "attn_sinks.weight")                    # gpt-oss: a logit a head, no value
        top = s.max(-1, keepdims=True) if sink is None else np.maximum(s.max(-1, keepdims=True),
                                                                       sink[None, :, None, None])
        s = np.exp(s - top)
        s /= s.sum(-1, keepdims=True) + (0.0 if sink is None else np.exp(sink[None, :, None, None] - top))
        o = np.einsum("bhqk,bkhd->bqhd", s, v)
        if p[q_ + "attn_q.weight"].shape[0] == 2 * h * d_i if q_ + "attn_q.weight" in p else False:
            o = o / (1 + np.exp(-gate))                         # qwen35's gated attention
        o = o.reshape(b, t, h * d_i)
        a = o @ p[q_ + "attn_output.weight"].T + p.get(q_ + "attn_output.bias", 0.0)
        if post_norms:
            a = rms_norm(a, p[q_ + "post_attention_norm.weight"], cfg.norm_eps)
        x = x + a * residual
        if q_ + "pre_ffw_norm_2.weight" in p:          # gemma4: experts beside the dense FFN
            f = gemma4_experts(x, p, q_, facts, gelu, cfg)
        else:
            f = ffn(rms_norm(x, p[ffn_norm], cfg.norm_eps), p, q_, facts, gelu, cfg)
        if post_norms:
            f = rms_norm(f, p[q_ + "post_ffw_norm.weight"], cfg.norm_eps)
        x = x + f * residual
        if n_pl:
            g = gelu(x @ p[q_ + "inp_gate.weight"].T) * per_layer[:, :, i]
            x = x + rms_norm(g @ p[q_ + "proj.weight"].T, p[q_ + "post_norm.weight"], cfg.norm_eps)
        if q_ + "layer_output_scale.weight" in p:
            x = x * p[q_ + "layer_output_scale.weight"]
    x = rms_norm(x, p[facts.get("final_norm", "output_norm.weight")], cfg.norm_eps)
    head = p["token_embd.weight"] if cfg.tied else p["output.weight"]
    logits = x @ head.T / getattr(cfg, "logit_scale", 1.0)
    cap = getattr(cfg, "logit_softcap", 0.0)
    return cap * np.tanh(logits / cap) if cap else logits


def loss(logits, targets):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).mean()
