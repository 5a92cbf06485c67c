"""The llama architecture as llama.cpp computes it (layer 4).

token embedding -> L x [RMSNorm -> attention (RoPE mode 0, grouped KV heads, causal,
1/sqrt(D) scale) -> residual -> RMSNorm -> SwiGLU FFN -> residual] -> RMSNorm -> output
projection (or the embedding, tied, when there is no output.weight).

Parameters use llama.cpp's tensor names with numpy-order shapes (ggml's ne reversed):
token_embd.weight (V, C), blk.{i}.attn_q.weight (H*D, C), attn_k/attn_v (Hkv*D, C),
attn_output (C, H*D), ffn_gate/ffn_up (F, C), ffn_down (C, F), norms (C,).

Attention is one fused op (ops.attention): q, k, v are read in the (B, T, heads, D)
layout the projections give, query heads h = kv*G + g sharing kv head `kv` (grouped
KV heads), and its output is already the (B, T, H*D) input of attn_output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggtrain.core import ops
from ggtrain.core.backend import StoredTensor
from ggtrain.errors import ConfigError


@dataclass(frozen=True)
class LlamaConfig:
    """Hyperparameters (llama.cpp's llama.* keys)."""

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

    def __post_init__(self):
        for name in ("vocab", "dim", "layers", "heads", "kv_heads", "ff", "ctx"):
            if getattr(self, name) < 1:
                raise ConfigError(f"llama: {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ConfigError(f"llama: dim {self.dim} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ConfigError(f"llama: heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_dim % 2 or self.n_rot % 2 or self.n_rot > self.head_dim:
            raise ConfigError(f"llama: rotary dims {self.n_rot} must be even and <= head dim {self.head_dim}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def n_rot(self) -> int:
        return self.rope_dims or self.head_dim


def param_shapes(cfg: LlamaConfig) -> dict:
    """{tensor name: numpy-order shape}, in llama.cpp's order."""
    c, d, f = cfg.dim, cfg.head_dim, cfg.ff
    shapes = {"token_embd.weight": (cfg.vocab, c), "output_norm.weight": (c,)}
    if not cfg.tied:
        shapes["output.weight"] = (cfg.vocab, c)
    for i in range(cfg.layers):
        p = f"blk.{i}."
        shapes.update({
            p + "attn_norm.weight": (c,),
            p + "attn_q.weight": (cfg.heads * d, c),
            p + "attn_k.weight": (cfg.kv_heads * d, c),
            p + "attn_v.weight": (cfg.kv_heads * d, c),
            p + "attn_output.weight": (c, cfg.heads * d),
            p + "ffn_norm.weight": (c,),
            p + "ffn_gate.weight": (f, c),
            p + "ffn_up.weight": (f, c),
            p + "ffn_down.weight": (c, f),
        })
    return shapes


def init_params(cfg: LlamaConfig, seed: int = 0, std: float = 0.02) -> dict:
    """Initialisation for training from scratch: N(0, std^2) for matrices, with the
    projections that write into the residual stream (attn_output, ffn_down) scaled by
    1/sqrt(2 L) as in GPT-2; ones for the RMSNorm weights. {name: float32 array}."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = np.ones(shape, np.float32)
        else:
            s = std / math.sqrt(2 * cfg.layers) if name.endswith(("attn_output.weight", "ffn_down.weight")) else std
            out[name] = rng.normal(0.0, s, shape).astype(np.float32)
    return out


def linear(x, params: dict, name: str, lora: dict | None = None):
    """x @ W.T for the weight `name`, plus its LoRA update when `lora` has one:
    scale * (x @ A.T) @ B.T with lora[name] = (A (r, n_in), B (n_out, r), scale), as
    llama.cpp applies an adapter (scale = user scale * alpha / r). A fourth item
    (p, seed, salt) drops the adapter's input out in training (ops.dropout; PEFT's
    lora_dropout), never the base product's."""
    y = ops.linear(x, params[name])
    if lora and name in lora:
        a, b, scale, *drop = lora[name]
        xa = ops.dropout(x, *drop[0]) if drop and drop[0] is not None else x
        # the scale goes on the rank-r product (r columns, not n_out)
        y = ops.add(y, ops.linear(ops.scale(ops.linear(xa, a), scale), b))
    return y


def _attention(cfg: LlamaConfig, x, p: str, params: dict, pos, lora=None, kv=None, n_kv: int = 0, seg=None,
               keep=None):
    """Self-attention of x (B, T, C), causal; with seg (B, T) i32 (packed samples), query i
    sees key j only when j <= i and seg[., j] == seg[., i] (pos (B, T) then restarts per
    sample). With kv = (k_cache, v_cache), persistent (S, Hkv*D) tensors (B must be 1):
    this step's keys and values are written at rows pos, and the queries attend over cache
    rows 0..n_kv-1, query i seeing rows <= pos[i]. keep: called with the fused attention
    node (Graph.keep under checkpointing)."""
    b, t, c = x.shape
    h, hkv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    q = ops.reshape(linear(x, params, p + "attn_q.weight", lora), (b, t, h, d))
    k = ops.reshape(linear(x, params, p + "attn_k.weight", lora), (b, t, hkv, d))
    v = ops.reshape(linear(x, params, p + "attn_v.weight", lora), (b, t, hkv, d))
    q = ops.rope(q, pos, cfg.n_rot, cfg.rope_base)
    k = ops.rope(k, pos, cfg.n_rot, cfg.rope_base)
    scale = 1.0 / math.sqrt(d)
    if kv is None:
        out = ops.attention(q, k, v, scale, causal=seg is None, seg=seg)                 # (B, T, H, D)
        if keep is not None:
            keep(out.root)
    else:
        if b != 1:
            raise ConfigError(f"llama: a KV cache serves one sequence, got a batch of {b}")
        cache_k = ops.set_rows(kv[0], ops.reshape(k, (t, hkv * d)), pos)              # (S, Hkv*D)
        cache_v = ops.set_rows(kv[1], ops.reshape(v, (t, hkv * d)), pos)
        k = ops.view(cache_k, (1, n_kv, hkv, d))                                        # rows 0..n_kv-1
        v = ops.view(cache_v, (1, n_kv, hkv, d))
        out = ops.attention(q, k, v, scale, pos=pos)
    return linear(ops.reshape(out, (b, t, h * d)), params, p + "attn_output.weight", lora)


def forward(cfg: LlamaConfig, params: dict, tokens, pos, graph=None, checkpoint: bool = False,
            lora: dict | None = None, cache: list | None = None, n_kv: int = 0, last_only: bool = False,
            seg=None, rows=None):
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
    of (B*T) (the ones a loss needs), (M, V).
    """
    b, t = tokens.shape
    if t > cfg.ctx:
        raise ConfigError(f"llama: sequence of {t} tokens exceeds the context {cfg.ctx}")
    eps = cfg.norm_eps
    x = ops.get_rows(params["token_embd.weight"], tokens)                            # (B, T, C)
    for i in range(cfg.layers):
        p = f"blk.{i}."
        h = ops.mul(ops.rms_norm(x, eps), params[p + "attn_norm.weight"])
        kv = cache[i] if cache is not None else None
        keep = graph.keep if checkpoint and graph is not None and not lora else None
        x = ops.add(x, _attention(cfg, h, p, params, pos, lora, kv, n_kv, seg, keep=keep))
        if keep is not None:
            keep(x)
        h = ops.mul(ops.rms_norm(x, eps), params[p + "ffn_norm.weight"])
        gate = linear(h, params, p + "ffn_gate.weight", lora)
        up = linear(h, params, p + "ffn_up.weight", lora)
        x = ops.add(x, linear(ops.swiglu(gate, up), params, p + "ffn_down.weight", lora))
        if checkpoint and graph is not None:
            graph.checkpoint(x)
    if last_only and t > 1:
        c = x.shape[-1]
        x = ops.view(x, (b, 1, c), (t * c, c, 1), (t - 1) * c)                      # (B, 1, C)
    if rows is not None:
        x = ops.get_rows(ops.reshape(x, (b * t, x.shape[-1])), rows)                # (M, C)
    x = ops.mul(ops.rms_norm(x, eps), params["output_norm.weight"])
    head = "token_embd.weight" if cfg.tied else "output.weight"
    return linear(x, params, head, lora)


def loss(logits, targets):
    """Mean cross-entropy of logits (B, T, V) against targets (B, T) i32, or of logits (M, V)
    against targets (M,) (negative targets: ignored)."""
    v = logits.shape[-1]
    n = logits.size // v
    return ops.cross_entropy(ops.reshape(logits, (n, v)), ops.reshape(targets, (n,)))


def _frozen(graph, weights: dict, adapters: dict | None) -> tuple:
    """Graph parameters for fixed weights: {name: Tensor}, the LoRA dict for forward, and
    {Tensor: buffer} of the weights that are already in backend memory (to bind).

    weights: {name: f32 array, or StoredTensor (bytes already in a backend buffer, any
    stored type)}; adapters: {weight name: (A, B, scale)} with f32 arrays.
    """
    params, stored = {}, {}
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
            raise ConfigError(f"llama: an adapter targets {name!r}, which the model does not have")
        lora[name] = (graph.param(a.shape, a, name=name + ".lora_a", trainable=False),
                      graph.param(b.shape, b, name=name + ".lora_b", trainable=False), float(scale))
    return params, lora, stored


class LlamaRunner:
    """Forward-only runs of a llama with fixed weights over whole windows: logits, and
    losses for evaluation. Compiled once for (batch, length); shorter inputs are padded
    (causal attention: padding after a position never changes its logits).

    weights: {name: f32 array or StoredTensor}; adapters: {weight name: (A, B, scale)}.
    """

    def __init__(self, cfg: LlamaConfig, weights: dict, backend, batch: int = 1, length: int | None = None,
                 n_threads: int | None = None, adapters: dict | None = None):
        from ggtrain.core.graph import Graph, Runtime  # same layer 3/4 boundary, no cycle

        self.cfg = cfg
        self.batch, self.length = batch, min(length or cfg.ctx, cfg.ctx)
        g = Graph()
        params, lora, stored = _frozen(g, weights, adapters)
        self.tokens = g.input((batch, self.length), "i32", name="tokens")
        self.targets = g.input((batch, self.length), "i32", name="targets")
        self.pos = g.input((self.length,), "i32", name="pos")
        self.logits_t = forward(cfg, params, self.tokens, self.pos, lora=lora)
        self.loss_t = loss(self.logits_t, self.targets)
        self.runtime = Runtime(g, backend)
        for t, buf in stored.items():
            self.runtime.bind(t, buf)
        self.n_threads = n_threads
        self._plan_logits = None
        self._plan_loss = None
        self.runtime.set(self.pos, np.arange(self.length, dtype=np.int32))

    def _fill(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[0] != self.batch or tokens.shape[1] > self.length:
            raise ConfigError(f"llama runner: tokens {tokens.shape} do not fit ({self.batch}, <= {self.length})")
        _check_ids(tokens, self.cfg.vocab)
        full = np.zeros((self.batch, self.length), np.int32)
        full[:, :tokens.shape[1]] = tokens
        return full

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits (batch, length, V) for tokens (batch, <= length); rows past the input are padding."""
        if self._plan_logits is None:
            self._plan_logits = self.runtime.compile([self.logits_t], self.n_threads)
        self.runtime.set(self.tokens, self._fill(tokens))
        self.runtime.run(self._plan_logits, self.n_threads)
        return self._plan_logits.read(self.logits_t)

    def nll(self, tokens: np.ndarray, targets: np.ndarray) -> float:
        """Summed negative log-likelihood of targets (negative ids ignored) given tokens."""
        if self._plan_loss is None:
            self._plan_loss = self.runtime.compile([self.loss_t], self.n_threads)
        tgt = np.full((self.batch, self.length), -1, np.int32)
        targets = np.asarray(targets, np.int32)
        tgt[:, :targets.shape[1]] = targets
        self.runtime.set(self.tokens, self._fill(tokens))
        self.runtime.set(self.targets, tgt)
        self.runtime.run(self._plan_loss, self.n_threads)
        return float(self._plan_loss.read(self.loss_t)) * int((tgt >= 0).sum())


def _check_ids(tokens: np.ndarray, vocab: int) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ConfigError(f"llama: token id outside 0..{vocab - 1}")


class LlamaDecoder:
    """Incremental (KV-cached) decoding of one sequence: `feed(ids)` appends tokens and
    returns the logits after the last one; each new token costs one token's work.

    The cache holds n_ctx positions (f32 keys and values per layer). Plans are compiled
    on demand per (tokens fed at once, cache rows attended): the rows attended grow in
    powers of two as the sequence does, so attention never reads more than twice the
    rows in use; prompts are fed in chunks of `chunk` tokens.
    """

    MIN_ROWS = 32

    def __init__(self, cfg: LlamaConfig, weights: dict, backend, n_ctx: int | None = None,
                 n_threads: int | None = None, adapters: dict | None = None, chunk: int = 256):
        from ggtrain.core.graph import Graph, Runtime  # same layer 3/4 boundary, no cycle

        self.cfg = cfg
        self.n_ctx = min(n_ctx or cfg.ctx, cfg.ctx)
        if self.n_ctx < 1 or chunk < 1:
            raise ConfigError(f"llama decoder: context {self.n_ctx} and chunk {chunk} must be >= 1")
        self.chunk = chunk
        self.n_threads = n_threads
        self.graph = g = Graph()
        self.params, self.lora, stored = _frozen(g, weights, adapters)
        kv = cfg.kv_heads * cfg.head_dim
        self.cache = [(g.state((self.n_ctx, kv), name=f"cache_k.{i}"),
                       g.state((self.n_ctx, kv), name=f"cache_v.{i}")) for i in range(cfg.layers)]
        self.runtime = Runtime(g, backend)
        for t, buf in stored.items():
            self.runtime.bind(t, buf)
        self._plans: dict = {}
        self.n_past = 0                      # positions in the cache

    def _rows(self, n: int) -> int:
        rows = self.MIN_ROWS
        while rows < n:
            rows *= 2
        return min(rows, self.n_ctx)

    def _plan(self, t: int, rows: int):
        key = (t, rows)
        if key not in self._plans:
            g = self.graph
            tokens = g.input((1, t), "i32", name=f"tokens.{t}")
            pos = g.input((t,), "i32", name=f"pos.{t}")
            logits = forward(self.cfg, self.params, tokens, pos, lora=self.lora, cache=self.cache,
                             n_kv=rows, last_only=True)
            self._plans[key] = (self.runtime.compile([logits], self.n_threads), tokens, pos, logits)
        return self._plans[key]

    def reset(self) -> None:
        """Forget the sequence (the cache rows are overwritten as new tokens come)."""
        self.n_past = 0

    def feed(self, ids) -> np.ndarray:
        """Append token ids (at least one) to the sequence; logits (V,) after the last one.

        Raises ConfigError when the sequence would pass the cache's n_ctx positions.
        """
        ids = np.asarray(ids, np.int32).reshape(-1)
        if ids.size == 0:
            raise ConfigError("llama decoder: nothing to feed")
        if self.n_past + ids.size > self.n_ctx:
            raise ConfigError(f"llama decoder: {self.n_past} + {ids.size} tokens exceed the context "
                              f"of {self.n_ctx}")
        _check_ids(ids, self.cfg.vocab)
        for start in range(0, ids.size, self.chunk):
            part = ids[start:start + self.chunk]
            plan, tokens, pos, logits = self._plan(part.size, self._rows(self.n_past + part.size))
            self.runtime.set(tokens, part[None, :])
            self.runtime.set(pos, np.arange(self.n_past, self.n_past + part.size, dtype=np.int32))
            self.runtime.run(plan, self.n_threads)
            self.n_past += part.size
        return plan.read(logits)[0, -1]


def generate(decoder: LlamaDecoder, prompt: list, n: int, sampler, stop: frozenset = frozenset()):
    """Yield new token ids after `prompt`: up to n (n < 0: until a stop token or the context
    is full), each drawn by `sampler(logits, history)`; a stop token is yielded, then ends."""
    ids = list(prompt)
    if not ids:
        raise ConfigError("generate: the prompt has no tokens")
    decoder.reset()
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
