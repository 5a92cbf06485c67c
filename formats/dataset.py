"""Training data (layer 5): data files read as text or records, and the token samples made
from them.

`read_data(path)` reads a data file or a folder of record files (formats/datafile.py says how
a path's format is told and how each is read):

    plain text    a .txt file, or a file of no record format whose first non-blank byte
                  starts no JSON: returned whole, for token windows
    records       JSON lines, a JSON array, Parquet or CSV (a folder: its shards), each
                  record of one layout of formats/layouts.py (the table of layouts, their
                  fields and what a record becomes):

                  layout         fields                          kind
                  text           text                            text
                  prompt_completion  prompt, completion          prompt_completion
                  messages       messages [{role, content}]      chat (OpenAI)
                  conversations  conversations [{from, value}]   chat (ShareGPT)
                  alpaca         instruction, input?, output     instruction
                  dolly          instruction, context?, response instruction
                  preference     prompt, chosen, rejected        preference

A file that is not UTF-8 text (Parquet aside), or whose extension names a format ggtrain does
not read, is an error, never text. Errors are one-line FormatErrors naming the file and the
record (line, index or row) and the field: 'data.jsonl line 7: record has no "completion" field'.

`samples(records, kind, tokenizer, template, train_on_inputs)` turns records into token
samples, each ids (n,) int32 with train (n,) bool, train[i] meaning "ids[i] is a prediction
target" (its loss counts when it is predicted from ids[:i]):

    text               BOS (if the vocabulary adds one), the text, EOS; all but BOS trained
    prompt_completion  BOS, prompt + completion encoded as one text, EOS; the completion's
                       tokens and EOS trained (all but BOS with train_on_inputs)
    instruction        with a chat template: the conversation `instruction_messages` makes
                       (the instruction and input as the user's turn, the output as the
                       assistant's), as chat; without one: Alpaca's prompt and the output as
                       prompt_completion (`alpaca_prompt`). Either way the output is trained.
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

import os
from dataclasses import dataclass, field

import numpy as np

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats import datafile
from ggtrain.formats.chat import TEMPLATE_KEY, ChatTemplate, chat_template
from ggtrain.formats.gguf import GGUFFile
from ggtrain.formats.layouts import (BY_NAME, KINDS, ROLES, SHAREGPT_ROLES, Layout, alpaca_prompt,  # noqa: F401
                                     instruction_messages, layout_of, no_layout, parse_records)
from ggtrain.formats.tokenizer import ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED, Tokenizer

_JSON_WS = " \t\r\n"
_BOM = b"\xef\xbb\xbf"


@dataclass
class Data:
    """A training data file (or folder) as read.

    kind: "plain" (text: the whole file) or one of KINDS (records: text -> str,
    prompt_completion -> (prompt, completion), chat -> list of message dicts with "role" and
    "content", instruction -> (instruction, input, output), preference -> (prompt, chosen,
    rejected)); where: for each record, where it is ("data.jsonl line 7", "chat.json record
    12", "chat.parquet row 3"); layout: "plain" or a layout's name (formats/layouts.py).
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
    """Read a training data file or folder (see the module docstring for the kinds).

    Raises FormatError naming the file (and line, record or row, and field) when it is empty,
    not UTF-8, of a format ggtrain does not read, not valid JSON/Parquet/CSV, or holds a
    malformed record or a mix of layouts; FileNotFoundError when it does not exist.
    """
    path = os.fspath(path)
    if datafile.data_format(path) == "text":
        with open(path, "rb") as f:
            raw = f.read()
        if raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        if not raw.strip():
            raise FormatError(f"{path}: the file is empty")
        return Data(path, "plain", text=datafile.decode(raw, path))
    records = open_records(path)
    out = Data(path, records.kind, layout=records.layout.name)
    for part in records.parts(1):
        got, _ = records.read(part)
        out.records += got.records
        out.where += got.where
    return out


def is_plain_text(path) -> bool:
    """Whether `read_data` reads the path as plain text (from its name and first block,
    without reading the rest): such files are tokenized as a stream (formats/corpus.py).
    False for a folder, and for a file with no text (read_data says it is empty). Raises
    FormatError for a file of a format ggtrain does not read, or whose first block is not
    text."""
    path = os.fspath(path)
    return datafile.data_format(path) == "text" and datafile.first_byte(path) is not None


def is_json_lines(path, first: bytes) -> bool:
    """Whether a record file whose first non-blank byte is `first` holds JSON lines (else one
    JSON array)."""
    return os.path.splitext(os.fspath(path))[1].lower() in (".jsonl", ".ndjson") or first == b"{"


@dataclass
class Records:
    """A record file or folder, opened: its shards (formats/datafile.py), the JSON arrays
    among them read whole, the layout of its records, where the first is, and the first
    record as read (`head`). Read by parts: `parts(workers)`, `read(part)`."""
    path: str
    shards: list
    arrays: dict
    layout: Layout
    first: str
    head: Data

    @property
    def kind(self) -> str:
        return self.layout.kind

    def parts(self, workers: int) -> list:
        return datafile.parts(self.shards, self.arrays, workers)

    def read(self, part: datafile.Part) -> tuple:
        """(Data of the part's records, their numbers: lines, indices or rows)."""
        shard = self.shards[part.shard]
        got = datafile.read_part(shard, part, self.arrays, self.layout.columns)
        _, records, where = parse_records([(shard.where(n), rec) for n, rec in got], (self.layout.name, self.first))
        return (Data(self.path, self.kind, records=records, where=where, layout=self.layout.name),
                [n for n, _ in got])


def open_records(path) -> Records:
    """A record file or a folder of them, opened (`Records`): every shard's first record is
    read and must be of the first's layout; a Parquet or CSV shard's columns must be some
    layout's, with its required fields. Raises FormatError naming the file (and record)."""
    path = os.fspath(path)
    shards = datafile.open_shards(path)
    arrays = datafile.read_arrays(shards)
    layout = first = head = None
    for shard in shards:
        columns = None
        if shard.columns:
            found = _columns_layout(shard)
            columns = found.columns
        number, rec = datafile.first_record(shard, arrays, columns)
        at = shard.where(number)
        name, records, where = parse_records([(at, rec)], (layout.name, first) if layout else None)
        if layout is None:
            layout, first = BY_NAME[name], at
            head = Data(path, layout.kind, records=records, where=where, layout=name)
    return Records(path, shards, arrays, layout, first, head)


def _columns_layout(shard: datafile.Shard) -> Layout:
    """The layout of a Parquet or CSV file's columns (FormatError: none, or a field missing)."""
    what = "columns" if shard.format == "parquet" else "header's fields"
    layout = layout_of(shard.columns)
    if layout is None:
        raise no_layout(shard.path, shard.columns, f"the {what}")
    missing = [f for f in layout.fields if f not in shard.columns]
    if missing:
        have = ", ".join(f'"{c}"' for c in shard.columns)
        raise FormatError(f'{shard.path}: no "{missing[0]}" {"column" if shard.format == "parquet" else "field"} '
                          f"({layout.words} records need one; its {what}: {have})")
    return layout


def read_lines(path, lo: int, hi: int, first_line: int, first: tuple | None = None) -> Data:
    """The records of the whole lines in bytes lo..hi of a JSON lines file, the first of them
    line first_line (errors name the file's lines); first: (layout, where) of the file's first
    record (None: these are the first). Kind and layout are the file's; no records is not an
    error here."""
    path = os.fspath(path)
    shard = datafile.Shard(path, "jsonl")
    got = datafile.read_part(shard, datafile.Part(0, lo, hi, first_line, hi - lo), {})
    layout, records, where = parse_records([(shard.where(n), rec) for n, rec in got], first)
    layout = layout or (first[0] if first else "text")
    return Data(path, BY_NAME[layout].kind, records=records, where=where, layout=layout)


def _json_lines(text: str, path: str, first_line: int = 1) -> list:
    """[(where, value)] of the non-blank lines of JSON lines text (formats/tasks.py reads them)."""
    return [(f"{path} line {n}", v) for n, v in datafile.json_lines(text, path, first_line)]


def _json_array(text: str, path: str) -> list:
    """[(where, value)] of the items of text holding one JSON array."""
    return [(f"{path} record {i}", v) for i, v in enumerate(datafile.json_array(text, path))]


def record_template(kind: str, conversational: bool, gguf_file: GGUFFile,
                    override_path=None) -> ChatTemplate | None:
    """The chat template records of `kind` are rendered with: chat records and conversational
    preference pairs need one (`chat_template`: the --chat-template file, else the model's;
    FormatError without); instruction records take it where there is one, else None (Alpaca's
    own prompt); other kinds None."""
    if kind == "chat" or conversational:
        return chat_template(gguf_file, override_path)
    if kind == "instruction" and (override_path is not None or gguf_file.value(TEMPLATE_KEY, None)):
        return chat_template(gguf_file, override_path)
    return None


# ---- samples ----------------------------------------------------------------------------------

def samples(records: list, kind: str, tokenizer: Tokenizer, template: ChatTemplate | None = None,
            train_on_inputs: bool = False, where: list | None = None) -> list:
    """Token samples of records of one kind (see the module docstring): list[Sample].

    records: as `read_data` gives them (text: str; prompt_completion: (prompt, completion);
    chat: a list of {"role", "content"} dicts; instruction: (instruction, input, output);
    preference: (prompt, chosen, rejected)); where: their places, for messages. An
    instruction record is a chat sample with a template, Alpaca's prompt and its output
    without one.
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
        elif kind == "instruction" and template is None:
            out.append(_prompt_completion_sample(*alpaca_prompt(rec), tokenizer, train_on_inputs))
        else:
            try:
                messages = instruction_messages(rec) if kind == "instruction" else rec
                out.append(_chat_sample(messages, tokenizer, template, train_on_inputs))
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
