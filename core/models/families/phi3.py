"""phi3 (Phi-3 mini/medium 4k, Phi-4-mini shapes): llama.cpp's LLM_ARCH_PHI3.

The llama block with q, k and v from one fused product (attn_qkv: q | k | v rows) and the
FFN's gate and up from another (stored as ffn_up: gate | up rows), NEOX rope, partial
rotation where rope.dimension_count is below the head size. LoRA targets the fused weights.
The long-context variants' rope_factors_long/short (chosen by llama.cpp from the run's
context, with a longrope attention factor) are not applied yet: such files are refused.
"""
from ggtrain.core.models.family import Family

FAMILY = Family(arch="phi3", rope_mode="neox",
                block=("attn_norm.weight", "attn_qkv.weight", "attn_output.weight", "ffn_norm.weight",
                       "ffn_gate_up.weight", "ffn_down.weight"),
                lora_targets=("attn_qkv", "attn_output", "ffn_up", "ffn_down"))
