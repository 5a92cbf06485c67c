"""linear_cross_entropy: the loss over a frozen output matrix with its input gradient, the
logits never held. The kernel against float64 for the stored types a head comes in, its bits
across thread counts and SIMD levels, bad input; and the fused loss in a LoRA step against
the chunked logits it replaces (tests/test_decoder.py has the chunked against one chunk)."""
import numpy as np
import pytest

from ggtrain.core import ops
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.backend_kernel import run_kernel
from ggtrain.core.graph import Graph
from ggtrain.core.models import inference, losses as model_losses
from ggtrain.core.models.config import ModelConfig, trainable
from ggtrain.core.models.decoder import Inputs, Net, Options, forward
from ggtrain.core.models.inference import Runner
from ggtrain.core.optim import AdamW
from ggtrain.core.step import TrainStep
from ggtrain.errors import NativeError, ShapeError
from ggtrain.native import lib
from ggtrain.native.dtypes import nbytes
from tests import refs
from tests.family_cases import TINY, TINY_CASES
from tests.test_families import family_params
from tests.test_qdot8 import _kquant_raw

BACKENDS = {n: CpuBackend(n) for n in (1, 2, 3)}


def _stored(W: np.ndarray, w: str) -> tuple:
    """(raw bytes, the f32 matrix gguf-py dequantizes them to) of W in type w: quantized by
    gguf-py, or random super-blocks of W's shape for the K-quants (which it cannot quantize)."""
    from gguf import GGMLQuantizationType, quants
    t = GGMLQuantizationType[w.upper()]
    if w.endswith("_k"):
        raw = _kquant_raw(np.random.default_rng(W.size), w, *W.shape)
    else:
        raw = np.frombuffer(quants.quantize(W, t).tobytes(), np.uint8)
    return raw, quants.dequantize(raw.reshape(W.shape[0], -1), t).reshape(W.shape).astype(np.float32)


def _kernel(x, w, t, wtype="f32", scale=1.0, softcap=0.0, mean=True, grad=True, n_threads=1, backend=None):
    """dst of linear_cross_entropy_fwd_f32[_<wtype>]; w: f32 (V, C), or a stored matrix's bytes;
    on the CPU with n_threads, or on `backend` (the op tests' fixture: the GPU's on a GPU machine)."""
    n, c = x.shape
    dst = np.full(n * c + n, np.nan, np.float32)
    src = w if wtype == "f32" else (w, wtype, (len(w) // nbytes((1, c), wtype), c), (c, 1))
    suffix = "f32" if wtype == "f32" else f"f32_{wtype}"
    return run_kernel(f"linear_cross_entropy_fwd_{suffix}", dst, [x, src, t], ip=(int(mean), int(grad)),
                      fp=(scale, softcap), n_threads=n_threads, backend=backend or BACKENDS[n_threads])


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0", "q4_k", "q6_k", "f16", "bf16"])
def test_stored_heads_equal_float64_of_the_dequantized_matrix(wtype):
    """A head in each type a GGUF stores it in, 3 vocabulary blocks (the last short), rows
    crossing the kernel's group of 256 on one thread, ignored rows inside and at the end."""
    rng = np.random.default_rng(1)
    n, c, v = 300, 256, 700
    x = rng.standard_normal((n, c)).astype(np.float32)
    W = (rng.standard_normal((v, c)) * 0.3).astype(np.float32)
    t = rng.integers(0, v, n).astype(np.int32)
    t[[5, 100]] = -1
    t[-20:] = -1
    raw, Wd = _stored(W, wtype)
    x *= 0.3 / np.abs(Wd).max()          # logits of a few units (the random K-quant blocks are large)
    got = _kernel(x, raw, t, wtype)
    want = refs.linear_cross_entropy(x, Wd, t)
    _close(got, want, Wd, t)
    assert np.all(got[n * c:][t < 0] == 0) and np.all(got[:n * c].reshape(n, c)[t < 0] == 0)


def _close(got, want, w, t):
    """Losses to f32 rounding; each gradient (a sum over the vocabulary of p_j w_j, minus
    w_t, over the rows counted) to rounding of the largest |w| it adds up."""
    n = len(t)
    np.testing.assert_allclose(got[-n:], want[-n:], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got[:-n], want[:-n], rtol=0, atol=2e-6 * np.abs(w).max() / max((t >= 0).sum(), 1))


def test_same_bits_for_any_thread_count_and_plain_c_within_rounding():
    """Threads split the rows, each row's numbers its own: the same bits for 1, 2, 3 threads.
    Plain C (SIMD level 0) multiplies then adds where the SIMD GEMMs fuse: float64's result
    to rounding, as the SIMD one is."""
    rng = np.random.default_rng(2)
    n, c, v = 70, 96, 530
    x = rng.standard_normal((n, c)).astype(np.float32)
    raw, Wd = _stored(rng.standard_normal((v, c)).astype(np.float32), "q8_0")
    t = rng.integers(-1, v, n).astype(np.int32)
    one = _kernel(x, raw, t, "q8_0", softcap=4.0, scale=0.7)
    for k in (2, 3):
        np.testing.assert_array_equal(_kernel(x, raw, t, "q8_0", softcap=4.0, scale=0.7, n_threads=k), one)
    padded = np.where(np.arange(n) < 25, t, -1).astype(np.int32)   # planned loss rows' padding
    np.testing.assert_array_equal(_kernel(x, raw, padded, "q8_0", n_threads=3), _kernel(x, raw, padded, "q8_0"))
    _close(_kernel(x, raw, padded, "q8_0", n_threads=2), refs.linear_cross_entropy(x, Wd, padded), Wd, padded)
    want = refs.linear_cross_entropy(x, Wd, t, 0.7, 4.0)
    try:
        lib.gt_set_simd_level(0)
        plain = _kernel(x, raw, t, "q8_0", softcap=4.0, scale=0.7, n_threads=2)
    finally:
        lib.gt_set_simd_level(2)
    for got in (one, plain):
        _close(got, want, Wd, t)


def test_avx512_exps_keep_the_bits():
    """The exps of each vocabulary block take gt_expf16_ with AVX-512, gt_expf_ below it: the same
    losses and gradients bit for bit at SIMD levels 1 and 2, from logits spanning the exp's range
    (rows scaled so most exps underflow) and blocks whose length is not a multiple of 16."""
    if not lib.gt_cpu_features() & 2:
        pytest.skip("this CPU lacks AVX-512 (no second path to compare)")
    rng = np.random.default_rng(4)
    n, c, v = 40, 64, 601
    x = rng.standard_normal((n, c)).astype(np.float32)
    x[:10] *= 30.0
    raw, _ = _stored(rng.standard_normal((v, c)).astype(np.float32), "q8_0")
    t = rng.integers(-1, v, n).astype(np.int32)
    got = {}
    for level in (1, 2):
        lib.gt_set_simd_level(level)
        try:
            got[level] = [_kernel(x, raw, t, "q8_0", scale=0.7, grad=grad, n_threads=2) for grad in (True, False)]
        finally:
            lib.gt_set_simd_level(2)
    for a, b in zip(got[1], got[2]):
        np.testing.assert_array_equal(a, b)
    assert np.isfinite(got[2][0]).all() and (got[2][0][n * c:][t >= 0] > 0).all()


@pytest.mark.parametrize("wtype", ["q8_0", "q4_k"])
def test_many_vocabulary_blocks_on_the_test_backend(wtype, backend):
    """Enough rows times vocabulary that every backend takes W in more than one block (the
    GPU's blocks hold 2^24 logits: 1100 rows give blocks of 15104 rows, so two), with the
    running max growing between blocks (the rescaled accumulators), soft-capping, a logit
    scale, ignored rows: float64 of the dequantized matrix."""
    rng = np.random.default_rng(3)
    n, c, v = 1100, 256, 16000
    x = rng.standard_normal((n, c)).astype(np.float32)
    W = (rng.standard_normal((v, c)) * 0.3).astype(np.float32)
    W[-500:] *= 3.0                      # the last block's logits larger: the max grows there
    t = rng.integers(0, v, n).astype(np.int32)
    t[[7, 500]] = -1
    raw, Wd = _stored(W, wtype)
    x *= 0.5 / np.abs(Wd).max()
    got = _kernel(x, raw, t, wtype, scale=0.5, softcap=3.0, backend=backend)
    want = refs.linear_cross_entropy(x, Wd, t, scale=0.5, softcap=3.0)
    _close(got, want, Wd, t)


def test_no_counted_rows_gives_zeros(backend):
    x = np.ones((3, 32), np.float32)
    w = np.ones((5, 32), np.float32)
    got = _kernel(x, w, np.full(3, -1, np.int32), backend=backend)
    assert np.array_equal(got, np.zeros_like(got))


def test_bad_input_is_refused_with_its_reason(backend):
    x = np.ones((3, 32), np.float32)
    w = np.ones((5, 32), np.float32)
    with pytest.raises(NativeError, match=r"target of row 1 is 5, expected < V = 5"):
        _kernel(x, w, np.array([0, 5, 1], np.int32), backend=backend)
    g = Graph()
    xs, ts = g.input((3, 32)), g.input((3,), "i32")
    with pytest.raises(ShapeError, match="w \\(V, C\\) as stored"):
        ops.linear_cross_entropy(xs, g.input((32, 5)), ts)
    with pytest.raises(ShapeError, match="targets"):
        ops.linear_cross_entropy(xs, g.input((5, 32)), g.input((4,), "i32"))


@pytest.mark.parametrize("kw", [{}, TINY_CASES["gemma3"], dict(arch="granite", logit_scale=4.0)],
                         ids=["llama", "gemma3-softcap", "granite-logit-scale"])
def test_the_fused_loss_trains_as_the_chunked_logits_do(kw):
    """A LoRA-like step (frozen output matrix): the fused loss (one linear_cross_entropy) and
    the logits in chunks give the same losses and parameters over 3 AdamW steps, and the
    same FLOPs; the fused plan makes no logits, and counts its products as the ones only
    counted rows take (step.row_flops: the kernel leaves the padding rows after the last
    counted one out; the logits' matmul multiplies every row)."""
    cfg = ModelConfig(**{**TINY, **kw, "vocab": 600, "ctx": 16})
    b, t = 4, 16
    rng = np.random.default_rng(3)
    tok = rng.integers(0, cfg.vocab, (b, t + 1)).astype(np.int32)
    tok[1, 5:] = -1
    head = {"output.weight", "token_embd.weight"}
    runs = {}
    for fused in (False, True):
        g = Graph()
        init = family_params(cfg, 0, std=0.1)
        params = {k: g.param(v.shape, v, name=k, trainable=trainable(k) and k not in head)
                  for k, v in init.items()}
        assert model_losses.fused_loss_available(Net(cfg, params), CpuBackend(2))
        tokens, targets = g.input((b, t), "i32"), g.input((b, t), "i32")
        pos = g.input((t,), "i32")
        n = 1 if fused else 4
        weights = g.input((n,), name="chunk_weights")
        hidden = forward(Net(cfg, params), Inputs(tokens, pos), Options(checkpoint=g, head=False))
        loss = model_losses.chunked_loss(Net(cfg, params), hidden, targets, weights, grad=True, fused=fused)
        trained = [p for p in params.values() if p.requires_grad]
        st = TrainStep(loss, trained, AdamW(lr=1e-3), CpuBackend(2), checkpointing=True)
        feed = {tokens: np.maximum(tok[:, :-1], 0), targets: tok[:, 1:], pos: np.arange(t, dtype=np.int32),
                weights: model_losses.chunk_weights(tok[:, 1:], n)}
        losses = [st.step([feed], 1e-3) for _ in range(3)]
        kernels = {c.kernel for c in st._update.plan.calls}
        runs[fused] = (losses, {k: st.get(v) for k, v in params.items()}, kernels, st.flops, st.row_flops)
    (l0, p0, k0, f0, r0), (l1, p1, k1, f1, r1) = runs[False], runs[True]
    assert f1 == f0             # the same products counted (ops.product_flops)
    assert r0 == 0 and r1 == 2 * 2 * b * t * cfg.dim * cfg.vocab   # the logits and dx, every row
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for k in p0:
        np.testing.assert_allclose(p1[k], p0[k], rtol=1e-4, atol=1e-6)
    assert "cross_entropy_fwd_f32" in k0 and "cross_entropy_fwd_f32" not in k1
    assert "linear_cross_entropy_fwd_f32" in k1


def test_evaluation_takes_the_loss_without_logits(monkeypatch):
    """Runner.nll (ggtrain eval) with f32 numbers: one linear_cross_entropy without its
    gradient, the same NLL as the logits in chunks, the plan holding no logits; llama.cpp's
    numbers (act8) keep their chunks (the head's product in 8 bits)."""
    cfg = ModelConfig(**{**TINY, "vocab": 600, "ctx": 16})
    weights = family_params(cfg, 0, std=0.3)
    tok = np.random.default_rng(4).integers(0, cfg.vocab, (2, 17)).astype(np.int32)
    monkeypatch.setattr(model_losses, "LOGITS_BUDGET", 1024)
    monkeypatch.setattr(model_losses, "CHUNK_BYTES", 9 * 600 * 4)
    fused = Runner(cfg, weights, CpuBackend(2), batch=2, length=16)
    got = fused.nll(tok[:, :-1], tok[:, 1:])
    kernels = {c.kernel for c in fused._plan_loss.plan.calls}
    assert "linear_cross_entropy_fwd_f32" in kernels and "cross_entropy_fwd_f32" not in kernels
    monkeypatch.setattr(inference, "fused_loss_available", lambda *a: False)
    chunked = Runner(cfg, weights, CpuBackend(2), batch=2, length=16)
    assert chunked.chunks.shape == (4,)
    assert got == pytest.approx(chunked.nll(tok[:, :-1], tok[:, 1:]), rel=1e-6)
    assert fused.runtime.memory.arena < chunked.runtime.memory.arena
