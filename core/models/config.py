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
from ggtrain.core.models.family import (BLOCK_SHAPES, EXPERT_GATINGS, OUTPUT, PER_LAYER_MODEL_PROJ,
                                        PER_LAYER_PROJ_NORM, PER_LAYER_TOKEN_EMBD, ROPE_CONSTANTS, ROPE_FACTORS_LONG,
                                        ROPE_FACTORS_SHORT, ROPE_FREQS, SELECTION_BIAS, STORED_AS, TOKEN_EMBD, Family)
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
    dims. rope_yarn: rope_scale is YaRN's factor (rope.scaling.type "yarn", gpt-oss) over
    rope_orig_ctx original positions (0: ctx), not a linear scaling. granite's multipliers, as llama.cpp reads them: embedding_scale multiplies the
    embedding, residual_scale what each attention and FFN adds to the residual (0: neither
    is scaled), attn_scale scales q.k (0: the family's scale), logits are divided by
    logit_scale. kv_heads: one count for every layer, or a tuple of one per layer (a file's
    array; 0 where a layer has no attention, LFM2's short-convolution layers); at(name, i)
    reads a per-layer field's value at layer i. shortconv_l: the taps of LFM2's short
    convolution (shortconv.l_cache; 0: the family's default where it has one).
    Gemma 4's: head_dim_swa and rope_dims_swa, the head size and rotated dims of the local
    layers (0: those of the global ones); swa_layers, one flag a layer (a file's array: local
    or global), where the layers are not every-n-th global (() : by window_pattern); shared_kv:
    the last shared_kv layers compute no K and V but attend over those of the last earlier
    layer of their kind (kv_source); v_from_k: per layer (or for all), the layer has no attn_v
    and its values are its keys' projection (the tensors say it, as `tied`); per_layer_dim:
    the width of the per-layer embeddings of Gemma 4's E-models (0: none). ff may be per layer.
    experts, experts_used: the routed experts of each block's FFN and how many each token takes
    (expert_count, expert_used_count); expert_ff: an expert's hidden size
    (expert_feed_forward_length; 0: ff / experts_used, as llama.cpp reads a file without it);
    shexp_ff: the shared expert's hidden size (expert_shared_feed_forward_length; 0: ff, as
    llama.cpp reads a file without it). dense_lead: the first dense_lead layers have a dense FFN,
    the rest routed experts (leading_dense_block_count); expert_gating: the router's gating
    function (expert_gating_func: family.EXPERT_GATINGS; 0: the family fixes it, Family.gating).
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
    rope_yarn: bool = False
    embedding_scale: float = 0.0
    residual_scale: float = 0.0
    attn_scale: float = 0.0
    logit_scale: float = 1.0
    shortconv_l: int = 0
    head_dim_swa: int = 0
    rope_dims_swa: int = 0
    swa_layers: object = ()
    shared_kv: int = 0
    v_from_k: object = False
    per_layer_dim: int = 0
    experts: int = 0
    experts_used: int = 0
    expert_ff: int = 0
    shexp_ff: int = 0
    dense_lead: int = 0
    expert_gating: int = 0
    ssm_conv: int = 0
    ssm_state: int = 0
    ssm_groups: int = 0
    ssm_heads: int = 0
    ssm_inner: int = 0
    attn_interval: int = 0
    rope_sections: tuple = ()

    def __post_init__(self):
        fam = family(self.arch)
        for f in dataclasses.fields(self):     # lists (a config read back from JSON) as tuples
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        for name in ("vocab", "dim", "layers", "heads", "ff", "ctx"):
            value = getattr(self, name)
            if (min(value) if isinstance(value, (tuple, list)) else value) < 1:
                raise ConfigError(f"{self.arch}: {name} must be >= 1, got {value}")
        self._per_layer(fam)
        if not self.head_dim:
            if self.dim % self.heads:
                raise ConfigError(f"{self.arch}: dim {self.dim} is not a multiple of heads {self.heads}")
            object.__setattr__(self, "head_dim", self.dim // self.heads)
        if self.head_dim < 1:
            raise ConfigError(f"{self.arch}: head_dim must be >= 1, got {self.head_dim}")
        if not self.rope_dims:
            object.__setattr__(self, "rope_dims", self.head_dim)
        if self.tied and not fam.may_tie:
            raise ConfigError(f"{self.arch}: llama.cpp's {self.arch} needs output.weight (its output is never the "
                              f"token embedding)")
        if fam.qk_norm_full and (self.kv_heads != self.heads or self.heads * self.head_dim != self.dim):
            raise ConfigError(f"{self.arch}: llama.cpp's q/k norms span n_embd, so kv_heads ({self.kv_heads}) must "
                              f"equal heads ({self.heads}) and heads x head_dim ({self.head_dim}) the dim ({self.dim})")
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
        if self.rope_yarn and not fam.yarn:
            raise ConfigError(f"{self.arch}: the family has no YaRN rope scaling")
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
        self._local_heads(fam)

    def _local_heads(self, fam: Family) -> None:
        """The local layers' head size and rotated dims, the layers whose K and V are another's
        (shared_kv) and those whose V is their K's projection (v_from_k), checked."""
        own = fam.all_keys
        for name, value in (("head_dim_swa", self.head_dim), ("rope_dims_swa", self.n_rot)):
            if name in own and not getattr(self, name):     # stated always: the global layers' value
                object.__setattr__(self, name, value)
        d, rot = self.head_dim_swa or self.head_dim, self.rope_dims_swa or self.n_rot
        if d % 2 or rot % 2 or rot > d:
            raise ConfigError(f"{self.arch}: rotary dims {rot} of the local layers must be even and <= their "
                              f"head dim {d}")
        for i in range(self.layers - self.shared_kv, self.layers):
            if not any(self.local(j) == self.local(i) for j in range(self.layers - self.shared_kv)):
                raise ConfigError(f"{self.arch}: layer {i} shares the keys and values of an earlier "
                                  f"{'local' if self.local(i) else 'global'} layer, and there is none "
                                  f"(shared_kv {self.shared_kv} of {self.layers} layers)")
        v = self.v_from_k
        if isinstance(v, (tuple, list)):
            if len(v) != self.layers:
                raise ConfigError(f"{self.arch}: v_from_k gives {len(v)} flags for {self.layers} layers")
            v = tuple(bool(x) for x in v)
            object.__setattr__(self, "v_from_k", v[0] if len(set(v)) == 1 else v)
        if self.v_from_k and not fam.v_from_k:
            raise ConfigError(f"{self.arch}: the family's layers all have attn_v (no v_from_k)")

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
        if self.head_dim_swa < 0 or self.rope_dims_swa < 0 or self.per_layer_dim < 0 \
                or not 0 <= self.shared_kv <= self.layers:
            raise ConfigError(f"{self.arch}: head_dim_swa {self.head_dim_swa}, rope_dims_swa {self.rope_dims_swa} "
                              f"per_layer_dim {self.per_layer_dim} must be >= 0, shared_kv {self.shared_kv} within "
                              f"0..{self.layers}")
        if "experts" in fam.all_keys and (self.experts or fam.all_keys["experts"].unset):   # gemma4: 0 dense
            self._experts(fam)
        for i in range(self.layers):
            kv, attention = self.at("kv_heads", i), fam.layer_kinds(self, i)[0] == "attention"
            if attention and kv < 1:
                raise ConfigError(f"{self.arch}: kv_heads must be >= 1 in an attention layer, got {kv} (layer {i})")
            if attention and self.heads % kv:
                raise ConfigError(f"{self.arch}: heads {self.heads} is not a multiple of kv_heads {kv} (layer {i})")
            if not attention and kv and isinstance(self.kv_heads, tuple):
                raise ConfigError(f"{self.arch}: layer {i} has no attention but {kv} KV heads")

    def head(self, layer: int) -> int:
        """The head size of `layer` (a local layer's may differ: head_dim_swa)."""
        return self.head_dim_swa if self.head_dim_swa and self.local(layer) else self.head_dim

    def rot(self, layer: int) -> int:
        """The rotated dims of `layer` (a local layer's may differ: rope_dims_swa)."""
        return self.rope_dims_swa if self.rope_dims_swa and self.local(layer) else self.n_rot

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends over: itself, or for the last
        shared_kv layers the last layer before them of its kind (llama.cpp's reuse: the local
        one before the last, the global one last)."""
        first = self.layers - self.shared_kv
        if layer < first:
            return layer
        return next(j for j in range(first - 1, -1, -1) if self.local(j) == self.local(layer))

    def _experts(self, fam: Family) -> None:
        """1 <= experts_used <= experts (naming the keys; 0: the family's default, a model built
        from scratch), expert_ff and shexp_ff resolved."""
        keys = fam.all_keys
        for name in ("experts", "experts_used"):
            if getattr(self, name) == 0:
                object.__setattr__(self, name, keys[name].unset)
        n, used = f"{self.arch}.{keys['experts'].key}", f"{self.arch}.{keys['experts_used'].key}"
        if self.experts < 1 or self.experts_used < 1:
            raise ConfigError(f"{self.arch}: {n} = {self.experts} and {used} = {self.experts_used} must be >= 1")
        if self.experts_used > self.experts:
            raise ConfigError(f"{self.arch}: {used} = {self.experts_used} exceeds {n} = {self.experts}")
        if "expert_gating" in keys and self.expert_gating not in EXPERT_GATINGS:
            raise ConfigError(f"{self.arch}: {self.arch}.{keys['expert_gating'].key} = {self.expert_gating}: a gating "
                              f"ggtrain does not compute (it computes "
                              f"{', '.join(f'{k} {v}' for k, v in EXPERT_GATINGS.items())})")
        if not 0 <= self.dense_lead <= self.layers:
            raise ConfigError(f"{self.arch}: {self.arch}.leading_dense_block_count = {self.dense_lead} must be "
                              f"within 0..{self.layers} (block_count)")
        if "shexp_ff" in keys and not self.shexp_ff:      # the shared expert: feed_forward_length wide
            object.__setattr__(self, "shexp_ff", self.at("ff", 0))
        if "expert_ff" not in keys:     # the experts are feed_forward_length wide
            return
        if not self.expert_ff:
            object.__setattr__(self, "expert_ff", self.at("ff", 0) // self.experts_used)
        if self.expert_ff < 1:
            raise ConfigError(f"{self.arch}: {self.arch}.{keys['expert_ff'].key} must be >= 1, got {self.expert_ff}")

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
    def gating(self) -> str:
        """The router's gating function, by the moe ops' name (core/ops/moe.py GATINGS)."""
        return EXPERT_GATINGS.get(self.expert_gating, self.family.gating)

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
        swa_layers' flag, or every window_pattern-th layer is global)."""
        if self.swa_layers != ():
            return self.window > 0 and bool(self.at("swa_layers", layer))
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
    if cfg.per_layer_dim:
        lp = cfg.layers * cfg.per_layer_dim
        shapes.update({PER_LAYER_TOKEN_EMBD: (cfg.vocab, lp), PER_LAYER_MODEL_PROJ: (lp, cfg.dim),
                       PER_LAYER_PROJ_NORM: (cfg.per_layer_dim,)})
    for i in range(cfg.layers):
        for name in cfg.family.block_of(cfg, i):
            shapes[f"blk.{i}.{STORED_AS.get(name, name)}"] = BLOCK_SHAPES[name](cfg, i)
    return shapes


def trainable(name: str) -> bool:
    """Whether training changes a parameter: all but the rope frequency factors (constants
    of the position encoding, not weights) and the experts' selection biases (load-balancing
    buffers, which no gradient reaches)."""
    return name not in ROPE_CONSTANTS and not name.endswith(SELECTION_BIAS)


# the projections that write into the residual stream
_RESIDUAL_WRITERS = ("attn_output.weight", "ffn_down.weight", "shortconv.out_proj.weight", "ffn_down_exps.weight",
                     "ssm_out.weight")
# tensors that start at a constant (ssm_a: -exp(A_log) at A_log = 0, a decay of e^-softplus)
_CONSTANT_INIT = {"ssm_a": -1.0}


def init_params(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict:
    """Initialisation for training from scratch: N(0, std^2) for matrices, with the
    projections that write into the residual stream (attn_output, ffn_down, out_proj, the
    experts' down) scaled by 1/sqrt(2 L) as in GPT-2; ones for the RMSNorm weights (and rope
    factors, and gemma4's block output scales), zeros for
    biases. {name: float32 array}."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        if name.rsplit(".", 1)[-1] in _CONSTANT_INIT:
            out[name] = np.full(shape, _CONSTANT_INIT[name.rsplit(".", 1)[-1]], np.float32)
        elif name.endswith(("norm.weight", "layer_output_scale.weight", ".scale")) or name in ROPE_CONSTANTS:
            out[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            out[name] = np.zeros(shape, np.float32)
        else:
            s = std / math.sqrt(2 * cfg.layers) if name.endswith(_RESIDUAL_WRITERS) else std
            out[name] = rng.normal(0.0, s, shape).astype(np.float32)
    return out
