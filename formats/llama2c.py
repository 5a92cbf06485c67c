"""Karpathy's llama2.c checkpoints and tokenizers (layer 5): read them as a llama model.

A legacy (version 0) llama2.c checkpoint is a header of 7 int32 (dim, hidden_dim,
n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative vocab_size means the
classifier is not shared with the embedding) and then float32 arrays, all row-major:

    token_embedding (V, C)       rms_att (L, C)      wq (L, C, C)
    wk, wv (L, H_kv * D, C)      wo (L, C, C)        rms_ffn (L, C)
    w1, w3 (L, F, C)             w2 (L, C, F)        rms_final (C,)
    freq_cis_real, freq_cis_imag (seq_len, D / 2)    wcls (V, C) only when not shared

The matrices are already (out_features, in_features) with q and k in the interleaved-pair
rotary layout that ggml's rope (mode 0) expects, so they become llama.cpp tensors as they
are; this was checked tensor by tensor against ggml-org's stories260K.gguf, which
llama.cpp's converter made from the same file. (Hugging Face checkpoints use the
rotate-half layout and need a permutation; llama2.c's exporter undoes it before writing.)

tokenizer.bin: int32 max_token_length, then per token float32 score, int32 length and
the UTF-8 bytes. Spaces are plain spaces (SentencePiece's U+2581 in GGUF), ids 1 and 2
are stored as "\\n<s>\\n" and "\\n</s>\\n".
"""
from __future__ import annotations

import os
import re
import struct

import numpy as np

from ggtrain.errors import FormatError
from ggtrain.formats.model import OUTPUT, OUTPUT_NORM, TOKEN_EMBD
from ggtrain.formats.tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, SpmTokenizer

_HEADER = struct.Struct("<7i")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# llama2.c's ids: 0 <unk>, 1 <s>, 2 </s> (SentencePiece's defaults, which llama2.c trains with)
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def read_llama2c(path) -> tuple:
    """(ModelConfig kwargs, {tensor name: f32 array}) of a version-0 llama2.c checkpoint.

    Raises FormatError naming the file for a header that is not a version-0 llama2.c one,
    sizes that do not fit the header (truncated or trailing bytes) and RoPE tables that
    are not llama2.c's (base 10000).
    """
    path = os.fspath(path)
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        raise FormatError(f"{path}: no such file") from None
    if raw.size < _HEADER.size:
        raise FormatError(f"{path}: {raw.size} bytes, too short for a llama2.c header ({_HEADER.size} bytes)")
    if raw[:4].tobytes() == b"ak42"[::-1] or raw[:4].tobytes() == b"ak42":
        version = struct.unpack_from("<i", raw, 4)[0]
        raise FormatError(f"{path}: a llama2.c version {version} export; ggtrain reads the legacy "
                          f"version 0 format (llama2.c's export.py --version 0)")
    if raw[:4].tobytes() == b"GGUF":
        raise FormatError(f"{path}: a GGUF file, not a llama2.c checkpoint (drop --from llama2c)")
    dim, hidden, layers, heads, kv_heads, vocab, seq_len = _HEADER.unpack_from(raw)
    shared = vocab > 0
    vocab = abs(vocab)
    fields = dict(dim=dim, hidden_dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                  vocab_size=vocab, seq_len=seq_len)
    bad = [f"{k}={v}" for k, v in fields.items() if not 0 < v < 1 << 24]
    if bad or dim % heads or heads % kv_heads or (dim // heads) % 2:
        raise FormatError(f"{path}: not a llama2.c checkpoint header ({', '.join(f'{k}={v}' for k, v in fields.items())})")
    d = dim // heads
    kv = kv_heads * d
    parts = [("token_embedding", (vocab, dim)), ("rms_att", (layers, dim)), ("wq", (layers, dim, dim)),
             ("wk", (layers, kv, dim)), ("wv", (layers, kv, dim)), ("wo", (layers, dim, dim)),
             ("rms_ffn", (layers, dim)), ("w1", (layers, hidden, dim)), ("w2", (layers, dim, hidden)),
             ("w3", (layers, hidden, dim)), ("rms_final", (dim,)), ("freq_cis_real", (seq_len, d // 2)),
             ("freq_cis_imag", (seq_len, d // 2))]
    if not shared:
        parts.append(("wcls", (vocab, dim)))
    need = _HEADER.size + 4 * sum(int(np.prod(s)) for _, s in parts)
    if raw.size != need:
        what = "truncated" if raw.size < need else "has trailing bytes"
        raise FormatError(f"{path}: {raw.size} bytes, but its header ({', '.join(f'{k}={v}' for k, v in fields.items())}) "
                          f"needs {need}: the file {what}")
    floats = raw[_HEADER.size:].view("<f4")
    arrays, at = {}, 0
    for name, shape in parts:
        n = int(np.prod(shape))
        arrays[name] = floats[at:at + n].reshape(shape).astype(np.float32)
        at += n
    _check_rope(path, arrays["freq_cis_real"], arrays["freq_cis_imag"], d)

    weights = {TOKEN_EMBD: arrays["token_embedding"], OUTPUT_NORM: arrays["rms_final"],
               OUTPUT: arrays["token_embedding"] if shared else arrays["wcls"]}
    per_block = {"attn_norm": "rms_att", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
                 "attn_output": "wo", "ffn_norm": "rms_ffn", "ffn_gate": "w1", "ffn_down": "w2",
                 "ffn_up": "w3"}
    for i in range(layers):
        for ours, theirs in per_block.items():
            weights[f"blk.{i}.{ours}.weight"] = arrays[theirs][i]
    config = dict(vocab=vocab, dim=dim, layers=layers, heads=heads, kv_heads=kv_heads, ff=hidden,
                  ctx=seq_len, rope_dims=d, rope_base=10000.0, norm_eps=1e-5, tied=False)
    return config, weights


def _check_rope(path, real: np.ndarray, imag: np.ndarray, d: int) -> None:
    """llama2.c stores cos/sin of t * 10000^(-2i/d); ggtrain (and llama.cpp) compute them."""
    t = np.arange(real.shape[0])[:, None]
    angle = t * 10000.0 ** (-np.arange(0, d, 2)[None, :] / d)
    err = max(np.abs(real - np.cos(angle)).max(), np.abs(imag - np.sin(angle)).max()) if real.size else 0.0
    if not err < 1e-3:
        raise FormatError(f"{path}: its RoPE tables are not llama2.c's (base 10000, head size {d}); "
                          f"largest difference {err:.3g}")


def read_llama2c_tokenizer(path, n_vocab: int) -> SpmTokenizer:
    """The SPM tokenizer of a llama2.c tokenizer.bin with n_vocab tokens, as llama.cpp's
    converter makes it: U+2581 for spaces, <unk> unknown, <s> and </s> control, <0xXX>
    byte tokens, the rest normal; BOS 1, EOS 2, UNK 0."""
    path = os.fspath(path)
    try:
        raw = open(path, "rb").read()
    except FileNotFoundError:
        raise FormatError(f"--tokenizer {path}: no such file") from None
    if len(raw) < 4:
        raise FormatError(f"{path}: too short for a llama2.c tokenizer")
    at = 4
    tokens, scores = [], np.zeros(n_vocab, np.float32)
    for i in range(n_vocab):
        if at + 8 > len(raw):
            raise FormatError(f"{path}: ends after {i} of the model's {n_vocab} tokens")
        score, n = struct.unpack_from("<fi", raw, at)
        at += 8
        if n < 0 or at + n > len(raw):
            raise FormatError(f"{path}: token {i} has a bad length {n}")
        try:
            text = raw[at:at + n].decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"{path}: token {i} is not UTF-8") from None
        at += n
        scores[i] = score
        tokens.append(text)
    if at != len(raw):
        raise FormatError(f"{path}: {len(raw) - at} bytes after the {n_vocab} tokens the model has "
                          f"(a tokenizer of another vocabulary?)")
    types = np.full(n_vocab, NORMAL, np.int32)
    for i, text in enumerate(tokens):
        if i == UNK_ID:
            types[i] = UNKNOWN
        elif i in (BOS_ID, EOS_ID):
            types[i], tokens[i] = CONTROL, text.strip("\n")
        elif _BYTE_TOKEN.fullmatch(text):
            types[i] = BYTE
        else:
            tokens[i] = text.replace(" ", "\u2581")
    return SpmTokenizer(tokens, scores, types, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
                        source=path)
