"""`ggtrain eval --task`: task files (JSON lines, llama.cpp's HellaSwag and Winogrande files),
lm-evaluation-harness's tokenization of a choice, and every choice's log-likelihood against
the one computed from real llama.cpp's logits (llama-cpp-python) on the same tokens; the
accuracies the command prints follow from those, item for item."""
import json
import math

import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.inference import Decoder
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.tasks import score_item, summarize
from ggtrain.errors import FormatError
from ggtrain.formats.model_file import load_model
from ggtrain.formats.tasks import TaskChoice, encode_choice, encode_items, read_task
from tests.interop import open_llm, run_cli

JSONL = [{"context": "Tom had a red", "choices": ["kite.", "house on the moon.", "dog"], "gold": 0},
         {"context": "The kite flew high over the ", "choices": ["park", "ocean of soup", "cat"], "gold": 0},
         {"context": "Lily and Ben went to the", "choices": ["park.", "zzz qqq", "blue"], "gold": 1,
          "delimiter": ""}]
HELLASWAG = ("Kids: Lily and Ben played in the park. They\n2\n ran to the moon and ate it.\nflew away.\n"
             "played with a ball.\nzzz qqq.\n"
             "Dog: The dog saw a cat. The dog\n0\nbarked at the cat.\nsang a song.\nwas a car.\nate the sun.\n")
WINOGRANDE = ("index,sentence,option1,option2,answer\n"
              '0,"Tom gave Lily a ball, so _ was happy.",Lily,Tom,1\n'
              "1,The cat chased the dog because _ was angry.,cat,dog,1\n")


@pytest.fixture
def files(tmp_path):
    paths = {"jsonl": tmp_path / "t.jsonl", "hellaswag": tmp_path / "hs.txt", "winogrande": tmp_path / "wg.csv"}
    paths["jsonl"].write_text("\n".join(json.dumps(r) for r in JSONL) + "\n")
    paths["hellaswag"].write_text(HELLASWAG)
    paths["winogrande"].write_text(WINOGRANDE)
    return paths


def test_task_files_read_as_lm_evaluation_harness_builds_them(files):
    items = read_task(files["jsonl"])
    assert [i.gold for i in items] == [0, 0, 1]
    assert items[0].choices[1] == TaskChoice("Tom had a red", " house on the moon.", len("house on the moon."))
    assert items[2].choices[0].continuation == "park."              # "delimiter": ""
    hs = read_task(files["hellaswag"], "hellaswag")
    assert [i.gold for i in hs] == [2, 0] and len(hs[0].choices) == 4
    assert hs[1].choices[0] == TaskChoice("Dog: The dog saw a cat. The dog", " barked at the cat.", 18)
    wg = read_task(files["winogrande"], "winogrande")                 # the header line skipped
    assert [i.gold for i in wg] == [0, 0]
    assert wg[0].choices[1] == TaskChoice("Tom gave Lily a ball, so Tom", " was happy.", 3)
    assert wg[1].where.endswith("wg.csv line 3")


@pytest.mark.parametrize("fmt, text, message", [
    ("jsonl", '{"context": "a", "choices": ["b", "c"], "gold": 2}\n', 'line 1: "gold" must be an index'),
    ("jsonl", '{"context": "a", "choices": ["b"], "gold": 0}\n', '"choices" must be a list of at least 2'),
    ("jsonl", '{"context": "a", "gold": 0}\n\n{"x": 1}\n', 'line 1: the item has no "choices" field'),
    ("jsonl", '{"context": "a", "choices": ["b", "c"], "gold": 0}\n{"context": \n', "line 2 column 13: invalid JSON"),
    ("jsonl", "\n\n", "no task items"),
    ("hellaswag", "ctx\n1\na\nb\nc\n", "5 lines, not a multiple of 6"),
    ("hellaswag", "ctx\n4\na\nb\nc\nd\n", "line 2: the gold ending's index is '4'"),
    ("winogrande", "0,No blank here.,a,b,1\n", 'line 1: the sentence has no "_"'),
    ("winogrande", "0,A _ b.,a,b,3\n", "line 1: the answer is '3'"),
    ("winogrande", "0,A _ b.,a\n", "line 1: expected 5 comma-separated fields"),
])
def test_bad_task_files_are_one_line_errors_naming_the_line(tmp_path, fmt, text, message):
    p = tmp_path / "bad.txt"
    p.write_text(text)
    with pytest.raises(FormatError, match=message.replace("(", r"\(").replace("[", r"\[")) as e:
        read_task(p, fmt)
    assert str(p) in str(e.value)


def test_a_choice_is_tokenized_as_lm_evaluation_harness_does(shared_data):
    _, _, tok = load_model(shared_data / "gguf" / "stories260K.gguf")
    for context, continuation in (("The kite flew high over the ", " park"), ("Tom had a", " red kite.")):
        ctx, cont = encode_choice(tok, TaskChoice(context, continuation, 1))
        # the context's trailing space goes with the continuation; the whole is one encoding
        stripped = context.rstrip()
        assert list(ctx) == list(tok.encode(stripped, add_bos=True))
        assert list(ctx) + list(cont) == list(tok.encode(stripped + context[len(stripped):] + continuation,
                                                         add_bos=True))


def _their_loglik(llm, ctx, cont):
    ids = list(ctx) + list(cont)
    llm.reset()
    llm.eval(ids)
    s = np.array(llm.scores[:len(ids)], np.float64)
    s -= s.max(-1, keepdims=True)
    lp = s - np.log(np.exp(s).sum(-1, keepdims=True))
    return float(sum(lp[len(ctx) - 1 + j, t] for j, t in enumerate(cont)))


@pytest.mark.parametrize("fmt", ["jsonl", "hellaswag", "winogrande"])
def test_scores_equal_those_from_llama_cpp_logits_choice_for_choice(files, shared_data, llama, fmt):
    model = shared_data / "gguf" / "stories260K.gguf"
    config, weights, tok = load_model(model)
    items = read_task(files[fmt], fmt)
    encoded = encode_items(tok, items)
    decoder = Decoder(ModelConfig(**config), weights, CpuBackend(2), n_ctx=128)
    llm = open_llm(llama, model, n_ctx=128)
    ours, theirs = [], []
    for choices, gold in encoded:
        scored = score_item(decoder, choices, gold)
        want = [_their_loglik(llm, c, t) for c, t, _ in choices]
        # F32 weights: logits agree to ~1e-3 with llama.cpp's, a token's log-probability likewise
        np.testing.assert_allclose(scored.logliks, want, rtol=0, atol=2e-3 * max(len(t) for _, t, _ in choices))
        assert scored.tokens == tuple(len(t) for _, t, _ in choices)
        ours.append(scored)
        theirs.append(type(scored)(tuple(want), scored.tokens, gold, scored.norm_lens))
    for a, b in zip(ours, theirs):
        assert (a.correct, a.correct_norm) == (b.correct, b.correct_norm)
    # what the command prints follows from those scores
    args = ["--hellaswag"] if fmt == "hellaswag" else ["--winogrande"] if fmt == "winogrande" else []
    r = run_cli("eval", "--model", model, "--task", files[fmt], *args, "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = summarize(theirs)
    assert got["items"] == len(items) and got["acc"] == want["acc"] and got["acc_norm"] == want["acc_norm"]
    acc = np.array([s.correct for s in theirs], float)
    assert got["acc_stderr"] == pytest.approx(acc.std(ddof=1) / math.sqrt(len(items)))


def test_shared_prefix_scores_equal_scoring_each_choice_alone(shared_data):
    """The prefix fed once and rewound to gives what a fresh decoder gives each choice."""
    config, weights, tok = load_model(shared_data / "gguf" / "stories260K.gguf")
    cfg = ModelConfig(**config)
    choices = [(np.array(tok.encode(c, add_bos=True)), np.array(tok.encode(t)[0:]), 1)
               for c, t in (("Tom had a red kite and", "a dog"), ("Tom had a red kite and a", "big cat"),
                            ("Tom had a", "ball"))]
    shared = score_item(Decoder(cfg, weights, CpuBackend(2), n_ctx=64), choices, 0)
    for k, choice in enumerate(choices):
        alone = score_item(Decoder(cfg, weights, CpuBackend(2), n_ctx=64), [choice], 0)
        assert shared.logliks[k] == pytest.approx(alone.logliks[0], abs=1e-4)


@pytest.mark.parametrize("fmt", ["jsonl", "hellaswag", "winogrande"])
def test_batched_scores_equal_item_by_item(files, shared_data, monkeypatch, fmt):
    """score_items (the choices of many items packed into the rows of one plan, each attending
    only to itself, over batches small enough here that items straddle them) gives the
    log-likelihoods of score_item (the KV-cached decoder, the shared prefix fed once), so the
    same accuracies."""
    from ggtrain.core import tasks
    from ggtrain.core.tasks import score_items
    monkeypatch.setattr(tasks, "BATCH_TOKENS", 96)    # rows of 64 positions, one a batch
    config, weights, tok = load_model(shared_data / "gguf" / "stories260K.gguf")
    cfg = ModelConfig(**config)
    encoded = encode_items(tok, read_task(files[fmt], fmt)) * 3
    decoder = Decoder(cfg, weights, CpuBackend(2), n_ctx=128)
    one = [score_item(decoder, choices, gold) for choices, gold in encoded]
    done = []
    many = score_items(cfg, weights, CpuBackend(2), encoded, n_ctx=128, progress=done.append)
    assert sum(done) == len(encoded) and len(done) > 1
    for a, b in zip(one, many):
        np.testing.assert_allclose(b.logliks, a.logliks, rtol=0, atol=1e-4)
        assert (a.tokens, a.gold, a.norm_lens) == (b.tokens, b.gold, b.norm_lens)
    assert summarize(one) == summarize(many)


def test_a_choice_longer_than_ctx_names_its_item(files, shared_data):
    """The batched path says which item does not fit, as the item-by-item one does."""
    r = run_cli("eval", "--model", shared_data / "gguf" / "stories260K.gguf", "--task", files["jsonl"], "--ctx", 4,
                "--quiet")
    assert r.returncode == 1 and "line 1" in r.stderr and "more than the context of 4 (--ctx)" in r.stderr, r.stderr


@pytest.mark.parametrize("args, message", [
    ([], "give --data TEXT (perplexity) or --task FILE"),
    (["--task", "missing.jsonl"], "--task missing.jsonl: no such file"),
    (["--data", "x.txt", "--hellaswag"], "--hellaswag and --winogrande say what --task holds"),
    (["--task", "TASK", "--ctx", "4"], "line 1: a choice takes"),
    (["--task", "TASK", "--half-window"], "--half-window scores --data (a text), not --task"),
])
def test_bad_eval_task_options_are_one_line(files, shared_data, args, message):
    args = [str(files["jsonl"]) if a == "TASK" else a for a in args]
    r = run_cli("eval", "--model", shared_data / "gguf" / "stories260K.gguf", *args, "--quiet")
    assert r.returncode == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def _random_items(rng, vocab: int, n: int) -> list:
    """n items of 2-4 choices: a shared context (with BOS 1), continuations of 1-5 tokens;
    some items' choices differ inside their contexts (the shared prefix stops there)."""
    items = []
    for i in range(n):
        ctx = [1] + list(rng.integers(2, vocab, int(rng.integers(2, 9))))
        choices = []
        for _ in range(int(rng.integers(2, 5))):
            c = list(ctx)
            if i % 3 == 2:
                c[-1] = int(rng.integers(2, vocab))
            t = rng.integers(2, vocab, int(rng.integers(1, 6)))
            choices.append((np.array(c, np.int32), t.astype(np.int32), len(t)))
        items.append((choices, int(rng.integers(0, len(choices)))))
    return items


@pytest.mark.parametrize("case, extra, tree", [("llama3", {}, True), ("qwen3", {}, True), ("gemma3", {}, False),
                                               ("gemma3", {"window": 32}, True), ("lfm2", {}, False)])
def test_tree_packed_scores_equal_item_by_item(monkeypatch, case, extra, tree):
    """score_items with the tree mask (each item's shared prefix once, its choices seeing it:
    llama, qwen3, gemma3 in rows no longer than its window) or, where the model's window is
    shorter than any row that fits (gemma3's local layers of 3) or it has recurrent layers
    (lfm2), each choice whole, gives score_item's log-likelihoods; the tree packs fewer
    positions than the choices whole."""
    from ggtrain.core import tasks
    from ggtrain.core.models.config import init_params
    from tests.family_cases import CASES, TINY
    cfg = ModelConfig(**{**TINY, **CASES[case].tiny, "ctx": 64, **extra})
    weights = init_params(cfg, seed=3, std=0.3)
    items = _random_items(np.random.default_rng(7), cfg.vocab, 12)
    monkeypatch.setattr(tasks, "BATCH_TOKENS", 128)     # rows of 64, two a batch: items straddle batches
    packed = []
    real_pack = tasks._pack
    monkeypatch.setattr(tasks, "_pack", lambda *a: packed.append(real_pack(*a)) or packed[-1])
    many = tasks.score_items(cfg, weights, CpuBackend(2), items, n_ctx=64)
    assert len(packed[0]) > 1
    whole = sum(len(c) + len(t) - 1 for choices, _ in items for c, t, _ in choices)
    taken = sum(int((b.seg >= 0).sum()) for b in packed[0])
    assert (taken < whole) == tree, (taken, whole)
    assert any((b.parent != b.seg).any() for b in packed[0]) == tree
    decoder = Decoder(cfg, weights, CpuBackend(2), n_ctx=64)
    for (choices, gold), got in zip(items, many):
        want = score_item(decoder, choices, gold)
        np.testing.assert_allclose(got.logliks, want.logliks, rtol=0, atol=2e-4)


def test_rows_may_be_longer_than_a_choice_may(monkeypatch):
    """--ctx bounds a choice, not a row: with n_ctx 64 on a model of context 256, rows longer than
    64 pack several items (positions count within a segment), and the scores are still those of
    the decoder whose context is 64."""
    from ggtrain.core import tasks
    from ggtrain.core.models.config import init_params
    from tests.family_cases import CASES, TINY
    cfg = ModelConfig(**{**TINY, **CASES["llama3"].tiny, "ctx": 256})
    weights = init_params(cfg, seed=3, std=0.3)
    items = _random_items(np.random.default_rng(5), cfg.vocab, 12)
    monkeypatch.setattr(tasks, "BATCH_TOKENS", 256)
    shapes = []
    real_shape = tasks._shape
    monkeypatch.setattr(tasks, "_shape", lambda *a: shapes.append(real_shape(*a)) or shapes[-1])
    many = tasks.score_items(cfg, weights, CpuBackend(2), items, n_ctx=64)
    assert shapes[0][0] > 64, shapes
    decoder = Decoder(cfg, weights, CpuBackend(2), n_ctx=64)
    for (choices, gold), got in zip(items, many):
        np.testing.assert_allclose(got.logliks, score_item(decoder, choices, gold).logliks, rtol=0, atol=2e-4)


@pytest.mark.parametrize("n_items", [3, 24, 200])
def test_packing_computes_few_positions_past_the_items(n_items):
    """The rows' length and count are chosen for the task (_shape): the positions a task's
    batches compute (batches x rows x length) stay within 15% (and a row) of those its items take,
    for HellaSwag-like items (a 40-90 token context, four 15-30 token endings) of any count: no
    half-empty rows of one item each, no nearly empty last batch. Every item's tokens are there."""
    from ggtrain.core import tasks
    rng = np.random.default_rng(n_items)
    items = []
    for _ in range(n_items):
        ctx = np.concatenate([[1], rng.integers(2, 1000, int(rng.integers(40, 90)))]).astype(np.int32)
        items.append(([(ctx, rng.integers(2, 1000, int(rng.integers(15, 30))).astype(np.int32), 1)
                       for _ in range(4)], 0))
    prepared = [tasks._Item(choices, True) for choices, _ in items]
    length, n_rows, tree = tasks._shape(prepared, 512, True, 0)
    batches = tasks._pack(prepared, length, n_rows, tree)
    taken = sum(int((b.seg >= 0).sum()) for b in batches)
    assert tree and taken == sum(p.tree for p in prepared)
    assert len(batches) * n_rows * length <= 1.15 * taken + length, (length, n_rows, len(batches), taken)
    assert n_rows * length <= tasks.BATCH_TOKENS
    assert sorted((i, j) for b in batches for i, j, _, _ in b.samples) == [(i, j) for i in range(n_items)
                                                                         for j in range(4)]


@pytest.mark.parametrize("fmt, option", [("hellaswag", "--hellaswag"), ("winogrande", "--winogrande")])
def test_a_task_file_of_another_format_names_its_option(files, shared_data, tmp_path, fmt, option):
    """A HellaSwag or Winogrande file read as JSON lines (no --hellaswag / --winogrande) is one
    line naming the option it needs, in eval --task and in finetune --eval-task; finetune reads
    it given the option, as eval does."""
    from tests.interop import run_here
    model = shared_data / "gguf" / "stories260K.gguf"
    with pytest.raises(FormatError, match=f"looks like llama-perplexity's .* file: give {option}"):
        read_task(files[fmt])
    r = run_here("eval", "--model", model, "--task", files[fmt], "--quiet")
    assert r.returncode == 1 and f"give {option}" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    text = tmp_path / "t.txt"
    text.write_text("Tom had a red kite. The kite flew high over the park. " * 30)
    common = ("finetune", "--model", model, "--data", text, "--out", tmp_path / "a.gguf", "--steps", "1",
              "--eval-task", files[fmt])
    r = run_here(*common, "--quiet")
    assert r.returncode == 1 and f"give {option}" in r.stderr, r.stderr
    r = run_here(*common, option, "--quiet")
    n = len(read_task(files[fmt], fmt))
    assert r.returncode == 0 and "task accuracy" in r.stderr and f"({n} items)" in r.stderr, r.stderr


def test_one_item_has_no_standard_error_and_valid_json(files, shared_data):
    """One item's standard error is undefined: None in the summary (eval --json prints null, not
    NaN, which JSON parsers refuse), left out of the text line."""
    from tests.interop import run_here
    model = shared_data / "gguf" / "stories260K.gguf"
    r = run_here("eval", "--model", model, "--task", files["jsonl"], "--limit", "1", "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert out["items"] == 1 and out["acc_stderr"] is None and out["acc_norm_stderr"] is None
    r = run_here("eval", "--model", model, "--task", files["jsonl"], "--limit", "1", "--quiet")
    assert r.returncode == 0 and "±" not in r.stdout and "(1 item)" in r.stdout, r.stdout
