"""qwen35moe (Qwen3.5 MoE: 35B-A3B, 122B-A10B, 397B-A17B): llama.cpp's LLM_ARCH_QWEN35MOE.

Qwen3.5's layers (qwen35: gated DeltaNet layers, gated attention every
full_attention_interval-th layer, the FFN after post_attention_norm) with an FFN of routed
experts plus a shared expert in every block (ffns.moe_shared): the router (ffn_gate_inp)
scores expert_count experts, each token takes the expert_used_count best by softmax, their
probabilities renormalised to sum to 1 (llama.cpp's graph fixes norm_w = true and softmax
gating, and reads no expert_weights_scale for the family), each a SwiGLU FFN
expert_feed_forward_length wide (ff / expert_used_count where a file does not say); the
shared expert's SwiGLU FFN (ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp:
expert_shared_feed_forward_length wide, ff where a file does not say) is added times
sigmoid(ffn_gate_inp_shexp . x), one gate a token. LoRA targets qwen35's attention and
DeltaNet projections, the router and the shared expert (llama.cpp adapts them through
build_lora_mm); the routed experts' stacked matrices and the shared expert's gate vector are
not targets. A model built from scratch is qwen35's with 8 experts, 2 a token.
"""
import dataclasses

from ggtrain.core.models.families.qwen35 import FAMILY as QWEN35
from ggtrain.core.models.families.qwen3moe import EXPERT_KEYS
from ggtrain.core.models.family import Key

_FFN = ("post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight",
        "ffn_down_exps.weight", "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
        "ffn_down_shexp.weight")
_DENSE = ("post_attention_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def _layers(cfg, layer: int) -> tuple:
    return (QWEN35.layer_kinds(cfg, layer)[0], FAMILY.ffn)


FAMILY = dataclasses.replace(
    QWEN35, arch="qwen35moe", block=tuple(n for n in QWEN35.block if n not in _DENSE) + _FFN, layers=_layers,
    ffn="moe_shared", moe_norm=True,
    lora_targets=tuple(t for t in QWEN35.lora_targets if not t.startswith("ffn_"))
    + ("ffn_gate_inp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"),
    keys=QWEN35.keys + EXPERT_KEYS + (Key("shexp_ff", "expert_shared_feed_forward_length", unset=0),))
