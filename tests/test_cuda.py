"""The CUDA backend's CPU side: the library nvcc builds (loaded without a GPU), its kernel
table against the CPU's, its block decoders (the device code, run on the host) against the
CPU's dequantizer, and the one-line refusal where no GPU can run. What needs a GPU is in
bench/cuda_check.py (every op against the CPU backend, the commands end to end)."""
import os
import shutil

import numpy as np
import pytest

from ggtrain.core import backend_cuda, ops
from ggtrain.errors import UnsupportedOpError
from ggtrain.native import ffi as cpu_ffi
from ggtrain.native import lib as cpu_lib
from ggtrain.native.dtypes import dtype
from ggtrain.core.numerics import LLAMA
from tests import refs

# CPU kernels the CUDA library does not have: llama.cpp's CPU numbers for generation and
# evaluation (ops.OpDef.numerics llama: products with 8-bit activations, its float orders, its
# f16-table gelu; on CUDA the decoder computes in f32: inference.llama_numerics_available). A new CPU
# kernel of any other op shows up in the table test until its CUDA launcher is written.
CPU_ONLY: set = {f"{op.kernel}_{v}" for op in ops.OPS.values() if op.numerics == LLAMA for v in op.dtypes}


@pytest.fixture(scope="module")
def cuda_lib():
    if backend_cuda.library_path() is None:
        msg = "no CUDA library in this build (nvcc was not on PATH when it was built)"
        if os.environ.get("CI") == "true" and shutil.which("nvcc"):
            pytest.fail("CI has nvcc, so the CUDA library must be built: " + msg, pytrace=False)
        pytest.skip(msg)
    return backend_cuda.load()


def _cpu_kernels() -> set:
    return {n[3:] for n in dir(cpu_lib) if n.startswith("gt_") and ("_fwd_" in n or "_bwd_" in n)
            and not n.endswith("_sizes")}


def test_the_kernel_table_is_the_cpus(cuda_lib):
    ffi, lib = cuda_lib
    names = {ffi.string(lib.gtc_kernel_name(i)).decode() for i in range(lib.gtc_kernel_count())}
    assert len(names) == lib.gtc_kernel_count()             # one entry a name
    cpu = _cpu_kernels()
    assert names <= cpu, names - cpu                         # the same names, the same meaning
    assert cpu - names == CPU_ONLY
    for name in names:
        assert lib.gtc_kernel(name.encode()) != ffi.NULL
    assert lib.gtc_kernel(b"no_such_kernel") == ffi.NULL


@pytest.mark.parametrize("name", ["f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k",
                                  "q5_k", "q6_k", "mxfp4"])
def test_the_device_block_decoder_equals_the_cpu_dequantizer(cuda_lib, name):
    """Random blocks (their f16 scales finite, as a quantizer writes them; MXFP4's scale byte any
    of its 256 values): the decoder the
    CUDA kernels run, compiled for the host, gives the CPU's f32 values bit for bit (on the
    device the same source, built with -fmad=false so no multiply-add is contracted)."""
    ffi, lib = cuda_lib
    t = dtype(name)
    rng = np.random.default_rng(7)
    n_blocks = 64
    raw = rng.integers(0, 256, n_blocks * t.block_bytes, dtype=np.uint8).reshape(n_blocks, t.block_bytes)
    if t.block > 1 and name != "mxfp4":   # every f16 field a small finite scale
        scale_at = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,), "q2_k": (80, 82),
                    "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}[name]
        for at in scale_at:
            raw[:, at:at + 2] = rng.uniform(-2, 2, n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    elif name == "f16":
        raw = rng.standard_normal(n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    n = n_blocks * t.block
    want, got = np.empty(n, np.float32), np.empty(n, np.float32)
    assert cpu_lib.gt_dequantize_row(cpu_ffi.cast("float *", want.ctypes.data), cpu_ffi.cast("void *", raw.ctypes.data),
                                     t.id, n) == 0
    assert lib.gtc_dequantize_row_host(ffi.cast("float *", got.ctypes.data), ffi.cast("void *", raw.ctypes.data),
                                       t.id, n) == 0
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_without_a_gpu_the_library_loads_and_says_why_it_cannot_start(cuda_lib):
    ffi, lib = cuda_lib
    if backend_cuda.unavailable_reason() is None:
        pytest.skip("this machine has a usable GPU")
    assert lib.gtc_init(0) != 0
    message = ffi.string(lib.gtc_last_error()).decode()
    assert message and "\n" not in message
    with pytest.raises(UnsupportedOpError, match="the CUDA backend cannot run here: ") as e:
        backend_cuda.CudaBackend()
    assert "\n" not in str(e.value)


def test_the_staged_allreduce_reduces_a_copy_and_writes_it_back():
    """Backend.allreduce's default (what the CUDA backend uses until NCCL): the reduce sees
    the buffer's first `count` floats and its result lands there; the CPU's reduces in place."""
    from ggtrain.core.backend import Backend
    from ggtrain.core.backend_cpu import CpuBackend
    be = CpuBackend(1)
    buf = be.alloc(40)
    be.copy_in(buf, 0, np.arange(10, dtype=np.float32))
    seen = []

    class World:
        def reduce_host(self, a):
            seen.append(a.copy())
            a *= 3.0
    reduce = World()
    Backend.allreduce(be, buf, 6, reduce)
    np.testing.assert_array_equal(seen[0], np.arange(6, dtype=np.float32))
    np.testing.assert_array_equal(buf.view(0, "f32", (10,)), np.r_[np.arange(6) * 3.0, np.arange(6, 10)])
    be.allreduce(buf, 2, reduce)
    assert not np.shares_memory(seen[0], buf.bytes)
    np.testing.assert_array_equal(buf.view(0, "f32", (3,)), [0.0, 9.0, 6.0])


def test_run_kernel_stages_arrays_through_a_device_backend():
    """run_kernel on a backend whose memory is not the host's (CUDA's; here a CPU backend seen
    through copies): strided views, an in-place kernel and dst come back as on the CPU."""
    from ggtrain.core.backend import Backend
    from ggtrain.core.backend_cpu import CpuBackend
    from ggtrain.core.backend_kernel import run_kernel

    class Staged(Backend):     # the CPU's kernels on buffers reached only by copies
        name = "staged"

        def __init__(self):
            self.cpu = CpuBackend(1)

        def __getattr__(self, name):
            return getattr(self.cpu, name)

        def alloc(self, nbytes):
            return self.cpu.alloc(nbytes)

        def free(self, buffer):
            self.cpu.free(buffer)

        def copy_in(self, buffer, offset, array):
            self.cpu.copy_in(buffer, offset, array)

        def copy_out(self, buffer, offset, out):
            return self.cpu.copy_out(buffer, offset, out)

        def supports(self, kernel):
            return self.cpu.supports(kernel)

        def kernel_sizes(self, call):
            return self.cpu.kernel_sizes(call)

        def compile(self, calls):
            return self.cpu.compile(calls)

        def run(self, plan):
            self.cpu.run(plan)

        def describe(self):
            return "the CPU behind copies"

    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 8)).astype(np.float32)
    x, y = base[::2, 1:5], rng.standard_normal((3, 4)).astype(np.float32)    # a strided view
    for be in (CpuBackend(1), Staged()):
        out = np.zeros((3, 4), np.float32)
        run_kernel("add_fwd_f32", out, [x, y], backend=be)
        np.testing.assert_array_equal(out, x + y)
        table = rng.standard_normal((5, 3)).astype(np.float32)
        want = table.copy()
        want[[4, 1]] = [[1, 2, 3], [4, 5, 6]]
        run_kernel("set_rows_fwd_f32", table, [table, np.array([[1, 2, 3], [4, 5, 6]], np.float32),
                                               np.array([4, 1], np.int32)], backend=be)
        np.testing.assert_array_equal(table, want)


def _views():
    """(a, b) operand pairs as the graph hands them to matmul: plain, transposed views (unit
    stride along rows instead of columns), a row slice, batches broadcast either way, batches
    that broadcast unevenly (one cuBLAS call a batch), and K = 0."""
    rng = np.random.default_rng(3)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)
    wide = r(7, 12)
    return [
        (r(5, 7), r(7, 3)),
        (r(7, 5).T, r(7, 3)),                      # a transposed: column stride 1
        (r(5, 7), r(3, 7).T),                      # b transposed (x @ W^T)
        (r(7, 5).T, r(3, 7).T),
        (r(5, 7), wide[:, 2:9]),                   # b's rows 12 apart
        (r(1, 7), r(7, 4)),                        # one row
        (r(5, 1), r(1, 4)),                        # K = 1
        (r(4, 5, 7), r(7, 3)),                     # batch of a, b shared (strided-batched)
        (r(5, 7), r(4, 7, 3)),                     # batch of b
        (r(2, 3, 5, 7), r(2, 3, 7, 4)),
        (r(2, 1, 5, 7), r(1, 3, 7, 4)),            # uneven: a call a batch
        (r(3, 7, 5).transpose(0, 2, 1), r(3, 4, 7).transpose(0, 2, 1)),
        (r(5, 0), r(0, 3)),                        # K = 0: zeros
    ]


def test_the_cublas_mapping_of_every_view_gives_the_product(cuda_lib):
    """matmul_fwd_f32's launcher, its cuBLAS calls answered by a host reference of
    cublasSgemm (column-major op/ld): the mapping of row-major and transposed views, batch
    broadcasting and the strided-batched path give numpy's products."""
    ffi, lib = cuda_lib
    if backend_cuda.unavailable_reason() is None:
        pytest.skip("a GPU is usable here: the host stand-in would replace cuBLAS in this process")
    from ggtrain.core.backend import KernelCall, TensorRef, fill_node
    from ggtrain.core.backend_kernel import _ArrayBuffer
    assert lib.gtc_test_host_blas() == 0
    fn = lib.gtc_kernel(b"matmul_fwd_f32")
    for a, b in _views():
        want = np.matmul(a.astype(np.float64), b.astype(np.float64))
        out = np.full(want.shape, np.nan, np.float32)

        def ref(x):
            return TensorRef(_ArrayBuffer(x), 0, "f32", x.shape, tuple(s // 4 for s in x.strides))
        node, keep = ffi.new("gt_node *"), []
        fill_node(ffi, node, KernelCall("matmul_fwd_f32", ref(out), (ref(a), ref(b))), fn, keep)
        ctx = ffi.new("gt_ctx *")
        assert fn(node, ctx) == 0, ffi.string(lib.gtc_last_error()).decode()
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=f"{a.shape} @ {b.shape}")
    # a view cuBLAS cannot read is refused, not read wrongly: rows that overlap (stride 0)
    a = np.lib.stride_tricks.as_strided(np.arange(7, dtype=np.float32), (5, 7), (0, 4))
    out = np.zeros((5, 3), np.float32)
    node = ffi.new("gt_node *")
    fill_node(ffi, node, KernelCall("matmul_fwd_f32", TensorRef(_ArrayBuffer(out), 0, "f32", (5, 3), (3, 1)),
                                    (TensorRef(_ArrayBuffer(np.ascontiguousarray(a)), 0, "f32", (5, 7), (0, 1)),
                                     TensorRef(_ArrayBuffer(np.ones((7, 3), np.float32)), 0, "f32", (7, 3), (3, 1)))),
              fn, [])
    assert fn(node, ffi.new("gt_ctx *")) != 0 and "overlap" in ffi.string(lib.gtc_last_error()).decode()


def test_matmul_lora_adds_its_second_product_through_the_host_stand_in(cuda_lib):
    """matmul_lora_fwd_f32's launcher (the product, then the adapter's with beta = 1), its
    cuBLAS calls answered by the host reference: x @ w.T + h @ b.T over batch dims, in f32 and
    with bf16 operands (both products' staged in the same work memory, which the sizes
    function asks for: the larger of the two), and a misshapen h refused in words."""
    ffi, lib = cuda_lib
    if backend_cuda.unavailable_reason() is None:
        pytest.skip("a GPU is usable here: the host stand-in would replace cuBLAS in this process")
    from ggtrain.core.backend import KernelCall, TensorRef, fill_node
    from ggtrain.core.backend_kernel import _ArrayBuffer
    assert lib.gtc_test_host_blas() == 0
    fn = lib.gtc_kernel(b"matmul_lora_fwd_f32")
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((2, 3, 7)).astype(np.float32), rng.standard_normal((5, 7)).astype(np.float32)
    h, b = rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)

    def ref(a):
        return TensorRef(_ArrayBuffer(a), 0, "f32", a.shape, tuple(s // 4 for s in a.strides))
    try:
        for math, hh, ok in (("f32", h, True), ("f32", h[:, :2], False), ("bf16", h, True)):
            assert lib.gtc_set_math(math.encode()) == 0
            out = np.full((2, 3, 5), np.nan, np.float32)
            node = ffi.new("gt_node *")
            fill_node(ffi, node, KernelCall("matmul_lora_fwd_f32", ref(out),
                                            (ref(x), ref(w.T), ref(np.ascontiguousarray(hh)), ref(b.T))), fn, [])
            ctx = ffi.new("gt_ctx *")
            scratch, work = ffi.new("int64_t *"), ffi.new("int64_t *")
            assert lib.gtc_kernel_sizes(b"matmul_lora_fwd_f32", node, scratch, work) == 0
            assert work[0] == (0 if math == "f32" else 2 * 256)     # x and w.T: 42 and 35 bf16s, each padded
            mem = ffi.new("char[]", max(1, work[0]))
            ctx.wdata, ctx.wsize = mem, work[0]
            rc = fn(node, ctx)
            if ok:
                assert rc == 0, ffi.string(lib.gtc_last_error()).decode()
                drop = 16 if math == "bf16" else 0
                r = (lambda a: refs.rounded(a, drop).astype(np.float64)) if drop else (lambda a: a.astype(np.float64))
                want = r(x) @ r(w.T) + r(h) @ r(b.T)
                np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=math)
            else:
                assert rc != 0 and "expected h (..., M, R)" in ffi.string(lib.gtc_last_error()).decode()
    finally:
        lib.gtc_set_math(b"f32")


def test_every_backend_precision_is_the_librarys_and_picks_its_compute_type(cuda_lib):
    """--backend's CUDA precisions (cli/common.py BACKENDS) are the names the library knows,
    gtc_set_math picks each one's way of reading a product's inputs (the host stand-in rounds
    them as that precision reads them: TF32's 10 fraction bits; bf16's 7, staged in the node's
    work memory, which the sizes function asks for under bf16 alone, over each operand's view:
    a transposed view of a wider matrix here), and an unknown name is refused with the list."""
    from ggtrain.cli.common import BACKENDS
    ffi, lib = cuda_lib
    if backend_cuda.unavailable_reason() is None:
        pytest.skip("a GPU is usable here: the host stand-in would replace cuBLAS in this process")
    from ggtrain.core.backend import KernelCall, TensorRef, fill_node
    from ggtrain.core.backend_kernel import _ArrayBuffer
    names = []
    while (name := lib.gtc_math_name(len(names))) != ffi.NULL:
        names.append(ffi.string(name).decode())
    assert sorted(m for m, _ in BACKENDS.values() if m) == sorted(names)
    assert lib.gtc_test_host_blas() == 0
    rng = np.random.default_rng(3)
    wide = rng.standard_normal((7, 10)).astype(np.float32)
    a, b = rng.standard_normal((6, 9)).astype(np.float32), wide[:5, 1:].T     # b: (9, 5), a strided view
    fn = lib.gtc_kernel(b"matmul_fwd_f32")

    def ref(x, base=None):
        base = x if base is None else base
        off = (x.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // 4
        return TensorRef(_ArrayBuffer(base), off * 4, "f32", x.shape, tuple(s // 4 for s in x.strides))
    try:
        for math, drop in (("tf32", 13), ("f32", 0), ("bf16", 16)):
            assert lib.gtc_set_math(math.encode()) == 0
            out = np.full((6, 5), np.nan, np.float32)
            call = KernelCall("matmul_fwd_f32", ref(out), (ref(a), ref(b, wide)))
            node = ffi.new("gt_node *")
            fill_node(ffi, node, call, fn, [])
            scratch, work = ffi.new("int64_t *"), ffi.new("int64_t *")
            assert lib.gtc_kernel_sizes(b"matmul_fwd_f32", node, scratch, work) == 0
            span_b = (b.shape[0] - 1) * 1 + (b.shape[1] - 1) * 10 + 1       # the view's first to last element
            assert work[0] == (0 if math != "bf16" else 256 * -(-a.size * 2 // 256) + 256 * -(-span_b * 2 // 256))
            ctx = ffi.new("gt_ctx *")
            if math == "bf16":
                assert fn(node, ctx) != 0        # no work memory: refused, saying how much it needs
                assert f"needs {work[0]} bytes of work memory" in ffi.string(lib.gtc_last_error()).decode()
                mem = ffi.new("char[]", work[0])
                ctx.wdata, ctx.wsize = mem, work[0]
            assert fn(node, ctx) == 0, ffi.string(lib.gtc_last_error()).decode()
            ra, rb = (refs.rounded(a, drop), refs.rounded(b, drop)) if drop else (a, b)
            want = ra.astype(np.float64) @ rb.astype(np.float64)
            np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6, err_msg=math)
            if drop:     # the rounding made a difference the check can see
                assert np.abs(want - a.astype(np.float64) @ b.astype(np.float64)).max() > 1e-4, math
        assert lib.gtc_set_math(b"fp8") != 0
        assert ("matrix products in fp8: expected one of f32, tf32, bf16"
                in ffi.string(lib.gtc_last_error()).decode())
    finally:
        lib.gtc_set_math(b"f32")
