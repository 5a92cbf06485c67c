"""Data-parallel training (`mpiexec -n 2 ggtrain ...`): two processes equal one with the doubled
batch, rank 0 alone writes, checkpoints resume on another number of processes, and a failing,
killed, stuck or interrupted process stops the run cleanly. Needs the `dp` extra (mpi4py and
the MPICH wheel's mpiexec); without it these tests skip, except in CI (CI=true), where they fail."""
import importlib.util
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ggtrain.core.distributed import World, launched
from ggtrain.core.train import TextConfig
from ggtrain.errors import ConfigError
from ggtrain.formats.model_file import load_model

TINY = ["--dim", "32", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ff", "64", "--ctx", "32",
        "--warmup", "3", "--lr", "3e-3", "--quiet", "--threads", "1"]
GGTRAIN = [sys.executable, "-m", "ggtrain"]


@pytest.fixture(scope="module")
def mpiexec():
    """The mpiexec of the dp extra (beside this Python, else on PATH), with mpi4py importable."""
    exe = pathlib.Path(sys.executable).parent / "mpiexec"
    exe = str(exe) if exe.exists() else shutil.which("mpiexec")
    problem = None
    if importlib.util.find_spec("mpi4py") is None:
        problem = "mpi4py is not installed"
    elif exe is None:
        problem = "no mpiexec beside python or on PATH"
    if problem:
        msg = f"{problem}; install the dp extra: pip install -e '.[dp]'"
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the data-parallel tests: " + msg, pytrace=False)
        pytest.skip(msg)
    return exe


def _run(*args, n: int = 1, mpiexec: str | None = None, **kw):
    cmd = ([mpiexec, "-n", str(n)] if n > 1 else []) + GGTRAIN + [str(a) for a in args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def _log(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(path) -> dict:
    return {e["step"]: e["loss"] for e in _log(path) if "loss" in e}


def _close(a: dict, b: dict, rtol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=rtol, atol=1e-6, err_msg=str(k))


# ---- without a launcher -----------------------------------------------------------------


def test_a_plain_run_is_one_process_and_never_imports_mpi4py(tmp_path, text):
    code = ("import sys; from ggtrain.cli.main import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('mpi4py' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MV2_"))}
    r = subprocess.run([sys.executable, "-c", code, "train", "--data", str(text), "--out", str(tmp_path / "m.gguf"),
                        "--steps", "1", "--batch", "2", *TINY], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False" and "data parallel" not in r.stderr


def test_launcher_environment(monkeypatch):
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK",
                "MV2_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert launched() == (0, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert launched() == (3, 4)
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("PMI_SIZE", "x")
    with pytest.raises(ConfigError, match="PMI_SIZE"):
        launched()


def test_shard_takes_the_rank_rows_of_a_global_batch():
    batch = np.arange(24).reshape(6, 4)
    parts = [World(r, 3).shard(batch) for r in range(3)]
    np.testing.assert_array_equal(np.concatenate(parts), batch)
    assert [p.shape for p in parts] == [(2, 4)] * 3
    d = World(1, 2).shard({"tokens": batch, "targets": -batch})
    np.testing.assert_array_equal(d["targets"], -batch[3:])
    with pytest.raises(ConfigError, match="6 rows cannot be split over 4"):
        World(0, 4).shard(batch)


def test_a_resumed_run_keeps_its_global_batch():
    cfg = TextConfig(steps=10, batch=4, world=2)
    assert cfg.on(1).batch == 8 and cfg.on(4).batch == 2 and cfg.on(4).global_batch == 8
    with pytest.raises(ConfigError, match="global batch of 8 .* over 3 processes"):
        cfg.on(3)


# ---- two processes ----------------------------------------------------------------------


def test_two_processes_equal_one_with_the_doubled_batch(tmp_path, text, mpiexec):
    """Per-step losses, validation losses and the model of `mpiexec -n 2 --batch 4` equal the
    single process with --batch 8; one log, one model, checkpoints from rank 0 only; the
    checkpoint resumes on one process (batch 8) and on two (4 each) to the same model."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    common = ["--data", text, "--steps", 6, "--eval-every", 3, *TINY]
    r1 = _run("train", "--out", one / "m.gguf", "--log", one / "log.jsonl", "--batch", 8, *common)
    assert r1.returncode == 0, r1.stderr
    r2 = _run("train", "--out", two / "m.gguf", "--log", two / "log.jsonl", "--batch", 4,
              "--checkpoint-dir", two / "ck", "--save-every", 3, *common, n=2, mpiexec=mpiexec)
    assert r2.returncode == 0, r2.stderr
    assert "data parallel over 2 processes" in r2.stderr
    assert r2.stderr.count("done: ran all 6 updates") == 1        # rank 0 alone reports

    log1, log2 = _log(one / "log.jsonl"), _log(two / "log.jsonl")
    assert [e.get("step") for e in log2] == [e.get("step") for e in log1]   # one writer: no duplicate line
    _close(_losses(one / "log.jsonl"), _losses(two / "log.jsonl"))
    val1 = [e["val_loss"] for e in log1 if "val_loss" in e]
    val2 = [e["val_loss"] for e in log2 if "val_loss" in e]
    np.testing.assert_allclose(val2, val1, rtol=1e-5)
    assert log2[-1]["event"] == "done" and log2[-1]["tokens_seen"] == log1[-1]["tokens_seen"]
    _, w1, _ = load_model(one / "m.gguf")
    _, w2, _ = load_model(two / "m.gguf")
    _close(w1, w2)
    assert sorted(p.name for p in two.iterdir()) == ["ck", "log.jsonl", "m.gguf"]   # no second model, no temp
    assert sorted(p.name for p in (two / "ck").iterdir()) == ["ckpt-000003.gguf", "ckpt-000006.gguf"]

    # the data cursor is global: resume on one process, and on two, from update 3
    ckpt = two / "ck" / "ckpt-000003.gguf"
    r = _run("train", "--out", tmp_path / "r1.gguf", "--log", tmp_path / "r1.jsonl", "--resume", ckpt, *common)
    assert r.returncode == 0, r.stderr
    r = _run("train", "--out", tmp_path / "r2.gguf", "--log", tmp_path / "r2.jsonl", "--resume", ckpt, *common,
             n=2, mpiexec=mpiexec)
    assert r.returncode == 0, r.stderr
    later = {k: v for k, v in _losses(two / "log.jsonl").items() if k > 3}
    for name in ("r1", "r2"):
        _close(_losses(tmp_path / f"{name}.jsonl"), later)
        _close(load_model(tmp_path / f"{name}.gguf")[1], w2)
    # resumed on the same two processes: bit for bit
    assert (tmp_path / "r2.gguf").read_bytes() == (two / "m.gguf").read_bytes()
    # a global batch of 8 cannot be shared by 3 processes
    r = _run("train", "--out", tmp_path / "r3.gguf", "--resume", ckpt, *common, n=3, mpiexec=mpiexec)
    assert r.returncode != 0 and "cannot be split over 3 processes" in r.stderr


def test_mnist_on_two_processes_equals_one(tmp_path, mpiexec):
    common = ["mnist", "train", "--limit", 600, "--epochs", 2, "--val-split", 0.1, "--threads", 1, "--quiet"]
    r = _run(*common, "--out", tmp_path / "one.gguf", "--log", tmp_path / "one.jsonl",
             "--batch", 180, "--physical-batch", 90)
    assert r.returncode == 0, r.stderr
    r = _run(*common, "--out", tmp_path / "two.gguf", "--log", tmp_path / "two.jsonl",
             "--batch", 90, "--physical-batch", 45, n=2, mpiexec=mpiexec)
    assert r.returncode == 0, r.stderr
    one, two = _log(tmp_path / "one.jsonl"), _log(tmp_path / "two.jsonl")
    assert len(one) == len(two)
    for a, b in zip(one, two):
        for k in ("loss", "val_loss", "train_loss", "train_accuracy", "val_accuracy"):
            if a.get(k) is not None:
                np.testing.assert_allclose(b[k], a[k], rtol=1e-5, err_msg=k)
    from ggtrain.core.models.mnist import PARAM_SHAPES
    from ggtrain.formats.mnist import load_mnist_model
    _close(load_mnist_model(tmp_path / "one.gguf", PARAM_SHAPES)[1], load_mnist_model(tmp_path / "two.gguf", PARAM_SHAPES)[1])


def _evals(path) -> dict:
    return {e["step"]: e["evals"] for e in _log(path) if "evals" in e}


def test_lbfgs_on_two_processes_equals_one_and_resumes(tmp_path, text, mpiexec):
    """L-BFGS: every line-search evaluation all-reduces the gradient and the loss, so both
    processes take the single process's decisions: the same evaluations per update, its
    losses and model; its checkpoint (the history) resumes on two processes bit for bit and
    on one to the same model."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    # lr 1 (L-BFGS's first trial step; TINY's 3e-3 is AdamW's): the searches then decide by
    # margins far above the rounding in which one and two processes differ
    common = ["--data", text, "--steps", 5, "--eval-every", 5, "--optimizer", "lbfgs", *TINY, "--lr", 1]
    r1 = _run("train", "--out", one / "m.gguf", "--log", one / "log.jsonl", "--batch", 8, *common)
    assert r1.returncode == 0, r1.stderr
    r2 = _run("train", "--out", two / "m.gguf", "--log", two / "log.jsonl", "--batch", 4,
              "--checkpoint-dir", two / "ck", "--save-every", 3, *common, n=2, mpiexec=mpiexec)
    assert r2.returncode == 0, r2.stderr
    evals = _evals(one / "log.jsonl")
    assert evals == _evals(two / "log.jsonl") and len(evals) == 5 and max(evals.values()) > 1
    _close(_losses(one / "log.jsonl"), _losses(two / "log.jsonl"))
    _close(load_model(one / "m.gguf")[1], load_model(two / "m.gguf")[1])
    ckpt = two / "ck" / "ckpt-000003.gguf"
    r = _run("train", "--out", tmp_path / "r2.gguf", "--resume", ckpt, *common, n=2, mpiexec=mpiexec)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "r2.gguf").read_bytes() == (two / "m.gguf").read_bytes()
    r = _run("train", "--out", tmp_path / "r1.gguf", "--resume", ckpt, *common)
    assert r.returncode == 0, r.stderr
    _close(load_model(tmp_path / "r1.gguf")[1], load_model(two / "m.gguf")[1])

    # full batch (mnist, --batch beyond the split): updates after the first reuse the last evaluation
    mnist = ["mnist", "train", "--limit", 600, "--epochs", 4, "--val-split", 0.2, "--threads", 1, "--quiet",
             "--optimizer", "lbfgs"]
    r = _run(*mnist, "--out", tmp_path / "one.gguf", "--log", tmp_path / "one.jsonl",
             "--batch", 480, "--physical-batch", 240)
    assert r.returncode == 0, r.stderr
    r = _run(*mnist, "--out", tmp_path / "two.gguf", "--log", tmp_path / "two.jsonl",
             "--batch", 120000, "--physical-batch", 120, n=2, mpiexec=mpiexec)
    assert r.returncode == 0, r.stderr
    assert "a full batch of 480 (240 on each of 2 processes)" in r.stderr
    evals = _evals(tmp_path / "one.jsonl")
    assert evals == _evals(tmp_path / "two.jsonl") and list(evals.values())[1:] == [1, 1, 1]
    _close(_losses(tmp_path / "one.jsonl"), _losses(tmp_path / "two.jsonl"))
    from ggtrain.core.models.mnist import PARAM_SHAPES
    from ggtrain.formats.mnist import load_mnist_model
    _close(load_mnist_model(tmp_path / "one.gguf", PARAM_SHAPES)[1],
           load_mnist_model(tmp_path / "two.gguf", PARAM_SHAPES)[1])


def test_finetune_on_two_processes_equals_one(tmp_path, shared_data, mpiexec):
    story = shared_data / "gguf" / "stories260K.gguf"
    data = tmp_path / "t.txt"
    data.write_text("Tom had a red kite. The kite flew high over the park and Tom laughed. " * 40)
    common = ["finetune", "--model", story, "--data", data, "--steps", 4, "--ctx", 64, "--lora-rank", 4,
              "--lr", 3e-3, "--quiet", "--threads", 1]
    r = _run(*common, "--out", tmp_path / "one.gguf", "--log", tmp_path / "one.jsonl", "--batch", 2)
    assert r.returncode == 0, r.stderr
    r = _run(*common, "--out", tmp_path / "two.gguf", "--log", tmp_path / "two.jsonl", "--batch", 1,
             n=2, mpiexec=mpiexec)
    assert r.returncode == 0, r.stderr
    _close(_losses(tmp_path / "one.jsonl"), _losses(tmp_path / "two.jsonl"))
    from ggtrain.formats.lora import read_lora
    a, b = read_lora(tmp_path / "one.gguf")[2], read_lora(tmp_path / "two.gguf")[2]
    assert a.keys() == b.keys() and a
    # NOTE: B starts at zero, so early gradients have elements near zero, where Adam's
    # m / sqrt(v) turns float rounding into differences of up to ~lr x 1e-2 (seen: 1.6e-5)
    for w in a:
        for x, y in zip(a[w], b[w]):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-4, err_msg=w)


# ---- failures -----------------------------------------------------------------------------


def _start(tmp_path, mpiexec, text, env=None):
    """A long two-process run; returns (process, stderr file, rank 1's pid) once it trains."""
    err = tmp_path / "err.txt"
    log = tmp_path / "log.jsonl"
    f = open(err, "w")
    p = subprocess.Popen([mpiexec, "-n", "2", *GGTRAIN, "train", "--data", str(text), "--out",
                          str(tmp_path / "m.gguf"), "--steps", "100000", "--batch", "2", "--log", str(log),
                          "--checkpoint-dir", str(tmp_path / "ck"), *TINY], stderr=f,
                         env={**os.environ, **(env or {})})
    deadline = time.time() + 120
    while time.time() < deadline and not (log.exists() and log.read_text().count("\n") >= 3):
        time.sleep(0.05)
    m = re.search(r"\b1: (\d+)@", err.read_text())
    assert m, err.read_text()
    return p, f, err, int(m.group(1))


def _running(marker: str) -> list:
    """Pids of live processes whose command line mentions marker."""
    found = []
    for d in pathlib.Path("/proc").iterdir():
        try:
            if d.name.isdigit() and marker in (d / "cmdline").read_bytes().decode(errors="replace") \
                    and "Z" not in (d / "stat").read_text().split(")")[-1].split()[0]:
                found.append(int(d.name))
        except OSError:
            pass
    return found


def test_a_failing_rank_stops_every_rank_with_its_error(tmp_path, text, mpiexec):
    """Rank 1 alone is given a file that does not exist (MPMD): one line names it and the rank.
    And a usage error, which ends rank 1 before MPI starts there, does not leave rank 0 waiting."""
    def mpmd(rank1: list) -> subprocess.CompletedProcess:
        rank0 = ["train", "--data", str(text), "--out", str(tmp_path / "m.gguf"), "--steps", "1000", *TINY]
        t0 = time.time()
        r = subprocess.run([mpiexec, "-n", "1", *GGTRAIN, *rank0, ":", "-n", "1", *GGTRAIN, *rank0, *rank1],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and time.time() - t0 < 30
        return r

    r = mpmd(["--data", str(tmp_path / "nope.txt")])     # the last --data counts
    # (the line's start: another rank's output may follow it before a newline in the merged stream)
    assert re.search(r"^error: rank 1: --data .*nope\.txt: no such file", r.stderr, re.M), r.stderr
    assert not (tmp_path / "m.gguf").exists()
    r = mpmd(["--steps", "abc"])
    assert "Invalid value for '--steps'" in r.stderr


def test_a_killed_rank_ends_the_run_within_seconds(tmp_path, text, mpiexec):
    p, f, err, pid = _start(tmp_path, mpiexec, text)
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    p.wait(timeout=60)
    f.close()
    assert time.time() - t0 < 10 and p.returncode != 0
    out = err.read_text()
    assert re.search(rf"^error: rank 1 \(pid {pid}\) was killed by SIGKILL; stopping every process$", out, re.M), out
    assert not (tmp_path / "m.gguf").exists()
    time.sleep(0.5)
    assert not _running(str(tmp_path / "m.gguf")), "processes of the run are left"


def test_a_stuck_rank_ends_the_run_after_the_timeout(tmp_path, text, mpiexec):
    p, f, err, pid = _start(tmp_path, mpiexec, text, env={"GGTRAIN_DP_TIMEOUT": "2"})
    os.kill(pid, signal.SIGSTOP)   # alive, but never answers again
    t0 = time.time()
    try:
        p.wait(timeout=60)
    finally:
        f.close()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert time.time() - t0 < 15 and p.returncode != 0
    assert re.search(r"^error: rank 0: .* waited more than 2 s", err.read_text(), re.M), err.read_text()


def test_ctrl_c_on_mpiexec_saves_one_checkpoint_that_resumes(tmp_path, text, mpiexec):
    p, f, err, _ = _start(tmp_path, mpiexec, text)
    p.send_signal(signal.SIGINT)
    p.wait(timeout=60)
    f.close()
    assert p.returncode == 130, err.read_text()
    saved = sorted((tmp_path / "ck").iterdir())
    assert len(saved) == 1, saved
    step = int(saved[0].name[5:11])
    log = _log(tmp_path / "log.jsonl")
    assert log[-1] == {"event": "interrupted", "step": step, "checkpoint": str(saved[0])}
    assert err.read_text().count("interrupted at update") == 1
    r = _run("train", "--data", text, "--out", tmp_path / "m.gguf", "--resume", saved[0], "--steps", step + 2,
             *TINY, n=2, mpiexec=mpiexec)
    assert r.returncode == 0, r.stderr
    assert f"done: ran all {step + 2} updates" in r.stderr


@pytest.fixture
def text(shakespeare):
    return shakespeare
