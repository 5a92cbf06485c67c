"""Corpora tokenized as a stream into cached token files (formats/corpus.py), the cut rule
that makes the stream exact (Tokenizer.cut), and the word-cache BPE path of long texts."""
import csv
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats import corpus, datafile, sample_cache
from ggtrain.formats.corpus import corpus_tokens
from ggtrain.formats.files import _host
from ggtrain.formats.pretokenizer import BPE_PRE
from ggtrain.formats.tokenizer import (ATTR_USER_DEFINED, BpeTokenizer, ByteTokenizer, load_tokenizer,
                                       tokenizer_from_gguf, train_bpe)

VOCABS = ["models/SmolLM2-135M-Instruct.Q4_1.gguf", "gguf/stories260K.gguf", "gguf/ggml-vocab-llama-spm.gguf",
          "gguf/ggml-vocab-phi-3.gguf", "gguf/ggml-vocab-llama-bpe.gguf", "gguf/ggml-vocab-qwen2.gguf",
          "gguf/ggml-vocab-deepseek-llm.gguf", "gguf/ggml-vocab-gpt-2.gguf", "gguf/ggml-vocab-starcoder.gguf",
          "gguf/ggml-vocab-falcon.gguf"]


def _vocab(shared_data, name):
    path = shared_data / name
    if not path.exists():
        pytest.skip(f"{path} is not there")
    return tokenizer_from_gguf(path)


def _mixed_text(shared_data, tok=None) -> str:
    """Real prose with code, digits, whitespace runs, CJK, undecodable bytes (surrogates) and,
    where the vocabulary has them, user-defined tokens (plain text is split at those)."""
    prose = (shared_data / "text" / "tinyshakespeare.txt").read_text()[:12000]
    odd = (" \u3000日本語のテキスト\n\n  hello   world\t\t\n\n\n1234567 x\udc80\udcff y "
           "def f(x):\n    return x**2  # ok\n\u00e9t\u00e9 \u2014 \u201cquoted\u201d \u0440\u0443\u0441\n")
    text = prose[:5000] + odd + prose[5000:9000] + odd + prose[9000:]
    if tok is not None:
        user = [tok.tokens[i] for i in range(tok.n_vocab) if tok.attrs[i] & ATTR_USER_DEFINED]
        if user:
            u = user[len(user) // 2]
            text = text[:3000] + u + "\nAbc " + u + " " + text[3000:]
    return text


def _check_cuts(tok, text, seed=0):
    rng = np.random.default_rng(seed)
    whole = tok.encode(text, add_bos=True)
    p, cuts = 1, 0
    while (q := tok.cut(text, p + int(rng.integers(1, 400)))) is not None:
        left, right = tok.encode(text[:q], add_bos=True), tok.encode(text[q:], continued=True)
        assert np.array_equal(np.concatenate([left, right]), whole), f"cut at {q}: {text[q - 10:q + 10]!r}"
        p, cuts = q, cuts + 1
    assert cuts > len(text) // 2000       # cuts are found all along the text, not once in a while


@pytest.mark.parametrize("name", VOCABS)
def test_cutting_where_cut_allows_keeps_every_id(shared_data, name):
    tok = _vocab(shared_data, name)
    _check_cuts(tok, _mixed_text(shared_data, tok))


def test_cut_of_byte_and_trained_bpe_tokenizers(shared_data):
    text = _mixed_text(shared_data)
    _check_cuts(ByteTokenizer(), text)
    _check_cuts(train_bpe(text, 400), text)


def test_cut_keeps_away_from_user_defined_tokens():
    tok = train_bpe("ab\ncd\nef\n" * 50, 300)

    def with_user(text):
        return BpeTokenizer(tok.tokens + [text], np.append(tok.token_type, 4), tok.merges, tok.bos_id,
                            tok.eos_id, pre=tok.pre)
    text = "xy\nAb"
    assert tok.cut(text, 1) == 3                    # after the lone "\n"
    assert with_user("y\nA").cut(text, 1) is None   # it would split the token in two
    assert with_user("y\n").cut(text, 1) is None    # it ends there: what follows starts a fragment
    assert with_user("Ab").cut(text, 1) == 3         # one starting there is whole on one side


@pytest.mark.parametrize("name", [v for v in VOCABS if "spm" not in v and "phi-3" not in v and "stories" not in v])
def test_word_cache_path_gives_the_ids_of_tokenizers(shared_data, name):
    tok = _vocab(shared_data, name)
    assert isinstance(tok, BpeTokenizer)
    safe = (shared_data / "text" / "tinyshakespeare.txt").read_text()[:30000]
    rng = np.random.default_rng(1)
    # every character of the range the word cache takes, in random runs among the prose
    pool = [chr(c) for c in range(0x530)] + [chr(c) for c in range(0x2000, 0x2070)]
    noise = "".join("".join(rng.choice(pool, int(rng.integers(1, 12)))) + " " for _ in range(3000))
    for text in (safe, noise + safe + noise, safe + "\u3000日本語"):
        fast = tok.encode(text)
        slow_tok = tok._fast
        tok._fast = None
        try:
            slow = tok.encode(text)
        finally:
            tok._fast = slow_tok
        assert np.array_equal(fast, slow)
    if tok.pre != "deepseek-llm":     # its regexes intersect classes (&&): tokenizers only
        assert tok._fast is not None


def test_regex_module_and_oniguruma_agree_on_the_word_cache_range():
    """The word cache's pre-tokens come from the `regex` module, llama.cpp's (and
    tokenizers') from Unicode 15.1 tables: on the characters it takes they must be the same."""
    from tokenizers import Regex, pre_tokenizers
    import regex

    from ggtrain.formats.tokenizer_bpe import _FAST_UNSAFE
    chars = "".join(chr(c) for c in range(0x110000)
                    if not 0xD800 <= c < 0xE000 and not _FAST_UNSAFE.match(chr(c)))
    assert len(chars) == 0x530 + 0x70
    classes = sorted({c for pre in BPE_PRE.values() for r in pre.regexes
                      for c in re.findall(r"\\p\{\w+\}|\\s|\\S", r)})
    assert {r"\p{L}", r"\p{N}", r"\s"} <= set(classes)
    for cls in classes:
        split = pre_tokenizers.Split(Regex(cls), behavior="removed")
        onig = set("".join(piece for piece, _ in split.pre_tokenize_str(chars)))   # not matched
        ours = {c for c in chars if not regex.match(cls, c)}
        assert onig == ours, cls


# ---- corpus_tokens ---------------------------------------------------------------------------

def _raw_corpus(shared_data) -> bytes:
    text = _mixed_text(shared_data).replace("\udc80\udcff", "")
    # a byte order mark, and 4-byte characters that blocks of every size below cut
    raw = text.encode("utf-8")
    return b"\xef\xbb\xbf" + raw[:7001] + "🦙".encode() + raw[7001:20000] + "𝄞😀".encode() + raw[20000:]


def _expected(tok, raw, add_bos):
    return tok.encode(raw[3:].decode("utf-8"), add_bos=add_bos)


@pytest.mark.parametrize("name", ["models/SmolLM2-135M-Instruct.Q4_1.gguf", "gguf/stories260K.gguf", "byte"])
@pytest.mark.parametrize("workers", [1, 2])
def test_stream_gives_the_ids_of_the_whole_text(shared_data, tmp_path, monkeypatch, name, workers):
    tok = ByteTokenizer() if name == "byte" else _vocab(shared_data, name)
    raw = _raw_corpus(shared_data)
    path = tmp_path / "corpus.txt"
    path.write_bytes(raw)
    # small blocks: every multibyte character and cut sequence meets a block's end somewhere
    for block in (997, 1000, 1001, 4093):
        monkeypatch.setattr(corpus, "BLOCK", block)
        monkeypatch.setattr(corpus, "_REACH", 300)
        for add_bos in (False, True):
            seen = []
            got = corpus_tokens(path, tok, add_bos=add_bos, cache_dir=None, workers=workers,
                                progress=lambda done, total, n: seen.append((done, total, n)))
            want = _expected(tok, raw, add_bos)
            assert np.array_equal(got.ids, want)
            assert got.fingerprint == hashlib.sha256(want.astype("<i4").tobytes()).hexdigest()
            dones = [d for d, _, _ in seen]
            assert dones == sorted(dones) and dones[-1] == len(raw) and seen[-1][1] == len(raw)
            assert seen[-1][2] == len(want)


def _pieces_encoded(monkeypatch, tok, path) -> tuple:
    """(ids of corpus_tokens(path), the length of each piece it encoded)."""
    lengths = []
    encode = type(tok).encode

    def spy(self, text, *args, **kwargs):
        lengths.append(len(text))
        return encode(self, text, *args, **kwargs)
    with monkeypatch.context() as m:
        m.setattr(type(tok), "encode", spy)
        got = corpus_tokens(path, tok, cache_dir=None, workers=1)
    return got.ids, lengths


def test_stream_holds_pieces_of_a_block_not_the_text(shared_data, tmp_path, monkeypatch):
    tok = _vocab(shared_data, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
    path = tmp_path / "big.txt"
    path.write_text((shared_data / "text" / "tinyshakespeare.txt").read_text() * 2)
    monkeypatch.setattr(corpus, "BLOCK", 1 << 16)
    ids, longest = _pieces_encoded(monkeypatch, tok, path)
    assert len(longest) > 30 and max(longest) <= (1 << 16) + (1 << 16)
    assert np.array_equal(ids, tok.encode(path.read_text()))


def test_cache_is_reused_and_keyed_by_content_tokenizer_and_bos(shared_data, tmp_path, monkeypatch):
    tok = ByteTokenizer()
    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    path.write_text("to be or not to be\n" * 500)
    first = corpus_tokens(path, tok, cache_dir=str(cache))
    assert not first.cached and sorted(p.suffix for p in cache.iterdir()) == [".json", ".tokens"]

    def no_encoding(*a, **k):
        raise AssertionError("tokenized again")
    monkeypatch.setattr(ByteTokenizer, "encode", no_encoding)
    again = corpus_tokens(path, tok, cache_dir=str(cache))
    assert again.cached and np.array_equal(again.ids, first.ids) and again.fingerprint == first.fingerprint
    monkeypatch.undo()
    # another text, another tokenizer, BOS: each its own file
    assert not corpus_tokens(path, tok, add_bos=True, cache_dir=str(cache)).cached
    assert not corpus_tokens(path, train_bpe(path.read_text(), 300), cache_dir=str(cache)).cached
    path.write_text("to be or not to be?\n" * 500)
    changed = corpus_tokens(path, tok, cache_dir=str(cache))
    assert not changed.cached and changed.fingerprint != first.fingerprint
    assert len(list(cache.glob("*.tokens"))) == 4


def test_a_damaged_or_unfinished_cache_entry_is_tokenized_again(tmp_path):
    tok = ByteTokenizer()
    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    path.write_text("abc def\n" * 300)
    want = np.array(corpus_tokens(path, tok, cache_dir=str(cache)).ids)   # a copy, not the map
    tokens = next(cache.glob("*.tokens"))
    with open(tokens, "r+b") as f:
        f.truncate(100)                                     # cut short
    again = corpus_tokens(path, tok, cache_dir=str(cache))
    assert not again.cached and np.array_equal(again.ids, want)
    next(cache.glob("*.json")).unlink()                     # killed before the .json was written
    third = corpus_tokens(path, tok, cache_dir=str(cache))
    assert not third.cached and np.array_equal(third.ids, want)


def test_temporary_files_of_a_killed_run_are_removed_and_live_ones_kept(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = cache / f".k.tokens.{_host()}-{gone.pid}.12345678.tmp"
    fresh = cache / f".k.tokens.{_host()}-{os.getpid()}.12345678.tmp"
    stale.write_bytes(b"x" * 10)
    fresh.write_bytes(b"y" * 10)
    path = tmp_path / "c.txt"
    path.write_text("hello world\n")
    corpus_tokens(path, ByteTokenizer(), cache_dir=str(cache))
    assert not stale.exists() and fresh.exists()


def test_no_cache_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus.tempfile, "tempdir", str(tmp_path / "t"))
    (tmp_path / "t").mkdir()
    path = tmp_path / "c.txt"
    path.write_text("hello world\n" * 100)
    got = corpus_tokens(path, ByteTokenizer(), cache_dir=None)
    assert len(got.ids) == 1200 and got.path is None
    assert list((tmp_path / "t").iterdir()) == []


def test_a_failed_tokenization_leaves_nothing_under_a_final_name(tmp_path, monkeypatch):
    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    path.write_text("hello world\n" * 100)

    def broken(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(ByteTokenizer, "encode", broken)
    with pytest.raises(KeyboardInterrupt):
        corpus_tokens(path, ByteTokenizer(), cache_dir=str(cache))
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("content", [b"", b"  \n\t\n", b"\xef\xbb\xbf\n"])
def test_a_file_without_text_is_one_error(tmp_path, content):
    path = tmp_path / "e.txt"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="the file is empty"):
        corpus_tokens(path, ByteTokenizer(), cache_dir=str(tmp_path / "cache"))
    assert not list((tmp_path / "cache").glob("*"))


@pytest.mark.parametrize("bad, where", [(b"\xe2(", "line 41 column 9: not UTF-8 (byte 0xe2)"),
                                        (b"\x00", "line 41 column 9: not text (a NUL byte"),
                                        (b"\xf0\x9f\x98", "line 41 column 9: not UTF-8 (byte 0xf0)")])
def test_a_corpus_that_is_not_utf8_text_is_one_error_before_any_tokenizing(tmp_path, monkeypatch, bad, where):
    """Far past the first block (which data_format looks at), and cut by a block's end."""
    monkeypatch.setattr(corpus, "BLOCK", 1000)
    path, cache = tmp_path / "c.txt", tmp_path / "cache"
    line = "abcdefghijklmnopqrstuvwxyz 0123456789 éü\n".encode()
    path.write_bytes(line * (datafile.SNIFF // len(line) + 40) + b"12345678" + bad + b" tail\n" + line)
    monkeypatch.setattr(ByteTokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    with pytest.raises(FormatError, match=re.escape(f"{path} line {datafile.SNIFF // len(line) + 41}"
                                                    f"{where[7:]}")):
        corpus_tokens(path, ByteTokenizer(), cache_dir=str(cache))
    assert not list(cache.glob("*"))


@pytest.mark.parametrize("name, content, message", [
    ("r.jsonl", b'{"text": "a"}\n', "JSON lines of records, not plain text"),
    ("r.parquet", b"PAR1", "a Parquet file of records, not plain text"),
    ("p.txt", b"PAR1\x15\x04\x15\xa0", "a Parquet file (name it .parquet to read its records), not text"),
    ("x.xlsx", b"PK\x03\x04", "an Excel workbook, a format ggtrain does not read")])
def test_a_corpus_that_is_not_plain_text_is_one_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(FormatError, match=re.escape(f"{path}: {message}")):
        corpus_tokens(path, ByteTokenizer(), cache_dir=None)


def test_tokenizer_fingerprint_tells_vocabularies_apart(shared_data):
    a = load_tokenizer("byte")
    assert a.fingerprint() == ByteTokenizer().fingerprint()
    text = (shared_data / "text" / "tinyshakespeare.txt").read_text()[:20000]
    assert train_bpe(text, 300).fingerprint() == train_bpe(text, 300).fingerprint()
    assert len({a.fingerprint(), train_bpe(text, 300).fingerprint(), train_bpe(text, 301).fingerprint()}) == 3


# ---- record files: samples made in parallel and kept -----------------------------------------

def _record_files(tmp_path, shared_data):
    chat = json.loads((shared_data / "chat" / "dummy_conversation.json").read_text())[:120]
    files = {
        "chat": ("chat.json", json.dumps([{"conversations": c["conversations"]} for c in chat])),
        "text": ("text.jsonl", "\n".join(json.dumps({"text": t["value"]}) for c in chat for t in c["conversations"])),
        "prompt_completion": ("pc.jsonl", "\n".join(json.dumps({"prompt": c["conversations"][0]["value"],
                                                                "completion": " " + c["conversations"][1]["value"]})
                                                    for c in chat)),
        "preference": ("pref.jsonl", "\n".join(json.dumps({
            "prompt": [{"role": "user", "content": c["conversations"][0]["value"]}],
            "chosen": [{"role": "assistant", "content": c["conversations"][1]["value"]}],
            "rejected": [{"role": "assistant", "content": "I do not know."}]}) for c in chat)),
        "instruction": ("alpaca.jsonl", "\n".join(json.dumps({
            "instruction": c["conversations"][0]["value"], "input": "Answer briefly." if i % 3 else "",
            "output": c["conversations"][1]["value"]}) for i, c in enumerate(chat))),
    }
    out = {}
    for kind, (name, content) in files.items():
        (tmp_path / name).write_text(content)
        out[kind] = tmp_path / name
    return out


def _same_samples(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for s, t in (zip(x, y) if isinstance(x, tuple) else [(x, y)]):
            assert np.array_equal(s.ids, t.ids) and np.array_equal(np.asarray(s.train, bool), t.train)


def _write_form(tmp_path, form, lines) -> object:
    """The records of JSON lines `lines` written as a file (or folder) of the form."""
    records = [json.loads(line) for line in lines if line.strip()]
    if form == "array":
        path = tmp_path / "records.json"
        path.write_text("[" + ",\n".join(lines) + "]")
    elif form == "jsonl":
        path = tmp_path / "records.jsonl"
        path.write_text("\ufeff" + "\n".join(l + ("\n\n  \r" if i % 7 == 3 else "") for i, l in enumerate(lines)) + "\n")
    elif form == "parquet":
        path = tmp_path / "records.parquet"
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=23)
    elif form == "csv":
        path = tmp_path / "records.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    else:       # a folder of shards of three formats, one in a subfolder
        path = tmp_path / "records"
        (path / "b").mkdir(parents=True)
        third = len(records) // 3
        (path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:third]))
        pq.write_table(pa.Table.from_pylist(records[third:2 * third]), path / "b" / "c.parquet", row_group_size=10)
        (path / "d.json").write_text(json.dumps(records[2 * third:]))
    return path


RECORD_CASES = [(kind, form) for kind in ["chat", "text", "prompt_completion", "preference", "instruction"]
                for form in ["jsonl", "array", "parquet", "csv", "folder"]
                if not (form == "csv" and kind in ("chat", "preference"))]     # a CSV holds strings only


@pytest.mark.parametrize("kind, form", RECORD_CASES, ids=[f"{k}-{f}" for k, f in RECORD_CASES])
def test_record_samples_are_those_of_the_records_and_come_back_from_the_cache(shared_data, tmp_path, monkeypatch,
                                                                              kind, form):
    """JSON lines and CSV are sampled by workers from ranges of whole lines / rows (made small
    here: many ranges, with a BOM and blank lines), Parquet from rows of row groups (cut in
    parts too), a JSON array from slices of its records, a folder from the parts of its
    shards: the samples are those of the records read whole, and so are their places."""
    from ggtrain.formats.chat import chat_template, template_id
    from ggtrain.formats.dataset import read_data
    from ggtrain.formats.gguf import read_gguf
    model = read_gguf(shared_data / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = tokenizer_from_gguf(model)
    template = chat_template(model)
    given = _record_files(tmp_path, shared_data)[kind]
    text = given.read_text()
    lines = ([json.dumps(r) for r in json.loads(text)] if given.suffix == ".json" else text.split("\n"))
    path = _write_form(tmp_path, form, lines)
    monkeypatch.setattr(datafile, "_MIN_RANGE", 300)
    monkeypatch.setattr(datafile, "_PART_ROWS", 7)
    data = read_data(path)
    templated = kind in ("chat", "preference", "instruction")
    want = data.samples(tok, template if templated else None, kind == "text")
    cache = str(tmp_path / "cache")
    key = sample_cache.samples_key(path, tok, template_id(model), kind == "text")
    assert sample_cache.cached_samples(cache, key, path) is None
    seen = []

    def template_of(k, conversational):
        seen.append((k, conversational))
        return template if k in ("chat", "instruction") or conversational else None
    made = sample_cache.sample_records(path, tok, template_of, kind == "text", cache, key, workers=2,
                                 progress=lambda done, total, unit: seen.append(unit))
    assert seen[0] == (kind, kind == "preference") and set(seen[1:]) == {"B"}
    if form != "array":
        assert len(seen) > 8      # many parts (about 4 a worker)
    _same_samples(made.samples, want)
    assert not made.cached and made.kind == kind and list(made.where) == data.where
    serial = sample_cache.sample_records(path, tok, template_of, kind == "text", None, key, workers=1)
    _same_samples(serial.samples, want)
    assert list(serial.where) == data.where
    monkeypatch.setattr(type(tok), "encode", lambda *a, **k: pytest.fail("sampled again"))
    hit = sample_cache.cached_samples(cache, key, path)
    assert hit.cached and hit.kind == kind and hit.layout == data.layout and list(hit.where) == data.where
    assert hit.conversational == (kind == "preference")
    _same_samples(hit.samples, want)
    # another template or train_on_inputs: another key
    assert sample_cache.samples_key(path, tok, "other", kind == "text") != key
    assert sample_cache.samples_key(path, tok, template_id(model), kind != "text") != key
    if form == "folder":        # the key covers every shard's bytes and name
        (path / "d.json").write_text((path / "d.json").read_text() + " ")
        assert sample_cache.samples_key(path, tok, template_id(model), kind == "text") != key
        changed = sample_cache.samples_key(path, tok, template_id(model), kind == "text")
        (path / "d.json").rename(path / "e.json")
        assert sample_cache.samples_key(path, tok, template_id(model), kind == "text") != changed


@pytest.mark.parametrize("damage", ["json", "layout", "utf8", "type"])
def test_a_bad_record_in_a_later_range_is_named_as_read_data_names_it(shared_data, tmp_path, monkeypatch, damage):
    from ggtrain.formats.dataset import read_data
    tok = tokenizer_from_gguf(shared_data / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    path = _record_files(tmp_path, shared_data)["prompt_completion"]
    raw = path.read_bytes().split(b"\n")
    bad = {"json": b'{"prompt": "a", "completion": ', "layout": b'{"text": "a"}', "utf8": b'{"prompt": "\xff"}',
           "type": b'{"prompt": "a", "completion": 7}'}[damage]
    raw[40] = bad
    path.write_bytes(b"\n".join(raw))
    with pytest.raises(FormatError) as whole:
        read_data(path)
    monkeypatch.setattr(datafile, "_MIN_RANGE", 300)
    with pytest.raises(FormatError) as streamed:
        sample_cache.sample_records(path, tok, lambda *a: None, False, str(tmp_path / "cache"), "k", workers=2)
    assert str(streamed.value) == str(whole.value) and "line 41" in str(streamed.value)
    # nothing kept, no temporaries left (bytes that are not UTF-8 in the first block: no folder made)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())


def test_finetune_on_records_reuses_their_samples(shared_data, tmp_path):
    path = _record_files(tmp_path, shared_data)["chat"]
    cache = tmp_path / "cache"
    args = [sys.executable, "-m", "ggtrain", "finetune", "--model", str(shared_data / "gguf" / "stories260K.gguf"), "--data", str(path),
            "--chat-template", str(shared_data / "templates" / "google-gemma-2-2b-it.jinja"),
            "--out", str(tmp_path / "a.gguf"), "--steps", "1", "--ctx", "256", "--batch", "2", "--quiet",
            "--token-cache", str(cache)]
    first = subprocess.run(args, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    made = sorted(p.suffix for p in cache.iterdir())
    # the samples, and the packed training rows (validation rows too, with a validation split)
    assert set(made) == {".json", ".lengths", ".places", ".tokens", ".train", ".rows"}
    assert made.count(".rows") in (1, 2) and made.count(".json") == 1 + made.count(".rows")
    mtimes = {p: p.stat().st_mtime_ns for p in cache.iterdir()}
    second = subprocess.run(args, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert {p: p.stat().st_mtime_ns for p in cache.iterdir()} == mtimes       # read, not rewritten
    summary = [line for line in first.stderr.splitlines() if line.startswith("finetune:")]
    assert summary and summary == [line for line in second.stderr.splitlines() if line.startswith("finetune:")]
    assert "samples" in summary[0]


def test_cut_rules_keep_the_pre_tokens_of_every_bpe_pre_row():
    """Whatever the vocabulary, a BPE cut must fall where the row's regexes (run by
    Oniguruma, as llama.cpp's are) end a pre-token: pre-tokens of the two sides = the whole's."""
    from tokenizers import Regex, pre_tokenizers
    from ggtrain.formats.tokenizer_bpe import _PRETOKEN_CUT, _STREAM_CUT
    rng = np.random.default_rng(5)
    pool = list("abcdefgXYZ019 .,'\"\n\r\t!?-/") + ["中", "文", "。", "é", "\u3000", "ß", "  ", "\n\n", "'s", "'ll",
                                                 " a", "a b", "\r\n"]
    texts = ["".join(rng.choice(pool, int(rng.integers(20, 200)))) for _ in range(150)]
    seen = set()
    for name, pre in BPE_PRE.items():
        if pre.regexes in seen:
            continue
        seen.add(pre.regexes)
        hf = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes])

        def pieces(t):
            return [p for p, _ in hf.pre_tokenize_str(t)]
        rule = _STREAM_CUT if pre.space_cut else _PRETOKEN_CUT
        cuts = 0
        for t in texts:
            whole = pieces(t)
            for m in rule.finditer(t):
                assert pieces(t[:m.end()]) + pieces(t[m.end():]) == whole, (name, t, m.end())
                cuts += 1
        assert cuts > 100, name
    # the row that may not cut before a space would break there
    exaone = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                      for r in BPE_PRE["exaone-moe"].regexes])
    assert [p for p, _ in exaone.pre_tokenize_str("ab cd")] == ["ab cd"]


def test_a_crlf_corpus_is_cut_into_pieces(shared_data, tmp_path, monkeypatch):
    tok = _vocab(shared_data, "models/SmolLM2-135M-Instruct.Q4_1.gguf")
    text = (shared_data / "text" / "tinyshakespeare.txt").read_text()[:200000].replace("\n", "\r\n")
    path = tmp_path / "crlf.txt"
    path.write_bytes(text.encode())
    monkeypatch.setattr(corpus, "BLOCK", 1 << 14)
    monkeypatch.setattr(corpus, "_REACH", 1 << 12)
    ids, longest = _pieces_encoded(monkeypatch, tok, path)
    assert len(longest) > 10 and max(longest) < 3 * (1 << 14)       # cut before spaces: no "\n" rule here
    assert np.array_equal(ids, tok.encode(text))


def test_spm_without_byte_fallback_never_cuts_a_run_of_unknown_characters():
    from ggtrain.formats.tokenizer import SpmTokenizer
    tokens = ["<unk>", "<s>", "</s>", "\u2581", "a", "b", "ab", "\u2581ab"]
    tok = SpmTokenizer(tokens, np.array([0, 0, 0, -1, -2, -3, -1, -0.5], np.float32),
                       np.array([2, 3, 3, 1, 1, 1, 1, 1], np.int32), bos_id=1, eos_id=2, unk_id=0)
    text = "ab xyz ab ab qq ab"
    whole = tok.encode(text)
    assert list(whole).count(0) == 2                  # each unknown run is one <unk>
    for p in range(1, len(text)):
        q = tok.cut(text, p, limit=1)
        if q is not None:
            assert np.array_equal(np.concatenate([tok.encode(text[:q]), tok.encode(text[q:], continued=True)]),
                                  whole), q


def test_a_default_token_cache_that_cannot_be_written_is_a_warning_not_a_failure(shared_data, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    text = tmp_path / "t.txt"
    text.write_text((shared_data / "text" / "tinyshakespeare.txt").read_text()[:20000])
    env = {**os.environ, "GGTRAIN_TOKEN_CACHE": str(blocker / "tokens")}
    args = [sys.executable, "-m", "ggtrain", "train", "--data", str(text), "--out", str(tmp_path / "m.gguf"),
            "--steps", "1", "--dim", "32", "--layers", "1", "--heads", "2", "--ff", "64", "--ctx", "32",
            "--batch", "2", "--quiet"]
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "warning: the token cache" in r.stderr and (tmp_path / "m.gguf").exists()
    # a folder the user names is used, or the run fails saying why
    r = subprocess.run(args + ["--token-cache", str(blocker / "tokens")], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "--token-cache" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("pairs", [False, True])
def test_packed_rows_are_kept_and_mapped_back_as_packed(tmp_path, pairs):
    from ggtrain.core.data import pack, pack_pairs
    from ggtrain.formats.dataset import Sample
    rng = np.random.default_rng(3)

    def sample():
        n = int(rng.integers(2, 40))
        train = rng.random(n) < 0.6
        train[-1] |= pairs          # (a pair's side must have a target within its half row)
        return Sample(rng.integers(0, 500, n).astype(np.int32), train)
    items = [(sample(), sample()) for _ in range(60)] if pairs else [sample() for _ in range(120)]

    def make(allocate):
        return (pack_pairs(items, 90, allocate=allocate, first_id=3) if pairs else
                pack(items, 32, drop_long=True, allocate=allocate))
    want, want_stats, want_fp, cached = sample_cache.packed_rows(None, "k", "spec", make)
    assert not cached
    cache = str(tmp_path)
    for hit in (False, True):
        got, stats, fp, cached = sample_cache.packed_rows(cache, "k", "spec", make)
        assert cached == hit and stats == want_stats and fp == want_fp == got.fingerprint()
        for name, value in want.fields().items():
            np.testing.assert_array_equal(got.fields()[name], value, err_msg=name)
        np.testing.assert_array_equal(got.trained_per_row(), (want.targets >= 0).sum(axis=1))
    rows = next(tmp_path.glob("*.rows"))
    with open(rows, "r+b") as f:      # damaged: packed again
        f.truncate(rows.stat().st_size - 4)
    got, _, fp, cached = sample_cache.packed_rows(cache, "k", "spec", make)
    assert not cached and fp == want_fp
    assert sample_cache.packed_rows(cache, "k", "other spec", make)[3] is False


_AFTER_BPE = r"""
import os, sys
import numpy as np
from ggtrain.formats import corpus
from ggtrain.formats.tokenizer import load_tokenizer
text = open(sys.argv[1], encoding="utf-8").read()
tok = load_tokenizer("bpe:400", text)        # tokenizers' trainer, in this process
tok.encode(text[:200000])                   # and its batch encoder
corpus.BLOCK = 1 << 16                      # many pieces, so the forked workers take several each
got = corpus.corpus_tokens(sys.argv[1], tok, cache_dir=None, workers=2)
assert np.array_equal(np.asarray(got.ids), tok.encode(text)), "ids differ"
print(os.environ["TOKENIZERS_PARALLELISM"])
"""


def test_workers_forked_after_a_bpe_vocabulary_was_trained_finish(tmp_path):
    """A BPE vocabulary trained and used in a process (`tokenizers`' trainer and batch encoder),
    then its text encoded by forked workers: they finish with the serial ids. (A worker once hung
    in encode_batch_fast on a lock of `tokenizers`' threads, which now never start in a ggtrain
    process: TOKENIZERS_PARALLELISM is false, whatever the environment said.)"""
    text = tmp_path / "t.txt"
    text.write_text((pathlib.Path(__file__).resolve().parents[1] / "cli" / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:400000],
                    encoding="utf-8")
    r = subprocess.run([sys.executable, "-c", _AFTER_BPE, str(text)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TOKENIZERS_PARALLELISM": "true"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "false" and "huggingface/tokenizers" not in r.stderr, (r.stdout, r.stderr)
