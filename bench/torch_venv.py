"""The benchmarks' PyTorch reference lives in its own venv (bench/.venv-torch, torch==2.13.0,
created on first use from the local CPU wheel); PyTorch is never a ggtrain dependency."""
import json
import os
import pathlib
import subprocess
import sys

TORCH_VENV = pathlib.Path(__file__).resolve().parent / ".venv-torch"


def ensure_torch() -> pathlib.Path:
    """The venv's python, creating the venv (torch==2.13.0, numpy) if it is missing; or the
    python GGTRAIN_TORCH_PYTHON names (a GPU machine's, where torch with CUDA is installed)."""
    if os.environ.get("GGTRAIN_TORCH_PYTHON"):
        return pathlib.Path(os.environ["GGTRAIN_TORCH_PYTHON"])
    py = TORCH_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(TORCH_VENV)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "numpy"], check=True)
    return py


class TorchProcess:
    """A PyTorch script running in the venv that stays up: it sets up, prints "ready", then
    answers each command line it reads on stdin with one JSON line (timed work, measured
    there). So the benches alternate with it step by step or epoch by epoch. Its stderr is
    the bench's own (a failure prints its traceback there). python: another interpreter to run
    the script with (sys.executable: ggtrain's side of a bench in its own process, alike)."""

    def __init__(self, script: str, args: dict, threads: int, python=None):
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen([str(python or ensure_torch()), "-c", script, json.dumps(args)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        if self.proc.stdout.readline().strip() != "ready":
            raise SystemExit("the side's process failed to start (its error is above)")

    def ask(self, command: str) -> dict:
        """Send one command; its JSON answer."""
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the side's process failed on {command!r} (its error is above)")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
