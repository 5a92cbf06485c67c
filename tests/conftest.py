"""Shared fixtures: the CPU backend, the location of ../shared/data, and llama.cpp."""
import atexit
import os
import pathlib
import shutil
import tempfile

import pytest

from ggtrain.core.backend_cpu import CpuBackend

SHARED_DATA = pathlib.Path(__file__).resolve().parents[1].parent / "shared" / "data"

# the token files of the commands the tests run (and their subprocesses) go to a folder of
# this session, not the user's cache
os.environ["GGTRAIN_TOKEN_CACHE"] = tempfile.mkdtemp(prefix="ggtrain-test-tokens-")
atexit.register(shutil.rmtree, os.environ["GGTRAIN_TOKEN_CACHE"], True)

# llama.cpp's CPU library runs its threads by OpenMP (libgomp), whose threads spin for a while
# after each parallel region by default. In this process they then take the 2 cores from the
# kernel core's pool and the next llama.cpp call (a one-token decode every few milliseconds):
# a tiny family's 61 one-token decodes took 13 s, 0.06 s with passive waiting (measured on
# 2 cores). Set before libgomp is loaded (the first import of llama_cpp); the numbers do not
# change, only how idle threads wait.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


if os.environ.get("GGTRAIN_TEST_BACKEND") == "cuda":   # the kernel tests' direct runs go to the GPU too
    import functools

    from ggtrain.core import backend_kernel
    from ggtrain.core.backend_cuda import CudaBackend

    _cuda = CudaBackend()
    backend_kernel.run_kernel = functools.partial(backend_kernel.run_kernel, backend=_cuda)


@pytest.fixture(scope="session")
def backend():
    """The backend the op and kernel tests run on: the CPU's (2 threads), or with
    GGTRAIN_TEST_BACKEND=cuda the GPU's (bench/cuda_check.py runs them so on a GPU machine)."""
    if os.environ.get("GGTRAIN_TEST_BACKEND") == "cuda":
        return _cuda
    return CpuBackend(2)


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (it lives in ../shared beside the repo)")
    return SHARED_DATA


@pytest.fixture(scope="module")
def llama():
    """The llama_cpp module (llama.cpp through llama-cpp-python, the `interop` extra).

    Without it the test skips, except in CI (CI=true), where it fails: CI installs the extra
    and must never pass by silently skipping interop.
    """
    try:
        import llama_cpp
    except ImportError as e:        # the extra is not installed
        msg = f"llama_cpp cannot be imported ({e}); install the interop extra: pip install -e '.[interop]'"
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the llama.cpp interop tests: " + msg, pytrace=False)
        pytest.skip(msg)
    return llama_cpp


@pytest.fixture(scope="session")
def small_models(tmp_path_factory):
    """{name: path} of tests.interop.SMALL_MODELS: random models whose widths cover llama.cpp's
    quantization mixtures and fallbacks."""
    from tests.interop import write_small_models
    return write_small_models(tmp_path_factory.mktemp("mixtures"))


@pytest.fixture(scope="session")
def llama_tools():
    """{name: path} of llama.cpp's llama-quantize and llama-imatrix, built from the installed
    llama-cpp-python's sources when not cached yet (tests/llama_tools.py: minutes, once).
    Without llama-cpp-python, or where they cannot be built, the test skips with the reason,
    except in CI (CI=true), where it fails with it."""
    try:
        import llama_cpp  # noqa: F401

        from tests.llama_tools import llama_tools as build
        return build()
    except Exception as e:      # ImportError, ToolBuildError, OSError: said, never swallowed in CI
        msg = f"llama.cpp's llama-quantize/llama-imatrix are not available: {e}"
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the llama.cpp tool tests: " + msg, pytrace=False)
        pytest.skip(msg)


# blocks of SmolLM2 kept by smollm2_blocks: a sixth of its 30, its every layer position in
# llama.cpp's mixture rules' thirds (use_more_bits over 5 layers) still met
SMOLLM2_BLOCKS = 5


@pytest.fixture(scope="session")
def smollm2_blocks(tmp_path_factory):
    """SmolLM2-135M-Instruct (Q4_1, Q8_0 embedding) cut to its first SMOLLM2_BLOCKS blocks: its
    real tensors byte for byte and every key but the block count, a file llama.cpp runs. The
    slow every-type quantizer comparisons run on it (a sixth of the work of the whole model,
    whose two most used types stay compared whole)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (it lives in ../shared beside the repo)")
    from gguf.constants import GGUFValueType
    from ggtrain.formats.gguf import read_gguf, write_gguf
    src = read_gguf(SHARED_DATA / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    key = f"{src.value('general.architecture')}.block_count"
    kv = [(k, SMOLLM2_BLOCKS, GGUFValueType.UINT32) if k == key else (k, v)
          for k, v in src.kv.items() if k != "general.alignment"]
    keep = [n for n in src.tensors if not n.startswith("blk.") or int(n.split(".")[1]) < SMOLLM2_BLOCKS]
    out = tmp_path_factory.mktemp("smollm2") / f"SmolLM2-135M-Instruct-{SMOLLM2_BLOCKS}blk.Q4_1.gguf"
    write_gguf(out, kv, [(n, (lambda n=n: src.read_tensor(n)), src.tensors[n].type, src.tensors[n].shape)
                         for n in keep], alignment=src.alignment)
    return out


def write_shakespeare(path, chars: int):
    """The first `chars` characters of tiny shakespeare written to path (a repeated sentence
    of about that length without ../shared); returns path."""
    src = SHARED_DATA / "text" / "tinyshakespeare.txt"
    sentence = "the quick brown fox jumps over the lazy dog. "
    path.write_text(src.read_text()[:chars] if src.exists() else sentence * (chars // len(sentence)))
    return path


@pytest.fixture
def shakespeare(tmp_path):
    """A 30 kB text file: the start of tiny shakespeare."""
    return write_shakespeare(tmp_path / "t.txt", 30000)
