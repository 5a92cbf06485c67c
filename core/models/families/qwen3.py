"""qwen3 (Qwen3 dense): llama.cpp's LLM_ARCH_QWEN3.

The llama block with an RMSNorm over each head of q and of k (attn_q_norm / attn_k_norm,
(head_dim,) weights) before rope, NEOX rope, and a head size from attention.key_length
that need not be n_embd / n_head (Qwen3-0.6B: 1024 / 16 heads of 128).
"""
from ggtrain.core.models.family import LLAMA_BLOCK, Family

_QKV = LLAMA_BLOCK.index("attn_v.weight") + 1
FAMILY = Family(arch="qwen3", rope_mode="neox",
                block=LLAMA_BLOCK[:_QKV] + ("attn_q_norm.weight", "attn_k_norm.weight") + LLAMA_BLOCK[_QKV:])
