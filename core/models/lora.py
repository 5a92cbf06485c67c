"""LoRA adapters of a decoder's linear weights (layer 4), as PEFT trains them and llama.cpp applies them.

A weight W (n_out, n_in) gets two trainable factors, A (r, n_in) and B (n_out, r), and the
layer computes W x + (alpha / r) B A x. PEFT's initialisation: A uniform in
[-1/sqrt(n_in), 1/sqrt(n_in)] (kaiming_uniform with a = sqrt(5)), B zero, so training starts
from the base model exactly. Factor tensors are named "<weight name>.lora_a" / ".lora_b", as
llama.cpp's adapter files name them; the scale alpha / r is what llama.cpp applies to an
adapter whose adapter.lora.alpha is alpha (times the user's --lora-scale).

The routed experts' stacked weights W (E, n_out, n_in) (Family.expert_targets, adapted only
where named) get a pair per expert, stacked: A (E, r, n_in), B (E, n_out, r), expert e's
update B[e] A[e] x over the tokens routed to it (llama.cpp's build_lora_mm_id).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ggtrain.core.models.families import FAMILIES
from ggtrain.core.models.family import STORED_AS
from ggtrain.errors import ConfigError

# the block weights an adapter may target in some family, by their llama.cpp names (each
# family's own are its Family.lora_targets, the defaults, and its Family.expert_targets)
TARGETS = tuple(dict.fromkeys(t for fam in FAMILIES.values() for t in fam.lora_targets + fam.expert_targets))


@dataclass(frozen=True)
class LoraConfig:
    """Rank, alpha, targeted weights (TARGETS names; empty: the model's family's
    lora_targets, never its experts) and dropout of the adapters' input."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple = ()
    dropout: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ConfigError(f"--lora-rank must be an integer >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ConfigError(f"--lora-alpha must be > 0, got {self.alpha}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ConfigError(f"--lora-targets: unknown target {unknown[0]!r} (targets: {', '.join(TARGETS)})")
        if len(set(self.targets)) != len(self.targets):
            raise ConfigError(f"--lora-targets: {', '.join(self.targets)} names a target twice")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"--lora-dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        """alpha / r: the factor of B A x."""
        return self.alpha / self.rank

    def weights(self, model) -> list:
        """The adapted weight names of `model` (a ModelConfig), in llama.cpp's order:
        blk.{i}.<target>.weight. ConfigError for a target the model's family lacks."""
        own = model.family.lora_targets + model.family.expert_targets
        missing = [t for t in self.targets if t not in own]
        if missing:
            raise ConfigError(f"--lora-targets: {missing[0]!r} is not a weight of a {model.arch} model "
                              f"(its targets: {', '.join(own)})")
        chosen = [t for t in own if t in (self.targets or model.family.lora_targets)]
        fam = model.family     # (layers of a hybrid have some of the targets: family.block_of)
        stored = [{STORED_AS.get(n, n) for n in fam.block_of(model, i)} for i in range(model.layers)]
        return [f"blk.{i}.{t}.weight" for i in range(model.layers) for t in chosen if t + ".weight" in stored[i]]


@dataclass(frozen=True)
class Adapter:
    """One weight's adapter in a graph (net.linear; ffns.expert_product for stacked experts:
    a (E, r, n_in), b (E, n_out, r)): factor tensors a (r, n_in) and b (n_out, r), scale (user scale * alpha / r); dropout: (p, seed tensor, salt) drops the
    adapter's input out in training (ops.dropout), None for none; fused: the backend sums the
    adapter's product onto the frozen one's in one op (ops.matmul_lora)."""

    a: object
    b: object
    scale: float
    dropout: tuple | None = None
    fused: bool = False


def init_lora(cfg: LoraConfig, shapes: dict, seed: int = 0) -> dict:
    """PEFT's initial factors for each adapted weight: {"<w>.lora_a": A (r, n_in) f32,
    "<w>.lora_b": B (n_out, r) zeros}. shapes: {weight name: (n_out, n_in)}, or (E, n_out,
    n_in) for stacked experts: A (E, r, n_in) and B (E, n_out, r), each expert's as PEFT's."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in shapes.items():
        *lead, n_out, n_in = shape
        bound = 1.0 / math.sqrt(n_in)
        out[name + ".lora_a"] = rng.uniform(-bound, bound, (*lead, cfg.rank, n_in)).astype(np.float32)
        out[name + ".lora_b"] = np.zeros((*lead, n_out, cfg.rank), np.float32)
    return out


def factor_names(name: str) -> tuple:
    """("<name>.lora_a", "<name>.lora_b")."""
    return name + ".lora_a", name + ".lora_b"
