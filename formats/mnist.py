"""MNIST model files in ggml's layout (layer 5): `general.architecture` mnist-fc / mnist-cnn.

Tensors are F32 with ggml's names and shapes (ne order in the file, numpy order in
memory): fc1.weight [ne 784, 500] is a numpy (500, 784) array, conv1.kernel
[ne 3, 3, 1, 8] is (8, 1, 3, 3).
"""
from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np

from ggtrain.errors import FormatError

ARCH_NAMES = {"fc": "mnist-fc", "cnn": "mnist-cnn"}


def save_mnist_model(path, arch: str, params: dict, shapes: dict) -> None:
    """Write an MNIST model atomically (temp file in the same folder, fsync, rename)."""
    import gguf

    path = pathlib.Path(path)
    folder = path.parent if str(path.parent) else pathlib.Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(f"{path}: folder {folder} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, ARCH_NAMES[arch])
        for name, shape in shapes.items():
            value = np.ascontiguousarray(params[name], dtype=np.float32)
            if value.shape != tuple(shape):
                raise FormatError(f"{name}: shape {value.shape}, expected {shape}")
            writer.add_tensor(name, value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_mnist_model(path, shapes_by_arch: dict) -> tuple:
    """(arch, {name: float32 array}) from an MNIST model file; FormatError if it is not one."""
    import gguf

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise FormatError(f"{path}: not a readable GGUF file ({exc})") from None
    field = reader.fields.get("general.architecture")
    arch_name = bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field else None
    arch = {v: k for k, v in ARCH_NAMES.items()}.get(arch_name)
    if arch is None:
        raise FormatError(f"{path}: not an MNIST model (general.architecture is {arch_name!r}, "
                          f"expected mnist-fc or mnist-cnn)")
    tensors = {t.name: t for t in reader.tensors}
    params = {}
    for name, shape in shapes_by_arch[arch].items():
        t = tensors.get(name)
        if t is None:
            raise FormatError(f"{path}: {arch_name} model has no tensor {name}")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise FormatError(f"{path}: tensor {name} is {t.tensor_type.name}, expected F32")
        value = np.asarray(t.data, dtype=np.float32)
        if value.size != int(np.prod(shape)):
            raise FormatError(f"{path}: tensor {name} has {value.size} elements, expected shape {shape}")
        params[name] = value.reshape(shape).copy()
    return arch, params
