"""lfm2 (Liquid AI's LFM2 dense models, 350M to 2.6B): llama.cpp's LLM_ARCH_LFM2.

A hybrid: the layers whose attention.head_count_kv entry (an array, one a layer) is 0 are
short-convolution blocks, the rest GQA attention with an RMSNorm over each head of q and of k
before NEOX rope. A short convolution projects x to B | C | x' (shortconv.in_proj), convolves
B * x' causally over time, each channel with its own kernel of shortconv.l_cache taps
(shortconv.conv, ggml's {l_cache, n_embd}), multiplies by C and projects back (out_proj);
generation keeps the last l_cache - 1 rows of B * x' per layer instead of a KV cache. Every
block's FFN is SwiGLU; the block norms are attn_norm and ffn_norm, the final one is stored as
token_embd_norm; the output is tied to the embedding where output.weight is absent (as the
converter writes LFM2). LoRA targets the attention's, the convolution's and the FFN's
projections (llama.cpp adapts them through build_lora_mm). A model built from scratch
(`train --arch lfm2`) attends in every third layer counted back from the last, never in the
first (LFM2's ratio, and llama.cpp's hybrid cache wants a convolution layer).
"""
from ggtrain.core.models.family import LLAMA_TARGETS, Family, Key

_ATTENTION = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight", "attn_k_norm.weight",
              "attn_output.weight")
_SHORTCONV = ("shortconv.in_proj.weight", "shortconv.conv.weight", "shortconv.out_proj.weight")
_FFN = ("ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _layers(cfg, layer: int) -> tuple:
    return ("attention" if cfg.at("kv_heads", layer) else "shortconv", "glu")


def _scratch(sizes: dict) -> dict:
    layers, kv_heads = sizes["layers"], sizes["kv_heads"]
    return dict(kv_heads=tuple(kv_heads if i > 0 and (layers - 1 - i) % 3 == 0 else 0 for i in range(layers)))


FAMILY = Family(arch="lfm2", rope_mode="neox", block=("attn_norm.weight",) + _ATTENTION + _SHORTCONV + _FFN,
                layers=_layers, kind_tensors={"attention": _ATTENTION, "shortconv": _SHORTCONV},
                output_norm="token_embd_norm.weight", scratch=_scratch,
                lora_targets=LLAMA_TARGETS + ("shortconv.in_proj", "shortconv.out_proj"),
                keys=(Key("shortconv_l", "shortconv.l_cache", unset=3, required=True),))
