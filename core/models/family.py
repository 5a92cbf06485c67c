"""What a model family is (layer 4): the GGUF keys and tensors of an architecture and the
options of the one decoder graph (core/models/decoder.py) that computes it.

A family is one small module in core/models/families/ holding `FAMILY = Family(...)`: the
architecture name llama.cpp writes in general.architecture, the tensors of a block (by
their llama.cpp names, shapes from the one table below), the keys it reads besides the
common ones, and its graph options. formats/ validates, reads and writes files from the
same description, the decoder builds the graph from it, and LoRA takes its targets from it;
adding a family is adding such a module (and its test rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggtrain.core.ops.moe import GATINGS


@dataclass(frozen=True)
class Key:
    """One "{arch}." key: the ModelConfig field it sets, the GGUF type llama.cpp reads it as
    ("u32" a count, "f32" a float, "bool" a flag: written as one a layer where per_layer), and the field's value where a file does not state it, so
    a writer states it only where it differs (None: stated always; a required key is stated
    always, and unset is then the value a model built from scratch gets). required: a file
    must state it. per_layer: a file may give one value per layer, an array (llama.cpp's
    get_key_or_arr); the field then holds a tuple (ModelConfig.at reads layer i's value).
    array: the key is an array of values that are not per layer (a tuple; ModelConfig checks
    its length)."""

    field: str
    key: str
    type: str = "u32"
    unset: object = None
    required: bool = False
    per_layer: bool = False
    array: bool = False

    def __post_init__(self):
        if self.type not in ("u32", "f32", "bool"):
            raise ValueError(f"key {self.key}: type {self.type!r} (u32, f32 or bool)")


# the keys every family's files hold, in the order they are written (the head size is stated
# where it is not n_embd / n_head, with attention.value_length equal to it: formats/model.py)
COMMON_KEYS = (
    Key("vocab", "vocab_size"),
    Key("ctx", "context_length", required=True),
    Key("dim", "embedding_length", required=True),
    Key("ff", "feed_forward_length", required=True, per_layer=True),
    Key("layers", "block_count", required=True),
    Key("heads", "attention.head_count", required=True),
    Key("kv_heads", "attention.head_count_kv", per_layer=True),
    Key("rope_dims", "rope.dimension_count"),
    Key("head_dim", "attention.key_length"),
    Key("norm_eps", "attention.layer_norm_rms_epsilon", "f32", required=True),
    Key("rope_base", "rope.freq_base", "f32"),
)

# block tensor (blk.{i}.<name>) -> numpy-order shape from a ModelConfig c and the layer i (for
# the per-layer keys: ModelConfig.at; the layer's head size: ModelConfig.head). The one table of shapes: every family lists the names
# it has.
BLOCK_SHAPES = {
    "attn_norm.weight": lambda c, i: (c.dim,),
    "attn_q.weight": lambda c, i: (c.heads * c.head(i), c.dim),
    "attn_k.weight": lambda c, i: (c.at("kv_heads", i) * c.head(i), c.dim),
    "attn_v.weight": lambda c, i: (c.at("kv_heads", i) * c.head(i), c.dim),
    "attn_q.bias": lambda c, i: (c.heads * c.head(i),),
    "attn_k.bias": lambda c, i: (c.at("kv_heads", i) * c.head(i),),
    "attn_v.bias": lambda c, i: (c.at("kv_heads", i) * c.head(i),),
    "attn_q_norm.weight": lambda c, i: (c.head(i),),
    "attn_k_norm.weight": lambda c, i: (c.head(i),),
    # q/k norms over all heads at once (olmoe), stored as attn_q_norm / attn_k_norm
    "attn_q_norm_full.weight": lambda c, i: (c.heads * c.head(i),),
    "attn_k_norm_full.weight": lambda c, i: (c.at("kv_heads", i) * c.head(i),),
    "attn_qkv.weight": lambda c, i: ((c.heads + 2 * c.at("kv_heads", i)) * c.head(i), c.dim),   # q | k | v rows
    "attn_output.weight": lambda c, i: (c.dim, c.heads * c.head(i)),
    "attn_output.bias": lambda c, i: (c.dim,),
    # gpt-oss's attention sinks: one learned logit a head in each softmax's denominator
    "attn_sinks.weight": lambda c, i: (c.heads,),
    "post_attention_norm.weight": lambda c, i: (c.dim,),
    "ffn_norm.weight": lambda c, i: (c.dim,),
    "ffn_gate.weight": lambda c, i: (c.at("ff", i), c.dim),
    "ffn_down.weight": lambda c, i: (c.dim, c.at("ff", i)),
    "ffn_up.weight": lambda c, i: (c.at("ff", i), c.dim),
    "ffn_gate_up.weight": lambda c, i: (2 * c.at("ff", i), c.dim),      # gate | up rows, stored as ffn_up
    "post_ffw_norm.weight": lambda c, i: (c.dim,),
    "layer_output_scale.weight": lambda c, i: (1,),            # gemma4: the block's output times it
    # gemma4's per-layer embeddings (E-models): the block's gate to P, back to C, its norm
    "inp_gate.weight": lambda c, i: (c.per_layer_dim, c.dim),
    "proj.weight": lambda c, i: (c.dim, c.per_layer_dim),
    "post_norm.weight": lambda c, i: (c.dim,),
    # LFM2's short convolution: in_proj to B | C | x rows, the depthwise kernel of each channel
    # (ggml's {l_cache, n_embd}), out_proj
    "shortconv.in_proj.weight": lambda c, i: (3 * c.dim, c.dim),
    "shortconv.conv.weight": lambda c, i: (c.dim, c.shortconv_l),
    "shortconv.out_proj.weight": lambda c, i: (c.dim, c.dim),
    # routed experts (qwen3moe, olmoe): the router (one logit an expert) and each expert's
    # gate, up and down matrices stacked, ggml's {n_embd, n_ff_exp, n_expert} and
    # {n_ff_exp, n_embd, n_expert}; n_ff_exp is expert_feed_forward_length where the family
    # reads it, else feed_forward_length (olmoe)
    "ffn_gate_inp.weight": lambda c, i: (c.experts, c.dim),
    "ffn_gate_exps.weight": lambda c, i: (c.experts, c.expert_ff or c.at("ff", i), c.dim),
    "ffn_up_exps.weight": lambda c, i: (c.experts, c.expert_ff or c.at("ff", i), c.dim),
    "ffn_down_exps.weight": lambda c, i: (c.experts, c.dim, c.expert_ff or c.at("ff", i)),
    # the shared expert beside the routed ones (qwen35moe): its gate (one logit a token, ggml's
    # {n_embd}) and its SwiGLU FFN, expert_shared_feed_forward_length wide
    "ffn_gate_inp_shexp.weight": lambda c, i: (c.dim,),
    # the experts' selection bias (lfm2moe: llama.cpp's exp_probs_b), added to the router's
    # scores for the top-k only
    "exp_probs_b.bias": lambda c, i: (c.experts,),
    "ffn_gate_shexp.weight": lambda c, i: (c.shexp_ff, c.dim),
    "ffn_up_shexp.weight": lambda c, i: (c.shexp_ff, c.dim),
    "ffn_down_shexp.weight": lambda c, i: (c.dim, c.shexp_ff),
    # gpt-oss's biases of the router and of each expert's gate, up and down (ggml's {n_ff_exp,
    # n_expert}, {n_embd, n_expert}: a row an expert)
    "ffn_gate_inp.bias": lambda c, i: (c.experts,),
    "ffn_gate_exps.bias": lambda c, i: (c.experts, c.expert_ff or c.at("ff", i)),
    "ffn_up_exps.bias": lambda c, i: (c.experts, c.expert_ff or c.at("ff", i)),
    "ffn_down_exps.bias": lambda c, i: (c.experts, c.dim),
    # gemma4's experts: their gate and up stacked in one matrix, each expert's output scale, the router input's scale, the norms of its
    # dense FFN's output (post_ffw_norm_1), of the experts' input and output (pre/post_ffw_norm_2)
    "ffn_down_exps.scale": lambda c, i: (c.experts,),
    "ffn_gate_up_exps.weight": lambda c, i: (c.experts, 2 * c.expert_ff, c.dim),     # gate | up rows
    "ffn_gate_inp.scale": lambda c, i: (c.dim,),
    "pre_ffw_norm_2.weight": lambda c, i: (c.dim,),
    "post_ffw_norm_1.weight": lambda c, i: (c.dim,),
    "post_ffw_norm_2.weight": lambda c, i: (c.dim,),
    # Qwen3.5's gated attention: q | gate rows per head (2D rows a head), stored as attn_q
    "attn_q_gate.weight": lambda c, i: (2 * c.heads * c.head(i), c.dim),
    # Qwen3.5's gated DeltaNet: q | k | v rows (K heads of ssm_state for q and k, V heads for
    # v) into the causal convolution (ggml's {conv_kernel, channels}), the output gate z, beta
    # and alpha (one a V head), the decay's bias and -exp(A_log), the gated norm, out
    "ssm_qkv.weight": lambda c, i: (c.ssm_channels, c.dim),
    "attn_gate.weight": lambda c, i: (c.ssm_heads * c.ssm_state, c.dim),
    "ssm_conv1d.weight": lambda c, i: (c.ssm_channels, c.ssm_conv),
    "ssm_dt.bias": lambda c, i: (c.ssm_heads,),
    "ssm_a": lambda c, i: (c.ssm_heads,),
    "ssm_beta.weight": lambda c, i: (c.ssm_heads, c.dim),
    "ssm_alpha.weight": lambda c, i: (c.ssm_heads, c.dim),
    "ssm_norm.weight": lambda c, i: (c.ssm_state,),
    "ssm_out.weight": lambda c, i: (c.dim, c.ssm_heads * c.ssm_state),
}
# block tensors stored under another name than their table entry
STORED_AS = {"ffn_gate_up.weight": "ffn_up.weight", "attn_q_norm_full.weight": "attn_q_norm.weight",
             "attn_k_norm_full.weight": "attn_k_norm.weight", "attn_q_gate.weight": "attn_q.weight",
             "ssm_qkv.weight": "attn_qkv.weight"}

# the llama block: the base every family here starts from. The order is the one tensors are
# written and initialised in (init_params draws them in it, so a seed gives the same model as
# before families existed); llama.cpp finds tensors by name, in any order.
LLAMA_BLOCK = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
               "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
LLAMA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

TOKEN_EMBD, OUTPUT_NORM, OUTPUT = "token_embd.weight", "output_norm.weight", "output.weight"
ROPE_FREQS = "rope_freqs.weight"   # llama 3: factors dividing the rotation frequencies, (rope_dims / 2,)
# phi3 (longrope): the factors for runs of a context beyond the original one, and for the rest
ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
ROPE_CONSTANTS = (ROPE_FREQS, ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)   # position-encoding constants

# rope scaling types (the {arch}.rope.scaling.type key) the decoder applies
ROPE_SCALING = ("none", "linear")
# the FFN gate: SwiGLU, GeGLU with gelu's tanh approximation, or gpt-oss's clamped SwiGLU
# (ops.swiglu_oai, llama.cpp's alpha 1.702 and limit 7)
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
# the router's gating functions a file may name (the {arch}.expert_gating_func key: llama.cpp's
# LLAMA_EXPERT_GATING_FUNC_TYPE values) and the moe ops' names for them
EXPERT_GATINGS = {1: "softmax", 2: "sigmoid"}
# the experts' selection bias: a load-balancing buffer (set outside gradient descent), never trained
SELECTION_BIAS = "exp_probs_b.bias"


def recip_sqrt_f32(n: int) -> float:
    """1 / sqrt(n) as llama.cpp's graphs compute attention scales, 1.0f / sqrtf((float)n): in
    f32, where the once-rounded value differs by an ulp for some sizes (24, 96: Phi-3's)."""
    return float(np.float32(1.0) / np.sqrt(np.float32(n)))


def head_scale(cfg) -> float:
    """1 / sqrt(head size) (in f32, recip_sqrt_f32): the attention scale of most families."""
    return recip_sqrt_f32(cfg.head_dim)


# the block tensors of per-layer embeddings (gemma4's E-models: ModelConfig.per_layer_dim)
PER_LAYER_BLOCK = ("inp_gate.weight", "proj.weight", "post_norm.weight")
# the model's tensors of them: the embedding (V, L*P), the projection of the scaled token
# embedding to every layer's (L*P, C) and its norm (P,)
PER_LAYER_TOKEN_EMBD, PER_LAYER_MODEL_PROJ, PER_LAYER_PROJ_NORM = (
    "per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight")
# what a layer that attends over another layer's keys and values lacks
_KV_TENSORS = ("attn_k.weight", "attn_v.weight", "attn_k.bias", "attn_v.bias", "attn_k_norm.weight")


@dataclass(frozen=True)
class Family:
    """One architecture: its GGUF name, block tensors and graph options.

    arch: general.architecture. block: the block's tensor names (BLOCK_SHAPES keys) in the
    order files hold them. rope_mode: "norm" (adjacent pairs) or "neox" (halves).
    rope_freqs: files may carry rope_freqs.weight. long_rope: files may carry
    rope_factors_long/short (and the rope scaling "longrope"). lora_targets: the block weights an
    adapter may target (their names without ".weight"). keys: the Keys read besides
    COMMON_KEYS (ModelConfig's fields of one family are set only from them). ignored_keys: keys after "{arch}." that files
    carry and that change nothing this decoder computes (each with its reason in the
    family's module); any other "{arch}." key is refused, not silently dropped.
    no_rope_every: n > 0, layers n-1, 2n-1, ... attend without rope (smollm3's NoPE layers).
    act: the FFN gate's activation (ACTIVATIONS). embed_scale: the embedding is multiplied
    by sqrt(n_embd). attention_scale: cfg -> the scale of q.k; scale_q: llama.cpp's graph
    multiplies q by it (after rope) rather than q.k (the same value, rounded elsewhere: llama
    numerics follow it).
    Post-attention / post-FFN norms and q/k norms are there when the block has their tensors.
    yarn: files may state the rope scaling "yarn" (ModelConfig.rope_yarn; gpt-oss).
    swa_rope_global: the local (sliding-window) layers rotate as the global ones, with the
    same base and scaling (gpt-oss: llama.cpp sets its SWA base and scale to the trained ones).
    Attention sinks (a logit a head in the softmax's denominator) where the block has
    attn_sinks.
    rope_switch: the family reads
    rope.scaling.finetuned = false as "no rope" (granite), which ggtrain refuses.
    mixer, ffn: the layers every block builds, by their names in mixers.MIXERS and ffns.FFNS
    ("attention", "shortconv"; "glu"); layers: (cfg, layer) -> (mixer, ffn) where the kind
    varies from layer to layer (None: every layer is (mixer, ffn)). layer_kinds(cfg, i)
    answers for both. kind_tensors: {mixer or FFN: the block tensors only its layers have} where
    layers differ (block lists them all; block_of(cfg, i) gives layer i's).
    output_norm: the final norm's tensor (LFM2 names it token_embd_norm). ffn_norm: the norm
    before the FFN (Qwen3.5 stores it as post_attention_norm).
    moe_norm: the "moe" FFN divides its k gate weights by their sum (llama.cpp's norm_w, which
    each family's graph fixes: qwen3moe true, olmoe false). gating: the router's gating
    function (the moe ops' GATINGS) where the file names none (expert_gating_func): softmax,
    or gpt-oss's softmax_weight (the softmax of the k chosen logits, llama.cpp's SOFTMAX_WEIGHT,
    which its graph fixes).
    may_tie: a file may leave out output.weight, the output then the token embedding (llama.cpp
    requires it of olmoe).
    scratch: (sizes) -> the ModelConfig fields a model built from scratch takes beyond the
    common ones and its required keys' unset values, from the sizes given (a dict: layers, dim,
    heads, kv_heads, head_dim, ctx): lfm2's per-layer KV heads, by which it mixes its layers;
    gemma4's local layers and window; qwen35's DeltaNet sizes. None: nothing more.
    v_from_k: a layer may lack attn_v, its values then the keys' projection (before the k
    norm and rope; ModelConfig.v_from_k says which). v_norm: the values are RMS-normed per
    head, unweighted. global_rope_freqs: rope_freqs' factors rotate the global layers only
    (Gemma 4's proportional rope), the local ones rotate plainly. Layers that share an
    earlier layer's keys and values (ModelConfig.shared_kv) have no K/V tensors.
    """

    arch: str
    block: tuple = LLAMA_BLOCK
    rope_mode: str = "norm"
    rope_freqs: bool = False
    long_rope: bool = False
    lora_targets: tuple = LLAMA_TARGETS
    keys: tuple = ()
    ignored_keys: tuple = ()
    act: str = "silu"
    embed_scale: bool = False
    attention_scale: Callable = head_scale
    scale_q: bool = False
    no_rope_every: int = 0
    rope_switch: bool = False
    mixer: str = "attention"
    ffn: str = "glu"
    layers: Callable | None = None
    kind_tensors: dict = field(default_factory=dict)
    output_norm: str = OUTPUT_NORM
    scratch: Callable | None = None
    v_from_k: bool = False
    v_norm: bool = False
    global_rope_freqs: bool = False
    moe_norm: bool = False
    gating: str = "softmax"
    may_tie: bool = True
    ffn_norm: str = "ffn_norm.weight"
    yarn: bool = False
    swa_rope_global: bool = False

    def __post_init__(self):
        unknown = [n for n in self.block if n not in BLOCK_SHAPES]
        if unknown:
            raise ValueError(f"family {self.arch}: no shape for block tensor {unknown[0]!r}")
        stored = [STORED_AS.get(n, n) for n in self.block]
        bad = [t for t in self.lora_targets if t + ".weight" not in stored]
        if bad:
            raise ValueError(f"family {self.arch}: LoRA target {bad[0]!r} is not a block weight")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"family {self.arch}: act {self.act!r} (one of {', '.join(ACTIVATIONS)})")
        if self.rope_mode not in ("norm", "neox"):
            raise ValueError(f"family {self.arch}: rope_mode {self.rope_mode!r} (norm or neox)")
        if self.gating not in GATINGS:
            raise ValueError(f"family {self.arch}: gating {self.gating!r} (one of {', '.join(GATINGS)})")
        own = [n for names in self.kind_tensors.values() for n in names if n not in self.block]
        if own:
            raise ValueError(f"family {self.arch}: mixer tensor {own[0]!r} is not in its block")

    def layer_kinds(self, cfg, layer: int) -> tuple:
        """(mixer, ffn) of block `layer` of a model of this family (config cfg)."""
        return self.layers(cfg, layer) if self.layers is not None else (self.mixer, self.ffn)

    @property
    def expert_targets(self) -> tuple:
        """The routed experts' stacked weights (*_exps) an adapter may target besides
        lora_targets, only where named (--lora-targets): per expert A and B stacked (E, r,
        n_in), (E, n_out, r), applied over each expert's routed tokens (llama.cpp's
        build_lora_mm_id)."""
        return tuple(n[:-len(".weight")] for n in self.block if n.endswith("_exps.weight"))

    def block_of(self, cfg, layer: int) -> tuple:
        """The tensor names (BLOCK_SHAPES keys) of block `layer`, in the block's order: all but
        those of the kinds (mixers, FFNs) the layer does not build."""
        kinds = self.layer_kinds(cfg, layer)
        others = {n for m, names in self.kind_tensors.items() if m not in kinds for n in names}
        if not cfg.per_layer_dim:
            others |= set(PER_LAYER_BLOCK)
        if cfg.kv_source(layer) != layer:
            others |= set(_KV_TENSORS)
        elif cfg.at("v_from_k", layer):
            others.add("attn_v.weight")
        return tuple(n for n in self.block if n not in others)

    @property
    def qkv_bias(self) -> bool:
        return "attn_q.bias" in self.block

    @property
    def qk_norm(self) -> bool:
        return "attn_q_norm.weight" in self.block

    @property
    def qk_norm_full(self) -> bool:
        """q and k normed over all their heads at once (before the heads are split), not head
        by head."""
        return "attn_q_norm_full.weight" in self.block

    @property
    def fused_qkv(self) -> bool:
        """q, k and v from one product (attn_qkv: q | k | v rows)."""
        return "attn_qkv.weight" in self.block

    @property
    def fused_gate_up(self) -> bool:
        """The FFN's gate and up from one product (stored as ffn_up: gate | up rows)."""
        return "ffn_gate_up.weight" in self.block

    @property
    def post_norms(self) -> bool:
        """Norms after the mixer and after the FFN (gemma3's post_attention_norm, post_ffw_norm)."""
        return "post_ffw_norm.weight" in self.block

    @property
    def sinks(self) -> bool:
        """Each head's softmax has a learned sink logit in its denominator (attn_sinks)."""
        return "attn_sinks.weight" in self.block

    @property
    def q_gate(self) -> bool:
        """attn_q gives q | gate per head and sigmoid(gate) scales the attention's output."""
        return "attn_q_gate.weight" in self.block

    @property
    def all_keys(self) -> dict:
        """{config field: Key} of every key this family reads (the common ones first)."""
        return {k.field: k for k in COMMON_KEYS + self.keys}

    @property
    def window_pattern(self) -> int:
        """With a sliding window, every n-th layer is global: the family's n where a file
        does not say (llama.cpp's default for it), 0 for a family without windows."""
        key = self.all_keys.get("window_pattern")
        return key.unset if key is not None else 0
