"""The benchmarks' PyTorch reference lives in its own venv (bench/.venv-torch, torch==2.13.0,
created on first use from the local CPU wheel); PyTorch is never a ggtrain dependency."""
import pathlib
import subprocess
import sys

TORCH_VENV = pathlib.Path(__file__).resolve().parent / ".venv-torch"


def ensure_torch() -> pathlib.Path:
    """The venv's python, creating the venv (torch==2.13.0, numpy) if it is missing."""
    py = TORCH_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TORCH_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "numpy"], check=True)
    return py
