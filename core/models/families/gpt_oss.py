"""gpt-oss (OpenAI's gpt-oss-20b and -120b): llama.cpp's LLM_ARCH_OPENAI_MOE.

Attention with q, k, v and output biases and a learned sink logit a head in each softmax's
denominator (attn_sinks: softmax over the keys and the sink, the sink adding no value),
1/sqrt(head size) scale, NEOX rope with YaRN scaling (rope.scaling.type "yarn", its factor
over rope.scaling.original_context_length positions; llama.cpp's ext_factor 1, beta_fast 32
and beta_slow 1, which it reads from no key: the converter's yarn_beta_fast / yarn_beta_slow
keys change nothing it computes, and are ignored here too). Every other layer attends through
a sliding window of attention.sliding_window keys (layers 0, 2, ...: llama.cpp's pattern 2),
rotating as the global ones (the same base and scaling, as llama.cpp sets them). The norms are
attn_norm before the attention and post_attention_norm before the FFN (no ffn_norm), and
output.weight is required. Every block's FFN is routed experts: the router's logits plus its
bias pick each token's expert_used_count best, weighted by the softmax of those k logits
(llama.cpp's SOFTMAX_WEIGHT gating, gating="softmax_weight": the softmax probabilities
renormalised over the chosen; no norm_w), each expert's gate and up products plus its bias rows, gpt-oss's clamped SwiGLU
(ops.swiglu_oai: alpha 1.702, limit 7), down plus its bias. LoRA targets the attention's
projections and the router (the experts' stacked matrices are not targets, as qwen3moe). A
model built from scratch has 8 experts, 2 a token, and gpt-oss's window of 128 (llama.cpp
requires attention.sliding_window).
"""
from ggtrain.core.models.families.qwen3moe import EXPERT_KEYS
from ggtrain.core.models.family import Family, Key

_BLOCK = ("attn_norm.weight", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight",
          "attn_v.bias", "attn_output.weight", "attn_output.bias", "attn_sinks.weight", "post_attention_norm.weight",
          "ffn_gate_inp.weight", "ffn_gate_inp.bias", "ffn_gate_exps.weight", "ffn_gate_exps.bias",
          "ffn_up_exps.weight", "ffn_up_exps.bias", "ffn_down_exps.weight", "ffn_down_exps.bias")

FAMILY = Family(arch="gpt-oss", rope_mode="neox", block=_BLOCK, ffn="moe", gating="softmax_weight", may_tie=False,
                act="swiglu_oai", ffn_norm="post_attention_norm.weight", yarn=True, swa_rope_global=True,
                keys=EXPERT_KEYS + (Key("window", "attention.sliding_window", unset=128, required=True),
                                    Key("window_pattern", "attention.sliding_window_pattern", unset=2),
                                    Key("rope_orig_ctx", "rope.scaling.original_context_length", unset=0)),
                ignored_keys=("rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow"),
                lora_targets=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"))
