"""The native core itself: thread pool and plans, errors across the C boundary, conversions."""
import numpy as np
import pytest

from ggtrain.core.backend import KernelCall, TensorRef
from ggtrain.core.backend_cpu import CpuBackend, CpuBuffer
from ggtrain.core.backend_kernel import run_kernel
from ggtrain.errors import GgtrainError, NativeError, ShapeError
from ggtrain.native import _check, ffi, lib


def _ref(buf, offset, shape):
    strides = tuple(int(np.prod(shape[i + 1:])) for i in range(len(shape)))
    return TensorRef(buf, offset, "f32", shape, strides)


def test_long_plan_on_two_threads_is_correct():
    backend = CpuBackend(2)
    n = 1000
    buf = CpuBuffer(2 * 4 * 37)
    a, b = buf.view(0, "f32", (37,)), buf.view(4 * 37, "f32", (37,))
    a[:] = np.arange(37)
    b[:] = 0
    # b = b + a, a thousand times, each node depending on the previous one
    calls = [KernelCall("add_fwd_f32", _ref(buf, 4 * 37, (37,)), (_ref(buf, 4 * 37, (37,)), _ref(buf, 0, (37,))))
             for _ in range(n)]
    plan = backend.compile(calls)
    for _ in range(3):
        backend.run(plan)
    np.testing.assert_array_equal(b, 3 * n * np.arange(37))


def test_error_in_any_node_raises_with_its_label_and_pool_survives():
    backend = CpuBackend(2)
    good = np.zeros(4, np.float32)
    with pytest.raises(ShapeError, match="add"):
        run_kernel("add_fwd_f32", good, [np.zeros(5, np.float32), good], n_threads=2, backend=backend)
    out = run_kernel("add_fwd_f32", good, [np.ones(4, np.float32), np.ones(4, np.float32)], n_threads=2,
                     backend=backend)
    np.testing.assert_array_equal(out, 2)


def test_plan_rejects_more_threads_than_pool():
    """The native guard: a plan asked to run on more threads than its pool has."""
    backend = CpuBackend(1)
    plan = backend.compile([])
    with pytest.raises(GgtrainError, match="n_threads 3"):
        _check(lib.gt_plan_compute(plan.ptr, 3))


def test_check_maps_status_to_exceptions():
    lib.gt_set_simd_level(7)  # invalid: records an error message
    with pytest.raises(NativeError, match="simd level 7") as info:
        _check(lib.GT_ERR_INVALID)
    assert isinstance(info.value, ValueError) and info.value.code == lib.GT_ERR_INVALID
    _check(0)  # GT_OK is silent


def test_f16_conversion_exhaustive():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty(65536, np.float32)
    _check(lib.gt_f16_to_f32(ffi.cast("float *", out.ctypes.data), ffi.cast("uint16_t *", h.ctypes.data), h.size))
    want = h.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan], want[~nan])


def test_f32_to_f16_rounds_like_numpy():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, s, 20000) for s in (1e-6, 1e-3, 1, 100, 1e4)]).astype(np.float32)
    x = np.concatenate([x, np.array([0.0, -0.0, 65504, 65520, 65519.99, 1e9, -1e9, 5.96e-8, 2.98e-8,
                                      np.inf, -np.inf], np.float32)])
    out = np.empty(x.size, np.uint16)
    _check(lib.gt_f32_to_f16(ffi.cast("uint16_t *", out.ctypes.data), ffi.cast("float *", x.ctypes.data), x.size))
    with np.errstate(over="ignore"):  # numpy warns on the values that become inf
        want = x.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(out, want)


def test_bf16_round_trip_and_rounding():
    x = np.array([1.0, 1.00390625, 1.005859375, -3.14159, 1e30, np.inf, 0.0], np.float32)
    out = np.empty(x.size, np.uint16)
    _check(lib.gt_f32_to_bf16(ffi.cast("uint16_t *", out.ctypes.data), ffi.cast("float *", x.ctypes.data), x.size))
    u = x.view(np.uint32)
    want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    np.testing.assert_array_equal(out, want)
    back = np.empty(x.size, np.float32)
    _check(lib.gt_bf16_to_f32(ffi.cast("float *", back.ctypes.data), ffi.cast("uint16_t *", out.ctypes.data), x.size))
    np.testing.assert_allclose(back[:5], x[:5], rtol=4e-3)


def test_cpu_features_reported():
    f = lib.gt_cpu_features()
    assert f in (0, 1, 3)


def test_plans_freed_right_after_running_and_failures_do_not_desync_the_pool():
    """Regression: a worker leaving a finished plan read the (already freed) plan, and a
    failure could leave a worker running the old plan when the next compute began."""
    backend = CpuBackend(2)
    ok_in = np.ones(4096, np.float32)
    for i in range(300):
        out = np.zeros(4096, np.float32)
        if i % 3 == 0:
            with pytest.raises(ShapeError):
                run_kernel("add_fwd_f32", out, [np.zeros(5, np.float32), ok_in], n_threads=2, backend=backend)
        else:
            run_kernel("add_fwd_f32", out, [ok_in, ok_in], n_threads=2, backend=backend)
            assert out.sum() == 2 * 4096


def test_a_bigger_pool_keeps_old_plans_working():
    backend = CpuBackend(1)
    a = np.ones(64, np.float32)
    out1 = np.zeros(64, np.float32)
    buf_calls = []
    from ggtrain.core.backend_kernel import _ArrayBuffer
    ref = lambda arr: TensorRef(_ArrayBuffer(arr), 0, "f32", arr.shape, (1,))  # noqa: E731
    old = backend.compile([KernelCall("add_fwd_f32", ref(out1), (ref(a), ref(a)))])
    backend.pool(3)  # grows: a new pool replaces the backend's
    backend.run(old)
    assert out1.sum() == 128
    assert not buf_calls


def _forked_child(backend, plan, out):
    """In a forked process: run the parent's plan (its pool's threads are not here), then free
    the parent's backend and plan as Python's collector does."""
    import gc
    try:
        backend.run(plan)
        out.put("ran")
    except NativeError as exc:
        out.put(str(exc))
    del backend, plan
    gc.collect()
    out.put("freed")


def test_a_forked_process_frees_the_parents_pool_and_will_not_run_it():
    """A fork copies a backend's thread pool but none of its threads. In the child, running a plan
    on it is a NativeError saying so (it would wait forever for the absent threads), and freeing
    it returns (it joined threads that are not there, and destroyed a condition variable the
    parent's waiting threads were on: a forked corpus worker hung there when its collector freed
    a backend the parent had made)."""
    import multiprocessing
    import time
    backend = CpuBackend(2)
    buf = CpuBuffer(2 * 4 * 37)
    calls = [KernelCall("add_fwd_f32", _ref(buf, 4 * 37, (37,)), (_ref(buf, 4 * 37, (37,)), _ref(buf, 0, (37,))))]
    plan = backend.compile(calls)
    backend.run(plan)
    time.sleep(0.3)                # the pool's worker now waits on its condition variable
    ctx = multiprocessing.get_context("fork")
    out = ctx.SimpleQueue()
    child = ctx.Process(target=_forked_child, args=(backend, plan, out))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked process hung freeing (or running) its parent's thread pool")
    said = [out.get(), out.get()]
    assert "made by process" in said[0] and "before a fork" in said[0], said
    assert said[1] == "freed" and child.exitcode == 0
    backend.run(plan)              # the parent's pool is untouched
