"""lfm2moe (Liquid AI's LFM2 MoE: LFM2-8B-A1B, LFM2-24B-A2B): llama.cpp's LLM_ARCH_LFM2MOE.

LFM2's layers (lfm2: short-convolution blocks where attention.head_count_kv is 0, GQA
attention with per-head q/k norms and NEOX rope in the rest, the final norm stored as
token_embd_norm, the output tied to the embedding where output.weight is absent) with routed
experts in place of the dense FFN after the first leading_dense_block_count layers (the
leading ones keep LFM2's SwiGLU FFN). The router (ffn_gate_inp) scores expert_count experts
by the gating function the file names (expert_gating_func: sigmoid, 2, as the converter writes
LFM2-MoE; or softmax, 1); each token takes the expert_used_count of largest score plus the
layer's selection bias (exp_probs_b.bias, which moves the selection only), weighted by their
scores renormalised to sum to 1 (llama.cpp's graph fixes norm_w = true and reads no
expert_weights_scale for the family), each a SwiGLU FFN expert_feed_forward_length wide.
The selection bias is a load-balancing buffer: no gradient reaches it and training keeps it.
LoRA targets lfm2's and the router; the experts' stacked matrices are not targets. A model
built from scratch (`train --arch lfm2moe`) is lfm2's with a dense first layer, 8 experts, 2
a token, ff / 2 wide, sigmoid gating.
"""
import dataclasses

from ggtrain.core.models.families.lfm2 import FAMILY as LFM2
from ggtrain.core.models.families.qwen3moe import EXPERT_KEYS
from ggtrain.core.models.family import Key

_DENSE = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_EXPERTS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
            "exp_probs_b.bias")


def _layers(cfg, layer: int) -> tuple:
    return (LFM2.layer_kinds(cfg, layer)[0], "glu" if layer < cfg.dense_lead else "moe")


def _scratch(sizes: dict) -> dict:
    return dict(LFM2.scratch(sizes), dense_lead=min(1, sizes["layers"] - 1))


FAMILY = dataclasses.replace(
    LFM2, arch="lfm2moe", block=LFM2.block + _EXPERTS, layers=_layers, moe_norm=True, scratch=_scratch,
    kind_tensors={**LFM2.kind_tensors, "glu": _DENSE, "moe": _EXPERTS},
    lora_targets=LFM2.lora_targets + ("ffn_gate_inp",),
    keys=LFM2.keys + tuple(k for k in EXPERT_KEYS if k.field != "expert_ff") + (
        Key("expert_ff", "expert_feed_forward_length", unset=0, required=True),
        Key("dense_lead", "leading_dense_block_count", unset=0),
        Key("expert_gating", "expert_gating_func", unset=2, required=True)))
