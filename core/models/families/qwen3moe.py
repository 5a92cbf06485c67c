"""qwen3moe (Qwen3 MoE: Qwen3-30B-A3B, Qwen3-235B-A22B): llama.cpp's LLM_ARCH_QWEN3MOE.

qwen3's attention (an RMSNorm over each head of q and of k before NEOX rope, a head size from
attention.key_length) with a routed-expert FFN in every block: the router (ffn_gate_inp)
scores expert_count experts, each token takes the expert_used_count best by softmax, their
probabilities renormalised to sum to 1 (llama.cpp's graph fixes norm_w = true for the family),
and the sum of those experts' SwiGLU FFNs (ffn_gate_exps, ffn_up_exps, ffn_down_exps: the
experts' matrices stacked, expert_feed_forward_length wide) so weighted. LoRA targets the
attention's projections and the router (llama.cpp adapts both through build_lora_mm) by
default; the experts' stacked 3-D matrices are targets only where --lora-targets names them
(ffn_gate_exps, ffn_up_exps, ffn_down_exps: per-expert factors stacked, which llama.cpp
applies through build_lora_mm_id; Family.expert_targets), else they stay frozen (in any
stored type). A model built from scratch (`train
--arch qwen3moe`) has 8 experts, 2 a token, each ff / 2 wide.
"""
from ggtrain.core.models.family import Family, Key

_BLOCK = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight",
          "attn_k_norm.weight", "attn_output.weight", "ffn_norm.weight", "ffn_gate_inp.weight",
          "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# the routed experts' keys (shared with the other MoE families)
EXPERT_KEYS = (Key("experts", "expert_count", unset=8, required=True),
               Key("experts_used", "expert_used_count", unset=2, required=True),
               Key("expert_ff", "expert_feed_forward_length", unset=0))

FAMILY = Family(arch="qwen3moe", rope_mode="neox", block=_BLOCK, ffn="moe", moe_norm=True, keys=EXPERT_KEYS,
                lora_targets=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"))
