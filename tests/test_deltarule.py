"""delta_rule's chunked form (native/cpu/deltachunk.c) against the row-by-row recurrence:
outputs against float64 numpy, every gradient against the stepwise kernels' in f32, over
windows of several chunks that are not a multiple of the chunk, packed samples, V heads
sharing K heads, weak and strong decays. (Finite differences of the chunked backward: the
delta_rule-chunked rows of tests/op_cases.py.)"""
import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.graph import Graph, Runtime
from tests import refs

B, T, HK, HV, DK, DV = 2, 150, 2, 4, 8, 6


def _inputs(glo, ghi, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, HK, DK))
    k = rng.normal(size=(B, T, HK, DK))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)        # as the layer's L2 norm
    v = rng.normal(size=(B, T, HV, DV))
    g = rng.uniform(glo, ghi, (B, T, HV))
    beta = rng.uniform(0.05, 0.95, (B, T, HV))
    return [a.astype(np.float32).astype(np.float64) for a in (q, k, v, g, beta)], rng.normal(size=(B, T, HV, DV))


def _segments():
    seg = np.zeros((B, T), np.int32)
    for start in (5, 64, 100, 129):      # inside a chunk, at a chunk's first row, one before a chunk's
        seg[0, start:] += 1
    seg[1, 50:] = 1
    return seg


def _run(arrays, seg, chunked, go, threads=2):
    g = Graph()
    ts = [g.param(a.shape, a.astype(np.float32)) for a in arrays]
    s = g.const(seg, dtype="i32") if seg is not None else None
    out = ops.delta_rule(*ts, seg=s, chunked=chunked)
    grads = backward(ops.sum(ops.mul(out, g.const(go))), ts, checkpointing=False)
    rt = Runtime(g, CpuBackend(threads))
    plan = rt.compile([out] + [grads[t] for t in ts])
    rt.run(plan)
    return [plan.read(out)] + [plan.read(grads[t]) for t in ts]


@pytest.mark.parametrize("decay", [(-0.05, -0.001), (-1.0, -0.05), (-12.0, -3.0)], ids=["weak", "mid", "strong"])
@pytest.mark.parametrize("packed", [False, True], ids=["one", "packed"])
def test_chunked_equals_the_recurrence(decay, packed):
    arrays, go = _inputs(*decay)
    seg = _segments() if packed else None
    step = _run(arrays, seg, False, go)
    chunk = _run(arrays, seg, True, go)
    want = refs.delta_rule(*arrays, seg)
    np.testing.assert_allclose(chunk[0], want, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(step[0], want, rtol=1e-5, atol=2e-6)
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), step, chunk):
        scale = np.abs(a).max()
        assert np.abs(a - b).max() <= 2e-6 * max(scale, 1.0), f"{name}: {np.abs(a - b).max()} (scale {scale})"


def test_chunked_restarts_at_every_segment():
    arrays, go = _inputs(-0.1, -0.01)
    seg = _segments()
    whole = _run(arrays, None, True, go)[0]
    packed = _run(arrays, seg, True, go)[0]
    # where a packed sample starts, its rows are those of the sample alone (from a zero state)
    alone = _run([a[:, 100:129] for a in arrays], None, True, go[:, 100:129])[0]
    np.testing.assert_allclose(packed[0, 100:129], alone[0], rtol=1e-5, atol=1e-6)
    assert np.abs(whole[0, 100:129] - alone[0]).max() > 1e-3      # (without seg the state carries over)


def test_chunked_gives_the_same_bits_on_any_thread_count():
    arrays, go = _inputs(-1.0, -0.05)
    one = _run(arrays, _segments(), True, go, threads=1)
    two = _run(arrays, _segments(), True, go, threads=2)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)


def test_the_rule_picks_chunked_for_long_windows_of_wide_heads():
    from ggtrain.core.ops.recurrent import CHUNKED_MIN_STATE, CHUNKED_MIN_T

    def node(t, hk, hv, dk, dv, **kw):
        g = Graph()
        qk = [g.input((1, t, hk, dk)) for _ in range(2)]
        return ops.delta_rule(*qk, g.input((1, t, hv, dv)), g.input((1, t, hv)), g.input((1, t, hv)), **kw)

    d = int(np.sqrt(CHUNKED_MIN_STATE))
    assert node(CHUNKED_MIN_T, 2, 4, d, d).params["chunked"] is True
    assert node(CHUNKED_MIN_T - 1, 2, 4, d, d).params["chunked"] is False
    assert node(CHUNKED_MIN_T, 2, 4, d, d // 2).params["chunked"] is False
    assert node(CHUNKED_MIN_T, 2, 4, 8, 8, chunked=True).params["chunked"] is True
    assert node(CHUNKED_MIN_T, 2, 4, d, d, chunked=False).params["chunked"] is False
