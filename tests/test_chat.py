"""Chat templates: rendered as Hugging Face's apply_chat_template renders them.

Oracles: the expected text of real conversations (../shared/data/chat/dummy_conversation.json)
under each real template in ../shared/data/templates and SmolLM2's own, written here by
reading each template; llama.cpp's own HF-style renderer (llama-cpp-python's
Jinja2ChatFormatter: the same jinja2 settings and helpers as transformers) on every template;
and the rendering rules of transformers' environment (trim_blocks, lstrip_blocks, loop
controls, raise_exception, tojson, strftime_now, the sandbox), each checked on a small template.
"""
import json
from datetime import datetime

import pytest

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.chat import ChatTemplate, chat_template, read_template

SMOLLM = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant."
TEMPLATES = ["Qwen-Qwen2.5-7B-Instruct", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
             "google-gemma-2-2b-it", "meta-llama-Llama-3.1-8B-Instruct",
             "microsoft-Phi-3.5-mini-instruct", "mistralai-Mistral-Nemo-Instruct-2407"]


def conversations(data, n=12):
    """The first n dummy conversations as messages (1 to 3 exchanges), and each with a system
    message first."""
    raw = json.loads((data / "chat" / "dummy_conversation.json").read_text())[:n]
    roles = {"human": "user", "gpt": "assistant"}
    plain = [[{"role": roles[t["from"]], "content": t["value"]} for t in r["conversations"]]
             for r in raw]
    assert {len(c) for c in plain} == {2, 4, 6}
    return plain, [[{"role": "system", "content": SYSTEM}] + c for c in plain]


# ---- expected renderings, written from reading each template ----------------------------------

def chatml(msgs, gen, default_system):
    """SmolLM2's and Qwen2.5's template (no tools): a default system turn when the first
    message is not a system one, each message as <|im_start|>role\\ncontent<|im_end|>\\n."""
    out = "" if msgs[0]["role"] == "system" else f"<|im_start|>system\n{default_system}<|im_end|>\n"
    out += "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs)
    return out + ("<|im_start|>assistant\n" if gen else "")


def llama31(msgs, gen):
    """Llama 3.1: BOS, a system header with the knowledge and fixed date lines, then the
    system message (trimmed) and each message with its header; contents trimmed."""
    system = msgs[0]["content"].strip() if msgs[0]["role"] == "system" else ""
    rest = msgs[1:] if msgs[0]["role"] == "system" else msgs
    out = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
           "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"
           f"{system}<|eot_id|>")
    out += "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                   for m in rest)
    return out + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if gen else "")


def gemma2(msgs, gen):
    """Gemma 2: BOS, each turn as <start_of_turn>user|model\\ncontent<end_of_turn>\\n."""
    out = "<bos>" + "".join(
        f"<start_of_turn>{'model' if m['role'] == 'assistant' else m['role']}\n"
        f"{m['content'].strip()}<end_of_turn>\n" for m in msgs)
    return out + ("<start_of_turn>model\n" if gen else "")


def phi35(msgs, gen):
    """Phi-3.5-mini: <|role|>\\ncontent<|end|>\\n per message; then the assistant header with
    a generation prompt, else eos_token."""
    out = "".join(f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in msgs)
    return out + ("<|assistant|>\n" if gen else "<|endoftext|>")


def mistral_nemo(msgs, gen):
    """Mistral Nemo without a system message: BOS, [INST]user[/INST], assistant + EOS."""
    return "<s>" + "".join(f"[INST]{m['content']}[/INST]" if m["role"] == "user" else m["content"] + "</s>"
                           for m in msgs)


def deepseek_r1(msgs, gen):
    """DeepSeek R1 distill: BOS and the system text, <｜User｜>content, <｜Assistant｜>content
    <｜end▁of▁sentence｜>; the generation prompt opens a think block."""
    out = "<｜begin▁of▁sentence｜>" + "".join(m["content"] for m in msgs if m["role"] == "system")
    for m in msgs:
        if m["role"] == "user":
            out += "<｜User｜>" + m["content"]
        elif m["role"] == "assistant":
            out += "<｜Assistant｜>" + m["content"] + "<｜end▁of▁sentence｜>"
    return out + ("<｜Assistant｜><think>\n" if gen else "")


# template name -> (bos_token, eos_token, expected(msgs, gen), takes a system message)
EXPECTED = {
    "Qwen-Qwen2.5-7B-Instruct": ("", "<|im_end|>", lambda m, g: chatml(
        m, g, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."), True),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|end_of_text|>", llama31, True),
    "google-gemma-2-2b-it": ("<bos>", "<eos>", gemma2, False),
    "microsoft-Phi-3.5-mini-instruct": ("<s>", "<|endoftext|>", phi35, True),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>", mistral_nemo, False),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                                                 deepseek_r1, True),
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_render_as_written(shared_data, name):
    bos, eos, expected, takes_system = EXPECTED[name]
    path = shared_data / "templates" / f"{name}.jinja"
    t = ChatTemplate(path.read_text(), bos, eos, name=str(path))
    plain, with_system = conversations(shared_data)
    for msgs in plain + (with_system if takes_system else []):
        for gen in (False, True):
            assert t.render(msgs, add_generation_prompt=gen) == expected(msgs, gen)


def test_smollm2_template_from_its_gguf(shared_data):
    t = chat_template(shared_data / SMOLLM)
    assert (t.bos_token, t.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert t.name.endswith("SmolLM2-135M-Instruct.Q4_1.gguf tokenizer.chat_template")
    plain, with_system = conversations(shared_data)
    for msgs in plain + with_system:
        for gen in (False, True):
            assert t.render(msgs, gen) == chatml(
                msgs, gen, "You are a helpful AI assistant named SmolLM, trained by Hugging Face")


@pytest.mark.parametrize("name", TEMPLATES + ["SmolLM2"])
def test_templates_render_as_llama_cpp_renders_them(shared_data, llama, name):
    """llama-cpp-python's Jinja2ChatFormatter renders HF templates with transformers' settings."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter
    if name == "SmolLM2":
        t = chat_template(shared_data / SMOLLM)
    else:
        bos, eos, _, _ = EXPECTED[name]
        path = shared_data / "templates" / f"{name}.jinja"
        t = ChatTemplate(path.read_text(), bos, eos, name=str(path))
    formatters = {gen: Jinja2ChatFormatter(t.source, t.eos_token, t.bos_token, add_generation_prompt=gen)
                  for gen in (False, True)}
    plain, with_system = conversations(shared_data)
    for msgs in plain + with_system:
        for gen in (False, True):
            theirs = formatters[gen]
            if name == "google-gemma-2-2b-it" and msgs[0]["role"] == "system":
                with pytest.raises(ValueError, match="System role not supported"):
                    theirs(messages=msgs)
                with pytest.raises(FormatError, match="System role not supported"):
                    t.render(msgs, gen)
                continue
            assert t.render(msgs, gen) == theirs(messages=msgs).prompt


# ---- transformers' environment, rule by rule ------------------------------------------------

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def render(source, msgs=MSGS, **kw):
    return ChatTemplate(source, "<s>", "</s>", name="t.jinja").render(msgs, **kw)


def test_trim_blocks_and_lstrip_blocks():
    # lstrip_blocks: spaces before a block tag on its line go; trim_blocks: the newline after it
    assert render("  {% if true %}\nA\n  {% endif %}\nB") == "A\nB"
    # neither applies to expressions
    assert render("  {{ 'x' }}\ny") == "  x\ny"


def test_loop_controls():
    src = "{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    assert render(src) == "user"
    src = "{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"
    assert render(src) == "hello"


def test_tojson_is_json_dumps_not_html_safe():
    # jinja's own tojson escapes <, >, &, ' and non-ASCII; transformers' is json.dumps
    obj = {"b": "é <tag> & 'q'", "a": [1, 2]}
    assert render("{{ x | tojson }}".replace("x", json.dumps(obj))) == json.dumps(obj, ensure_ascii=False)
    assert (render("{{ x | tojson(indent=2) }}".replace("x", json.dumps(obj)))
            == json.dumps(obj, ensure_ascii=False, indent=2))
    assert render("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}") == '{"a": 2, "b": 1}'


def test_variables():
    assert render("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}") == "<s>|</s>|False"
    assert render("{{ add_generation_prompt }}", add_generation_prompt=True) == "True"
    # tools and documents are defined and none (transformers passes tools=None, documents=None)
    assert render("{{ tools is defined }} {{ tools is none }} {{ documents is none }}") == "True True True"
    assert render("{% if not tools %}no tools{% endif %}") == "no tools"


def test_strftime_now_and_generation_tag():
    assert render("{{ strftime_now('%Y') }}") == datetime.now().strftime("%Y")
    src = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render(src) == "[hi][hello]"


def test_raise_exception_message_is_the_error():
    src = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('roles must alternate') }}{% endif %}{% endfor %}")
    assert render(src) == ""
    with pytest.raises(FormatError, match=r"^t\.jinja: roles must alternate$"):
        render(src, msgs=MSGS[::-1])


def test_sandbox_is_immutable():
    with pytest.raises(FormatError, match="t.jinja line 1: rendering the chat template failed: SecurityError"):
        render("{{ messages.append(1) }}")
    with pytest.raises(FormatError, match="SecurityError"):
        render("{{ ''.__class__.__mro__ }}{{ messages.__class__.__subclasses__() }}")


def test_render_errors_name_the_template_line():
    with pytest.raises(FormatError, match=r"^t\.jinja line 2: rendering the chat template failed: "
                                          r"TypeError: can only concatenate str"):
        render("ok\n{{ messages[0].content + 1 }}")
    with pytest.raises(FormatError, match=r"^t\.jinja line 3: .*UndefinedError: list object has no element 7"):
        render("a\nb\n{{ messages[7]['role'].x }}")


def test_compile_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(FormatError, match=r"^t\.jinja line 2: the chat template does not compile: "):
        ChatTemplate("fine\n{% if %}", name="t.jinja")
    with pytest.raises(FormatError, match="does not compile: Encountered unknown tag 'endfor'"):
        ChatTemplate("{% endfor %}", name="t.jinja")


# ---- where the template comes from -----------------------------------------------------------

def test_override_file_wins_and_keeps_the_model_tokens(shared_data, tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}")
    t = chat_template(shared_data / SMOLLM, path)
    assert t.name == str(path)
    assert t.render(MSGS) == "<|im_start|>hihello<|im_end|>"
    assert read_template(path) == path.read_text()


def test_missing_template_is_an_error_naming_the_file(shared_data, tmp_path):
    model = shared_data / "gguf" / "stories260K.gguf"
    with pytest.raises(FormatError, match=r"stories260K\.gguf: the model has no chat template \(tokenizer\.chat_template\).*--chat-template"):
        chat_template(model)
    with pytest.raises(ConfigError, match=r"--chat-template .*nope\.jinja: no such file"):
        chat_template(model, tmp_path / "nope.jinja")
    # a template file fixes it; stories260K's <s> and </s> are its tokens
    path = tmp_path / "t.jinja"
    path.write_text("{{ bos_token }}{{ messages[0].content }}{{ eos_token }}")
    assert chat_template(model, path).render(MSGS) == "<s>hi</s>"


def test_bad_template_files(tmp_path):
    empty = tmp_path / "empty.jinja"
    empty.write_text(" \n")
    with pytest.raises(FormatError, match=r"empty\.jinja: the chat template is empty"):
        chat_template(None, empty)
    latin = tmp_path / "latin.jinja"
    latin.write_bytes(b"ok\n{{ 'caf\xe9' }}")
    with pytest.raises(FormatError, match=r"latin\.jinja line 2: the chat template is not UTF-8 \(byte 0xe9\)"):
        chat_template(None, latin)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m.content }}\n")
    with pytest.raises(FormatError, match=r"broken\.jinja line 2: the chat template does not compile"):
        chat_template(None, broken)
