"""Importance matrices as llama-imatrix collects them (core/models/importance.py, `ggtrain
imatrix`), without llama.cpp: every family's sums against the float64 numpy twin's inputs of
each block product (tests/np_decoder.py), the command's file as our reader and gguf-py read
it, and the input it refuses (one line, exit 1, nothing written). tests/test_imatrix_interop.py
compares the files with llama-imatrix's own."""
import gguf
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig, init_params
from ggtrain.core.models.importance import MIN_ROWS, importance_sums
from ggtrain.formats.imatrix import read_imatrix
from ggtrain.formats.model_file import save_model
from ggtrain.formats.tokenizer import load_tokenizer
from tests import np_decoder
from tests.conftest import write_shakespeare
from tests.family_cases import TINY, TINY_CASES
from tests.interop import run_cli
from tests.test_decoder import family_params

FAMILIES = [pytest.param(kw, id=name) for name, kw in TINY_CASES.items()]


@pytest.mark.parametrize("kw", [{}] + FAMILIES, ids=lambda kw: "llama" if not kw else None)
def test_importance_sums_are_the_numpy_twins(kw):
    """Per block matrix, the sums of its input's squared columns over 3 windows (each from an
    empty context) are the float64 twin's, to f32 rounding; the q, k and v of one input alike;
    the count is the tokens; no entry for the embedding or the output matrix. Stacked experts:
    per expert the sums over the rows routed to it and their count (some experts none)."""
    cfg = ModelConfig(**{**TINY, **kw})
    t = cfg.ctx
    assert t >= MIN_ROWS
    init = family_params(cfg, seed=3, std=0.1)
    rng = np.random.default_rng(4)
    windows = [rng.integers(0, cfg.vocab, t).astype(np.int32) for _ in range(3)]
    sums, counts = importance_sums(cfg, init, CpuBackend(2), windows)
    taps = {}
    for w in windows:
        np_decoder.forward(cfg, init, w[None], np.arange(t), taps=taps)
    assert sorted(sums) == sorted(taps)
    assert not any(n.startswith(("token_embd", "output")) for n in sums)
    for name, inputs in taps.items():
        if name.endswith("_exps.weight"):       # [per expert, [one token's row]]
            assert sums[name].shape == (cfg.experts, init[name].shape[-1]) and sums[name].dtype == np.float32
            np.testing.assert_array_equal(counts[name], [len(rows) for rows in inputs], err_msg=name)
            assert counts[name].sum() == 3 * t * cfg.experts_used
            want = np.array([sum(r ** 2 for r in rows) if rows else np.zeros(sums[name].shape[1]) for rows in inputs])
            np.testing.assert_allclose(sums[name], want, rtol=2e-5, atol=1e-7, err_msg=name)
            continue
        np.testing.assert_array_equal(counts[name], [3 * t], err_msg=name)
        assert len(inputs) == 3, name
        want = sum((x.reshape(-1, x.shape[-1]) ** 2).sum(0) for x in inputs)
        assert sums[name].dtype == np.float32
        np.testing.assert_allclose(sums[name], want, rtol=2e-5, atol=1e-7, err_msg=name)


def test_windows_of_other_lengths_are_refused():
    cfg = ModelConfig(**TINY)
    init = init_params(cfg, seed=0)
    with pytest.raises(ValueError, match="chunk 1 has 15 tokens, the first 16"):
        importance_sums(cfg, init, CpuBackend(1), [np.zeros(16, np.int32), np.zeros(15, np.int32)])
    with pytest.raises(ValueError, match="16..16"):
        importance_sums(cfg, init, CpuBackend(1), [np.zeros(8, np.int32)])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random F32 llama of context 32 with a byte vocabulary that asks for BOS."""
    tok = load_tokenizer("byte", "First Citizen: Before we proceed any further, hear me speak.")
    path = tmp_path_factory.mktemp("importance") / "m.gguf"
    config = dict(vocab=tok.n_vocab, dim=64, layers=2, heads=4, kv_heads=2, ff=96, ctx=32)
    save_model(path, config, init_params(ModelConfig(**config), seed=5, std=0.05), tok, out_type="f32")
    return path


def test_imatrix_file_reads_back(tmp_path, model):
    """`ggtrain imatrix`: llama-imatrix's GGUF layout as gguf-py reads it (general.type imatrix,
    the dataset as named, chunk_count and chunk_size UINT32, per matrix W.in_sum2 (n_cols,) and
    W.counts (1,) F32 in name order), and read_imatrix gives sums / count as llama-quantize does;
    --chunks 2 of a longer text sums the first two chunks, each starting with BOS: the sums of
    importance_sums over those windows, bit for bit (the command adds nothing of its own)."""
    text = write_shakespeare(tmp_path / "t.txt", 3000)
    out = tmp_path / "im.gguf"
    r = run_cli("imatrix", "--model", model, "--data", text, "--out", out, "--ctx", 32, "--chunks", 2, "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrote {out}: the importance of 14 matrices over 2 chunks of 32 tokens"
    reader = gguf.GGUFReader(str(out))
    fields = {f.name: f for f in reader.fields.values()}
    assert fields["general.type"].contents() == "imatrix"
    assert fields["imatrix.datasets"].contents() == [str(text)]
    for key in ("imatrix.chunk_count", "imatrix.chunk_size"):
        assert fields[key].types == [gguf.GGUFValueType.UINT32]
    assert fields["imatrix.chunk_count"].contents() == 2 and fields["imatrix.chunk_size"].contents() == 32
    names = [t.name for t in reader.tensors]
    weights = sorted(n[:-len(".in_sum2")] for n in names if n.endswith(".in_sum2"))
    assert names == [n + s for n in weights for s in (".in_sum2", ".counts")]
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    counts = {t.name: np.array(t.data) for t in reader.tensors if t.name.endswith(".counts")}
    assert all(c.shape == (1,) and c[0] == 64 for c in counts.values())

    from ggtrain.formats.model_file import open_model
    be = CpuBackend(2)
    config, weights, tok = open_model(model, be)
    ids = tok.encode(text.read_text(), add_bos=True)
    windows = [np.concatenate([[tok.bos_id], ids[i * 32 + 1:(i + 1) * 32]]).astype(np.int32) for i in range(2)]
    assert ids[0] == tok.bos_id and ids[32] != tok.bos_id
    sums, counts = importance_sums(ModelConfig(**config), weights, be, windows)
    count = 64
    assert all(list(c) == [count] for c in counts.values())
    im = read_imatrix(out)
    assert sorted(im.values) == sorted(sums) == weights_in(model)
    for t in reader.tensors:
        if t.name.endswith(".in_sum2"):
            np.testing.assert_array_equal(np.array(t.data), sums[t.name[:-len(".in_sum2")]])
    for name, s in sums.items():
        np.testing.assert_array_equal(im.values[name], s / np.float32(count))


def weights_in(model) -> list:
    """The block matrices of a model file, sorted."""
    from ggtrain.formats.gguf import read_gguf
    return sorted(n for n, i in read_gguf(model).tensors.items() if n.startswith("blk.") and len(i.shape) == 2)


def _refused(tmp_path, *args, words=()):
    out = tmp_path / "im.gguf"
    r = run_cli("imatrix", "--out", out, *args)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert str(w) in lines[0], (w, lines[0])
    assert not out.exists() and not list(tmp_path.glob("im.gguf*"))


def test_bad_input_is_refused_in_one_line(tmp_path, model):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("x" * 50)          # 51 tokens with BOS: less than two chunks of 32
    text = write_shakespeare(tmp_path / "t.txt", 2000)
    _refused(tmp_path, "--model", model, "--data", empty, "--ctx", 32, words=("--data", "empty"))
    _refused(tmp_path, "--model", model, "--data", short, "--ctx", 32, words=("51 tokens", "at least 64"))
    _refused(tmp_path, "--model", model, "--data", tmp_path / "none.txt", "--ctx", 32, words=("--data", "none.txt"))
    _refused(tmp_path, "--model", model, "--data", text, "--ctx", 64, words=("--ctx 64", "16..32"))
    _refused(tmp_path, "--model", model, "--data", text, "--ctx", 8, words=("--ctx 8",))
    _refused(tmp_path, "--model", model, "--data", text, "--ctx", 32, "--chunks", 0, words=("--chunks 0",))
    _refused(tmp_path, "--model", tmp_path / "none.gguf", "--data", text, words=("--model",))
    folder = tmp_path / "folder"
    folder.mkdir()
    r = run_cli("imatrix", "--model", model, "--data", text, "--out", folder, "--ctx", 32)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "is a folder" in r.stderr, r.stderr
    assert not any(folder.iterdir())
