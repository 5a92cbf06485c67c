"""Training data files and the token samples made from them (formats/dataset.py).

Oracles: the files' own contents (records read back as written); exact one-line error
messages for malformed input; for samples, the tokenizer (tested against llama.cpp in
test_tokenizer.py) and the text: the trained tokens of a chat sample spell exactly each
assistant turn's content followed by its end-of-turn token, checked through the tokens'
places in the rendered text and through their decoded bytes, on every shared template with a
vocabulary holding its special tokens where one exists (SmolLM2: ChatML; qwen2: Qwen2.5;
llama-bpe: Llama 3.1; phi-3: Phi-3.5 and phi-3's own; deepseek-llm: DeepSeek R1 distill's
BOS/EOS; llama-spm: Mistral Nemo's <s>/</s>) and with the byte vocabulary on every template
(Gemma 2 has no shared vocabulary: byte only).
"""
import json

import numpy as np
import pytest

from ggtrain.errors import ConfigError, FormatError
from ggtrain.formats.chat import ChatTemplate, chat_template
from ggtrain.formats.dataset import read_data, samples, token_offsets
from ggtrain.formats.tokenizer import ByteTokenizer, tokenizer_from_gguf

SMOLLM = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant."
_TOKENIZERS = {}


def tokenizer(data, vocab):
    """One tokenizer per vocabulary per session ("byte", or a path under ../shared/data)."""
    if vocab not in _TOKENIZERS:
        _TOKENIZERS[vocab] = ByteTokenizer() if vocab == "byte" else tokenizer_from_gguf(data / vocab)
    return _TOKENIZERS[vocab]


def write(tmp_path, name, content):
    path = tmp_path / name
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    return path


# ---- reading files ------------------------------------------------------------------------

def test_kinds_by_extension_and_content(tmp_path):
    d = read_data(write(tmp_path, "a.jsonl", '{"text": "hi", "id": 1}\n\n{"text": "yo"}\n'))
    assert (d.kind, d.layout, d.records) == ("text", "text", ["hi", "yo"])
    assert d.where == [f"{tmp_path}/a.jsonl line 1", f"{tmp_path}/a.jsonl line 3"]
    d = read_data(write(tmp_path, "b.json", json.dumps([{"prompt": "p", "completion": "c"}] * 2)))
    assert (d.kind, d.records, d.where[1]) == ("prompt_completion", [("p", "c")] * 2, f"{tmp_path}/b.json record 1")
    # JSON lines and arrays by their first character, whatever the extension
    assert read_data(write(tmp_path, "c.data", '\ufeff {"text": "x"}\n')).records == ["x"]
    assert read_data(write(tmp_path, "d", '\n[{"text": "x"}]')).records == ["x"]
    assert read_data(write(tmp_path, "e.json", '{"text": "x"}')).kind == "text"
    # plain text: .txt always, other files that are not JSON
    d = read_data(write(tmp_path, "f.txt", '{"text": "café"}\n'))
    assert (d.kind, d.text) == ("plain", '{"text": "café"}\n')
    assert read_data(write(tmp_path, "g.md", "# notes\n")).text == "# notes\n"
    # records become samples, plain text does not (it is cut into token windows)
    s, = read_data(write(tmp_path, "h.jsonl", '{"text": "ab"}\n')).samples(ByteTokenizer())
    np.testing.assert_array_equal(s.ids, [1, 3 + ord("a"), 3 + ord("b"), 2])
    with pytest.raises(ConfigError, match=r"f\.txt: plain text is cut into token windows"):
        read_data(tmp_path / "f.txt").samples(ByteTokenizer())


def test_alpaca_and_dolly_records(tmp_path):
    """An absent, null or empty input is none; Dolly's context is Alpaca's input; other fields
    (Dolly's category) are ignored."""
    d = read_data(write(tmp_path, "a.jsonl", "\n".join(json.dumps(r) for r in [
        {"instruction": "Add.", "input": "2 3", "output": "5"}, {"instruction": "Hi.", "output": "Hello."},
        {"instruction": "Hi.", "input": None, "output": "Hey."}, {"instruction": "Hi.", "input": "", "output": ""}])))
    assert (d.kind, d.layout) == ("instruction", "alpaca")
    assert d.records == [("Add.", "2 3", "5"), ("Hi.", "", "Hello."), ("Hi.", "", "Hey."), ("Hi.", "", "")]
    d = read_data(write(tmp_path, "d.json", json.dumps([
        {"instruction": "Sum up.", "context": "A long text.", "response": "Short.", "category": "summarization"},
        {"instruction": "Why?", "response": "Because."}])))
    assert (d.kind, d.layout, d.where[1]) == ("instruction", "dolly", f"{tmp_path}/d.json record 1")
    assert d.records == [("Sum up.", "A long text.", "Short."), ("Why?", "", "Because.")]


def test_sharegpt_and_openai_give_the_same_conversations(shared_data, tmp_path):
    d = read_data(shared_data / "chat" / "dummy_conversation.json")
    assert (d.kind, d.layout, len(d.records)) == ("chat", "conversations", 500)
    assert d.records[0][:2] == [
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "I am Vicuna, a language model trained by researchers "
                                         "from Large Model Systems Organization (LMSYS)."}]
    assert d.where[12].endswith("dummy_conversation.json record 12")
    raw = json.loads((shared_data / "chat" / "dummy_conversation.json").read_text())
    roles = {"human": "user", "gpt": "assistant"}
    lines = [json.dumps({"messages": [{"role": roles[t["from"]], "content": t["value"]}
                                      for t in r["conversations"]]}) for r in raw]
    o = read_data(write(tmp_path, "chat.jsonl", "\n".join(lines) + "\n"))
    assert (o.kind, o.layout, o.records) == ("chat", "messages", d.records)


BAD = [
    ("b.jsonl", '{"prompt": "a", "completion": "b"}\n' * 6 + '{"prompt": "x"}\n',
     r'b\.jsonl line 7: record has no "completion" field$'),
    ("c.json", json.dumps([{"conversations": [{"from": "human", "value": "x"}]}] * 12
                          + [{"conversations": [{"from": "human", "value": "x"}] * 3 + [{"from": "bot", "value": "x"}]}]),
     r"c\.json record 12: conversations\[3\]\.from is 'bot' \(expected human, user, gpt, chatgpt, "
     r"assistant, system or tool\)$"),
    ("d.jsonl", '{"text": "hi"}\n{"prompt": "a", "completion": "b"}\n',
     r'd\.jsonl line 2: a \{"prompt", "completion"\} record, but the first record '
     r'\(.*d\.jsonl line 1\) is \{"text"\}: a file, or a folder of them, holds one layout$'),
    ("e.jsonl", '{"text": "hi"}\n{"text": "a", \n',
     r"e\.jsonl line 2 column 15: invalid JSON \(Expecting property name enclosed in double quotes\); "
     r"JSON lines hold one whole record per line$"),
    ("f.json", '[{"text": "hi"},\n {"text" "a"}]', r"f\.json line 2 column 10: invalid JSON \(Expecting ':' delimiter\)$"),
    ("g.jsonl", b'{"text": "hi"}\n{"text": "a\xff"}\n', r"g\.jsonl line 2 column 12: not UTF-8 \(byte 0xff\)$"),
    ("h.jsonl", "  \n", r"h\.jsonl: the file is empty$"),
    ("h.txt", "", r"h\.txt: the file is empty$"),
    ("i.json", "[]", r"i\.json: the JSON array holds no records$"),
    ("j.jsonl", "[1]\n", r"j\.jsonl line 1: the record is an array \(expected a JSON object\)$"),
    ("j.json", "[1, 2]", r"j\.json record 0: the record is a number \(1\) \(expected a JSON object\)$"),
    ("k.jsonl", '{"messages": [{"role": "user", "content": null}]}\n',
     r"k\.jsonl line 1: messages\[0\]\.content is null \(expected a string\)$"),
    ("l.jsonl", '{"messages": [{"role": "bot", "content": "x"}]}\n',
     r"l\.jsonl line 1: messages\[0\]\.role is 'bot' \(expected system, user, assistant or tool\)$"),
    ("m.jsonl", '{"text": "\\ud800x"}\n', r'm\.jsonl line 1: "text" holds a lone surrogate \\ud800 at character 0'),
    ("n.jsonl", '{"foo": 1, "bar": 2}\n', r'n\.jsonl line 1: the record\'s fields \("foo", "bar"\) are of no layout '
     r'ggtrain reads \(known: \{"prompt", "chosen", "rejected"\}; .*\{"instruction", "input", "output"\} \(Alpaca\); '
     r'\{"prompt", "completion"\}; \{"text"\}\)$'),
    ("q.json", "hello\n", r"q\.json: not JSON lines or a JSON array of records \(it starts with 'h'\)$"),
    ("s.jsonl", '{"messages": []}\n', r"s\.jsonl line 1: messages is empty$"),
    ("t.jsonl", '{"messages": "hi"}\n',
     r'messages is a string \(expected an array of \{"role", "content"\} objects\)$'),
    ("u.jsonl", '{"messages": [{"content": "x"}]}\n', r'u\.jsonl line 1: messages\[0\] has no "role" field$'),
    ("v.jsonl", '{"conversations": [{"from": "gpt"}]}\n', r'v\.jsonl line 1: conversations\[0\] has no "value" field$'),
    ("w.jsonl", '{"prompt": 3, "completion": "x"}\n', r'w\.jsonl line 1: "prompt" is a number \(3\) \(expected a string\)$'),
    ("x.jsonl", '{"instruction": "a", "output": "b"}\n{"instruction": "a", "input": "b"}\n',
     r'x\.jsonl line 2: record has no "output" field$'),
    ("y.json", '[{"instruction": "a", "input": 3, "output": "b"}]',
     r'y\.json record 0: "input" is a number \(3\) \(expected a string\)$'),
    ("z.jsonl", '{"instruction": "a", "context": "", "response": "b"}\n{"instruction": "a", "output": "b"}\n',
     r'z\.jsonl line 2: a \{"instruction", "input", "output"\} \(Alpaca\) record, but the first record \(.*z\.jsonl line 1\) '
     r'is \{"instruction", "context", "response"\} \(Dolly\): a file, or a folder of them, holds one layout$'),
    ("za.jsonl", '{"context": "c", "response": "b"}\n', r'za\.jsonl line 1: record has no "instruction" field$'),
]


@pytest.mark.parametrize("name, content, message", BAD, ids=[b[0] for b in BAD])
def test_malformed_files_are_one_line_errors(tmp_path, name, content, message):
    with pytest.raises(FormatError, match=message) as e:
        read_data(write(tmp_path, name, content))
    assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path))


# ---- text and prompt/completion samples ---------------------------------------------------------

@pytest.mark.parametrize("vocab", ["gguf/ggml-vocab-llama-spm.gguf", SMOLLM])
def test_text_samples(shared_data, vocab):
    tok = tokenizer(shared_data, vocab)
    text = "Hello world.\nA second line."
    s, = samples([text], "text", tok)
    body = tok.encode(text)
    if tok.add_bos:                                   # llama-spm adds BOS, SmolLM2 does not
        np.testing.assert_array_equal(s.ids, np.r_[tok.bos_id, body, tok.eos_id])
        np.testing.assert_array_equal(s.train, [False] + [True] * (len(body) + 1))
    else:
        np.testing.assert_array_equal(s.ids, np.r_[body, tok.eos_id])
        assert s.train.all()
    assert s.ids.dtype == np.int32 and s.train.dtype == bool


PAIRS = [("The capital of France is", " Paris."), ("Q: 2+2?\nA:", " 4"),
         ("Übersetze: cat\n", "Katze"), ("", "only a completion"), ("no completion", "")]


@pytest.mark.parametrize("vocab", ["gguf/ggml-vocab-llama-spm.gguf", SMOLLM, "byte"])
def test_prompt_completion_samples(shared_data, vocab):
    tok = tokenizer(shared_data, vocab)
    for (prompt, completion), s in zip(PAIRS, samples(PAIRS, "prompt_completion", tok)):
        lead = int(tok.add_bos)
        np.testing.assert_array_equal(s.ids[lead:-1], tok.encode(prompt + completion))
        assert s.ids[-1] == tok.eos_id and s.train[-1]
        assert not s.train[:lead].any()
        # the trained tokens are the completion's (an SPM vocabulary spells a space before
        # the text that the text does not have: "▁Paris" is " Paris")
        body = s.ids[lead:-1]
        got = tok.decode_bytes(body[s.train[lead:-1]]).decode()
        spm_space = tok.kind == "spm" and tok.add_space_prefix and not prompt
        assert got == (" " if spm_space else "") + completion
        # the tokens before it are the prompt's
        n_prompt = len(tok.encode(prompt)) if prompt else 0
        assert not s.train[:lead + n_prompt].any() and s.train[lead + n_prompt:].all()
    every = samples(PAIRS, "prompt_completion", tok, train_on_inputs=True)
    for s in every:
        assert s.train[int(tok.add_bos):].all() and not s.train[:int(tok.add_bos)].any()


# Stanford Alpaca's prompts (train.py, PROMPT_DICT), written out here as the reference
ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                "{instruction}\n\n### Input:\n{input}\n\n### Response:")
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                   "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:")
INSTRUCTIONS = [("Name a color.", "", "Blue."), ("Add the numbers.", "2 and 3", "They add up to 5."),
                ("Übersetze ins Englische.", "Katze", "Cat"), ("Say nothing.", "", "")]


@pytest.mark.parametrize("vocab", ["gguf/ggml-vocab-llama-spm.gguf", SMOLLM, "byte"])
def test_instruction_samples_without_a_template_are_alpacas_prompt_with_the_output_trained(shared_data, vocab):
    tok = tokenizer(shared_data, vocab)
    for rec, s in zip(INSTRUCTIONS, samples(INSTRUCTIONS, "instruction", tok)):
        instruction, given, output = rec
        prompt = (ALPACA_INPUT if given else ALPACA_NO_INPUT).format(instruction=instruction, input=given)
        lead = int(tok.add_bos)
        body = tok.encode(prompt + output)
        np.testing.assert_array_equal(s.ids, np.r_[[tok.bos_id] * lead, body, tok.eos_id])
        # trained: the output's tokens and EOS, nothing of the prompt
        n_prompt = len(tok.encode(prompt))
        assert not s.train[:lead + n_prompt].any() and s.train[lead + n_prompt:].all()
        assert tok.decode_bytes(s.ids[s.train][:-1]).decode() == output and s.ids[s.train][-1] == tok.eos_id
    # with train_on_inputs, every token but BOS
    every = samples(INSTRUCTIONS, "instruction", tok, train_on_inputs=True)
    for a, b in zip(samples(INSTRUCTIONS, "instruction", tok), every):
        np.testing.assert_array_equal(a.ids, b.ids)
        assert b.train[int(tok.add_bos):].all()


INSTRUCTION_CHAT = [("SmolLM2", SMOLLM, "<|im_end|>"),
                    ("meta-llama-Llama-3.1-8B-Instruct", "gguf/ggml-vocab-llama-bpe.gguf", "<|eot_id|>"),
                    ("mistralai-Mistral-Nemo-Instruct-2407", "gguf/ggml-vocab-llama-spm.gguf", "</s>"),
                    ("google-gemma-2-2b-it", "byte", "<end_of_turn>")]


@pytest.mark.parametrize("name, vocab, eot", INSTRUCTION_CHAT, ids=[c[0] for c in INSTRUCTION_CHAT])
def test_instruction_samples_with_a_template_are_a_user_turn_and_the_output_as_the_answer(shared_data, name,
                                                                                         vocab, eot):
    tok = tokenizer(shared_data, vocab)
    t = template(shared_data, name, vocab)
    records = [r for r in INSTRUCTIONS if r[2]]
    got = samples(records, "instruction", tok, t)
    for (instruction, given, output), s in zip(records, got):
        user = f"{instruction}\n\n{given}" if given else instruction
        conversation = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        want, = samples([conversation], "chat", tok, t)
        np.testing.assert_array_equal(s.ids, want.ids)
        np.testing.assert_array_equal(s.train, want.train)
        assert spelled(tok, s.ids[s.train]) == output + eot
        assert user in spelled(tok, s.ids)


def test_samples_arguments():
    tok = ByteTokenizer()
    with pytest.raises(ConfigError, match="chat records need a chat template"):
        samples([[{"role": "user", "content": "x"}]], "chat", tok)
    with pytest.raises(ConfigError, match="records of kind 'plain'"):
        samples(["x"], "plain", tok)


# ---- chat samples ------------------------------------------------------------------------------

# (template: a shared file or SmolLM2's own, vocabulary, the end-of-turn text, takes a system message)
CHAT = [
    ("SmolLM2", SMOLLM, "<|im_end|>", True),
    ("Qwen-Qwen2.5-7B-Instruct", "gguf/ggml-vocab-qwen2.gguf", "<|im_end|>", True),
    ("meta-llama-Llama-3.1-8B-Instruct", "gguf/ggml-vocab-llama-bpe.gguf", "<|eot_id|>", True),
    ("microsoft-Phi-3.5-mini-instruct", "gguf/ggml-vocab-phi-3.gguf", "<|end|>", True),
    ("phi-3", "gguf/ggml-vocab-phi-3.gguf", "<|end|>", False),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "gguf/ggml-vocab-deepseek-llm.gguf",
     "<｜end▁of▁sentence｜>", True),
    ("mistralai-Mistral-Nemo-Instruct-2407", "gguf/ggml-vocab-llama-spm.gguf", "</s>", False),
    ("google-gemma-2-2b-it", "byte", "<end_of_turn>", False),
    ("SmolLM2", "byte", "<|im_end|>", True),
    ("Qwen-Qwen2.5-7B-Instruct", "byte", "<|im_end|>", True),
    ("meta-llama-Llama-3.1-8B-Instruct", "byte", "<|eot_id|>", True),
    ("microsoft-Phi-3.5-mini-instruct", "byte", "<|end|>", True),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "byte", "<｜end▁of▁sentence｜>", True),
    ("mistralai-Mistral-Nemo-Instruct-2407", "byte", "</s>", False),
]


def template(data, name, vocab):
    """The template `name` with bos/eos texts from the vocabulary it is used with."""
    if name == "SmolLM2":
        path = None
        gguf = data / SMOLLM
    elif name == "phi-3":
        return chat_template(data / "gguf/ggml-vocab-phi-3.gguf")
    else:
        path = data / "templates" / f"{name}.jinja"
        gguf = None if vocab == "byte" else data / vocab
    if gguf is None:
        return ChatTemplate(path.read_text(), "<s>", "</s>", name=str(path))
    t = chat_template(gguf, path)
    if vocab == "byte":                  # SmolLM2's template, the byte vocabulary's tokens
        return ChatTemplate(t.source, "<s>", "</s>", name=t.name)
    return t


def conversations(data, n=30):
    d = read_data(data / "chat" / "dummy_conversation.json")
    plain = d.records[:n]
    assert {len(c) for c in plain} == {2, 4, 6}                   # 1, 2 and 3 exchanges
    return plain, [[{"role": "system", "content": SYSTEM}] + c for c in plain]


def spelled(tok, ids) -> str:
    """The text of tokens as the template wrote it: special tokens as their text."""
    return b"".join(tok.piece(i) or tok.tokens[i].encode() for i in ids.tolist()).decode()


@pytest.mark.parametrize("name, vocab, eot, takes_system", CHAT,
                         ids=[f"{c[0]}-{c[1].split('/')[-1]}" for c in CHAT])
def test_chat_samples_train_assistant_turns_through_end_of_turn(shared_data, name, vocab, eot, takes_system):
    tok = tokenizer(shared_data, vocab)
    t = template(shared_data, name, vocab)
    plain, with_system = conversations(shared_data)
    convs = plain + (with_system if takes_system else [])
    for msgs, s in zip(convs, samples(convs, "chat", tok, t)):
        full = t.render(msgs)
        want = "".join(m["content"] + eot for m in msgs if m["role"] == "assistant")
        # the template's BOS text is BOS; with none, BOS is put first when the vocabulary asks
        lead = int(tok.add_bos and not full.startswith(tok.tokens[tok.bos_id]))
        if lead or full.startswith(tok.tokens[tok.bos_id]):
            assert s.ids[0] == tok.bos_id and s.ids[1] != tok.bos_id
        np.testing.assert_array_equal(s.ids[lead:], tok.encode(full, parse_special=True))
        # the trained tokens' places in the text spell the contents and end-of-turn texts
        starts, ends = token_offsets(tok, s.ids[lead:], full)
        data = full.encode()
        got = b"".join(data[a:b] for a, b in zip(starts[s.train[lead:]], ends[s.train[lead:]]))
        assert got.decode() == want
        # and so do their bytes, but for the space an SPM vocabulary puts after a special
        # token (phi-3 strips the newline after <|assistant|>, and "▁I" starts the content)
        if tok.kind == "spm" and name.startswith(("microsoft", "phi-3")):
            want = "".join(" " + m["content"] + eot for m in msgs if m["role"] == "assistant")
        if vocab == "byte":         # reads U+2581 (in DeepSeek's <｜end▁of▁sentence｜>) as a space
            want = want.replace("\u2581", " ")
        assert spelled(tok, s.ids[s.train]) == want
        if vocab != "byte":
            # with the template's own end-of-turn token, it is trained, once per assistant turn
            n_turns = sum(m["role"] == "assistant" for m in msgs)
            assert sum(tok.tokens[i] == eot for i in s.ids[s.train]) == n_turns
        # every token but a leading BOS with train_on_inputs
        every, = samples([msgs], "chat", tok, t, train_on_inputs=True)
        np.testing.assert_array_equal(every.ids, s.ids)
        assert every.train[1:].all() and every.train[0] == (s.ids[0] != tok.bos_id)


def test_chat_errors_name_the_record(shared_data):
    d = read_data(shared_data / "chat" / "dummy_conversation.json")
    tok = ByteTokenizer()
    system = [[{"role": "system", "content": SYSTEM}] + c for c in d.records[:3]]
    gemma = template(shared_data, "google-gemma-2-2b-it", "byte")
    with pytest.raises(FormatError, match=r"dummy_conversation\.json record 0: .*gemma-2-2b-it\.jinja: "
                                          r"System role not supported$"):
        samples(system, "chat", tok, gemma, where=d.where)
    # Mistral Nemo puts the system message into the last user turn: in a conversation that
    # ends with an assistant turn, it is not rendered at all
    mistral = template(shared_data, "mistralai-Mistral-Nemo-Instruct-2407", "byte")
    with pytest.raises(FormatError, match=r"^record 0: the chat template .*Mistral-Nemo.* does not render "
                                          r"messages\[0\] \(role 'system'\): its content is not in the text$"):
        samples(system, "chat", tok, mistral)
    # ... and with a user turn last, it moves: the first turns are not the whole's start
    moved = system[0][:4]
    assert [m["role"] for m in moved] == ["system", "user", "assistant", "user"]
    with pytest.raises(FormatError, match=r"record 0: the chat template .* does not render messages\[:2\] as "
                                          r"the start of the whole conversation .*--train-on-inputs"):
        samples([moved], "chat", tok, mistral)
    assert samples([moved], "chat", tok, mistral, train_on_inputs=True)[0].train[1:].all()
    # phi-3's own template knows only user and assistant
    phi3 = template(shared_data, "phi-3", "")
    with pytest.raises(FormatError, match=r"does not render messages\[0\] \(role 'system'\)"):
        samples(system, "chat", tokenizer(shared_data, "gguf/ggml-vocab-phi-3.gguf"), phi3)


def test_tool_turns(shared_data):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "tool", "content": "18 C, sunny"},
            {"role": "assistant", "content": "It is 18 C and sunny."}]
    tok = tokenizer(shared_data, SMOLLM)
    s, = samples([msgs], "chat", tok, template(shared_data, "SmolLM2", SMOLLM))
    assert spelled(tok, s.ids[s.train]) == "Let me look.<|im_end|>It is 18 C and sunny.<|im_end|>"
    assert "<|im_start|>tool\n18 C, sunny<|im_end|>" in spelled(tok, s.ids)
    # Phi-3.5's template drops tool messages without a word: reported
    phi = template(shared_data, "microsoft-Phi-3.5-mini-instruct", "byte")
    with pytest.raises(FormatError, match=r"does not render messages\[2\] \(role 'tool'\)"):
        samples([msgs], "chat", ByteTokenizer(), phi)


def test_first_turn_by_the_assistant(shared_data):
    """SmolLM2's template adds a default system turn to any non-empty conversation, so the
    empty conversation's generation prompt is not where the assistant's turn starts."""
    tok = tokenizer(shared_data, SMOLLM)
    t = template(shared_data, "SmolLM2", SMOLLM)
    msgs = [{"role": "assistant", "content": "Hi, how can I help?"},
            {"role": "user", "content": "Tell a joke."}, {"role": "assistant", "content": "No."}]
    with pytest.raises(FormatError, match=r"renders b'system\\nYou are a helpful AI .* between the generation "
                                          r"prompt and the content of messages\[0\]"):
        samples([msgs], "chat", tok, t)
    # a system turn first makes it plain
    s, = samples([[{"role": "system", "content": SYSTEM}] + msgs], "chat", tok, t)
    assert spelled(tok, s.ids[s.train]) == "Hi, how can I help?<|im_end|>No.<|im_end|>"


def test_templates_that_transform_the_content(shared_data):
    """Llama 3.1 and Gemma trim contents, DeepSeek R1 keeps what follows </think>: the turn
    still trains from the header's end through its end-of-turn token."""
    tok = tokenizer(shared_data, "gguf/ggml-vocab-llama-bpe.gguf")
    t = template(shared_data, "meta-llama-Llama-3.1-8B-Instruct", "gguf/ggml-vocab-llama-bpe.gguf")
    msgs = [{"role": "user", "content": "  hi  "}, {"role": "assistant", "content": "\n hello there \n"}]
    s, = samples([msgs], "chat", tok, t)
    assert spelled(tok, s.ids[s.train]) == "hello there<|eot_id|>"
    tok = tokenizer(shared_data, "gguf/ggml-vocab-deepseek-llm.gguf")
    t = template(shared_data, "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "gguf/ggml-vocab-deepseek-llm.gguf")
    msgs = [{"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>easy</think>4"},
            {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]
    s, = samples([msgs], "chat", tok, t)
    assert spelled(tok, s.ids[s.train]) == "4<｜end▁of▁sentence｜>6<｜end▁of▁sentence｜>"


@pytest.mark.parametrize("vocab", ["gguf/ggml-vocab-llama-spm.gguf", "gguf/ggml-vocab-phi-3.gguf",
                                   "gguf/ggml-vocab-qwen2.gguf", "byte"])
def test_token_offsets_spell_the_text(shared_data, vocab):
    tok = tokenizer(shared_data, vocab)
    texts = [" leading space", "a\u2581b \u2581\u2581c", "<s>  two spaces after BOS</s>\n\nx",
             "<|user|>\nhi<|end|>\n<|assistant|>\n\n  ok<|end|>\n", "tabs\tand\r\nnewlines\n\n\n",
             "naïve café 日本語 🦙", "<|im_start|>user\n<|im_end|>"]
    for text in texts:
        ids = tok.encode(text, parse_special=True)
        starts, ends = token_offsets(tok, ids, text)
        data = text.encode()
        assert (np.diff(starts) >= 0).all() and (ends >= starts).all() and (starts[1:] >= ends[:-1]).all()
        # between and after tokens only whitespace a special token stripped
        gaps = [data[a:b] for a, b in zip(np.r_[0, ends], np.r_[starts, len(data)])]
        assert all(not g.strip() for g in gaps), (text, gaps)
        for i, a, b in zip(ids.tolist(), starts, ends):
            piece = tok.piece(i) or tok.tokens[i].encode()
            span = data[a:b].replace("\u2581".encode(), b" ")
            assert span in (piece, piece[1:]), (text, i, piece, data[a:b])
