"""smollm3 (SmolLM3): llama.cpp's LLM_ARCH_SMOLLM3. The llama block; every 4th layer
attends without rope (NoPE)."""
from ggtrain.core.models.family import Family

FAMILY = Family(arch="smollm3", no_rope_every=4)
