"""nvcc build of the CUDA library (layer 1): native/cuda/*.cu into `ggtrain/native/_cuda.so`.

Built by setup.py's build_ext when nvcc is on PATH (a failed build is then a warning and the
install goes on without it; GGTRAIN_CUDA=1 makes a missing nvcc or a failed build an error,
GGTRAIN_CUDA=0 skips it), and by `python native/build_cuda.py` in place. The
CUDA runtime is linked statically and cuBLAS and the driver are loaded when the library
starts (native/cuda/gtc.h), so the file loads on any Linux machine and needs nothing at
install time. Code for sm_80 (A100) and sm_90 (H100/H200), and PTX of sm_90 for newer GPUs.
GGTRAIN_NATIVE_WERROR=1 (CI) makes warnings errors, as for the CPU library.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
ARCHS = ("80", "90")


def nvcc() -> str | None:
    """nvcc's path when the CUDA library should be built, else None; GGTRAIN_CUDA=1 without
    nvcc is an error, GGTRAIN_CUDA=0 builds nothing."""
    want = os.environ.get("GGTRAIN_CUDA")
    if want == "0":
        return None
    found = shutil.which("nvcc")
    if found is None and want == "1":
        raise RuntimeError("GGTRAIN_CUDA=1 but nvcc is not on PATH")
    return found


def command(compiler: str, out: pathlib.Path) -> list:
    warn = "-Wall,-Wextra" + (",-Werror" if os.environ.get("GGTRAIN_NATIVE_WERROR") == "1" else "")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    gencode.append(f"-gencode=arch=compute_{ARCHS[-1]},code=compute_{ARCHS[-1]}")
    werror = ["-Werror=all-warnings"] if os.environ.get("GGTRAIN_NATIVE_WERROR") == "1" else []
    sources = sorted(str(p.relative_to(HERE.parent)) for p in (HERE / "cuda").glob("*.cu"))
    # -fmad=false: no contraction of a * b + c into one rounding, so the block decoders give the
    # CPU's bits and the elementwise kernels compute the CPU's formulas (cuBLAS is not affected)
    return [compiler, "-O3", "-std=c++17", "-fmad=false", "--threads", "0", "--shared", "-cudart", "static",
            f"-Xcompiler=-fPIC,{warn}", *werror, *gencode, "-o", str(out), *sources, "-ldl"]


def build(out: pathlib.Path) -> pathlib.Path | None:
    """Build the library into `out` (a .so path); None when it is not to be built."""
    compiler = nvcc()
    if compiler is None:
        return None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    cmd = command(compiler, tmp)
    print("building the CUDA library:", " ".join(cmd), file=sys.stderr)
    try:
        subprocess.run(cmd, check=True, cwd=HERE.parent)
    except (OSError, subprocess.CalledProcessError) as e:
        if os.environ.get("GGTRAIN_CUDA") == "1":
            raise
        # an nvcc that cannot build it (too old a toolkit, say) must not stop a CPU install:
        # said here, and `--backend cuda` says the library is missing
        print(f"warning: the CUDA library was not built ({e}); ggtrain installs without it "
              f"(GGTRAIN_CUDA=1 makes this an error)", file=sys.stderr)
        if tmp.exists():
            tmp.unlink()
        return None
    os.replace(tmp, out)
    return out


if __name__ == "__main__":
    os.environ.setdefault("GGTRAIN_CUDA", "1")
    print(build(HERE / "_cuda.so"))
