"""MNIST model files in ggml's layout (layer 5): `general.architecture` mnist-fc / mnist-cnn.

Tensors are F32 with ggml's names and shapes (ne order in the file, numpy order in
memory): fc1.weight [ne 784, 500] is a numpy (500, 784) array, conv1.kernel
[ne 3, 3, 1, 8] is (8, 1, 3, 3). Written atomically through formats.gguf.
"""
from __future__ import annotations

import pathlib

import numpy as np

from ggtrain.errors import FormatError
from ggtrain.formats.gguf import read_gguf, write_gguf

ARCH_NAMES = {"fc": "mnist-fc", "cnn": "mnist-cnn"}


def model_kv(arch: str) -> list:
    """The keys of an MNIST model file (and of an mnist checkpoint's header)."""
    if arch not in ARCH_NAMES:
        raise FormatError(f"unknown MNIST architecture {arch!r} (known: {', '.join(ARCH_NAMES)})")
    return [("general.architecture", ARCH_NAMES[arch]), ("general.name", ARCH_NAMES[arch])]


def save_mnist_model(path, arch: str, params: dict, shapes: dict) -> None:
    """Write an MNIST model atomically (temp file in the same folder, fsync, rename)."""
    path = pathlib.Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise FileNotFoundError(f"{path}: folder {folder} does not exist")
    tensors = []
    for name, shape in shapes.items():
        value = np.ascontiguousarray(params[name], dtype=np.float32)
        if value.shape != tuple(shape):
            raise FormatError(f"{name}: shape {value.shape}, expected {shape}")
        tensors.append((name, value, "F32"))
    write_gguf(path, model_kv(arch), tensors)


def load_mnist_model(path, shapes_by_arch: dict) -> tuple:
    """(arch, {name: float32 array}) from an MNIST model file; FormatError if it is not one."""
    f = read_gguf(path)
    arch_name = f.value("general.architecture", None)
    arch = {v: k for k, v in ARCH_NAMES.items()}.get(arch_name)
    if arch is None:
        raise FormatError(f"{path}: not an MNIST model (general.architecture is {arch_name!r}, "
                          f"expected mnist-fc or mnist-cnn)")
    params = {}
    for name, shape in shapes_by_arch[arch].items():
        if name not in f.tensors:
            raise FormatError(f"{path}: {arch_name} model has no tensor {name}")
        info = f.tensors[name]
        if tuple(info.shape) != tuple(shape):
            raise FormatError(f"{path}: tensor {name} has shape {tuple(info.shape)}, expected {shape}")
        params[name] = f.tensor_f32(name).reshape(shape)
    return arch, params
