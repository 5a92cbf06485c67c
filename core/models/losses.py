"""The losses of a decoder's outputs (layer 4): mean cross-entropy over a window (in chunks of
rows when the logits would be large, or fused with the output projection), and per-sequence
weighted NLL sums for preference objectives (core/preference.py).

Each takes the normed hidden states the output projection reads (decoder.forward with
Options(head=False)) and a net.Net, so the logits are made a chunk at a time or not at all.
"""
from __future__ import annotations

import numpy as np

from ggtrain.core import ops
from ggtrain.core.autograd import backward
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.decoder import Net, head_name, output


def loss(logits, targets):
    """Mean cross-entropy of logits (B, T, V) against targets (B, T) i32, or of logits (M, V)
    against targets (M,) (negative targets: ignored)."""
    v = logits.shape[-1]
    n = logits.size // v
    return ops.cross_entropy(ops.reshape(logits, (n, v)), ops.reshape(targets, (n,)))


# Logits of at most this many bytes are made at once; a loss over more is taken in chunks of
# rows (Gemma's 262144-token vocabulary makes 1 MiB of f32 logits a position). Each chunk
# multiplies the whole output matrix, dequantizing it a tile at a time for its rows: with 32
# rows a chunk (32 MiB) Gemma 3 270M's Q8_0 output projection ran at 140-160 GFLOP/s and took
# 62% of a LoRA update, with 128 rows at 220-234 (the update 7.4 s -> 5.8 s, ctx 512 b2), and
# 256 rows ran 13-18% faster than 128 again (measured alternately, x @ W.T and g @ W).
LOGITS_BUDGET = 256 * 2**20
CHUNK_BYTES = 256 * 2**20


def loss_chunks(cfg: ModelConfig, rows: int, head_trained: bool = False) -> int:
    """How many chunks chunked_loss takes rows positions in: 1 while their logits fit
    LOGITS_BUDGET, or when the output matrix is trained (each chunk would add a (V, C)
    weight gradient, which outweighs the logits saved unless rows >> 2 C), else chunks of
    about CHUNK_BYTES of logits."""
    full = rows * cfg.vocab * 4
    if full <= LOGITS_BUDGET or head_trained:
        return 1
    per = max(1, CHUNK_BYTES // (cfg.vocab * 4))
    return -(-rows // per)


def chunk_weights(targets: np.ndarray, n_chunks: int) -> np.ndarray:
    """(n_chunks,) f32: each chunk's share of the positions with a target (targets (..., T)
    flattened, negative ids ignored), so the weighted chunk means are the mean over all."""
    flat = np.asarray(targets).reshape(-1)
    size = -(-flat.size // n_chunks)
    counts = np.array([(flat[k * size:(k + 1) * size] >= 0).sum() for k in range(n_chunks)], np.float64)
    total = counts.sum()
    return (counts / total if total else counts).astype(np.float32)


def fused_loss_available(net: Net, backend) -> bool:
    """Whether the loss over the output matrix can be one ops.linear_cross_entropy, its input
    gradient taken in the forward and no logits held (chunked_loss and sequence_nll with
    fused): a frozen output matrix (LoRA) with no adapter and no bias, in exact numerics, on a
    backend with the kernel for its type (the CPU's; CUDA takes the chunked logits)."""
    name = head_name(net.cfg)
    w = net.params.get(name)
    if (w is None or w.requires_grad or name in net.lora or name[:-len("weight")] + "bias" in net.params
            or net.llama):
        return False
    return backend.supports(ops.OPS["linear_cross_entropy"].kernel_name_for(w))


def _fused_rows(net: Net, x2, t1, mean: bool, grad: bool) -> tuple:
    """(nll (N,), dx (N, C)) of ops.linear_cross_entropy over rows x2 (N, C), targets t1."""
    n, c = x2.shape
    cfg = net.cfg
    out = ops.linear_cross_entropy(x2, net.params[head_name(cfg)], t1, scale=1.0 / cfg.logit_scale,
                                   softcap=cfg.logit_softcap or 0.0, mean=mean, grad=grad)
    return ops.view(out, (n,), (1,), n * c), ops.view(out, (n, c), (c, 1), 0)


def chunked_loss(net: Net, x, targets, weights, grad: bool = False, fused: bool = False):
    """Mean cross-entropy of the logits of normed hidden states x (..., C) against targets
    (...) i32 (negative: ignored), len(weights) chunks of rows at a time: chunk k's mean
    times weights[k] (its share of the counted rows, chunk_weights), summed. One chunk is
    loss(output(x), targets) exactly. Forward only (evaluation), no more than a chunk's
    (rows, V) logits are held. With grad (training with the output matrix frozen: LoRA),
    each chunk's gradient of its rows of x is computed right after its loss, in the
    forward, and handed to the backward (ops.with_grad): its logits die there and are never
    recomputed. (A trained output matrix would get a (V, C) gradient per chunk, more than
    the logits saved: loss_chunks gives it one chunk.) fused (fused_loss_available; with
    one chunk): one ops.linear_cross_entropy over all rows gives the mean (and with grad
    its gradient), the logits never made (FlashAttention's running softmax over the
    vocabulary)."""
    k_total = weights.shape[0]
    x2, t1 = _rows(x, targets)
    if fused:
        if k_total != 1:
            raise ValueError("chunked_loss: the fused loss takes its rows in one chunk")
        nll, dx = _fused_rows(net, x2, t1, mean=True, grad=grad)
        ce = ops.sum(nll)
        return ops.mul(ops.with_grad(ce, x2, dx) if grad else ce, ops.reshape(weights, ()))
    if k_total == 1:
        return ops.mul(ops.cross_entropy(output(net, x2), t1), ops.reshape(weights, ()))
    total = None
    for k, (lo, m, xk, tk) in enumerate(_chunks(x2, t1, k_total)):
        ce = ops.cross_entropy(output(net, xk), tk)
        if grad:   # d ce / d xk now; the backward scales it by the chunk's upstream gradient
            ce = ops.with_grad(ce, xk, backward(ce, [xk], checkpointing=False)[xk])
        part = ops.mul(ce, ops.view(weights, (), (), k))
        total = part if total is None else ops.add(total, part)
    return total


def _rows(x, targets) -> tuple:
    """x (..., C) and targets (...) as (N, C) rows and (N,) targets."""
    c = x.shape[-1]
    n = x.size // c
    return ops.reshape(x, (n, c)), ops.reshape(targets, (n,))


def _chunks(x2, t1, n_chunks: int):
    """(lo, m, rows, targets) of n_chunks consecutive chunks of x2 (N, C) and t1 (N,): views
    of about N / n_chunks rows each (the whole tensors for one chunk)."""
    n, c = x2.shape
    if n_chunks == 1:
        yield 0, n, x2, t1
        return
    size = -(-n // n_chunks)
    for lo in range(0, n, size):
        m = min(size, n - lo)
        yield lo, m, ops.view(x2, (m, c), (c, 1), lo * c), ops.view(t1, (m,), (1,), lo)


def sequence_nll(net: Net, x, targets, select, n_chunks: int = 1, grad: bool = False, fused: bool = False):
    """Weighted sums of per-position losses: select (K, N) @ nll (N,), (K,), where nll[r] is
    -log p(targets[r]) at normed hidden state x[r] (x (N, C), targets (N,) i32; 0 where the
    target is negative). The summed or mean log-probability of each sequence a preference
    loss compares (core/preference.py). Taken n_chunks row chunks at a time (loss_chunks),
    as chunked_loss; with grad (LoRA: a frozen output matrix) each chunk's per-row input
    gradients are computed in the forward (ops.with_grad, row-wise) and its logits die there.
    fused (one chunk): ops.linear_cross_entropy's per-row losses (and with grad gradients)."""
    k_rows = select.shape[0]
    x2, t1 = _rows(x, targets)
    n = x2.shape[0]
    if fused:
        if n_chunks != 1:
            raise ValueError("sequence_nll: the fused loss takes its rows in one chunk")
        nll, dx = _fused_rows(net, x2, t1, mean=False, grad=grad)
        if grad:
            nll = ops.with_grad(nll, x2, dx)
        return ops.reshape(ops.matmul(select, ops.reshape(nll, (n, 1))), (k_rows,))
    total = None
    for lo, m, xk, tk in _chunks(x2, t1, n_chunks):
        whole = m == n
        nll = ops.cross_entropy_rows(output(net, xk), tk)
        if grad and not whole:   # d nll[r] / d xk[r] now; the backward scales row r by its upstream
            nll = ops.with_grad(nll, xk, backward(ops.sum(nll), [xk], checkpointing=False)[xk])
        sk = select if whole else ops.view(select, (k_rows, m), (n, 1), lo)
        part = ops.reshape(ops.matmul(sk, ops.reshape(nll, (m, 1))), (k_rows,))
        total = part if total is None else ops.add(total, part)
    return total
