"""The model families ggtrain computes, one module each (layer 4): FAMILIES, {architecture
name: Family}, from every module in this folder (each holds FAMILY; core/models/family.py),
and NAMES, their architecture names as help texts and errors list them."""
from __future__ import annotations

import importlib
import pkgutil

FAMILIES: dict = {}
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    _family = importlib.import_module(f"{__name__}.{_module}").FAMILY
    FAMILIES[_family.arch] = _family

NAMES = ", ".join(sorted(FAMILIES))
