"""Byte-level BPE vocabularies (layer 5): llama.cpp's BPE tokenizer with its pre-tokenizers
(formats/pretokenizer.py), the word-cache and fast paths for long texts, and the BPE trainer
of `--tokenizer bpe:N`."""
from __future__ import annotations

import json
import os
import re
from typing import Iterable, Sequence

import numpy as np
import regex

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.pretokenizer import BPE_PRE, BpePre
from ggtrain.formats.tokenizer_base import (BOS_TEXT, CONTROL, EOS_TEXT, K, MIN_BPE_VOCAB,
                                            NORMAL, Tokenizer, VT, VocabInfo, _check_str, _utf8, token_pieces)

# `tokenizers` runs its own threads (encode_batch, BpeTrainer) unless told not to. ggtrain encodes
# large texts in forked worker processes (formats/corpus.py, sample_cache.py), and forking a
# process those threads have run in is unsafe (tokenizers warns of it), so they never start in a
# ggtrain process: its parallelism is its own workers'. (The worker once seen hung inside
# encode_batch_fast was not this: Python's collector, run there, freed a CPU backend's thread pool
# copied from the parent, whose threads are not in the child; native/cpu/pool.c now frees such
# a copy without waiting for them.)
os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (byte-level BPE's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_CHAR = _bytes_to_unicode()
_CHAR_BYTE = {c: b for b, c in _BYTE_CHAR.items()}


class BpeTokenizer(Tokenizer):
    """A byte-level BPE vocabulary (tokens + merges), encoded with `tokenizers`.

    pre: the tokenizer.ggml.pre value, a key of pretokenizer.BPE_PRE: the regexes that cut
    text into pre-tokens before merging, and whether a pre-token that is a token skips the
    merges (ignore_merges).
    """

    kind = "bpe"

    def __init__(self, tokens: Sequence[str], token_type: np.ndarray, merges: Sequence[str],
                 bos_id: int, eos_id: int, unk_id: int | None = None, pad_id: int | None = None,
                 add_bos: bool = True, add_eos: bool = False, pre: str = "gpt-2",
                 source: str = "vocabulary", vocab: VocabInfo | None = None):
        super().__init__(tokens, token_type, bos_id, eos_id, unk_id, pad_id, add_bos, add_eos, vocab)
        if pre not in BPE_PRE:
            raise FormatError(f"{source}: {_unsupported_pre(pre)}")
        self.merges = list(merges)
        self.pre = pre
        self._pieces = _bpe_pieces(self.tokens, self.attrs)
        self._tok = _hf_bpe(self.tokens, self.merges, BPE_PRE[pre], source)
        self._fast = _WordCacheBpe.make(BPE_PRE[pre], self._tok)

    def _encode_raw(self, text: str, after_special: bool) -> Sequence[int]:
        if self._fast is not None and len(text) > _FAST_MIN and not _FAST_UNSAFE.search(text):
            return self._fast.encode(text)
        if len(text) <= _BPE_CHUNK:
            return self._tok.encode(text, add_special_tokens=False).ids
        # long texts: pieces encoded in parallel; cut only where the pre-tokenizer cuts anyway
        out = []
        for enc in self._tok.encode_batch(list(_bpe_chunks(text)), add_special_tokens=False):
            out.extend(enc.ids)
        return out

    def _candidates(self, text: str, start: int, end: int) -> Iterable[int]:
        """After a lone "\\n" between a printable ASCII character and an ASCII letter or
        digit, where every pre-tokenizer ends a pre-token (see `_bpe_chunks`), and where the
        row allows it (BpePre.space_cut) before a single space between ASCII letters."""
        rule = _STREAM_CUT if BPE_PRE[self.pre].space_cut else _PRETOKEN_CUT
        return (m.end() for m in rule.finditer(text, start - 1, end) if m.end() >= start)

    def gguf_kv(self) -> list[tuple]:
        kv = [
            (K + "model", "gpt2", VT.STRING),
            (K + "pre", self.pre, VT.STRING),
            (K + "tokens", self.tokens, VT.ARRAY, VT.STRING),
            (K + "token_type", self.token_type, VT.ARRAY, VT.INT32),
            (K + "merges", self.merges, VT.ARRAY, VT.STRING),
            *self._special_kv(with_unk=True),
        ]
        return kv


def _unsupported_pre(pre) -> str:
    return (f"tokenizer.ggml.pre {pre!r} is not supported for gpt2 vocabularies "
            f"(supported: {', '.join(sorted(BPE_PRE))})")


_BPE_CHUNK = 1 << 15
_PRETOKEN_CUT = re.compile(r"(?<=[!-~])\n(?=[A-Za-z0-9])")
# ... or before " " between ASCII letters (a zero-width match: its end is the cut)
_STREAM_CUT = re.compile(r"(?<=[!-~])\n(?=[A-Za-z0-9])|(?<=[A-Za-z])(?= [A-Za-z])")


def _bpe_chunks(text: str) -> Iterable[str]:
    """`text` cut into pieces of about _BPE_CHUNK characters, each cut right after a lone
    "\\n" between a printable ASCII character and an ASCII letter or digit. Every regex of
    BPE_PRE ends a pre-token at such a newline, whether or not the text goes on: none lets a
    newline start a pre-token with what follows it (GPT-2's " ?" takes only a space, Llama
    3's [^\\r\\n...]? excludes it, DeepSeek's \\s? comes after newlines are split off, a
    one-character whitespace run before \\S stands alone), none lets a punctuation run take
    a letter or digit after its newlines (tekken's [\\r\\n/]* would take a "/"), and matching
    restarts after it, so encoding the pieces gives the ids of the whole text. (A cut after
    "\\n\\n" would not: at the end of a piece the run would be one pre-token, inside the
    text two.)
    """
    pos = 0
    while pos < len(text):
        m = _PRETOKEN_CUT.search(text, pos + _BPE_CHUNK) if pos + _BPE_CHUNK < len(text) else None
        end = m.end() if m else len(text)
        yield text[pos:end]
        pos = end


# Long texts whose characters are all in these blocks (Basic Latin through Cyrillic
# Supplement, General Punctuation) are pre-tokenized by the `regex` module instead of
# Oniguruma: both engines give these characters the same Unicode categories (tested against
# Oniguruma for every one of them), while elsewhere `regex` may know a newer Unicode than
# llama.cpp's 15.1 (letters added since). Short texts stay on the `tokenizers` path.
_FAST_UNSAFE = re.compile("[^\x00-\u052f\u2000-\u206f]")
_FAST_MIN = 1 << 12


class _WordCacheBpe:
    """Byte-level BPE of long texts, several times faster than `tokenizers` alone: the
    pre-tokens are cut by the `regex` module (each regex of the row in turn splits every
    piece into its matches and the gaps between them, as Split "isolated" does), and each
    distinct pre-token is merged once by `tokenizers` (without its regexes) and remembered.
    The ids are those of the whole pipeline: merging never crosses a pre-token."""

    MAX_WORDS = 1 << 20     # the memory of pre-tokens is forgotten when it grows past this

    def __init__(self, regexes: list, words):
        self.regexes = regexes
        self.words = words              # `tokenizers` BPE with only the byte-level map
        self.index: dict[str, int] = {}
        self.flat = np.zeros(0, dtype=np.int32)     # the ids of every remembered pre-token
        self.start = np.zeros(1, dtype=np.int64)    # pre-token k: flat[start[k]:start[k + 1]]

    @classmethod
    def make(cls, pre: BpePre, hf) -> "_WordCacheBpe | None":
        """None where a regex of `pre` is not one the `regex` module runs as Oniguruma does
        (a class intersection, a capturing group)."""
        from tokenizers import Tokenizer as HFTokenizer, pre_tokenizers

        compiled = []
        for r in pre.regexes:
            if "&&" in r:
                return None
            try:
                c = regex.compile(f"({r})", regex.VERSION0)
            except regex.error:
                return None
            if c.groups != 1:
                return None
            compiled.append(c)
        words = HFTokenizer.from_str(hf.to_str())
        words.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        return cls(compiled, words)

    def pretokens(self, text: str) -> list:
        pieces = [text]
        for r in self.regexes:
            # split with the regex captured: gaps and matches in order, empty gaps dropped
            pieces = [x for p in pieces for x in r.split(p) if x]
        return pieces

    def encode(self, text: str) -> np.ndarray:
        pieces = self.pretokens(text)
        if len(self.index) > self.MAX_WORDS:
            self.__init__(self.regexes, self.words)
        index = self.index
        new = list(dict.fromkeys(p for p in pieces if p not in index))
        if new:
            encs = self.words.encode_batch_fast(new, add_special_tokens=False)
            ids = [enc.ids for enc in encs]
            n = len(self.start) - 1
            index.update(zip(new, range(n, n + len(new))))
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
            self.start = np.concatenate([self.start, self.start[-1] + np.cumsum(lengths)])
            self.flat = np.concatenate([self.flat, np.fromiter(
                (i for w in ids for i in w), dtype=np.int32, count=int(lengths.sum()))])
        keys = np.fromiter(map(index.__getitem__, pieces), dtype=np.int64, count=len(pieces))
        first, lengths = self.start[keys], self.start[keys + 1] - self.start[keys]
        ends = np.cumsum(lengths)
        # output position j lies in pre-token k: it is flat[first[k] + j - (ends[k] - lengths[k])]
        at = np.repeat(first - (ends - lengths), lengths) + np.arange(ends[-1] if len(ends) else 0)
        return self.flat[at]


def _bpe_pieces(tokens: list[str], attrs: np.ndarray) -> list[bytes]:
    """What llama.cpp's token_to_piece(special=False) gives for each byte-level BPE token."""
    return token_pieces(tokens, attrs, _byte_level_decode)


# GPT-2's map as a str.translate table onto latin-1; the other latin-1 characters go to a
# character latin-1 cannot encode, so an unmapped character always takes the slow path
_BYTE_LEVEL_TABLE = {**{ord(c): chr(b) for c, b in _CHAR_BYTE.items()},
                     **{cp: "\uffff" for cp in range(256) if chr(cp) not in _CHAR_BYTE}}


def _byte_level_decode(text: str) -> bytes:
    """A normal token's bytes: each character's byte under GPT-2's map. A character outside
    the map gives what llama.cpp's llama_decode_text writes: "[UNK_BYTE_0x" + its UTF-8 in
    hex + the whole token + "]"."""
    try:
        return text.translate(_BYTE_LEVEL_TABLE).encode("latin-1")
    except UnicodeEncodeError:
        pass
    out = bytearray()
    for c in text:
        b = _CHAR_BYTE.get(c)
        if b is None:
            out += f"[UNK_BYTE_0x{c.encode('utf-8').hex()}{text}]".encode("utf-8")
        else:
            out.append(b)
    return bytes(out)


def _hf_bpe(tokens: list[str], merges: list[str], pre: BpePre, source: str):
    """A `tokenizers` BPE from tokens and merges, pre-tokenizing as llama.cpp does for `pre`."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        # llama.cpp splits at the first space after the first character
        pos = m.find(" ", 1)
        if pos < 0:
            raise FormatError(f"{source}: BPE merge {m!r} is not 'left right'")
        pairs.append((m[:pos], m[pos + 1:]))
    pairs = list(dict.fromkeys(pairs))  # llama.cpp keeps the first rank of a repeated merge
    try:
        tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    except Exception as e:  # tokenizers raises plain Exception for a bad vocabulary/merges
        raise FormatError(f"{source}: the BPE vocabulary and merges do not fit together: {e}") from None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(text: str, vocab_size: int) -> BpeTokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens on `text` (deterministic).

    Raises ConfigError for a vocab_size below 258 or an empty text.
    """
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

    if vocab_size < MIN_BPE_VOCAB:
        raise ConfigError(f"--tokenizer bpe:{vocab_size}: the vocabulary needs at least "
                          f"{MIN_BPE_VOCAB} tokens (256 bytes + BOS + EOS)")
    if not text:
        raise ConfigError(f"--tokenizer bpe:{vocab_size}: the training text is empty")
    _check_str(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # undecodable input bytes: trained on as U+FFFD, as encode() sees them
        text = _utf8(text).decode("utf-8", "replace")
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS_TEXT, EOS_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # word counts are what training needs, so line-sized pieces (parallel) are as good as
    # the whole text; encoding is exact regardless
    hf.train_from_iterator(_chunks(text), trainer)
    model = json.loads(hf.to_str())["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    if any(t is None for t in tokens):
        raise RuntimeError("tokenizers returned a vocabulary with gaps in its ids")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = np.full(len(tokens), NORMAL, dtype=np.int32)
    bos, eos = vocab[BOS_TEXT], vocab[EOS_TEXT]
    types[[bos, eos]] = CONTROL
    return BpeTokenizer(tokens, types, merges, bos_id=bos, eos_id=eos, add_bos=True,
                        source=f"bpe:{vocab_size}")


def _chunks(text: str, size: int = 1 << 16) -> Iterable[str]:
    """`text` in pieces of about `size` characters, cut after a newline where there is one."""
    pos = 0
    while pos < len(text):
        end = min(len(text), pos + size)
        if end < len(text):
            nl = text.rfind("\n", pos, end)
            if nl > pos:
                end = nl + 1
        yield text[pos:end]
        pos = end


# ---- from GGUF ----------------------------------------------------------------------------
