"""granite (IBM Granite 3.x dense): llama.cpp's LLM_ARCH_GRANITE.

The llama block with four multipliers the file states: the embedding is multiplied by
embedding_scale, what each attention and FFN adds to the residual by residual_scale, q.k by
attention.scale (instead of 1 / sqrt(head size)), and the logits are divided by logit_scale.
llama.cpp requires all four keys; rope.scaling.finetuned = false would turn rope off (refused).
"""
from ggtrain.core.models.family import Family, Key, head_scale

FAMILY = Family(arch="granite", rope_switch=True,
                attention_scale=lambda cfg: cfg.attn_scale or head_scale(cfg),
                keys=(Key("embedding_scale", "embedding_scale", "f32", required=True),
                      Key("residual_scale", "residual_scale", "f32", required=True),
                      Key("attn_scale", "attention.scale", "f32", required=True),
                      Key("logit_scale", "logit_scale", "f32", required=True)))
