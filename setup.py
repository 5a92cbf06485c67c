"""Folder-to-package mapping, the cffi extension and the CUDA library (STYLE §3); metadata lives
in pyproject.toml."""
import pathlib
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ROOTS = ["cli", "core", "native", "formats"]


def _packages():
    pkgs = {"ggtrain": "ggtrain"}
    for root in ROOTS:
        pkgs[f"ggtrain.{root}"] = root
        for sub in find_packages(where=root):
            pkgs[f"ggtrain.{root}.{sub}"] = f"{root}/{sub.replace('.', '/')}"
    return pkgs


PACKAGE_DIR = _packages()


class BuildExt(build_ext):
    """The cffi extension, then the CUDA library beside it when nvcc is on PATH
    (native/build_cuda.py: GGTRAIN_CUDA=1 requires it, 0 skips it)."""

    def run(self):
        super().run()
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "native"))
        import build_cuda
        folder = (pathlib.Path(PACKAGE_DIR["ggtrain.native"]) if self.inplace
                  else pathlib.Path(self.build_lib) / "ggtrain" / "native")
        build_cuda.build(folder / "_cuda.so")


setup(
    packages=list(PACKAGE_DIR),
    package_dir=PACKAGE_DIR,
    cffi_modules=["native/build.py:ffibuilder"],
    cmdclass={"build_ext": BuildExt},
)
