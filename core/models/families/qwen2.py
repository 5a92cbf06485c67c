"""qwen2 (Qwen2, Qwen2.5): llama.cpp's LLM_ARCH_QWEN2.

The llama block with biases on the q, k and v projections (trained with --full), and NEOX
rope (the halves of each head rotate together).
"""
from ggtrain.core.models.family import LLAMA_BLOCK, Family

_QKV = LLAMA_BLOCK.index("attn_v.weight") + 1
FAMILY = Family(arch="qwen2", rope_mode="neox",
                block=LLAMA_BLOCK[:_QKV] + ("attn_q.bias", "attn_k.bias", "attn_v.bias") + LLAMA_BLOCK[_QKV:])
