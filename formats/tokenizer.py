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
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import regex
from gguf.constants import GGUFValueType

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.gguf import GGUFFile, StringArray, read_gguf
from ggtrain.formats.pretokenizer import BPE_PRE, BpePre

VT = GGUFValueType

# llama.cpp's LLAMA_TOKEN_TYPE_* (the same numbers as sentencepiece's piece types)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"                     # sentencepiece's escaped space, "▁"
BOS_TEXT, EOS_TEXT, UNK_TEXT = "<s>", "</s>", "<unk>"
MIN_BPE_VOCAB = 256 + 2              # the byte alphabet plus BOS and EOS
SPECS = "'byte', 'bpe:N' (N >= 258, a byte-level BPE trained on the text) or a path to a .gguf file"

K = "tokenizer.ggml."


# ---- how llama.cpp classifies tokens --------------------------------------------------------

# llama.cpp's LLAMA_TOKEN_ATTR_* bits (llama.h)
ATTR_UNKNOWN, ATTR_UNUSED, ATTR_NORMAL, ATTR_CONTROL = 1 << 0, 1 << 1, 1 << 2, 1 << 3
ATTR_USER_DEFINED, ATTR_BYTE, ATTR_LSTRIP, ATTR_RSTRIP = 1 << 4, 1 << 5, 1 << 7, 1 << 8
_TYPE_ATTR = {NORMAL: ATTR_NORMAL, UNKNOWN: ATTR_UNKNOWN, CONTROL: ATTR_CONTROL,
              USER_DEFINED: ATTR_USER_DEFINED, UNUSED: ATTR_UNUSED, BYTE: ATTR_BYTE}
_C_SPACE = " \t\n\v\f\r"            # C's isspace(), what LSTRIP/RSTRIP strip

# Token texts llama.cpp recognises whatever their type (llama_vocab::impl::load). For each
# role whose id the file does not give, the first token found with one of these texts takes
# the role and becomes CONTROL.
# NOTE: llama.cpp looks in hash-map order; where a vocabulary has several candidates for one
# role this takes the lowest id (none of the real vocabularies has two).
_ROLE_TEXTS = {
    "eot": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
            "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
            "<end_of_utterance>"),
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# the GGUF keys of those roles (the last three are deprecated names, read after the others)
_ROLE_KEYS = (("eot", "eot_token_id"), ("eom", "eom_token_id"), ("fim_pre", "fim_pre_token_id"),
              ("fim_suf", "fim_suf_token_id"), ("fim_mid", "fim_mid_token_id"),
              ("fim_pad", "fim_pad_token_id"), ("fim_rep", "fim_rep_token_id"),
              ("fim_sep", "fim_sep_token_id"), ("fim_pre", "prefix_token_id"),
              ("fim_suf", "suffix_token_id"), ("fim_mid", "middle_token_id"))
# tokens that end generation, made CONTROL
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["))
# gpt-oss: always rendered, so plain user-defined tokens
_USER_DEFINED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


@dataclass(frozen=True)
class VocabInfo:
    """What besides tokens and types llama.cpp reads to classify a vocabulary's tokens.

    role_ids: {"eot"|"eom"|"fim_pre"|...: id} from the file's keys (valid ids only);
    name, arch, pre: general.name, general.architecture, tokenizer.ggml.pre.
    """
    role_ids: dict = field(default_factory=dict)
    name: str = ""
    arch: str = ""
    pre: str = ""


def token_attrs(tokens: Sequence[str], token_type: np.ndarray, eos_id: int | None,
                vocab: VocabInfo) -> tuple[np.ndarray, frozenset]:
    """llama.cpp's attribute bits of every token and its end-of-generation ids.

    Returns (attrs (n_vocab,) int32, eog_ids): the bits of each token's type, then what
    llama.cpp's loader changes by text: role and end-of-generation tokens become CONTROL
    (CONTROL "...unused..." ones UNUSED too), gpt-oss's channel tokens USER_DEFINED, and by
    the model's name or pre-tokenizer some special tokens strip the whitespace beside them.
    """
    types = np.asarray(token_type, dtype=np.int64)
    lut = np.array([_TYPE_ATTR.get(t, 0) for t in range(8)], dtype=np.int32)
    attrs = np.where((types >= 0) & (types < 8), lut[np.clip(types, 0, 7)], 0).astype(np.int32)
    ids = {t: i for i, t in enumerate(tokens)}
    roles = dict(vocab.role_ids)
    for role, texts in _ROLE_TEXTS.items():
        if role not in roles:
            found = sorted(ids[t] for t in texts if t in ids)
            if found:
                roles[role] = found[0]
                attrs[found[0]] |= ATTR_CONTROL
    for i in np.flatnonzero(attrs & ATTR_CONTROL).tolist():
        if "unused" in tokens[i]:
            attrs[i] |= ATTR_UNUSED
    eog = {roles[r] for r in ("fim_pad", "fim_rep", "fim_sep") if r in roles}
    for t in _EOG_TEXTS & ids.keys():
        eog.add(ids[t])
        attrs[ids[t]] |= ATTR_CONTROL
    for t in _USER_DEFINED_TEXTS:
        if t in ids:
            attrs[ids[t]] = ATTR_USER_DEFINED
    eog |= {i for i in (eos_id, roles.get("eot"), roles.get("eom")) if i is not None}
    eog_texts = {tokens[i]: i for i in eog}
    # gpt-oss and solar-open: "<|end|>" ends a message there, not the generation
    call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
    if "<|end|>" in eog_texts and call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
        eog.discard(eog_texts["<|end|>"])
        attrs[eog_texts["<|end|>"]] = ATTR_USER_DEFINED
    # gemma4 and plamo: "</s>" is a normal token
    if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
        eog.discard(eog_texts["</s>"])
        attrs[eog_texts["</s>"]] = ATTR_NORMAL
    # whitespace stripping beside special tokens, by model (llama.cpp's list)
    name = "".join(c.lower() if c < "\x80" else c for c in vocab.name)
    if (any(p in vocab.pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
            or any(a in vocab.arch for a in ("nomic-bert-moe", "jina-bert-v3"))):
        _set_attr(attrs, ids, ("<mask>",), ATTR_LSTRIP, True)
    elif "phi-3" in name or "phi3" in name:
        attrs[(attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN)) != 0] |= ATTR_RSTRIP
        _set_attr(attrs, ids, ("</s>",), ATTR_RSTRIP, True)
        _set_attr(attrs, ids, ("<unk>", "<s>", "<|endoftext|>"), ATTR_RSTRIP, False)
    elif "modern-bert" in name:
        _set_attr(attrs, ids, ("[MASK]",), ATTR_LSTRIP, True)
    return attrs, frozenset(eog)


def _set_attr(attrs: np.ndarray, ids: dict, texts: Sequence[str], bit: int, on: bool) -> None:
    for t in texts:
        if t in ids:
            attrs[ids[t]] = attrs[ids[t]] | bit if on else attrs[ids[t]] & ~bit


# ---- the interface ------------------------------------------------------------------

class Tokenizer:
    """Text <-> token ids. Subclasses fill the vocabulary and implement `_encode_raw`.

    tokens: list[str] (n_vocab,); token_type: (n_vocab,) int32 (llama.cpp token types, as
    stored in GGUF); bos_id, eos_id: int; unk_id, pad_id: int | None; add_bos, add_eos:
    llama.cpp's defaults for this vocabulary (tokenizer.ggml.add_bos_token / add_eos_token);
    vocab: what else llama.cpp reads to classify tokens (see `token_attrs`). attrs: (n_vocab,)
    int32 llama.cpp's attribute bits of each token; eog_ids: the ids that end generation.
    """

    kind = "?"

    def __init__(self, tokens: Sequence[str], token_type: np.ndarray, bos_id: int, eos_id: int,
                 unk_id: int | None = None, pad_id: int | None = None,
                 add_bos: bool = True, add_eos: bool = False, vocab: VocabInfo | None = None):
        self.tokens = list(tokens)
        self.token_type = np.asarray(token_type, dtype=np.int32).reshape(-1)
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = bos_id, eos_id, unk_id, pad_id
        self.add_bos, self.add_eos = bool(add_bos), bool(add_eos)
        self.attrs, self.eog_ids = token_attrs(self.tokens, self.token_type, eos_id,
                                               vocab or VocabInfo())
        self._pieces: list[bytes] = []      # (n_vocab,) what each id decodes to
        self._user: frozenset | None = None  # `cut`: the user-defined tokens' texts, made when first needed
        # special-token ids in the order llama.cpp splits them out of text: longest first
        special = np.flatnonzero(self.attrs & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN))
        self._special_order = sorted(special.tolist(),
                                     key=lambda i: (-len(self.tokens[i].encode("utf-8")), i))

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"

    # -- encoding --
    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False,
               continued: bool = False) -> np.ndarray:
        """Token ids of `text`: (n,) int32, BOS first when add_bos.

        llama.cpp's llama_tokenize(text, add_special=False, parse_special), with BOS put first
        when add_bos whether or not the vocabulary asks for one (`tokenize` does exactly what
        add_special does). continued: `text` is the rest of a text cut where `cut` allows, so
        it does not start a fragment (no SPM space prefix).
        """
        text = self._clean(text)
        parts: list[np.ndarray] = []
        if add_bos:
            parts.append(np.array([self.bos_id], dtype=np.int32))
        after_special = not continued
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                parts.append(np.array([frag], dtype=np.int32))
                after_special = True
            else:
                parts.append(np.asarray(self._encode_raw(frag, after_special), dtype=np.int32))
                after_special = False
        if not parts:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def encode_bytes(self, data: bytes, add_bos: bool = False) -> np.ndarray:
        """Token ids of raw bytes; invalid UTF-8 becomes U+FFFD (ByteTokenizer keeps every byte)."""
        return self.encode(bytes(data).decode("utf-8", errors="replace"), add_bos)

    def _clean(self, text: str) -> str:
        """`text` made encodable: lone surrogates (not text) are replaced like bad bytes."""
        _check_str(text)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = _utf8(text).decode("utf-8", "replace")
        return text

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = False) -> np.ndarray:
        """Exactly llama.cpp's llama_tokenize(text, add_special, parse_special): (n,) int32.

        add_special puts BOS first only where the vocabulary asks for it (add_bos), and EOS
        last where it asks for that (add_eos), as llama.cpp does.
        """
        ids = self.encode(text, add_bos=add_special and self.add_bos, parse_special=parse_special)
        if add_special and self.add_eos:
            ids = np.append(ids, np.int32(self.eos_id))
        return ids

    def _partition(self, text: str, parse_special: bool) -> list:
        """Split `text` at special tokens as llama.cpp's tokenizer_st_partition does.

        Each special token in turn, longest first, is cut out of every text fragment left
        (user-defined tokens always; control and unknown ones only with parse_special), and
        an LSTRIP/RSTRIP token also takes the whitespace on its left/right with it. Returns
        str fragments (non-empty) and int ids.
        """
        frags: list = [text] if text else []
        for i in self._special_order:
            attr = int(self.attrs[i])
            if not parse_special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue
            token = self.tokens[i]
            out: list = []
            for frag in frags:
                if isinstance(frag, int) or token not in frag:
                    out.append(frag)
                    continue
                parts = frag.split(token)
                for k, part in enumerate(parts):
                    if k:
                        out.append(i)
                    if attr & ATTR_LSTRIP and k < len(parts) - 1:
                        part = part.rstrip(_C_SPACE)
                    if attr & ATTR_RSTRIP and k:
                        part = part.lstrip(_C_SPACE)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def _encode_raw(self, text: str, after_special: bool) -> Sequence[int]:
        raise NotImplementedError

    def cut(self, text: str, start: int, limit: int = 1 << 20) -> int | None:
        """The first position p in [max(start, 1), min(len(text), start + limit)) where
        `text` can be cut so that encode(text[:p]) followed by encode(text[p:],
        continued=True) are the ids of encode(text) (parse_special False), or None.

        Used to tokenize a corpus as a stream of pieces. A cut never comes near a
        user-defined token (plain text is split at those) or the whitespace such a token
        strips; each kind adds its own rule (`_cuttable`)."""
        end = min(len(text), start + limit)
        for p in self._candidates(text, max(start, 1), end):
            if self._clear_of_special(text, p):
                return p
        return None

    def _candidates(self, text: str, start: int, end: int) -> Iterable[int]:
        raise NotImplementedError

    def _clear_of_special(self, text: str, p: int) -> bool:
        """Plain text is split at user-defined tokens (`_partition`). A cut at p leaves that
        split alone when no such token holds text[p - 1] and text[p] side by side (none
        can span p), and none ends at p (what follows it starts a fragment, the cut text
        would be `continued`); a token that strips whitespace must not reach p over it."""
        if self._user is None:
            user = [self.tokens[i] for i in self._special_order if self.attrs[i] & ATTR_USER_DEFINED]
            strip = [self.tokens[i] for i in self._special_order
                     if self.attrs[i] & ATTR_USER_DEFINED and self.attrs[i] & (ATTR_LSTRIP | ATTR_RSTRIP)]
            self._user = frozenset(user)
            self._user_pairs = frozenset(t[k:k + 2] for t in user for k in range(len(t) - 1))
            self._user_reach = max(map(len, user), default=0)
            self._user_strip = re.compile("|".join(map(re.escape, strip))) if strip else None
        if not self._user:
            return True
        if text[p - 1:p + 1] in self._user_pairs:
            return False
        if any(text[p - k:p] in self._user for k in range(1, min(p, self._user_reach) + 1)):
            return False
        if self._user_strip is None:
            return True
        lo, hi = p, p
        while lo > 0 and text[lo - 1] in _C_SPACE:
            lo -= 1
        while hi < len(text) and text[hi] in _C_SPACE:
            hi += 1
        return self._user_strip.search(text, max(0, lo - self._user_reach), hi + self._user_reach) is None

    def fingerprint(self) -> str:
        """sha256 of what decides this tokenizer's ids: its kind, its tokenizer.ggml.* keys and the
        token attributes llama.cpp derives from them and the model (VocabInfo: which tokens
        strip whitespace, which are control tokens)."""
        h = hashlib.sha256(type(self).__name__.encode())
        h.update(self.attrs.astype("<i4").tobytes())
        for key, value, *_ in self.gguf_kv():
            h.update(f"|{key}=".encode())
            if isinstance(value, np.ndarray):
                h.update(f"{value.dtype.str}{value.shape}".encode() + value.tobytes())
            elif isinstance(value, (list, tuple)):
                h.update(json.dumps([v.item() if isinstance(v, np.generic) else v for v in value]).encode())
            else:
                h.update(repr(value).encode())
        return h.hexdigest()

    # -- decoding --
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of the tokens `ids`, as llama.cpp's token_to_piece(special=False) gives them."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        n = len(self._pieces)
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = ids[(ids < 0) | (ids >= n)][0]
            raise ValueError(f"token id {bad} is out of range for a vocabulary of {n}")
        return b"".join(map(self._pieces.__getitem__, ids.tolist()))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of the tokens `ids`; bytes that are not UTF-8 become U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def piece(self, i: int) -> bytes:
        """The bytes token `i` decodes to (b"" for control tokens)."""
        return self._pieces[i]

    # -- GGUF --
    def gguf_kv(self) -> list[tuple]:
        """The tokenizer.ggml.* keys: [(key, value, type[, item_type]), ...] for GGUFWriter.add_kv."""
        raise NotImplementedError

    def _special_kv(self, with_unk: bool) -> list[tuple]:
        kv = [(K + "bos_token_id", self.bos_id, VT.UINT32),
              (K + "eos_token_id", self.eos_id, VT.UINT32)]
        if with_unk and self.unk_id is not None:
            kv.append((K + "unknown_token_id", self.unk_id, VT.UINT32))
        if self.pad_id is not None:
            kv.append((K + "padding_token_id", self.pad_id, VT.UINT32))
        kv += [(K + "add_bos_token", self.add_bos, VT.BOOL),
               (K + "add_eos_token", self.add_eos, VT.BOOL)]
        return kv


def _check_str(text) -> None:
    if not isinstance(text, str):
        raise TypeError(f"encode takes str, got {type(text).__name__} (use encode_bytes for bytes)")


def _utf8(text: str) -> bytes:
    """UTF-8 of `text`; surrogateescape'd bytes (U+DC80..U+DCFF) become their bytes again,
    other lone surrogates "?"."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


# ---- byte ---------------------------------------------------------------------------------

class ByteTokenizer(Tokenizer):
    """One token per byte (see the module docstring for the id layout and why)."""

    kind = "byte"
    BYTE0 = 3                       # id of byte 0x00
    SPACE_ID = 259                  # "\u2581"

    def __init__(self):
        tokens = [UNK_TEXT, BOS_TEXT, EOS_TEXT] + [f"<0x{b:02X}>" for b in range(256)] + [SPACE]
        types = np.array([UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL], dtype=np.int32)
        super().__init__(tokens, types, bos_id=1, eos_id=2, unk_id=0, add_bos=True)
        self._pieces = [b"", b"", b""] + [bytes([b]) for b in range(256)] + [b" "]
        # byte value -> token id
        self._lut = np.arange(256, dtype=np.int32) + self.BYTE0
        self._lut[0x20] = self.SPACE_ID

    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False,
               continued: bool = False) -> np.ndarray:
        _check_str(text)
        if parse_special:
            return super().encode(text, add_bos, parse_special, continued)
        return self.encode_bytes(_utf8(text), add_bos)

    def encode_bytes(self, data: bytes, add_bos: bool = False) -> np.ndarray:
        """Any bytes -> ids: byte b -> 3 + b, except " " and the UTF-8 of U+2581 -> 259."""
        data = bytes(data).replace(SPACE.encode("utf-8"), b" ")
        ids = self._lut[np.frombuffer(data, dtype=np.uint8)]
        if add_bos:
            ids = np.concatenate([np.array([self.bos_id], dtype=np.int32), ids])
        return ids

    def _encode_raw(self, text: str, after_special: bool) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def _candidates(self, text: str, start: int, end: int) -> Iterable[int]:
        return range(start, end)      # one token per byte: any character boundary

    def gguf_kv(self) -> list[tuple]:
        return [
            (K + "model", "llama", VT.STRING),
            (K + "pre", "default", VT.STRING),
            (K + "tokens", self.tokens, VT.ARRAY, VT.STRING),
            (K + "scores", np.zeros(self.n_vocab, dtype=np.float32), VT.ARRAY, VT.FLOAT32),
            (K + "token_type", self.token_type, VT.ARRAY, VT.INT32),
            *self._special_kv(with_unk=True),
            (K + "add_space_prefix", False, VT.BOOL),
        ]


# ---- SPM (llama.cpp's "llama" vocabularies) through sentencepiece -------------------------

class SpmTokenizer(Tokenizer):
    """A llama.cpp SPM vocabulary (tokens, scores, types), encoded with sentencepiece.

    llama.cpp's SPM tokenizer is sentencepiece's BPE algorithm: symbols are UTF-8
    characters, the adjacent pair whose concatenation is the best-scoring token merges
    first (ties: leftmost), symbols that are not tokens fall back to <0xXX> byte tokens.
    The model given to sentencepiece is built so its choices are llama.cpp's: identity
    normalization, spaces escaped to U+2581, no dummy prefix (the space prefix is added
    here, per fragment, as llama.cpp does), unused and undefined tokens as normal pieces
    (llama.cpp emits them like any token), one unknown piece (the unknown id).
    """

    kind = "spm"

    def __init__(self, tokens: Sequence[str], scores: np.ndarray, token_type: np.ndarray,
                 bos_id: int, eos_id: int, unk_id: int | None, pad_id: int | None = None,
                 add_bos: bool = True, add_eos: bool = False, add_space_prefix: bool = True,
                 pre: str | None = None, source: str = "vocabulary", vocab: VocabInfo | None = None):
        super().__init__(tokens, token_type, bos_id, eos_id, unk_id, pad_id, add_bos, add_eos, vocab)
        self.scores = np.asarray(scores, dtype=np.float32).reshape(-1)
        self.add_space_prefix = bool(add_space_prefix)
        self.pre = pre
        self._pieces = _spm_pieces(self.tokens, self.attrs)
        self._sp = _sentencepiece(self.tokens, self.scores, _attr_types(self.attrs), unk_id, source)
        self._pairs: set | None = None      # `cut`: every two adjacent characters of a token
        self._chars: set = set()            # `cut`: every character of a token

    def _encode_raw(self, text: str, after_special: bool) -> list:
        if self.add_space_prefix and after_special:
            text = " " + text
        return self._sp.encode(text)

    def _candidates(self, text: str, start: int, end: int) -> Iterable[int]:
        """Between two characters that no token holds side by side (a space is U+2581 in
        tokens): merging joins adjacent symbols into a token, so no symbol can ever span
        such a cut, and the merges on either side do not depend on the other. Never beside a
        character no token holds: without byte fallback a run of unknown characters is one
        <unk>, and undecodable bytes (surrogates) become one U+FFFD per invalid sequence."""
        if self._pairs is None:
            self._pairs = {t[k:k + 2] for t in self.tokens for k in range(len(t) - 1)}
            self._chars = {c for t in self.tokens for c in t}
        pairs, chars = self._pairs, self._chars
        for p in range(start, end):
            a, b = text[p - 1].replace(" ", SPACE), text[p].replace(" ", SPACE)
            # a character no token holds is unknown: without byte fallback a run of them is one <unk>
            if a not in chars or b not in chars:
                continue
            if a + b not in pairs:
                yield p

    def gguf_kv(self) -> list[tuple]:
        return [
            (K + "model", "llama", VT.STRING),
            (K + "pre", self.pre or "default", VT.STRING),
            (K + "tokens", self.tokens, VT.ARRAY, VT.STRING),
            (K + "scores", self.scores, VT.ARRAY, VT.FLOAT32),
            (K + "token_type", self.token_type, VT.ARRAY, VT.INT32),
            *self._special_kv(with_unk=True),
            (K + "add_space_prefix", self.add_space_prefix, VT.BOOL),
        ]


def _spm_pieces(tokens: list[str], attrs: np.ndarray) -> list[bytes]:
    """What llama.cpp's token_to_piece(special=False) gives for each SPM token."""
    pieces = []
    for text, a in zip(tokens, attrs.tolist()):
        if a & (ATTR_CONTROL | ATTR_UNKNOWN):
            pieces.append(b"")
        elif a & ATTR_USER_DEFINED:
            pieces.append(text.encode("utf-8"))
        elif a & ATTR_NORMAL:
            pieces.append(text.replace(SPACE, " ").encode("utf-8"))
        elif a & ATTR_BYTE:
            pieces.append(_byte_piece(text))
        else:                        # unused, undefined: nothing
            pieces.append(b"")
    return pieces


def _byte_piece(text: str) -> bytes:
    """A byte token's byte: llama.cpp reads text[3:5] with strtol(.., 16) ("<0x0A>" -> 10)."""
    digits = ""
    for c in text[3:5]:
        if c not in "0123456789ABCDEFabcdef":
            break
        digits += c
    return bytes([int(digits, 16) if digits else 0])


def _attr_types(attrs: np.ndarray) -> np.ndarray:
    """Token types as llama.cpp's attributes make them: a token it made CONTROL is CONTROL."""
    types = np.full(len(attrs), NORMAL, dtype=np.int32)
    for bit, t in ((ATTR_BYTE, BYTE), (ATTR_USER_DEFINED, USER_DEFINED), (ATTR_UNKNOWN, UNKNOWN),
                   (ATTR_UNUSED, UNUSED), (ATTR_CONTROL, CONTROL)):
        types[(attrs & bit) != 0] = t
    types[attrs == 0] = 0
    return types


def _sentencepiece(tokens, scores, types, unk_id, source):
    """A sentencepiece processor for an SPM vocabulary (see SpmTokenizer)."""
    import sentencepiece as spm

    proto = _spm_model_proto(tokens, scores, types, unk_id)
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto)
    except (RuntimeError, OSError) as e:
        raise FormatError(f"{source}: sentencepiece rejects the SPM vocabulary: {e}") from None
    return sp


def _spm_model_proto(tokens, scores, types, unk_id) -> bytes:
    """A serialized sentencepiece ModelProto (sentencepiece_model.proto), written by hand.

    ModelProto: 1 pieces {1 piece, 2 score (float), 3 type}, 2 trainer_spec {3 model_type
    (2 = BPE), 35 byte_fallback, 40 unk_id}, 3 normalizer_spec {1 name, 3 add_dummy_prefix,
    4 remove_extra_whitespaces, 5 escape_whitespaces}.
    """
    n = len(tokens)
    all_bytes = {f"<0x{b:02X}>" for b in range(256)}
    byte_fallback = all_bytes <= {t for t, ty in zip(tokens, types.tolist()) if ty == BYTE}
    if unk_id is None or not 0 <= unk_id < n:
        unk_id = int(np.flatnonzero(types == UNKNOWN)[0]) if (types == UNKNOWN).any() else None
    out = bytearray()
    for i, (text, score, t) in enumerate(zip(tokens, scores.tolist(), types.tolist())):
        if i == unk_id:
            t = UNKNOWN
        elif t == UNKNOWN:
            t = CONTROL                 # sentencepiece allows one; others are never matched
        elif t == BYTE and not (byte_fallback and text in all_bytes):
            t = NORMAL
        elif t not in (NORMAL, CONTROL, USER_DEFINED, BYTE):
            t = NORMAL                  # unused, undefined: llama.cpp treats them as tokens
        body = _pb_bytes(1, text.encode("utf-8")) + _pb_key(2, 5) + struct.pack("<f", score)
        body += _pb_varint_field(3, t)
        out += _pb_bytes(1, body)
    extra = b""
    if unk_id is None:                   # sentencepiece needs an unknown piece: one past the end
        body = _pb_bytes(1, b"<ggtrain-unk>") + _pb_key(2, 5) + struct.pack("<f", 0.0)
        extra = _pb_bytes(1, body + _pb_varint_field(3, UNKNOWN))
        unk_id = n
    trainer = _pb_varint_field(3, 2) + _pb_varint_field(35, int(byte_fallback)) + \
        _pb_varint_field(40, unk_id)
    normalizer = _pb_bytes(1, b"identity") + _pb_varint_field(3, 0) + _pb_varint_field(4, 0) + \
        _pb_varint_field(5, 1)
    return bytes(out) + extra + _pb_bytes(2, trainer) + _pb_bytes(3, normalizer)


def _pb_varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _pb_key(field: int, wire: int) -> bytes:
    return _pb_varint(field << 3 | wire)


def _pb_varint_field(field: int, v: int) -> bytes:
    return _pb_key(field, 0) + _pb_varint(v)


def _pb_bytes(field: int, data: bytes) -> bytes:
    return _pb_key(field, 2) + _pb_varint(len(data)) + data


# ---- byte-level BPE (llama.cpp's "gpt2" vocabularies) through tokenizers --------------------

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
    pieces = []
    for text, a in zip(tokens, attrs.tolist()):
        if a & (ATTR_CONTROL | ATTR_UNKNOWN):
            pieces.append(b"")
        elif a & ATTR_USER_DEFINED:
            pieces.append(text.encode("utf-8"))
        elif a & ATTR_NORMAL:
            pieces.append(_byte_level_decode(text))
        elif a & ATTR_BYTE:
            pieces.append(_byte_piece(text))
        else:                        # unused, undefined: nothing
            pieces.append(b"")
    return pieces


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
