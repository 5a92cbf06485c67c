"""Data files as people download them (formats/datafile.py, formats/dataset.py): every record
layout from Parquet and CSV, folders of shards, and files that are not data.

Oracle: the same records written as JSON lines and read by `read_data` (whose JSON reading
test_dataset.py checks against the files' contents); places named as each format counts
them (Parquet rows from 0, CSV lines where a row starts); exact one-line errors naming the
file for everything that is not data ggtrain reads.
"""
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ggtrain.errors import FormatError
from ggtrain.formats import datafile
from ggtrain.formats.dataset import is_plain_text, read_data

MESSAGES = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i} + {i}?"},
             {"role": "assistant", "content": f"{2 * i}."}] for i in range(9)]
RECORDS = {
    "messages": [{"messages": m} for m in MESSAGES],
    "conversations": [{"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[t["role"]],
                                          "value": t["content"]} for t in m]} for m in MESSAGES],
    "alpaca": [{"instruction": f"Double {i}.", "input": "" if i % 3 else f"Think of {i}, twice.",
                "output": f"{2 * i}"} for i in range(9)],
    "dolly": [{"instruction": f"Say {i}, \"quoted\".", "context": f"a, b\nline two {i}" if i % 2 else "",
               "response": f"{i}", "category": "open_qa"} for i in range(9)],
    "prompt_completion": [{"prompt": f"{i} times 3 is", "completion": f" {3 * i}"} for i in range(9)],
    "text": [{"text": f"Line {i}.\nAnd \"another\", with commas, {i}."} for i in range(9)],
    "preference": [{"prompt": f"Hi {i}", "chosen": "Hello!", "rejected": f"Go away {i}."} for i in range(9)],
    "preference_chat": [{"prompt": m[:2], "chosen": m[2:], "rejected": [{"role": "assistant", "content": "No."}]}
                        for m in MESSAGES],
}
FLAT = ("alpaca", "dolly", "prompt_completion", "text", "preference")       # what a CSV can hold


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _parquet(path, records, row_group_size=4):
    pq.write_table(pa.Table.from_pylist(records), path, row_group_size=row_group_size)
    return path


def _csv(path, records, delimiter=","):
    """Written by hand: quoted fields where they need it, CRLF line ends, a BOM, a blank line."""
    columns = list(records[0])

    def field(v):
        return '"' + v.replace('"', '""') + '"' if any(c in v for c in f'"\n\r{delimiter}') else v
    lines = [delimiter.join(columns)] + [delimiter.join(field(r[c]) for c in columns) for r in records]
    lines.insert(3, "")
    path.write_text("\ufeff" + "\r\n".join(lines) + "\r\n", newline="")
    return path


@pytest.mark.parametrize("name", list(RECORDS))
def test_parquet_records_are_those_of_json_lines(tmp_path, name):
    want = read_data(_jsonl(tmp_path / "r.jsonl", RECORDS[name]))
    got = read_data(_parquet(tmp_path / "r.parquet", RECORDS[name]))
    assert (got.kind, got.layout, got.records) == (want.kind, want.layout, want.records)
    assert got.where == [f"{tmp_path}/r.parquet row {i}" for i in range(9)]
    assert not is_plain_text(tmp_path / "r.parquet")


def test_parquet_structs_arrive_without_the_null_fields_of_other_rows(tmp_path):
    """A struct column holds every field any row has; a message's absent fields are not null ones."""
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "name": "bot"}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}]}]
    got = read_data(_parquet(tmp_path / "c.parquet", rows))
    assert got.records[1] == rows[1]["messages"] and got.records[0] == rows[0]["messages"]
    # a null input is none; a null required field is named
    got = read_data(_parquet(tmp_path / "a.parquet", [{"instruction": "x", "input": None, "output": "y"}]))
    assert got.records == [("x", "", "y")]
    _parquet(tmp_path / "n.parquet", [{"instruction": "x", "input": "i", "output": "y"}] * 5
             + [{"instruction": "x", "input": "i", "output": None}])
    with pytest.raises(FormatError, match=r'n\.parquet row 5: "output" is null \(expected a string\)$'):
        read_data(tmp_path / "n.parquet")


@pytest.mark.parametrize("name", FLAT)
@pytest.mark.parametrize("ext", ["csv", "tsv"])
def test_csv_records_are_those_of_json_lines(tmp_path, name, ext):
    want = read_data(_jsonl(tmp_path / "r.jsonl", RECORDS[name]))
    path = _csv(tmp_path / f"r.{ext}", RECORDS[name], "\t" if ext == "tsv" else ",")
    got = read_data(path)
    assert (got.kind, got.layout, got.records) == (want.kind, want.layout, want.records)
    # each row named by the line it starts on: the header is line 1, a blank line after row 2
    lines, line = [], 2
    for i, r in enumerate(RECORDS[name]):
        line += i == 2
        lines.append(line)
        line += 1 + sum(v.count("\n") for v in r.values())
    assert got.where == [f"{path} line {n}" for n in lines]


def test_csv_parts_are_whole_rows(tmp_path, monkeypatch):
    """Parts cut a CSV file where rows end, not where lines do (a quoted field spans lines)."""
    records = [{"instruction": f"Row {i}", "context": "x\n" * (i % 5) + f"end {i}", "response": f"{i}"}
               for i in range(300)]
    path = _csv(tmp_path / "d.csv", records)
    whole = read_data(path)
    monkeypatch.setattr(datafile, "_MIN_RANGE", 100)
    shards = datafile.open_shards(path)
    parts = datafile.parts(shards, {}, 2)
    assert len(parts) >= 8 and parts[0].lo == shards[0].body and parts[-1].hi == path.stat().st_size
    assert all(a.hi == b.lo for a, b in zip(parts, parts[1:]))
    got = [n for p in parts for n, _ in datafile.read_part(shards[0], p, {})]
    assert [f"{path} line {n}" for n in got] == whole.where


def test_parquet_parts_are_rows_of_row_groups(tmp_path, monkeypatch):
    path = _parquet(tmp_path / "t.parquet", [{"text": f"t{i}", "other": i} for i in range(50)], row_group_size=7)
    monkeypatch.setattr(datafile, "_PART_ROWS", 3)
    shards = datafile.open_shards(path)
    assert shards[0].groups == (7,) * 7 + (1,) and shards[0].columns == ("text", "other")
    parts = datafile.parts(shards, {}, 2)
    assert {(p.first, p.lo, p.hi) for p in parts} == {(g, lo, min(lo + 3, n)) for g, n in enumerate(shards[0].groups)
                                                      for lo in range(0, n, 3)}
    rows = [r for p in parts for r in datafile.read_part(shards[0], p, {}, ("text",))]
    assert rows == [(i, {"text": f"t{i}"}) for i in range(50)]          # only the columns asked for
    # each part decodes its whole row group: a group is cut into a few parts at most
    monkeypatch.setattr(datafile, "_GROUP_PARTS", 2)
    parts = datafile.parts(shards, {}, 2)
    assert [(p.first, p.lo, p.hi) for p in parts[:3]] == [(0, 0, 4), (0, 4, 7), (1, 0, 4)] and len(parts) == 15
    assert [r for p in parts for r in datafile.read_part(shards[0], p, {}, ("text",))] == rows


def test_a_folder_is_its_data_files_in_order(tmp_path):
    """Shards of any record format, in subfolders too; other files are not data."""
    rows = RECORDS["alpaca"]
    folder = tmp_path / "data"
    (folder / "train" / ".cache").mkdir(parents=True)
    _parquet(folder / "train" / "00002.parquet", rows[6:])
    _jsonl(folder / "train" / "00001.jsonl", rows[3:6])
    _csv(folder / "00000.csv", rows[:3])
    (folder / "README.md").write_text("# a dataset card\n")
    (folder / ".gitattributes").write_text("*.parquet filter=lfs\n")
    (folder / "train" / ".cache" / "x.jsonl").write_text("not json\n")
    got = read_data(folder)
    assert (got.kind, got.layout) == ("instruction", "alpaca")
    assert got.records == read_data(_jsonl(tmp_path / "all.jsonl", rows)).records
    assert got.where[2:4] == [f"{folder}/00000.csv line 5", f"{folder}/train/00001.jsonl line 1"]
    assert got.where[-1] == f"{folder}/train/00002.parquet row 2"
    assert not is_plain_text(folder)


def _unknown_columns(tmp_path):
    return _parquet(tmp_path / "u.parquet", [{"question": "q", "answer": "a"}])


BAD = [
    # (name, make(tmp_path) -> path, message after "<path>")
    ("binary .txt", lambda p: _write(p / "chat.txt", _parquet(p / "x.parquet", RECORDS["text"]).read_bytes()),
     ": a Parquet file (name it .parquet to read its records), not text"),
    ("latin-1 .txt", lambda p: _write(p / "l.txt", "café\n".encode("latin-1")), " line 1 column 4: not UTF-8 (byte 0xe9)"),
    ("utf-16 .txt", lambda p: _write(p / "w.txt", "hi\n".encode("utf-16-le")), " line 1 column 2: not text (a NUL byte"),
    ("parquet without known columns", _unknown_columns,
     ': the columns ("question", "answer") are of no layout ggtrain reads (known: {"prompt", "chosen", "rejected"}; '
     '{"messages"} (OpenAI); {"conversations"} (ShareGPT); {"instruction", "context", "response"} (Dolly); '
     '{"instruction", "input", "output"} (Alpaca); {"prompt", "completion"}; {"text"})'),
    ("parquet without a field", lambda p: _parquet(p / "m.parquet", [{"instruction": "i", "input": "x"}]),
     ': no "output" column ({"instruction", "input", "output"} (Alpaca) records need one; its columns: '
     '"instruction", "input")'),
    ("parquet without rows", lambda p: _write(p / "e.parquet", _empty_parquet()), ": no records (0 rows)"),
    ("not parquet", lambda p: _write(p / "n.parquet", b'{"text": "hi"}\n'), ": not a Parquet file ("),
    ("csv with an unknown header", lambda p: _write(p / "h.csv", b"question,answer\nq,a\n"),
     ': the header\'s fields ("question", "answer") are of no layout ggtrain reads'),
    ("csv row with fields missing", lambda p: _write(p / "r.csv", b"prompt,completion\na,b\nc\n"),
     " line 3: 1 fields, the header has 2"),
    ("csv with a bad quote", lambda p: _write(p / "q.csv", b'prompt,completion\na,"b"c\n'), " line 2: not CSV ("),
    ("csv header only", lambda p: _write(p / "o.csv", b"prompt,completion\n"), ": no records (only the header)"),
    ("csv not utf-8", lambda p: _write(p / "b.csv", b"text\nok\ncaf\xe9\n"), " line 3 column 4: not UTF-8 (byte 0xe9)"),
    ("xlsx", lambda p: _write(p / "d.xlsx", b"PK\x03\x04"),
     ": an Excel workbook, a format ggtrain does not read; give it text (.txt), JSON lines (.jsonl), JSON (.json), "
     "Parquet (.parquet) or CSV (.csv, .tsv)"),
    ("gz", lambda p: _write(p / "d.jsonl.gz", b"\x1f\x8b"), ": gzip-compressed (decompress it first), a format"),
]


def _write(path, raw: bytes):
    path.write_bytes(raw)
    return path


def _empty_parquet():
    import io
    out = io.BytesIO()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), out)
    return out.getvalue()


@pytest.mark.parametrize("case, make, message", BAD, ids=[b[0] for b in BAD])
def test_files_that_are_not_data_are_one_line_errors_naming_them(tmp_path, case, make, message):
    path = make(tmp_path)
    with pytest.raises(FormatError) as e:
        read_data(path)
    assert str(e.value).startswith(f"{path}{message}") and "\n" not in str(e.value), str(e.value)


def test_folders_that_are_not_data_are_one_line_errors(tmp_path):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _jsonl(mixed / "a.jsonl", RECORDS["alpaca"])
    _parquet(mixed / "b.parquet", RECORDS["messages"])
    with pytest.raises(FormatError, match=rf'^{mixed}/b\.parquet row 0: a \{{"messages"\}} \(OpenAI\) record, but the '
                                          rf'first record \({mixed}/a\.jsonl line 1\) is \{{"instruction", "input", '
                                          rf'"output"\}} \(Alpaca\): a file, or a folder of them, holds one layout$'):
        read_data(mixed)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "README.md").write_text("# nothing\n")
    (empty / "notes.txt").write_text("plain text is not a shard\n")
    with pytest.raises(FormatError, match=rf"^{empty}: a folder without data files \(it holds 2 other files, e\.g\. "
                                          r"README\.md\); its data files are JSON lines"):
        read_data(empty)
    unread = tmp_path / "unread"
    unread.mkdir()
    _jsonl(unread / "a.jsonl", RECORDS["text"])
    _write(unread / "b.xlsx", b"PK\x03\x04")
    with pytest.raises(FormatError, match=rf"^{unread}/b\.xlsx: an Excel workbook, a format ggtrain does not read"):
        read_data(unread)


def test_text_for_every_command_is_utf8_and_not_another_format(tmp_path):
    """read_text (eval --data) takes plain text only; read_utf8 (tokenize --file) any text."""
    jsonl = _jsonl(tmp_path / "r.jsonl", RECORDS["text"])
    assert datafile.read_utf8(jsonl) == jsonl.read_text()
    with pytest.raises(FormatError, match=rf"^{jsonl}: JSON lines of records, not plain text$"):
        datafile.read_text(jsonl)
    parquet = _parquet(tmp_path / "r.parquet", RECORDS["text"])
    for read in (datafile.read_text, datafile.read_utf8):
        with pytest.raises(FormatError, match=rf"^{parquet}: a Parquet file"):
            read(parquet)
    text = _write(tmp_path / "t.md", "\ufeffnaïve 🦙\n".encode())
    assert datafile.read_text(text) == datafile.read_utf8(text) == "\ufeffnaïve 🦙\n"
    # a NUL is UTF-8 (tokenize --file reads it), but no text to train or evaluate on
    nul = _write(tmp_path / "n.txt", b"a\n" * 40000 + b"b\x00c\n")
    assert datafile.read_utf8(nul) == "a\n" * 40000 + "b\x00c\n"
    with pytest.raises(FormatError, match=rf"^{nul} line 40001 column 2: not text \(a NUL byte"):
        datafile.read_text(nul)


def test_utf8_stream_names_the_line_and_column_across_blocks():
    raw = "ab\ncdé\n🦙x\n".encode() + b"\xff"
    for cut in range(1, len(raw)):
        stream = datafile.Utf8Stream("f")
        text = stream.feed(raw[:cut])
        with pytest.raises(FormatError, match=r"^f line 4 column 1: not UTF-8 \(byte 0xff\)$"):
            text += stream.feed(raw[cut:], final=True)
    stream = datafile.Utf8Stream("f")
    assert stream.feed(raw[:-1][:9]) + stream.feed(raw[:-1][9:], final=True) == "ab\ncdé\n🦙x\n"
    assert np.all([datafile._complete(b"a\xf0\x9f") == 1, datafile._complete(b"a\xc3\xa9") == 3])


def test_pyarrow_is_imported_only_where_parquet_is_read(tmp_path):
    """Its import takes about 0.1 s: commands and files without Parquet do not pay it."""
    import subprocess
    import sys
    data = _jsonl(tmp_path / "r.jsonl", RECORDS["alpaca"])
    parquet = _parquet(tmp_path / "r.parquet", RECORDS["alpaca"])
    code = ("import sys; import ggtrain.cli.main, ggtrain.cli.finetune, ggtrain.cli.train, ggtrain.cli.generate; "
            "from ggtrain.formats.dataset import read_data; read_data(sys.argv[1]); "
            "print('pyarrow' in sys.modules)")
    for path, imported in ((data, "False"), (parquet, "True")):
        r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout.strip() == imported, r.stderr
