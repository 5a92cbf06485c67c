"""What a node computes (layer 3): the FLOPs of its products, for speed reports."""
from __future__ import annotations

import builtins

from ggtrain.core.tensor import Tensor
from ggtrain.native.host import (ACT8_TYPES, HYPER_BC1, HYPER_BC2, HYPER_BETA1, HYPER_BETA2,  # noqa: F401
                                 HYPER_COUNT, HYPER_EPS, HYPER_LR, HYPER_MAX_NORM, HYPER_MOMENTUM, HYPER_WD)
from ggtrain.core.ops.conv import _conv2d_flops


def row_flops(t: Tensor) -> int:
    """The part of product_flops(t) that is done only for the rows whose target counts
    (linear_cross_entropy's: its kernel leaves the rows after the last counted one out of
    both products, the padding of a plan's loss rows); 0 for other ops."""
    return product_flops(t) if t.op == "linear_cross_entropy" else 0


def product_flops(t: Tensor) -> int:
    """FLOPs (2 per multiply-add) of node t's matrix products: a matmul's (matmul_lora's
    two), or those inside fused attention (forward: q k^T and p v; backward: q k^T again and
    four more) over the (query, key) pairs its mask lets through; a position or segment mask
    counts as causal, a bound; or conv2d's (forward, and each gradient: the same count); or
    moe_matmul's (each token's k expert products, and each gradient the same count), or
    linear_cross_entropy's (the logits, and with grad their product with the matrix again;
    every row counted, a bound: the kernel skips ignored rows after the last counted one,
    see row_flops).
    0 for other ops."""
    if t.op == "matmul":
        return 2 * t.size * t.srcs[0].shape[-1]
    if t.op in ("moe_matmul", "moe_matmul_input_bwd", "moe_matmul_weight_bwd"):   # the routed rows' products
        y = t.srcs[2] if t.op != "moe_matmul" else t
        return 2 * y.size * (t.srcs[0].shape[-1] if t.op != "moe_matmul_input_bwd" else t.shape[-1])
    if t.op == "matmul_lora":       # the frozen product and the adapter's
        return 2 * t.size * (t.srcs[0].shape[-1] + t.srcs[2].shape[-1])
    if t.op == "linear_cross_entropy":
        (n, c), v = t.srcs[0].shape, t.srcs[1].shape[0]
        return 2 * n * v * c * (2 if t.params["grad"] else 1)
    if t.op == "conv2d":
        return _conv2d_flops(t.srcs[0].shape, t.srcs[1].shape, t.params)
    if t.op == "conv2d_input_bwd":
        return _conv2d_flops(t.shape, t.srcs[0].shape, t.params)
    if t.op == "conv2d_weight_bwd":
        return _conv2d_flops(t.srcs[0].shape, t.params["kernel_shape"], t.params)
    if t.op not in ("attention", "attention_bwd"):
        return 0
    b, tq, h, d = t.srcs[0].shape
    tk = t.srcs[1].shape[1]
    # causal: query i sees min(tk, i + 1 + tk - tq) keys
    pairs = tq * tk if t.params["mask"] == "none" else tq * (tk - tq) + tq * (tq + 1) // 2 if tq <= tk else \
        builtins.sum(min(tk, max(0, i + 1 + tk - tq)) for i in range(tq))
    return 2 * (2 if t.op == "attention" else 5) * b * h * d * pairs
