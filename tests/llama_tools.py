"""llama.cpp's command-line tools as test oracles (llama-quantize, llama-imatrix): built once from
the llama.cpp sources vendored in the sdist of the installed llama-cpp-python (the same llama.cpp
as the interop tests' library), cached outside the repository in
$GGTRAIN_CACHE/llama.cpp-<version>/bin (default ~/.cache/ggtrain). The sdist is taken from that
folder when it is there, else from pip (`pip download --no-binary :all: --no-deps`, which its
cache answers); the build is cmake's, CPU only, static, these two targets (minutes on 2 cores).

NOTE: not -march=native (GGML_NATIVE): where the CPU reports AMX but the kernel does not let a
process use its tiles (this machine), the native build's AMX matrix products die of SIGILL; the
x86 build takes AVX2/FMA/F16C where /proc/cpuinfo lists them, as llama-cpp-python's wheel does.
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import platform
import shutil
import subprocess
import sys
import tarfile

TOOLS = ("llama-quantize", "llama-imatrix")


class ToolBuildError(RuntimeError):
    """The tools could not be built here (the reason, with the log's tail)."""


def _cache() -> pathlib.Path:
    return pathlib.Path(os.environ.get("GGTRAIN_CACHE") or pathlib.Path.home() / ".cache" / "ggtrain")


def _run(cmd: list, log: pathlib.Path, cwd=None) -> None:
    with open(log, "a") as out:
        r = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    if r.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise ToolBuildError(f"{' '.join(map(str, cmd[:3]))} ... failed ({r.returncode}); {log}:\n" + "\n".join(tail))


def _sources(root: pathlib.Path, version: str, log: pathlib.Path) -> pathlib.Path:
    """llama.cpp's source folder of llama-cpp-python `version`'s sdist, unpacked under root."""
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={version}", "-d", root], log)
    if not sdist.is_file():
        raise ToolBuildError(f"pip download did not give {sdist.name} in {root}")
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise ToolBuildError(f"{sdist} has no vendor/llama.cpp")
    return src


def _cpu_options() -> list:
    """cmake's ggml CPU options: no native tuning; AVX2, FMA and F16C on an x86 CPU that has them."""
    opts = ["-DGGML_NATIVE=OFF"]
    try:
        flags = set(pathlib.Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    if platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= flags:
        opts += ["-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    return opts


def llama_tools() -> dict:
    """{tool name: path of the executable}, building them first where they are absent.
    ToolBuildError with the reason when that fails (no cmake, no compiler, no sdist)."""
    import llama_cpp

    root = _cache() / f"llama.cpp-{llama_cpp.__version__}"
    exes = {t: root / "bin" / t for t in TOOLS}
    if all(p.is_file() for p in exes.values()):
        return exes
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:         # one build at a time (parallel test runs)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if all(p.is_file() for p in exes.values()):
            return exes
        for tool in ("cmake", "c++"):
            if shutil.which(tool) is None:
                raise ToolBuildError(f"building llama.cpp's {', '.join(TOOLS)} needs {tool}, which is not on PATH")
        log = root / "build.log"
        src = _sources(root, llama_cpp.__version__, log)
        build = root / "build"
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        _run(["cmake", "-S", src, "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
              "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", *_cpu_options()], log)
        _run(["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target", *TOOLS], log)
        (root / "bin").mkdir(exist_ok=True)
        for t, exe in exes.items():
            tmp = exe.with_name(exe.name + ".tmp")
            shutil.copy2(build / "bin" / t, tmp)
            os.replace(tmp, exe)
    return exes
