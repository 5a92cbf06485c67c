"""Facts of the C core that any backend's graphs use (layer 1), read once from the compiled
core, so layer 3 (core/ops/) never reaches into a backend's module for them.

HYPER_*: the layout of the hyper vector the optimizer steps read (enum gt_hyper of
native/gt_core.h, which both the CPU and the CUDA library compile). ACT8_TYPES: the weight
types whose product with 8-bit activations (llama.cpp's numerics) has a kernel
(native/checks.h's GT_ACT8_TYPES: the core's kernels named gt_matmul_q8_fwd_f32_<type>).
The dtype table is native/dtypes.py.
"""
from __future__ import annotations

from ggtrain.native import lib
from ggtrain.native.dtypes import WEIGHT_TYPES

HYPER_LR, HYPER_BETA1, HYPER_BETA2 = lib.GT_HYPER_LR, lib.GT_HYPER_BETA1, lib.GT_HYPER_BETA2
HYPER_EPS, HYPER_WD, HYPER_BC1, HYPER_BC2 = lib.GT_HYPER_EPS, lib.GT_HYPER_WD, lib.GT_HYPER_BC1, lib.GT_HYPER_BC2
HYPER_MAX_NORM, HYPER_MOMENTUM = lib.GT_HYPER_MAX_NORM, lib.GT_HYPER_MOMENTUM
HYPER_COUNT = lib.GT_HYPER_COUNT

ACT8_TYPES = tuple(w for w in WEIGHT_TYPES if hasattr(lib, f"gt_matmul_q8_fwd_f32_{w}"))
