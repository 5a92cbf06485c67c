"""Preference objectives (layer 4): DPO and ORPO on packed pairs of sequences.

A pair is a prompt with a chosen and a rejected completion; data.pack_pairs lays both
sequences side by side in one row and marks their positions with `pair` = 2 * id + side
(side 0: chosen). The model's loss at each trained position, nll (N,) (losses.sequence_nll),
is reduced each batch by a selection matrix S (K, N) fed with it: K = 2P + 1 for P pair
slots, row p the chosen sequence of slot p, row P + p its rejected one, row 2P the chosen
tokens' mean (ORPO's SFT term). Slots a batch does not fill carry weight 0.

DPO (Rafailov et al. 2023, the sigmoid loss), log-probabilities summed over each completion,
the reference's from the model before training (LoRA: the base; cached per pair, see
TextRun.compute_reference):

    h = beta * ((logp_c - ref_c) - (logp_r - ref_r)),   loss = mean over pairs of softplus(-h)

which is -log sigmoid(h): log 2 when the policy is the reference. The reported rewards are
beta * (logp - ref) of each side. With rpo_alpha > 0 (RPO, Pang et al. 2024; TRL's rpo_alpha)
rpo_alpha times the chosen tokens' mean NLL is added: DPO alone on pairs the model did not
write lowers the rejected answers more than it raises the chosen ones, and its greedy text
need not become the chosen side's.

ORPO (Hong et al. 2024), a = each completion's mean log-probability per token:

    z = (a_c - log(1 - e^a_c)) - (a_r - log(1 - e^a_r))     (the log odds ratio)
    loss = the chosen tokens' mean NLL + lambda * mean over pairs of softplus(-z)

with rewards lambda * a (as TRL reports them). Both are composites of registry ops
(cross_entropy_rows, matmul, softplus, log1mexp), so their gradients are the autodiff's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggtrain.core import ops
from ggtrain.errors import ConfigError

METHODS = ("sft", "dpo", "orpo")
METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy")


@dataclass(frozen=True)
class PreferenceConfig:
    """A preference objective: method "dpo" (beta) or "orpo" (orpo_lambda)."""
    method: str = "dpo"
    beta: float = 0.1
    orpo_lambda: float = 0.1
    rpo_alpha: float = 0.0

    def __post_init__(self):
        if self.method not in METHODS[1:]:
            raise ConfigError(f"--method {self.method!r}: a preference objective is one of "
                              f"{', '.join(METHODS[1:])}")
        if not self.beta > 0:
            raise ConfigError(f"--beta must be > 0, got {self.beta}")
        if not self.orpo_lambda >= 0:
            raise ConfigError(f"--orpo-lambda must be >= 0, got {self.orpo_lambda}")
        if not self.rpo_alpha >= 0:
            raise ConfigError(f"--rpo-alpha must be >= 0, got {self.rpo_alpha}")
        if self.rpo_alpha and self.method != "dpo":
            raise ConfigError(f"--rpo-alpha adds an SFT term to DPO; --method {self.method} has its own")


def pair_slots(pair: np.ndarray, batch: int) -> int:
    """Pair slots a physical batch of `batch` rows of pair codes (rows, ctx) can need: the
    pairs of its fullest rows."""
    per_row = np.array([np.unique(r[r >= 0] // 2).size for r in pair], np.int64)
    return int(np.sort(per_row)[::-1][:batch].sum())


class PairLoss:
    """The graph inputs and loss of a preference objective over `pairs` slots and `rows`
    trained positions (the loss rows of a physical batch)."""

    def __init__(self, graph, config: PreferenceConfig, pairs: int, rows: int):
        if pairs < 1 or rows < 1:
            raise ConfigError(f"preference loss: {pairs} pair slots over {rows} positions")
        self.config, self.pairs, self.rows = config, pairs, rows
        k = 2 * pairs + 1
        self.select = graph.input((k, rows), name="pair_select")
        self.weight = graph.input((pairs,), name="pair_weight")     # 1 / pairs in the batch, 0 unused
        # DPO: the reference's NLL of each sequence; ORPO: 1 in unused slots (keeps log1mexp finite)
        self.offset = graph.input((k,), name="pair_offset")

    def loss(self, nll) -> tuple:
        """(scalar loss, [outputs the metrics read]) from nll (K,) = select @ per-position NLL."""
        p, cfg = self.pairs, self.config
        chosen = lambda t: ops.view(t, (p,), (1,), 0)      # noqa: E731
        rejected = lambda t: ops.view(t, (p,), (1,), p)    # noqa: E731
        if cfg.method == "dpo":
            d = ops.sub(self.offset, nll)                   # (K,) logp - ref logp
            h = ops.scale(ops.sub(chosen(d), rejected(d)), cfg.beta)
            loss = ops.sum(ops.mul(self.weight, ops.softplus(ops.scale(h, -1.0))))
            if cfg.rpo_alpha:
                loss = ops.add(loss, ops.scale(ops.view(nll, (), (), 2 * p), cfg.rpo_alpha))
            return loss, [d]
        a = ops.scale(ops.add(nll, self.offset), -1.0)      # (K,) mean logp of each sequence
        sides = ops.view(a, (2 * p,), (1,), 0)
        odds = ops.sub(sides, ops.log1mexp(sides))          # log(p / (1 - p))
        z = ops.sub(chosen(odds), rejected(odds))
        ratio = ops.sum(ops.mul(self.weight, ops.softplus(ops.scale(z, -1.0))))
        loss = ops.add(ops.view(nll, (), (), 2 * p), ops.scale(ratio, cfg.orpo_lambda))
        return loss, [a]

    def feed(self, codes: np.ndarray, reference: np.ndarray | None) -> dict:
        """{input tensor: array} for one physical batch. codes (rows,): the pair code
        (2 * id + side) of each loss row, -1 where unused; reference (ids, 2): each pair's
        reference NLL (chosen, rejected), or None (DPO's reference pass: zero)."""
        p, n_rows = self.pairs, self.rows
        codes = np.asarray(codes, np.int64)
        cols = np.flatnonzero(codes >= 0)
        ids, slot = np.unique(codes[cols] // 2, return_inverse=True)
        side = codes[cols] % 2
        n = len(ids)
        if n > p:
            raise ConfigError(f"a batch holds {n} preference pairs, more than the {p} planned")
        at = slot + side * p                         # the selection row of each loss row
        select = np.zeros((2 * p + 1, n_rows), np.float32)
        offset = np.zeros(2 * p + 1, np.float32)
        chosen = cols[side == 0]
        select[2 * p, chosen] = 1.0 / max(1, len(chosen))    # the chosen tokens' mean NLL
        if self.config.method == "dpo":
            select[at, cols] = 1.0
            if reference is not None:
                offset[:n], offset[p:p + n] = reference[ids, 0], reference[ids, 1]
        else:
            counts = np.bincount(at, minlength=2 * p)
            select[at, cols] = 1.0 / counts[at]
            offset[n:p], offset[p + n:2 * p] = 1.0, 1.0
        weight = np.zeros(p, np.float32)
        weight[:n] = 1.0 / max(1, n)
        return {self.select: select, self.weight: weight, self.offset: offset}

    def sides(self, outputs: list, feed: dict) -> tuple:
        """(chosen, rejected) arrays (n,) of the pairs of one batch: DPO logp - ref logp,
        ORPO mean logp; outputs: the batch's values of loss()'s outputs."""
        n = int((feed[self.weight] > 0).sum())
        v = np.asarray(outputs[0], np.float64)
        return v[:n], v[self.pairs:self.pairs + n]

    def sums(self, batches: list) -> list:
        """[pairs, sum of chosen rewards, of rejected rewards, of margins, pairs whose chosen
        reward is higher] over [(outputs, feed)] of physical batches: what metrics() averages,
        in a form the processes of a data-parallel run add up."""
        scale = self.config.beta if self.config.method == "dpo" else self.config.orpo_lambda
        c, r = (np.concatenate(x) * scale for x in zip(*(self.sides(o, f) for o, f in batches)))
        return [float(len(c)), float(c.sum()), float(r.sum()), float((c - r).sum()), float((c > r).sum())]

    @staticmethod
    def metrics(sums) -> dict:
        """TRL's preference metrics from sums() (of every process): the mean rewards of the
        chosen and rejected sides, their margin, and the fraction of pairs whose chosen reward
        is higher (rewards_accuracy). Empty without pairs."""
        n, c, r, margin, right = (float(x) for x in sums)
        if not n:
            return {}
        return dict(zip(METRICS, (c / n, r / n, margin / n, right / n)))
