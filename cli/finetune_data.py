"""What `finetune` trains on (layer 6): its --data as one object whatever the kind (plain text in
token windows, records packed into windows, preference pairs packed side by side), each giving
the run the same things: batches, validation batches, a fingerprint and the words of the summary
line. Every process draws the global batches (batch x processes) and takes its rows of them."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

import numpy as np

from ggtrain.cli.common import file_errors, read_corpus, read_records
from ggtrain.core.data import (PackedBatches, Picked, TokenWindows, eval_windows, pack, pack_pairs, split_samples,
                               split_tokens)
from ggtrain.core.distributed import World
from ggtrain.core.preference import PreferenceConfig, pair_slots
from ggtrain.errors import ConfigError
from ggtrain.formats.chat import template_id
from ggtrain.formats.sample_cache import packed_rows
from ggtrain.formats.dataset import is_plain_text, record_template
from ggtrain.formats.gguf import GGUFFile
from ggtrain.formats.tokenizer import Tokenizer
from ggtrain.words import count


@dataclass(frozen=True)
class DataOptions:
    """The options that decide what a finetune trains on (a checkpoint keeps them)."""

    path: pathlib.Path
    ctx: int
    packing: bool = True
    drop_long: bool = False
    train_on_inputs: bool = False
    val_split: float = 0.0
    seed: int = 0
    chat_template: pathlib.Path | None = None
    token_cache: str | None = None


@dataclass
class TrainingData:
    """batches: the batch source (TokenWindows or PackedBatches); val_batches: the global
    validation batches; per_epoch: batches an epoch; fingerprint: sha256 of what is trained on
    (a checkpoint is tied to it); summary: the words of the summary line. Packed kinds also give
    packed (the training rows), val_packed, pairs (pair slots of a physical batch) and n_pairs."""

    batches: object
    val_batches: list
    per_epoch: int
    fingerprint: str
    summary: str
    packed: object = None
    val_packed: object = None
    pairs: int = 0
    n_pairs: int = 0

    def loss_rows(self, batch: int, skips_uncounted: bool) -> tuple:
        """(loss rows, counted share) of a physical batch of `batch` rows: logits only where a
        target is, at most the trained positions of the fullest rows (0: every position, plain
        text); counted: the mean share of those rows a batch fills (what the backend's loss head
        multiplies when it skips the padding)."""
        if self.packed is None:
            return 0, 1.0
        per_row = np.sort(self.packed.trained_per_row())[::-1]
        rows = int(per_row[:batch].sum())
        counted = min(1.0, float(per_row.mean()) * batch / max(rows, 1)) if skips_uncounted else 1.0
        if self.val_batches:
            rows = max(rows, max(int((v["targets"] >= 0).sum()) for v in self.val_batches))
        return rows, counted


def eval_batches(data, batch: int) -> list:
    """Every row of packed data once, in order, as batches (the last padded with empty rows)."""
    out = []
    for start in range(0, data.rows, batch):
        part = {k: v[start:start + batch] for k, v in data.fields().items()}
        short = batch - len(part["tokens"])
        if short:
            fill = {"tokens": 0, "targets": -1, "pos": 0, "seg": -1, "pair": -1}
            part = {k: np.concatenate([v, np.full((short, data.ctx), fill[k], np.int32)]) for k, v in part.items()}
        out.append(part)
    return out


def training_data(opts: DataOptions, tok: Tokenizer, base_file: GGUFFile, global_batch: int,
                  preference: PreferenceConfig | None, quiet: bool, world: World) -> TrainingData:
    """The TrainingData of --data (see the module docstring); ConfigError when the data's kind
    does not suit the objective, or when it fills less than one batch."""
    data = opts.path
    method = preference.method if preference is not None else "sft"

    def check_kind(kind: str, layout: str) -> None:
        if (kind == "preference") != (preference is not None):
            raise ConfigError(f"--data {data}: preference pairs train with --method dpo or orpo" if preference is None
                              else f"--method {method} trains on preference pairs ({{\"prompt\", \"chosen\", "
                                   f"\"rejected\"}} records); --data {data} holds "
                                   f"{'plain text' if kind == 'plain' else layout + ' records'}")
        if preference is not None and opts.train_on_inputs:
            raise ConfigError(f"--train-on-inputs does not apply to --method {method}: its loss compares the answers")

    with file_errors(f"--data {data}"):
        plain = is_plain_text(data)
    if plain:
        check_kind("plain", "plain")
        return _plain(opts, tok, global_batch, quiet, world)
    records = read_records(data, tok, lambda kind, conv: record_template(kind, conv, base_file, opts.chat_template),
                           template_id(base_file, opts.chat_template), opts.train_on_inputs, opts.token_cache, quiet,
                           world, check_kind)
    spec = f"ctx={opts.ctx}|packing={opts.packing}|drop_long={opts.drop_long}|val={opts.val_split}|seed={opts.seed}"

    def packed_part(part: str, make) -> tuple:     # packed rows are kept beside the samples, keyed by what decides them
        return packed_rows(records.cache_dir, records.key, f"{part}|{spec}", make)

    if records.kind == "preference":
        return _pairs(opts, records, packed_part, global_batch, world, method)
    return _records(opts, records, packed_part, global_batch)


def _plain(opts: DataOptions, tok: Tokenizer, global_batch: int, quiet: bool, world: World) -> TrainingData:
    """Plain text: token windows of the text's tokens (the end held out)."""
    corpus = read_corpus(opts.path, tok, tok.add_bos, opts.token_cache, quiet, world)
    train_ids, val_ids = split_tokens(corpus.ids, opts.val_split, opts.ctx)
    batches = TokenWindows(train_ids, opts.ctx, global_batch, opts.seed + 1)
    return TrainingData(batches, eval_windows(val_ids, opts.ctx, global_batch, 8) if len(val_ids) else [],
                        batches.windows_per_epoch, corpus.fingerprint,
                        f"{len(train_ids):,} training / {len(val_ids):,} validation tokens in windows of {opts.ctx}")


def _enough(opts: DataOptions, packed, global_batch: int) -> None:
    if packed.rows < global_batch:
        raise ConfigError(f"--data {opts.path}: {count(packed.rows, 'window')} of {opts.ctx} tokens, fewer than one batch of "
                          f"{global_batch}; use a smaller --batch or --ctx")


def _records(opts: DataOptions, records, packed_part, global_batch: int) -> TrainingData:
    """Text, prompt/completion, instruction and chat records: samples packed into windows."""
    train_s, val_s = split_samples(records.samples, opts.val_split, opts.seed)
    packed, stats, fingerprint, _ = packed_part("train", lambda allocate: pack(
        train_s, opts.ctx, packing=opts.packing, drop_long=opts.drop_long, allocate=allocate))
    _enough(opts, packed, global_batch)
    batches = PackedBatches(packed, global_batch, opts.seed + 1)
    val = (eval_batches(packed_part("val", lambda allocate: pack(
        val_s, opts.ctx, packing=opts.packing, drop_long=opts.drop_long, allocate=allocate))[0], global_batch)
        if len(val_s) else [])
    summary = (f"{count(stats.samples, 'sample')}, {stats.trained:,} trained of {count(stats.tokens, 'token')} "
               f"({stats.truncated} cut, {stats.dropped} dropped at --ctx {opts.ctx}, {stats.empty} with "
               f"nothing to train) in {count(stats.rows, 'window')}{'' if opts.packing else ' (no packing)'}")
    return TrainingData(batches, val, batches.batches_per_epoch, fingerprint, summary, packed=packed)


def _pairs(opts: DataOptions, records, packed_part, global_batch: int, world: World, method: str) -> TrainingData:
    """Preference pairs: each pair's chosen and rejected sides packed together."""
    every = records.samples
    train_p, val_p = split_samples(every, opts.val_split, opts.seed)
    packed, stats, fingerprint, _ = packed_part("train", lambda allocate: pack_pairs(
        train_p, opts.ctx, packing=opts.packing, drop_long=opts.drop_long, where=Picked(records.where, train_p.idx),
        allocate=allocate))
    _enough(opts, packed, global_batch)
    batches = PackedBatches(packed, global_batch, opts.seed + 1)
    val_packed = (packed_part("val", lambda allocate: pack_pairs(
        val_p, opts.ctx, packing=opts.packing, drop_long=opts.drop_long, first_id=len(train_p),
        where=Picked(records.where, val_p.idx), allocate=allocate))[0] if len(val_p) else None)
    pairs = pair_slots(packed.pair, global_batch // world.size)
    if val_packed is not None:
        pairs = max(pairs, pair_slots(val_packed.pair, global_batch // world.size))
    summary = (f"{count(stats.packed, 'preference pair')} ({stats.truncated} cut, {stats.dropped} dropped at --ctx "
               f"{opts.ctx}), {stats.trained:,} trained of {count(stats.tokens, 'token')} in {count(stats.rows, 'window')}; {method}")
    return TrainingData(batches, eval_batches(val_packed, global_batch) if val_packed is not None else [],
                        batches.batches_per_epoch, fingerprint, summary, packed=packed, val_packed=val_packed,
                        pairs=pairs, n_pairs=len(every))
