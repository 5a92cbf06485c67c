"""A decoder's description (layer 4): ModelConfig (the {arch}.* keys of a GGUF file), the
family it belongs to, its parameters' names and shapes, and their initialisation for training
from scratch.

Parameters use llama.cpp's tensor names with numpy-order shapes (ggml's ne reversed):
token_embd.weight (V, C), blk.{i}.attn_q.weight (H*D, C), attn_k/attn_v (Hkv*D, C),
attn_output (C, H*D), ffn_gate/ffn_up (F, C), ffn_down (C, F), norms (C,); D is the head
size (attention.key_length; C / H when absent). What a family has is its Family
(core/models/family.py, core/models/families/).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ggtrain.core.models.families import FAMILIES, NAMES
from ggtrain.core.models.family import (BLOCK_SHAPES, OUTPUT, ROPE_CONSTANTS, ROPE_FACTORS_LONG,
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
    logit_scale. kv_heads: one count for every layer, or a tuple of one per layer (a file's
    array; 0 where a layer has no attention, LFM2's short-convolution layers); at(name, i)
    reads a per-layer field's value at layer i. shortconv_l: the taps of LFM2's short
    convolution (shortconv.l_cache; 0: the family's default where it has one).
    Qwen3.5's gated DeltaNet (ssm.*): ssm_conv the taps of its convolution, ssm_state the
    size of a K and V head, ssm_groups the K heads, ssm_heads the V heads (time_step_rank),
    ssm_inner = ssm_heads * ssm_state; attn_interval: every n-th layer attends (the rest are
    DeltaNet layers); rope_sections: the multi-section rope's four section sizes (in rotated
    pairs), which text positions turn as NEOX when they cover every pair.
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
    shortconv_l: int = 0
    ssm_conv: int = 0
    ssm_state: int = 0
    ssm_groups: int = 0
    ssm_heads: int = 0
    ssm_inner: int = 0
    attn_interval: int = 0
    rope_sections: tuple = ()

    def __post_init__(self):
        fam = family(self.arch)
        for f in dataclasses.fields(self):     # arrays as tuples (a config read back from JSON has lists)
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        for name in ("vocab", "dim", "layers", "heads", "ff", "ctx"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{self.arch}: {name} must be >= 1, got {getattr(self, name)}")
        self._per_layer(fam)
        if not self.head_dim:
            if self.dim % self.heads:
                raise ConfigError(f"{self.arch}: dim {self.dim} is not a multiple of heads {self.heads}")
            object.__setattr__(self, "head_dim", self.dim // self.heads)
        if self.head_dim < 1:
            raise ConfigError(f"{self.arch}: head_dim must be >= 1, got {self.head_dim}")
        if not self.rope_dims:
            object.__setattr__(self, "rope_dims", self.head_dim)
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
        if self.rope_long and not fam.long_rope:
            raise ConfigError(f"{self.arch}: the family has no long-context rope factors")
        if not (self.embedding_scale >= 0 and self.residual_scale >= 0 and self.attn_scale >= 0
                and self.logit_scale > 0):
            raise ConfigError(f"{self.arch}: embedding_scale {self.embedding_scale}, residual_scale "
                              f"{self.residual_scale}, attn_scale {self.attn_scale} must be >= 0, logit_scale "
                              f"{self.logit_scale} > 0")
        # a field some family reads keeps its neutral value in a family that does not
        own = fam.all_keys
        for name in FAMILY_FIELDS:
            neutral = fam.window_pattern if name == "window_pattern" else _NEUTRAL[name]
            if name not in own and getattr(self, name) != neutral:
                raise ConfigError(f"{self.arch}: the family has no {name} (it reads "
                                  f"{', '.join(k.field for k in fam.keys) or 'only the common keys'})")
        self._recurrent(fam)
        if self.rope_orig_ctx < 0 or not self.rope_attn_factor > 0:
            raise ConfigError(f"{self.arch}: rope_orig_ctx {self.rope_orig_ctx} must be >= 0, "
                              f"rope_attn_factor {self.rope_attn_factor} > 0")

    def _per_layer(self, fam: Family) -> None:
        """Per-layer fields as tuples of `layers` ints (one int where every layer agrees, so
        equal models have equal configs); every attention layer's KV heads divide the heads,
        and a layer without attention has none."""
        for key in fam.all_keys.values():
            value = getattr(self, key.field)
            if not key.per_layer or not isinstance(value, (tuple, list)):
                continue
            if len(value) != self.layers:
                raise ConfigError(f"{self.arch}: {key.field} ({self.arch}.{key.key}) gives {len(value)} values "
                                  f"for {self.layers} layers")
            value = tuple(int(v) for v in value)
            object.__setattr__(self, key.field, value[0] if len(set(value)) == 1 else value)
        taps = fam.all_keys.get("shortconv_l")
        if taps is not None:
            if self.shortconv_l == 0:
                object.__setattr__(self, "shortconv_l", taps.unset)
            if self.shortconv_l < 2:    # llama.cpp keeps l_cache - 1 >= 1 columns of state
                raise ConfigError(f"{self.arch}: {taps.key} must be >= 2, got {self.shortconv_l}")
        for i in range(self.layers):
            kv, attention = self.at("kv_heads", i), fam.layer_kinds(self, i)[0] == "attention"
            if attention and kv < 1:
                raise ConfigError(f"{self.arch}: kv_heads must be >= 1 in an attention layer, got {kv} (layer {i})")
            if attention and self.heads % kv:
                raise ConfigError(f"{self.arch}: heads {self.heads} is not a multiple of kv_heads {kv} (layer {i})")
            if not attention and kv and isinstance(self.kv_heads, tuple):
                raise ConfigError(f"{self.arch}: layer {i} has no attention but {kv} KV heads")

    def _recurrent(self, fam: Family) -> None:
        """The gated DeltaNet's sizes agree (inner = V heads x head size, V heads a multiple
        of K heads); the rope sections rotate text as NEOX (IMROPE gives pair j the position of
        section j % 3 while j < 3 x its size: every pair must be in one of the first three)."""
        if "ssm_state" in fam.all_keys:
            if self.attn_interval == 0:      # a file without full_attention_interval: llama.cpp's 4
                object.__setattr__(self, "attn_interval", fam.all_keys["attn_interval"].unset)
            if min(self.ssm_conv, self.ssm_state, self.ssm_groups, self.ssm_heads, self.attn_interval) < 1:
                raise ConfigError(f"{self.arch}: ssm conv_kernel {self.ssm_conv}, state_size {self.ssm_state}, "
                                  f"group_count {self.ssm_groups}, time_step_rank {self.ssm_heads} and "
                                  f"full_attention_interval {self.attn_interval} must be >= 1")
            if self.attn_interval > self.layers:     # llama.cpp's KV cache needs an attention layer
                raise ConfigError(f"{self.arch}: full_attention_interval {self.attn_interval} leaves none of the "
                                  f"{self.layers} layers attending (llama.cpp needs one)")
            if self.ssm_inner != self.ssm_heads * self.ssm_state or self.ssm_heads % self.ssm_groups:
                raise ConfigError(f"{self.arch}: ssm.inner_size {self.ssm_inner} must be time_step_rank "
                                  f"{self.ssm_heads} x state_size {self.ssm_state}, and time_step_rank a multiple "
                                  f"of group_count {self.ssm_groups}")
        if "rope_sections" in fam.all_keys:
            sec = tuple(int(v) for v in self.rope_sections)
            object.__setattr__(self, "rope_sections", sec)
            covered = len(sec) == 4 and all(v >= 0 for v in sec) and all(
                j < 3 * sec[j % 3] for j in range(self.n_rot // 2))
            if not covered:
                raise ConfigError(f"{self.arch}: rope.dimension_sections {list(sec)} must be 4 sizes whose first "
                                  f"three cover the {self.n_rot // 2} rotated pairs (text positions; ggtrain "
                                  f"rotates them as NEOX)")

    @property
    def ssm_channels(self) -> int:
        """The DeltaNet convolution's channels: q and k (K heads) and v (V heads)."""
        return (2 * self.ssm_groups + self.ssm_heads) * self.ssm_state

    def at(self, name: str, layer: int):
        """A per-layer field's value at `layer` (the field itself where it is one value)."""
        value = getattr(self, name)
        return value[layer] if isinstance(value, tuple) else value

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


# the fields one family or another reads from its own keys, and their neutral values (the
# defaults: what a file without the key means)
FAMILY_FIELDS = tuple(dict.fromkeys(k.field for fam in FAMILIES.values() for k in fam.keys))
_NEUTRAL = {f.name: f.default for f in dataclasses.fields(ModelConfig)}


def param_shapes(cfg: ModelConfig) -> dict:
    """{tensor name: numpy-order shape}, in llama.cpp's order."""
    shapes = {TOKEN_EMBD: (cfg.vocab, cfg.dim), cfg.family.output_norm: (cfg.dim,)}
    if not cfg.tied:
        shapes[OUTPUT] = (cfg.vocab, cfg.dim)
    if cfg.rope_freqs:
        shapes[ROPE_FREQS] = (cfg.n_rot // 2,)
    if cfg.rope_long:
        shapes[ROPE_FACTORS_LONG] = shapes[ROPE_FACTORS_SHORT] = (cfg.n_rot // 2,)
    for i in range(cfg.layers):
        for name in cfg.family.block_of(cfg, i):
            shapes[f"blk.{i}.{STORED_AS.get(name, name)}"] = BLOCK_SHAPES[name](cfg, i)
    return shapes


def trainable(name: str) -> bool:
    """Whether training changes a parameter: all but the rope frequency factors (constants
    of the position encoding, not weights)."""
    return name not in ROPE_CONSTANTS


# the projections that write into the residual stream
_RESIDUAL_WRITERS = ("attn_output.weight", "ffn_down.weight", "shortconv.out_proj.weight", "ssm_out.weight")
# tensors that start at a constant (ssm_a: -exp(A_log) at A_log = 0, a decay of e^-softplus)
_CONSTANT_INIT = {"ssm_a": -1.0}


def init_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict:
    """Initialisation for training from scratch: N(0, std^2) for matrices, with the
    projections that write into the residual stream (attn_output, ffn_down, out_proj) scaled by
    1/sqrt(2 L) as in GPT-2; ones for the RMSNorm weights (and rope factors), zeros for
    biases. {name: float32 array}."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.rsplit(".", 1)[-1] in _CONSTANT_INIT:
            out[name] = np.full(shape, _CONSTANT_INIT[name.rsplit(".", 1)[-1]], np.float32)
        elif name.endswith("norm.weight") or name in ROPE_CONSTANTS:
            out[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        else:
            s = std / math.sqrt(2 * cfg.layers) if name.endswith(_RESIDUAL_WRITERS) else std
            out[name] = rng.normal(0.0, s, shape).astype(np.float32)
    return out
