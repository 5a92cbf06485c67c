"""llama (Llama 1-3.x, SmolLM2, TinyLlama, Mistral): llama.cpp's LLM_ARCH_LLAMA.

Adjacent-pair rope; Llama 3.1+ files carry rope_freqs.weight (the converter's llama3 rope
scaling as per-pair frequency divisors); head size from attention.key_length where given.
"""
from ggtrain.core.models.family import Family

FAMILY = Family(arch="llama", rope_freqs=True)
