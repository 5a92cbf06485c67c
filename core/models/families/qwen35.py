"""qwen35 (Qwen3.5 dense, 0.8B to 27B): llama.cpp's LLM_ARCH_QWEN35.

A hybrid: every full_attention_interval-th layer (4 where a file does not say, as in the
released models; attention.recurrent_layers, one bool a layer, where it says so instead) attends,
the rest are gated DeltaNet layers (mixers.deltanet: a causal convolution over q | k | v, L2-normed q
and k, the gated delta rule, a gated RMSNorm). The attention is gated: attn_q gives q | gate
per head and sigmoid(gate) scales the attention's output; q and k are RMS-normed per head,
then rotated by the multi-section rope (IMROPE), which turns text positions as NEOX over
rope.dimension_count dims where the sections cover every pair (ModelConfig checks). The FFN
is SwiGLU after post_attention_norm (Qwen3.5's name for the norm before the FFN). LoRA targets
the attention's projections, the DeltaNet's input (attn_qkv, attn_gate) and output (ssm_out)
projections and the FFN (llama.cpp adapts them through build_lora_mm). Generation carries
each DeltaNet layer's convolution rows and state S instead of a KV cache. A model built from
scratch (`train --arch qwen35`) has DeltaNet heads of the attention's head size, as many V
heads as --heads and K heads as --kv-heads, and attends every 4th layer (every layer of a
shallower model: llama.cpp needs one attention layer).
"""
from ggtrain.core.models.family import Family, Key

_ATTENTION = ("attn_q_gate.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight", "attn_k_norm.weight",
              "attn_output.weight")
_DELTANET = ("ssm_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
             "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight")
_FFN = ("post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _layers(cfg, layer: int) -> tuple:
    return ("attention" if (layer + 1) % cfg.attn_interval == 0 else "deltanet", "glu")


def _scratch(sizes: dict) -> dict:
    head_dim, heads = sizes["head_dim"], sizes["heads"]
    third = -(-(head_dim // 2) // 3)      # sections covering the pairs (rope over the whole head)
    return dict(ssm_state=head_dim, ssm_groups=sizes["kv_heads"], ssm_heads=heads, ssm_inner=heads * head_dim,
                rope_sections=(third, third, third, 0), attn_interval=min(4, sizes["layers"]))


FAMILY = Family(arch="qwen35", rope_mode="neox", block=("attn_norm.weight",) + _ATTENTION + _DELTANET + _FFN,
                layers=_layers, kind_tensors={"attention": _ATTENTION, "deltanet": _DELTANET},
                ffn_norm="post_attention_norm.weight", scratch=_scratch,
                lora_targets=("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_out",
                              "ffn_gate", "ffn_up", "ffn_down"),
                keys=(Key("ssm_conv", "ssm.conv_kernel", unset=4, required=True),
                      Key("ssm_inner", "ssm.inner_size", required=True),
                      Key("ssm_state", "ssm.state_size", required=True),
                      Key("ssm_heads", "ssm.time_step_rank", required=True),
                      Key("ssm_groups", "ssm.group_count", required=True),
                      Key("attn_interval", "full_attention_interval", unset=4),
                      Key("rope_sections", "rope.dimension_sections", required=True, array=True)))
