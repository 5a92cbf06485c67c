"""gemma3 (Gemma 3 text models, 270M to 27B): llama.cpp's LLM_ARCH_GEMMA3.

The embedding is scaled by sqrt(n_embd); each block normalises q and k per head before
NEOX rope, normalises the attention's and the FFN's outputs again before their residuals
(post_attention_norm, post_ffw_norm), and gates its FFN with GeGLU (gelu's tanh form).
Norm weights are applied as stored (the converter stores Gemma's 1 + w). Local layers see
a sliding window of attention.sliding_window keys and rotate with rope.freq_base_swa
(10000 when absent); every attention.sliding_window_pattern-th layer (6th by default) is
global, rotating with rope.freq_base and the rope scaling. q.k is scaled by 1/sqrt(head
size), by 1/sqrt(n_embd / n_head) for the 62-layer 27B model, as llama.cpp does. Logits
are soft-capped (c tanh(x / c)) where final_logit_softcapping is given.
"""
from ggtrain.core.models.family import Family, Key, recip_sqrt_f32

_BLOCK = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight",
          "attn_k_norm.weight", "attn_output.weight", "post_attention_norm.weight", "ffn_norm.weight",
          "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight")


def _attention_scale(cfg) -> float:
    return recip_sqrt_f32(cfg.dim // cfg.heads if cfg.layers == 62 else cfg.head_dim)


FAMILY = Family(arch="gemma3", block=_BLOCK, rope_mode="neox", act="gelu", embed_scale=True,
                attention_scale=_attention_scale, scale_q=True,
                keys=(Key("window", "attention.sliding_window", unset=0),
                      Key("window_pattern", "attention.sliding_window_pattern", unset=6),
                      Key("rope_base_swa", "rope.freq_base_swa", "f32", unset=10000.0),
                      Key("logit_softcap", "final_logit_softcapping", "f32", unset=0.0)))
