"""The one decoder graph of every model family (layer 4), as llama.cpp computes each.

token embedding -> L x [RMSNorm -> attention (q/k/v projections, + biases (qwen2), per-head
RMSNorm of q and k (qwen3), rope (adjacent pairs or NEOX halves, llama 3's frequency
factors, linear scaling), grouped KV heads, causal, 1/sqrt(D) scale) -> residual -> RMSNorm
-> SwiGLU FFN -> residual] -> RMSNorm -> output projection (or the embedding, tied, when
there is no output.weight). What a family has is its Family (core/models/family.py,
core/models/families/); ModelConfig is the one description of a model's hyperparameters.

Parameters use llama.cpp's tensor names with numpy-order shapes (ggml's ne reversed):
token_embd.weight (V, C), blk.{i}.attn_q.weight (H*D, C), attn_k/attn_v (Hkv*D, C),
attn_output (C, H*D), ffn_gate/ffn_up (F, C), ffn_down (C, F), norms (C,); D is the head
size (attention.key_length; C / H when absent).

Attention is one fused op (ops.attention): q, k, v are read in the (B, T, heads, D)
layout the projections give, query heads h = kv*G + g sharing kv head `kv` (grouped
KV heads), and its output is already the (B, T, H*D) input of attn_output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend import StoredTensor
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models.families import FAMILIES, NAMES
from ggtrain.core.models.family import (BLOCK_SHAPES, OUTPUT, OUTPUT_NORM, ROPE_CONSTANTS, ROPE_FACTORS_LONG,
                                        ROPE_FACTORS_SHORT, ROPE_FREQS, STORED_AS, TOKEN_EMBD, Family)
from ggtrain.errors import ConfigError


def family(arch: str) -> Family:
    """The Family of an architecture name; ConfigError naming the supported ones."""
    fam = FAMILIES.get(arch)
    if fam is None:
        raise ConfigError(f"architecture {arch!r} is not supported (ggtrain computes {NAMES})")
    return fam


@dataclass(frozen=True)
class ModelConfig:
    """A decoder's hyperparameters (the {arch}.* keys of its GGUF file).

    head_dim: 0 means dim // heads; rope_dims: 0 means the whole head (both resolved on
    construction, so equal models have equal configs); rope_scale: linear
    rope scaling (positions divided by it); rope_freqs: the model carries rope_freqs.weight
    (per-pair frequency factors); tied: the output projection is the token embedding.
    window: > 0, the sliding window of the local layers (gemma3); window_pattern: every
    n-th layer is global (-1: the family's default; 0: none is); rope_base_swa: the rope
    base of local layers; logit_softcap: > 0, logits become c tanh(logits / c).
    rope_long: the model carries rope_factors_long/short (phi3's longrope), the long ones
    for runs of a context beyond rope_orig_ctx (0: ctx); rope_attn_factor scales the rotated
    dims. granite's multipliers, as llama.cpp reads them: embedding_scale multiplies the
    embedding, residual_scale what each attention and FFN adds to the residual (0: neither
    is scaled), attn_scale scales q.k (0: the family's scale), logits are divided by
    logit_scale.
    """

    vocab: int
    dim: int = 256
    layers: int = 4
    heads: int = 8
    kv_heads: int = 8
    ff: int = 768
    ctx: int = 128
    rope_dims: int = 0           # 0: the whole head
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    tied: bool = False           # output projection is the token embedding
    arch: str = "llama"
    head_dim: int = 0            # 0: dim // heads
    rope_scale: float = 1.0
    rope_freqs: bool = False
    window: int = 0
    window_pattern: int = -1
    rope_base_swa: float = 10000.0
    logit_softcap: float = 0.0
    rope_long: bool = False
    rope_orig_ctx: int = 0
    rope_attn_factor: float = 1.0
    embedding_scale: float = 0.0
    residual_scale: float = 0.0
    attn_scale: float = 0.0
    logit_scale: float = 1.0

    def __post_init__(self):
        fam = family(self.arch)
        for name in ("vocab", "dim", "layers", "heads", "kv_heads", "ff", "ctx"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{self.arch}: {name} must be >= 1, got {getattr(self, name)}")
        if not self.head_dim:
            if self.dim % self.heads:
                raise ConfigError(f"{self.arch}: dim {self.dim} is not a multiple of heads {self.heads}")
            object.__setattr__(self, "head_dim", self.dim // self.heads)
        if self.head_dim < 1:
            raise ConfigError(f"{self.arch}: head_dim must be >= 1, got {self.head_dim}")
        if not self.rope_dims:
            object.__setattr__(self, "rope_dims", self.head_dim)
        if self.heads % self.kv_heads:
            raise ConfigError(f"{self.arch}: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_dim % 2 or self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ConfigError(f"{self.arch}: rotary dims {self.n_rot} must be even and <= head dim {self.head_dim}")
        if not self.rope_scale > 0 or not self.rope_base > 0 or not self.norm_eps > 0:
            raise ConfigError(f"{self.arch}: rope_scale, rope_base and norm_eps must be > 0")
        if self.rope_freqs and not fam.rope_freqs:
            raise ConfigError(f"{self.arch}: the family has no {ROPE_FREQS}")
        if self.window_pattern == -1:
            object.__setattr__(self, "window_pattern", fam.window_pattern)
        if self.window < 0 or self.window_pattern < 0 or self.logit_softcap < 0 or not self.rope_base_swa > 0:
            raise ConfigError(f"{self.arch}: window {self.window}, window_pattern {self.window_pattern}, "
                              f"logit_softcap {self.logit_softcap} must be >= 0, rope_base_swa > 0")
        if self.window and "window" not in fam.keys:
            raise ConfigError(f"{self.arch}: the family has no sliding-window attention")
        if self.rope_long and not fam.long_rope:
            raise ConfigError(f"{self.arch}: the family has no long-context rope factors")
        if not (self.embedding_scale >= 0 and self.residual_scale >= 0 and self.attn_scale >= 0
                and self.logit_scale > 0):
            raise ConfigError(f"{self.arch}: embedding_scale {self.embedding_scale}, residual_scale "
                              f"{self.residual_scale}, attn_scale {self.attn_scale} must be >= 0, logit_scale "
                              f"{self.logit_scale} > 0")
        applied = dict(embedding_scale=self.embedding_scale != 0, residual_scale=self.residual_scale != 0,
                       attn_scale=self.attn_scale != 0, logit_scale=self.logit_scale != 1.0)
        unread = [name for name, on in applied.items() if on and name not in fam.keys]
        if unread:
            raise ConfigError(f"{self.arch}: the family has no {unread[0]}")
        if self.rope_orig_ctx < 0 or not self.rope_attn_factor > 0:
            raise ConfigError(f"{self.arch}: rope_orig_ctx {self.rope_orig_ctx} must be >= 0, "
                              f"rope_attn_factor {self.rope_attn_factor} > 0")

    @property
    def family(self) -> Family:
        return FAMILIES[self.arch]

    @property
    def n_rot(self) -> int:
        return self.rope_dims

    def local(self, layer: int) -> bool:
        """Whether a layer attends through the sliding window (llama.cpp's SWA pattern:
        every window_pattern-th layer is global)."""
        n = self.window_pattern
        return self.window > 0 and (n == 0 or layer % n < n - 1)

    @property
    def n_params(self) -> int:
        """Parameters (the output tied to the embedding or not, as the config says)."""
        return sum(math.prod(s) for s in param_shapes(self).values())


def param_shapes(cfg: ModelConfig) -> dict:
    """{tensor name: numpy-order shape}, in llama.cpp's order."""
    shapes = {TOKEN_EMBD: (cfg.vocab, cfg.dim), OUTPUT_NORM: (cfg.dim,)}
    if not cfg.tied:
        shapes[OUTPUT] = (cfg.vocab, cfg.dim)
    if cfg.rope_freqs:
        shapes[ROPE_FREQS] = (cfg.n_rot // 2,)
    if cfg.rope_long:
        shapes[ROPE_FACTORS_LONG] = shapes[ROPE_FACTORS_SHORT] = (cfg.n_rot // 2,)
    for i in range(cfg.layers):
        for name in cfg.family.block:
            shapes[f"blk.{i}.{STORED_AS.get(name, name)}"] = BLOCK_SHAPES[name](cfg)
    return shapes


def trainable(name: str) -> bool:
    """Whether training changes a parameter: all but the rope frequency factors (constants
    of the position encoding, not weights)."""
    return name not in ROPE_CONSTANTS


def init_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict:
    """Initialisation for training from scratch: N(0, std^2) for matrices, with the
    projections that write into the residual stream (attn_output, ffn_down) scaled by
    1/sqrt(2 L) as in GPT-2; ones for the RMSNorm weights (and rope factors), zeros for
    biases. {name: float32 array}."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight") or name in ROPE_CONSTANTS:
            out[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        else:
            s = std / math.sqrt(2 * cfg.layers) if name.endswith(("attn_output.weight", "ffn_down.weight")) else std
            out[name] = rng.normal(0.0, s, shape).astype(np.float32)
    return out


def linear(x, params: dict, name: str, lora: dict | None = None):
    """x @ W.T for the weight `name`, plus its LoRA update when `lora` has one, plus the
    bias "<name without .weight>.bias" where params has one (after the LoRA update, as
    llama.cpp adds it):
    scale * (x @ A.T) @ B.T with lora[name] = (A (r, n_in), B (n_out, r), scale), as
    llama.cpp applies an adapter (scale = user scale * alpha / r). A fourth item
    (p, seed, salt) drops the adapter's input out in training (ops.dropout; PEFT's
    lora_dropout), never the base product's; a true fifth sums the adapter's product onto
    the frozen one's in one op (ops.matmul_lora, where the backend has it: lora_fused). With
    params.act8 (FrozenParams), llama.cpp's CPU numbers: a weight of an ops.ACT8_TYPES type
    multiplies x quantized to 8 bits (ops.matmul_q8), an f32 or f16 one (and the adapter's
    factors) takes its float order (ops.matmul_ggml), and the adapter's scale goes on B (A x),
    as llama.cpp's graph applies it. (bf16 weights multiply exactly: llama.cpp's bf16 products
    are not emulated.)"""
    w = params[name]
    ggml = getattr(params, "act8", False)
    if lora and name in lora and not ggml:
        a, b, scale, *rest = lora[name]
        drop, fused = rest[0] if rest else None, len(rest) > 1 and rest[1]
        y = None if fused else ops.linear(x, w)
        xa = ops.dropout(x, *drop) if drop is not None else x
        # the scale goes on the rank-r product (r columns, not n_out)
        h = ops.scale(ops.linear(xa, a), scale)
        if fused:      # the adapter's product summed onto the frozen one's
            return _bias(ops.matmul_lora(x, w, h, b), params, name)
        return _bias(ops.add(y, ops.linear(h, b)), params, name)
    if ggml and w.dtype in ops.ACT8_TYPES:     # llama.cpp's numerics
        y = ops.matmul_q8(x, ops.transpose(w, -1, -2))
    elif ggml and w.dtype in ops.GGML_FLOAT_TYPES:
        y = ops.matmul_ggml(x, ops.transpose(w, -1, -2))
    else:
        y = ops.linear(x, w)
    if lora and name in lora:      # (act8)
        a, b, scale, *_ = lora[name]
        ab = ops.matmul_ggml(ops.matmul_ggml(x, ops.transpose(a, -1, -2)), ops.transpose(b, -1, -2))
        return _bias(ops.add(y, ops.scale(ab, scale)), params, name)
    return _bias(y, params, name)


def _bias(y, params: dict, name: str):
    """y plus the bias of weight `name` where params has one."""
    bias = params.get(name[:-len("weight")] + "bias")
    return y if bias is None else ops.add(y, bias)


def _rope_factors(cfg: ModelConfig, params: dict, n_ctx: int):
    """The per-pair frequency divisors a run of context n_ctx rotates with, or None."""
    if cfg.rope_long:     # llama.cpp: the long factors when the context passes the original one
        return params[ROPE_FACTORS_LONG if n_ctx > (cfg.rope_orig_ctx or cfg.ctx) else ROPE_FACTORS_SHORT]
    return params.get(ROPE_FREQS)


def _ggml_attention(fam, ggml: bool, params) -> dict:
    """ops.attention's arguments for llama.cpp's numbers (none otherwise)."""
    return {"ggml": True, "scale_q": fam.scale_q, "kv_f16": params.kv_f16} if ggml else {}


def _norm(x, eps: float, ggml: bool):
    """rms_norm, in llama.cpp's numbers where ggml."""
    return ops.rms_norm(x, eps, ggml=True) if ggml else ops.rms_norm(x, eps)


def _attention(cfg: ModelConfig, x, p: str, params: dict, pos, lora=None, kv=None, n_kv: int = 0, seg=None,
               keep=None, layer: int = 0, n_ctx: int = 0):
    """Self-attention of x (B, T, C), causal; with seg (B, T) i32 (packed samples), query i
    sees key j only when j <= i and seg[., j] == seg[., i] (pos (B, T) then restarts per
    sample). With kv = (k_cache, v_cache), persistent (S, Hkv*D) tensors (B must be 1):
    this step's keys and values are written at rows pos, and the queries attend over cache
    rows 0..n_kv-1, query i seeing rows <= pos[i]. keep: called with the fused attention
    node (Graph.keep under checkpointing). layer: the block's index (a sliding-window layer
    has its window, its rope base and no rope scaling; a NoPE layer no rope). n_ctx: the
    run's context (chooses phi3's long or short rope factors)."""
    b, t, c = x.shape
    fam = cfg.family
    local = cfg.local(layer)
    h, hkv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    if fam.fused_qkv:   # one product, its q | k | v columns read as views
        qkv = linear(x, params, p + "attn_qkv.weight", lora)                              # (B, T, (H+2Hkv)*D)
        n = qkv.shape[-1]
        q = ops.view(qkv, (b, t, h, d), (t * n, n, d, 1))
        k = ops.view(qkv, (b, t, hkv, d), (t * n, n, d, 1), h * d)
        v = ops.view(qkv, (b, t, hkv, d), (t * n, n, d, 1), (h + hkv) * d)
    else:
        q = ops.reshape(linear(x, params, p + "attn_q.weight", lora), (b, t, h, d))
        k = ops.reshape(linear(x, params, p + "attn_k.weight", lora), (b, t, hkv, d))
        v = ops.reshape(linear(x, params, p + "attn_v.weight", lora), (b, t, hkv, d))
    ggml = getattr(params, "act8", False)       # llama.cpp's numbers: its norms, rope angles, attention order
    if fam.qk_norm:   # RMSNorm over each head's D values
        q = ops.mul(_norm(q, cfg.norm_eps, ggml), params[p + "attn_q_norm.weight"])
        k = ops.mul(_norm(k, cfg.norm_eps, ggml), params[p + "attn_k_norm.weight"])
    nope = fam.no_rope_every and (layer + 1) % fam.no_rope_every == 0      # smollm3's NoPE layers
    if not nope:
        rope = dict(n_dims=cfg.n_rot, freq_base=cfg.rope_base_swa if local else cfg.rope_base, mode=fam.rope_mode,
                    freq_scale=1.0 if local else 1.0 / cfg.rope_scale, factors=_rope_factors(cfg, params, n_ctx),
                    attn_factor=cfg.rope_attn_factor, **({"ggml": True} if ggml else {}))
        q = ops.rope(q, pos, **rope)
        k = ops.rope(k, pos, **rope)
    scale = fam.attention_scale(cfg)
    window = cfg.window if local else 0
    if kv is None:
        out = ops.attention(q, k, v, scale, causal=seg is None, seg=seg, window=window,   # (B, T, H, D)
                            **_ggml_attention(fam, ggml and seg is None, params))
        if keep is not None:
            keep(out.root)
    else:
        if b != 1:
            raise ConfigError(f"{cfg.arch}: a KV cache serves one sequence, got a batch of {b}")
        cache_k = ops.set_rows(kv[0], ops.reshape(k, (t, hkv * d)), pos)              # (S, Hkv*D)
        cache_v = ops.set_rows(kv[1], ops.reshape(v, (t, hkv * d)), pos)
        k = ops.view(cache_k, (1, n_kv, hkv, d))                                        # rows 0..n_kv-1
        v = ops.view(cache_v, (1, n_kv, hkv, d))
        out = ops.attention(q, k, v, scale, pos=pos, window=window, **_ggml_attention(fam, ggml, params))
    return linear(ops.reshape(out, (b, t, h * d)), params, p + "attn_output.weight", lora)


def forward(cfg: ModelConfig, params: dict, tokens, pos, graph=None, checkpoint: bool = False,
            lora: dict | None = None, cache: list | None = None, n_kv: int = 0, last_only: bool = False,
            seg=None, rows=None, head: bool = True, n_ctx: int = 0):
    """Logits (B, T, V) for tokens (B, T) i32 at positions pos (T,) i32.

    params: {name: Tensor} as param_shapes (weights f32, or frozen in their stored types).
    lora: {weight name: (A, B, scale)} adapters added to those weights (see `linear`).
    With checkpoint, each block ends a segment of `graph` (gradient checkpointing
    recomputes blocks in backward), except what Graph.keep marks: the fused attention
    node (so its output and the q, k, v its backward reads stay, and neither attention nor
    the q, k, v products run again) and the residual after it (so the output projection
    does not either). Backward then recomputes only the norms and the FFN's gate and up
    products: ~40% of a block's forward (less at long contexts), for ~5 (B, T, C) tensors
    a block instead of the ~6 C + 4 ff per token that no checkpointing keeps. (With lora,
    TrainStep's own selective policy keeps the frozen products instead, and attention is
    recomputed: fine-tuning large models is short of memory, not time.)
    seg (B, T) i32: packed samples (pos then (B, T), restarting per sample; see _attention).
    cache: per layer (k_cache, v_cache) persistent (S, Hkv*D) tensors for incremental
    decoding (B = 1; see _attention), attending over n_kv cache rows. last_only: logits of
    the last position only, (B, 1, V). rows (M,) i32: logits only at those flat positions
    of (B*T) (the ones a loss needs), (M, V). head=False: the normed hidden states the
    output projection reads instead of logits ((..., C); chunked_loss takes them). n_ctx: the
    context of the run (the window, or the KV cache's positions; 0: T), which picks phi3's
    long or short rope factors as llama.cpp's context size does.
    """
    b, t = tokens.shape
    if t > cfg.ctx:
        raise ConfigError(f"{cfg.arch}: sequence of {t} tokens exceeds the context {cfg.ctx}")
    eps = cfg.norm_eps
    fam = cfg.family
    ggml = getattr(params, "act8", False)       # llama.cpp's numbers (FrozenParams.act8): its norms' sums
    x = ops.get_rows(params["token_embd.weight"], tokens)                            # (B, T, C)
    if fam.embed_scale:
        x = ops.scale(x, math.sqrt(cfg.dim))
    if cfg.embedding_scale:
        x = ops.scale(x, cfg.embedding_scale)
    for i in range(cfg.layers):
        p = f"blk.{i}."
        h = ops.mul(_norm(x, eps, ggml), params[p + "attn_norm.weight"])
        kv = cache[i] if cache is not None else None
        keep = graph.keep if checkpoint and graph is not None and not lora else None
        a = _attention(cfg, h, p, params, pos, lora, kv, n_kv, seg, keep=keep, layer=i, n_ctx=n_ctx or t)
        if fam.post_norms:
            a = ops.mul(_norm(a, eps, ggml), params[p + "post_attention_norm.weight"])
        if cfg.residual_scale:
            a = ops.scale(a, cfg.residual_scale)
        if last_only and t > 1 and i == cfg.layers - 1:
            # as llama.cpp's graphs (inp_out_ids): the last block's FFN, like the head, takes
            # only the row whose logits are wanted, so its products have llama.cpp's row count
            a, x = _last_row(a), _last_row(x)
        x = ops.add(x, a)
        if keep is not None:
            keep(x)
        h = ops.mul(_norm(x, eps, ggml), params[p + "ffn_norm.weight"])
        if fam.fused_gate_up:   # one product, gate | up columns
            gu = linear(h, params, p + "ffn_up.weight", lora)                             # (B, T, 2F)
            b_, t_, f2 = gu.shape
            gate = ops.view(gu, (b_, t_, f2 // 2), (t_ * f2, f2, 1))
            up = ops.view(gu, (b_, t_, f2 // 2), (t_ * f2, f2, 1), f2 // 2)
        else:
            gate = linear(h, params, p + "ffn_gate.weight", lora)
            up = linear(h, params, p + "ffn_up.weight", lora)
        if fam.act != "gelu":
            act = ops.swiglu_ggml(gate, up) if ggml else ops.swiglu(gate, up)
        else:       # (llama.cpp's f16-table gelu with its 8-bit products: its numbers, FrozenParams)
            act = ops.geglu_f16(gate, up) if getattr(params, "act8", False) else ops.geglu(gate, up)
        f = linear(act, params, p + "ffn_down.weight", lora)
        if fam.post_norms:
            f = ops.mul(_norm(f, eps, ggml), params[p + "post_ffw_norm.weight"])
        if cfg.residual_scale:
            f = ops.scale(f, cfg.residual_scale)
        x = ops.add(x, f)
        if checkpoint and graph is not None:
            graph.checkpoint(x)
    if last_only and t > 1 and not cfg.layers:
        x = _last_row(x)
    if rows is not None:
        x = ops.get_rows(ops.reshape(x, (b * t, x.shape[-1])), rows)                # (M, C)
    x = ops.mul(_norm(x, eps, ggml), params["output_norm.weight"])
    return output(cfg, params, x, lora) if head else x


def _last_row(x):
    """The last position of x (B, T, C) contiguous, as (B, 1, C)."""
    b, t, c = x.shape
    return ops.view(x, (b, 1, c), (t * c, c, 1), (t - 1) * c)


def head_name(cfg: ModelConfig) -> str:
    """The output matrix's tensor: the embedding when tied."""
    return "token_embd.weight" if cfg.tied else "output.weight"


def output(cfg: ModelConfig, params: dict, x, lora: dict | None = None):
    """Logits (..., V) of normed hidden states x (..., C): the output projection (the
    embedding when tied), divided by logit_scale and soft-capped where the model says."""
    logits = linear(x, params, head_name(cfg), lora)
    if cfg.logit_scale != 1.0:
        logits = ops.scale(logits, 1.0 / cfg.logit_scale)
    if cfg.logit_softcap:
        c = cfg.logit_softcap
        logits = ops.scale(ops.tanh(ops.scale(logits, 1.0 / c)), c)
    return logits


def loss(logits, targets):
    """Mean cross-entropy of logits (B, T, V) against targets (B, T) i32, or of logits (M, V)
    against targets (M,) (negative targets: ignored)."""
    v = logits.shape[-1]
    n = logits.size // v
    return ops.cross_entropy(ops.reshape(logits, (n, v)), ops.reshape(targets, (n,)))


# Logits of at most this many bytes are made at once; a loss over more is taken in chunks of
# rows (Gemma's 262144-token vocabulary makes 1 MiB of f32 logits a position). Each chunk
# multiplies the whole output matrix, dequantizing it a tile at a time for its rows: with 32
# rows a chunk (32 MiB) Gemma 3 270M's Q8_0 output projection ran at 140-160 GFLOP/s and took
# 62% of a LoRA update, with 128 rows at 220-234 (the update 7.4 s -> 5.8 s, ctx 512 b2), and
# 256 rows ran 13-18% faster than 128 again (measured alternately, x @ W.T and g @ W).
LOGITS_BUDGET = 256 * 2**20
CHUNK_BYTES = 256 * 2**20


def loss_chunks(cfg: ModelConfig, rows: int, head_trained: bool = False) -> int:
    """How many chunks chunked_loss takes rows positions in: 1 while their logits fit
    LOGITS_BUDGET, or when the output matrix is trained (each chunk would add a (V, C)
    weight gradient, which outweighs the logits saved unless rows >> 2 C), else chunks of
    about CHUNK_BYTES of logits."""
    full = rows * cfg.vocab * 4
    if full <= LOGITS_BUDGET or head_trained:
        return 1
    per = max(1, CHUNK_BYTES // (cfg.vocab * 4))
    return -(-rows // per)


def chunk_weights(targets: np.ndarray, n_chunks: int) -> np.ndarray:
    """(n_chunks,) f32: each chunk's share of the positions with a target (targets (..., T)
    flattened, negative ids ignored), so the weighted chunk means are the mean over all."""
    flat = np.asarray(targets).reshape(-1)
    size = -(-flat.size // n_chunks)
    counts = np.array([(flat[k * size:(k + 1) * size] >= 0).sum() for k in range(n_chunks)], np.float64)
    total = counts.sum()
    return (counts / total if total else counts).astype(np.float32)


def fused_loss_available(cfg: ModelConfig, params: dict, lora: dict | None, backend) -> bool:
    """Whether the loss over the output matrix can be one ops.linear_cross_entropy, its input
    gradient taken in the forward and no logits held (chunked_loss and sequence_nll with
    fused): a frozen output matrix (LoRA) with no adapter and no bias, on a backend with the
    kernel for its type (the CPU's; CUDA takes the chunked logits)."""
    name = head_name(cfg)
    w = params.get(name)
    if w is None or w.requires_grad or (lora and name in lora) or name[:-len("weight")] + "bias" in params:
        return False
    return backend.supports(ops.OPS["linear_cross_entropy"].kernel_name_for(w))


def _fused_rows(cfg: ModelConfig, params: dict, x2, t1, mean: bool, grad: bool) -> tuple:
    """(nll (N,), dx (N, C)) of ops.linear_cross_entropy over rows x2 (N, C), targets t1."""
    n, c = x2.shape
    out = ops.linear_cross_entropy(x2, params[head_name(cfg)], t1, scale=1.0 / cfg.logit_scale,
                                   softcap=cfg.logit_softcap or 0.0, mean=mean, grad=grad)
    return ops.view(out, (n,), (1,), n * c), ops.view(out, (n, c), (c, 1), 0)


def chunked_loss(cfg: ModelConfig, params: dict, x, targets, weights, lora: dict | None = None,
                 grad: bool = False, fused: bool = False):
    """Mean cross-entropy of the logits of normed hidden states x (..., C) against targets
    (...) i32 (negative: ignored), len(weights) chunks of rows at a time: chunk k's mean
    times weights[k] (its share of the counted rows, chunk_weights), summed. One chunk is
    loss(output(x), targets) exactly. Forward only (evaluation), no more than a chunk's
    (rows, V) logits are held. With grad (training with the output matrix frozen: LoRA),
    each chunk's gradient of its rows of x is computed right after its loss, in the
    forward, and handed to the backward (ops.with_grad): its logits die there and are never
    recomputed. (A trained output matrix would get a (V, C) gradient per chunk, more than
    the logits saved: loss_chunks gives it one chunk.) fused (fused_loss_available; with
    one chunk): one ops.linear_cross_entropy over all rows gives the mean (and with grad
    its gradient), the logits never made (FlashAttention's running softmax over the
    vocabulary)."""
    k_total = weights.shape[0]
    x2, t1 = _rows(x, targets)
    if fused:
        if k_total != 1:
            raise ValueError("chunked_loss: the fused loss takes its rows in one chunk")
        nll, dx = _fused_rows(cfg, params, x2, t1, mean=True, grad=grad)
        ce = ops.sum(nll)
        return ops.mul(ops.with_grad(ce, x2, dx) if grad else ce, ops.reshape(weights, ()))
    if k_total == 1:
        return ops.mul(ops.cross_entropy(output(cfg, params, x2, lora), t1), ops.reshape(weights, ()))
    total = None
    for k, (lo, m, xk, tk) in enumerate(_chunks(x2, t1, k_total)):
        ce = ops.cross_entropy(output(cfg, params, xk, lora), tk)
        if grad:   # d ce / d xk now; the backward scales it by the chunk's upstream gradient
            ce = ops.with_grad(ce, xk, backward(ce, [xk], checkpointing=False)[xk])
        part = ops.mul(ce, ops.view(weights, (), (), k))
        total = part if total is None else ops.add(total, part)
    return total


def _rows(x, targets) -> tuple:
    """x (..., C) and targets (...) as (N, C) rows and (N,) targets."""
    c = x.shape[-1]
    n = x.size // c
    return ops.reshape(x, (n, c)), ops.reshape(targets, (n,))


def _chunks(x2, t1, n_chunks: int):
    """(lo, m, rows, targets) of n_chunks consecutive chunks of x2 (N, C) and t1 (N,): views
    of about N / n_chunks rows each (the whole tensors for one chunk)."""
    n, c = x2.shape
    if n_chunks == 1:
        yield 0, n, x2, t1
        return
    size = -(-n // n_chunks)
    for lo in range(0, n, size):
        m = min(size, n - lo)
        yield lo, m, ops.view(x2, (m, c), (c, 1), lo * c), ops.view(t1, (m,), (1,), lo)


def sequence_nll(cfg: ModelConfig, params: dict, x, targets, select, n_chunks: int = 1,
                 lora: dict | None = None, grad: bool = False, fused: bool = False):
    """Weighted sums of per-position losses: select (K, N) @ nll (N,), (K,), where nll[r] is
    -log p(targets[r]) at normed hidden state x[r] (x (N, C), targets (N,) i32; 0 where the
    target is negative). The summed or mean log-probability of each sequence a preference
    loss compares (core/preference.py). Taken n_chunks row chunks at a time (loss_chunks),
    as chunked_loss; with grad (LoRA: a frozen output matrix) each chunk's per-row input
    gradients are computed in the forward (ops.with_grad, row-wise) and its logits die there.
    fused (one chunk): ops.linear_cross_entropy's per-row losses (and with grad gradients)."""
    k_rows = select.shape[0]
    x2, t1 = _rows(x, targets)
    n = x2.shape[0]
    if fused:
        if n_chunks != 1:
            raise ValueError("sequence_nll: the fused loss takes its rows in one chunk")
        nll, dx = _fused_rows(cfg, params, x2, t1, mean=False, grad=grad)
        if grad:
            nll = ops.with_grad(nll, x2, dx)
        return ops.reshape(ops.matmul(select, ops.reshape(nll, (n, 1))), (k_rows,))
    total = None
    for lo, m, xk, tk in _chunks(x2, t1, n_chunks):
        whole = m == n
        nll = ops.cross_entropy_rows(output(cfg, params, xk, lora), tk)
        if grad and not whole:   # d nll[r] / d xk[r] now; the backward scales row r by its upstream
            nll = ops.with_grad(nll, xk, backward(ops.sum(nll), [xk], checkpointing=False)[xk])
        sk = select if whole else ops.view(select, (k_rows, m), (n, 1), lo)
        part = ops.reshape(ops.matmul(sk, ops.reshape(nll, (m, 1))), (k_rows,))
        total = part if total is None else ops.add(total, part)
    return total


class FrozenParams(dict):
    """{name: Tensor} of fixed weights; act8: llama.cpp's CPU numerics for inference: products
    with quantized weights take 8-bit activations (`linear`), and geglu its f16-table gelu;
    kv_f16 (with act8): attention rounds as llama.cpp's F16 KV cache (its default) does."""

    act8 = False
    kv_f16 = False


def lora_fused(backend, w) -> bool:
    """Whether `backend` sums an adapter's product onto the frozen weight w's in one op
    (ops.matmul_lora's kernel for w's type)."""
    return backend.supports(ops.OPS["matmul_lora"].kernel_name_for(w))


def act8_available(backend) -> bool:
    """Whether `backend` has llama.cpp's CPU numbers (every variant of every ops.OpDef.llama_cpu
    op: the CPU does; CUDA computes f32)."""
    kernels = [f"{op.kernel}_{d}" for op in ops.OPS.values() if op.llama_cpu for d in op.dtypes]
    return bool(ops.ACT8_TYPES) and all(backend.supports(k) for k in kernels)


def _frozen(graph, weights: dict, adapters: dict | None, act8: bool = False, kv_f16: bool = False) -> tuple:
    """Graph parameters for fixed weights: {name: Tensor} (FrozenParams, act8 as given), the
    LoRA dict for forward, and {Tensor: buffer} of the weights that are already in backend
    memory (to bind).

    weights: {name: f32 array, or StoredTensor (bytes already in a backend buffer, any
    stored type)}; adapters: {weight name: (A, B, scale)} with f32 arrays (or f16 ones, kept
    f16 with act8: formats.lora.read_lora).
    """
    params, stored = FrozenParams(), {}
    params.act8 = act8
    params.kv_f16 = act8 and kv_f16
    for name, w in weights.items():
        if isinstance(w, StoredTensor):
            t = graph.param(w.shape, name=name, trainable=False, dtype=w.dtype)
            stored[t] = w.buffer
        else:
            t = graph.param(w.shape, w, name=name, trainable=False)
        params[name] = t
    lora = {}
    for name, (a, b, scale) in (adapters or {}).items():
        if name not in params:
            raise ConfigError(f"an adapter targets {name!r}, which the model does not have")
        # an adapter stored in f16 stays f16 in llama.cpp's numbers (which multiply it so); else f32
        lora[name] = tuple(graph.param(f.shape, f, name=name + suffix, trainable=False,
                                       dtype="f16" if act8 and f.dtype == np.float16 else "f32")
                           for f, suffix in ((a, ".lora_a"), (b, ".lora_b"))) + (float(scale),)
    return params, lora, stored


class Runner:
    """Forward-only runs of a model with fixed weights over whole windows: logits, and
    losses for evaluation. Compiled once for (batch, length); shorter inputs are padded
    (causal attention: padding after a position never changes its logits).

    weights: {name: f32 array or StoredTensor}; adapters: {weight name: (A, B, scale)}.
    n_ctx: the run's context when it is not `length` (a user's --ctx, of which a short text
    fills less): it picks phi3's long or short rope factors. act8: llama.cpp's CPU numbers
    (quantized weights times 8-bit activations, see `linear`; act8_available says where), and
    kv_f16 with it those of its default F16 KV cache (FrozenParams).
    """

    def __init__(self, cfg: ModelConfig, weights: dict, backend, batch: int = 1, length: int | None = None,
                 adapters: dict | None = None, n_ctx: int = 0, act8: bool = False, kv_f16: bool = False):
        self.cfg = cfg
        self.batch, self.length = batch, min(length or cfg.ctx, cfg.ctx)
        g = Graph()
        params, lora, stored = _frozen(g, weights, adapters, act8, kv_f16)
        self.tokens = g.input((batch, self.length), "i32", name="tokens")
        self.targets = g.input((batch, self.length), "i32", name="targets")
        self.pos = g.input((self.length,), "i32", name="pos")
        hidden = forward(cfg, params, self.tokens, self.pos, lora=lora, head=False, n_ctx=n_ctx or self.length)
        self.logits_t = output(cfg, params, hidden, lora)
        # the loss never holds the window's logits whole: none at all where one
        # linear_cross_entropy can take it (f32 numbers, the output matrix without an
        # adapter), else a chunk of rows at a time (chunked_loss)
        fused = not act8 and fused_loss_available(cfg, params, lora, backend)
        self.chunks = g.input((1 if fused else loss_chunks(cfg, batch * self.length),), name="chunk_weights")
        self.loss_t = chunked_loss(cfg, params, hidden, self.targets, self.chunks, lora=lora, fused=fused)
        self.runtime = Runtime(g, backend)
        for t, buf in stored.items():
            self.runtime.bind(t, buf)
        self._plan_logits = None
        self._plan_loss = None
        self.runtime.set(self.pos, np.arange(self.length, dtype=np.int32))

    def _fill(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[0] != self.batch or tokens.shape[1] > self.length:
            raise ConfigError(f"runner: tokens {tokens.shape} do not fit ({self.batch}, <= {self.length})")
        _check_ids(tokens, self.cfg.vocab)
        full = np.zeros((self.batch, self.length), np.int32)
        full[:, :tokens.shape[1]] = tokens
        return full

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits (batch, length, V) for tokens (batch, <= length); rows past the input are padding."""
        if self._plan_logits is None:
            self._plan_logits = self.runtime.compile([self.logits_t])
        self.runtime.set(self.tokens, self._fill(tokens))
        self.runtime.run(self._plan_logits)
        return self._plan_logits.read(self.logits_t)

    def nll(self, tokens: np.ndarray, targets: np.ndarray) -> float:
        """Summed negative log-likelihood of targets (negative ids ignored) given tokens."""
        if self._plan_loss is None:
            self._plan_loss = self.runtime.compile([self.loss_t])
        tgt = np.full((self.batch, self.length), -1, np.int32)
        targets = np.asarray(targets, np.int32)
        tgt[:, :targets.shape[1]] = targets
        self.runtime.set(self.tokens, self._fill(tokens))
        self.runtime.set(self.targets, tgt)
        self.runtime.set(self.chunks, chunk_weights(tgt, self.chunks.shape[0]))
        self.runtime.run(self._plan_loss)
        return float(self._plan_loss.read(self.loss_t)) * int((tgt >= 0).sum())


def _check_ids(tokens: np.ndarray, vocab: int) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ConfigError(f"token id outside 0..{vocab - 1}")


class Decoder:
    """Incremental (KV-cached) decoding of one sequence: `feed(ids)` appends tokens and
    returns the logits after the last one; each new token costs one token's work.

    The cache holds n_ctx positions (f32 keys and values per layer). Plans are compiled
    on demand, one per count of tokens fed at once, each attending over the whole cache:
    the attention kernels read only the rows each query sees (its position and those
    before), so one plan serves a token at any position (plans per power-of-two span of
    rows were compiled anew as the sequence grew, about 30 ms each, which was a fifth of the
    time of 48 tokens of SmolLM2). Prompts are fed in chunks of `chunk` tokens (llama.cpp's
    default ubatch of 512: with act8 a product's row count picks llama.cpp's kernel, hence
    its float order, so a prompt is cut where llama.cpp cuts it). act8, kv_f16: as Runner's.
    """

    def __init__(self, cfg: ModelConfig, weights: dict, backend, n_ctx: int | None = None,
                 adapters: dict | None = None, chunk: int = 512, act8: bool = False, kv_f16: bool = False):
        self.cfg = cfg
        self.n_ctx = min(n_ctx or cfg.ctx, cfg.ctx)
        if self.n_ctx < 1 or chunk < 1:
            raise ConfigError(f"decoder: context {self.n_ctx} and chunk {chunk} must be >= 1")
        self.chunk = chunk
        self.graph = g = Graph()
        self.params, self.lora, stored = _frozen(g, weights, adapters, act8, kv_f16)
        kv = cfg.kv_heads * cfg.head_dim
        self.cache = [(g.state((self.n_ctx, kv), name=f"cache_k.{i}"),
                       g.state((self.n_ctx, kv), name=f"cache_v.{i}")) for i in range(cfg.layers)]
        self.runtime = Runtime(g, backend)
        for t, buf in stored.items():
            self.runtime.bind(t, buf)
        self._plans: dict = {}
        self.n_past = 0                      # positions in the cache

    def _plan(self, t: int, every: bool = False):
        key = (t, every)
        if key not in self._plans:
            g = self.graph
            tokens = g.input((1, t), "i32", name=f"tokens.{t}")
            pos = g.input((t,), "i32", name=f"pos.{t}")
            logits = forward(self.cfg, self.params, tokens, pos, lora=self.lora, cache=self.cache,
                             n_kv=self.n_ctx, last_only=not every, n_ctx=self.n_ctx)
            self._plans[key] = (self.runtime.compile([logits]), tokens, pos, logits)
        return self._plans[key]

    def prepare(self) -> None:
        """Compile the plan of one token now (generation's every step after the prompt), so the
        first generated token does not wait for it."""
        self._plan(1)

    def reset(self) -> None:
        """Forget the sequence (the cache rows are overwritten as new tokens come)."""
        self.n_past = 0

    def rewind(self, n: int) -> None:
        """Keep the first n positions of the sequence (a shared prefix), forget the rest."""
        if not 0 <= n <= self.n_past:
            raise ConfigError(f"decoder: cannot rewind to {n} of {self.n_past} positions")
        self.n_past = n

    def feed(self, ids, every: bool = False) -> np.ndarray:
        """Append token ids (at least one) to the sequence; logits (V,) after the last one,
        or with every the logits (len(ids), V) after each.

        Raises ConfigError when the sequence would pass the cache's n_ctx positions.
        """
        ids = np.asarray(ids, np.int32).reshape(-1)
        if ids.size == 0:
            raise ConfigError("decoder: nothing to feed")
        if self.n_past + ids.size > self.n_ctx:
            raise ConfigError(f"decoder: {self.n_past} + {ids.size} tokens exceed the context "
                              f"of {self.n_ctx}")
        _check_ids(ids, self.cfg.vocab)
        out = []
        for start in range(0, ids.size, self.chunk):
            part = ids[start:start + self.chunk]
            plan, tokens, pos, logits = self._plan(part.size, every)
            self.runtime.set(tokens, part[None, :])
            self.runtime.set(pos, np.arange(self.n_past, self.n_past + part.size, dtype=np.int32))
            self.runtime.run(plan)
            self.n_past += part.size
            if every:
                out.append(plan.read(logits)[0])
        return np.concatenate(out) if every else plan.read(logits)[0, -1]


def generate(decoder: Decoder, prompt: list, n: int, sampler, stop: frozenset = frozenset()):
    """Yield new token ids after `prompt`: up to n (n < 0: until a stop token or the context
    is full), each drawn by `sampler(logits, history)`; a stop token is yielded, then ends."""
    ids = list(prompt)
    if not ids:
        raise ConfigError("generate: the prompt has no tokens")
    decoder.reset()
    if n != 0:
        decoder.prepare()
    logits = decoder.feed(ids)
    count = 0
    while n < 0 or count < n:
        nxt = int(sampler(logits, ids))
        ids.append(nxt)
        count += 1
        yield nxt
        if nxt in stop or decoder.n_past >= decoder.n_ctx:
            return
        logits = decoder.feed([nxt])
