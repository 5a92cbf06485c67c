"""ggml's MNIST classifiers (layer 4), with its tensor names so model files interchange.

mnist-fc:  784 -> 500 ReLU -> 10
mnist-cnn: conv 3x3 (1->8, pad 1) ReLU -> max-pool 2 -> conv 3x3 (8->16, pad 1) ReLU
           -> max-pool 2 -> flatten channel-fastest (7*7*16 = 784) -> dense 784 -> 10
Activations are NHWC, which is exactly ggml's channel-fastest flattening.
Parameter shapes are numpy order (ggml's ne reversed): fc1.weight (500, 784),
conv1.kernel (8, 1, 3, 3) = (Cout, Cin, KH, KW), conv1.bias (8, 1, 1).
"""
from __future__ import annotations

import numpy as np

from ggtrain.core import ops

ARCHS = ("fc", "cnn")
N_CLASSES = 10
HIDDEN = 500

PARAM_SHAPES = {
    "fc": {"fc1.weight": (HIDDEN, 784), "fc1.bias": (HIDDEN,),
           "fc2.weight": (N_CLASSES, HIDDEN), "fc2.bias": (N_CLASSES,)},
    "cnn": {"conv1.kernel": (8, 1, 3, 3), "conv1.bias": (8, 1, 1),
            "conv2.kernel": (16, 8, 3, 3), "conv2.bias": (16, 1, 1),
            "dense.weight": (N_CLASSES, 784), "dense.bias": (N_CLASSES,)},
}


def init_params(arch: str, seed: int = 0, std: float = 0.01) -> dict:
    """ggml's initialisation: every tensor N(0, std^2), seeded. {name: float32 array}."""
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0.0, std, shape).astype(np.float32)
            for name, shape in PARAM_SHAPES[arch].items()}


def forward(arch: str, params: dict, x):
    """Logits (B, 10) for images x (B, 28, 28) f32 in [0, 1]; params {name: Tensor}."""
    batch = x.shape[0]
    if arch == "fc":
        h = ops.relu(ops.linear(ops.reshape(x, (batch, 784)), params["fc1.weight"], params["fc1.bias"]))
        return ops.linear(h, params["fc2.weight"], params["fc2.bias"])
    if arch == "cnn":
        h = ops.reshape(x, (batch, 28, 28, 1))
        # each conv2d node is the convolution, bias, relu and 2x2 max-pool in one pass
        h = ops.conv2d(h, params["conv1.kernel"], ops.reshape(params["conv1.bias"], (8,)), 1, 1,
                       relu=True, pool=2)                          # (B, 14, 14, 8)
        h = ops.conv2d(h, params["conv2.kernel"], ops.reshape(params["conv2.bias"], (16,)), 1, 1,
                       relu=True, pool=2)                          # (B, 7, 7, 16)
        return ops.linear(ops.reshape(h, (batch, 784)), params["dense.weight"], params["dense.bias"])
    raise ValueError(f"unknown MNIST architecture {arch!r} (expected one of {ARCHS})")
