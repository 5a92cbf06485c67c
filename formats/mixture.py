"""Output types of models as llama.cpp's quantizer names them (layer 5): each `--out-type` is a
mixture, a llama.cpp file type (general.file_type) whose tensors each get a ggml type by
llama.cpp's rules (llama_tensor_get_type in src/llama-quant.cpp):

- tensors llama.cpp never quantizes (1-D ones, norms, ...) keep the type they come in;
- under a quantized mixture, the output projection (the token embedding when it is tied) is
  Q6_K, or Q8_0 where its rows are not whole blocks of the mixture's base type;
- the mixture's rules give some block matrices more bits (Q4_K_M: attn_v and ffn_down of the
  first and last eighths of the layers and every third one between, Q6_K; ...);
- a matrix whose rows are not whole blocks of its type falls back to a type of 32-element
  blocks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K and Q3_K -> Q4_0), and to F16 where
  rows are not whole 32-element blocks either;
- MXFP4_MOE (gpt-oss's release type) is its own rule: the stacked experts (3-D matrices) MXFP4,
  every other matrix, the output projection included, Q8_0;
- with an importance matrix (formats.imatrix) a few rules change (Q4_0 and Q5_0 give the first
  eighth of ffn_down Q4_1 and Q5_1), and some mixtures need one: Q2_K_S's Q2_K matrices
  (llama.cpp's tensor_requires_imatrix; never the output or token embedding).

MIXTURES is the one table: --out-type's choices and help, general.file_type and the interop
tests read it; a new mixture is a row.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import LlamaFileType as FT

from ggtrain.core.models.family import OUTPUT, TOKEN_EMBD
from ggtrain.errors import FormatError
from ggtrain.native.dtypes import dtype


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of n, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# a rule's condition, of (i, n, cfg): i the tensor's index among the model's tensors of its
# kind (its layer where every layer has one), n their count (ffn_down: the layer count), cfg
# the model's ModelConfig
WHEN = {
    "always": lambda i, n, m: True,
    "gqa>=4": lambda i, n, m: _n_gqa(m) >= 4,
    "first 2": lambda i, n, m: i < 2,
    "first 4": lambda i, n, m: i < 4,
    "first 16th": lambda i, n, m: i < n // 16,
    "first 8th": lambda i, n, m: i < n // 8,
    "more bits": lambda i, n, m: _more_bits(i, n),
}


@dataclass(frozen=True)
class Rule:
    """Tensors of `kind` ("attn_v", "ffn_down", "attn_output") for which `when` (a WHEN key)
    holds are written as `type`; a kind's first matching rule wins. with_imatrix: the rule holds
    only when the model is quantized with an importance matrix."""

    kind: str
    when: str
    type: str
    with_imatrix: bool = False


@dataclass(frozen=True)
class Mixture:
    """One --out-type: llama.cpp's file type `file_type`, the ggml type `base` of its matrices
    and the rules that give some of them another type; needs_imatrix: the types whose matrices
    llama.cpp quantizes only with an importance matrix in this mixture; dense: where set, base
    is the stacked experts' type only, and every other matrix (the output's too) is dense."""

    name: str
    file_type: FT
    base: str
    rules: tuple = ()
    needs_imatrix: tuple = ()
    dense: str = ""

    @property
    def quantized(self) -> bool:
        """llama.cpp applies its per-tensor rules and fallbacks to block base types only."""
        return dtype(self.base).is_block


_ATTN_V_FFN_DOWN_Q6_K = (Rule("attn_v", "more bits", "q6_k"), Rule("ffn_down", "more bits", "q6_k"))

MIXTURES = {m.name: m for m in (
    Mixture("f32", FT.ALL_F32, "f32"),
    Mixture("f16", FT.MOSTLY_F16, "f16"),
    Mixture("bf16", FT.MOSTLY_BF16, "bf16"),
    Mixture("q8_0", FT.MOSTLY_Q8_0, "q8_0"),
    Mixture("q4_0", FT.MOSTLY_Q4_0, "q4_0", (Rule("ffn_down", "first 8th", "q4_1", with_imatrix=True),)),
    Mixture("q4_1", FT.MOSTLY_Q4_1, "q4_1"),
    Mixture("q5_0", FT.MOSTLY_Q5_0, "q5_0", (Rule("ffn_down", "first 8th", "q5_1", with_imatrix=True),)),
    Mixture("q5_1", FT.MOSTLY_Q5_1, "q5_1"),
    Mixture("q2_k", FT.MOSTLY_Q2_K, "q2_k", (Rule("attn_v", "gqa>=4", "q4_k"), Rule("attn_v", "always", "q3_k"),
                                            Rule("ffn_down", "always", "q3_k"), Rule("attn_output", "always", "q3_k"))),
    Mixture("q2_k_s", FT.MOSTLY_Q2_K_S, "q2_k", (Rule("attn_v", "gqa>=4", "q4_k"), Rule("ffn_down", "first 8th", "q4_k")),
            needs_imatrix=("q2_k",)),
    Mixture("q3_k_s", FT.MOSTLY_Q3_K_S, "q3_k"),
    Mixture("q3_k_m", FT.MOSTLY_Q3_K_M, "q3_k", (Rule("attn_v", "first 2", "q5_k"), Rule("attn_v", "always", "q4_k"),
                                                Rule("ffn_down", "first 16th", "q5_k"),
                                                Rule("ffn_down", "always", "q4_k"),
                                                Rule("attn_output", "always", "q4_k"))),
    Mixture("q3_k_l", FT.MOSTLY_Q3_K_L, "q3_k", (Rule("attn_v", "always", "q5_k"), Rule("ffn_down", "always", "q5_k"),
                                                Rule("attn_output", "always", "q5_k"))),
    Mixture("q4_k_s", FT.MOSTLY_Q4_K_S, "q4_k", (Rule("attn_v", "first 4", "q5_k"),
                                                Rule("ffn_down", "first 8th", "q5_k"))),
    Mixture("q4_k_m", FT.MOSTLY_Q4_K_M, "q4_k", _ATTN_V_FFN_DOWN_Q6_K),
    Mixture("q5_k_s", FT.MOSTLY_Q5_K_S, "q5_k"),
    Mixture("q5_k_m", FT.MOSTLY_Q5_K_M, "q5_k", _ATTN_V_FFN_DOWN_Q6_K),
    Mixture("q6_k", FT.MOSTLY_Q6_K, "q6_k"),
    Mixture("mxfp4_moe", FT.MOSTLY_MXFP4_MOE, "mxfp4", dense="q8_0"),
)}
OUT_TYPES = tuple(MIXTURES)     # --out-type's choices, in the table's order

# where rows are not whole blocks of a 256-element type: llama.cpp's type of 32-element blocks
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
# name fragments of 2-D tensors llama.cpp never quantizes (tensor_allows_quantization)
_NEVER = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d", "shortconv.conv.weight", "position_embd.weight",
          "token_types.weight", "attn_rel_b.weight", "per_layer_model_proj")


def mixture(name: str, what: str = "--out-type") -> Mixture:
    """The Mixture called `name` (any case); FormatError naming the ones ggtrain writes."""
    m = MIXTURES.get(str(name).lower())
    if m is None:
        raise FormatError(f"{what} {name}: not a type ggtrain writes (it writes {', '.join(OUT_TYPES)})")
    return m


def quantizable(name: str, shape: tuple) -> bool:
    """Whether llama.cpp's quantizer gives this tensor the mixture's types (else it keeps its own)."""
    return len(shape) >= 2 and name.endswith("weight") and not any(s in name for s in _NEVER)


def kind(name: str) -> str | None:
    """The kind the rules name a tensor by (llama.cpp's tensor_get_category), or None."""
    if name == OUTPUT:
        return "output"
    if name in (TOKEN_EMBD, "per_layer_token_embd.weight"):   # gemma4's per-layer table is one too
        return "token_embd"
    for k, frag in (("attn_v", "attn_qkv.weight"), ("attn_v", "attn_v.weight"), ("attn_k", "attn_k.weight"),
                    ("attn_output", "attn_output.weight"),
                    ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if frag in name:
            return k
    return None


def fallback(t: str, ncols: int) -> str:
    """t, or where rows of ncols are not whole blocks of t llama.cpp's fallback type (F16 when
    that does not fit either)."""
    if ncols % dtype(t).block == 0:
        return t
    t = FALLBACK.get(t, t)
    return t if ncols % dtype(t).block == 0 else "f16"


def _n_gqa(cfg) -> int:
    """llama.cpp's hparams.n_gqa(): layer 0's heads per KV head (0 where it has no attention)."""
    kv = cfg.at("kv_heads", 0)
    return cfg.heads // kv if kv else 0


def _is_70b(cfg) -> bool:
    """llama.cpp's LLM_TYPE_70B (80 layers of qwen2, or of llama with grouped KV heads), whose
    attn_v it gives Q5_K instead of Q3_K or Q4_K."""
    return cfg.layers == 80 and (cfg.arch == "qwen2" or (cfg.arch == "llama" and _n_gqa(cfg) != 1))


def _layer(name: str) -> int:
    if name.startswith("blk."):
        head = name[4:].split(".", 1)[0]
        if head.isdigit():
            return int(head)
    return -1


def needs_imatrix(mix: Mixture, name: str, t: str) -> bool:
    """Whether llama.cpp quantizes tensor `name` as type t (its type in mix) only with an
    importance matrix (tensor_requires_imatrix)."""
    return t in mix.needs_imatrix and name not in (OUTPUT, TOKEN_EMBD)


def llama_order(names) -> list:
    """names in the order llama.cpp's quantizer walks and writes them: by layer (the tensors of
    no layer first), by name within one (its weight map's order)."""
    return sorted(names, key=lambda n: (_layer(n), n))


# the mixtures whose attn_output llama.cpp writes as Q5_K in a model of exactly 8 experts (its
# attn_v and attn_k then Q8_0, in every mixture)
_EXPERTS8_ATTN_OUTPUT_Q5_K = ("q2_k", "q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m")


def tensor_types(mix: Mixture, tensors: dict, cfg, imatrix: bool = False) -> dict:
    """{name: ggml type name} of a model written as `mix`. tensors: {name: (numpy-order shape,
    the type it comes in)}, the whole model (the rules count tensors of a kind across it);
    cfg: its ModelConfig (arch, layers, heads, kv_heads); imatrix: whether it is quantized
    with an importance matrix (some rules hold only then)."""
    order = llama_order(tensors)
    counts = {"attn_v": sum(kind(n) == "attn_v" for n in order), "ffn_down": cfg.layers}
    seen = {"attn_v": 0, "ffn_down": 0}
    tied = OUTPUT not in tensors
    experts8 = getattr(cfg, "experts", 0) == 8
    out = {}
    for name in order:
        shape, stored = tensors[name]
        if not quantizable(name, shape):
            out[name] = stored
            continue
        t = mix.base
        if not mix.quantized:
            out[name] = t
            continue
        k = kind(name)
        ncols = int(shape[-1])
        if mix.dense:
            t = t if len(shape) == 3 and shape[0] > 1 else mix.dense
        elif k == "output" or (tied and k == "token_embd"):
            t = "q8_0" if ncols % dtype(t).block or t == "q8_0" else "q6_k"
        elif k == "attn_output" and experts8:     # llama.cpp's rule for 8-expert models (Mixtral)
            t = "q5_k" if mix.name in _EXPERTS8_ATTN_OUTPUT_Q5_K else t
        elif k == "attn_k" and experts8:
            t = "q8_0"
        elif k in ("attn_v", "ffn_down", "attn_output"):
            i, n = seen.get(k, 0), counts.get(k, 0)
            if k == "ffn_down" and getattr(cfg, "experts", 0) > 1:    # llama.cpp reads the layer from the name
                i, n = int(name.split(".")[1]), cfg.layers
            t = next((r.type for r in mix.rules if r.kind == k and (imatrix or not r.with_imatrix)
                      and WHEN[r.when](i, n, cfg)), t)
            if k == "attn_v" and _is_70b(cfg) and t in ("q3_k", "q4_k"):
                t = "q5_k"
            if k == "attn_v" and experts8:
                t = "q8_0"
            if k in seen:
                seen[k] += 1
        out[name] = fallback(t, ncols)
    return {name: out[name] for name in tensors}
