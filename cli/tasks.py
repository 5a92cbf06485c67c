"""Multiple-choice task scoring for `eval --task` and `finetune --eval-task` (layer 6): the
task's items tokenized as lm-evaluation-harness does, scored by a KV-cached decoder with a
progress bar, summarised with standard errors."""
from __future__ import annotations

import sys

from tqdm import tqdm

from ggtrain.core.tasks import score_item, summarize
from ggtrain.errors import ConfigError
from ggtrain.formats.tasks import encode_items


def run_task(decoder, tokenizer, items: list, quiet: bool = False, desc: str = "task") -> dict:
    """summarize() of the scored items (formats.tasks.TaskItem); ConfigError naming the item
    that does not fit the decoder's context."""
    encoded = encode_items(tokenizer, items)
    scored = []
    bar = None if quiet else tqdm(total=len(items), unit="item", desc=desc, file=sys.stderr, leave=False)
    try:
        for item, (choices, gold) in zip(items, encoded):
            try:
                scored.append(score_item(decoder, choices, gold))
            except ConfigError as exc:
                raise ConfigError(f"{item.where}: {exc} (--ctx)") from None
            if bar is not None:
                bar.update(1)
                done = summarize(scored)
                bar.set_postfix(acc=f"{done['acc']:.3f}", acc_norm=f"{done['acc_norm']:.3f}")
    finally:
        if bar is not None:
            bar.close()
    return summarize(scored)


def task_words(result: dict, prefix: str = "") -> str:
    """'accuracy 0.6250 ± 0.0234, normalised 0.6500 ± 0.0230 (400 items)' of summarize()'s
    keys (with a prefix: "task_acc", ...)."""
    r = {k[len(prefix):]: v for k, v in result.items() if k.startswith(prefix)}
    return (f"accuracy {r['acc']:.4f} ± {r['acc_stderr']:.4f}, normalised {r['acc_norm']:.4f} "
            f"± {r['acc_norm_stderr']:.4f} ({r['items']} items)")
