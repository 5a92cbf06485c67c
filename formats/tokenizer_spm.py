"""SentencePiece vocabularies (layer 5): llama.cpp's SPM tokenizer, encoded through sentencepiece
with a model proto written from the GGUF vocabulary."""
from __future__ import annotations

import struct
from typing import Iterable, Sequence

import numpy as np

from ggtrain.errors import FormatError
from ggtrain.formats.tokenizer_base import (ATTR_BYTE, ATTR_CONTROL, ATTR_UNKNOWN, ATTR_UNUSED, token_pieces,
                                            ATTR_USER_DEFINED, BYTE, CONTROL, K, NORMAL, SPACE, Tokenizer,
                                            UNKNOWN, UNUSED, USER_DEFINED, VT, VocabInfo)


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
    """What llama.cpp's token_to_piece(special=False) gives for each SPM token (a normal token's
    U+2581 is a space)."""
    return token_pieces(tokens, attrs, lambda text: text.replace(SPACE, " ").encode("utf-8"))


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
