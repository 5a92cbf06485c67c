"""`ggtrain tokenize --model FILE.gguf (--text TEXT | --file PATH) [--json] [--bos] [--special]` (layer 6).

The token ids llama.cpp gives for a text, with the vocabulary of any GGUF that holds one
(vocab-only files too): llama_tokenize(text, add_special=--bos, parse_special=--special).
Prints the ids space-separated on one line, or with --json one object {"ids": [...]}.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ggtrain.cli.common import file_errors
from ggtrain.cli.main import app
from ggtrain.errors import ConfigError
from ggtrain.formats.datafile import read_utf8
from ggtrain.formats.tokenizer import tokenizer_from_gguf

_HELP = (
    "Print the token ids llama.cpp gives for a text, with the vocabulary of a GGUF file.\n\n"
    "Any GGUF with a tokenizer (tokenizer.ggml.*) works, vocabulary-only files too: SPM "
    "(\"llama\") vocabularies, and byte-level BPE (\"gpt2\") ones with the pre-tokenizers "
    "llama.cpp runs as regexes (llama-bpe, smollm, qwen2, deepseek-*, falcon, starcoder, "
    "tekken, gpt-2, ...).\n\n"
    "As llama.cpp does by default, special-token text such as \"<|im_start|>\" is plain "
    "text unless --special is given. No BOS is added unless --bos is given."
)

def _read_text(file: Path) -> str:
    with file_errors(f"--file {file}", "text file"):
        return read_utf8(file)


@app.command("tokenize", rich_help_panel="Files", help=_HELP)
def tokenize_command(
    model: Path = typer.Option(..., "--model", show_default=False,
                               help="A GGUF file with a tokenizer vocabulary (a model or vocab-only file)."),
    text: Optional[str] = typer.Option(None, "--text", show_default=False,
                                       help="The text to tokenize."),
    file: Optional[Path] = typer.Option(None, "--file", show_default=False,
                                        help="Tokenize this UTF-8 text file, byte for byte (final newline "
                                             "included); a binary file is an error."),
    as_json: bool = typer.Option(False, "--json", help='Print one JSON object {"ids": [...]}.'),
    bos: bool = typer.Option(False, "--bos",
                             help="Add the special tokens the vocabulary asks for, as llama.cpp's "
                                  "add_special does: BOS if tokenizer.ggml.add_bos_token (EOS too if "
                                  "add_eos_token). A vocabulary that does not ask gets none."),
    special: bool = typer.Option(False, "--special",
                                 help='Parse special tokens written in the text ("<|im_start|>" -> '
                                      'its id); without it they are plain text.'),
):
    if (text is None) == (file is None):
        raise ConfigError("give exactly one of --text and --file")
    if file is not None:
        text = _read_text(file)
    if not model.exists():
        raise ConfigError(f"--model {model}: no such file")
    if model.is_dir():
        raise ConfigError(f"--model {model}: is a directory, not a GGUF file")
    tok = tokenizer_from_gguf(model)
    ids = tok.tokenize(text, add_special=bos, parse_special=special).tolist()
    if as_json:
        typer.echo(json.dumps({"ids": ids}))
    else:
        typer.echo(" ".join(map(str, ids)))
