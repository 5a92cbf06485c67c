"""Preference tuning (`finetune --method dpo|orpo`): each loss against a float64 reference of
its formula on a tiny model (per-sequence log-probabilities from the numpy twin of the
decoder), its gradient by finite differences of that reference, pair packing, LoRA DPO's
first update at exactly log 2, the command end to end on stories260K (pairs learnt, adapter
in real llama.cpp, bit-identical resume) and its bad input."""
import json

import gguf
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.data import pack_pairs
from ggtrain.core.models import losses as model_losses
from ggtrain.core.models.config import ModelConfig, trainable
from ggtrain.core.models.decoder import Inputs, Net, Options, forward
from ggtrain.core.preference import PreferenceConfig, pair_slots
from ggtrain.core.train import TextConfig, TextRun
from ggtrain.errors import ConfigError
from tests import np_decoder
from tests.interop import open_llm, run_cli
from tests.test_distributed import mpiexec  # noqa: F401 - the fixture
from tests.family_cases import TINY
from tests.test_decoder import family_params

CTX = 16


def _pairs(rng, n, vocab):
    """n random pairs: a shared prompt of 2-4 tokens, then answers of 1-4 tokens (trained)."""
    out = []
    for _ in range(n):
        prompt = rng.integers(0, vocab, rng.integers(2, 5))
        sides = []
        for _ in range(2):
            answer = rng.integers(0, vocab, rng.integers(1, 5))
            ids = np.concatenate([prompt, answer]).astype(np.int32)
            sides.append((ids, np.arange(len(ids)) >= len(prompt)))
        out.append(tuple(sides))
    return out


def _seq_logp(cfg, params, ids, train):
    """float64 (sum, count) of log p(ids[i] | ids[:i]) over the trained i, from the numpy twin."""
    logits = np_decoder.forward(cfg, params, ids[None, :-1], np.arange(len(ids) - 1))[0]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    at = np.flatnonzero(train[1:])
    return logp[at, ids[1:][at]].sum(), len(at)


def _reference_loss(cfg, params, pairs, pref, reference):
    """The method's loss over `pairs` in float64, straight from its formula."""
    softplus = lambda x: np.logaddexp(0.0, x)   # noqa: E731 - -log sigmoid(-x)
    terms, nll, count = [], 0.0, 0
    for k, (c, r) in enumerate(pairs):
        (sc, nc), (sr, nr) = _seq_logp(cfg, params, *c), _seq_logp(cfg, params, *r)
        if pref.method == "dpo":
            h = pref.beta * ((sc - reference[k, 0]) - (sr - reference[k, 1]))
            terms.append(softplus(-h))
            nll, count = nll - sc, count + nc
        else:
            odds = lambda a: a - np.log1p(-np.exp(a))   # noqa: E731
            terms.append(softplus(-(odds(sc / nc) - odds(sr / nr))))
            nll, count = nll - sc, count + nc
    loss = np.mean(terms)
    if pref.method == "dpo":
        return loss + pref.rpo_alpha * nll / count
    return nll / count + pref.orpo_lambda * loss


def _run(cfg, init, data, pref, batch, seed=0):
    loss_rows = int(np.sort((data.targets >= 0).sum(axis=1))[::-1][:batch].sum())
    tc = TextConfig(steps=1, batch=batch, lr=1e-3, lr_min=1e-3, warmup=0, weight_decay=0.0, grad_clip=0.0,
                    checkpointing=False, seed=seed)
    return TextRun(cfg, init, tc, CpuBackend(2), ctx=CTX, packed=True, loss_rows=loss_rows, preference=pref,
                   pairs=pair_slots(data.pair, batch))


@pytest.mark.parametrize("pref", [PreferenceConfig("dpo", beta=0.5), PreferenceConfig("orpo", orpo_lambda=0.7),
                                  PreferenceConfig("dpo", beta=0.5, rpo_alpha=0.8)], ids=["dpo", "orpo", "dpo-rpo"])
def test_loss_and_gradient_match_the_float64_formula(pref):
    cfg = ModelConfig(**{**TINY, "ctx": CTX})
    rng = np.random.default_rng(0)
    pairs = _pairs(rng, 5, cfg.vocab)
    data, stats = pack_pairs(pairs, CTX)
    assert stats.packed == 5 and stats.truncated == 0
    init = family_params(cfg, 0, std=0.1)
    run = _run(cfg, init, data, pref, batch=data.rows)
    # DPO's reference, near the model's own values so that no pair's sigmoid saturates
    ref64 = {k: v.astype(np.float64) for k, v in init.items()}
    own = np.array([[-_seq_logp(cfg, ref64, *side)[0] for side in p] for p in pairs])
    run.reference = (own + rng.normal(0, 1.0, own.shape)).astype(np.float32)
    reference_logp = -run.reference.astype(np.float64)
    batch = data.fields()
    loss = run.step.step([run.feed(batch)], lr=0.0)   # lr 0: the gradient, parameters unchanged
    want = _reference_loss(cfg, ref64, pairs, pref, reference_logp)
    assert loss == pytest.approx(want, rel=2e-5)
    assert run._run_eval(batch)[0] == pytest.approx(want, rel=2e-5)
    # the gradient: the flat buffer holds it (parameters in order), against central differences
    grad = run.step.get(run.step.grad_flat)
    offset = 0
    for p in run.step.params:
        name, size = p.name, p.size
        g = grad[offset:offset + size]
        offset += size
        flat = ref64[name].reshape(-1)
        for i in rng.choice(size, size=min(3, size), replace=False):
            old = flat[i]
            flat[i] = old + 1e-6
            lp = _reference_loss(cfg, ref64, pairs, pref, reference_logp)
            flat[i] = old - 1e-6
            lm = _reference_loss(cfg, ref64, pairs, pref, reference_logp)
            flat[i] = old
            assert g[i] == pytest.approx((lp - lm) / 2e-6, rel=3e-3, abs=3e-5), f"{name}[{i}]"


def test_metrics_are_trl_rewards():
    """rewards = beta (logp - ref logp) per side; accuracy: the chosen side's is higher."""
    cfg = ModelConfig(**{**TINY, "ctx": CTX})
    rng = np.random.default_rng(1)
    pairs = _pairs(rng, 4, cfg.vocab)
    data, _ = pack_pairs(pairs, CTX)
    init = family_params(cfg, 0, std=0.1)
    pref = PreferenceConfig("dpo", beta=0.25)
    run = _run(cfg, init, data, pref, batch=data.rows)
    run.reference = rng.normal(-15, 2, (4, 2)).astype(np.float32)
    run.evaluate([data.fields()])
    ref64 = {k: v.astype(np.float64) for k, v in init.items()}
    rewards = np.array([[pref.beta * (_seq_logp(cfg, ref64, *side)[0] + run.reference[k, j])   # + ref NLL
                         for j, side in enumerate(p)] for k, p in enumerate(pairs)])
    m = run.last_eval_metrics
    assert m["val_rewards_chosen"] == pytest.approx(rewards[:, 0].mean(), rel=1e-4)
    assert m["val_rewards_rejected"] == pytest.approx(rewards[:, 1].mean(), rel=1e-4)
    assert m["val_rewards_margin"] == pytest.approx((rewards[:, 0] - rewards[:, 1]).mean(), rel=1e-4, abs=1e-5)
    assert m["val_rewards_accuracy"] == np.mean(rewards[:, 0] > rewards[:, 1])


def test_pairs_pack_side_by_side_and_long_ones_are_cut_or_refused():
    rng = np.random.default_rng(2)
    pairs = _pairs(rng, 7, 64)
    data, stats = pack_pairs(pairs, CTX, first_id=10)
    for r in range(data.rows):   # each row: whole pairs, a segment for each side
        used = data.pair[r] >= 0
        for pid in np.unique(data.pair[r][used] // 2):
            mine = used & (data.pair[r] // 2 == pid)
            assert set(data.pair[r][mine] % 2) == {0, 1} and len(set(data.seg[r][mine])) == 2
    assert sorted(np.unique(data.pair[data.pair >= 0] // 2)) == list(range(10, 17))
    assert stats.trained == sum(int(s[1][1:].sum()) for p in pairs for s in p)
    # a pair longer than a row: the longer side is cut (never below half the row)
    long = [((np.arange(14, dtype=np.int32), np.arange(14) >= 2), (np.arange(6, dtype=np.int32), np.arange(6) >= 2))]
    d, st = pack_pairs(long, 12)
    assert st.truncated == 1 and (d.pair[0] % 2 == 0).sum() == 7 and (d.pair[0] % 2 == 1).sum() == 5
    with pytest.raises(ConfigError, match="no token to train on"):
        pack_pairs(long, 12, drop_long=True)
    # a prompt that fills its side's share of the row: refused, naming the pair
    side = (np.arange(20, dtype=np.int32), np.arange(20) >= 15)
    huge = [(side, side)]
    with pytest.raises(ConfigError, match="p.jsonl line 3: the prompt leaves no chosen token"):
        pack_pairs(huge, 16, where=["p.jsonl line 3"])


# ---- the command ---------------------------------------------------------------------------

FAST = ["--ctx", "128", "--batch", "2", "--lora-rank", "4", "--quiet"]
NAMES = ["Lily", "Ben", "Sam", "Mia", "Tom", "Sue", "Max", "Amy"]


@pytest.fixture
def story(shared_data):
    return shared_data / "gguf" / "stories260K.gguf"


@pytest.fixture
def pairs_file(tmp_path):
    lines = [json.dumps({"prompt": f"Who is {n}? ", "chosen": f"{n} is a kid who likes to play.",
                         "rejected": f"{n} is a big dog that barks."}) for n in NAMES * 5]
    p = tmp_path / "pairs.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _steps(log):
    return [json.loads(x) for x in log.read_text().splitlines() if '"loss"' in x]


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_finetune_learns_the_pairs_and_the_adapter_runs_in_llama_cpp(tmp_path, story, pairs_file, method, llama):
    out, log = tmp_path / "a.gguf", tmp_path / "log.jsonl"
    r = run_cli("finetune", "--model", story, "--data", pairs_file, "--out", out, "--method", method, "--steps", 20,
                "--lr", "3e-3", "--val-split", "0.2", "--log", log, *FAST)
    assert r.returncode == 0, r.stderr
    steps = _steps(log)
    done = json.loads(log.read_text().splitlines()[-1])
    if method == "dpo":   # the policy starts as the reference: loss log 2, rewards 0, exactly
        assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-7)
        assert steps[0]["rewards_chosen"] == steps[0]["rewards_rejected"] == 0.0
    assert steps[-1]["loss"] < 0.5 * steps[0]["loss"]
    assert done["val_rewards_accuracy"] == 1.0 and done["val_rewards_margin"] > 0
    assert "preference accuracy 1.000" in r.stderr
    assert gguf.GGUFReader(out).fields["general.type"].contents() == "adapter"
    # llama.cpp with the adapter prefers the chosen answer (summed log-probabilities)
    llm = open_llm(llama, story, out, n_ctx=128)
    from ggtrain.formats.model_file import load_model
    _, _, tok = load_model(story)

    def logp(prompt, answer):
        ids = tok.encode(prompt + answer, add_bos=True).tolist()
        n = len(tok.encode(prompt, add_bos=True))
        llm.reset()
        llm.eval(ids)
        s = np.array(llm.scores[:len(ids)], np.float64)
        s -= s.max(-1, keepdims=True)
        lp = s - np.log(np.exp(s).sum(-1, keepdims=True))
        return sum(lp[i - 1, ids[i]] for i in range(n, len(ids)))
    assert all(logp(f"Who is {n}? ", f"{n} is a kid who likes to play.") >
               logp(f"Who is {n}? ", f"{n} is a big dog that barks.") for n in NAMES[:4])


def test_full_dpo_starts_at_log_2_without_a_second_copy_of_the_model(tmp_path, story, pairs_file):
    """--full: the reference is the model before the first update, its log-probabilities
    computed once (no frozen copy); the first update's loss is log 2, then it falls."""
    out, log = tmp_path / "m.gguf", tmp_path / "log.jsonl"
    r = run_cli("finetune", "--model", story, "--data", pairs_file, "--out", out, "--method", "dpo", "--full",
                "--steps", 8, "--lr", "1e-3", "--log", log, *FAST)
    assert r.returncode == 0, r.stderr
    steps = _steps(log)
    assert steps[0]["loss"] == pytest.approx(np.log(2), abs=1e-7) and steps[-1]["loss"] < 0.5 * np.log(2)
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "llama"


def test_dpo_resumes_bit_identically(tmp_path, story, pairs_file):
    common = ["--model", story, "--data", pairs_file, "--method", "dpo", "--steps", 6, "--lr", "3e-3", *FAST]
    full, ck = tmp_path / "full.gguf", tmp_path / "ck"
    r = run_cli("finetune", "--out", full, "--checkpoint-dir", ck, "--save-every", 3, *common)
    assert r.returncode == 0, r.stderr
    names = [t.name for t in gguf.GGUFReader(ck / "ckpt-000003.gguf").tensors]
    assert "preference.reference_nll" in names
    resumed = tmp_path / "resumed.gguf"
    r = run_cli("finetune", "--out", resumed, "--resume", ck / "ckpt-000003.gguf", *common)
    assert r.returncode == 0, r.stderr
    assert full.read_bytes() == resumed.read_bytes()


def test_conversational_pairs_train_only_the_answer(tmp_path, story, shared_data):
    from ggtrain.formats.dataset import read_data
    from ggtrain.formats.chat import ChatTemplate
    from ggtrain.formats.model_file import load_model
    from tests.test_finetune_cli import TEMPLATE
    _, _, tok = load_model(story)
    rec = {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                      {"role": "user", "content": "Who is Tom?"}],
           "chosen": [{"role": "assistant", "content": "Tom is a kid."}],
           "rejected": [{"role": "assistant", "content": "Tom is a dog."}]}
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps(rec) + "\n")
    found = read_data(p)
    assert found.kind == "preference"
    template = ChatTemplate(TEMPLATE, bos_token="<s>", eos_token="</s>")
    (chosen, rejected), = found.samples(tok, template)
    for s, answer in ((chosen, "Tom is a kid."), (rejected, "Tom is a dog.")):
        trained = tok.decode(s.ids[s.train].tolist())
        assert trained.strip().startswith(answer) and "Hello" not in trained


@pytest.mark.parametrize("record, args, message", [
    ({"prompt": "Q ", "chosen": "same", "rejected": "same"}, ["--method", "dpo"],
     '"chosen" and "rejected" are identical'),
    ({"prompt": "Q ", "chosen": "a", "rejected": 3}, ["--method", "dpo"], "three strings or three message lists"),
    ({"prompt": [{"role": "user", "content": "Q"}], "chosen": [{"role": "user", "content": "a"}],
      "rejected": [{"role": "assistant", "content": "b"}]}, ["--method", "dpo"], "chosen[0].role is 'user'"),
    ({"prompt": "Q ", "chosen": "a"}, ["--method", "dpo"], 'no "rejected" field'),
    ({"prompt": "Q " * 200, "chosen": "a", "rejected": "b"}, ["--method", "dpo"], "the prompt leaves no chosen token"),
    ({"prompt": "Q ", "chosen": "a", "rejected": "b"}, ["--method", "ppo"], "'ppo' is not one of 'sft', 'dpo', 'orpo'"),
    ({"prompt": "Q ", "chosen": "a", "rejected": "b"}, [], "preference pairs train with --method dpo or orpo"),
    ({"text": "Tom had a kite."}, ["--method", "orpo"], "--method orpo trains on preference pairs"),
    ({"prompt": "Q ", "chosen": "a", "rejected": "b"}, ["--method", "dpo", "--beta", "0"], "--beta must be > 0"),
    ({"prompt": "Q ", "chosen": "a", "rejected": "b"}, ["--method", "dpo", "--train-on-inputs"],
     "--train-on-inputs does not apply to --method dpo"),
    ({"prompt": "Q ", "chosen": "a", "rejected": "b"}, ["--method", "orpo", "--rpo-alpha", "1"],
     "--rpo-alpha adds an SFT term to DPO"),
])
def test_bad_preference_input_is_one_line_and_writes_nothing(tmp_path, story, record, args, message):
    p = tmp_path / "p.jsonl"
    p.write_text((json.dumps(record) + "\n") * 4)
    out = tmp_path / "a.gguf"
    r = run_cli("finetune", "--model", story, "--data", p, "--out", out, *args, *FAST)
    assert r.returncode == (2 if "ppo" in args else 1), r.stderr      # a value not among the choices: a usage error
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists()


def test_sequence_nll_in_chunks_with_gradients_in_the_forward_equals_one_chunk():
    """losses.sequence_nll over row chunks, each chunk's per-row input gradients taken in the
    forward (ops.with_grad, row-wise: a frozen output matrix, as under LoRA), and fused (one
    linear_cross_entropy, what TextRun takes on the CPU): the values and gradients of one chunk."""
    from ggtrain.core.autograd import backward
    from ggtrain.core.graph import Graph, Runtime
    from ggtrain.core import ops
    cfg = ModelConfig(**{**TINY, "ctx": CTX})
    rng = np.random.default_rng(5)
    b, n = 2, 2 * CTX
    tok = rng.integers(0, cfg.vocab, (b, CTX)).astype(np.int32)
    tgt = np.where(rng.random((b, CTX)) < 0.7, rng.integers(0, cfg.vocab, (b, CTX)), -1).astype(np.int32)
    select = rng.normal(0, 1, (5, n)).astype(np.float32)
    weights = rng.normal(0, 1, 5).astype(np.float32)
    got = {}
    for chunks in (1, 3, "fused"):
        g = Graph()
        init = family_params(cfg, 0, std=0.1)
        params = {k: g.param(v.shape, v, name=k, trainable=trainable(k) and k != "output.weight")
                  for k, v in init.items()}
        tokens, targets, pos = g.input((b, CTX), "i32"), g.input((b, CTX), "i32"), g.input((CTX,), "i32")
        sel = g.input((5, n))
        hidden = forward(Net(cfg, params), Inputs(tokens, pos), Options(head=False))
        if chunks == "fused":
            s = model_losses.sequence_nll(Net(cfg, params), hidden, targets, sel, 1, grad=True, fused=True)
        else:
            s = model_losses.sequence_nll(Net(cfg, params), hidden, targets, sel, chunks, grad=chunks > 1)
        loss = ops.sum(ops.mul(s, g.const(weights)))
        trained = [p for p in params.values() if p.requires_grad]
        grads = backward(loss, trained, checkpointing=False)
        rt = Runtime(g, CpuBackend(2))
        for t, v in ((tokens, tok), (targets, tgt), (pos, np.arange(CTX, dtype=np.int32)), (sel, select)):
            rt.set(t, v)
        plan = rt.compile([s] + [grads[p] for p in trained])
        rt.run(plan)
        got[chunks] = [plan.read(s)] + [plan.read(grads[p]) for p in trained]
    logits = np_decoder.forward(cfg, family_params(cfg, 0, std=0.1), tok, np.arange(CTX)).reshape(n, -1)
    lp = logits - logits.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    flat = tgt.reshape(-1)
    nll = np.where(flat >= 0, -lp[np.arange(n), np.maximum(flat, 0)], 0.0)
    np.testing.assert_allclose(got[1][0], select @ nll, rtol=1e-4, atol=1e-4)
    for one, three, fused in zip(got[1], got[3], got["fused"]):
        # absolute tolerance on the array's scale: a gradient element near cancellation (0.002
        # among terms of 10) keeps rounding of its terms' size, about 1e-7 of the largest
        atol = 1e-6 * max(1.0, float(np.abs(one).max()))
        np.testing.assert_allclose(three, one, rtol=1e-4, atol=atol)
        np.testing.assert_allclose(fused, one, rtol=1e-4, atol=atol)


def test_eval_task_during_finetune_scores_the_model_being_trained(tmp_path, story, pairs_file):
    """--eval-task: the task's accuracy every --eval-every updates and at the end, that of the
    written adapter under `eval --task --lora` (and above the base's)."""
    task = tmp_path / "task.jsonl"
    task.write_text("\n".join(json.dumps({"context": f"Who is {n}?", "choices": [f"{n} is a big dog that barks.",
                                                                                 f"{n} is a kid who likes to play."],
                                          "gold": 1}) for n in NAMES) + "\n")
    out, log = tmp_path / "a.gguf", tmp_path / "log.jsonl"
    r = run_cli("finetune", "--model", story, "--data", pairs_file, "--out", out, "--method", "dpo", "--steps", 12,
                "--lr", "3e-3", "--eval-every", 6, "--eval-task", task, "--log", log, *FAST)
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [x["step"] for x in lines if "task_acc" in x and "event" not in x] == [6]
    done = lines[-1]
    assert done["task_items"] == len(NAMES) and done["task_acc"] == 1.0
    after = run_cli("eval", "--model", story, "--lora", out, "--task", task, "--json", "--quiet")
    before = run_cli("eval", "--model", story, "--task", task, "--json", "--quiet")
    assert after.returncode == before.returncode == 0, after.stderr + before.stderr
    got = json.loads(after.stdout)
    assert {k: done[f"task_{k}"] for k in got} == got
    assert json.loads(before.stdout)["acc"] < 1.0
    assert "task accuracy 1.0000" in r.stderr


def test_dpo_on_two_processes_equals_one(tmp_path, story, pairs_file, mpiexec):
    """`mpiexec -n 2 --batch 1` against one process with --batch 2 (a pair a window at --ctx
    64): the same losses, rewards (summed over the processes) and adapter."""
    from tests.test_distributed import _run
    common = ["finetune", "--model", story, "--data", pairs_file, "--method", "dpo", "--steps", 4, "--ctx", 64,
              "--lora-rank", 4, "--lr", 3e-3, "--quiet", "--threads", 1]
    r = _run(*common, "--out", tmp_path / "one.gguf", "--log", tmp_path / "one.jsonl", "--batch", 2)
    assert r.returncode == 0, r.stderr
    r = _run(*common, "--out", tmp_path / "two.gguf", "--log", tmp_path / "two.jsonl", "--batch", 1,
             n=2, mpiexec=mpiexec)
    assert r.returncode == 0, r.stderr
    one, two = _steps(tmp_path / "one.jsonl"), _steps(tmp_path / "two.jsonl")
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        for key in ("loss", "rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    from ggtrain.formats.lora import read_lora
    a, b = read_lora(tmp_path / "one.gguf")[2], read_lora(tmp_path / "two.gguf")[2]
    for w in a:
        for x, y in zip(a[w], b[w]):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-4, err_msg=w)
