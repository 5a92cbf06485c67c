"""olmoe (OLMoE-1B-7B): llama.cpp's LLM_ARCH_OLMOE.

The llama block's attention with an RMSNorm over the whole q and the whole k projection (all
heads at once, n_embd-wide attn_q_norm / attn_k_norm) before NEOX rope, and a routed-expert FFN
in every block: the router (ffn_gate_inp) scores expert_count experts, each token takes the
expert_used_count best by softmax, weighted by those probabilities as they are (llama.cpp's graph
fixes norm_w = false for the family: not renormalised), each expert's SwiGLU FFN
feed_forward_length wide (ffn_gate_exps, ffn_up_exps, ffn_down_exps). llama.cpp makes both
norms n_embd wide, so it runs OLMoE only with as many KV heads as heads (OLMoE's 16 and 16),
and it needs output.weight (never tied to the embedding): ggtrain requires both. LoRA targets
the attention's projections and the router; the experts' stacked 3-D matrices only where
named (see qwen3moe). A model built from scratch has 8 experts, 2 a token.
"""
from ggtrain.core.models.families.qwen3moe import EXPERT_KEYS
from ggtrain.core.models.family import Family

_BLOCK = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm_full.weight",
          "attn_k_norm_full.weight", "attn_output.weight", "ffn_norm.weight", "ffn_gate_inp.weight",
          "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")

FAMILY = Family(arch="olmoe", rope_mode="neox", block=_BLOCK, ffn="moe", moe_norm=False, may_tie=False,
                keys=tuple(k for k in EXPERT_KEYS if k.field != "expert_ff"),
                lora_targets=("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"))
