"""MNIST end to end: IDX reading, training on a subset, eval, model files, bad input."""
import gzip
import json
import subprocess
import sys

import gguf
import numpy as np
import pytest

from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models import mnist as model
from ggtrain.core.train_classifier import ClassifierConfig, ClassifierRun, classifier_data
from ggtrain.errors import FormatError
from ggtrain.formats.idx import load_mnist, read_idx
from ggtrain.formats.mnist import load_mnist_model, save_mnist_model


@pytest.fixture(scope="module")
def mnist(request):
    from tests.conftest import SHARED_DATA
    folder = SHARED_DATA / "mnist"
    if not folder.is_dir():
        pytest.skip(f"real MNIST files absent ({folder})")
    x, y = load_mnist(folder, "train")
    xt, yt = load_mnist(folder, "test")
    return folder, x, y, xt, yt


def test_real_idx_files_read(mnist):
    folder, x, y, xt, yt = mnist
    assert x.shape == (60000, 28, 28) and y.shape == (60000,)
    assert xt.shape == (10000, 28, 28) and x.dtype == np.float32 and 0 <= x.min() and x.max() == 1.0
    # label histograms from ../shared/data/README.md
    assert list(np.bincount(y)) == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert list(np.bincount(yt)) == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def _idx(tmp_path, name, payload, gz=False):
    p = tmp_path / name
    p.write_bytes(gzip.compress(payload) if gz else payload)
    return p


@pytest.mark.parametrize("payload, words", [
    (b"\x00\x00\x08\x01\x00\x00\x00\x05abc", "need 5 data bytes, file has 3"),
    (b"\x00\x00\x08\x01\x00\x00\x00\x02abcd", "need 2 data bytes, file has 4"),
    (b"\x01\x02\x08\x01\x00\x00\x00\x01a", "not an IDX file"),
    (b"\x00\x00\x07\x01\x00\x00\x00\x01a", "unknown IDX element type"),
    (b"\x00\x00\x08\x09", "dimension count 9"),
    (b"\x00\x00\x08\x03\x00\x00", "truncated IDX header"),
    (b"\x00\x00", "too short"),
    (b"\x00\x00\x08\x03\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "claim"),
])
def test_damaged_idx_names_file_and_problem(tmp_path, payload, words):
    p = _idx(tmp_path, "bad-idx1-ubyte", payload)
    with pytest.raises(FormatError) as info:
        read_idx(p)
    assert words in str(info.value) and str(p) in str(info.value)


def test_damaged_gzip_and_wrong_mnist_files(tmp_path):
    p = tmp_path / "x.gz"
    p.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x01a")[:-6])
    with pytest.raises(FormatError, match="gzip"):
        read_idx(p)
    # labels > 9 and count mismatch
    imgs = b"\x00\x00\x08\x03\x00\x00\x00\x02\x00\x00\x00\x1c\x00\x00\x00\x1c" + bytes(2 * 784)
    _idx(tmp_path, "train-images-idx3-ubyte.gz", imgs, gz=True)
    _idx(tmp_path, "train-labels-idx1-ubyte.gz", b"\x00\x00\x08\x01\x00\x00\x00\x02\x01\x0c", gz=True)
    with pytest.raises(FormatError, match="label 12"):
        load_mnist(tmp_path, "train")
    _idx(tmp_path, "train-labels-idx1-ubyte.gz", b"\x00\x00\x08\x01\x00\x00\x00\x03\x01\x02\x03", gz=True)
    with pytest.raises(FormatError, match="3 labels for 2 images"):
        load_mnist(tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="t10k images"):
        load_mnist(tmp_path, "test")


def _run(arch, x, y, batch, physical, epochs=1, seed=0, lr=1e-3):
    cfg = ClassifierConfig(epochs=epochs, batch=batch, physical_batch=physical, lr=lr, seed=seed, val_split=0.1)
    run = ClassifierRun(lambda p, t: model.forward(arch, p, t), model.init_params(arch, seed), (28, 28), cfg,
                        CpuBackend(2))
    return run, run.fit(*classifier_data(x, y, cfg, run.world))


@pytest.mark.parametrize("arch, n, epochs, want", [("fc", 5000, 2, 0.85), ("cnn", 4000, 2, 0.5)])
def test_short_run_beats_chance_and_eval_matches(mnist, arch, n, epochs, want):
    folder, x, y, xt, yt = mnist
    run, history = _run(arch, x[:n], y[:n], 100, 50, epochs=epochs, lr=3e-3)
    assert history[-1]["val_accuracy"] > want
    ev = run.evaluate(xt[:2000], yt[:2000])
    assert ev["accuracy"] > want and ev["n"] == 2000
    # evaluate reproduces the validation accuracy the run reported
    from ggtrain.core.train_classifier import split_train_val
    _, val = split_train_val(n, 0.1, 0)
    assert run.evaluate(x[:n][val], y[:n][val])["accuracy"] == history[-1]["val_accuracy"]


def test_accumulating_two_physical_batches_equals_one_logical(mnist):
    folder, x, y, xt, yt = mnist
    a, _ = _run("cnn", x[:600], y[:600], 100, 100)
    b, _ = _run("cnn", x[:600], y[:600], 100, 50)
    for name, value in a.param_values().items():
        # NOTE: the two sum the batch in a different order; Adam divides by sqrt(v), which
        # turns rounding of near-zero gradients into ~1e-6 parameter differences (lr 1e-3).
        np.testing.assert_allclose(b.param_values()[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("arch", ["fc", "cnn"])
def test_model_file_layout_read_by_gguf_py(tmp_path, arch):
    params = model.init_params(arch, 3)
    path = tmp_path / "m.gguf"
    save_mnist_model(path, arch, params, model.PARAM_SHAPES[arch])
    reader = gguf.GGUFReader(path)
    arch_field = reader.fields["general.architecture"]
    assert bytes(arch_field.parts[arch_field.data[0]]).decode() == f"mnist-{arch}"
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == set(model.PARAM_SHAPES[arch])
    for name, shape in model.PARAM_SHAPES[arch].items():
        t = tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert tuple(int(d) for d in t.shape) == tuple(reversed(shape))  # ggml ne order
        np.testing.assert_array_equal(np.asarray(t.data).reshape(shape), params[name])
    if arch == "fc":
        assert tuple(int(d) for d in tensors["fc1.weight"].shape) == (784, 500)
    else:
        assert tuple(int(d) for d in tensors["conv1.kernel"].shape) == (3, 3, 1, 8)
        assert tuple(int(d) for d in tensors["conv1.bias"].shape) == (1, 1, 8)
    got_arch, got = load_mnist_model(path, model.PARAM_SHAPES)
    assert got_arch == arch and all(np.array_equal(got[k], params[k]) for k in params)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]  # no temp file left


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ggtrain", *args], capture_output=True, text=True)


def test_cli_train_then_eval_reports_same_accuracy(mnist, tmp_path):
    folder = mnist[0]
    out, log = tmp_path / "fc.gguf", tmp_path / "run.jsonl"
    r = _cli("mnist", "train", "--arch", "fc", "--data", str(folder), "--out", str(out), "--limit", "3000",
             "--epochs", "1", "--batch", "100", "--physical-batch", "50", "--quiet", "--log", str(log))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(l) for l in log.read_text().splitlines()]
    assert lines[0]["event"] == "config" and lines[0]["options"]["limit"] == 3000
    assert {"step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "elapsed_s"} <= set(lines[1])
    assert lines[-1]["event"] == "done"
    r = _cli("mnist", "eval", "--model", str(out), "--data", str(folder), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert 0.7 < res["accuracy"] <= 1 and res["n"] == 10000 and res["accuracy_se"] > 0


def test_cli_rejects_bad_input(mnist, tmp_path, shared_data):
    folder = mnist[0]
    r = _cli("mnist", "eval", "--model", str(shared_data / "gguf" / "stories260K.gguf"), "--data", str(folder))
    assert r.returncode == 1 and "not an MNIST model" in r.stderr and "Traceback" not in r.stderr
    r = _cli("mnist", "eval", "--model", str(tmp_path / "nope.gguf"), "--data", str(folder))
    assert r.returncode == 1 and "nope.gguf" in r.stderr
    r = _cli("mnist", "train", "--data", str(tmp_path), "--out", str(tmp_path / "m.gguf"))
    assert r.returncode == 1 and "train images" in r.stderr
    r = _cli("mnist", "train", "--arch", "rnn", "--data", str(folder), "--out", str(tmp_path / "m.gguf"))
    assert r.returncode == 2 and "--arch" in r.stderr and "'fc', 'cnn'" in r.stderr   # a usage error
    r = _cli("mnist", "train", "--data", str(folder), "--out", str(tmp_path / "m.gguf"), "--batch", "300",
             "--physical-batch", "200")
    assert r.returncode == 1 and "--physical-batch" in r.stderr
    assert not (tmp_path / "m.gguf").exists()


def test_cli_runs_on_the_bundled_subset_without_data(tmp_path):
    out = tmp_path / "m.gguf"
    r = _cli("mnist", "train", "--out", str(out), "--limit", "1000", "--epochs", "1", "--batch", "100",
             "--physical-batch", "100", "--quiet")
    assert r.returncode == 0, r.stderr
    r = _cli("mnist", "eval", "--model", str(out), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n"] == 1000
