"""Tokenizers and their GGUF vocabularies (layer 5), encoding text exactly as llama.cpp does.

Three kinds, all made by `load_tokenizer(spec, text)`:

    "byte"       ByteTokenizer: every UTF-8 byte is a token (stored as an SPM vocabulary)
    "bpe:N"      BpeTokenizer: byte-level BPE of at most N tokens trained on `text`
                 with the `tokenizers` library (stored as a GPT-2 vocabulary with merges)
    "PATH.gguf"  the vocabulary of an existing GGUF, rebuilt from its tokenizer.ggml.* keys:
                 SpmTokenizer ("llama" model, encoded through `sentencepiece`) or
                 BpeTokenizer ("gpt2" model, encoded through `tokenizers`, pre-tokenized
                 as llama.cpp does for the file's tokenizer.ggml.pre: see pretokenizer.py)

Every tokenizer has `encode(text, add_bos=False) -> (n,) int32`, `tokenize(text,
add_special, parse_special)` (exactly llama.cpp's llama_tokenize), `encode_bytes(data)`,
`decode(ids) -> str`, `decode_bytes(ids) -> bytes` (for streaming: feed it to an
incremental UTF-8 decoder), `bos_id`, `eos_id`, `n_vocab`, `add_bos` (what llama.cpp does
by default) and `gguf_kv()`, the tokenizer.ggml.* keys that make llama.cpp tokenize text
into the same ids. Encoding reproduces llama.cpp's `llama_tokenize(text, add_special,
parse_special=False)`; decoding is the concatenation of llama.cpp's `token_to_piece(id,
special=False)`: control and unknown tokens decode to nothing, and no leading space is
removed (an SPM vocabulary with add_space_prefix gives " " + text back).

Byte id layout (n_vocab 260; the layout of llama2.c / stories260K vocabularies):

    0 "<unk>" UNKNOWN   1 "<s>" BOS, CONTROL   2 "</s>" EOS, CONTROL
    3 + b  "<0xBB>" BYTE for every byte b (0..255)
    259 "\u2581" NORMAL: the space
    llama.cpp's SPM tokenizer turns every " " into U+2581 before it looks tokens up, so a
    space can only come out as this token, never as byte 0x20: `encode` maps " " (and a
    literal U+2581, which llama.cpp cannot tell from a space) to 259 and every other byte b
    to 3 + b. With only byte tokens and "\u2581", no two symbols ever merge, so llama.cpp
    falls back to one byte token per byte. tokenizer.ggml.add_space_prefix is false, so no
    space is put before the text. Id 35 (<0x20>) is never produced; decode maps it to " ".

BPE id layout (bpe:N): 0 "<s>" BOS, 1 "</s>" EOS (CONTROL), 2..257 the 256 byte-level
characters (GPT-2's byte-to-unicode map, sorted), then one token per merge in merge order;
n_vocab <= N (fewer when the text has too few distinct pairs). The pre-tokenizer is GPT-2's
regex ('s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+),
stored as tokenizer.ggml.pre "gpt-2", which llama.cpp maps to the same regex. Training is
deterministic (the trainer breaks ties by pair order; checked in the tests).

Keys written by gguf_kv() and the types llama.cpp (src/llama-vocab.cpp) requires:

    tokenizer.ggml.model            STRING   "llama" (SPM, byte) or "gpt2" (BPE); required
    tokenizer.ggml.pre              STRING   "default" (SPM) / "gpt-2" (BPE); BPE without it
                                             falls back to llama.cpp's "default" regex
    tokenizer.ggml.tokens           ARRAY[STRING]   required; unique, non-empty strings
    tokenizer.ggml.scores           ARRAY[FLOAT32]  SPM merge priority (read as float*)
    tokenizer.ggml.token_type       ARRAY[INT32]    1 normal, 2 unknown, 3 control,
                                                    4 user-defined, 5 unused, 6 byte (int*)
    tokenizer.ggml.merges           ARRAY[STRING]   BPE only, "left right" in rank order;
                                                    a gpt2 model without it fails to load
    tokenizer.ggml.bos_token_id     UINT32   (get_key<uint32_t> checks the type; an id
    tokenizer.ggml.eos_token_id     UINT32    >= n_vocab is ignored with a warning)
    tokenizer.ggml.unknown_token_id UINT32   when the vocabulary has one (byte: 0; bpe:N: none)
    tokenizer.ggml.padding_token_id UINT32   when the vocabulary has one (byte, bpe:N: none)
    tokenizer.ggml.add_bos_token    BOOL     llama.cpp prepends BOS when asked for specials
    tokenizer.ggml.add_eos_token    BOOL
    tokenizer.ggml.add_space_prefix BOOL     SPM only: false for byte, as read for GGUFs
                                             (llama.cpp's SPM default is true)

Text that is not valid UTF-8: the text API is `str`. ByteTokenizer.encode_bytes takes any
bytes and maps each byte to its token (spaces and U+2581 sequences as above), and
ByteTokenizer.encode encodes str with errors="surrogateescape", so a file read with
errors="surrogateescape" gets its exact bytes back. The other kinds decode bytes with
errors="replace" (each invalid sequence becomes U+FFFD) in encode_bytes, and treat
surrogateescape'd bytes in str the same way (other lone surrogates become "?", in every
kind). decode() always decodes with errors="replace". llama.cpp itself only ever sees
valid UTF-8 prompts; for invalid bytes the ids are this module's definition.

Special tokens: llama.cpp decides at load what each token is (its attribute bits), from
its type and, for some texts, from what the text is: "<|im_end|>", "</s>", "<|eot_id|>" and
the other end-of-generation texts become CONTROL whatever the file says, and so on
(`token_attrs`; `attrs` and `eog_ids` hold the result). Text is split at special tokens as
llama.cpp's tokenizer_st_partition does: user-defined tokens always, control and unknown
ones only with `parse_special=True` (llama-cpp-python tokenizes completion prompts that
way); with parse_special=False "<|im_start|>" in the text is plain text.

The kinds live in tokenizer_base.py (Tokenizer, the byte kind), tokenizer_spm.py and
tokenizer_bpe.py (with its trainer); this module tells which one a GGUF file or a
--tokenizer spec names, and is what callers import.
"""
from __future__ import annotations

import os
import re

import numpy as np

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.gguf import GGUFFile, read_gguf
from ggtrain.formats.gguf_values import StringArray
from ggtrain.formats.pretokenizer import BPE_PRE
# (callers import the kinds and their constants from here too)
from ggtrain.formats.tokenizer_base import *  # noqa: F401,F403
from ggtrain.formats.tokenizer_base import (_ROLE_KEYS, K, MIN_BPE_VOCAB, NORMAL, SPECS, VT, ByteTokenizer,
                                            Tokenizer, VocabInfo)
from ggtrain.formats.tokenizer_bpe import BpeTokenizer, _unsupported_pre, train_bpe
from ggtrain.formats.tokenizer_spm import SpmTokenizer


def tokenizer_from_gguf(gguf: GGUFFile | str | os.PathLike) -> Tokenizer:
    """The tokenizer of a GGUF file's tokenizer.ggml.* keys, with llama.cpp's defaults.

    Raises FormatError naming the file when it has no vocabulary or an unsupported
    tokenizer.ggml.model ("llama" and "gpt2" are supported) or tokenizer.ggml.pre.
    """
    f = gguf if isinstance(gguf, GGUFFile) else read_gguf(gguf)
    src = f.path
    model = f.value(K + "model", None)
    if model is None or K + "tokens" not in f.kv:
        raise FormatError(f"{src}: no tokenizer vocabulary (tokenizer.ggml.model and "
                          f"tokenizer.ggml.tokens are needed)")
    if model not in ("llama", "gpt2"):
        raise FormatError(f"{src}: tokenizer.ggml.model {model!r} is not supported "
                          f"(supported: 'llama' (SPM) and 'gpt2' (BPE))")
    tokens = _strings(f, K + "tokens")
    n = len(tokens)
    for i, t in enumerate(tokens):       # llama.cpp renames empty tokens
        if not t:
            tokens[i] = f"[EMPTY_{i}]"
    if len(set(tokens)) != n:
        raise FormatError(f"{src}: tokenizer.ggml.tokens holds duplicate tokens "
                          f"(llama.cpp refuses such a vocabulary)")
    types = _array(f, K + "token_type", n, np.int32, NORMAL)
    pre = f.value(K + "pre", None)
    if model == "gpt2":
        pre = "default" if pre is None else pre     # as llama.cpp does, with a warning
        if pre not in BPE_PRE:
            raise FormatError(f"{src}: {_unsupported_pre(pre)}")
        if K + "merges" not in f.kv:
            raise FormatError(f"{src}: gpt2 vocabulary without tokenizer.ggml.merges")
    roles = _special_ids(f, n, **{role: None for role, _ in _ROLE_KEYS})
    vocab = VocabInfo({r: i for r, i in roles.items() if i is not None},
                      _text(f, "general.name"), _text(f, "general.architecture"), _text(f, K + "pre"))
    if model == "llama":
        ids = _special_ids(f, n, bos=1, eos=2, unk=0, pad=None)
        byte = ByteTokenizer()
        if (tokens == list(byte.tokens) and np.array_equal(types, byte.token_type)
                and not _flag(f, K + "add_space_prefix", True)
                and (ids["bos"], ids["eos"], ids["unk"]) == (byte.bos_id, byte.eos_id, byte.unk_id)):
            # our own byte vocabulary: the same ids for valid UTF-8 (llama.cpp agrees), and
            # arbitrary bytes keep their byte ids, so a resumed run sees the same tokens
            return byte
        return SpmTokenizer(tokens, _array(f, K + "scores", n, np.float32, 0.0), types,
                            ids["bos"], ids["eos"], ids["unk"], ids["pad"],
                            add_bos=_flag(f, K + "add_bos_token", True),
                            add_eos=_flag(f, K + "add_eos_token", False),
                            add_space_prefix=_flag(f, K + "add_space_prefix", True),
                            pre=pre, source=src, vocab=vocab)
    ids = _special_ids(f, n, bos=11, eos=11, unk=None, pad=None)
    return BpeTokenizer(tokens, types, _strings(f, K + "merges"), ids["bos"], ids["eos"],
                        ids["unk"], ids["pad"], add_bos=_flag(f, K + "add_bos_token", BPE_PRE[pre].add_bos),
                        add_eos=_flag(f, K + "add_eos_token", False), pre=pre, source=src, vocab=vocab)


def _text(f: GGUFFile, key: str) -> str:
    v = f.value(key, "")
    return v if isinstance(v, str) else ""


def _strings(f: GGUFFile, key: str) -> list[str]:
    v = f.kv[key]
    if v.type != VT.ARRAY or v.item_type != VT.STRING:
        raise FormatError(f"{f.path}: {key} must be an array of strings")
    return list(v.value) if isinstance(v.value, StringArray) else v.to_python()


def _array(f: GGUFFile, key: str, n: int, dtype, default) -> np.ndarray:
    v = f.kv.get(key)
    if v is None:
        return np.full(n, default, dtype=dtype)
    if v.type != VT.ARRAY or not isinstance(v.value, np.ndarray):
        raise FormatError(f"{f.path}: {key} must be a numeric array")
    arr = v.value.astype(dtype)
    if len(arr) < n:                     # llama.cpp reads past the end; we pad with the default
        arr = np.concatenate([arr, np.full(n - len(arr), default, dtype=dtype)])
    return arr[:n]


def _flag(f: GGUFFile, key: str, default: bool) -> bool:
    v = f.kv.get(key)
    if v is None:
        return default
    if v.type != VT.BOOL:
        raise FormatError(f"{f.path}: {key} must be BOOL, not {v.type.name}")
    return bool(v.value)


def _special_ids(f: GGUFFile, n: int, **defaults) -> dict:
    """Special ids as llama.cpp sets them: the default unless the key holds an id < n
    (of the roles' keys, a deprecated one read later wins)."""
    keys = {"bos": ("bos_token_id",), "eos": ("eos_token_id",), "unk": ("unknown_token_id",),
            "pad": ("padding_token_id",)}
    for role, key in _ROLE_KEYS:
        keys[role] = keys.get(role, ()) + (key,)
    out = {}
    for name, default in defaults.items():
        out[name] = default if default is None or default < n else None
        for key in keys[name]:
            v = f.value(K + key, None)
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
                out[name] = int(v)
    return out


# ---- the factory ------------------------------------------------------------------------

def load_tokenizer(spec: str, text: str | None = None) -> Tokenizer:
    """The tokenizer named by `spec` (the --tokenizer option): "byte", "bpe:N" or "PATH.gguf".

    text: the training text, needed (non-empty) for bpe:N only.
    Raises ConfigError for an unknown spec, a bad N, a missing file or an empty text;
    FormatError for a GGUF without a supported vocabulary.
    """
    if not isinstance(spec, str) or not spec:
        raise ConfigError(f"--tokenizer {spec!r}: expected {SPECS}")
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        n = spec[4:]
        if not re.fullmatch(r"[0-9]+", n):
            raise ConfigError(f"--tokenizer {spec!r}: N must be an integer >= {MIN_BPE_VOCAB}")
        if text is None:
            raise ConfigError(f"--tokenizer {spec!r}: a BPE vocabulary is trained on the "
                              f"training text, and none was given")
        return train_bpe(text, int(n))
    if spec.lower().endswith(".gguf") or os.path.isfile(spec):
        if not os.path.isfile(spec):
            raise ConfigError(f"--tokenizer {spec!r}: no such file")
        return tokenizer_from_gguf(spec)
    raise ConfigError(f"--tokenizer {spec!r}: expected {SPECS}")
