"""Tokenizers: llama.cpp's own test vectors, round trips, GGUF keys and bad input.

Oracles: llama.cpp's expected ids in ../shared/data/gguf/ggml-vocab-*.gguf.out (skipped
with a reason when that folder is absent), sentencepiece on tok512.model for stories260K,
and round trips. Agreement with real llama.cpp on models we write is checked by the
interop tests of the llama issue.
"""
import os
import subprocess
import sys
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as VT

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.gguf import read_gguf, write_gguf
from ggtrain.formats.pretokenizer import BPE_PRE
from ggtrain.formats.tokenizer import (
    ATTR_CONTROL,
    ATTR_RSTRIP,
    BYTE,
    CONTROL,
    MIN_BPE_VOCAB,
    NORMAL,
    UNKNOWN,
    USER_DEFINED,
    BpeTokenizer,
    ByteTokenizer,
    SpmTokenizer,
    load_tokenizer,
    tokenizer_from_gguf,
)
from ggtrain.formats.tokenizer_bpe import _BPE_CHUNK, _bpe_chunks


VOCABS = ["llama-spm", "phi-3", "gpt-2"]

ROUND_TRIP = [
    "", " ", "  ", "\n", "\n\n\n", "\t\n", "Hello world", " Hello world", "   leading spaces",
    "trailing spaces   ", "line one\nline two\n\nline four\n", "naïve café — “quotes”",
    "Здравствуй, мир", "日本語のテキスト", "emoji 🦙🚀 and 👨‍👩‍👧 family", "a\u2581b",
    "tabs\tand\r\ncrlf", "<s> and </s> as text", "<0x41> looks like a byte token", "\x00\x01\x7f",
    "'s 're 've 'll 'd !!!??? 3.14159 1234567", "\ufeffbom", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 outside the BMP",
]

TEXT_SAMPLE = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    "All:\nSpeak, speak.\n\nFirst Citizen:\nYou are all resolved rather to die than to famish?\n"
)


def _vectors(data: Path, name: str):
    """llama.cpp's test-tokenizer-0 inputs and expected ids (without BOS)."""
    raw = (data / "gguf" / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    inp = raw.split("\n__ggml_vocab_test__\n")
    if inp[-1] == "":
        inp.pop()
    lines = (data / "gguf" / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    if lines[-1] == "":
        lines.pop()
    return inp, [[int(x) for x in line.split()] for line in lines]


_CACHE = {}


def _tok(spec, text=None):
    """Tokenizers are slow-ish to build (a 50k vocabulary): one per spec per session."""
    if spec not in _CACHE:
        _CACHE[spec] = load_tokenizer(str(spec), text)
    return _CACHE[spec]


@pytest.fixture
def shakespeare(shared_data):
    return (shared_data / "text" / "tinyshakespeare.txt").read_text(encoding="utf-8")


@pytest.fixture
def bpe(shakespeare):
    return _tok("bpe:600", shakespeare[:200_000])


# ---- llama.cpp's test vectors ---------------------------------------------------------------

@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vectors(shared_data, name):
    tok = _tok(shared_data / "gguf" / f"ggml-vocab-{name}.gguf")
    inp, out = _vectors(shared_data, name)
    assert len(inp) == len(out) == 46
    bad = [(s, tok.encode(s).tolist(), ids) for s, ids in zip(inp, out) if tok.encode(s).tolist() != ids]
    assert not bad, f"{len(bad)} of 46 differ, first: {bad[0]!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_vectors_with_bos(shared_data, name):
    tok = _tok(shared_data / "gguf" / f"ggml-vocab-{name}.gguf")
    ids = tok.encode("Hello world", add_bos=True).tolist()
    assert ids[0] == tok.bos_id and ids[1:] == tok.encode("Hello world").tolist()


def test_vocab_kinds_and_ids(shared_data):
    spm = _tok(shared_data / "gguf" / "ggml-vocab-llama-spm.gguf")
    assert isinstance(spm, SpmTokenizer) and (spm.n_vocab, spm.bos_id, spm.eos_id, spm.unk_id) == (32000, 1, 2, 0)
    assert spm.add_bos and spm.add_space_prefix
    phi = _tok(shared_data / "gguf" / "ggml-vocab-phi-3.gguf")
    assert (phi.n_vocab, phi.bos_id, phi.eos_id, phi.pad_id) == (32064, 1, 32000, 32000)
    g2 = _tok(shared_data / "gguf" / "ggml-vocab-gpt-2.gguf")
    assert isinstance(g2, BpeTokenizer) and (g2.n_vocab, g2.bos_id, g2.eos_id) == (50257, 50256, 50256)
    assert not g2.add_bos and len(g2.merges) == 50000


def test_phi3_end_of_text_is_control(shared_data):
    # phi-3 types "</s>" user-defined, but llama.cpp makes it CONTROL (an end-of-generation
    # text) and RSTRIP (the model is named Phi3): plain text unless special tokens are
    # parsed, and then split out with the whitespace after it, and a space prefix before
    # the text that follows (llama.cpp agrees: tests/test_tokenize_interop.py)
    phi = _tok(shared_data / "gguf" / "ggml-vocab-phi-3.gguf")
    assert phi.token_type[2] == USER_DEFINED and phi.attrs[2] & ATTR_CONTROL and phi.attrs[2] & ATTR_RSTRIP
    assert 2 in phi.eog_ids and phi.piece(2) == b""
    assert 2 not in phi.encode("a</s>b").tolist()
    want = phi.encode("a").tolist() + [2] + phi.encode("b").tolist()
    assert phi.encode("a</s> \n b", parse_special=True).tolist() == want


def test_parse_special(shared_data):
    spm = _tok(shared_data / "gguf" / "ggml-vocab-llama-spm.gguf")
    assert spm.encode("<s>Hello").tolist() != [1] + spm.encode("Hello").tolist()
    assert spm.encode("<s>Hello", parse_special=True).tolist() == [1] + spm.encode("Hello").tolist()
    byte = ByteTokenizer()
    assert byte.encode("a</s>", parse_special=True).tolist() == [3 + 97, 2]
    assert byte.encode("a</s>").tolist() == byte.encode_bytes(b"a</s>").tolist()


# ---- stories260K -------------------------------------------------------------------------

def test_stories260k(shared_data):
    tok = _tok(shared_data / "gguf" / "stories260K.gguf")
    assert tok.encode("Once upon a time").tolist() == [403, 407, 261, 378]
    assert tok.encode("Once upon a time", add_bos=True).tolist() == [1, 403, 407, 261, 378]
    assert tok.decode([403, 407, 261, 378]) == " Once upon a time"
    assert tok.add_bos and tok.n_vocab == 512


def test_stories260k_matches_sentencepiece(shared_data, shakespeare):
    import sentencepiece as spm  # a dependency: a missing install must fail, not skip
    sp = spm.SentencePieceProcessor(model_file=str(shared_data / "llama2c" / "tok512.model"))
    tok = _tok(shared_data / "gguf" / "stories260K.gguf")
    for s in ROUND_TRIP + [TEXT_SAMPLE, shakespeare[:20_000]]:
        if "\x00" in s or s != s.strip(" ") or "  " in s or not s:
            # tok512.model's normalizer drops NUL and extra spaces; llama.cpp keeps them
            continue
        assert tok.encode(s).tolist() == sp.encode(s), repr(s)


# ---- byte ------------------------------------------------------------------------------

def test_byte_layout():
    tok = ByteTokenizer()
    assert tok.n_vocab == 260 and (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0)
    assert tok.tokens[:3] == ["<unk>", "<s>", "</s>"] and tok.tokens[3 + 0x41] == "<0x41>"
    assert tok.tokens[259] == "\u2581"
    assert tok.token_type.tolist() == [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL]
    assert tok.encode("a b\n").tolist() == [3 + 97, 259, 3 + 98, 3 + 10]
    assert tok.encode("é", add_bos=True).tolist() == [1, 3 + 0xC3, 3 + 0xA9]
    assert tok.encode("\u2581").tolist() == [259]     # as llama.cpp: U+2581 is a space
    assert tok.decode([1, 3 + 104, 3 + 105, 259, 2]) == "hi "


def test_byte_takes_any_bytes():
    tok = ByteTokenizer()
    data = bytes(range(256)) + b"\xff\xfe\xc3(" + b"\xe2\x96"
    ids = tok.encode_bytes(data)
    assert ids.dtype == np.int32 and len(ids) == len(data)
    assert tok.decode_bytes(ids) == data
    assert ids[0x20] == 259 and all(ids[b] == 3 + b for b in range(256) if b != 0x20)
    # text read with errors="surrogateescape" keeps its exact bytes
    text = data.decode("utf-8", errors="surrogateescape")
    assert tok.encode(text).tolist() == ids.tolist()
    assert tok.decode(ids) == data.decode("utf-8", errors="replace")


def test_other_kinds_replace_invalid_utf8(shared_data, bpe):
    spm = _tok(shared_data / "gguf" / "stories260K.gguf")
    for tok in (spm, bpe):
        bad = b"ok \xff\xfe end"
        assert tok.encode_bytes(bad).tolist() == tok.encode("ok \ufffd\ufffd end").tolist()
        assert tok.encode("lone \udcff surrogate").tolist() == tok.encode("lone \ufffd surrogate").tolist()


# ---- round trips -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["byte", "bpe", "stories260K", "llama-spm", "gpt-2"])
def test_round_trip(shared_data, bpe, kind):
    tok = {"byte": lambda: ByteTokenizer(), "bpe": lambda: bpe,
           "stories260K": lambda: _tok(shared_data / "gguf" / "stories260K.gguf"),
           "llama-spm": lambda: _tok(shared_data / "gguf" / "ggml-vocab-llama-spm.gguf"),
           "gpt-2": lambda: _tok(shared_data / "gguf" / "ggml-vocab-gpt-2.gguf")}[kind]()
    prefix = " " if getattr(tok, "add_space_prefix", False) else ""
    for s in ROUND_TRIP:
        ids = tok.encode(s)
        assert ids.dtype == np.int32 and ids.ndim == 1
        want = (prefix + s if s else s).replace("\u2581", " ") if isinstance(tok, (ByteTokenizer, SpmTokenizer)) else prefix + s
        assert tok.decode(ids) == want, (kind, s)
        assert tok.decode(tok.encode(s, add_bos=True)) == want   # BOS decodes to nothing
    assert tok.encode("").tolist() == [] and tok.encode("", add_bos=True).tolist() == [tok.bos_id]


# ---- trained BPE -----------------------------------------------------------------------

def test_bpe_layout(bpe):
    assert bpe.n_vocab == 600 and (bpe.bos_id, bpe.eos_id) == (0, 1) and bpe.add_bos
    assert bpe.tokens[:2] == ["<s>", "</s>"] and bpe.token_type[:2].tolist() == [CONTROL, CONTROL]
    assert (bpe.token_type[2:] == NORMAL).all() and len(bpe.merges) == 600 - 258
    assert bpe.encode("<s>").tolist() != [0]           # control tokens are not matched in text
    assert len(bpe.encode(TEXT_SAMPLE)) < len(TEXT_SAMPLE) / 2


def test_bpe_training_is_deterministic(shakespeare, bpe):
    again = load_tokenizer("bpe:600", shakespeare[:200_000])
    assert again.tokens == bpe.tokens and again.merges == bpe.merges
    # fresh interpreters with other hash seeds and thread counts learn the same merges
    code = ("import sys, zlib; from ggtrain.formats.tokenizer import load_tokenizer; "
            "t = load_tokenizer('bpe:600', sys.stdin.read()); "
            "print(zlib.crc32('\\n'.join(t.tokens + t.merges).encode()))")
    want = zlib.crc32("\n".join(bpe.tokens + bpe.merges).encode())
    for seed, threads in (("1", "1"), ("2", "2")):
        env = dict(os.environ, PYTHONHASHSEED=seed, RAYON_NUM_THREADS=threads)
        out = subprocess.run([sys.executable, "-c", code], input=shakespeare[:200_000],
                             capture_output=True, text=True, env=env, check=True)
        assert int(out.stdout) == want


def test_bpe_small_text_gives_smaller_vocab():
    tok = load_tokenizer("bpe:1000", "abc abc abd")
    assert MIN_BPE_VOCAB <= tok.n_vocab < 1000
    assert tok.decode(tok.encode("abc abd xyz")) == "abc abd xyz"


def test_bpe_chunked_encoding_equals_whole(shared_data, shakespeare):
    # the gpt-2 vocabulary has "\n\n" as one token, so a wrong cut shows
    tok = _tok(shared_data / "gguf" / "ggml-vocab-gpt-2.gguf")
    text = shakespeare[:300_000] + "x\n\n\ny\n  z\n" * 5000
    assert len(list(_bpe_chunks(text))) > 5
    assert tok.encode(text).tolist() == tok._tok.encode(text, add_special_tokens=False).ids


def test_long_text_in_pieces_equals_whole_for_every_pre(shakespeare):
    # Long texts are encoded in pieces cut at newlines every pre-tokenizer ends a pre-token
    # at. A vocabulary trained without pre-tokenization merges across pre-token boundaries,
    # so a wrong cut changes the ids (tekken's [\r\n/]* once took the "/" after a cut).
    import json

    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers
    # the first place a cut may be looked for is right before the ".\n/"
    text = shakespeare[:_BPE_CHUNK] + "".join(f"x{i}.\n/y a\n\n b\n  c 12\n3 'S\n's .\n/ \n" for i in range(200))
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.train_from_iterator(text.splitlines(keepends=True) + ["x.\n/y"] * 50, trainers.BpeTrainer(
        vocab_size=1500, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) for m in model["merges"]]
    assert len(list(_bpe_chunks(text))) > 1
    rows = {}                       # one name per row of the table
    for name, row in BPE_PRE.items():
        rows.setdefault(row, name)
    for pre in rows.values():
        tok = BpeTokenizer(tokens, np.full(len(tokens), NORMAL), merges, 0, 1, pre=pre)
        assert tok.encode(text).tolist() == tok._tok.encode(text, add_special_tokens=False).ids, pre


# ---- GGUF keys ----------------------------------------------------------------------------

EXPECTED_TYPES = {
    "tokenizer.ggml.model": (VT.STRING, None), "tokenizer.ggml.pre": (VT.STRING, None),
    "tokenizer.ggml.tokens": (VT.ARRAY, VT.STRING), "tokenizer.ggml.scores": (VT.ARRAY, VT.FLOAT32),
    "tokenizer.ggml.token_type": (VT.ARRAY, VT.INT32), "tokenizer.ggml.merges": (VT.ARRAY, VT.STRING),
    "tokenizer.ggml.bos_token_id": (VT.UINT32, None), "tokenizer.ggml.eos_token_id": (VT.UINT32, None),
    "tokenizer.ggml.unknown_token_id": (VT.UINT32, None),
    "tokenizer.ggml.padding_token_id": (VT.UINT32, None),
    "tokenizer.ggml.add_bos_token": (VT.BOOL, None), "tokenizer.ggml.add_eos_token": (VT.BOOL, None),
    "tokenizer.ggml.add_space_prefix": (VT.BOOL, None),
}


def _write_vocab(path, tok):
    kv = [("general.architecture", "llama", VT.STRING)] + tok.gguf_kv()
    write_gguf(path, kv, [])


@pytest.mark.parametrize("kind", ["byte", "bpe", "stories260K", "phi-3", "gpt-2"])
def test_gguf_kv_round_trip(tmp_path, shared_data, bpe, kind):
    tok = {"byte": lambda: ByteTokenizer(), "bpe": lambda: bpe,
           "stories260K": lambda: _tok(shared_data / "gguf" / "stories260K.gguf"),
           "phi-3": lambda: _tok(shared_data / "gguf" / "ggml-vocab-phi-3.gguf"),
           "gpt-2": lambda: _tok(shared_data / "gguf" / "ggml-vocab-gpt-2.gguf")}[kind]()
    path = tmp_path / "vocab.gguf"
    _write_vocab(path, tok)
    f = read_gguf(path)
    keys = {k for k in f.kv if k.startswith("tokenizer.")}
    assert keys <= set(EXPECTED_TYPES)
    for key in keys:
        want = EXPECTED_TYPES[key]
        assert (f.kv[key].type, f.kv[key].item_type) == want, key
    # gguf-py, the reference reader, sees the same vocabulary
    r = gguf.GGUFReader(path)
    field = r.fields["tokenizer.ggml.tokens"]
    assert len(field.data) == tok.n_vocab
    assert bytes(field.parts[field.data[-1]]).decode("utf-8") == tok.tokens[-1]
    back = load_tokenizer(str(path))
    # our own byte vocabulary comes back as the byte tokenizer (it keeps arbitrary bytes)
    want_type = {"byte": ByteTokenizer, "stories260K": SpmTokenizer, "phi-3": SpmTokenizer}.get(kind, BpeTokenizer)
    assert type(back) is want_type
    assert (back.n_vocab, back.bos_id, back.eos_id, back.add_bos) == (tok.n_vocab, tok.bos_id, tok.eos_id, tok.add_bos)
    for s in ROUND_TRIP + [TEXT_SAMPLE]:
        assert back.encode(s).tolist() == tok.encode(s).tolist(), repr(s)
        assert back.decode(back.encode(s)) == tok.decode(tok.encode(s))


def test_byte_gguf_keys():
    kv = {k: (v, t) for k, v, t, *_ in ByteTokenizer().gguf_kv()}
    assert kv["tokenizer.ggml.model"][0] == "llama"
    assert kv["tokenizer.ggml.add_space_prefix"] == (False, VT.BOOL)
    assert kv["tokenizer.ggml.bos_token_id"] == (1, VT.UINT32)


def test_bpe_gguf_keys(bpe):
    kv = {k: (v, t) for k, v, t, *_ in bpe.gguf_kv()}
    assert kv["tokenizer.ggml.model"][0] == "gpt2" and kv["tokenizer.ggml.pre"][0] == "gpt-2"
    assert all(len(m.split(" ")) == 2 for m in kv["tokenizer.ggml.merges"][0])
    assert "tokenizer.ggml.add_space_prefix" not in kv and "tokenizer.ggml.scores" not in kv


# ---- the whole corpus -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["byte", "bpe:1024", "stories260K"])
def test_whole_corpus_round_trip(shared_data, shakespeare, kind):
    tok = load_tokenizer(kind if kind != "stories260K" else str(shared_data / "gguf" / "stories260K.gguf"),
                         shakespeare)
    ids = tok.encode(shakespeare)
    assert tok.decode(ids).lstrip(" ") == shakespeare


# ---- bad input ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["", "bytes", "bpe", "bpe:", "bpe:abc", "bpe:-5", "bpe:1e3", "spm:100"])
def test_bad_spec(spec):
    with pytest.raises(ConfigError) as e:
        load_tokenizer(spec, "some text")
    assert repr(spec) in str(e.value)


def test_unknown_spec_message():
    with pytest.raises(ConfigError, match=r"'wordpiece'.*byte.*bpe:N.*gguf"):
        load_tokenizer("wordpiece", "text")


@pytest.mark.parametrize("n", [1, 100, 257])
def test_bpe_too_small(n):
    with pytest.raises(ConfigError, match=rf"bpe:{n}.*258"):
        load_tokenizer(f"bpe:{n}", "some text")


@pytest.mark.parametrize("text", ["", None])
def test_bpe_needs_text(text):
    with pytest.raises(ConfigError, match="bpe:300"):
        load_tokenizer("bpe:300", text)


def test_missing_gguf(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_tokenizer(str(tmp_path / "nope.gguf"))


def test_gguf_without_vocab(tmp_path):
    path = tmp_path / "novocab.gguf"
    write_gguf(path, [("general.architecture", "llama", VT.STRING)], [])
    with pytest.raises(FormatError, match=r"novocab\.gguf.*no tokenizer vocabulary"):
        load_tokenizer(str(path))


def test_unsupported_model(shared_data):
    path = shared_data / "gguf" / "ggml-vocab-bert-bge.gguf"
    with pytest.raises(FormatError, match=r"bert-bge\.gguf.*'bert'.*not supported"):
        load_tokenizer(str(path))


@pytest.mark.parametrize("pre", ["kimi-k2", "no-such-pre"])
def test_unsupported_pre(tmp_path, bpe, pre):
    # kimi-k2: llama.cpp has it, with a hand-written splitter we do not have
    path = tmp_path / "kimi.gguf"
    kv = [(k, pre, *rest[1:]) if k == "tokenizer.ggml.pre" else (k, *rest) for k, *rest in bpe.gguf_kv()]
    write_gguf(path, kv, [])
    with pytest.raises(FormatError) as e:
        tokenizer_from_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and f"tokenizer.ggml.pre {pre!r}" in msg
    assert all(repr(name) not in msg and name in msg for name in ("llama-bpe", "smollm", "qwen2", "tekken"))


def test_every_supported_pre_is_a_working_regex_list():
    from tokenizers import Regex
    assert {"default", "llama-bpe", "smollm", "deepseek-llm", "deepseek-coder", "qwen2", "falcon",
            "starcoder", "refact", "command-r", "mpt", "gpt-2", "tekken"} <= set(BPE_PRE)
    for name, pre in BPE_PRE.items():
        assert pre.regexes, name
        for r in pre.regexes:
            Regex(r)


def test_gpt2_vocabulary_without_pre_is_default(tmp_path, bpe):
    # llama.cpp warns and uses its "default" regexes, which isolate punctuation runs
    path = tmp_path / "nopre.gguf"
    write_gguf(path, [kv for kv in bpe.gguf_kv() if kv[0] != "tokenizer.ggml.pre"], [])
    tok = tokenizer_from_gguf(path)
    assert tok.pre == "default"
    assert tok.encode("a 'sb").tolist() != bpe.encode("a 'sb").tolist()


def test_trained_bpe_tokenizes_as_before(shakespeare, bpe):
    # bpe:N vocabularies were encoded with `tokenizers`' own GPT-2 byte-level pre-tokenizer
    # before the pre-tokenizer table; their "gpt-2" row must give the same ids
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers
    old = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(bpe.tokens)},
                                 merges=[tuple(m.split(" ")) for m in bpe.merges]))
    old.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    for s in ROUND_TRIP + [TEXT_SAMPLE, shakespeare[:30_000], "a\u00a0b \u3000x  \t\n y 12345 'S"]:
        assert bpe.encode(s).tolist() == old.encode(s, add_special_tokens=False).ids, repr(s)


def test_gpt2_without_merges(tmp_path, bpe):
    path = tmp_path / "nomerges.gguf"
    write_gguf(path, [kv for kv in bpe.gguf_kv() if kv[0] != "tokenizer.ggml.merges"], [])
    with pytest.raises(FormatError, match=r"nomerges\.gguf.*merges"):
        tokenizer_from_gguf(path)


def test_duplicate_tokens(tmp_path):
    tok = ByteTokenizer()
    kv = [(k, ["<s>"] + v[1:], *rest) if k == "tokenizer.ggml.tokens" else (k, v, *rest)
          for k, v, *rest in tok.gguf_kv()]
    path = tmp_path / "dup.gguf"
    write_gguf(path, kv, [])
    with pytest.raises(FormatError, match=r"dup\.gguf.*duplicate"):
        tokenizer_from_gguf(path)


def test_encode_rejects_bytes():
    with pytest.raises(TypeError, match="encode_bytes"):
        ByteTokenizer().encode(b"bytes")


def test_decode_out_of_range():
    with pytest.raises(ValueError, match="260"):
        ByteTokenizer().decode([5, 260])
