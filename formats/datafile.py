"""Data files as people download them (layer 5): what a data path holds, the shards of a folder,
and their records read in parts that worker processes read on their own.

A file's format comes from its extension; a name without a known one is told by its first
non-blank byte ("{": JSON lines, "[": a JSON array, anything else: plain text):

    format    extensions          a record                            a part (one worker's read)
    text      .txt, .text         - (plain text, cut into windows)    -
    jsonl     .jsonl, .ndjson     a JSON object on one line           whole lines, about a range
                                                                      of bytes ("line 7")
    json      .json               an object of a JSON array ("{"      a slice of the array, which is
                                  first: JSON lines)                  read whole ("record 12")
    parquet   .parquet, .pq       a row: its columns are the          rows of one row group (at most
                                  fields; lists of structs (chat      8 parts a group), only the
                                  messages) arrive as lists of        columns the layout reads
                                  dicts, without their null fields    ("row 12", from 0)
    csv, tsv  .csv, .tsv          a row under the header line         whole rows, about a range of
                                                                      bytes ("line 7")

A folder is read as the shards it and its subfolders hold: the files of record formats (by
extension), in sorted order of their paths; hidden files and folders, and files of other
extensions (README.md, LICENSE, .txt), are not data; a file of a format ggtrain does not read
is an error, as is a folder without data files.

Every format but Parquet is UTF-8 text. A data file that is not (a byte that is not UTF-8,
a NUL (`read_utf8`, what `tokenize --file` reads, lets those through), the first bytes of a
binary format) or whose extension names a format ggtrain does
not read (.xlsx, .arrow, .gz, ...) is a FormatError naming the file (and line and column),
never text: `data_format` looks at a file's name and first block, `Utf8Stream` checks every
byte as it decodes. Record files' errors name the record: "data.jsonl line 7",
"chat.json record 12", "chat.parquet row 12", "data.csv line 7" (where the row starts).
pyarrow is imported only where Parquet is read.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import dataclass

from ggtrain.errors import FormatError
from ggtrain.formats.layouts import _type_words

BLOCK = 4 << 20              # bytes read at a time
SNIFF = 1 << 16              # bytes of a file looked at to tell what it is
_MIN_RANGE = 1 << 16         # bytes of JSON lines or CSV a part holds at least (tests make it small)
_PART_ROWS = 4096            # Parquet rows a part holds (unless a row group would make more than
_GROUP_PARTS = 8             # ... this many parts: a worker holds one row group, and a part of it)
_ARRAY_PART = 2000           # records of a JSON array a part holds at most
_BOM = b"\xef\xbb\xbf"
_JSON_WS = " \t\r\n"

EXTENSIONS = {".txt": "text", ".text": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json",
              ".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".tsv": "tsv"}
RECORD_FORMATS = ("jsonl", "json", "parquet", "csv", "tsv")
# how a record's place is named in each format
WORDS = {"jsonl": "line", "json": "record", "parquet": "row", "csv": "line", "tsv": "line"}
# extensions of formats ggtrain does not read: what they are
UNREAD = {
    ".xlsx": "an Excel workbook", ".xls": "an Excel workbook", ".ods": "a spreadsheet",
    ".arrow": "an Arrow file (a Hugging Face datasets cache: its Parquet or JSON files are read)",
    ".feather": "an Arrow file", ".avro": "an Avro file", ".orc": "an ORC file",
    ".gz": "gzip-compressed (decompress it first)", ".bz2": "bzip2-compressed (decompress it first)",
    ".xz": "xz-compressed (decompress it first)", ".zst": "zstd-compressed (decompress it first)",
    ".zip": "a zip archive (unpack it first)", ".tar": "a tar archive (unpack it first)",
    ".7z": "a 7-zip archive (unpack it first)", ".pdf": "a PDF document", ".doc": "a Word document",
    ".docx": "a Word document", ".pkl": "a Python pickle", ".pickle": "a Python pickle",
    ".npy": "a numpy array", ".npz": "numpy arrays", ".pt": "a PyTorch file", ".pth": "a PyTorch file",
    ".safetensors": "a safetensors file", ".gguf": "a GGUF model", ".bin": "a binary file",
    ".h5": "an HDF5 file", ".hdf5": "an HDF5 file", ".db": "a database", ".sqlite": "an SQLite database",
}
# the first bytes of binary formats, for a file whose name does not say what it is
MAGIC = ((b"PAR1", "a Parquet file (name it .parquet to read its records)"),
         (b"PK\x03\x04", "a zip archive (.zip, .xlsx, .docx, ...)"), (b"\x1f\x8b", "gzip-compressed"),
         (b"GGUF", "a GGUF model"), (b"\xfd7zXZ\x00", "xz-compressed"), (b"(\xb5/\xfd", "zstd-compressed"),
         (b"ARROW1", "an Arrow file"), (b"\x89HDF", "an HDF5 file"))
_KNOWN = "text (.txt), JSON lines (.jsonl), JSON (.json), Parquet (.parquet) or CSV (.csv, .tsv)"


# ---- text -------------------------------------------------------------------------------------

def _complete(raw: bytes) -> int:
    """The length of `raw` without a UTF-8 sequence its end cuts short (which the next bytes
    may complete)."""
    for back in range(1, min(3, len(raw)) + 1):
        b = raw[-back]
        if b & 0xC0 == 0x80:
            continue                         # a continuation byte: look further back
        if b >= 0xC0:
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            if back < need:
                return len(raw) - back
        break
    return len(raw)


class Utf8Stream:
    """Decodes a file's bytes block after block, strictly: the first byte that is not UTF-8
    text, or a NUL (no training text holds one; binary files and UTF-16 do; nul=True lets
    them through, for `read_utf8`), is a FormatError naming
    the file's line and column (in bytes, from 1). A UTF-8 sequence cut by a block's end
    waits for the next block."""

    def __init__(self, path: str, first_line: int = 1, nul: bool = False):
        self.nul = nul
        self.path = path
        self.line = first_line       # the line of the next byte fed
        self.column = 1              # ... and its column
        self.held = b""

    def feed(self, raw: bytes, final: bool = False) -> str:
        """The text of the bytes fed so far that is complete (all with final)."""
        raw = self.held + raw
        end = len(raw) if final else _complete(raw)
        self.held = raw[end:]
        raw = raw[:end]
        nul = -1 if self.nul else raw.find(b"\x00")
        try:
            text = raw[:nul if nul >= 0 else len(raw)].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._error(raw, e.start, f"not UTF-8 (byte 0x{raw[e.start]:02x})") from None
        if nul >= 0:
            raise self._error(raw, nul, "not text (a NUL byte: a binary or UTF-16 file?)")
        newlines = raw.count(b"\n")
        if newlines:
            self.line += newlines
            self.column = len(raw) - raw.rfind(b"\n")
        else:
            self.column += len(raw)
        return text

    def _error(self, raw: bytes, at: int, what: str) -> FormatError:
        before = raw.rfind(b"\n", 0, at)
        line = self.line + raw.count(b"\n", 0, at)
        column = at - before if before >= 0 else self.column + at
        return FormatError(f"{self.path} line {line} column {column}: {what}")


def decode(raw: bytes, path: str, first_line: int = 1, nul: bool = False) -> str:
    """`raw`, the bytes of a text file from line first_line on, decoded (see Utf8Stream)."""
    return Utf8Stream(path, first_line, nul).feed(raw, final=True)


def _sniff(path: str, head: bytes, nul: bool = False) -> None:
    """Raises FormatError if the first bytes of a file that should be text are a binary
    format's or not text."""
    for magic, what in MAGIC:
        if head.startswith(magic):
            raise FormatError(f"{path}: {what}, not text")
    Utf8Stream(path, nul=nul).feed(head[len(_BOM):] if head.startswith(_BOM) else head)


def first_byte(path: str) -> bytes | None:
    """A text file's first byte that is not whitespace (after a byte order mark); None when
    it has none."""
    with open(path, "rb") as f:
        head = f.read(len(_BOM))
        if head != _BOM:
            f.seek(0)
        while block := f.read(SNIFF):
            block = block.lstrip(_JSON_WS.encode())
            if block:
                return block[:1]
    return None


def data_format(path, nul: bool = False) -> str:
    """What a data path holds: "folder", or a file's format (see the module docstring).

    Raises FormatError naming the file for an extension of a format ggtrain does not read, a
    text file (every format but Parquet) whose first block is a binary format or not text, and
    a .json file that starts with neither "{" nor "["; FileNotFoundError when it is absent."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return "folder"
    ext = os.path.splitext(path)[1].lower()
    if ext in UNREAD:
        raise FormatError(f"{path}: {UNREAD[ext]}, a format ggtrain does not read; give it {_KNOWN}")
    fmt = EXTENSIONS.get(ext)
    if fmt == "parquet":
        with open(path, "rb"):
            return fmt
    with open(path, "rb") as f:
        _sniff(path, f.read(SNIFF), nul)
    if fmt in ("text", "jsonl", "csv", "tsv"):
        return fmt
    first = first_byte(path)
    if first == b"{":
        return "jsonl"
    if first == b"[":
        return "json"
    if fmt == "json" and first is not None:
        raise FormatError(f"{path}: not JSON lines or a JSON array of records "
                          f"(it starts with {first.decode('latin-1')!r})")
    return fmt or "text"


def require_text(path) -> None:
    """Raises FormatError unless `data_format` tells `path` is plain text (records, a folder,
    a binary or unread format are not)."""
    fmt = data_format(path)
    if fmt != "text":
        raise FormatError(f"{os.fspath(path)}: {format_words(fmt)}, not plain text")


def read_utf8(path) -> str:
    """The whole of a text file of any format but Parquet, decoded byte for byte (a byte
    order mark kept, and NUL characters: UTF-8 text may hold them); FormatError for a binary or
    unread format, or bytes that are not UTF-8; IsADirectoryError for a folder."""
    path = os.fspath(path)
    fmt = data_format(path, nul=True)
    if fmt == "folder":
        raise IsADirectoryError(21, "Is a directory", path)
    if fmt == "parquet":
        raise FormatError(f"{path}: a Parquet file, not text")
    with open(path, "rb") as f:
        return decode(f.read(), path, nul=True)


def read_text(path) -> str:
    """The whole of a plain-text file, decoded (a byte order mark kept, as a character);
    FormatError for a file that is not plain text (`require_text`) or not UTF-8 text;
    IsADirectoryError for a folder."""
    if os.path.isdir(path):
        raise IsADirectoryError(21, "Is a directory", os.fspath(path))
    require_text(path)
    with open(path, "rb") as f:
        return decode(f.read(), os.fspath(path))


def check_utf8(path) -> None:
    """Raises FormatError (naming the line and column) at a file's first byte that is not
    UTF-8 text (`Utf8Stream`), reading it through once, in blocks."""
    path = os.fspath(path)
    stream = Utf8Stream(path)
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            stream.feed(block)
    stream.feed(b"", final=True)


def format_words(fmt: str) -> str:
    """What a format is, in messages ("a Parquet file of records")."""
    return {"folder": "a folder", "jsonl": "JSON lines of records", "json": "a JSON array of records",
            "parquet": "a Parquet file of records", "csv": "a CSV file of records",
            "tsv": "a TSV file of records"}.get(fmt, fmt)


# ---- shards -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shard:
    """One record file: path, format (one of RECORD_FORMATS); columns: the fields of its
    records (Parquet: the schema's; CSV: the header's); groups: rows in each Parquet row
    group; body, body_line: where a CSV file's rows start (byte offset and line)."""
    path: str
    format: str
    columns: tuple = ()
    groups: tuple = ()
    body: int = 0
    body_line: int = 1

    def where(self, number: int) -> str:
        """How messages name record `number` (its line, index or row)."""
        return f"{self.path} {WORDS[self.format]} {number}"


def data_files(path) -> list:
    """The files of a data path: itself, or a folder's data files (see the module docstring),
    sorted. FormatError for a folder holding a file of a format ggtrain does not read, or no
    data file."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return [path]
    found, other = [], []
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            ext = os.path.splitext(name)[1].lower()
            full = os.path.join(root, name)
            if ext in UNREAD:
                raise FormatError(f"{full}: {UNREAD[ext]}, a format ggtrain does not read; a folder's "
                                  f"data files are JSON lines, JSON, Parquet or CSV")
            (found if EXTENSIONS.get(ext) in RECORD_FORMATS else other).append(full)
    if not found:
        seen = f" (it holds {len(other)} other files, e.g. {os.path.basename(sorted(other)[0])})" if other else ""
        raise FormatError(f"{path}: a folder without data files{seen}; its data files are JSON lines "
                          f"(.jsonl), JSON (.json), Parquet (.parquet) or CSV (.csv, .tsv) records")
    return sorted(found, key=lambda p: os.path.relpath(p, path))


def open_shards(path) -> list:
    """The shards of a record file or a folder of them: list[Shard]. Raises FormatError for a
    file that is not a record file (plain text, an unread format), an unreadable Parquet file
    or a bad CSV header."""
    path = os.fspath(path)
    shards = []
    for file in data_files(path):
        fmt = data_format(file)
        if fmt not in RECORD_FORMATS:
            if fmt == "text" and first_byte(file) is None:   # not text either: nothing at all
                raise FormatError(f"{file}: the file is empty")
            raise FormatError(f"{file}: {format_words(fmt)}, not records")
        if fmt == "parquet":
            meta = _parquet(file).metadata
            groups = tuple(meta.row_group(g).num_rows for g in range(meta.num_row_groups))
            shards.append(Shard(file, fmt, tuple(meta.schema.to_arrow_schema().names), groups))
        elif fmt in ("csv", "tsv"):
            columns, body, body_line = _csv_header(file, fmt)
            shards.append(Shard(file, fmt, columns, body=body, body_line=body_line))
        else:
            shards.append(Shard(file, fmt))
    return shards


# ---- parts ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Part:
    """What one worker reads of shard number `shard`: JSON lines and CSV: bytes lo..hi, the
    first of them on line `first`; a JSON array: records lo..hi; Parquet: rows lo..hi of row
    group `first`. size: the bytes of the shard it stands for (for progress)."""
    shard: int
    lo: int
    hi: int
    first: int
    size: int


def parts(shards: list, arrays: dict, workers: int) -> list:
    """The parts of the shards, about 4 a worker, each read by one (`read_part`); arrays:
    the values of the JSON array shards (`read_arrays`)."""
    total = sum(os.path.getsize(s.path) for s in shards)
    chunk = max(_MIN_RANGE, min(BLOCK, -(-total // (4 * workers))))
    rows = sum(sum(s.groups) for s in shards)
    per_part = max(1, min(_PART_ROWS, -(-rows // (4 * workers))))
    out = []
    for k, s in enumerate(shards):
        size = os.path.getsize(s.path)
        if s.format == "jsonl":
            out += [Part(k, lo, hi, line, hi - lo) for lo, hi, line in _line_ranges(s.path, chunk)]
        elif s.format in ("csv", "tsv"):
            out += [Part(k, lo, hi, line, hi - lo) for lo, hi, line in _csv_ranges(s, chunk)]
        elif s.format == "json":
            n = len(arrays[s.path])
            step = max(1, min(_ARRAY_PART, -(-n // (4 * workers))))
            out += [Part(k, lo, min(n, lo + step), 0, size * (min(n, lo + step) - lo) // n)
                    for lo in range(0, n, step)]
        else:
            n = max(1, sum(s.groups))
            for g, g_rows in enumerate(s.groups):
                # each part of a group decodes the whole group (Parquet's unit): a few parts at most
                step = -(-g_rows // min(_GROUP_PARTS, -(-g_rows // per_part))) if g_rows else 1
                out += [Part(k, lo, min(g_rows, lo + step), g, size * (min(g_rows, lo + step) - lo) // n)
                        for lo in range(0, g_rows, step)]
    return out


def read_part(shard: Shard, part: Part, arrays: dict, columns: tuple | None = None) -> list:
    """[(number, record)] of a part: each record's line, index or row, and the record (a JSON
    value; a dict of a row's columns, only `columns` of Parquet's when given)."""
    if shard.format == "jsonl":
        raw = _read_bytes(shard.path, part.lo, part.hi)
        if part.lo == 0 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        return json_lines(decode(raw, shard.path, part.first), shard.path, part.first)
    if shard.format == "json":
        return list(enumerate(arrays[shard.path][part.lo:part.hi], part.lo))
    if shard.format == "parquet":
        return _parquet_rows(shard, part, columns)
    return _csv_rows(shard, part)


def first_record(shard: Shard, arrays: dict, columns: tuple | None = None) -> tuple:
    """(number, record) of a shard's first record; FormatError when it holds none."""
    if shard.format == "jsonl":
        with open(shard.path, "rb") as f:
            line, lo = 1, 0
            while raw := f.readline():
                blank = raw.strip(_JSON_WS.encode())
                if blank and not (lo == 0 and blank == _BOM):
                    return read_part(shard, Part(0, lo, lo + len(raw), line, len(raw)), arrays)[0]
                line, lo = line + 1, lo + len(raw)
        raise FormatError(f"{shard.path}: the file is empty")
    if shard.format == "json":
        return 0, arrays[shard.path][0]
    if shard.format == "parquet":
        if not any(shard.groups):
            raise FormatError(f"{shard.path}: no records (0 rows)")
        g = next(g for g, n in enumerate(shard.groups) if n)
        return _parquet_rows(shard, Part(0, 0, 1, g, 0), columns)[0]
    rows = _csv_rows(shard, Part(0, shard.body, os.path.getsize(shard.path), shard.body_line, 0), limit=1)
    if not rows:
        raise FormatError(f"{shard.path}: no records (only the header)")
    return rows[0]


def read_arrays(shards: list) -> dict:
    """The values of the JSON array shards, each read whole: {path: list}."""
    return {s.path: read_array(s.path) for s in shards if s.format == "json"}


def _read_bytes(path: str, lo: int, hi: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(lo)
        return f.read(hi - lo)


# ---- JSON -------------------------------------------------------------------------------------

def json_lines(text: str, path: str, first_line: int = 1) -> list:
    """[(line, value)] of the non-blank lines of JSON lines text (that starts on first_line)."""
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
        out.append((n, value))
    return out


def json_array(text: str, path: str) -> list:
    """The values of text holding one JSON array (FormatError for anything else, or none)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise FormatError(f"{path}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        raise FormatError(f"{path} line {e.lineno} column {e.colno}: invalid JSON ({e.msg})") from None
    if not isinstance(value, list):
        raise FormatError(f"{path}: the file holds {_type_words(value)}, not an array of records")
    if not value:
        raise FormatError(f"{path}: the JSON array holds no records")
    return value


def read_array(path: str) -> list:
    """The values of a JSON array file."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(_BOM):
        raw = raw[len(_BOM):]
    if not raw.strip():
        raise FormatError(f"{path}: the file is empty")
    return json_array(decode(raw, path), path)


def _line_ranges(path: str, chunk: int) -> list:
    """(lo, hi, first line) of consecutive ranges of whole lines, each about chunk bytes (a
    longer line: a range of its own)."""
    out, lo, line, buf = [], 0, 1, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(BLOCK)
            buf += block
            while len(buf) > chunk and (nl := buf.find(b"\n", chunk - 1)) >= 0:
                out.append((lo, lo + nl + 1, line))
                line += buf.count(b"\n", 0, nl + 1)
                lo, buf = lo + nl + 1, buf[nl + 1:]
            if not block:
                break
    if buf:
        out.append((lo, lo + len(buf), line))
    return out


# ---- CSV --------------------------------------------------------------------------------------

def _csv_lines(path: str, lo: int, hi: int, line: int, state: dict):
    """The lines of bytes lo..hi of a CSV file (line `line` at lo), decoded; as each is
    given, state["end"] is the offset after it and state["line"] the line after it."""
    state["end"], state["line"] = lo, line
    with open(path, "rb") as f:
        f.seek(lo)
        while state["end"] < hi and (raw := f.readline(hi - state["end"])):
            start = len(_BOM) if state["end"] == 0 and raw.startswith(_BOM) else 0
            text = decode(raw[start:], path, state["line"])
            state["end"] += len(raw)
            state["line"] += 1
            yield text


def _csv_reader(lines, fmt: str):
    if csv.field_size_limit() < (1 << 31) - 1:
        csv.field_size_limit(min(sys.maxsize, (1 << 31) - 1))   # a long answer is one field
    return csv.reader(lines, delimiter="\t" if fmt == "tsv" else ",", strict=True)


def _csv_next(reader, path: str, state: dict):
    try:
        return next(reader, None)
    except csv.Error as e:
        raise FormatError(f"{path} line {state['line'] - 1}: not CSV ({e})") from None


def _csv_header(path: str, fmt: str) -> tuple:
    """(columns, byte offset and line after the header) of a CSV file."""
    state: dict = {}
    reader = _csv_reader(_csv_lines(path, 0, os.path.getsize(path), 1, state), fmt)
    while (row := _csv_next(reader, path, state)) is not None and not any(row):
        pass
    if row is None:
        raise FormatError(f"{path}: the file is empty")
    columns = tuple(c.strip() for c in row)
    for c in columns:
        if columns.count(c) > 1:
            raise FormatError(f'{path} line {state["line"] - 1}: the header names "{c}" twice')
    return columns, state["end"], state["line"]


def _csv_ranges(shard: Shard, chunk: int) -> list:
    """(lo, hi, first line) of consecutive ranges of whole rows of a CSV file's body, each
    about chunk bytes (a row's quoted field may span lines)."""
    state: dict = {}
    reader = _csv_reader(_csv_lines(shard.path, shard.body, os.path.getsize(shard.path), shard.body_line, state),
                         shard.format)
    out, lo, line = [], shard.body, shard.body_line
    while _csv_next(reader, shard.path, state) is not None:
        if state["end"] - lo >= chunk:
            out.append((lo, state["end"], line))
            lo, line = state["end"], state["line"]
    if state["end"] > lo:
        out.append((lo, state["end"], line))
    return out


def _csv_rows(shard: Shard, part: Part, limit: int | None = None) -> list:
    """[(line, {column: value})] of the rows of a CSV part (blank lines skipped)."""
    state: dict = {}
    reader = _csv_reader(_csv_lines(shard.path, part.lo, part.hi, part.first, state), shard.format)
    out = []
    while limit is None or len(out) < limit:
        line = part.first + reader.line_num
        row = _csv_next(reader, shard.path, state)
        if row is None:
            break
        if not any(row):
            continue
        if len(row) != len(shard.columns):
            raise FormatError(f"{shard.path} line {line}: {len(row)} fields, the header has {len(shard.columns)}")
        out.append((line, dict(zip(shard.columns, row))))
    return out


# ---- Parquet ----------------------------------------------------------------------------------

def _parquet(path: str):
    """A pyarrow ParquetFile (pyarrow imported here, so other commands do not pay for it)."""
    import pyarrow
    import pyarrow.parquet as pq
    try:
        return pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as e:
        raise FormatError(f"{path}: not a Parquet file ({str(e).splitlines()[0]})") from None


def _without_nulls(value):
    """A Parquet value with the null fields of its structs dropped (a struct column holds
    every field any row has: a message without "name" arrives with "name": None)."""
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def _parquet_rows(shard: Shard, part: Part, columns: tuple | None) -> list:
    """[(row, {column: value})] of the rows lo..hi of a row group (only `columns` read)."""
    import pyarrow
    base = sum(shard.groups[:part.first])
    try:
        table = _parquet(shard.path).read_row_group(part.first, columns=list(columns) if columns else None,
                                                    use_threads=False)   # the workers are the threads
        rows = table.slice(part.lo, part.hi - part.lo).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
        raise FormatError(f"{shard.path} row group {part.first}: cannot read it ({str(e).splitlines()[0]})") from None
    return [(base + part.lo + i, {k: _without_nulls(v) for k, v in row.items()}) for i, row in enumerate(rows)]
