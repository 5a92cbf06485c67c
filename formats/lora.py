"""LoRA adapters in llama.cpp's format (layer 5).

An adapter GGUF has general.type "adapter", adapter.type "lora", adapter.lora.alpha
(FLOAT32), general.architecture of its base model, and per adapted weight W (numpy
shape (n_out, n_in)) two tensors: `<W name>.lora_a` of numpy shape (r, n_in) and
`<W name>.lora_b` of shape (n_out, r) (ggml ne [n_in, r] and [r, n_out]). llama.cpp
adds scale * alpha / r * B @ (A @ x) to W @ x, so the merged weight is
W + scale * alpha / r * B @ A. Stacked experts W (E, n_out, n_in) (ffn_*_exps) have a pair
per expert, stacked: A (E, r, n_in), B (E, n_out, r) (ne [n_in, r, E] and [r, n_out, E]), as
llama.cpp's build_lora_mm_id applies them; expert e's merged weight W[e] + s * B[e] @ A[e].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType as VT

from ggtrain.errors import FormatError
from ggtrain.formats.gguf import GGUFFile, read_gguf, write_gguf
from ggtrain.formats.quants import dequantize
from ggtrain.formats.model import CHECKPOINT_KEY, validate_model
from ggtrain.formats.model_file import rewrite_model


def read_lora(path) -> tuple:
    """(alpha, architecture, {weight name: (A (r, n_in), B (n_out, r)), or stacked experts'
    (A (E, r, n_in), B (E, n_out, r))}) of an adapter file:
    f32 arrays, or f16 ones where the file stores F16 (as llama.cpp's converter writes PEFT's
    adapters by default): llama.cpp multiplies those in f16, and so do llama.cpp's numbers
    here (llama numerics); everything else takes their exact values as f32."""
    f = read_gguf(path)
    if f.value("general.type", None) != "adapter" or f.value("adapter.type", None) != "lora":
        if f.value(CHECKPOINT_KEY, None) is not None:
            raise FormatError(f"{path}: a ggtrain checkpoint, not a LoRA adapter; `ggtrain convert-checkpoint {path} "
                              f"ADAPTER.gguf` writes its adapter")
        raise FormatError(f"{path}: not a LoRA adapter (general.type {f.value('general.type', None)!r}, "
                          f"adapter.type {f.value('adapter.type', None)!r}); finetune writes one with --out")
    alpha = float(f.value("adapter.lora.alpha", 0.0))
    pairs = {}
    for name in f.tensors:
        if name.endswith(".lora_a"):
            base = name[:-len(".lora_a")]
            if base + ".lora_b" not in f.tensors:
                raise FormatError(f"{path}: {name} has no matching {base}.lora_b")
            a, b = (_factor(f, n) for n in (name, base + ".lora_b"))
            if a.ndim != b.ndim or a.ndim not in (2, 3) or a.shape[:-2] != b.shape[:-2] or a.shape[-2] != b.shape[-1]:
                raise FormatError(f"{path}: {base}: lora_a {a.shape} and lora_b {b.shape} do not share a rank"
                                  f"{' and experts' if a.ndim == 3 else ''}")
            pairs[base] = (a, b)
        elif not name.endswith(".lora_b"):
            raise FormatError(f"{path}: unexpected tensor {name!r} in a LoRA adapter")
    if not pairs:
        raise FormatError(f"{path}: the adapter holds no lora_a/lora_b pairs")
    return alpha, f.value("general.architecture", None), pairs


def _factor(f, name: str) -> np.ndarray:
    """An adapter factor's values: f16 where stored F16 (exact), else f32."""
    a = f.tensor_f32(name)
    return a.astype(np.float16) if f.info(name).type == GGMLQuantizationType.F16 else a


def write_lora(path, arch: str, alpha: float, pairs: dict, progress=None, tensor_type: str = "F32") -> None:
    """Write an adapter atomically: pairs {weight name: (A (r, n_in), B (n_out, r)), or a
    stacked experts' (A (E, r, n_in), B (E, n_out, r))}, each
    factor in tensor_type (F32, or F16 as llama.cpp's converter writes PEFT's by default)."""
    if tensor_type not in ("F32", "F16"):
        raise ValueError(f"write_lora: tensor_type {tensor_type!r} is not F32 or F16")
    kv = [("general.architecture", arch, VT.STRING), ("general.type", "adapter", VT.STRING),
          ("adapter.type", "lora", VT.STRING), ("adapter.lora.alpha", float(alpha), VT.FLOAT32)]
    tensors = []
    for name, (a, b) in pairs.items():
        tensors.append((name + ".lora_a", np.ascontiguousarray(a, np.float32), tensor_type))
        tensors.append((name + ".lora_b", np.ascontiguousarray(b, np.float32), tensor_type))
    write_gguf(path, kv, tensors, progress=progress)


def lora_adapters(path, shapes: dict, scale: float = 1.0, arch: str = "llama") -> dict:
    """The adapter at `path` as {weight name: (A (r, n_in), B (n_out, r), s)} with s = scale *
    alpha / r (scale alone when alpha is 0), the factor llama.cpp applies to B @ A.

    shapes: {weight name: numpy-order shape} of the model. Raises FormatError for a
    foreign adapter, a target the model lacks or mismatched shapes.
    """
    alpha, adapter_arch, pairs = read_lora(path)
    if adapter_arch not in (None, arch):
        raise FormatError(f"{path}: adapter for architecture {adapter_arch!r}, the model is {arch!r}")
    return fit_pairs(path, pairs, alpha, shapes, scale)


def fit_pairs(src, pairs: dict, alpha: float, shapes: dict, scale: float = 1.0) -> dict:
    """pairs {weight name: (A, B)} checked against the model's shapes, as {name: (A, B, s)}
    with s = scale * alpha / r (scale alone when alpha is 0). src names the adapter in errors."""
    out = {}
    for name, (a, b) in pairs.items():
        shape = shapes.get(name)
        if shape is None:
            raise FormatError(f"{src}: adapter targets {name!r}, which the model does not have")
        if (*b.shape[:-1], a.shape[-1]) != tuple(shape):
            raise FormatError(f"{src}: {name}: adapter gives {(*b.shape[:-1], a.shape[-1])}, the weight is "
                              f"{tuple(shape)}")
        out[name] = (a, b, adapter_scale(scale, alpha, a.shape[-2]))
    return out


def adapter_scale(scale: float, alpha: float, r: int) -> float:
    """The factor of B @ A: scale * alpha / r (scale alone when alpha is 0), in f32 as llama.cpp
    computes it ((scale * alpha) / (float)r), so an adapter goes on with llama.cpp's bits."""
    if not alpha:
        return float(np.float32(scale))
    return float(np.float32(np.float32(scale) * np.float32(alpha)) / np.float32(r))


def lora_delta(a: np.ndarray, b: np.ndarray, s: float, expert_scale: np.ndarray | None = None) -> np.ndarray:
    """The change an adapter makes to its weight: s * B @ A (n_out, n_in), float64; stacked
    experts' per expert (E, n_out, n_in), divided by expert_scale (E,) where the experts'
    products are multiplied by one (Gemma 4's ffn_down_exps.scale: llama.cpp adds the
    adapter's update after that product, so the merged weight takes it divided)."""
    d = s * (b.astype(np.float64) @ a.astype(np.float64))
    if expert_scale is None:
        return d
    e = np.asarray(expert_scale, np.float64).reshape(-1)
    if not np.all(e != 0):
        raise FormatError("an expert's scale is 0: its adapter update cannot be merged into its weight")
    return d / e[:, None, None]


def expert_scale_name(name: str, shapes: dict) -> str | None:
    """The per-expert scale tensor (E,) multiplying the stacked experts `name`'s products
    ("<name without .weight>.scale") where the model (shapes: {tensor name: shape}) has one."""
    scale = name[:-len("weight")] + "scale"
    return scale if name.endswith("_exps.weight") and scale in shapes else None


def merged_weight(w: np.ndarray, a: np.ndarray, b: np.ndarray, s: float,
                  expert_scale: np.ndarray | None = None) -> np.ndarray:
    """W + s * B @ A (lora_delta), computed in float64 and rounded to f32 once."""
    return (w.astype(np.float64) + lora_delta(a, b, s, expert_scale)).astype(np.float32)


# below this share of the adapter's change kept, a merge warns (merge_warning)
KEPT_WARN = 0.9


@dataclass(frozen=True)
class MergeResult:
    """What write_merged wrote: types {tensor name: type written}; merged: the names of the
    merged tensors; kept: the share of the adapter's change dW the written merged tensors keep,
    sum <Q(W + dW) - W, dW> / sum |dW|^2 over them (Q: what the written type stores; 1 when
    nothing is lost, ~0 when the rounding undoes the change), None when dW is 0."""

    types: dict
    merged: tuple
    kept: float | None

    @property
    def merged_types(self) -> str:
        """The types the merged tensors were written in, upper case ("F16", "Q4_K, Q6_K")."""
        return ", ".join(sorted({self.types[n].upper() for n in self.merged}))

    def words(self) -> str:
        """The summary's words: "merged tensors as F16 keep 99.8% of the adapter's change"."""
        if self.kept is None:
            return f"merged tensors as {self.merged_types}; the adapter changes nothing"
        return f"merged tensors as {self.merged_types} keep {self.kept:.1%} of the adapter's change"

    def warning(self) -> str | None:
        """A line for a merge that loses most of the adapter's change, else None."""
        if self.kept is None or self.kept >= KEPT_WARN:
            return None
        return (f"warning: written as {self.merged_types}, the merged tensors keep only {self.kept:.0%} of what the "
                f"adapter changes: write them as F16 or Q8_0 (--out-type f16 / q8_0, or no --out-type), or run the "
                f"base with the adapter (llama-cli --lora ADAPTER.gguf, Ollama's ADAPTER)")


def write_merged(path, base, pairs: dict, alpha: float, scale: float = 1.0, out_type: str | None = None,
                 src="the adapter", progress=None, imatrix=None) -> MergeResult:
    """Write the llama model `base` (path or GGUFFile) with the adapter pairs {weight name:
    (A, B)} merged in (merged_weight, from the dequantized base, one tensor at a time),
    atomically: the base's keys and other tensors as they are, the merged matrices in their
    base type where it has 8 bits or more (else F16: model_file.merged_type); or everything as
    the mixture `out_type` (model_file.rewrite_model; quantized with the importance matrix
    `imatrix`, formats.imatrix, where given). Measures how much of the change each
    written merged tensor keeps (MergeResult.kept). Raises FormatError when the adapter does
    not fit the base."""
    f = base if isinstance(base, GGUFFile) else read_gguf(base)
    layout = validate_model(f)
    fitted = fit_pairs(src, pairs, alpha, layout.shapes, scale)
    pending, sums = {}, [0.0, 0.0]      # name -> (W, dW) until written; <Q - W, dW>, |dW|^2

    def merged(name, a, b, s):
        w = f.tensor_f32(name)
        scale = expert_scale_name(name, layout.shapes)
        delta = lora_delta(a, b, s, None if scale is None else f.tensor_f32(scale))
        pending[name] = (w, delta)
        return (w.astype(np.float64) + delta).astype(np.float32)

    def observe(name, t, values, raw):
        w, delta = pending.pop(name)
        q = values if t == "f32" else dequantize(raw, t, values.shape)
        sums[0] += float(np.sum((q.astype(np.float64) - w) * delta))
        sums[1] += float(np.sum(delta * delta))

    replace = {name: (lambda name=name, a=a, b=b, s=s: merged(name, a, b, s)) for name, (a, b, s) in fitted.items()}
    types = rewrite_model(path, f, replace, out_type, progress=progress, observe=observe, imatrix=imatrix)
    return MergeResult(types, tuple(fitted), sums[0] / sums[1] if sums[1] > 0 else None)


def merge_lora(weights: dict, path, scale: float = 1.0, arch: str = "llama") -> dict:
    """weights with the adapter at `path` merged in (merged_weight). Raises FormatError for
    a foreign adapter or mismatched shapes."""
    adapters = lora_adapters(path, {n: w.shape for n, w in weights.items()}, scale, arch)
    out = dict(weights)
    for name, (a, b, s) in adapters.items():
        scale = expert_scale_name(name, weights)
        out[name] = merged_weight(weights[name], a, b, s, None if scale is None else weights[scale])
    return out
