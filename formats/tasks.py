"""Multiple-choice task files (layer 5): items of (context, continuation) choices with a gold
answer, as lm-evaluation-harness scores them, from three formats:

    JSON lines (or a JSON array)   {"context": str, "choices": [str, ...], "gold": int} (from 0);
                                   each choice is scored as the continuation `delimiter +
                                   choice` of the context (field "delimiter", default " ",
                                   lm-evaluation-harness's target delimiter)
    --hellaswag (llama.cpp's file  6 lines a task: the context (activity label: text), the gold
    for llama-perplexity)          ending's index (0-3), 4 endings; continuation " " + ending
    --winogrande (llama.cpp's CSV) index,sentence,option1,option2,answer (1 or 2) a line, the
                                   sentence with one "_"; lm-evaluation-harness's partial
                                   scoring: the context is the sentence up to "_" with each
                                   option put in, the continuation " " + the rest (stripped),
                                   the same for both

Each choice also carries the length its log-likelihood is normalised by for acc_norm: the
choice's text in characters, as lm-evaluation-harness counts it. Errors are one-line
FormatErrors naming the file, the line and the field.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ggtrain.errors import FormatError
from ggtrain.formats.dataset import _json_array, _json_lines

FORMATS = ("jsonl", "hellaswag", "winogrande")


@dataclass(frozen=True)
class TaskChoice:
    context: str
    continuation: str
    norm_len: int      # characters acc_norm divides by


@dataclass(frozen=True)
class TaskItem:
    choices: tuple     # of TaskChoice
    gold: int
    where: str         # "file line 7", for messages


def read_task(path, fmt: str = "jsonl") -> list:
    """The items of a task file in format fmt (one of FORMATS): list[TaskItem].

    Raises FormatError naming the file and line for anything malformed or an empty file,
    FileNotFoundError when it does not exist."""
    path = os.fspath(path)
    if fmt not in FORMATS:
        raise ValueError(f"task format {fmt!r}: expected one of {', '.join(FORMATS)}")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise FormatError(f"{path} line {line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None
    if fmt == "jsonl" and text.strip() and text.lstrip()[0] not in "{[":
        other = _looks_like(text)
        if other:
            raise FormatError(f"{path}: not JSON lines; it looks like llama-perplexity's {other[0]} file: "
                              f"give {other[1]}")
    items = {"jsonl": _jsonl, "hellaswag": _hellaswag, "winogrande": _winogrande}[fmt](text, path)
    if not items:
        raise FormatError(f"{path}: no task items")
    return items


def _looks_like(text: str) -> tuple | None:
    """(name, option) of the other task format text has the layout of, or None: HellaSwag's
    6 lines an item with the gold index second, Winogrande's 5 CSV fields with a "_" to fill."""
    lines = text.rstrip("\n").split("\n")
    if len(lines) % 6 == 0 and lines[1].strip() in ("0", "1", "2", "3"):
        return ("HellaSwag", "--hellaswag")
    fields = _csv_fields(lines[-1].rstrip("\r"))
    if fields is not None and "_" in fields[1] and fields[4].strip() in ("1", "2"):
        return ("Winogrande", "--winogrande")
    return None


def _jsonl(text: str, path: str) -> list:
    records = _json_array(text, path) if text.lstrip().startswith("[") else _json_lines(text, path)
    items = []
    for at, rec in records:
        if not isinstance(rec, dict):
            raise FormatError(f'{at}: an item is a JSON object {{"context", "choices", "gold"}}')
        for key in ("context", "choices", "gold"):
            if key not in rec:
                raise FormatError(f'{at}: the item has no "{key}" field')
        context, choices, gold = rec["context"], rec["choices"], rec["gold"]
        delimiter = rec.get("delimiter", " ")
        if not isinstance(context, str) or not isinstance(delimiter, str):
            raise FormatError(f'{at}: "context" and "delimiter" must be strings')
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) for c in choices):
            raise FormatError(f'{at}: "choices" must be a list of at least 2 strings')
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
            raise FormatError(f'{at}: "gold" must be an index into "choices" (0..{len(choices) - 1}), got {gold!r}')
        items.append(TaskItem(tuple(TaskChoice(context, delimiter + c, len(c)) for c in choices), gold, at))
    return items


def _hellaswag(text: str, path: str) -> list:
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise FormatError(f"{path}: {len(lines)} lines, not a multiple of 6 (a HellaSwag task is a context, "
                          f"the gold ending's index and 4 endings)")
    items = []
    for k in range(0, len(lines), 6):
        at = f"{path} line {k + 1}"
        context, label, endings = lines[k], lines[k + 1].strip(), lines[k + 2:k + 6]
        if not label.isdigit() or not 0 <= int(label) < 4:
            raise FormatError(f"{path} line {k + 2}: the gold ending's index is {label!r} (expected 0..3)")
        items.append(TaskItem(tuple(TaskChoice(context, " " + e, len(e)) for e in endings), int(label), at))
    return items


def _csv_fields(line: str) -> list | None:
    """The 5 fields of a winogrande line: commas inside double quotes are text (llama.cpp's
    reading: the quotes around the sentence removed)."""
    cuts, quoted = [], False
    for i, ch in enumerate(line):
        if ch == '"':
            quoted = not quoted
        elif ch == "," and not quoted:
            cuts.append(i)
            if len(cuts) == 4:
                break
    if len(cuts) != 4:
        return None
    bounds = [-1] + cuts + [len(line)]
    fields = [line[bounds[i] + 1:bounds[i + 1]] for i in range(5)]
    if len(fields[1]) >= 2 and fields[1][0] == fields[1][-1] == '"':
        fields[1] = fields[1][1:-1]
    return fields


def _winogrande(text: str, path: str) -> list:
    items = []
    for n, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")
        if not line.strip():
            continue
        fields = _csv_fields(line)
        if n == 1 and fields is not None and fields[4].strip().lower() == "answer":
            continue    # a header line
        if fields is None:
            raise FormatError(f"{path} line {n}: expected 5 comma-separated fields "
                              f"(index,sentence,option1,option2,answer)")
        _, sentence, opt1, opt2, answer = fields
        if "_" not in sentence:
            raise FormatError(f'{path} line {n}: the sentence has no "_" to fill')
        if answer.strip() not in ("1", "2"):
            raise FormatError(f"{path} line {n}: the answer is {answer.strip()!r} (expected 1 or 2)")
        cut = sentence.index("_")
        rest = " " + sentence[cut + 1:].strip()
        items.append(TaskItem(tuple(TaskChoice(sentence[:cut] + o, rest, len(o)) for o in (opt1, opt2)),
                              int(answer) - 1, f"{path} line {n}"))
    return items


def encode_choice(tokenizer, choice: TaskChoice) -> tuple:
    """(context ids, continuation ids) of a choice as lm-evaluation-harness makes them: the
    context's trailing whitespace moves to the continuation; the continuation's tokens are
    those of context + continuation after as many tokens as the context alone has (BOS first
    where the vocabulary adds one)."""
    context, continuation = choice.context, choice.continuation
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokenizer.encode(context + continuation, add_bos=tokenizer.add_bos)
    ctx = tokenizer.encode(context, add_bos=tokenizer.add_bos)
    return ctx, whole[len(ctx):]


def encode_items(tokenizer, items: list) -> list:
    """[(choices [(context ids, continuation ids, norm_len)], gold)] of TaskItems; FormatError
    naming the item when a context is empty or a continuation gives no token of its own."""
    out = []
    for item in items:
        choices = []
        for k, choice in enumerate(item.choices):
            ctx, cont = encode_choice(tokenizer, choice)
            if len(ctx) == 0 or len(cont) == 0:
                raise FormatError(f"{item.where}: choice {k} gives no {'context' if len(ctx) == 0 else 'continuation'} "
                                  f"token")
            choices.append((ctx, cont, choice.norm_len))
        out.append((choices, item.gold))
    return out
