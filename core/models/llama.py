"""The llama architecture as llama.cpp computes it (layer 4).

token embedding -> L x [RMSNorm -> attention (RoPE mode 0, grouped KV heads, causal,
1/sqrt(D) scale) -> residual -> RMSNorm -> SwiGLU FFN -> residual] -> RMSNorm -> output
projection (or the embedding, tied, when there is no output.weight).

Parameters use llama.cpp's tensor names with numpy-order shapes (ggml's ne reversed):
token_embd.weight (V, C), blk.{i}.attn_q.weight (H*D, C), attn_k/attn_v (Hkv*D, C),
attn_output (C, H*D), ffn_gate/ffn_up (F, C), ffn_down (C, F), norms (C,).

Grouped-query attention without copies: q heads h = kv*G + g share kv head `kv`, so
q (B, H, T, D) reshapes to (B, Hkv, G*T, D) and one batched matmul per kv head
serves its G query heads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggtrain.core import ops
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


def _attention(cfg: LlamaConfig, x, p: str, params: dict, pos):
    b, t, c = x.shape
    h, hkv, d = cfg.heads, cfg.kv_heads, cfg.head_dim
    g = h // hkv
    q = ops.reshape(ops.linear(x, params[p + "attn_q.weight"]), (b, t, h, d))
    k = ops.reshape(ops.linear(x, params[p + "attn_k.weight"]), (b, t, hkv, d))
    v = ops.reshape(ops.linear(x, params[p + "attn_v.weight"]), (b, t, hkv, d))
    q = ops.rope(q, pos, cfg.n_rot, cfg.rope_base)
    k = ops.rope(k, pos, cfg.n_rot, cfg.rope_base)
    q = ops.reshape(ops.cont(ops.permute(q, (0, 2, 1, 3))), (b, hkv, g * t, d))   # (B, Hkv, G*T, D)
    k = ops.permute(k, (0, 2, 3, 1))                                                 # (B, Hkv, D, T) view
    v = ops.cont(ops.permute(v, (0, 2, 1, 3)))                                       # (B, Hkv, T, D)
    scores = ops.reshape(ops.matmul(q, k), (b, h, t, t))
    probs = ops.softmax(scores, 1.0 / math.sqrt(d), causal=True)
    out = ops.matmul(ops.reshape(probs, (b, hkv, g * t, t)), v)                     # (B, Hkv, G*T, D)
    out = ops.permute(ops.reshape(out, (b, h, t, d)), (0, 2, 1, 3))                  # (B, T, H, D) view
    out = ops.reshape(out, (b, t, h * d))                                            # copies (cont)
    return ops.linear(out, params[p + "attn_output.weight"])


def forward(cfg: LlamaConfig, params: dict, tokens, pos, graph=None, checkpoint: bool = False):
    """Logits (B, T, V) for tokens (B, T) i32 at positions pos (T,) i32.

    params: {name: Tensor} as param_shapes. With checkpoint, each block ends a
    segment of `graph` (gradient checkpointing recomputes blocks in backward).
    """
    b, t = tokens.shape
    if t > cfg.ctx:
        raise ConfigError(f"llama: sequence of {t} tokens exceeds the context {cfg.ctx}")
    eps = cfg.norm_eps
    x = ops.get_rows(params["token_embd.weight"], tokens)                            # (B, T, C)
    for i in range(cfg.layers):
        p = f"blk.{i}."
        h = ops.mul(ops.rms_norm(x, eps), params[p + "attn_norm.weight"])
        x = ops.add(x, _attention(cfg, h, p, params, pos))
        h = ops.mul(ops.rms_norm(x, eps), params[p + "ffn_norm.weight"])
        gate = ops.silu(ops.linear(h, params[p + "ffn_gate.weight"]))
        up = ops.linear(h, params[p + "ffn_up.weight"])
        x = ops.add(x, ops.linear(ops.mul(gate, up), params[p + "ffn_down.weight"]))
        if checkpoint and graph is not None:
            graph.checkpoint(x)
    x = ops.mul(ops.rms_norm(x, eps), params["output_norm.weight"])
    head = params["token_embd.weight"] if cfg.tied else params["output.weight"]
    return ops.linear(x, head)


def loss(logits, targets):
    """Mean cross-entropy of logits (B, T, V) against targets (B, T) i32 (negative: ignored)."""
    b, t, v = logits.shape
    return ops.cross_entropy(ops.reshape(logits, (b * t, v)), ops.reshape(targets, (b * t,)))


class LlamaRunner:
    """Forward-only runs of a llama with fixed weights: logits for generation, losses
    for evaluation. Compiled once for (batch, length); shorter inputs are padded
    (causal attention: padding after a position never changes its logits)."""

    def __init__(self, cfg: LlamaConfig, weights: dict, backend, batch: int = 1, length: int | None = None,
                 n_threads: int | None = None):
        from ggtrain.core.graph import Graph, Runtime  # same layer 3/4 boundary, no cycle

        self.cfg = cfg
        self.batch, self.length = batch, min(length or cfg.ctx, cfg.ctx)
        g = Graph()
        params = {k: g.param(v.shape, v, name=k, trainable=False) for k, v in weights.items()}
        self.tokens = g.input((batch, self.length), "i32", name="tokens")
        self.targets = g.input((batch, self.length), "i32", name="targets")
        self.pos = g.input((self.length,), "i32", name="pos")
        self.logits_t = forward(cfg, params, self.tokens, self.pos)
        self.loss_t = loss(self.logits_t, self.targets)
        self.runtime = Runtime(g, backend)
        self.n_threads = n_threads
        self._plan_logits = self.runtime.compile([self.logits_t], n_threads)
        self._plan_loss = None
        self.runtime.set(self.pos, np.arange(self.length, dtype=np.int32))

    def _fill(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32)
        if tokens.ndim != 2 or tokens.shape[0] != self.batch or tokens.shape[1] > self.length:
            raise ConfigError(f"llama runner: tokens {tokens.shape} do not fit ({self.batch}, <= {self.length})")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab):
            raise ConfigError(f"llama runner: token id outside 0..{self.cfg.vocab - 1}")
        full = np.zeros((self.batch, self.length), np.int32)
        full[:, :tokens.shape[1]] = tokens
        return full

    def logits(self, tokens: np.ndarray) -> np.ndarray:
        """Logits (batch, length, V) for tokens (batch, <= length); rows past the input are padding."""
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


def sample(logits: np.ndarray, temp: float, top_k: int, rng: np.random.Generator) -> int:
    """The next token from logits (V,): greedy (argmax) when temp is 0, else softmax
    sampling at temperature temp over the top_k largest (0: all)."""
    if temp <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temp
    if 0 < top_k < z.size:
        cut = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= cut, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    return int(rng.choice(z.size, p=p))


def generate(runner: LlamaRunner, prompt: list, n: int, temp: float = 0.0, top_k: int = 0, seed: int = 0,
             eos: int | None = None):
    """Yield up to n new token ids after `prompt` (stops after eos or at the context)."""
    rng = np.random.default_rng(seed)
    ids = list(prompt)
    if not ids:
        raise ConfigError("generate: the prompt has no tokens")
    for _ in range(n):
        if len(ids) >= runner.length:
            return
        logits = runner.logits(np.array([ids], np.int32))[0, len(ids) - 1]
        nxt = sample(logits, temp, top_k, rng)
        ids.append(nxt)
        yield nxt
        if eos is not None and nxt == eos:
            return
