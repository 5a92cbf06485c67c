"""Chat templates (layer 5): Jinja templates rendered exactly as Hugging Face renders them.

A model's chat template (the GGUF key tokenizer.chat_template, or a --chat-template
FILE.jinja) turns a conversation, a list of {"role", "content"} messages, into the text the
model was trained on. transformers' apply_chat_template compiles it in a jinja2 (>= 3.1)
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loop-controls
extension ({% break %}, {% continue %}) and its {% generation %} tag (rendered as its body
here), and gives it:

    raise_exception(msg)   fails the rendering with msg (e.g. "roles must alternate")
    strftime_now(format)   the local time, formatted
    |tojson                json.dumps with ensure_ascii=False (and indent, separators,
                           sort_keys options), not jinja's HTML-safe tojson

and renders it with messages, tools=None, documents=None, add_generation_prompt and the
tokenizer's special tokens as variables (here bos_token and eos_token, the texts of the
vocabulary's BOS and EOS tokens). `ChatTemplate.render` does the same.
"""
from __future__ import annotations

import hashlib
import json
import os
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.gguf import GGUFFile, read_gguf

TEMPLATE_KEY = "tokenizer.chat_template"


class _TemplateRaised(jinja2.TemplateError):
    """What raise_exception() raises: the template's own message about its input."""


class _Generation(jinja2.ext.Extension):
    """{% generation %} ... {% endgeneration %}: transformers marks assistant text with it;
    rendering it gives its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template.

    source: the Jinja text; bos_token, eos_token: the texts the template sees as those
    variables; name: what error messages call it (a file name, or "MODEL.gguf
    tokenizer.chat_template"). Raises FormatError when the template does not compile.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 name: str = "chat template"):
        if not isinstance(source, str):
            raise TypeError(f"a chat template is a str, not {type(source).__name__}")
        self.source, self.bos_token, self.eos_token, self.name = source, bos_token, eos_token, name
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise FormatError(f"{name} line {e.lineno}: the chat template does not compile: "
                              f"{_one_line(e.message)}") from None

    def __repr__(self) -> str:
        return f"ChatTemplate({self.name!r}, bos_token={self.bos_token!r}, eos_token={self.eos_token!r})"

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The text of the conversation `messages`, as transformers' apply_chat_template gives it.

        Raises FormatError naming the template when rendering fails: the template's own
        raise_exception message, or what went wrong and on which template line.
        """
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=bool(add_generation_prompt),
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except _TemplateRaised as e:
            raise FormatError(f"{self.name}: {_one_line(e.message)}") from None
        except Exception as e:                   # UndefinedError, TypeError, ... in the template
            line = _template_line(e.__traceback__)
            where = f"{self.name} line {line}" if line else self.name
            raise FormatError(f"{where}: rendering the chat template failed: "
                              f"{type(e).__name__}: {_one_line(str(e))}") from None


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _template_line(tb) -> int | None:
    """The template line of the innermost template frame of a traceback (jinja2 rewrites
    tracebacks so template code shows as frames of the file "<template>")."""
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def read_template(path) -> str:
    """The text of a --chat-template FILE.jinja.

    Raises ConfigError when the file does not exist, FormatError when it is empty or not UTF-8.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--chat-template {path}: no such file") from None
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        source = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise FormatError(f"{path} line {line}: the chat template is not UTF-8 "
                          f"(byte 0x{raw[e.start]:02x})") from None
    if not source.strip():
        raise FormatError(f"{path}: the chat template is empty")
    return source


def special_token_text(f: GGUFFile, role: str) -> str:
    """The text of a GGUF vocabulary's tokenizer.ggml.<role>_token_id token ("" without one)."""
    i = f.value(f"tokenizer.ggml.{role}_token_id", None)
    tokens = f.value("tokenizer.ggml.tokens", None)
    if isinstance(i, bool) or not isinstance(i, int) or tokens is None or not 0 <= i < len(tokens):
        return ""
    return str(tokens[i])


def template_id(gguf_file: GGUFFile, override_path: str | os.PathLike | None = None) -> str:
    """sha256 of what `chat_template(gguf_file, override_path)` would render with (its source,
    BOS and EOS texts), "" where there is no template: part of the key of cached samples."""
    source = read_template(override_path) if override_path is not None else gguf_file.value(TEMPLATE_KEY, None)
    if not isinstance(source, str):
        return ""
    parts = [source, special_token_text(gguf_file, "bos"), special_token_text(gguf_file, "eos")]
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).hexdigest()


def chat_template(gguf_file: GGUFFile | str | os.PathLike | None,
                  override_path: str | os.PathLike | None = None) -> ChatTemplate:
    """The chat template to fine-tune a model with: the --chat-template file when given,
    else the GGUF's tokenizer.chat_template; bos_token and eos_token are the texts of the
    GGUF vocabulary's BOS and EOS tokens ("" when it has none).

    Raises FormatError naming the file when the GGUF has no template (and none was
    given), or the template does not compile; ConfigError when override_path is missing.
    """
    f = None
    if gguf_file is not None:
        f = gguf_file if isinstance(gguf_file, GGUFFile) else read_gguf(gguf_file)
    bos = special_token_text(f, "bos") if f is not None else ""
    eos = special_token_text(f, "eos") if f is not None else ""
    if override_path is not None:
        return ChatTemplate(read_template(override_path), bos, eos, name=os.fspath(override_path))
    if f is None:
        raise ConfigError("no chat template: give a model or --chat-template FILE.jinja")
    source = f.value(TEMPLATE_KEY, None)
    if source is None:
        raise FormatError(f"{f.path}: the model has no chat template ({TEMPLATE_KEY}); "
                          f"give one with --chat-template FILE.jinja")
    if not isinstance(source, str) or not source.strip():
        raise FormatError(f"{f.path}: {TEMPLATE_KEY} is not a template (an empty string or "
                          f"not a string); give one with --chat-template FILE.jinja")
    return ChatTemplate(source, bos, eos, name=f"{f.path} {TEMPLATE_KEY}")
