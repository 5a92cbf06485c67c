"""Optimizer steps as ops (layer 3): adamw_step and sgd_step, in place; built by core/optim.py."""
from __future__ import annotations


from ggtrain.core.tensor import Tensor
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.ops.registry import OpDef, _f32, _need, apply, register


# ---- optimizer steps (in place; built by core/optim.py) -----------------------------------


def _infer_step(name, n_src):
    def infer(srcs, params):
        _need(len(srcs) == n_src, f"{name}: needs {n_src} inputs")
        _f32(name, *srcs)
        p = srcs[0]
        for i, s in enumerate(srcs):
            if i == 2:
                _need(s.shape == (HYPER_COUNT,), f"{name}: hyper must be ({HYPER_COUNT},), got {s.shape}")
            elif i == 3:
                _need(s.size == 1, f"{name}: grad norm must be a scalar, got {s.shape}")
            else:
                _need(s.shape == p.shape, f"{name}: input {i} {s.shape} does not match param {p.shape}")
        return p.shape, "f32"
    return infer


# (the layout of the hyper vector the step kernels read: native/host.py, HYPER_*)


def adamw_step(p, grad, hyper, grad_norm, m, v, decay: bool) -> Tensor:
    """AdamW update of p in place (and of m, v); decay: apply weight decay to p."""
    return apply("adamw_step", [p, grad, hyper, grad_norm, m, v], decay=bool(decay))


def sgd_step(p, grad, hyper, grad_norm, buf, decay: bool) -> Tensor:
    """SGD (momentum optional) update of p in place (and of buf)."""
    return apply("sgd_step", [p, grad, hyper, grad_norm, buf], decay=bool(decay))


_step_lower = lambda y: ((), (1.0 if y.params["decay"] else 0.0,))  # noqa: E731
register(OpDef("adamw_step", _infer_step("adamw_step", 6), "adamw_step_fwd",
               contiguous=(0, 1, 2, 3, 4, 5), lower=_step_lower, differentiable=()))
register(OpDef("sgd_step", _infer_step("sgd_step", 5), "sgd_step_fwd",
               contiguous=(0, 1, 2, 3, 4), lower=_step_lower, differentiable=()))
