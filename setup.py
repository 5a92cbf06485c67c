"""Folder-to-package mapping and the cffi extension (STYLE §3); metadata lives in pyproject.toml."""
from setuptools import find_packages, setup

ROOTS = ["cli", "core", "native", "formats"]


def _packages():
    pkgs = {"ggtrain": "ggtrain"}
    for root in ROOTS:
        pkgs[f"ggtrain.{root}"] = root
        for sub in find_packages(where=root):
            pkgs[f"ggtrain.{root}.{sub}"] = f"{root}/{sub.replace('.', '/')}"
    return pkgs


PACKAGE_DIR = _packages()

setup(
    packages=list(PACKAGE_DIR),
    package_dir=PACKAGE_DIR,
    cffi_modules=["native/build.py:ffibuilder"],
)
