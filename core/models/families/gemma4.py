"""gemma4 (Gemma 4 text models: 31B, E2B/E4B, 26B-A4B): llama.cpp's
LLM_ARCH_GEMMA4.

Gemma 3's block (scaled embedding, q/k norms, post-attention and post-FFN norms, GeGLU,
NEOX rope, soft-capped logits) with what Gemma 4 changed: which layers are local is an
array (attention.sliding_window_pattern, one flag a layer); local and global layers have
their own head size (attention.key_length_swa / key_length), rotated dims
(rope.dimension_count_swa / dimension_count), rope base (rope.freq_base_swa / freq_base) and
KV heads (head_count_kv per layer); the global layers rotate with rope_freqs' factors
(proportional rope: factors of 1e30 leave the unrotated pairs still); q.k is not scaled
(attention scale 1: the q/k norms set the scale); the values are RMS-normed per head without
a weight, and a layer without attn_v takes its keys' projection as values; each block's output
is multiplied by its layer_output_scale. The last attention.shared_kv_layers layers compute
no keys or values and attend over those of the last earlier layer of their kind (their FFNs
may be wider: feed_forward_length per layer). The E-models add per-layer embeddings
(embedding_length_per_layer_input P > 0): each layer's P values from per_layer_token_embd
(times sqrt(P)) plus the RMS-normed projection of the scaled token embedding
(per_layer_model_proj, times 1/sqrt(n_embd)), the sum times 1/sqrt(2); after its FFN a block
adds post_norm(proj(gelu(inp_gate x) * its P values)). The MoE models (26B-A4B: expert_count
> 0) add routed experts to every block's dense FFN: its output normed by post_ffw_norm_1, plus
expert_used_count of expert_count GeGLU experts of pre_ffw_norm_2(x), routed by softmax (the
k weights renormalised) over ffn_gate_inp's logits of x RMS-normed, times 1/sqrt(n_embd) and
ffn_gate_inp.scale (the experts' gate and up one stacked matrix, ffn_gate_up_exps, as the
converter writes them), each expert's output times its ffn_down_exps.scale, normed by
post_ffw_norm_2. LoRA targets the attention and the dense FFN; the experts (ffn_gate_up_exps,
ffn_down_exps) only where --lora-targets names them (the update added after the down scale,
as llama.cpp's build_lora_mm_id adds it; a merge divides it by the scale).
"""
from ggtrain.core.models.family import LLAMA_TARGETS, Family, Key

_EXPERTS = ("post_ffw_norm_1.weight", "pre_ffw_norm_2.weight", "ffn_gate_inp.weight", "ffn_gate_inp.scale",
            "ffn_gate_up_exps.weight", "ffn_down_exps.weight", "ffn_down_exps.scale",
            "post_ffw_norm_2.weight")
_BLOCK = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight",
          "attn_k_norm.weight", "attn_output.weight", "post_attention_norm.weight", "ffn_norm.weight",
          "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight") + _EXPERTS + (
          "post_ffw_norm.weight", "inp_gate.weight", "proj.weight", "post_norm.weight", "layer_output_scale.weight")


def _layers(cfg, layer: int) -> tuple:
    return ("attention", "glu_moe" if cfg.experts else "glu")


def _unit_scale(cfg) -> float:
    return 1.0


def _scratch(sizes: dict) -> dict:
    """A model built from scratch: Gemma 4's five local layers to a global one, the last
    global; a window of a quarter of the context; plain rope factors (ones) for the global
    layers, which llama.cpp requires."""
    layers = sizes["layers"]
    return dict(swa_layers=tuple(int((layers - 1 - i) % 6 != 0) for i in range(layers)),
                window=max(1, sizes["ctx"] // 4), rope_freqs=True)


FAMILY = Family(arch="gemma4", block=_BLOCK, rope_mode="neox", act="gelu", embed_scale=True, rope_freqs=True,
                attention_scale=_unit_scale, layers=_layers, kind_tensors={"glu_moe": _EXPERTS},
                moe_norm=True, v_from_k=True, v_norm=True, global_rope_freqs=True, scratch=_scratch,
                lora_targets=LLAMA_TARGETS,
                keys=(Key("window", "attention.sliding_window", required=True),
                      Key("swa_layers", "attention.sliding_window_pattern", "bool", required=True, per_layer=True),
                      Key("head_dim_swa", "attention.key_length_swa", required=True),
                      Key("rope_dims_swa", "rope.dimension_count_swa"),
                      Key("rope_base_swa", "rope.freq_base_swa", "f32", unset=10000.0),
                      Key("shared_kv", "attention.shared_kv_layers", unset=0),
                      Key("per_layer_dim", "embedding_length_per_layer_input", required=True, unset=0),
                      Key("logit_softcap", "final_logit_softcapping", "f32", unset=0.0),
                      Key("experts", "expert_count", unset=0),
                      Key("experts_used", "expert_used_count", unset=0),
                      Key("expert_ff", "expert_feed_forward_length", unset=0)))
