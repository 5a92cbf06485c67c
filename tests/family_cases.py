"""The model families' test cases, one table (tests), and the numpy oracle's facts of each.

CASES: a row per case, named: what sets the family apart, at the two sizes the suite runs a
family at. `tiny` (over TINY) is for the graph against the float64 oracle (tests/np_decoder.py,
tests/test_decoder.py): windows shorter than its 5-7 token texts; `interop` (over BASE) is for
llama.cpp on a file (tests/test_families.py): windows shorter than its ~150-token text. None:
the case is not run at that size. test_every_family_has_test_cases (tests/test_decoder.py)
fails when a registered family lacks a case at either size or an oracle row, as the op table
fails for an op without a case.

ORACLE: what the float64 oracle needs to know of each family, written from llama.cpp's graphs
(its src/models/*.cpp), independently of core/models/families/: NEOX rope (halves rather than
adjacent pairs), the embedding scaled by sqrt(n_embd), post-attention and post-FFN norms, the
GeGLU gate, q.k scaled by n_embd / n_head at 62 layers (Gemma 3 27B), layers without rope every
n-th (smollm3), the final norm's tensor where it is not output_norm (lfm2), the routed experts'
gate weights renormalised (qwen3moe, qwen35moe, lfm2moe), q and k normed over all heads at once (olmoe). What the
tensors say (biases, q/k norms, fused qkv, tied output, rope factors) and the config's
multipliers and windows the oracle reads from them.
"""
from __future__ import annotations

from dataclasses import dataclass

TINY = dict(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ff=48, ctx=16)
BASE = dict(dim=64, layers=2, heads=4, kv_heads=2, ff=96, ctx=256)


@dataclass(frozen=True)
class Case:
    tiny: dict | None        # ModelConfig overrides of TINY (None: not run there)
    interop: dict | None     # of BASE (the vocabulary is the tokenizer's)


CASES = {
    # llama 3's rope factors, a head size that is not dim / heads, a large base; linear scaling
    "llama3": Case(dict(arch="llama", rope_freqs=True, head_dim=12, rope_base=500000.0, rope_scale=2.0),
                   dict(arch="llama", rope_freqs=True, head_dim=24, rope_base=500000.0)),
    "llama-linear": Case(None, dict(arch="llama", rope_scale=4.0, kv_heads=1)),
    # qwen2's biases (tied output); qwen3's q/k norms (one kv head; a larger head)
    "qwen2": Case(dict(arch="qwen2", tied=True), dict(arch="qwen2", tied=True)),
    "qwen3": Case(dict(arch="qwen3", head_dim=12, kv_heads=1), dict(arch="qwen3", head_dim=32)),
    # gemma3: local layers 0, 2 (the window shorter than the text), global 1 (pattern 2),
    # soft-capped logits
    "gemma3": Case(dict(arch="gemma3", head_dim=12, kv_heads=1, tied=True, window=3, window_pattern=2,
                        rope_base_swa=100.0, logit_softcap=3.0, layers=3),
                   dict(arch="gemma3", head_dim=32, kv_heads=1, tied=True, layers=3, window=8, window_pattern=2,
                        rope_base=1e6, rope_base_swa=10000.0, logit_softcap=30.0)),
    # phi3: fused qkv and gate|up, partial rotation (Phi-4-mini rotates 3/4 of each head)
    "phi3": Case(dict(arch="phi3", kv_heads=2, rope_dims=4), dict(arch="phi3", rope_dims=12, kv_heads=1)),
    # phi3's longrope: the long factors (a run past the original context) with partial
    # rotation, and past it by llama.cpp's context (256) and ours; the attention factor
    "phi3-longrope-partial": Case(dict(arch="phi3", kv_heads=2, rope_dims=4, rope_long=True, rope_orig_ctx=4,
                                       rope_attn_factor=1.2), None),
    "phi3-longrope": Case(dict(arch="phi3", kv_heads=2, rope_long=True, rope_orig_ctx=64, rope_attn_factor=1.2),
                          dict(arch="phi3", rope_long=True, rope_orig_ctx=64, rope_attn_factor=1.19)),
    # smollm3: layer 3 without rope
    "smollm3": Case(dict(arch="smollm3", layers=4), dict(arch="smollm3", layers=4)),
    # granite's four multipliers (Granite 3.x's are of the interop case's order)
    "granite": Case(dict(arch="granite", embedding_scale=3.0, residual_scale=0.5, attn_scale=0.2, logit_scale=2.5),
                    dict(arch="granite", kv_heads=1, embedding_scale=12.0, residual_scale=0.22, attn_scale=0.05,
                         logit_scale=8.0)),
    # lfm2: short-convolution layers (kv_heads 0) beside attention ones with q/k norms; taps
    # longer than LFM2's 3 in the tiny case (its windows of 5-7 tokens), its own output there
    "lfm2": Case(dict(arch="lfm2", layers=3, kv_heads=(2, 0, 0), shortconv_l=4),
                 dict(arch="lfm2", layers=3, kv_heads=(0, 2, 0), tied=True)),
    # gemma4: local layers (flags) with their own head size, rotated dims, base and KV heads;
    # global layers with rope factors (zero frequency past half of them, as proportional rope);
    # a global layer without attn_v (V from K); the last two layers attend over layers 1 and 2's
    # keys and values
    "gemma4": Case(dict(arch="gemma4", layers=5, head_dim=16, head_dim_swa=8, rope_dims_swa=4, kv_heads=(2, 2, 1, 2, 1),
                        swa_layers=(1, 1, 0, 1, 0), window=3, rope_base_swa=100.0, rope_freqs=True,
                        v_from_k=(0, 0, 1, 0, 0), shared_kv=2, logit_softcap=3.0, tied=True),
                   dict(arch="gemma4", layers=5, head_dim=32, head_dim_swa=16, rope_dims_swa=8, kv_heads=(2, 2, 1, 2, 1),
                        swa_layers=(1, 1, 0, 1, 0), window=8, rope_base=1e6, rope_base_swa=10000.0,
                        rope_freqs=True, v_from_k=(0, 0, 1, 0, 0), shared_kv=2, logit_softcap=30.0, tied=True)),
    # gemma4's E-models: per-layer embeddings, the KV-sharing layers' FFNs twice as wide
    "gemma4-e": Case(dict(arch="gemma4", layers=4, head_dim=8, kv_heads=1, swa_layers=(1, 0, 1, 0), window=3,
                          rope_freqs=True, shared_kv=2, per_layer_dim=4, ff=(48, 48, 96, 96)),
                     dict(arch="gemma4", layers=4, head_dim=16, head_dim_swa=16, kv_heads=1, swa_layers=(1, 0, 1, 0),
                          window=8, rope_freqs=True, shared_kv=2, per_layer_dim=8, ff=(96, 96, 192, 192),
                          logit_softcap=30.0)),
    # qwen3moe: 8 experts, 2 a token (so some get no token in a window), the gate weights
    # renormalised; one with expert_feed_forward_length given, one with ff / experts_used
    "qwen3moe": Case(dict(arch="qwen3moe", head_dim=12, kv_heads=1, experts=8, experts_used=2, expert_ff=20),
                     dict(arch="qwen3moe", head_dim=32, experts=8, experts_used=2)),
    # olmoe: q/k norms over all heads (as many KV heads as heads), weights not renormalised,
    # experts feed_forward_length wide; 4 of 6 experts a token in the tiny case
    "olmoe": Case(dict(arch="olmoe", kv_heads=4, experts=6, experts_used=4),
                  dict(arch="olmoe", kv_heads=4, experts=8, experts_used=2)),
    # gemma4's MoE models (26B-A4B): experts beside every block's dense FFN, some unused
    "gemma4-moe": Case(dict(arch="gemma4", layers=2, head_dim=8, kv_heads=2, swa_layers=(1, 0), window=3,
                            rope_freqs=True, experts=6, experts_used=2, expert_ff=12),
                       dict(arch="gemma4", layers=2, head_dim=16, kv_heads=2, swa_layers=(1, 0), window=8,
                            rope_freqs=True, experts=8, experts_used=2, expert_ff=32, logit_softcap=30.0)),
    # qwen35: DeltaNet layers 0, 2 and gated attention in 1, 3 (interval 2); V heads sharing K
    # heads (4 over 2), partial rotation by rope sections covering the rotated pairs
    "qwen35": Case(dict(arch="qwen35", layers=4, head_dim=8, rope_dims=4, ssm_conv=4, ssm_state=8, ssm_groups=2,
                        ssm_heads=4, ssm_inner=32, attn_interval=2, rope_sections=(1, 1, 0, 0)),
                   dict(arch="qwen35", layers=4, head_dim=16, rope_dims=8, ssm_conv=4, ssm_state=8, ssm_groups=2,
                        ssm_heads=4, ssm_inner=32, attn_interval=2, rope_sections=(2, 1, 1, 0), tied=True)),
    # qwen35moe: qwen35's layers (DeltaNet 0, 2; attention 1, 3; two layers against llama.cpp)
    # with 6 experts, 2 a token, and the shared expert, each of its own width (the tiny case);
    # ff / experts_used and ff wide
    "qwen35moe": Case(dict(arch="qwen35moe", layers=4, head_dim=8, rope_dims=4, ssm_conv=4, ssm_state=8,
                           ssm_groups=2, ssm_heads=4, ssm_inner=32, attn_interval=2, rope_sections=(1, 1, 0, 0),
                           experts=6, experts_used=2, expert_ff=12, shexp_ff=20),
                      dict(arch="qwen35moe", layers=2, head_dim=16, rope_dims=8, ssm_conv=4, ssm_state=8,
                           ssm_groups=2, ssm_heads=4, ssm_inner=32, attn_interval=2, rope_sections=(2, 1, 1, 0),
                           experts=8, experts_used=2, tied=True)),
    # lfm2moe: lfm2's layers, the first dense, the rest 6 (8) experts, 2 a token, by sigmoid
    # scores with a selection bias; a convolution layer and an attention layer of each FFN kind
    "lfm2moe": Case(dict(arch="lfm2moe", layers=4, kv_heads=(0, 2, 0, 2), dense_lead=1, experts=6, experts_used=2,
                         expert_ff=12, expert_gating=2),
                    dict(arch="lfm2moe", layers=3, kv_heads=(0, 2, 2), dense_lead=1, experts=8, experts_used=2,
                         expert_ff=32, expert_gating=2, tied=True)),
    # gpt-oss: sinks, biases everywhere, 6 experts 2 a token (biased router, softmax over the
    # chosen), the clamped SwiGLU, layers 0 and 2 local (window shorter than the text) rotating
    # with the global YaRN (factor 4 over 8 original positions: pair 0 kept, the rest scaled;
    # factor 32 over 64 in the interop case, its ramp over pairs 0-2 of 8)
    "gpt-oss": Case(dict(arch="gpt-oss", layers=3, head_dim=8, kv_heads=2, experts=6, experts_used=2, expert_ff=12,
                         window=3, rope_scale=4.0, rope_yarn=True, rope_orig_ctx=8, rope_base=1000.0),
                    dict(arch="gpt-oss", layers=3, head_dim=16, experts=8, experts_used=2, expert_ff=32, window=8,
                         rope_scale=32.0, rope_yarn=True, rope_orig_ctx=64, rope_base=150000.0)),
}
# `train --arch` options of a family that cannot take the test's grouped KV heads (olmoe: llama.cpp
# norms k over n_embd)
SCRATCH_KV_HEADS = {"olmoe": 4}
TINY_CASES = {name: c.tiny for name, c in CASES.items() if c.tiny is not None}
INTEROP_CASES = {name: c.interop for name, c in CASES.items() if c.interop is not None}

ORACLE = {
    "llama": dict(),
    "qwen2": dict(neox=True),
    "qwen3": dict(neox=True),
    "gemma3": dict(neox=True, embed_scale=True, post_norms=True, gelu=True, scale_62=True),
    "phi3": dict(neox=True),
    "smollm3": dict(no_rope_every=4),
    "granite": dict(),
    "lfm2": dict(neox=True, final_norm="token_embd_norm.weight"),
    "gemma4": dict(neox=True, embed_scale=True, post_norms=True, gelu=True, v_norm=True, unit_scale=True,
                   global_rope_freqs=True),
    "qwen3moe": dict(neox=True, moe_norm=True),
    "olmoe": dict(neox=True, qk_norm_full=True),
    # (moe_norm: the reference's softmax renormalised over the chosen, llama.cpp's softmax of the k
    # chosen logits)
    "gpt-oss": dict(neox=True, ffn_norm="post_attention_norm.weight", moe_norm=True, swiglu_oai=True,
                    swa_rope_global=True),
    # (its delta rule, sigmoid and softplus are exact f32, not llama.cpp's float order)
    "qwen35": dict(neox=True, ffn_norm="post_attention_norm.weight", llama_bits=False),
    "qwen35moe": dict(neox=True, ffn_norm="post_attention_norm.weight", llama_bits=False, moe_norm=True),
    "lfm2moe": dict(neox=True, final_norm="token_embd_norm.weight", moe_norm=True),
}
