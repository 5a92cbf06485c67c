"""What every tokenizer is (layer 5): llama.cpp's token types and attributes, the Tokenizer
base class (special-token splitting, gguf_kv) and the byte tokenizer (formats/tokenizer.py
tells the kinds apart)."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from gguf.constants import GGUFValueType



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


def token_pieces(tokens: list[str], attrs: np.ndarray, normal) -> list[bytes]:
    """What llama.cpp's token_to_piece(special=False) gives for each token: nothing for control,
    unknown, unused and undefined tokens, a user-defined token's text, a byte token's byte, and
    normal(text) for a normal token (the vocabulary kind's own decoding)."""
    pieces = []
    for text, a in zip(tokens, attrs.tolist()):
        if a & (ATTR_CONTROL | ATTR_UNKNOWN):
            pieces.append(b"")
        elif a & ATTR_USER_DEFINED:
            pieces.append(text.encode("utf-8"))
        elif a & ATTR_NORMAL:
            pieces.append(normal(text))
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
