"""KV-cached decoding against whole-window forward passes, and the sampler against its
definitions (llama.cpp's sampler chain)."""
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig, init_params
from ggtrain.core.models.inference import Decoder, Runner, generate
from ggtrain.core.sampling import Sampler
from ggtrain.errors import ConfigError
from tests import np_decoder as np_llama

# GQA (4 query heads on 2 KV heads), partial rotary dims, not tied
CFG = ModelConfig(vocab=61, dim=32, layers=2, heads=4, kv_heads=2, ff=48, ctx=96, rope_dims=4)


@pytest.fixture(scope="module")
def tiny():
    return init_params(CFG, seed=3, std=0.3)


def _window_logits(weights, ids, cfg=CFG):
    """Logits at every position of ids from one whole-window pass (no cache)."""
    runner = Runner(cfg, weights, CpuBackend(2), length=len(ids))
    return runner.logits(np.asarray(ids, np.int32)[None])[0, :len(ids)]


@pytest.mark.parametrize("chunk", [256, 5])
def test_cached_logits_equal_window_logits(tiny, chunk):
    """Prompt in chunks (5: several plans), then one token at a time from position 13 to 79:
    the logits after each token equal the whole-window pass's at that position, and one plan
    per count of tokens fed serves every position (each attends over the whole cache)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, CFG.vocab, 80).tolist()
    want = _window_logits(tiny, ids)
    dec = Decoder(CFG, tiny, CpuBackend(2), n_ctx=80, chunk=chunk)
    got = [dec.feed(ids[:13])]
    for t in ids[13:]:
        got.append(dec.feed([t]))
    got = np.stack(got)
    np.testing.assert_allclose(got, want[12:], rtol=1e-4, atol=1e-4)
    assert dec.n_past == 80
    assert sorted(t for t, _ in dec._plans) == ([1, 3, 5] if chunk == 5 else [1, 13])
    with pytest.raises(ConfigError, match="exceed the context of 80"):
        dec.feed([1])


def test_cached_logits_equal_numpy_oracle(tiny):
    ids = [5, 17, 3, 60, 0, 22, 9]
    want = np_llama.forward(CFG, tiny, np.array([ids]), np.arange(len(ids)))[0]
    dec = Decoder(CFG, tiny, CpuBackend(1), n_ctx=16)
    got = np.stack([dec.feed(ids[:4])] + [dec.feed([t]) for t in ids[4:]])
    np.testing.assert_allclose(got, want[3:], rtol=1e-4, atol=1e-4)


def test_reset_reuses_the_cache(tiny):
    dec = Decoder(CFG, tiny, CpuBackend(2), n_ctx=40)
    first = dec.feed([1, 2, 3, 4])
    dec.feed([7, 7, 7])
    dec.reset()
    np.testing.assert_array_equal(dec.feed([1, 2, 3, 4]), first)


def test_generate_greedy_and_stop(tiny):
    """Greedy generation is the argmax of the window logits at each step, and stops after a
    stop token (which it yields)."""
    prompt = [4, 8, 15]
    dec = Decoder(CFG, tiny, CpuBackend(2), n_ctx=40)
    ids = list(generate(dec, prompt, 20, Sampler(temp=0)))
    assert len(ids) == 20
    seq = prompt + ids
    want = _window_logits(tiny, seq)[len(prompt) - 1:-1].argmax(-1)
    assert ids == want.tolist()
    stop = ids[5]
    first = ids.index(stop)
    assert list(generate(dec, prompt, 20, Sampler(temp=0), frozenset({stop}))) == ids[:first + 1]
    # n < 0: until a stop token or a full cache (10 positions hold the prompt and 7 tokens;
    # the logits after the last of them give an 8th)
    assert len(list(generate(Decoder(CFG, tiny, CpuBackend(2), n_ctx=10), prompt, -1, Sampler(temp=0)))) == 8


def test_decoder_bad_input(tiny):
    dec = Decoder(CFG, tiny, CpuBackend(1), n_ctx=8)
    with pytest.raises(ConfigError, match="token id"):
        dec.feed([CFG.vocab])
    with pytest.raises(ConfigError, match="nothing"):
        dec.feed([])
    with pytest.raises(ConfigError, match="no tokens"):
        list(generate(dec, [], 3, Sampler(temp=0)))


# ---- the sampler ---------------------------------------------------------------------------

def _softmax(z):
    p = np.exp(z - z.max())
    return p / p.sum()


def _draws(sampler, logits, n=4000, history=()):
    return np.bincount([sampler(logits, history) for _ in range(n)], minlength=logits.size) / n


def test_greedy_is_argmax_after_penalty():
    z = np.array([1.0, 3.0, 2.9, -1.0])
    assert Sampler(temp=0)(z) == 1
    # llama.cpp's penalty: 3.0 / 1.5 = 2.0 < 2.9, so id 2 wins once id 1 was seen
    assert Sampler(temp=0, repeat_penalty=1.5)(z, [1]) == 2
    # negative logits are multiplied: -1 * 10 keeps id 3 last
    assert Sampler(temp=0, repeat_penalty=10.0)(np.array([-1.0, -2.0]), [0]) == 1
    # only the last repeat_last_n ids count
    assert Sampler(temp=0, repeat_penalty=1.5, repeat_last_n=1)(z, [1, 0]) == 1


def test_sampling_follows_the_filtered_softmax():
    """Frequencies of 4000 seeded draws within 4 sigma of each filter's distribution."""
    z = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    cases = [
        (dict(top_k=0, top_p=1.0, min_p=0.0), [0, 1, 2, 3, 4, 5]),
        (dict(top_k=3, top_p=1.0, min_p=0.0), [0, 1, 2]),
        (dict(top_k=0, top_p=0.7, min_p=0.0), [0, 1, 2]),       # 0.4 + 0.25 < 0.7 <= 0.8
        (dict(top_k=0, top_p=1.0, min_p=0.3), [0, 1, 2]),       # p >= 0.3 * 0.4 = 0.12
        # top-p over what top-k kept, renormalized (0.5, 0.31, 0.19): two reach 0.75, not three
        (dict(top_k=3, top_p=0.75, min_p=0.0), [0, 1]),
    ]
    for kw, keep in cases:
        want = np.zeros(z.size)
        want[keep] = _softmax(z[keep])
        got = _draws(Sampler(temp=1.0, seed=1, **kw), z)
        sigma = np.sqrt(want * (1 - want) / 4000) + 1e-9
        assert (np.abs(got - want) <= 4 * sigma + 1e-12).all(), (kw, got, want)
    # temperature 0.5 squares the odds
    got = _draws(Sampler(temp=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=2), z)
    want = _softmax(2 * z)
    assert (np.abs(got - want) <= 4 * np.sqrt(want * (1 - want) / 4000) + 1e-9).all()


def test_seeded_sampling_is_reproducible():
    z = np.random.default_rng(0).normal(size=50)
    s1, s2 = Sampler(temp=1.0, seed=7), Sampler(temp=1.0, seed=7)
    draws = [s1(z) for _ in range(30)]
    assert draws == [s2(z) for _ in range(30)]
    s3 = Sampler(temp=1.0, seed=8)
    assert draws != [s3(z) for _ in range(30)]


@pytest.mark.parametrize("kw", [dict(temp=-1), dict(top_p=0), dict(min_p=1.5), dict(repeat_penalty=0),
                                dict(repeat_last_n=-1)])
def test_sampler_rejects_bad_settings(kw):
    with pytest.raises(ConfigError):
        Sampler(**kw)
