"""View and copy ops (layer 3): reshape, permute, transpose, view, cont, set_rows, ...: memory aliases and copies."""
from __future__ import annotations

import builtins

from ggtrain.core.tensor import Tensor, contiguous_strides, numel
from ggtrain.errors import DTypeError, ShapeError
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.ops.registry import OpDef, _f32, _need, apply, register


# ---- views and copies ------------------------------------------------------------------


def reshape(x: Tensor, shape: tuple) -> Tensor:
    """Same elements, new shape (a view; a non-contiguous x is copied first). One dim may be -1."""
    shape = tuple(int(d) for d in shape)
    if shape.count(-1) == 1:
        known = numel(tuple(d for d in shape if d != -1))
        if known == 0 or x.size % known:
            raise ShapeError(f"reshape: cannot infer -1 in {shape} for {x.size} elements")
        shape = tuple(x.size // known if d == -1 else d for d in shape)
    if numel(shape) != x.size or any(d < 0 for d in shape):
        raise ShapeError(f"reshape: {x.shape} ({x.size} elements) cannot become {shape}")
    if shape == x.shape:
        return x
    return apply("reshape", [x], shape=shape)


def _infer_reshape(srcs, params):
    return params["shape"], srcs[0].dtype


def _view_reshape(y):
    return y.srcs[0].offset, contiguous_strides(y.shape)


register(OpDef("reshape", _infer_reshape, contiguous=(0,), view=_view_reshape,
               backward=lambda y, g: [reshape(g, y.srcs[0].shape)]))


def permute(x: Tensor, axes: tuple) -> Tensor:
    """Reorder dims: output dim i is input dim axes[i] (a view, numpy's transpose)."""
    axes = tuple(int(a) % max(1, x.ndim) for a in axes)
    if sorted(axes) != list(range(x.ndim)):
        raise ShapeError(f"permute: {axes} is not a permutation of {x.ndim} dims")
    if axes == tuple(range(x.ndim)):
        return x
    return apply("permute", [x], axes=axes)


def transpose(x: Tensor, a: int = -1, b: int = -2) -> Tensor:
    """Swap two dims (a view; composite of permute)."""
    if x.ndim < 2:
        raise ShapeError(f"transpose: needs >= 2 dims, got {x.shape}")
    axes = list(range(x.ndim))
    a, b = a % x.ndim, b % x.ndim
    axes[a], axes[b] = axes[b], axes[a]
    return permute(x, tuple(axes))


def _infer_permute(srcs, params):
    x = srcs[0]
    return tuple(x.shape[a] for a in params["axes"]), x.dtype


def _view_permute(y):
    x = y.srcs[0]
    return x.offset, tuple(x.strides[a] for a in y.params["axes"])


def _permute_bwd(y, g):
    axes = y.params["axes"]
    inverse = [0] * len(axes)
    for i, a in enumerate(axes):
        inverse[a] = i
    return [permute(g, tuple(inverse))]


register(OpDef("permute", _infer_permute, view=_view_permute, backward=_permute_bwd))


def view(x: Tensor, shape: tuple, strides: tuple | None = None, offset: int = 0) -> Tensor:
    """A window into contiguous x: `shape`, element `strides` and `offset` in x's layout.

    E.g. the k part of a fused qkv projection. Checked to stay inside x.
    """
    shape = tuple(int(d) for d in shape)
    strides = contiguous_strides(shape) if strides is None else tuple(int(s) for s in strides)
    if len(strides) != len(shape) or any(s < 0 for s in strides) or offset < 0:
        raise ShapeError(f"view: bad strides {strides} / offset {offset} for shape {shape}")
    reach = offset + builtins.sum((d - 1) * s for d, s in zip(shape, strides)) if numel(shape) else offset
    if numel(shape) and reach >= x.size:
        raise ShapeError(f"view: shape {shape} strides {strides} offset {offset} reaches element "
                         f"{reach} of a {x.size}-element tensor {x.shape}")
    if (x.op == "view_bwd" and x.srcs[0].shape == shape and x.params["vstrides"] == strides
            and x.params["voffset"] == offset):
        return x.srcs[0]   # the window view_bwd wrote g into: g itself, and view_bwd never runs
    return apply("view", [x], shape=shape, vstrides=strides, voffset=int(offset))


def _infer_view(srcs, params):
    return params["shape"], srcs[0].dtype


def _view_view(y):
    return y.srcs[0].offset + y.params["voffset"], y.params["vstrides"]


def view_bwd(g: Tensor, base_shape: tuple, strides: tuple, offset: int) -> Tensor:
    """Zeros of base_shape with g written where the view lay (the backward of view)."""
    return apply("view_bwd", [g], base_shape=tuple(base_shape), vstrides=tuple(strides), voffset=int(offset))


def _infer_view_bwd(srcs, params):
    _f32("view_bwd", srcs[0])
    return params["base_shape"], "f32"


register(OpDef("view", _infer_view, contiguous=(0,), view=_view_view,
               backward=lambda y, g: [view_bwd(g, y.srcs[0].shape, y.params["vstrides"], y.params["voffset"])]))
register(OpDef("view_bwd", _infer_view_bwd, "view_bwd", contiguous=(0,),
               lower=lambda y: ((y.params["voffset"],) + y.params["vstrides"], ())))


def set_rows(target: Tensor, values: Tensor, idx: Tensor) -> Tensor:
    """Row idx[t] of persistent target (S, C) becomes values[t] (T, C), in place, at run time
    (a KV cache written at the positions being decoded). Returns the updated target: read
    the rows through it, so that readers run after the write. (f32, not differentiable)"""
    y = apply("set_rows", [target, values, idx])
    y.out = target
    return y


def _infer_set_rows(srcs, params):
    target, values, idx = srcs
    _f32("set_rows", target, values)
    _need(target.kind in ("state", "param", "input") and not target.is_view and target.out is None,
          f"set_rows: the target must be a persistent tensor, got {target!r}")
    _need(target.ndim == 2 and values.ndim == 2 and values.shape[1] == target.shape[1],
          f"set_rows: values {values.shape} do not fit rows of target {target.shape}")
    if idx.dtype != "i32":
        raise DTypeError(f"set_rows: indices must be i32, got {idx.dtype}")
    _need(idx.shape == values.shape[:1], f"set_rows: indices {idx.shape} do not match values {values.shape}")
    return target.shape, "f32"


register(OpDef("set_rows", _infer_set_rows, "set_rows_fwd", contiguous=(1, 2), differentiable=()))


def cont(x: Tensor) -> Tensor:
    """A contiguous copy of x (any strides)."""
    return apply("cont", [x])


def cast(x: Tensor, dtype: str) -> Tensor:
    """x converted to dtype (f32, f16 or bf16), contiguous; f32 -> f16/bf16 rounds to nearest even."""
    if dtype == x.dtype and x.is_contiguous():
        return x
    return apply("cast", [x], dtype=dtype)


def _infer_cont(srcs, params):
    x = srcs[0]
    if x.dtype not in _CAST_TYPES:
        raise DTypeError(f"cont: {x.dtype} tensors are not copied by kernels ({x!r})")
    return x.shape, x.dtype


def _infer_cast(srcs, params):
    x = srcs[0]
    dtype = params["dtype"]
    if dtype not in ("f32", "f16", "bf16") or x.dtype not in ("f32", "f16", "bf16"):
        raise DTypeError(f"cast: cannot convert {x.dtype} to {dtype}")
    return x.shape, dtype


_CAST_TYPES = ("f32", "f16", "bf16")
register(OpDef("cont", _infer_cont, "copy_fwd", backward=lambda y, g: [g],
               dtypes=_CAST_TYPES, suffix=lambda y: y.dtype))
register(OpDef("cast", _infer_cast, "copy_fwd",
               backward=lambda y, g: [cast(g, y.srcs[0].dtype)], dtypes=_CAST_TYPES, suffix=lambda y: y.dtype))
