"""A self-contained float64 numpy llama forward pass (the oracle for core/models/llama.py).

Written from the architecture's definition, independent of ggtrain's ops: RMSNorm,
RoPE mode 0 (adjacent pairs), causal attention with grouped KV heads, SwiGLU.
"""
import numpy as np


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, pos, n_rot, base):
    # x (B, T, H, D); rotate pairs (2i, 2i+1) for 2i < n_rot by pos * base^(-2i/n_rot)
    out = x.copy()
    i = np.arange(n_rot // 2)
    theta = pos[:, None] * base ** (-2.0 * i / n_rot)           # (T, n_rot/2)
    c, s = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
    x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    out[..., 0:n_rot:2] = x0 * c - x1 * s
    out[..., 1:n_rot:2] = x0 * s + x1 * c
    return out


def forward(cfg, p, tokens, pos):
    p = {k: np.asarray(v, np.float64) for k, v in p.items()}
    b, t = tokens.shape
    h, hkv, d = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
    x = p["token_embd.weight"][tokens]
    mask = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(cfg.layers):
        q_ = f"blk.{i}."
        a = rms_norm(x, p[q_ + "attn_norm.weight"], cfg.norm_eps)
        q = rope((a @ p[q_ + "attn_q.weight"].T).reshape(b, t, h, d), pos, cfg.n_rot, cfg.rope_base)
        k = rope((a @ p[q_ + "attn_k.weight"].T).reshape(b, t, hkv, d), pos, cfg.n_rot, cfg.rope_base)
        v = (a @ p[q_ + "attn_v.weight"].T).reshape(b, t, hkv, d)
        k = np.repeat(k, h // hkv, axis=2)                      # q head j uses kv head j // G
        v = np.repeat(v, h // hkv, axis=2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = np.einsum("bhqk,bkhd->bqhd", s, v).reshape(b, t, h * d)
        x = x + o @ p[q_ + "attn_output.weight"].T
        f = rms_norm(x, p[q_ + "ffn_norm.weight"], cfg.norm_eps)
        gate = f @ p[q_ + "ffn_gate.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (f @ p[q_ + "ffn_up.weight"].T)) @ p[q_ + "ffn_down.weight"].T
    x = rms_norm(x, p["output_norm.weight"], cfg.norm_eps)
    head = p["token_embd.weight"] if cfg.tied else p["output.weight"]
    return x @ head.T


def loss(logits, targets):
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, targets[..., None], -1).mean()
