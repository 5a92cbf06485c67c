"""Shared fixtures: the CPU backend and the location of ../shared/data."""
import pathlib

import pytest

from ggtrain.core.backend_cpu import CpuBackend

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def backend():
    return CpuBackend(2)


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (it lives in ../shared beside the repo)")
    return SHARED_DATA
