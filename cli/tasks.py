"""Multiple-choice task scoring for `eval --task` and `finetune --eval-task` (layer 6): the
task's items tokenized as lm-evaluation-harness does, scored with a progress bar (many choices
in one batch in exact numbers; item by item through the KV-cached decoder in llama.cpp's),
summarized with standard errors."""
from __future__ import annotations

import re

from ggtrain.cli.common import progress_bar
from ggtrain.core.models.inference import Decoder
from ggtrain.core.numerics import EXACT, LLAMA
from ggtrain.core.tasks import score_item, score_items, summarize
from ggtrain.errors import ConfigError
from ggtrain.formats.tasks import encode_items


def run_task(items: list, tokenizer, cfg, weights: dict, backend, adapters: dict | None = None, n_ctx: int = 0,
             numerics: str = EXACT, kv_f16: bool = False, quiet: bool = False, desc: str = "task") -> dict:
    """summarize() of the scored items (formats.tasks.TaskItem) of the model (cfg, weights on
    backend, adapters); n_ctx: the most positions a choice may take (default the model's
    context). ConfigError naming the item that does not fit."""
    encoded = encode_items(tokenizer, items)
    bar = progress_bar(quiet, total=len(items), unit="item", desc=desc, leave=False)
    try:
        if numerics == LLAMA:
            decoder = Decoder(cfg, weights, backend, n_ctx=n_ctx or cfg.ctx, adapters=adapters, numerics=LLAMA,
                              kv_f16=kv_f16)
            scored = []
            for item, (choices, gold) in zip(items, encoded):
                try:
                    scored.append(score_item(decoder, choices, gold))
                except ConfigError as exc:
                    raise ConfigError(f"{item.where}: {exc} (--ctx)") from None
                if bar is not None:
                    bar.update(1)
            return summarize(scored)
        try:
            scored = score_items(cfg, weights, backend, encoded, adapters, n_ctx,
                                 progress=bar.update if bar is not None else None)
        except ConfigError as exc:
            at = re.match(r"item (\d+): (.*)", str(exc))
            if at is None:
                raise
            raise ConfigError(f"{items[int(at.group(1))].where}: {at.group(2)} (--ctx)") from None
        return summarize(scored)
    finally:
        if bar is not None:
            bar.close()


def task_words(result: dict, prefix: str = "") -> str:
    """'accuracy 0.6250 ± 0.0234, normalized 0.6500 ± 0.0230 (400 items)' of summarize()'s
    keys (with a prefix: "task_acc", ...)."""
    r = {k[len(prefix):]: v for k, v in result.items() if k.startswith(prefix)}

    def value(key: str) -> str:    # no standard error of one item
        return f"{r[key]:.4f}" + (f" ± {r[key + '_stderr']:.4f}" if r[key + "_stderr"] is not None else "")

    item = "item" if r["items"] == 1 else "items"
    return f"accuracy {value('acc')}, normalized {value('acc_norm')} ({r['items']} {item})"
