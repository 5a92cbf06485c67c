"""Training data (layer 5): text and JSON record files, and the token samples made from them.

`read_data(path)` tells the kind of a file by its extension and content:

    .txt                 plain text, returned whole for token windows (as `ggtrain train`
                         reads it: bytes that are not UTF-8 kept as surrogates)
    .jsonl, or a file    JSON lines: one JSON object per line (blank lines skipped)
    starting with "{"
    a file starting      a JSON array of objects
    with "["
    anything else        plain text

Records (one kind per file; a record's other fields are ignored):

    {"text": str}                                  -> kind "text"
    {"prompt": str, "completion": str}             -> kind "prompt_completion"
    {"messages": [{"role", "content"}, ...]}       -> kind "chat" (OpenAI; roles system,
                                                      user, assistant, tool)
    {"conversations": [{"from", "value"}, ...]}    -> kind "chat" (ShareGPT; from human/user,
                                                      gpt/chatgpt/assistant, system, tool),
                                                      normalised to messages
    {"prompt", "chosen", "rejected"}              -> kind "preference" (a pair for DPO/ORPO):
                                                      three strings, or TRL's conversational
                                                      form (prompt a list of messages, chosen
                                                      and rejected lists of the assistant's
                                                      answer)

Errors are one-line FormatErrors naming the file and the line (JSON lines) or the record
index (a JSON array, counted from 0 as in data[12]), and the field: 'data.jsonl line 7:
record has no "completion" field'.

`samples(records, kind, tokenizer, template, train_on_inputs)` turns records into token
samples, each ids (n,) int32 with train (n,) bool, train[i] meaning "ids[i] is a prediction
target" (its loss counts when it is predicted from ids[:i]):

    text               BOS (if the vocabulary adds one), the text, EOS; all but BOS trained
    prompt_completion  BOS, prompt + completion encoded as one text, EOS; the completion's
                       tokens and EOS trained (all but BOS with train_on_inputs)
    preference         a pair (chosen, rejected) of samples: the prompt with each completion,
                       as prompt_completion (strings) or chat (messages: the prompt's turns
                       then the answer's, rendered; only the answer's turns trained)
    chat               the conversation rendered by the chat template and encoded with
                       special tokens parsed (BOS put first when the vocabulary adds one and
                       the template did not); trained: each assistant turn's content through
                       its end-of-turn token (all but BOS with train_on_inputs)

Where a turn is: the template renders the conversation up to each assistant turn with the
generation prompt (ending where the assistant's header ends), and up to the end of that turn;
each must be the start of the whole conversation's text (a template that moves or rewrites
earlier text, like Mistral Nemo's with a system message and several user turns, is reported).
Templates that close every rendering with a fixed text (Phi-3.5 ends one without a
generation prompt with eos_token) are understood: the closing text must be the end of the
whole conversation too. The turn trains from the header's end through the first end-of-turn
token (tokenizer.eog_ids: <|im_end|>, <|eot_id|>, <|end|>, </s>, ...) after its content, not
the whitespace after it; with no such token in the turn (a vocabulary without the template's
tokens), through the turn's text without its trailing whitespace.

Character spans become token spans through the tokens' byte offsets in the rendered text
(`token_offsets`); a token that straddles a span's boundary is trained if and only if it
starts inside the span.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.chat import ChatTemplate
from ggtrain.formats.tokenizer import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED, Tokenizer

KINDS = ("text", "prompt_completion", "chat", "preference")
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "system": "system", "tool": "tool"}
# record layouts: (kind, what messages call a record of it)
_LAYOUTS = {"text": ("text", '{"text"}'),
            "prompt_completion": ("prompt_completion", '{"prompt", "completion"}'),
            "messages": ("chat", '{"messages"} (OpenAI)'),
            "conversations": ("chat", '{"conversations"} (ShareGPT)'),
            "preference": ("preference", '{"prompt", "chosen", "rejected"}')}
_JSON_WS = " \t\r\n"
_BOM = b"\xef\xbb\xbf"


@dataclass
class Data:
    """A training data file as read.

    kind: "plain" (text: the whole file) or one of KINDS (records: text -> str,
    prompt_completion -> (prompt, completion), chat -> list of message dicts with "role" and
    "content"); where: for each record, where it is ("data.jsonl line 7", "chat.json record
    12"); layout: "plain", "text", "prompt_completion", "messages" or "conversations".
    """
    path: str
    kind: str
    text: str | None = None
    records: list = field(default_factory=list)
    where: list = field(default_factory=list)
    layout: str = "plain"

    def samples(self, tokenizer: Tokenizer, template: ChatTemplate | None = None,
                train_on_inputs: bool = False) -> list:
        """`samples` of this file's records."""
        if self.kind == "plain":
            raise ConfigError(f"{self.path}: plain text is cut into token windows, not samples")
        return samples(self.records, self.kind, tokenizer, template, train_on_inputs, self.where)


@dataclass
class Sample:
    """One training sample: ids (n,) int32; train (n,) bool, train[i] meaning ids[i] is a
    prediction target (its loss counts when it is predicted from ids[:i])."""
    ids: np.ndarray
    train: np.ndarray


# ---- reading files ----------------------------------------------------------------------------

def read_data(path) -> Data:
    """Read a training data file (see the module docstring for the kinds).

    Raises FormatError naming the file (and line or record, and field) when it is empty, not
    UTF-8 (JSON), not valid JSON, or holds a malformed record or a mix of kinds;
    FileNotFoundError when it does not exist.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    if not raw.strip():
        raise FormatError(f"{path}: the file is empty")
    first = raw.lstrip(_JSON_WS.encode())[:1]
    if _plain(path, first):
        # undecodable bytes survive as surrogates, as ggtrain train reads text
        return Data(path, "plain", text=raw.decode("utf-8", errors="surrogateescape"))
    text = _decode(raw, path)
    pairs = _json_lines(text, path) if is_json_lines(path, first) else _json_array(text, path)
    layout, records, where = _parse_records(pairs)
    return Data(path, _LAYOUTS[layout][0], records=records, where=where, layout=layout)


def is_json_lines(path, first: bytes) -> bool:
    """Whether a record file whose first non-blank byte is `first` holds JSON lines (else one
    JSON array)."""
    return os.path.splitext(os.fspath(path))[1].lower() == ".jsonl" or first == b"{"


def read_lines(path, lo: int, hi: int, first_line: int, first: tuple | None = None) -> Data:
    """The records of the whole lines in bytes lo..hi of a JSON lines file, the first of them
    line first_line (errors name the file's lines); first: (layout, where) of the file's first
    record (None: these are the first). Kind and layout are the file's; no records is not an
    error here."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        f.seek(lo)
        raw = f.read(hi - lo)
    if lo == 0 and raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    layout, records, where = _parse_records(_json_lines(_decode(raw, path, first_line), path, first_line), first)
    layout = layout or (first[0] if first else None)
    return Data(path, _LAYOUTS[layout][0] if layout else "text", records=records, where=where,
                layout=layout or "text")


def is_plain_text(path) -> bool:
    """Whether `read_data` reads the file as plain text (from its name and first non-blank
    byte, without reading the rest): such files are tokenized as a stream
    (formats/corpus.py). False for a file with no text (read_data says it is empty)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        head = f.read(len(_BOM))
        if head != _BOM:
            f.seek(0)
        while block := f.read(1 << 16):
            block = block.lstrip(_JSON_WS.encode())
            if block:
                return _plain(path, block[:1])
    return False


def _plain(path: str, first: bytes) -> bool:
    """Plain text by the extension, or by a first non-blank byte that starts no JSON."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".txt" or (ext != ".jsonl" and first not in (b"{", b"[")):
        if ext == ".json":
            raise FormatError(f"{path}: not JSON lines or a JSON array of records "
                              f"(it starts with {first.decode('latin-1')!r})")
        return True
    return False


def _decode(raw: bytes, path: str, first_line: int = 1) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + first_line
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise FormatError(f"{path} line {line} column {column}: not UTF-8 "
                          f"(byte 0x{raw[e.start]:02x})") from None


def _json_lines(text: str, path: str, first_line: int = 1) -> list:
    """[(where, value)] of the non-blank lines of a JSON lines file (or of its lines from
    first_line on)."""
    out = []
    for n, line in enumerate(text.split("\n"), first_line):
        if not line.strip(_JSON_WS):
            continue
        try:
            value = json.loads(line)
        except RecursionError:
            raise FormatError(f"{path} line {n}: JSON nested too deeply") from None
        except json.JSONDecodeError as e:
            hint = ("; JSON lines hold one whole record per line"
                    if e.pos >= len(line.rstrip(_JSON_WS)) else "")
            raise FormatError(f"{path} line {n} column {e.colno}: invalid JSON ({e.msg}){hint}") from None
        out.append((f"{path} line {n}", value))
    return out


def _json_array(text: str, path: str) -> list:
    """[(where, value)] of the items of a file holding one JSON array."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise FormatError(f"{path}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} line {e.lineno} column {e.colno}: invalid JSON ({e.msg})") from None
    if not isinstance(value, list):
        raise FormatError(f"{path}: the file holds {_json_type(value)}, not an array of records")
    if not value:
        raise FormatError(f"{path}: the JSON array holds no records")
    return [(f"{path} record {i}", v) for i, v in enumerate(value)]


def _json_type(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, (int, float)):
        return f"a number ({v})"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


def _layout(record: dict) -> str | None:
    if "chosen" in record or "rejected" in record:
        return "preference"
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "conversations"
    if "prompt" in record or "completion" in record:
        return "prompt_completion"
    if "text" in record:
        return "text"
    return None


def _parse_records(pairs: list, first: tuple | None = None) -> tuple:
    """(layout, records, where) of [(where, JSON value)], each record checked and normalised;
    first: (layout, where) of the file's first record when these records come after it."""
    layout0, where0 = first or (None, None)
    records, where = [], []
    for at, rec in pairs:
        if not isinstance(rec, dict):
            raise FormatError(f"{at}: the record is {_json_type(rec)} (expected a JSON object)")
        layout = _layout(rec)
        if layout is None:
            keys = ", ".join(f'"{k}"' for k in list(rec)[:5]) or "none"
            raise FormatError(f'{at}: the record has none of the fields "text", "prompt" and '
                              f'"completion", "messages", "conversations" (its fields: {keys})')
        if layout0 is None:
            layout0, where0 = layout, at
        elif layout != layout0:
            raise FormatError(f"{at}: a {_LAYOUTS[layout][1]} record, but the file's first "
                              f"record ({where0}) is {_LAYOUTS[layout0][1]}: a file holds one kind")
        records.append(_PARSE[layout](rec, at))
        where.append(at)
    return layout0, records, where


def _string(value, at: str, name: str) -> str:
    if not isinstance(value, str):
        raise FormatError(f"{at}: {name} is {_json_type(value)} (expected a string)")
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


def _parse_text(rec: dict, at: str) -> str:
    return _string(rec["text"], at, '"text"')


def _parse_prompt_completion(rec: dict, at: str) -> tuple:
    return (_string(_field(rec, "prompt", at), at, '"prompt"'),
            _string(_field(rec, "completion", at), at, '"completion"'))


def _turns(rec: dict, key: str, at: str, shape: str) -> list:
    turns = rec[key]
    if not isinstance(turns, list):
        raise FormatError(f"{at}: {key} is {_json_type(turns)} (expected an array of {shape} objects)")
    if not turns:
        raise FormatError(f"{at}: {key} is empty")
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            raise FormatError(f"{at}: {key}[{i}] is {_json_type(t)} (expected a {shape} object)")
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
        kinds = ", ".join(f'"{k}" {_json_type(p)}' for k, p in zip(("prompt", "chosen", "rejected"), parts))
        raise FormatError(f"{at}: a preference pair holds three strings or three message lists, got {kinds}")
    if out[1] == out[2]:
        raise FormatError(f'{at}: "chosen" and "rejected" are identical (a pair must differ)')
    return out


_PARSE = {"text": _parse_text, "prompt_completion": _parse_prompt_completion,
          "messages": _parse_messages, "conversations": _parse_conversations,
          "preference": _parse_preference}


# ---- samples ----------------------------------------------------------------------------------

def samples(records: list, kind: str, tokenizer: Tokenizer, template: ChatTemplate | None = None,
            train_on_inputs: bool = False, where: list | None = None) -> list:
    """Token samples of records of one kind (see the module docstring): list[Sample].

    records: as `read_data` gives them (text: str; prompt_completion: (prompt, completion);
    chat: a list of {"role", "content"} dicts); where: their places, for messages.
    Raises ConfigError for chat records without a template, FormatError (naming the record)
    when the template fails on a conversation or its turns cannot be found.
    """
    if kind not in KINDS:
        raise ConfigError(f"records of kind {kind!r}: expected one of {', '.join(KINDS)}")
    if kind == "chat" and template is None:
        raise ConfigError("chat records need a chat template (the model's "
                          "tokenizer.chat_template or --chat-template FILE.jinja)")
    if kind == "preference" and template is None and records and isinstance(records[0][0], list):
        raise ConfigError("conversational preference pairs need a chat template (the model's "
                          "tokenizer.chat_template or --chat-template FILE.jinja)")
    where = where if where is not None else [f"record {i}" for i in range(len(records))]
    out = []
    for rec, at in zip(records, where):
        if kind == "preference":
            try:
                out.append(_pair_samples(rec, tokenizer, template))
            except FormatError as e:
                raise FormatError(f"{at}: {e}") from None
        elif kind == "text":
            out.append(_text_sample(rec, tokenizer))
        elif kind == "prompt_completion":
            out.append(_prompt_completion_sample(rec[0], rec[1], tokenizer, train_on_inputs))
        else:
            try:
                out.append(_chat_sample(rec, tokenizer, template, train_on_inputs))
            except FormatError as e:
                raise FormatError(f"{at}: {e}") from None
    return out


def _with_eos(ids: np.ndarray, tokenizer: Tokenizer) -> np.ndarray:
    return np.append(ids, np.int32(tokenizer.eos_id)).astype(np.int32)


def _text_sample(text: str, tokenizer: Tokenizer) -> Sample:
    ids = _with_eos(tokenizer.encode(text, add_bos=tokenizer.add_bos), tokenizer)
    train = np.ones(len(ids), bool)
    train[0] = not tokenizer.add_bos
    return Sample(ids, train)


def _prompt_completion_sample(prompt: str, completion: str, tokenizer: Tokenizer,
                              train_on_inputs: bool) -> Sample:
    # one text, so the tokens are those of the whole (an SPM vocabulary's space prefix is
    # put once, before the prompt); the completion's tokens are those starting in it
    text = prompt + completion
    lead = int(tokenizer.add_bos)
    body = tokenizer.encode(text)
    ids = _with_eos(np.concatenate([[tokenizer.bos_id] * lead, body]).astype(np.int32), tokenizer)
    if train_on_inputs:
        train = np.ones(len(ids), bool)
    else:
        starts, _ = token_offsets(tokenizer, body, text)
        train = np.concatenate([[False] * lead, starts >= len(prompt.encode("utf-8")), [True]])
    train[:lead] = False
    return Sample(ids, train.astype(bool))


# what llama.cpp's tokenizer cuts out of text as special tokens (with parse_special)
_SPECIAL = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
_WS = b" \t\n\r\v\f"
_ESCAPED_SPACE = "\u2581".encode("utf-8")


def token_offsets(tokenizer: Tokenizer, ids: np.ndarray, text: str) -> tuple:
    """Where each token of `ids`, the encoding of `text`, lies in text's UTF-8 bytes.

    Returns (starts, ends), each (n,) int64 byte offsets. Each token's bytes (a special
    token's: its text) are matched in order against the text, allowing for what the
    tokenizer does besides cutting the text: the space an SPM vocabulary puts before text
    (matched by nothing), whitespace a special token strips beside it (belongs to no token),
    and U+2581 in the text (SPM and byte vocabularies read it as a space).
    Raises FormatError when the tokens do not spell the text.
    """
    data = text.encode("utf-8")
    ids = np.asarray(ids).reshape(-1)
    starts = np.empty(len(ids), np.int64)
    ends = np.empty(len(ids), np.int64)
    # only an SPM vocabulary that puts a space before text spells one the text lacks
    space_prefix = bool(getattr(tokenizer, "add_space_prefix", False))
    pos = 0
    for k, i in enumerate(ids.tolist()):
        piece = tokenizer.piece(i)
        if not piece and tokenizer.attrs[i] & _SPECIAL:
            piece = tokenizer.tokens[i].encode("utf-8")
        end = _match(data, pos, piece, space_prefix)
        if end < 0:
            skip = pos
            while skip < len(data) and data[skip] in _WS:
                skip += 1
            end = _match(data, skip, piece, space_prefix) if skip > pos else -1
            if end < 0:
                raise FormatError(f"token {k} (id {i}, {piece!r}) does not continue the text at "
                                  f"byte {pos} ({data[pos:pos + 16]!r})")
            pos = skip
        starts[k], ends[k] = pos, end
        pos = end
    if data[pos:].strip(_WS):
        raise FormatError(f"the tokens end at byte {pos} of {len(data)}, before the text does")
    return starts, ends


def _match(data: bytes, pos: int, piece: bytes, space_prefix: bool) -> int:
    """Where `piece` ends if the text continues with it at pos (-1 if it does not)."""
    for p in (piece, piece[1:]) if space_prefix and piece[:1] == b" " else (piece,):
        if data.startswith(p, pos):
            return pos + len(p)
        if b" " in p and _ESCAPED_SPACE in data[pos:pos + 3 * len(p)]:
            end = _match_escaped(data, pos, p)
            if end >= 0:
                return end
    return -1


def _match_escaped(data: bytes, pos: int, piece: bytes) -> int:
    """_match where each space of piece may also be a U+2581 of the text."""
    j = pos
    for b in piece:
        if j < len(data) and data[j] == b:
            j += 1
        elif b == 0x20 and data.startswith(_ESCAPED_SPACE, j):
            j += 3
        else:
            return -1
    return j


def _chat_ids(text: str, tokenizer: Tokenizer) -> tuple:
    """(ids, lead, body) of a rendered conversation: its tokens with special tokens parsed,
    after a BOS (lead = 1) when the vocabulary adds one and the template did not render it
    (one BOS, as llama.cpp ends up with)."""
    body = tokenizer.encode(text, parse_special=True)
    lead = int(tokenizer.add_bos and (len(body) == 0 or body[0] != tokenizer.bos_id))
    return np.concatenate([[tokenizer.bos_id] * lead, body]).astype(np.int32), lead, body


def chat_prompt(messages: list, tokenizer: Tokenizer, template: ChatTemplate) -> np.ndarray:
    """The token ids of a conversation rendered with its generation prompt (the header of the
    assistant's next turn), as generation starts from it: (n,) int32."""
    return _chat_ids(template.render(messages, add_generation_prompt=True), tokenizer)[0]


def _chat_sample(messages: list, tokenizer: Tokenizer, template: ChatTemplate,
                 train_on_inputs: bool, from_byte: int = 0) -> Sample:
    full = template.render(messages)
    ids, lead, body = _chat_ids(full, tokenizer)
    if train_on_inputs:
        train = np.ones(len(ids), bool)
        train[:1] = ids[:1] != tokenizer.bos_id
        return Sample(ids, train)
    _check_rendered(messages, full, template)
    starts, ends = token_offsets(tokenizer, body, full)
    starts = np.concatenate([[-1] * lead, starts]).astype(np.int64)   # an added BOS is nowhere
    ends = np.concatenate([[-1] * lead, ends]).astype(np.int64)
    train = np.zeros(len(ids), bool)
    for lo, hi in _assistant_spans(messages, full, template, ids, starts, ends, tokenizer.eog_ids):
        train |= (starts >= max(lo, from_byte)) & (starts < hi)
    return Sample(ids, train)


def _pair_samples(rec: tuple, tokenizer: Tokenizer, template: ChatTemplate | None) -> tuple:
    """(chosen, rejected) Samples of a preference record: the prompt with each answer, the
    answer's tokens trained (with its end-of-turn / EOS)."""
    prompt, chosen, rejected = rec
    if isinstance(prompt, str):
        return tuple(_prompt_completion_sample(prompt, answer, tokenizer, False) for answer in (chosen, rejected))
    # the prompt's own assistant turns are context: train from where its rendering with the
    # generation prompt ends
    head = len(template.render(prompt, add_generation_prompt=True).encode("utf-8"))
    return tuple(_chat_sample(prompt + answer, tokenizer, template, False, from_byte=head)
                 for answer in (chosen, rejected))


def _check_rendered(messages: list, full: str, template: ChatTemplate) -> None:
    """Every non-assistant message with content shows in the text: a template that does not
    know a role (Phi-3.5 and tool) may drop it silently. (A check of the content's text only:
    a short message that also appears elsewhere passes.)"""
    for i, m in enumerate(messages):
        content = m["content"].strip()
        if m["role"] != "assistant" and content and content not in full:
            raise FormatError(f"the chat template {template.name} does not render messages[{i}] "
                              f"(role {m['role']!r}): its content is not in the text")


class _Layout:
    """Renderings of the first k messages of a conversation, placed in the whole one's text."""

    def __init__(self, messages, full, template, starts, ends):
        self.messages, self.template = messages, template
        self.data = full.encode("utf-8")
        self.starts, self.ends = starts, ends
        self.closing = 0                 # bytes of closing text found after renderings

    def render(self, k: int, gen: bool = False) -> bytes:
        return self.template.render(self.messages[:k], add_generation_prompt=gen).encode("utf-8")

    def _snap(self, at: int) -> int:
        """`at`, or the start of the token it falls inside."""
        t = int(np.searchsorted(self.starts, at, side="right")) - 1
        if t >= 0 and self.starts[t] < at < self.ends[t]:
            return int(self.starts[t])
        return at

    def _lcp(self, r: bytes) -> int:
        lo, hi = 0, min(len(r), len(self.data))        # r[:lo] is a common prefix
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if r[:mid] == self.data[:mid]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def end_of(self, k: int) -> int:
        """Where messages[:k] end in the whole text. A closing text the template puts after
        every rendering (Phi-3.5's eos_token) is not part of them: the whole text must end
        with it too, and it is taken to be eos_token when that fits, else to start where the
        rendering leaves the whole text (moved back to the start of a token it cuts)."""
        r = self.render(k)
        if self.data.startswith(r):
            return len(r)
        eos = self.template.eos_token.encode("utf-8")
        if eos and r.endswith(eos) and self.data.startswith(r[:-len(eos)]) and self.data.endswith(eos):
            at = len(r) - len(eos)
        else:
            at = self._snap(self._lcp(r))
        if not self.data.endswith(r[at:]):
            raise self.not_prefix(k)
        self.closing = len(r) - at
        return at

    def header_end(self, k: int) -> int:
        """Where the generation prompt after messages[:k] ends in the whole text; where the
        two differ, where they part (moved back to the start of a token it cuts): DeepSeek
        R1's generation prompt ends with "<think>\\n", its rendered assistant turns do not."""
        r = self.render(k, gen=True)
        if self.data.startswith(r):
            return len(r)
        return self._snap(self._lcp(r))

    def not_prefix(self, k: int) -> FormatError:
        return FormatError(f"the chat template {self.template.name} does not render messages[:{k}] "
                           f"as the start of the whole conversation (it moves or rewrites earlier "
                           f"text), so the assistant turns cannot be found; train on every token "
                           f"with --train-on-inputs, or use another --chat-template")


def _assistant_spans(messages, full, template, ids, starts, ends, eog_ids) -> list:
    """[(start, stop)] byte spans of full to train on: each assistant turn's content through
    its end-of-turn token."""
    lay = _Layout(messages, full, template, starts, ends)
    data = lay.data
    is_eog = np.isin(ids, np.fromiter(eog_ids, np.int64, len(eog_ids)))
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = lay.end_of(k) if k else 0
        head = lay.header_end(k)
        end = lay.end_of(k + 1) if k + 1 < len(messages) else len(data) - lay.closing
        if head < before or end < head:
            raise lay.not_prefix(k if head < before else k + 1)
        # the content as rendered: as given, or trimmed (Llama 3, Gemma); else (DeepSeek R1
        # keeps what follows </think>) search for the end-of-turn token from the header on
        content_end = head
        for text in (m["content"], m["content"].strip()):
            c = text.encode("utf-8")
            at = data.find(c, head, end)
            if c and at >= 0:
                if data[head:at].strip(_WS):
                    raise FormatError(
                        f"the chat template {template.name} renders {data[head:at][:40]!r} "
                        f"between the generation prompt and the content of messages[{k}], so "
                        f"where the assistant's turn starts is unclear; train on every token "
                        f"with --train-on-inputs, or use another --chat-template")
                content_end = at + len(c)
                break
        eot = np.flatnonzero(is_eog & (starts >= content_end) & (starts < end))
        stop = int(ends[eot[0]]) if eot.size else head + len(data[head:end].rstrip(_WS))
        spans.append((head, stop))
    return spans
