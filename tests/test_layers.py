"""Imports point down only (STYLE §2), always through the `ggtrain.` name (STYLE §3)."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# layer of each module prefix; a module may import only from its own layer or lower ones
LAYERS = [
    ("ggtrain.errors", 0), ("ggtrain.words", 0), ("ggtrain.__init__", 0), ("ggtrain.__main__", 0),
    ("ggtrain.native", 1),
    ("ggtrain.core.backend", 2),   # backend.py, backend_cpu.py, backend_cuda.py
    ("ggtrain.core.ops", 3), ("ggtrain.core.tensor", 3), ("ggtrain.core.graph", 3), ("ggtrain.core.numerics", 3),
    ("ggtrain.core.autograd", 3),
    ("ggtrain.core.optim", 4), ("ggtrain.core.train", 4), ("ggtrain.core.step", 4), ("ggtrain.core.fit", 4), ("ggtrain.core.models", 4),
    ("ggtrain.core.data", 4), ("ggtrain.core.sampling", 4), ("ggtrain.core.distributed", 4),
    ("ggtrain.core.preference", 4), ("ggtrain.core.tasks", 4),
    ("ggtrain.formats", 5),
    ("ggtrain.cli", 6),
]
PACKAGES = {"ggtrain": "ggtrain", "cli": "ggtrain.cli", "core": "ggtrain.core",
            "native": "ggtrain.native", "formats": "ggtrain.formats"}


def layer_of(module: str):
    best = None
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    return None if best is None else best[1]


def modules():
    for folder, pkg in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "build" in path.parts:
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            name = ".".join((pkg,) + rel.parts).replace(".__init__", "") if rel.name == "__init__" \
                else ".".join((pkg,) + rel.parts)
            if folder == "native" and path.name == "build.py":
                continue  # the cffi builder runs at build time only
            yield name, path


ALL = list(modules())


@pytest.mark.parametrize("name, path", ALL, ids=[n for n, _ in ALL])
def test_imports_point_down(name, path):
    own = layer_of(name if not name.endswith("__init__") else name)
    if name == "ggtrain.__main__":
        return  # only calls the CLI
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from ggtrain.core import ops` imports the module ggtrain.core.ops
            targets = [node.module] if layer_of(node.module) is not None or node.module == "ggtrain" or \
                not node.module.startswith("ggtrain") else [f"{node.module}.{a.name}" for a in node.names]
        for t in targets:
            top = t.split(".")[0]
            assert top not in ("core", "cli", "formats", "native"), \
                f"{path}: `import {t}` must start with ggtrain. (a second copy of the module)"
            if not t.startswith("ggtrain"):
                continue
            if t == "ggtrain":
                continue
            dep = layer_of(t)
            assert dep is not None, f"{path}: unknown project module {t}"
            assert own is not None, f"{path}: module {name} has no layer"
            assert dep <= own, f"{path} (layer {own}) imports {t} (layer {dep}): imports point down only"
            assert not t.startswith("ggtrain.cli") or name.startswith("ggtrain.cli"), \
                f"{path}: nothing imports cli"
