"""The op registry (layer 3): shape/dtype inference, kernel parameters and backward rules.

Each op is one `OpDef` in OPS, registered next to its public function and its backward
rule. A rule receives the forward node `y` (with y.srcs and y.params) and the upstream
gradient `g` (same shape as y) and returns one gradient (or None) per input, written
with the ops of this module, so it runs on every backend that has them.

Kernel names: an op `foo` runs `gt_foo_fwd_<dtypes>`; an op named `foo_bwd` runs
`gt_foo_bwd_<dtypes>`, where <dtypes> is the output's dtype, followed by an input's
where the inputs differ (`matmul_fwd_f32_q4_0`: f32 activations times a Q4_0 weight).
Each OpDef lists the variants it may run (`dtypes`) and picks one per node (`suffix`).
Composite ops (mean, transpose, linear) build other ops and have no kernel.
View ops (reshape, permute, view) have no kernel either: they alias their input's
memory with other strides. What memory a kernel needs besides its tensors (scratch,
work) is asked of the backend when a graph is compiled, never computed here.

Shapes are numpy order everywhere: x: (B, T, C) means batch, time, channels.

The ops live in one module per kind (registry: the machinery; views, elementwise, matmul, norm,
attention, rope, conv, moe, recurrent, optim_steps; costs: the FLOPs of a node), registered as those
modules are
imported here, in that order; callers use this package's names (`ops.add`, `ops.OPS`, ...).
"""
from ggtrain.core.ops.registry import *  # noqa: F401,F403
from ggtrain.core.ops.registry import (_f32, _llama, _need, _weight_suffix, _WEIGHT_VARIANTS)  # noqa: F401
from ggtrain.core.ops.views import *  # noqa: F401,F403
from ggtrain.core.ops.elementwise import *  # noqa: F401,F403
from ggtrain.core.ops.matmul import *  # noqa: F401,F403
from ggtrain.core.ops.norm import *  # noqa: F401,F403
from ggtrain.core.ops.attention import *  # noqa: F401,F403
from ggtrain.core.ops.rope import *  # noqa: F401,F403
from ggtrain.core.ops.conv import *  # noqa: F401,F403
from ggtrain.core.ops.moe import *  # noqa: F401,F403
from ggtrain.core.ops.recurrent import *  # noqa: F401,F403
from ggtrain.core.ops.costs import *  # noqa: F401,F403
from ggtrain.core.ops.optim_steps import *  # noqa: F401,F403
# the core's facts the ops' callers read through ops (the optimizer's hyper-vector layout, the
# weight types with 8-bit-activation products): native/host.py
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
