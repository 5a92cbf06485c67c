"""phi3 (Phi-3 mini/medium 4k, Phi-4-mini shapes): llama.cpp's LLM_ARCH_PHI3.

The llama block with q, k and v from one fused product (attn_qkv: q | k | v rows) and the
FFN's gate and up from another (stored as ffn_up: gate | up rows), NEOX rope, partial
rotation where rope.dimension_count is below the head size. LoRA targets the fused weights.
The long-context variants (Phi-3.5-mini, Phi-4-mini: rope scaling "longrope") carry
rope_factors_long and rope_factors_short, per-pair frequency divisors: a run whose context
passes rope.scaling.original_context_length rotates with the long ones, others with the short
ones, as llama.cpp chooses by its context size; the rotated dims are scaled by
rope.scaling.attn_factor. attention.sliding_window, which the converter writes, is read and
ignored as llama.cpp does (it disables Phi's window: the converters write no layer pattern),
so both compute full causal attention.
"""
from ggtrain.core.models.family import Family, Key

FAMILY = Family(arch="phi3", rope_mode="neox", long_rope=True, scale_q=True,
                keys=(Key("rope_orig_ctx", "rope.scaling.original_context_length", unset=0),
                      Key("rope_attn_factor", "rope.scaling.attn_factor", "f32", unset=1.0)),
                ignored_keys=("attention.sliding_window",),
                block=("attn_norm.weight", "attn_qkv.weight", "attn_output.weight", "ffn_norm.weight",
                       "ffn_gate_up.weight", "ffn_down.weight"),
                lora_targets=("attn_qkv", "attn_output", "ffn_up", "ffn_down"))
