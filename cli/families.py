"""The supported-families table of README.md, made from the family registry so that it cannot
drift from what the code computes (tests/test_docs.py compares the README's copy with it).

`python -m ggtrain.cli.families` prints it: one row a family, its architecture name
(general.architecture), the models its module names, what its block does beyond the llama
block, the keys it reads beyond the common ones, and the weights a LoRA adapter may target.
"""
from __future__ import annotations

import sys

from ggtrain.core.models.families import FAMILIES

BEGIN = "<!-- families: made by `python -m ggtrain.cli.families`; do not edit by hand -->"
END = "<!-- families end -->"


def _models(family) -> str:
    """The models a family's module names: its docstring's first line, "arch (MODELS): ..."."""
    # its module: named after the architecture, but for the names Python cannot take (gpt-oss)
    module = sys.modules[f"ggtrain.core.models.families.{family.arch.replace('-', '_')}"]
    doc = module.__doc__ or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    return first.split("(", 1)[1].split(")", 1)[0] if "(" in first else ""


# what a block may do beyond the llama block: (does this family's?, the words for it)
_FEATURES = (
    (lambda f: f.rope_freqs, "rope_freqs factors"),
    (lambda f: f.long_rope, "longrope factors"),
    (lambda f: f.no_rope_every, lambda f: f"no rope in every {f.no_rope_every}th layer"),
    (lambda f: f.fused_qkv, "fused qkv"),
    (lambda f: f.qkv_bias, "q/k/v biases"),
    (lambda f: f.qk_norm, "q/k norms"),
    (lambda f: f.qk_norm_full, "q/k norms over all heads"),
    (lambda f: f.q_gate, "gated attention"),
    (lambda f: f.sinks, "attention sinks"),
    (lambda f: "attn_output.bias" in f.block, "output bias"),
    (lambda f: f.yarn, "YaRN rope scaling"),
    (lambda f: f.window_pattern or "swa_layers" in f.all_keys, "sliding-window layers"),
    (lambda f: f.v_from_k, "V from K where attn_v is absent"),
    (lambda f: f.v_norm, "V norms"),
    (lambda f: "shared_kv" in f.all_keys, "KV shared by the last layers"),
    (lambda f: "per_layer_dim" in f.all_keys, "per-layer embeddings"),
    (lambda f: f.post_norms, "post-norms"),
    (lambda f: f.embed_scale, "scaled embedding"),
)


def _block(family) -> str:
    """What a family's block computes beyond the llama block, in a few words."""
    out = [] if family.layers is None and family.mixer == "attention" else ["layer kinds per layer"]
    out.append("NEOX rope" if family.rope_mode == "neox" else "rope")
    out += [words(family) if callable(words) else words for has, words in _FEATURES if has(family)]
    act = {"silu": "SwiGLU", "gelu": "GeGLU", "swiglu_oai": "clamped SwiGLU (biased)"}[family.act] + (" (fused gate-up)" if family.fused_gate_up else "")
    norm = "renormalized" if family.moe_norm or family.gating == "softmax_weight" else "not renormalized"
    router = "a softmax router"
    if "expert_gating" in family.all_keys:     # the file names the gating (lfm2moe)
        router = "expert_gating_func's sigmoid or softmax scores" + (
            " plus a selection bias" if "exp_probs_b.bias" in family.block else "")
    routed = f"routed {act} experts (top-k of {router}, weights {norm})"
    if family.ffn == "moe":
        act = routed
    elif family.ffn == "moe_shared":
        act = f"{routed} plus a shared {act} expert gated by a sigmoid"
    elif "glu_moe" in family.kind_tensors:     # experts beside the dense FFN where the file has them
        act = f"{act}, with routed {act} experts beside it where expert_count > 0 (weights {norm})"
    elif "moe" in family.kind_tensors:         # dense FFNs in the leading layers, experts in the rest
        act = f"{act} in the first leading_dense_block_count layers, {routed} in the rest"
    out.append(act)
    return ", ".join(out)


def markdown() -> str:
    """The table, between its BEGIN and END markers."""
    rows = [BEGIN, "| architecture | models | block | keys beyond the common ones | LoRA targets |",
            "| --- | --- | --- | --- | --- |"]
    for arch in sorted(FAMILIES):
        f = FAMILIES[arch]
        keys = ", ".join(f"`{k.key}`" for k in f.keys) or "—"
        targets = " ".join(f.lora_targets)
        rows.append(f"| `{arch}` | {_models(f)} | {_block(f)} | {keys} | {targets} |")
    rows.append(END)
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
