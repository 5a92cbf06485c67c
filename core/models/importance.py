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
    """({weight name: (n_cols,) f32 sum of squared inputs}, tokens summed) over the chunks:
    each (T,) int32 token ids of one window, all of one length MIN_ROWS <= T <= cfg.ctx, each
    run from an empty context. weights, numerics, kv_f16: as inference.Runner's.
    progress(i) after chunk i. ValueError for a chunk of another length or too short."""
    acc_of: dict = {}         # {id of an input: its running sums}, one for the weights sharing it
    count, plan, length = 0, None, 0
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
            taps = net.taps                                   # {weight name: its input (1, T, n_cols)}
            inputs = list({id(t): t for t in taps.values()}.values())     # q, k and v share one
            plan = runtime.compile(inputs)
            runtime.set(pos, np.arange(length, dtype=np.int32))
        if ids.size != length:
            raise ValueError(f"importance_sums: chunk {i} has {ids.size} tokens, the first {length}")
        runtime.set(tokens, ids.reshape(1, -1))
        runtime.run(plan)
        for t in inputs:
            x = np.asarray(plan.read(t), np.float32).reshape(length, t.shape[-1])      # (T, n_cols)
            acc = acc_of.setdefault(id(t), np.zeros(x.shape[1], np.float32))
            for row in x:               # token after token, in f32: llama-imatrix's order
                acc += row * row
        count += length
        if progress is not None:
            progress(i)
    if plan is None:
        return {}, 0
    return {name: acc_of[id(t)].copy() for name, t in taps.items()}, count
