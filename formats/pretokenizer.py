r"""llama.cpp's pre-tokenizers of byte-level BPE ("gpt2") vocabularies, by tokenizer.ggml.pre (layer 5).

Before merging, llama.cpp cuts text into pre-tokens with a list of regexes chosen by the
vocabulary's tokenizer.ggml.pre value (src/llama-vocab.cpp, llm_tokenizer_bpe): each regex
in turn splits every piece into its matches and the text between them, and each final piece
is then merged on its own. `BPE_PRE` below is the one table of those values: name ->
regexes and options. tokenizer.py builds a `tokenizers` pipeline from a row (Split
"isolated" per regex, then ByteLevel without its own regex, then BPE).

The regexes are llama.cpp's own strings, run here by Oniguruma (the `tokenizers` regex
engine). llama.cpp runs them three ways: hand-written matchers for the GPT-2, Llama 3 and
Qwen2 regexes, std::regex over a "collapsed" text for regexes with \p{..} classes (every
non-ASCII character replaced by one stand-in byte per Unicode category, non-ASCII
whitespace by \v), and std::wregex over code points for the rest (non-ASCII whitespace
again replaced by \v first). The two engines agree on all of them except where noted:

- NOTE: in the std::wregex regexes, a character class with non-ASCII whitespace in it (the
  ranges ࠀ-一 = U+0800..U+4E00 and 　-。 = U+3000..U+3002 of the DeepSeek regexes) never
  matches that whitespace in llama.cpp, because it was replaced by \v before matching. Here
  those classes are intersected with \S (Oniguruma's `[...&&\S]`), which is the same thing.
  With the raw classes, "。\u3000\u3000。" and "ab \u3000" come out differently from
  llama.cpp (tests/test_tokenize_interop.py has them).
- `$` (end of line in Oniguruma's Ruby syntax, end of input in std::regex) is written `\z`;
  in DeepSeek's regexes newlines are split off first, so the two never differ there.

Both engines know the same Unicode categories: llama.cpp's unicode-data.cpp and the
Oniguruma in `tokenizers` both have Unicode 15.1 (U+2EBF0, a CJK letter new in 15.1, is
\p{L} in both), so \p{L}, \p{N}, \p{P}, \p{S}, \p{M} and \s mean the same; llama.cpp's
collapsed text keeps exactly these categories.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BpePre:
    """How llama.cpp pre-tokenizes one family of tokenizer.ggml.pre values.

    regexes: applied in order; each splits every piece into matches and the gaps between.
    ignore_merges: a pre-token that is itself in the vocabulary becomes that token whole
        (llama.cpp's ignore_merges, `tokenizers`' BPE(ignore_merges=True)).
    add_bos: llama.cpp's add_bos when tokenizer.ggml.add_bos_token is absent.
    space_cut: a single space between two ASCII letters always starts a pre-token, so a text
        may be cut before it (Tokenizer.cut); true of every row but EXAONE MoE's, whose
        letter runs go on across single spaces (tests/test_corpus.py checks each row).
    """
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False
    space_cut: bool = True


_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

# LLAMA_VOCAB_PRE_TYPE_GPT2 (llama.cpp's table has no final |\s+; its matcher does, and a
# split keeps unmatched text as a piece anyway)
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# LLAMA3 (the tokenizer.json regex with (?i:...) spelled out, as llama.cpp writes it)
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
         r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
# Mistral's tekken and GPT-4o: upper/lower case runs, written with lookaheads as llama.cpp
# does (its collapsed text cannot tell \p{Lu} from \p{Ll}: any non-ASCII letter is both)
_UPPER = r"((?=[\p{L}])([^a-z]))"
_LOWER = r"((?=[\p{L}])([^A-Z]))"
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
         rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+")
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+")
MINICPM5 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")
DEEPSEEK3 = (r'''[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+'''
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Regexes with non-ASCII characters are written with \u escapes: editors and tools may
# NFC-normalize literal text, which changes some of these characters (U+1F7D -> U+03CE).
# DeepSeek's CJK and Hangul run [一-龥ࠀ-一가-퟿]+; NOTE its U+0800..U+4E00 range holds
# whitespace (see above)
_DEEPSEEK_CJK = "[[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]&&\\S]+"
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5"
    "\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59"
    "\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc"
    "\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+")
# ASCII and fullwidth punctuation, quotes, 　-。; NOTE U+3000 is the ideographic space
_DEEPSEEK_PUNCT = "\\s?[[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]&&\\S]+"
# CJK ideographs, hiragana, katakana
_DEEPSEEK3_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
# anything up to whitespace or .,!?…。，、।۔، (BLOOM, Poro, Viking)
_POOR_SPLIT = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_LLAMA3 = BpePre((LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2 = BpePre((GPT2,))
_STARCODER = BpePre((r"\p{N}", GPT2))
_QWEN2 = BpePre((QWEN2,))
_DBRX = BpePre((LLAMA3,))
_DEEPSEEK3 = BpePre((r"\p{N}{1,3}", _DEEPSEEK3_CJK, DEEPSEEK3))
_GPT4O = BpePre((GPT4O,))
_BAILINGMOE = BpePre((BAILINGMOE,))
_PORO = BpePre((_POOR_SPLIT,))

# tokenizer.ggml.pre -> how llama.cpp pre-tokenizes; a gpt2 vocabulary without the key is
# "default" (llama.cpp warns, then does the same)
BPE_PRE: dict[str, BpePre] = {
    # LLAMA_VOCAB_PRE_TYPE_DEFAULT
    "default": BpePre((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    # LLAMA3
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "falcon-h1": _LLAMA3, "pixtral": _LLAMA3, "midm-2.0": _LLAMA3, "lfm2": _LLAMA3,
    "jina-v5-nano": _LLAMA3,
    # DBRX, SMAUG: the Llama 3 regex without its options
    "dbrx": _DBRX, "smaug-bpe": _DBRX,
    # JAIS2
    "jais-2": BpePre((JAIS2,)),
    # DEEPSEEK_LLM
    "deepseek-llm": BpePre((r"[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+\z", _DEEPSEEK_CJK,
                            r"\p{N}+")),
    # DEEPSEEK_CODER
    "deepseek-coder": BpePre((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")),
    # DEEPSEEK3_LLM, HUNYUAN_DENSE, JOYAI_LLM, HY_V4
    "deepseek-v3": _DEEPSEEK3, "hunyuan-dense": _DEEPSEEK3, "joyai-llm": _DEEPSEEK3,
    "hy_v4": _DEEPSEEK3,
    # FALCON
    "falcon": BpePre((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]")),
    # STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2: digits alone
    "starcoder": _STARCODER, "refact": _STARCODER, "command-r": _STARCODER,
    "smollm": _STARCODER, "codeshell": _STARCODER, "exaone": _STARCODER,
    "minerva-7b": _STARCODER, "mellum2": _STARCODER,
    # GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING
    "gpt-2": _GPT2, "phi-2": _GPT2, "jina-es": _GPT2, "jina-de": _GPT2, "gigachat": _GPT2,
    "jina-v2-es": _GPT2, "jina-v2-de": _GPT2, "a.x-4.0": _GPT2, "mellum": _GPT2,
    "modern-bert": _GPT2, "exaone4": _GPT2, "mpt": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "trillion": _GPT2, "granite-docling": _GPT2,
    # QWEN2, STABLELM2, HUNYUAN, SOLAR_OPEN, GROK_2 (the same regex)
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "kormo": _QWEN2, "f2llmv2": _QWEN2,
    "megrez": _QWEN2, "stablelm2": _QWEN2, "hunyuan": _QWEN2, "solar-open": _QWEN2,
    "grok-2": _QWEN2,
    # QWEN35: letters take their combining marks along
    "qwen35": BpePre((QWEN35,)),
    # PORO, BLOOM, GPT3_FINNISH; VIKING
    "poro-chat": _PORO, "bloom": _PORO, "gpt3-finnish": _PORO,
    "viking": BpePre((_POOR_SPLIT, r"\p{N}")),
    # TEKKEN
    "tekken": BpePre((TEKKEN,), ignore_merges=True, add_bos=True),
    # GPT4O, MINIMAX_M2
    "gpt-4o": _GPT4O, "llama4": _GPT4O, "kanana2": _GPT4O, "talkie": _GPT4O, "minimax-m2": _GPT4O,
    # MINICPM5
    "minicpm5": BpePre((r"\p{N}{1,3}", MINICPM5), ignore_merges=True),
    # SEED_CODER, BAILINGMOE, UFAKZEKA, EXAONE_MOE
    "seed-coder": BpePre((SEED_CODER,)),
    "bailingmoe": _BAILINGMOE, "bailingmoe2": _BAILINGMOE, "llada-moe": _BAILINGMOE,
    "ufakzeka": BpePre((UFAKZEKA,)),
    "exaone-moe": BpePre((EXAONE_MOE,), space_cut=False),
    # LAGUNA: lines and newline runs first, then Qwen2's regex
    "laguna": BpePre((r"[^\n]+|[\n]+", QWEN2)),
}
