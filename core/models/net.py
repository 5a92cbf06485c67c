"""What every layer of the decoder graph is built from (layer 4): the Net (a model as the graph
sees it), the Inputs and Options of a forward pass, and the two products every layer takes:
`linear` (a weight's product with its LoRA update and bias, in the net's numerics) and `norm`.
The layers themselves are in mixers.py and ffns.py, the graph that stacks them in decoder.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ggtrain.core import ops
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.numerics import EXACT, LLAMA, check_numerics


@dataclass(frozen=True)
class Net:
    """A model as the graph sees it. params: {tensor name: Tensor} as config.param_shapes
    (weights f32, or frozen in their stored types); lora: {weight name: lora.Adapter} added to
    those weights (see `linear`); numerics: core/numerics.py (EXACT, or LLAMA: llama.cpp's CPU
    numbers, inference only); kv_f16 (LLAMA only): attention rounds as llama.cpp's F16 KV cache
    (its default) does. taps: where given, the products record there {weight name: (the
    tensor it multiplies, None or the expert ids that route its rows)} for every weight of the
    blocks ("blk.*"; `tap`), the activations whose squares llama-imatrix sums
    (core/models/importance.py). aux: where given, the routed-expert layers append there
    their load-balancing loss (ffns.load_balance_loss), a scalar each, for training.
    """

    cfg: ModelConfig
    params: dict
    lora: dict = field(default_factory=dict)
    numerics: str = EXACT
    kv_f16: bool = False
    taps: dict | None = None
    aux: list | None = None

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
    pos restarts per sample), and with seg parent (B, T) i32: the tree mask of attention
    (ops.attention: row i also sees the keys of segment parent[., i] before it, a shared prefix;
    attention layers only); rows (M,) i32: only those flat positions of (B*T) go on past
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
    parent: object = None
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
    """x @ W.T for the weight `name` (a 1-D weight: one row), plus its LoRA update where net.lora has one, plus the
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
    tap(net, name, x)
    w = net.params[name]
    if w.ndim == 1:     # one output (ggml's mul_mat of an {n_embd} weight: qwen35moe's shared-expert gate)
        w = ops.reshape(w, (1, w.shape[0]))
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


def tap(net: Net, name: str, x, ids=None) -> None:
    """Record in net.taps (where it has them) the input x of block weight `name`'s product: a
    matrix's (..., n_in) with ids None, or the experts' (N, 1 or k, n_in) of ops.moe_matmul
    with its ids (N, k)."""
    if net.taps is not None and name.startswith("blk."):
        net.taps[name] = (x, ids)


def _bias(net: Net, y, name: str):
    """y plus the bias of weight `name` where the net has one."""
    bias = net.params.get(name[:-len("weight")] + "bias")
    return y if bias is None else ops.add(y, bias)


def norm(net: Net, x, weight: str):
    """rms_norm of x times the norm weight `weight` (in llama.cpp's numbers where the net's are)."""
    return ops.mul(ops.rms_norm(x, net.cfg.norm_eps, numerics=net.numerics), net.params[weight])
