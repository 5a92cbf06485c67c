"""Running a model with fixed weights (layer 4): frozen weights in a graph, the window Runner
(logits and losses for evaluation), the KV-cached Decoder and generate().

Weights come as {name: f32 array, or StoredTensor (bytes already in a backend buffer, any
stored type)}; adapters as {weight name: (A, B, scale)} with f32 arrays (or f16 ones, kept f16
in llama numerics: formats.lora.read_lora). numerics (core/numerics.py) is EXACT or LLAMA
(llama.cpp's CPU numbers; llama_numerics_available says where), and kv_f16 with LLAMA those of
its default F16 KV cache.
"""
from __future__ import annotations

import numpy as np

from ggtrain.core import ops
from ggtrain.core.backend import StoredTensor
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.decoder import MIXER_CACHE, RECURRENT, Inputs, Net, Options, forward, output
from ggtrain.core.models.lora import Adapter
from ggtrain.core.models.losses import chunk_weights, chunked_loss, fused_loss_available, loss_chunks
from ggtrain.core.numerics import EXACT, LLAMA, check_numerics
from ggtrain.errors import ConfigError


def lora_fused(backend, w) -> bool:
    """Whether `backend` sums an adapter's product onto the frozen weight w's in one op
    (ops.matmul_lora's kernel for w's type; never for stacked experts)."""
    return w.ndim == 2 and backend.supports(ops.OPS["matmul_lora"].kernel_name_for(w))


def llama_numerics_available(backend) -> bool:
    """Whether `backend` has llama.cpp's CPU numbers (every variant of every op that exists
    for them, OpDef.numerics LLAMA: the CPU does; CUDA computes exact f32)."""
    kernels = [f"{op.kernel}_{d}" for op in ops.OPS.values() if op.numerics == LLAMA for d in op.dtypes]
    return bool(ops.ACT8_TYPES) and all(backend.supports(k) for k in kernels)


def frozen_params(graph, weights: dict) -> tuple:
    """Graph parameters for fixed weights: ({name: Tensor}, {Tensor: buffer} of the weights
    that are already in backend memory, to bind)."""
    params, stored = {}, {}
    for name, w in weights.items():
        if isinstance(w, StoredTensor):
            t = graph.param(w.shape, name=name, trainable=False, dtype=w.dtype)
            stored[t] = w.buffer
        else:
            t = graph.param(w.shape, w, name=name, trainable=False)
        params[name] = t
    return params, stored


def frozen_net(cfg: ModelConfig, graph, weights: dict, adapters: dict | None, numerics: str = EXACT,
               kv_f16: bool = False) -> tuple:
    """(Net of fixed weights and adapters, {Tensor: buffer} to bind). An adapter stored in f16
    stays f16 in llama numerics (which multiply it so); else f32."""
    check_numerics(numerics)
    params, stored = frozen_params(graph, weights)
    lora = {}
    for name, (a, b, scale) in (adapters or {}).items():
        if name not in params:
            raise ConfigError(f"an adapter targets {name!r}, which the model does not have")
        fa, fb = (graph.param(f.shape, f, name=name + suffix, trainable=False,
                              dtype="f16" if numerics == LLAMA and f.dtype == np.float16 else "f32")
                  for f, suffix in ((a, ".lora_a"), (b, ".lora_b")))
        lora[name] = Adapter(fa, fb, float(scale))
    return Net(cfg, params, lora, numerics, numerics == LLAMA and kv_f16), stored


def _check_ids(tokens: np.ndarray, vocab: int) -> None:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        raise ConfigError(f"token id outside 0..{vocab - 1}")


class Runner:
    """Forward-only runs of a model with fixed weights over whole windows: logits, and
    losses for evaluation. Compiled once for (batch, length); shorter inputs are padded
    (causal attention: padding after a position never changes its logits).

    n_ctx: the run's context when it is not `length` (a user's --ctx, of which a short text
    fills less): it picks phi3's long or short rope factors. numerics, kv_f16: see the module.
    """

    def __init__(self, cfg: ModelConfig, weights: dict, backend, batch: int = 1, length: int | None = None,
                 adapters: dict | None = None, n_ctx: int = 0, numerics: str = EXACT, kv_f16: bool = False):
        self.cfg = cfg
        self.batch, self.length = batch, min(length or cfg.ctx, cfg.ctx)
        g = Graph()
        net, stored = frozen_net(cfg, g, weights, adapters, numerics, kv_f16)
        self.tokens = g.input((batch, self.length), "i32", name="tokens")
        self.targets = g.input((batch, self.length), "i32", name="targets")
        self.pos = g.input((self.length,), "i32", name="pos")
        hidden = forward(net, Inputs(self.tokens, self.pos), Options(head=False, n_ctx=n_ctx or self.length))
        self.logits_t = output(net, hidden)
        # the loss never holds the window's logits whole: none at all where one
        # linear_cross_entropy can take it (exact numbers, the output matrix without an
        # adapter), else a chunk of rows at a time (chunked_loss)
        fused = fused_loss_available(net, backend)
        self.chunks = g.input((1 if fused else loss_chunks(cfg, batch * self.length),), name="chunk_weights")
        self.loss_t = chunked_loss(net, hidden, self.targets, self.chunks, fused=fused)
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


class Decoder:
    """Incremental (KV-cached) decoding of one sequence: `feed(ids)` appends tokens and
    returns the logits after the last one; each new token costs one token's work.

    The cache holds n_ctx positions (f32 keys and values per attention layer; a recurrent
    layer's state instead: mixers.MIXER_CACHE). Plans are compiled
    on demand, one per count of tokens fed at once, each attending over the whole cache:
    the attention kernels read only the rows each query sees (its position and those
    before), so one plan serves a token at any position (plans per power-of-two span of
    rows were compiled anew as the sequence grew, about 30 ms each, which was a fifth of the
    time of 48 tokens of SmolLM2). Prompts are fed in chunks of `chunk` tokens (llama.cpp's
    default ubatch of 512: in llama numerics a product's row count picks llama.cpp's kernel,
    hence its float order, so a prompt is cut where llama.cpp cuts it). numerics, kv_f16: see
    the module.
    """

    def __init__(self, cfg: ModelConfig, weights: dict, backend, n_ctx: int | None = None,
                 adapters: dict | None = None, chunk: int = 512, numerics: str = EXACT, kv_f16: bool = False):
        self.cfg = cfg
        self.n_ctx = min(n_ctx or cfg.ctx, cfg.ctx)
        if self.n_ctx < 1 or chunk < 1:
            raise ConfigError(f"decoder: context {self.n_ctx} and chunk {chunk} must be >= 1")
        self.chunk = chunk
        self.graph = g = Graph()
        self.net, stored = frozen_net(cfg, g, weights, adapters, numerics, kv_f16)
        # per layer its mixer's cache (mixers.MIXER_CACHE): keys and values, or a state
        kinds = [cfg.family.layer_kinds(cfg, i)[0] for i in range(cfg.layers)]
        self.cache = [tuple(g.state(shape, name=f"cache.{i}.{j}")
                            for j, shape in enumerate(MIXER_CACHE[kind](cfg, i, self.n_ctx)))
                      for i, kind in enumerate(kinds)]
        self.states = [t for kind, c in zip(kinds, self.cache) if kind in RECURRENT for t in c]
        self.runtime = Runtime(g, backend)
        for t, buf in stored.items():
            self.runtime.bind(t, buf)
        self._plans: dict = {}
        self.n_past = 0                      # positions in the cache
        self._ids: list = []                 # the tokens fed (a recurrent state rewinds by feeding again)
        self.reset()

    def _plan(self, t: int, every: bool = False):
        key = (t, every)
        if key not in self._plans:
            g = self.graph
            tokens = g.input((1, t), "i32", name=f"tokens.{t}")
            pos = g.input((t,), "i32", name=f"pos.{t}")
            writes: list = []
            logits = forward(self.net, Inputs(tokens, pos, cache=self.cache, n_kv=self.n_ctx, writes=writes),
                             Options(last_only=not every, n_ctx=self.n_ctx))
            self._plans[key] = (self.runtime.compile([logits] + writes), tokens, pos, logits)
        return self._plans[key]

    def prepare(self) -> None:
        """Compile the plan of one token now (generation's every step after the prompt), so the
        first generated token does not wait for it."""
        self._plan(1)

    def reset(self) -> None:
        """Forget the sequence (the cache rows are overwritten as new tokens come; recurrent
        states start again from zeros)."""
        self.n_past = 0
        self._ids = []
        for t in self.states:
            self.runtime.set(t, np.zeros(t.shape, np.float32))

    def rewind(self, n: int) -> None:
        """Keep the first n positions of the sequence (a shared prefix), forget the rest. A
        recurrent state holds no earlier positions: with one, the first n tokens are fed again."""
        if not 0 <= n <= self.n_past:
            raise ConfigError(f"decoder: cannot rewind to {n} of {self.n_past} positions")
        if self.states and n < self.n_past:
            ids = self._ids[:n]
            self.reset()
            if ids:
                self.feed(ids)
            return
        self.n_past = n
        del self._ids[n:]

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
            self._ids.extend(part.tolist())
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
