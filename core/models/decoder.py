"""The one decoder graph of every model family (layer 4), as llama.cpp computes each.

token embedding -> L x [RMSNorm -> mixer -> residual -> RMSNorm -> FFN -> residual] ->
RMSNorm -> output projection (or the embedding, tied, when there is no output.weight).

The layers a block builds are the family's choice (Family.layer_kinds), looked up by name in
mixers.MIXERS and ffns.FFNS, never branches on a family's name. What a graph is built from is
explicit (net.py): a Net (config, parameter tensors, LoRA adapters and the numerics it
computes in), an Inputs record (token ids, positions, packed segments, the KV cache) and an
Options record (checkpointing, which logits, the run's context).
"""
from __future__ import annotations

import math

from ggtrain.core import ops
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.family import PER_LAYER_MODEL_PROJ, PER_LAYER_PROJ_NORM, PER_LAYER_TOKEN_EMBD
from ggtrain.core.models.ffns import FFNS
from ggtrain.core.models.mixers import MIXER_CACHE, MIXERS, RECURRENT
from ggtrain.core.models.net import Inputs, Net, Options, linear, norm
from ggtrain.errors import ConfigError

# what callers of the graph import from here
__all__ = ["Inputs", "MIXER_CACHE", "Net", "Options", "RECURRENT", "forward", "head_name", "linear", "output"]


def per_layer_inputs(net: Net, x, tokens):
    """Gemma 4's per-layer embeddings (B, T, L*P) of tokens (B, T), x their scaled token
    embeddings (B, T, C): per_layer_token_embd's rows times sqrt(P), plus the projection of x
    times 1/sqrt(C) RMS-normed per layer (per_layer_proj_norm), the sum times 1/sqrt(2)."""
    cfg = net.cfg
    b, t = tokens.shape
    lp, p = cfg.layers * cfg.per_layer_dim, cfg.per_layer_dim
    rows = ops.scale(ops.get_rows(net.params[PER_LAYER_TOKEN_EMBD], tokens), math.sqrt(p))        # (B, T, L*P)
    proj = ops.scale(linear(net, x, PER_LAYER_MODEL_PROJ), 1.0 / math.sqrt(cfg.dim))
    proj = norm(net, ops.reshape(proj, (b, t, cfg.layers, p)), PER_LAYER_PROJ_NORM)
    return ops.scale(ops.add(ops.reshape(proj, (b, t, lp)), rows), 1.0 / math.sqrt(2.0))


def _per_layer(net: Net, x, layer: int, pl):
    """What layer `layer` adds to x (B, T, C) from its per-layer embeddings (its P columns of
    pl, (B, T, L*P)): post_norm(proj(gelu(inp_gate x) * them))."""
    b, t, _ = x.shape
    p, lp = net.cfg.per_layer_dim, net.cfg.layers * net.cfg.per_layer_dim
    mine = ops.view(pl, (b, t, p), (t * lp, lp, 1), layer * p)
    gate = linear(net, x, f"blk.{layer}.inp_gate.weight")
    act = ops.geglu_f16(gate, mine) if net.llama else ops.geglu(gate, mine)
    return norm(net, linear(net, act, f"blk.{layer}.proj.weight"), f"blk.{layer}.post_norm.weight")


def block(net: Net, x, layer: int, inp: Inputs, opt: Options, pl=None):
    """One block on the residual stream x (B, T, C): the family's mixer and FFN, each after
    an RMSNorm, each (post-normed and scaled where the family says) added to x; then what
    the layer's per-layer embeddings add (pl: per_layer_inputs) and its output scale."""
    cfg, fam = net.cfg, net.cfg.family
    p = f"blk.{layer}."
    mixer, ffn = fam.layer_kinds(cfg, layer)
    graph = opt.checkpoint
    keep = graph.keep if graph is not None and not net.lora else None
    a = MIXERS[mixer](net, norm(net, x, p + "attn_norm.weight"), layer, inp, opt, keep)
    if fam.post_norms:
        a = norm(net, a, p + "post_attention_norm.weight")
    if cfg.residual_scale:
        a = ops.scale(a, cfg.residual_scale)
    t = x.shape[1]
    if opt.last_only and t > 1 and layer == cfg.layers - 1:
        # as llama.cpp's graphs (inp_out_ids): the last block's FFN, like the head, takes
        # only the row whose logits are wanted, so its products have llama.cpp's row count
        a, x = _last_row(a), _last_row(x)
    x = ops.add(x, a)
    if keep is not None:
        keep(x)
    f = FFNS[ffn](net, norm(net, x, p + fam.ffn_norm), layer, x)
    if fam.post_norms:
        f = norm(net, f, p + "post_ffw_norm.weight")
    if cfg.residual_scale:
        f = ops.scale(f, cfg.residual_scale)
    x = ops.add(x, f)
    if pl is not None:
        if opt.last_only and t > 1 and layer == cfg.layers - 1:
            pl = _last_row(pl)
        x = ops.add(x, _per_layer(net, x, layer, pl))
    out_scale = net.params.get(p + "layer_output_scale.weight")
    if out_scale is not None:      # gemma4: the block's output times a learned scalar
        x = ops.mul(x, out_scale)
    if graph is not None:
        graph.checkpoint(x)
    return x


def forward(net: Net, inp: Inputs, opt: Options = Options()):
    """Logits (B, T, V) for inp.tokens (B, T) i32 at positions inp.pos.

    With opt.checkpoint (a Graph), each block ends a segment of it (gradient checkpointing
    recomputes blocks in backward), except what Graph.keep marks: the fused attention node
    (so its output and the q, k, v its backward reads stay, and neither attention nor the q,
    k, v products run again) and the residual after it (so the output projection does not
    either). Backward then recomputes only the norms and the FFN's gate and up products: ~40%
    of a block's forward (less at long contexts), for ~5 (B, T, C) tensors a block instead of
    the ~6 C + 4 ff per token that no checkpointing keeps. (With adapters, TrainStep's own
    selective policy keeps the frozen products instead, and attention is recomputed:
    fine-tuning large models is short of memory, not time.) See Inputs and Options for the
    rest: opt.last_only gives (B, 1, V), inp.rows (M, V), opt.head=False hidden states.
    """
    cfg = net.cfg
    b, t = inp.tokens.shape
    if t > cfg.ctx:
        raise ConfigError(f"{cfg.arch}: sequence of {t} tokens exceeds the context {cfg.ctx}")
    x = ops.get_rows(net.params["token_embd.weight"], inp.tokens)                     # (B, T, C)
    if cfg.family.embed_scale:
        x = ops.scale(x, math.sqrt(cfg.dim))
    if cfg.embedding_scale:
        x = ops.scale(x, cfg.embedding_scale)
    pl = per_layer_inputs(net, x, inp.tokens) if cfg.per_layer_dim else None
    for i in range(cfg.layers):
        x = block(net, x, i, inp, opt, pl)
    if opt.last_only and t > 1 and not cfg.layers:
        x = _last_row(x)
    if inp.rows is not None:
        x = ops.get_rows(ops.reshape(x, (b * t, x.shape[-1])), inp.rows)             # (M, C)
    x = norm(net, x, cfg.family.output_norm)
    return output(net, x) if opt.head else x


def _last_row(x):
    """The last position of x (B, T, C) contiguous, as (B, 1, C)."""
    b, t, c = x.shape
    return ops.view(x, (b, 1, c), (t * c, c, 1), (t - 1) * c)


def head_name(cfg: ModelConfig) -> str:
    """The output matrix's tensor: the embedding when tied."""
    return "token_embd.weight" if cfg.tied else "output.weight"


def output(net: Net, x):
    """Logits (..., V) of normed hidden states x (..., C): the output projection (the
    embedding when tied), divided by logit_scale and soft-capped where the model says."""
    cfg = net.cfg
    logits = linear(net, x, head_name(cfg))
    if cfg.logit_scale != 1.0:
        logits = ops.scale(logits, 1.0 / cfg.logit_scale)
    if cfg.logit_softcap:
        c = cfg.logit_softcap
        logits = ops.scale(ops.tanh(ops.scale(logits, 1.0 / c)), c)
    return logits
