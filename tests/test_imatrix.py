"""Importance matrices (formats.imatrix, convert-checkpoint --imatrix) without llama.cpp: the
files llama-imatrix writes (GGUF, written here with gguf-py, and the legacy .dat) read as
llama-quantize reads them, and the files and options it refuses, each one line naming the file
(and the tensor), exit 1, nothing written. tests/test_imatrix_interop.py compares the quantized
models with llama.cpp's."""
import struct

import gguf
import numpy as np
import pytest

from ggtrain.core.models.config import ModelConfig, init_params
from ggtrain.formats.gguf import read_gguf
from ggtrain.formats.imatrix import read_imatrix
from ggtrain.formats.model_file import save_model
from ggtrain.formats.tokenizer import load_tokenizer
from tests.interop import run_cli

SMALL = dict(dim=256, layers=2, heads=4, kv_heads=2, ff=512, ctx=32)


def write_imatrix_gguf(path, entries: dict, datasets=("data.txt",), chunk_count=4, chunk_size=64, keys=True):
    """An imatrix in llama-imatrix's GGUF layout, by gguf-py: entries {weight: (sums (n_mat, n),
    counts (n_mat,))} as W.in_sum2 (n_mat, n) and W.counts (n_mat, 1), F32."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "imatrix")
    if keys:
        w.add_array("imatrix.datasets", list(datasets))
        w.add_uint32("imatrix.chunk_count", chunk_count)
        w.add_uint32("imatrix.chunk_size", chunk_size)
    for name, (sums, counts) in sorted(entries.items()):
        w.add_tensor(f"{name}.in_sum2", np.asarray(sums, np.float32))
        w.add_tensor(f"{name}.counts", np.asarray(counts, np.float32).reshape(-1, 1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_imatrix_dat(path, entries: dict, chunk_count=None, dataset=None):
    """An imatrix in llama-imatrix's legacy layout: entries {weight: (ncall, values (n,))}."""
    out = struct.pack("<i", len(entries))
    for name, (ncall, values) in entries.items():
        values = np.asarray(values, "<f4")
        out += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", ncall, values.size) + values.tobytes()
    if chunk_count is not None:
        out += struct.pack("<i", chunk_count)
        if dataset is not None:
            out += struct.pack("<i", len(dataset)) + dataset.encode()
    path.write_bytes(out)
    return path


def model_entries(model, rng, counts=(64.0,)) -> dict:
    """Random sums for every block matrix of `model` (as llama-imatrix has them: not the token
    embedding, not the output), for write_imatrix_gguf."""
    f = read_gguf(model)
    return {n: ((rng.random((len(counts), i.shape[-1])) ** 3 * 50).astype(np.float32), np.asarray(counts))
            for n, i in f.tensors.items() if n.startswith("blk.") and len(i.shape) == 2}


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    tok = load_tokenizer("byte", "First Citizen: Before we proceed any further, hear me speak.")
    path = tmp_path_factory.mktemp("imatrix") / "small.gguf"
    config = dict(vocab=tok.n_vocab, **SMALL)
    save_model(path, config, init_params(ModelConfig(**config), seed=2, std=0.02), tok, out_type="f32")
    return path


def test_gguf_imatrix_reads_as_llama_quantize_reads_it(tmp_path):
    """Importance = in_sum2 / count per matrix (f32 division), 1 for a matrix of count 0;
    the datasets and chunk count come along; tensors that are not sums or counts are ignored."""
    rng = np.random.default_rng(0)
    sums = rng.random((3, 64)).astype(np.float32) * 100
    entries = {"blk.0.attn_q.weight": (sums[:1], [7]), "blk.0.ffn_down_exps.weight": (sums, [5, 0, 3])}
    im = read_imatrix(write_imatrix_gguf(tmp_path / "im.gguf", entries, datasets=("a.txt", "b.txt"), chunk_count=9))
    assert sorted(im.values) == sorted(entries)
    assert np.array_equal(im.values["blk.0.attn_q.weight"], sums[0] / np.float32(7))
    per = [sums[0] / np.float32(5), np.ones(64, np.float32), sums[2] / np.float32(3)]
    assert np.array_equal(im.values["blk.0.ffn_down_exps.weight"], np.concatenate(per))
    assert im.datasets == ("a.txt", "b.txt") and im.chunk_count == 9
    assert im.importance("blk.0.ffn_down_exps.weight", (3, 8, 64)).shape == (3, 64)
    assert im.importance("blk.0.attn_v.weight", (8, 64)) is None      # no entry: quantized without


def test_legacy_imatrix_reads_as_llama_quantize_reads_it(tmp_path):
    """Legacy entries are means times ncall: importance = values / ncall (values as they are for
    ncall 0); the trailing chunk count and dataset are optional."""
    v = np.random.default_rng(1).random(32).astype(np.float32) * 10
    im = read_imatrix(write_imatrix_dat(tmp_path / "im.dat", {"blk.1.attn_k.weight": (3, v), "x": (0, v)}, 12,
                                        "wiki.txt"))
    assert np.array_equal(im.values["blk.1.attn_k.weight"], v / np.float32(3))
    assert np.array_equal(im.values["x"], v)
    assert im.datasets == ("wiki.txt",) and im.chunk_count == 12
    bare = read_imatrix(write_imatrix_dat(tmp_path / "bare.dat", {"y": (1, v)}))
    assert bare.datasets == () and bare.chunk_count == 0


def _refused(tmp_path, model, *options, words=()):
    out = tmp_path / "out.gguf"
    r = run_cli("convert-checkpoint", model, out, *options)
    assert r.returncode == 1, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert str(w) in lines[0], (w, lines[0])
    assert not out.exists() and not list(tmp_path.glob("out.gguf*"))
    return lines[0]


def test_unreadable_imatrix_files_are_refused(tmp_path, small_model):
    rng = np.random.default_rng(2)
    entries = model_entries(small_model, rng)
    q = "blk.0.attn_q.weight"
    text = tmp_path / "notes.txt"
    text.write_text("not an importance matrix\n" * 4)
    nan = dict(entries)
    nan[q] = (entries[q][0].copy(), entries[q][1])
    nan[q][0][0, 5] = np.nan
    cases = {
        "text": (text, ()),
        "missing": (tmp_path / "absent.gguf", ("no such file",)),
        "no keys": (write_imatrix_gguf(tmp_path / "nokeys.gguf", entries, keys=False), ("imatrix.datasets",)),
        "nan": (write_imatrix_gguf(tmp_path / "nan.gguf", nan), (q, "non-finite")),
        "truncated dat": (tmp_path / "cut.dat", ("ends",)),
    }
    full = write_imatrix_dat(tmp_path / "full.dat", {q: (1, entries[q][0][0])})
    cases["truncated dat"][0].write_bytes(full.read_bytes()[:-9])
    g = gguf.GGUFWriter(str(tmp_path / "nocounts.gguf"), "llama")
    for k, v in (("imatrix.chunk_count", 1), ("imatrix.chunk_size", 64)):
        g.add_uint32(k, v)
    g.add_array("imatrix.datasets", ["t.txt"])
    g.add_tensor(f"{q}.in_sum2", entries[q][0])
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    cases["no counts"] = (tmp_path / "nocounts.gguf", (q, "counts"))
    for label, (path, words) in cases.items():
        line = _refused(tmp_path, small_model, "--out-type", "q4_k_m", "--imatrix", path, words=(path, *words))
        assert line.startswith("--imatrix") or "--imatrix" in line, (label, line)


def test_imatrix_of_another_model_is_refused(tmp_path, small_model):
    """An entry whose length is not the tensor's columns names the file and the tensor; a file
    none of whose entries names a matrix of the model says so; neither writes anything."""
    rng = np.random.default_rng(3)
    entries = model_entries(small_model, rng)
    wrong = dict(entries)
    wrong["blk.1.ffn_down.weight"] = (rng.random((1, 256)).astype(np.float32), [64])       # its rows are 512
    path = write_imatrix_gguf(tmp_path / "wrong.gguf", wrong)
    _refused(tmp_path, small_model, "--out-type", "q4_k_m", "--imatrix", path,
             words=(path, "blk.1.ffn_down.weight", "256", "512"))
    other = {n.replace("blk.", "layers."): v for n, v in entries.items()}
    path = write_imatrix_gguf(tmp_path / "other.gguf", other)
    _refused(tmp_path, small_model, "--out-type", "q6_k", "--imatrix", path, words=(path, "another model"))


def test_imatrix_options_that_do_not_fit_are_refused(tmp_path, small_model):
    """--imatrix without --out-type; Q2_K_S without an importance matrix (llama.cpp refuses it:
    its Q2_K matrices need one), or with one that lacks an entry of a Q2_K matrix."""
    entries = model_entries(small_model, np.random.default_rng(4))
    path = write_imatrix_gguf(tmp_path / "im.gguf", entries)
    _refused(tmp_path, small_model, "--imatrix", path, words=("--imatrix", "--out-type"))
    _refused(tmp_path, small_model, "--out-type", "q2_k_s", words=("q2_k_s", "Q2_K", "--imatrix"))
    del entries["blk.1.attn_q.weight"]
    path = write_imatrix_gguf(tmp_path / "lacking.gguf", entries)
    _refused(tmp_path, small_model, "--out-type", "q2_k_s", "--imatrix", path, words=(path, "blk.1.attn_q.weight"))


def test_imatrix_summary_counts_the_weighted_matrices(tmp_path, small_model):
    entries = model_entries(small_model, np.random.default_rng(5))
    del entries["blk.0.attn_k.weight"]
    path = write_imatrix_gguf(tmp_path / "im.gguf", entries)
    out = tmp_path / "q.gguf"
    r = run_cli("convert-checkpoint", small_model, out, "--out-type", "q4_k_m", "--imatrix", path)
    assert r.returncode == 0, r.stderr
    n = sum(1 for name, i in read_gguf(out).tensors.items() if len(i.shape) == 2)   # every matrix is quantized
    assert f"importance matrix {path} ({len(entries)} of {n} quantized matrices have an entry)" in r.stdout, r.stdout
    f = read_gguf(out)
    assert f.value("quantize.imatrix.file") == str(path)
    assert f.value("quantize.imatrix.dataset") == "data.txt"
    assert f.value("quantize.imatrix.entries_count") == len(entries)
    assert f.value("quantize.imatrix.chunks_count") == 4


def test_finetune_takes_imatrix_with_out_type_only(tmp_path, small_model):
    """finetune --imatrix is read before training: without --out-type it is refused at once."""
    path = write_imatrix_gguf(tmp_path / "im.gguf", model_entries(small_model, np.random.default_rng(6)))
    data = tmp_path / "d.txt"
    data.write_text("First Citizen: Before we proceed any further, hear me speak. " * 20)
    r = run_cli("finetune", "--model", small_model, "--data", data, "--out", tmp_path / "a.gguf", "--imatrix", path)
    assert r.returncode == 1 and "--imatrix" in r.stderr and "--out-type" in r.stderr, r.stderr
    assert not (tmp_path / "a.gguf").exists()
