"""Every registry op forward against float64 numpy, backward against finite differences."""
import re

import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.numerics import EXACT, LLAMA
from tests.op_cases import CASES

HEADER = __import__("pathlib").Path(__file__).resolve().parents[1] / "native" / "ggtrain.h"


def _inputs(case, seed):
    rng = np.random.default_rng(seed)
    arrays = []
    for spec in case.inputs:
        if spec.values is not None:
            arrays.append(np.asarray(spec.values))
        elif spec.ints is not None:
            arrays.append(rng.integers(spec.ints[0], spec.ints[1], spec.shape).astype(np.int32))
        else:
            arrays.append(rng.uniform(spec.lo, spec.hi, spec.shape))
    return arrays


def _is_int(spec, arr):
    return spec.ints is not None or arr.dtype.kind in "iu"


def _build(case, arrays):
    g = Graph()
    tensors = []
    for spec, arr in zip(case.inputs, arrays):
        if _is_int(spec, arr):
            tensors.append(g.const(arr.astype(np.int32), dtype="i32"))
        else:
            tensors.append(g.param(arr.shape, arr.astype(np.float32), trainable=spec.grad))
    return g, tensors, case.build(*tensors)


def _f32_inputs(case, arrays):
    # the reference sees exactly the float32 values the kernels see
    return [a if _is_int(s, a) else a.astype(np.float32).astype(np.float64)
            for s, a in zip(case.inputs, arrays)]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_forward(case, n_threads, backend):
    if getattr(ops.OPS.get(case.op), "numerics", EXACT) == LLAMA and backend.name != "cpu":
        pytest.skip(f"{case.op} is llama.cpp's CPU numbers (OpDef.numerics llama): the {backend.name} backend has no kernel")
    arrays = _f32_inputs(case, _inputs(case, 0))
    g, tensors, out = _build(case, arrays)
    rt = Runtime(g, CpuBackend(n_threads) if backend.name == "cpu" else backend)
    plan = rt.compile([out])
    rt.run(plan)
    got = plan.read(out)
    want = case.ref(*arrays)
    assert got.shape == np.shape(want), f"shape {got.shape} vs reference {np.shape(want)}"
    np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol)


def _numeric_grad(f, x, h=1e-6):
    grad = np.zeros_like(x)
    flat, gflat = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + h
        fp = f()
        flat[i] = old - h
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * h)
    return grad


BACKWARD = [c for c in CASES if c.backward]


@pytest.mark.parametrize("case", BACKWARD, ids=[c.id for c in BACKWARD])
def test_backward(case, backend):
    arrays = _f32_inputs(case, _inputs(case, 1))
    g, tensors, out = _build(case, arrays)
    rng = np.random.default_rng(2)
    upstream = rng.uniform(0.5, 1.5, out.shape) * rng.choice([-1, 1], out.shape)  # never all ones
    loss = ops.sum(ops.mul(out, g.const(upstream))) if out.shape else ops.mul(out, g.const(upstream))
    wrt = [t for t, s, a in zip(tensors, case.inputs, arrays) if s.grad and not _is_int(s, a)]
    grads = backward(loss, wrt, checkpointing=False)
    rt = Runtime(g, backend)
    plan = rt.compile([grads[t] for t in wrt])
    rt.run(plan)
    for t in wrt:
        i = tensors.index(t)
        x = arrays[i].astype(np.float64)
        args = list(arrays)
        args[i] = x
        numeric = _numeric_grad(lambda: float(np.sum(case.ref(*args) * upstream)), x)
        np.testing.assert_allclose(plan.read(grads[t]), numeric, rtol=case.grad_rtol, atol=case.grad_atol,
                                   err_msg=f"gradient of input {i}")


SMALL = [c for c in BACKWARD if sum(int(np.prod(s.shape)) for s in c.inputs) <= 48]


@pytest.mark.parametrize("case", SMALL, ids=[c.id for c in SMALL])
def test_backward_matches_own_forward(case, backend):
    """Finite differences of ggtrain's own float32 forward agree with its backward."""
    arrays = _f32_inputs(case, _inputs(case, 3))
    g, tensors, out = _build(case, arrays)
    upstream = np.random.default_rng(4).uniform(-1.5, 1.5, out.shape)
    loss = ops.sum(ops.mul(out, g.const(upstream))) if out.shape else ops.mul(out, g.const(upstream))
    wrt = [t for t, s, a in zip(tensors, case.inputs, arrays) if s.grad and not _is_int(s, a)]
    grads = backward(loss, wrt, checkpointing=False)
    rt = Runtime(g, CpuBackend(1) if backend.name == "cpu" else backend)
    fwd = rt.compile([loss])
    bwd = rt.compile([grads[t] for t in wrt])
    rt.run(bwd)
    analytics = [bwd.read(grads[t]) for t in wrt]   # before fwd reuses the shared arena
    for t, analytic in zip(wrt, analytics):
        x = rt.get(t).astype(np.float64)
        h = 1e-2

        def f():
            rt.set(t, x.astype(np.float32))
            rt.run(fwd)
            return float(fwd.read(loss))

        numeric = _numeric_grad(f, x, h)
        rt.set(t, x.astype(np.float32))
        np.testing.assert_allclose(analytic, numeric, rtol=2e-2, atol=2e-2)


# registry ops whose inputs the f32 cases cannot make, with the test that covers them
TESTED_ELSEWHERE = {
    "matmul_q8": "tests/test_qdot8.py: a stored Q4_0 ... Q6_K weight, forward only, against float64",
    "matmul_ggml": "tests/test_ggml_numbers.py: f32 and stored f16 weights, against llama.cpp's float order "
                   "(and test_interop.py, against its compiled vec_dot)",
}


def test_every_registry_op_has_a_case():
    covered = {c.op for c in CASES} | set(TESTED_ELSEWHERE)
    for c in CASES:
        covered.update(c.ops_covered)
    missing = sorted(set(ops.OPS) - covered)
    assert not missing, f"registry ops without a test case: {missing}"


def _op_kernels() -> set:
    """Every kernel some registry op may run: its kernel with each dtype variant."""
    return {f"{op.kernel}_{v}" for op in ops.OPS.values() if op.kernel for v in op.dtypes}


def test_every_kernel_in_header_is_used_by_an_op():
    text = HEADER.read_text()
    kernels = set(re.findall(r"int gt_(\w+)\(const struct gt_node \*node, const gt_ctx \*ctx\);", text))
    unused = sorted(kernels - _op_kernels())
    assert kernels, "no kernels found in ggtrain.h"
    assert not unused, f"kernels in ggtrain.h that no op uses: {unused}"


def _llama_numerics_kernels() -> set:
    return {f"{op.kernel}_{v}" for op in ops.OPS.values() if op.numerics == LLAMA for v in op.dtypes}


def test_every_op_variant_has_a_kernel(backend):
    """Every variant on the CPU; on another backend all but llama.cpp's CPU numbers (OpDef.numerics llama)."""
    want = _op_kernels() - (set() if backend.name == "cpu" else _llama_numerics_kernels())
    missing = sorted(k for k in want if not backend.supports(k))
    assert not missing, f"registry ops name kernels the {backend.name} backend lacks: {missing}"
    assert _llama_numerics_kernels() and all(backend.supports(k) == (backend.name == "cpu") for k in _llama_numerics_kernels())


def test_every_sizes_function_belongs_to_a_kernel():
    text = HEADER.read_text()
    sizers = set(re.findall(r"int gt_(\w+)_sizes\(const struct gt_node \*node,", text))
    assert sizers and sizers <= _op_kernels(), sorted(sizers - _op_kernels())


def test_swiglu_has_the_bits_of_silu_then_mul():
    # the fused gate (llama's FFN) against its composition: forward and both gradients
    # bit for bit, on 1 and 3 threads (odd sizes: SIMD tails)
    from ggtrain.core.backend_cpu import CpuBackend

    rng = np.random.default_rng(3)
    gv, uv, wv = (rng.uniform(-6, 6, (5, 77)).astype(np.float32) for _ in range(3))
    out = {}
    for fused in (False, True):
        for threads in (1, 3):
            g = Graph()
            gate, up = g.param(gv.shape, gv), g.param(uv.shape, uv)
            y = ops.swiglu(gate, up) if fused else ops.mul(ops.silu(gate), up)
            loss = ops.sum(ops.mul(y, g.const(wv)))
            grads = backward(loss, [gate, up], checkpointing=False)
            rt = Runtime(g, CpuBackend(threads))
            plan = rt.compile([y, grads[gate], grads[up]])
            rt.run(plan)
            out[fused, threads] = [plan.read(t) for t in (y, grads[gate], grads[up])]
    ref = out[False, 1]
    for key, got in out.items():
        for a, b in zip(ref, got):
            np.testing.assert_array_equal(a, b, err_msg=str(key))
    sig = 1 / (1 + np.exp(-gv.astype(np.float64)))
    np.testing.assert_allclose(ref[0], gv * sig * uv, rtol=1e-5, atol=1e-6)
