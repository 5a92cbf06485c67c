"""MNIST training speed: ggtrain vs an equivalent PyTorch CPU model, measured in one run.

Same architecture, N(0, 0.01^2) init, batches (logical 1000 = 2 physical 500 with
gradient accumulation), AdamW(1e-3), 2 threads. PyTorch runs in its own venv
(bench/.venv-torch, created on first use with torch==2.13.0; never a ggtrain
dependency). Prints seconds per epoch and the ratio ours/PyTorch (lower is better).

    python bench/bench_mnist.py [--epochs 2] [--threads 2] [--arch fc,cnn]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from torch_venv import ensure_torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "mnist"

TORCH_SCRIPT = r"""
import json, sys, time
import numpy as np, torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
torch.manual_seed(0)
d = np.load(args["data"])
X = torch.from_numpy(d["x"]).reshape(-1, 1, 28, 28); Y = torch.from_numpy(d["y"]).long()
arch = args["arch"]
if arch == "fc":
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 500), torch.nn.ReLU(), torch.nn.Linear(500, 10))
else:
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(784, 10))
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.01)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
lossf = torch.nn.CrossEntropyLoss()
n = len(Y) // 1000 * 1000
def epoch(updates):
    perm = torch.randperm(len(Y))
    for u in range(updates):
        opt.zero_grad(set_to_none=False)
        for j in range(2):
            idx = perm[(2 * u + j) * 500:(2 * u + j + 1) * 500]
            loss = lossf(model(X[idx]), Y[idx]) / 2
            loss.backward()
        opt.step()
    return float(loss)
epoch(5)  # warm-up
times = []
for _ in range(args["epochs"]):
    t = time.perf_counter(); epoch(n // 1000); times.append(time.perf_counter() - t)
print(json.dumps({"epoch_s": min(times), "all": times}))
"""


def run_torch(arch, threads, epochs, data_file):
    py = ensure_torch()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out = subprocess.run([str(py), "-c", TORCH_SCRIPT,
                          json.dumps({"arch": arch, "threads": threads, "epochs": epochs, "data": data_file})],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["epoch_s"]


def run_ours(arch, threads, epochs, x, y):
    from ggtrain.core.backend_cpu import CpuBackend
    from ggtrain.core.models import mnist as model
    from ggtrain.core.train import ClassifierConfig, ClassifierRun

    cfg = ClassifierConfig(epochs=1, val_split=0.0)
    run = ClassifierRun(lambda p, t: model.forward(arch, p, t), model.init_params(arch, 0), (28, 28), cfg,
                        CpuBackend(threads), n_threads=threads)
    n = len(y) // 1000 * 1000
    perm = np.random.default_rng(0).permutation(len(y))

    def epoch(updates):
        for u in range(updates):
            batches = [{run.x: x[perm[(2 * u + j) * 500:(2 * u + j + 1) * 500]],
                        run.y: y[perm[(2 * u + j) * 500:(2 * u + j + 1) * 500]]} for j in range(2)]
            run.step.step(batches, 1e-3)

    epoch(5)
    times = []
    for _ in range(epochs):
        t = time.perf_counter()
        epoch(n // 1000)
        times.append(time.perf_counter() - t)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arch", default="fc,cnn")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ggtrain.formats.idx import load_mnist
    x, y = load_mnist(DATA, "train")
    x, y = x[:57000], y[:57000]  # the training split's size (95% of 60000)
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, "mnist.npz")
        np.savez(data_file, x=x, y=y)
        print(f"{'model':<6} {'ours s/epoch':>13} {'torch s/epoch':>14} {'ratio':>7}   ({args.threads} threads)")
        for arch in args.arch.split(","):
            ours = run_ours(arch, args.threads, args.epochs, x, y)
            torch_s = run_torch(arch, args.threads, args.epochs, data_file)
            print(f"{arch:<6} {ours:>13.3f} {torch_s:>14.3f} {ours / torch_s:>7.2f}")


if __name__ == "__main__":
    main()
