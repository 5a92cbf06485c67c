"""Packing samples into rows and batching them: core/data.py's pack, PackedBatches, split_samples.

Oracles: hand-written rows for tiny samples; the samples themselves (every row segment read
back is a whole sample, every trained (token, target) pair appears exactly once); a plain
first-fit loop; an uninterrupted run for resuming.
"""
from collections import Counter

import numpy as np
import pytest

from ggtrain.core.data import PackedBatches, _first_fit, pack, split_samples
from ggtrain.errors import ConfigError, ShapeError


def S(ids, train):
    return np.array(ids, np.int32), np.array(train, bool)


def test_pack_by_hand():
    samples = [S([1, 2, 3, 4], [0, 0, 1, 1]),     # 3 positions: targets -, 3, 4
               S([5, 6, 7], [0, 1, 1]),           # 2 positions: fits after the first
               S([8, 9], [0, 1])]                 # 1 position: next row (the first is full)
    data, stats = pack(samples, ctx=5)
    np.testing.assert_array_equal(data.tokens, [[1, 2, 3, 5, 6], [8, 0, 0, 0, 0]])
    np.testing.assert_array_equal(data.targets, [[-1, 3, 4, 6, 7], [9, -1, -1, -1, -1]])
    np.testing.assert_array_equal(data.pos, [[0, 1, 2, 0, 1], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(data.seg, [[0, 0, 0, 1, 1], [0, -1, -1, -1, -1]])
    for a in (data.tokens, data.targets, data.pos, data.seg):
        assert a.dtype == np.int32 and a.shape == (2, 5)
    assert stats.as_dict() == dict(samples=3, packed=3, truncated=0, dropped=0, empty=0, rows=2,
                                   tokens=6, trained=5, padding=4)


def test_first_fit_goes_back_to_earlier_rows():
    # lengths (positions) 4, 3, 2, 1 in ctx 5: [4, 1] [3, 2]
    samples = [S(range(10, 15), [1] * 5), S(range(20, 24), [1] * 4), S(range(30, 33), [1] * 3),
               S(range(40, 42), [1] * 2)]
    data, stats = pack(samples, ctx=5)
    np.testing.assert_array_equal(data.tokens, [[10, 11, 12, 13, 40], [20, 21, 22, 30, 31]])
    np.testing.assert_array_equal(data.seg, [[0, 0, 0, 0, 1], [0, 0, 0, 1, 1]])
    assert stats.padding == 0


def test_no_packing_one_sample_per_row():
    samples = [S([1, 2, 3], [0, 1, 1]), S([4, 5], [0, 1])]
    data, stats = pack(samples, ctx=4, packing=False)
    np.testing.assert_array_equal(data.tokens, [[1, 2, 0, 0], [4, 0, 0, 0]])
    np.testing.assert_array_equal(data.targets, [[2, 3, -1, -1], [5, -1, -1, -1]])
    np.testing.assert_array_equal(data.seg, [[0, 0, -1, -1], [0, -1, -1, -1]])
    assert (stats.rows, stats.tokens, stats.padding) == (2, 3, 5)


def test_truncation_drop_and_empty_counts():
    long = S(range(1, 9), [1] * 8)                 # 8 tokens > ctx + 1 = 5
    prompt_only = S([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 0, 1, 1])   # trained part cut off
    ok = S([1, 2], [0, 1])
    data, stats = pack([long, prompt_only, ok], ctx=4)
    assert (stats.samples, stats.packed, stats.truncated, stats.dropped, stats.empty) == (3, 2, 2, 0, 1)
    np.testing.assert_array_equal(data.tokens[0], [1, 2, 3, 4])       # the first ctx + 1 tokens
    np.testing.assert_array_equal(data.targets[0], [2, 3, 4, 5])
    data, stats = pack([long, prompt_only, ok], ctx=4, drop_long=True)
    assert (stats.packed, stats.truncated, stats.dropped, stats.empty) == (1, 0, 2, 0)
    # exactly ctx + 1 tokens fill a row and are not truncated
    data, stats = pack([S(range(1, 6), [1] * 5)], ctx=4)
    assert (stats.truncated, stats.padding, stats.trained) == (0, 0, 4)


def test_nothing_to_train_is_a_config_error():
    with pytest.raises(ConfigError, match="no token to train on: of 2 samples, 2 have no trained token"):
        pack([S([1, 2, 3], [1, 0, 0]), S([4], [1])], ctx=8)
    with pytest.raises(ConfigError, match=r"1 longer than that were dropped \(--drop-long\)"):
        pack([S(range(1, 20), [1] * 19)], ctx=8, drop_long=True)
    with pytest.raises(ShapeError, match="differ in length"):
        pack([S([1, 2], [1])], ctx=8)


def _random_samples(rng, n, ctx):
    """Samples whose tokens name them (sample i's tokens are 1000 * i + j), so a packed
    row tells where each token came from."""
    out = []
    for i in range(n):
        length = int(rng.integers(1, ctx + 8))
        ids = 1000 * (i + 1) + np.arange(length)
        out.append(S(ids, rng.random(length) < 0.6))
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_packing_loses_and_invents_nothing(packing):
    rng = np.random.default_rng(0)
    ctx = 16
    samples = _random_samples(rng, 200, ctx)
    data, stats = pack(samples, ctx, packing=packing)
    kept = {}
    for ids, train in samples:
        ids, train = ids[:ctx + 1], train[:ctx + 1]
        if train[1:].any():
            kept[int(ids[0]) // 1000] = (ids, train)
    # every trained (input, target, position) of the kept samples, once; nothing else
    want = Counter((int(ids[j]), int(ids[j + 1]), j) for ids, train in kept.values()
                   for j in range(len(ids) - 1) if train[j + 1])
    got = Counter(zip(data.tokens[data.targets >= 0].tolist(), data.targets[data.targets >= 0].tolist(),
                      data.pos[data.targets >= 0].tolist()))
    assert got == want
    # each (row, seg) is one whole sample's inputs, in order, with targets only within it
    seen = []
    for r in range(data.rows):
        segs = data.seg[r]
        used = segs >= 0
        assert not used[np.argmin(used):].any() or used.all()      # padding only at the end
        for s in np.unique(segs[used]):
            at = np.flatnonzero(segs == s)
            assert np.array_equal(at, np.arange(at[0], at[-1] + 1))
            i = int(data.tokens[r, at[0]]) // 1000
            ids, train = kept[i]
            np.testing.assert_array_equal(data.tokens[r, at], ids[:-1])
            np.testing.assert_array_equal(data.targets[r, at], np.where(train[1:], ids[1:], -1))
            np.testing.assert_array_equal(data.pos[r, at], np.arange(len(at)))
            seen.append(i)
        assert (data.tokens[r, ~used] == 0).all() and (data.targets[r, ~used] == -1).all()
    assert sorted(seen) == sorted(kept)
    assert stats.packed == len(kept) and stats.trained == sum(want.values())
    assert stats.tokens + stats.padding == data.rows * ctx
    if packing:
        assert data.rows < len(kept)
    else:
        assert data.rows == len(kept)


def test_first_fit_equals_the_plain_loop():
    rng = np.random.default_rng(1)
    for ctx in (1, 7, 64):
        lengths = rng.integers(1, ctx + 1, 300).tolist()
        free, want = [], []
        for n in lengths:
            for r, f in enumerate(free):
                if f >= n:
                    break
            else:
                r = len(free)
                free.append(ctx)
            free[r] -= n
            want.append(r)
        assert _first_fit(lengths, ctx) == want


def _packed(rows=10, ctx=4):
    samples = [S([100 + r] * (ctx + 1), [1] * (ctx + 1)) for r in range(rows)]
    return pack(samples, ctx)[0]       # row r holds tokens 100 + r


def test_batches_cover_every_row_once_per_epoch():
    data = _packed(rows=12)
    b = PackedBatches(data, batch=4, seed=3)
    assert b.batches_per_epoch == 3
    epochs = []
    for _ in range(2):
        rows = np.concatenate([b.next()["tokens"][:, 0] for _ in range(3)]) - 100
        assert sorted(rows.tolist()) == list(range(12))
        epochs.append(rows.tolist())
    assert epochs[0] != epochs[1]                          # reshuffled each epoch
    assert b.epoch == 2.0
    batch = b.next()
    assert set(batch) == {"tokens", "targets", "pos", "seg"}
    assert all(v.shape == (4, 4) and v.dtype == np.int32 for v in batch.values())


def test_batches_span_epochs_and_are_seeded():
    data = _packed(rows=5)
    b = PackedBatches(data, batch=3, seed=0)
    assert b.batches_per_epoch == 2                        # ceil(5 / 3): every row at least once
    rows = np.concatenate([b.next()["tokens"][:, 0] for _ in range(10)]) - 100
    for e in range(6):
        assert sorted(rows[5 * e:5 * e + 5].tolist()) == list(range(5))
    assert b.epoch == 6.0
    again = PackedBatches(data, batch=3, seed=0)
    np.testing.assert_array_equal(np.concatenate([again.next()["tokens"][:, 0] for _ in range(10)]) - 100, rows)
    other = PackedBatches(data, batch=3, seed=1)
    assert not np.array_equal(np.concatenate([other.next()["tokens"][:, 0] for _ in range(10)]) - 100, rows)


def test_batches_resume_exactly():
    data = _packed(rows=7)
    whole = PackedBatches(data, batch=3, seed=5)
    want = [whole.next() for _ in range(9)]
    first = PackedBatches(data, batch=3, seed=5)
    for _ in range(4):
        first.next()
    state = first.state()
    resumed = PackedBatches(data, batch=3, seed=99)        # the state carries the seed
    resumed.set_state(state)
    assert resumed.epoch == first.epoch
    for w in want[4:]:
        got = resumed.next()
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])
    with pytest.raises(ConfigError, match="trained on 7 packed rows, this data packs into 5"):
        PackedBatches(_packed(rows=5), batch=3, seed=5).set_state(state)


def test_split_samples():
    samples = [S([i, i + 1], [0, 1]) for i in range(100)]
    train, val = split_samples(samples, 0.1, seed=0)
    assert (len(train), len(val)) == (90, 10)
    ids = [int(s[0][0]) for s in train], [int(s[0][0]) for s in val]
    assert sorted(ids[0] + ids[1]) == list(range(100))
    assert ids[0] == sorted(ids[0]) and ids[1] == sorted(ids[1])      # order kept
    again = split_samples(samples, 0.1, seed=0)
    assert [int(s[0][0]) for s in again[1]] == ids[1]
    assert [int(s[0][0]) for s in split_samples(samples, 0.1, seed=1)[1]] != ids[1]
    whole, none = split_samples(samples, 0.0, seed=0)
    assert list(whole) == samples and len(none) == 0
    with pytest.raises(ConfigError, match=r"--val-split 0.001 of 100 samples holds no sample"):
        split_samples(samples, 0.001, seed=0)
    with pytest.raises(ConfigError, match=r"--val-split must be in \[0, 1\)"):
        split_samples(samples, 1.0, seed=0)
