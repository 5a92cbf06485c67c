"""Record layouts of training data (layer 5): the table of the record shapes ggtrain reads, and
how a record of each is checked and normalised.

A record is a mapping of fields: a JSON object, a Parquet row (its columns), a CSV row (under
its header). Its layout is the first row of LAYOUTS one of whose `marks` is among its fields
(its other fields are ignored); a file (a folder of shards too) holds one layout.

    layout             fields                                kind               a record as read
    preference         prompt, chosen, rejected              preference         (prompt, chosen, rejected):
                                                                                three strings, or TRL's
                                                                                conversational form (three
                                                                                message lists, the answers'
                                                                                the assistant's)
    messages           messages: [{role, content}]           chat               [{"role", "content"}, ...]
                       (OpenAI; roles system, user,
                       assistant, tool)
    conversations      conversations: [{from, value}]        chat               the same, from normalised to
                       (ShareGPT)                                               role (human -> user, gpt ->
                                                                                assistant, ...)
    dolly              instruction, context?, response       instruction        (instruction, context, response)
    alpaca             instruction, input?, output           instruction        (instruction, input, output)
    prompt_completion  prompt, completion                    prompt_completion  (prompt, completion)
    text               text                                  text               str

A field marked ? may be absent, null or "" (no input). An instruction record becomes a
conversation when the model has a chat template (`instruction_messages`: the instruction, a
blank line and the input as the user's turn, the output as the assistant's), else Alpaca's
own prompt and the output as its completion (`alpaca_prompt`); either way only the output
(and what ends it) is trained, as formats/dataset.py says.

Errors are one-line FormatErrors naming the record (its file and line, index or row) and the
field: 'data.jsonl line 7: record has no "completion" field'.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ggtrain.errors import FormatError

KINDS = ("text", "prompt_completion", "chat", "instruction", "preference")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "system": "system", "tool": "tool"}

# Alpaca's two prompts, as Stanford Alpaca trained with them: PROMPT_DICT in train.py of
# github.com/tatsu-lab/stanford_alpaca (commit 761dc5b); "prompt_input" where the record's
# input is not "", else "prompt_no_input"; the completion is the output (then EOS), right
# after "### Response:".
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:")
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:")


def _type_words(v) -> str:
    """What a value is, as messages say it ("a number (3)")."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, (int, float)):
        return f"a number ({v})"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, (list, tuple)):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, (bytes, bytearray)):
        return "bytes"
    return f"a {type(v).__name__}"       # a Parquet date, decimal, ...


def _string(value, at: str, name: str) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{at}: {name} is {_type_words(value)} (expected a string)")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FormatError(f"{at}: {name} holds a lone surrogate \\u{ord(value[e.start]):04x} at "
                          f"character {e.start}, which is not text") from None
    return value


def _field(rec: dict, key: str, at: str, owner: str = "record") -> object:
    if key not in rec:
        raise FormatError(f'{at}: {owner} has no "{key}" field')
    return rec[key]


def _optional_string(rec: dict, key: str, at: str) -> str:
    """A field that may be absent or null: "" then."""
    value = rec.get(key)
    return "" if value is None else _string(value, at, f'"{key}"')


def _parse_text(rec: dict, at: str) -> str:
    return _string(rec["text"], at, '"text"')


def _parse_prompt_completion(rec: dict, at: str) -> tuple:
    return (_string(_field(rec, "prompt", at), at, '"prompt"'),
            _string(_field(rec, "completion", at), at, '"completion"'))


def _turns(rec: dict, key: str, at: str, shape: str) -> list:
    turns = rec[key]
    if not isinstance(turns, list):
        raise FormatError(f"{at}: {key} is {_type_words(turns)} (expected an array of {shape} objects)")
    if not turns:
        raise FormatError(f"{at}: {key} is empty")
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise FormatError(f"{at}: {key}[{i}] is {_type_words(t)} (expected a {shape} object)")
    return turns


def _parse_messages(rec: dict, at: str, key: str = "messages") -> list:
    out = []
    for i, m in enumerate(_turns({key: rec["messages"]}, key, at, '{"role", "content"}')):
        role = _string(_field(m, "role", at, f"{key}[{i}]"), at, f"{key}[{i}].role")
        if role not in ROLES:
            raise FormatError(f"{at}: {key}[{i}].role is {role!r} (expected {', '.join(ROLES[:-1])} "
                              f"or {ROLES[-1]})")
        _string(_field(m, "content", at, f"{key}[{i}]"), at, f"{key}[{i}].content")
        out.append(dict(m))
    return out


def _parse_conversations(rec: dict, at: str) -> list:
    out = []
    for i, t in enumerate(_turns(rec, "conversations", at, '{"from", "value"}')):
        who = _string(_field(t, "from", at, f"conversations[{i}]"), at, f"conversations[{i}].from")
        if who not in SHAREGPT_ROLES:
            raise FormatError(f"{at}: conversations[{i}].from is {who!r} (expected "
                              f"{', '.join(list(SHAREGPT_ROLES)[:-1])} or {list(SHAREGPT_ROLES)[-1]})")
        value = _string(_field(t, "value", at, f"conversations[{i}]"), at, f"conversations[{i}].value")
        out.append({"role": SHAREGPT_ROLES[who], "content": value})
    return out


def _parse_alpaca(rec: dict, at: str) -> tuple:
    return (_string(_field(rec, "instruction", at), at, '"instruction"'), _optional_string(rec, "input", at),
            _string(_field(rec, "output", at), at, '"output"'))


def _parse_dolly(rec: dict, at: str) -> tuple:
    return (_string(_field(rec, "instruction", at), at, '"instruction"'), _optional_string(rec, "context", at),
            _string(_field(rec, "response", at), at, '"response"'))


def _parse_preference(rec: dict, at: str) -> tuple:
    """(prompt, chosen, rejected): three strings, or three message lists (the answers'
    messages all the assistant's)."""
    parts = [_field(rec, key, at) for key in ("prompt", "chosen", "rejected")]
    if all(isinstance(p, str) for p in parts):
        out = tuple(_string(p, at, f'"{key}"') for p, key in zip(parts, ("prompt", "chosen", "rejected")))
    elif all(isinstance(p, list) for p in parts):
        out = tuple(_parse_messages({"messages": p}, at, key)
                    for p, key in zip(parts, ("prompt", "chosen", "rejected")))
        for key, answer in zip(("chosen", "rejected"), out[1:]):
            for i, m in enumerate(answer):
                if m["role"] != "assistant":
                    raise FormatError(f"{at}: {key}[{i}].role is {m['role']!r} (the answer's messages are "
                                      f"the assistant's)")
    else:
        kinds = ", ".join(f'"{k}" {_type_words(p)}' for k, p in zip(("prompt", "chosen", "rejected"), parts))
        raise FormatError(f"{at}: a preference pair holds three strings or three message lists, got {kinds}")
    if out[1] == out[2]:
        raise FormatError(f'{at}: "chosen" and "rejected" are identical (a pair must differ)')
    return out


@dataclass(frozen=True)
class Layout:
    """One record layout: name; kind (one of KINDS: how its records become samples); fields
    (required) and optional fields, in their order; marks: the fields that tell a record is
    of this layout (any one of them); words: what messages call its records; parse(record,
    where) -> the record as read (see the module docstring)."""
    name: str
    kind: str
    fields: tuple
    optional: tuple
    marks: tuple
    words: str
    parse: Callable

    @property
    def columns(self) -> tuple:
        """Every field it reads: the columns a Parquet file of it needs read."""
        return self.fields + self.optional


# in the order records are told apart: a record is of the first layout it has a mark of
LAYOUTS = (
    Layout("preference", "preference", ("prompt", "chosen", "rejected"), (), ("chosen", "rejected"),
           '{"prompt", "chosen", "rejected"}', _parse_preference),
    Layout("messages", "chat", ("messages",), (), ("messages",), '{"messages"} (OpenAI)', _parse_messages),
    Layout("conversations", "chat", ("conversations",), (), ("conversations",), '{"conversations"} (ShareGPT)',
           _parse_conversations),
    Layout("dolly", "instruction", ("instruction", "response"), ("context",), ("response",),
           '{"instruction", "context", "response"} (Dolly)', _parse_dolly),
    Layout("alpaca", "instruction", ("instruction", "output"), ("input",), ("instruction", "input", "output"),
           '{"instruction", "input", "output"} (Alpaca)', _parse_alpaca),
    Layout("prompt_completion", "prompt_completion", ("prompt", "completion"), (), ("prompt", "completion"),
           '{"prompt", "completion"}', _parse_prompt_completion),
    Layout("text", "text", ("text",), (), ("text",), '{"text"}', _parse_text),
)
BY_NAME = {layout.name: layout for layout in LAYOUTS}


def layout_of(fields) -> Layout | None:
    """The layout of a record with these fields (names), or None when it has none's marks."""
    present = set(fields)
    for layout in LAYOUTS:
        if present.intersection(layout.marks):
            return layout
    return None


def no_layout(at: str, fields, owner: str = "the record's fields") -> FormatError:
    """The error of fields of no known layout: the fields found and the layouts known."""
    found = ", ".join(f'"{k}"' for k in list(fields)[:8]) or "none"
    if len(fields) > 8:
        found += f" and {len(fields) - 8} more"
    known = "; ".join(layout.words for layout in LAYOUTS)
    return FormatError(f"{at}: {owner} ({found}) are of no layout ggtrain reads (known: {known})")


def parse_records(pairs, first: tuple | None = None) -> tuple:
    """(layout name, records, where) of [(where, record)], each record checked and normalised;
    first: (layout name, where) of the file's first record when these come after it. Raises
    FormatError naming the record for one that is not a mapping, of no layout, of another
    layout than the first, or malformed."""
    layout0, where0 = first or (None, None)
    records, where = [], []
    for at, rec in pairs:
        if not isinstance(rec, dict):
            raise FormatError(f"{at}: the record is {_type_words(rec)} (expected a JSON object)")
        layout = layout_of(rec)
        if layout is None:
            raise no_layout(at, list(rec))
        if layout0 is None:
            layout0, where0 = layout.name, at
        elif layout.name != layout0:
            raise FormatError(f"{at}: a {layout.words} record, but the first record ({where0}) is "
                              f"{BY_NAME[layout0].words}: a file, or a folder of them, holds one layout")
        records.append(layout.parse(rec, at))
        where.append(at)
    return layout0, records, where


def instruction_messages(record: tuple) -> list:
    """The conversation of an instruction record (instruction, input, output): the user's turn
    is the instruction, and after a blank line the input where there is one; the assistant's
    is the output."""
    instruction, given, output = record
    user = f"{instruction}\n\n{given}" if given else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def alpaca_prompt(record: tuple) -> tuple:
    """(prompt, completion) of an instruction record in Alpaca's own format."""
    instruction, given, output = record
    if given:
        return ALPACA_PROMPT_INPUT.format(instruction=instruction, input=given), output
    return ALPACA_PROMPT_NO_INPUT.format(instruction=instruction), output
