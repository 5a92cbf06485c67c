"""Importance matrices (layer 4): per weight matrix of a model's blocks, the sum over tokens of
the squared activations entering it, per column, as llama.cpp's llama-imatrix collects them
(formats.imatrix writes its file).

llama-imatrix records the f32 input (src1) of every matrix product whose weight is named blk.*
(the output matrix only with its --process-output, which we do not offer), adding x[j] * x[j]
for each token in turn into a float32 sum per column, and counts the tokens. One forward pass
per chunk of text, each from an empty context, every position going through every block (it
asks for the logits of all of them, so no block skips rows). The inputs are read back from the
plan and summed here, in that order.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import numpy as np

from ggtrain.core.graph import Graph, Runtime
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.decoder import Inputs, Options, forward
from ggtrain.core.models.inference import frozen_net
from ggtrain.core.numerics import EXACT

# llama-imatrix ignores products of fewer rows (tokens) than this
MIN_ROWS = 16


def importance_sums(cfg: ModelConfig, weights: dict, backend, chunks: Iterable[np.ndarray], numerics: str = EXACT,
                    kv_f16: bool = False, progress: Callable[[int], None] | None = None) -> tuple:
    """({weight name: f32 sums of squared inputs}, {weight name: (n_mat,) int64 rows summed})
    over the chunks: a matrix's sums (n_cols,) and count (1,) (the tokens), the experts' (E,
    n_cols) and (E,) (the rows routed to each; module doc). chunks: each (T,) int32 token ids
    of one window, all of one length MIN_ROWS <= T <= cfg.ctx, each run from an empty context.
    weights, numerics, kv_f16: as inference.Runner's. progress(i) after chunk i. ValueError
    for a chunk of another length or too short."""
    acc_of: dict = {}         # {ids of an input (and its routing): running sums}, one for the weights sharing it
    rows_of: dict = {}        # {the same: rows summed per matrix}
    plan, length = None, 0
    for i, ids in enumerate(chunks):
        ids = np.asarray(ids, np.int32).reshape(-1)
        if plan is None:
            length = ids.size
            if not MIN_ROWS <= length <= cfg.ctx:
                raise ValueError(f"importance_sums: chunks of {length} tokens; {MIN_ROWS}..{cfg.ctx} are summed")
            g = Graph()
            net, stored = frozen_net(cfg, g, weights, None, numerics, kv_f16)
            net = dataclasses.replace(net, taps={})
            tokens = g.input((1, length), "i32", name="tokens")
            pos = g.input((length,), "i32", name="pos")
            forward(net, Inputs(tokens, pos), Options(head=False, n_ctx=length))
            runtime = Runtime(g, backend)
            for t, buf in stored.items():
                runtime.bind(t, buf)
            taps = net.taps                   # {weight name: (its input, None or its expert ids)}
            inputs = list({_key(tp): tp for tp in taps.values()}.values())     # q, k and v share one
            plan = runtime.compile([t for tp in inputs for t in tp if t is not None])
            runtime.set(pos, np.arange(length, dtype=np.int32))
        if ids.size != length:
            raise ValueError(f"importance_sums: chunk {i} has {ids.size} tokens, the first {length}")
        runtime.set(tokens, ids.reshape(1, -1))
        runtime.run(plan)
        for t, route in inputs:
            key, x = _key((t, route)), np.asarray(plan.read(t), np.float32)
            if route is None:
                x = x.reshape(-1, t.shape[-1])                                           # (T, n_cols)
                acc = acc_of.setdefault(key, np.zeros(x.shape[1], np.float32))
                for row in x:               # token after token, in f32: llama-imatrix's order
                    acc += row * row
                rows_of[key] = rows_of.get(key, 0) + np.array([x.shape[0]], np.int64)
            else:
                _add_routed(acc_of, rows_of, key, x, np.asarray(plan.read(route)), cfg.experts)
        if progress is not None:
            progress(i)
    if plan is None:
        return {}, {}
    return ({name: acc_of[_key(tp)].copy() for name, tp in taps.items()},
            {name: rows_of[_key(tp)].copy() for name, tp in taps.items()})


def _key(tap: tuple) -> tuple:
    """The identity of a tap (input, expert ids or None): the weights sharing both share sums."""
    return tuple(id(t) for t in tap)


def _add_routed(acc_of: dict, rows_of: dict, key, x: np.ndarray, ids: np.ndarray, experts: int) -> None:
    """Add the routed rows x (N, 1 or k, n_cols) into per-expert sums (E, n_cols) by ids (N, k):
    slot s of token n into expert ids[n, s] (x's row 0 or s), slot after slot, token after
    token, in f32 (np.add.at adds repeated indices one after another, in index order)."""
    acc = acc_of.setdefault(key, np.zeros((experts, x.shape[-1]), np.float32))
    for s in range(ids.shape[1]):
        row = x[:, s % x.shape[1]]
        np.add.at(acc, ids[:, s], row * row)
    rows_of[key] = rows_of.get(key, 0) + np.bincount(ids.reshape(-1), minlength=experts).astype(np.int64)
