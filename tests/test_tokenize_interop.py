"""Tokenization and decoding equal real llama.cpp's (llama-cpp-python, the `interop` extra).

- Every vocabulary in ../shared/data/gguf (bert's WPM aside: a FormatError) and SmolLM2:
  hard strings with and without parsing special tokens, add_special, decoding, and every
  token's piece, attribute bits and end-of-generation flag.
- Every row of pretokenizer.BPE_PRE, most of which no shared file has: a GGUF written at
  test time with a small vocabulary trained on the hard strings and tokenizer.ggml.pre set to
  the row's name. llama.cpp picks its pre-tokenizer regexes by that name, so loading the file
  in llama.cpp is a real oracle for the row; and every other name of the table is checked
  to tokenize as its row does in llama.cpp.
- llama.cpp's special-token rules (end-of-generation texts made CONTROL, gpt-oss, LSTRIP...)
  on tokens appended to gpt-2's vocabulary, and `ggtrain tokenize` itself.

Oracle: llama_cpp.Llama(model_path=F, vocab_only=True).tokenize(text, add_bos, special),
llama_token_to_piece, llama_vocab_get_attr, llama_vocab_is_eog. Without llama_cpp these
tests skip, except under CI=true, where they fail (the `llama` fixture of conftest.py).
Each vocabulary is loaded once per module.
"""
import ctypes
import functools
import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType as VT
from typer.testing import CliRunner

from ggtrain.cli.main import _register, app
from ggtrain.errors import FormatError
from ggtrain.formats.gguf import read_gguf, write_gguf
from ggtrain.formats.gguf_values import make_value
from ggtrain.formats.pretokenizer import BPE_PRE
from ggtrain.formats.tokenizer import tokenizer_from_gguf
from tests.conftest import SHARED_DATA

REPO = Path(__file__).resolve().parents[1]
_register()

HARD = [
    # whitespace runs: spaces, tabs, newlines, mixed, leading, trailing
    "Hello world", " leading", "  two leading", "trailing   ", "   ", " ", "\t", "\t\t tab",
    "a\tb", "\n", "\n\n\n", " \n \n", "a \t\n b", "line1\r\nline2\r\n\r\n", "x  \n  y", "end\n",
    "  \n", "\n  ", "a\n\n\tb", "a  b   c    d",
    # unicode spaces: NBSP, ideographic, thin, narrow NBSP, medium math, NEL, line/paragraph
    # separators, zero-width space (a format character, not a space), BOM
    "a\u00a0b", "\u00a0\u00a0", "\u3000", "a\u3000b", "\u3000\u3000x", "x\u2009y", "a\u202fb",
    "a\u205fb", "a\x85b", "a\u2028b\u2029c", "a\u200bb", "\ufeffbom",
    # DeepSeek's classes span U+3000, which llama.cpp never matches there (see pretokenizer.py)
    "。\u3000\u3000。", "中\u3000\u3000文", "ab \u3000", "x\u2000\u2000中",
    # digits: Llama 3 groups 1-3, others one by one; other scripts' digits, ½, Ⅻ
    "1", "12", "123", "1234", "12345", "1234567890123", "3.14159", "1,000,000", " 42",
    "a1b22c333", "٣٤٥٦", "①②③", "½ ¾", "Ⅻ", "2\u00b2",
    # contractions, both cases
    "I'm", "I'M", "don't", "DON'T", "we're", "WE'RE", "'S", "'s", "it's IT'S", "they'll THEY'LL",
    "'ve 'VE 'Ve", "'D'd", "'ll'", "x'sy", "''", "rock 'n' roll", "ſ's 'ſ", "it'sawesome",
    "he'dbeen", "we'vegot", "they'llsee", "I'mhere",
    # CJK, fullwidth
    "日本語のテキスト", "中文测试，你好。", "한국어 텍스트", "東京2020年", "カタカナ", "ｆｕｌｌ　ＡＢＣ！", "混合mixed文字",
    # emoji: ZWJ sequences, skin tones, variation selectors, flags
    "👨\u200d👩\u200d👧\u200d👦", "👍🏽 ok", "🏳️\u200d🌈", "❤️", "🇫🇷🇩🇪", "emoji🦙🚀end",
    # code
    "def f(x):\n    return x**2 + 1\n", "if (a && b) { return -1; } // comment",
    "x = [1, 2, 3]\n\tfoo->bar();", "    \n\n    indented", "a != b >= c <<= d", "#include <stdio.h>",
    "s = '''doc'''", "$var + @attr ^ ~x | `cmd`", "a...b!!!c???", "http://example.com/path?q=1&r=2",
    # right-to-left scripts
    "مرحبا بالعالم", "שלום עולם", "مرحبا123", "עברית, English",
    # combining marks and other scripts; case runs (tekken, gpt-4o)
    "e\u0301", "a\u0308\u0304b", "ñ ñ", "क्षत्रिय", "ภาษาไทย", "Ελληνικά", "Здравствуй, мир",
    "ÉCOLE école École", "ǅungla", "ßẞ", "CamelCaseWord HTTPServer iPhone",
    # words Llama 3's vocabulary has as tokens its merges do not reach (ignore_merges)
    "Cửa Việt", " việc", " ایران", " характер", "mektedir",
    # control characters, unassigned and private-use code points, replacement character
    "\x00", "a\x01b", "\x7f", "\x1b[31mred\x1b[0m", "\x0c", "\x0b", "a\x1cb", "\u0378\u0379",
    "\U0002ebf0x", "\ue000", "a\ufffdb", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    # special-token text: plain text unless parsed
    "<|im_start|>user\nHi<|im_end|>\n", "<|endoftext|>", "<s> and </s>", "<|begin_of_text|>x<|eot_id|>",
    "<unk>", "<｜end▁of▁sentence｜>", "</s>", "a</s>b", "a </s>  \n b", "<|user|>\n hi <|end|>\n",
    "<fim_prefix>x<fim_suffix>y<fim_middle>", "<|fim_prefix|>", "<mask>", "<|im_start|><|im_start|>",
    "<|im_start|", "<<|im_end|>>", "<|endoftext|><|endoftext|>",
]

VOCABS = ["gguf/ggml-vocab-llama-spm.gguf", "gguf/ggml-vocab-phi-3.gguf", "gguf/ggml-vocab-gpt-2.gguf",
          "gguf/ggml-vocab-llama-bpe.gguf", "gguf/ggml-vocab-deepseek-llm.gguf",
          "gguf/ggml-vocab-qwen2.gguf", "gguf/ggml-vocab-starcoder.gguf", "gguf/ggml-vocab-falcon.gguf",
          "models/SmolLM2-135M-Instruct.Q4_1.gguf"]


def _representatives():
    """One tokenizer.ggml.pre name per distinct row of BPE_PRE (the first in table order)."""
    seen, names = set(), []
    for name, row in BPE_PRE.items():
        if row not in seen:
            seen.add(row)
            names.append(name)
    return names


def _need_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (it lives in ../shared beside the repo)")


def _derive(base: Path, out: Path, pre: str, extra_kv=(), extra_tokens=()) -> Path:
    """A copy of the vocabulary file `base` with tokenizer.ggml.pre = pre, more keys, and
    more tokens (text, type) appended."""
    f = read_gguf(base)
    kv = dict(f.kv)
    kv["tokenizer.ggml.pre"] = make_value(pre)
    if extra_tokens:
        tokens = list(f.value("tokenizer.ggml.tokens")) + [t for t, _ in extra_tokens]
        types = np.concatenate([f.kv["tokenizer.ggml.token_type"].value.astype(np.int32),
                                np.array([t for _, t in extra_tokens], np.int32)])
        kv["tokenizer.ggml.tokens"] = make_value(tokens)
        kv["tokenizer.ggml.token_type"] = make_value(types)
    for key, value, vtype in extra_kv:
        kv[key] = make_value(value, vtype)
    write_gguf(out, kv, [])
    return out


# pre-tokens of HARD that become tokens of their own, after the merges: with ignore_merges
# (Llama 3, tekken, minicpm5) such a pre-token is that one token, without it what the merges
# make of it
WHOLE_WORDS = ["Hello", " world", " việc", "Cửa", " Việt", "mektedir", "ÉCOLE", "123", "\n\n"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]


@functools.lru_cache(maxsize=None)
def _trained_bpe() -> tuple:
    """(tokens, types, merges) of a byte-level BPE trained on HARD without any pre-tokenizer.

    Its merges run across every boundary a pre-tokenizer might draw, so two pre-tokenizers
    that cut HARD differently give different ids with it, which real vocabularies (trained
    after their own pre-tokenizer) do not guarantee. Deterministic; small, so it loads fast.
    """
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=100_000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # "sa" made more common than "'s", so that a pre-token "'sawesome" (no contraction rule,
    # ufakzeka) merges differently from "'s" + "awesome" (Qwen2)
    hf.train_from_iterator(HARD + ["sa"] * 20, trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for word in WHOLE_WORDS:
        (piece, _), = byte_level.pre_tokenize_str(word)
        if piece not in tokens:
            tokens.append(piece)
    tokens += [t for t in SPECIALS if t not in tokens]      # merges may have made "<s>"
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return tokens, types, [" ".join(m) for m in model["merges"]]


def _trained_gguf(path: Path, pre: str) -> Path:
    tokens, types, merges = _trained_bpe()
    eos = tokens.index("<|endoftext|>")
    write_gguf(path, [("general.architecture", "llama", VT.STRING), ("tokenizer.ggml.model", "gpt2", VT.STRING),
                      ("tokenizer.ggml.pre", pre, VT.STRING), ("tokenizer.ggml.tokens", tokens, VT.ARRAY, VT.STRING),
                      ("tokenizer.ggml.token_type", np.array(types, np.int32), VT.ARRAY, VT.INT32),
                      ("tokenizer.ggml.merges", merges, VT.ARRAY, VT.STRING),
                      ("tokenizer.ggml.bos_token_id", eos, VT.UINT32),
                      ("tokenizer.ggml.eos_token_id", eos, VT.UINT32)], [])
    return path


def _open(llama, path):
    return llama.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="module", params=VOCABS + [f"trained+{pre}" for pre in _representatives()])
def vocab(request, llama, tmp_path_factory):
    """(path, llama.cpp's Llama, our tokenizer) of a shared vocabulary, or of the trained
    one with a row of BPE_PRE."""
    if request.param.startswith("trained+"):
        pre = request.param.split("+")[1]
        path = _trained_gguf(tmp_path_factory.mktemp("pre") / f"trained-{pre}.gguf", pre)
    else:
        _need_data()
        path = SHARED_DATA / request.param
    return path, _open(llama, path), tokenizer_from_gguf(path)


def _their_bytes(llama, llm, ids):
    """llama.cpp's text of ids: its token_to_piece(special=False) of each, joined.

    NOTE: Llama.detokenize does the same with a 32-byte buffer and silently drops longer
    pieces (llama-cpp-python 0.3.36), so it is only compared where no piece is that long.
    """
    vocab = llama.llama_model_get_vocab(llm.model)
    buf = ctypes.create_string_buffer(256)
    out = []
    for i in ids:
        n = llama.llama_token_to_piece(vocab, i, buf, len(buf), 0, False)
        assert 0 <= n <= len(buf)
        out.append(buf.raw[:n])
    return out


def test_tokenize_equals_llama_cpp(vocab):
    _, llm, tok = vocab
    bad = []
    for text in HARD:
        for special in (False, True):
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            ours = tok.encode(text, parse_special=special).tolist()
            if ours != theirs:
                bad.append((text, special, ours, theirs))
    assert not bad, f"{len(bad)} of {2 * len(HARD)} differ, first (text, special, ours, llama.cpp): {bad[0]}"


def test_add_special_equals_llama_cpp(vocab):
    _, llm, tok = vocab
    for text in ("Hello world", "", "<|im_start|>x"):
        for special in (False, True):
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=True, special=special)
            assert tok.tokenize(text, add_special=True, parse_special=special).tolist() == theirs


def test_decode_equals_llama_cpp(vocab, llama):
    _, llm, tok = vocab
    for text in HARD:
        for special in (False, True):
            ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            pieces = _their_bytes(llama, llm, ids)
            assert tok.decode_bytes(ids) == b"".join(pieces), repr(text)
            if all(len(p) <= 32 for p in pieces) and (not ids or ids[0] != tok.bos_id):
                assert tok.decode_bytes(ids) == llm.detokenize(ids), repr(text)


def test_every_token_piece_attr_and_eog_equal_llama_cpp(vocab, llama):
    _, llm, tok = vocab
    _check_tokens(llama, llm, tok)


def _check_tokens(llama, llm, tok):
    vocab = llama.llama_model_get_vocab(llm.model)
    n = llama.llama_vocab_n_tokens(vocab)
    assert n == tok.n_vocab
    pieces = _their_bytes(llama, llm, range(n))
    bad = [(i, tok.tokens[i], pieces[i], tok.piece(i)) for i in range(n) if pieces[i] != tok.piece(i)]
    assert not bad, f"{len(bad)} pieces differ, first (id, token, llama.cpp, ours): {bad[0]}"
    attrs = np.array([llama.llama_vocab_get_attr(vocab, i) for i in range(n)])
    bad = np.flatnonzero(attrs != tok.attrs)
    assert not bad.size, [(int(i), tok.tokens[i], int(attrs[i]), int(tok.attrs[i])) for i in bad[:5]]
    eog = {i for i in range(n) if llama.llama_vocab_is_eog(vocab, i)}
    assert eog == set(tok.eog_ids)


# The text rules llama.cpp applies to special tokens, on tokens appended to gpt-2's vocabulary
# (type: 1 normal, 3 control, 4 user-defined, 5 unused, 6 byte, 0 undefined)
RULE_TOKENS = [
    ("<|im_end|>", 1),          # an end-of-generation text: made CONTROL, EOG
    ("<fim_prefix>", 1),        # a fill-in-the-middle role: made CONTROL
    ("<|fim_pad|>", 4),         # FIM pad: CONTROL and EOG
    ("<|eom_id|>", 4),          # end of message: CONTROL, EOG
    ("<|channel|>", 3),         # gpt-oss: USER_DEFINED whatever its type
    ("<|return|>", 3), ("<|call|>", 3), ("<|end|>", 3),     # gpt-oss: <|end|> is no EOG
    ("</s>", 3), ("<|tool_response>", 3),                   # gemma4: </s> is NORMAL
    ("<unused_7>", 3),          # CONTROL with "unused" in it: UNUSED too
    ("<mask>", 4), ("[MASK]", 4),                           # LSTRIP for jina-v2 / modern-bert
    ("<|user_word|>", 4),       # user-defined: split out even without parse_special
    ("<0x41>", 6), ("<0x4G>", 6),                           # BPE byte tokens: pieces b"A", b"\x04"
    ("日本\u3000語", 1),        # a normal token outside the byte map: llama.cpp's [UNK_BYTE_0x..]
    ("ĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ", 4),         # a long user-defined piece
    ("<undefined>", 0), ("<unused-type>", 5),
]
RULE_TEXTS = ["a <mask> b", "a [MASK]  b", "x<|user_word|>y  <|user_word|> z", "<|channel|>a<|end|>",
              "</s> <|im_end|> <|eom_id|>", "<fim_prefix>1<|fim_pad|>", "<0x41> 日本\u3000語",
              "<|call|><|return|><|tool_response>", "<unused_7><undefined><unused-type>"]


@pytest.mark.parametrize("pre,name", [("jina-v2-de", "rules"), ("gpt-2", "Modern-BERT rules")])
def test_special_token_rules_equal_llama_cpp(llama, tmp_path, pre, name):
    _need_data()
    path = _derive(SHARED_DATA / "gguf" / "ggml-vocab-gpt-2.gguf", tmp_path / "rules.gguf", pre,
                   extra_kv=[("general.name", name, VT.STRING)], extra_tokens=RULE_TOKENS)
    llm, tok = _open(llama, path), tokenizer_from_gguf(path)
    _check_tokens(llama, llm, tok)
    for text in RULE_TEXTS:
        for special in (False, True):
            theirs = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
            assert tok.encode(text, parse_special=special).tolist() == theirs, (text, special)


def test_every_pre_name_is_its_rows_pre_tokenizer(llama, tmp_path):
    """Each name of BPE_PRE with the trained vocabulary: llama.cpp gives the ids of the row
    the table files the name under. The rows all differ on the text (in ids or add_bos), so
    a name filed under the wrong row shows."""
    # one text, as llama.cpp builds its std::regex again for every call (slow for some rows)
    text = "\n".join(HARD)
    ours, first = {}, {}            # row -> ids of the text with add_special; its first name
    for name, row in BPE_PRE.items():
        if row not in ours:
            ours[row] = tokenizer_from_gguf(_trained_gguf(tmp_path / "row.gguf", name)).tokenize(
                text, add_special=True).tolist()
            first[row] = name
    same = {(first[a], first[b]) for a, b in itertools.combinations(ours, 2) if ours[a] == ours[b]}
    # NOTE: llama.cpp's BAILINGMOE regex is Qwen2's written another way ('(?:[sS...]) for the
    # contractions, \s*[\r\n] for \s*[\r\n]+, which match the same): no text tells them apart
    assert same == {("qwen2", "bailingmoe")}, f"rows the text does not tell apart: {same}"
    for name, row in BPE_PRE.items():
        llm = _open(llama, _trained_gguf(tmp_path / "name.gguf", name))
        assert llm.tokenize(text.encode("utf-8"), add_bos=True, special=False) == ours[row], \
            f"{name!r} is not tokenized like {first[row]!r}"


def test_bert_vocabulary_is_a_clear_error(llama):
    _need_data()
    path = SHARED_DATA / "gguf" / "ggml-vocab-bert-bge.gguf"
    _open(llama, path)              # llama.cpp loads it (WPM), we do not
    with pytest.raises(FormatError, match=r"bert-bge\.gguf: tokenizer\.ggml\.model 'bert' is not supported"):
        tokenizer_from_gguf(path)


def test_every_shared_vocabulary_is_covered():
    _need_data()
    files = {str(p.relative_to(SHARED_DATA)) for p in (SHARED_DATA / "gguf").glob("ggml-vocab-*.gguf")}
    assert files == set(VOCABS) - {"models/SmolLM2-135M-Instruct.Q4_1.gguf"} | {"gguf/ggml-vocab-bert-bge.gguf"}


def test_cli_equals_llama_cpp(vocab, tmp_path):
    """`ggtrain tokenize --file F --bos --special` (in this process) on every vocabulary."""
    path, llm, _ = vocab
    text = "\n".join(HARD)
    file = tmp_path / "hard.txt"
    file.write_bytes(text.encode("utf-8"))
    r = CliRunner().invoke(app, ["tokenize", "--model", str(path), "--file", str(file), "--bos", "--special"])
    assert r.exit_code == 0, r.output
    assert [int(x) for x in r.stdout.split()] == llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)


def test_console_script_equals_llama_cpp(llama, tmp_path):
    """The real entry point, as a user runs it, on SmolLM2 with a file of hard strings."""
    _need_data()
    path = SHARED_DATA / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    text = "\n".join(HARD)
    file = tmp_path / "hard.txt"
    file.write_bytes(text.encode("utf-8"))
    r = subprocess.run([sys.executable, "-m", "ggtrain", "tokenize", "--model", str(path), "--file", str(file),
                        "--json"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ids": _open(llama, path).tokenize(text.encode("utf-8"), add_bos=False,
                                                                      special=False)}
