"""MNIST training speed: ggtrain vs an equivalent PyTorch CPU model, measured in one sitting.

Same architecture, N(0, 0.01^2) init, batches (logical 1000 = 2 physical 500 with
gradient accumulation), AdamW(1e-3), 2 threads. PyTorch runs in its own venv
(bench/.venv-torch, created on first use with torch==2.13.0; never a ggtrain
dependency), as a process that stays up and times one epoch per command, so the two
sides alternate epoch by epoch (a noisy moment hits both) with the FP32 peak (bench/peak.py)
sampled between them. Prints the best seconds per epoch of each side, the ratio
ours/PyTorch (lower is better), and our GFLOP/s (the graph's count of an update's products
and convolutions) as a fraction of the peak.

    python bench/bench_mnist.py [--rounds 3] [--threads 2] [--arch fc,cnn]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from peak import Peak  # noqa: E402
from torch_venv import TorchProcess  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "mnist"
# a side's idle threads spin a while after its epoch (PyTorch's pool, ours): let them sleep
_SPIN_S = 0.2

TORCH_SCRIPT = r"""
import json, sys, time
import numpy as np, torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
torch.manual_seed(0)
dev = args.get("device", "cpu")
d = np.load(args["data"])
X = torch.from_numpy(d["x"]).reshape(-1, 1, 28, 28).to(dev); Y = torch.from_numpy(d["y"]).long().to(dev)
arch = args["arch"]
if arch == "fc":
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 500), torch.nn.ReLU(), torch.nn.Linear(500, 10))
else:
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                                torch.nn.Flatten(), torch.nn.Linear(784, 10))
model = model.to(dev)
with torch.no_grad():
    for p in model.parameters():
        p.normal_(0.0, 0.01)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
lossf = torch.nn.CrossEntropyLoss()
n = len(Y) // 1000 * 1000
def epoch(updates):
    perm = torch.randperm(len(Y), device=dev)
    for u in range(updates):
        opt.zero_grad(set_to_none=False)
        for j in range(2):
            idx = perm[(2 * u + j) * 500:(2 * u + j + 1) * 500]
            loss = lossf(model(X[idx]), Y[idx]) / 2
            loss.backward()
        opt.step()
    return float(loss.detach())    # (on a GPU: waits for it)
epoch(5)  # warm-up
print("ready", flush=True)
for line in sys.stdin:  # one timed epoch per command
    t = time.perf_counter(); epoch(n // 1000)
    print(json.dumps({"epoch_s": time.perf_counter() - t}), flush=True)
"""


class TorchSide(TorchProcess):
    """The PyTorch process: set up and warmed up once, then one timed epoch per call (on its
    CPU threads, or device "cuda": bench/cuda_check.py)."""

    def __init__(self, arch, threads, data_file, device="cpu"):
        super().__init__(TORCH_SCRIPT, {"arch": arch, "threads": threads, "data": data_file, "device": device},
                         threads)

    def epoch(self) -> float:
        return self.ask("epoch")["epoch_s"]


class OursSide:
    """Our classifier run on the same data, warmed up; one timed epoch per call (on `threads`
    CPU threads, or the backend given: bench/cuda_check.py's GPU)."""

    def __init__(self, arch, threads, x, y, backend=None):
        from ggtrain.core.backend_cpu import CpuBackend
        from ggtrain.core.models import mnist as model
        from ggtrain.core.train_classifier import ClassifierConfig, ClassifierRun

        cfg = ClassifierConfig(epochs=1, val_split=0.0)
        self.run = ClassifierRun(lambda p, t: model.forward(arch, p, t), model.init_params(arch, 0), (28, 28), cfg,
                                 backend or CpuBackend(threads))
        self.x, self.y = x, y
        self.n = len(y) // 1000 * 1000
        self.perm = np.random.default_rng(0).permutation(len(y))
        self._updates(5)

    def batches(self, u: int) -> list:
        """Update u's two physical batches, as ClassifierRun.fit feeds them: images gathered
        straight into the input buffer."""
        from ggtrain.core.graph import Rows

        x, y, perm, run = self.x, self.y, self.perm, self.run
        return [{run.x: Rows(x, perm[(2 * u + j) * 500:(2 * u + j + 1) * 500]),
                 run.y: y[perm[(2 * u + j) * 500:(2 * u + j + 1) * 500]]} for j in range(2)]

    def _updates(self, count):
        for u in range(count):
            self.run.step.step(self.batches(u), 1e-3)

    def epoch(self) -> float:
        t = time.perf_counter()
        self._updates(self.n // 1000)
        return time.perf_counter() - t

    @property
    def flop_per_epoch(self) -> float:
        return self.run.flop_per_sample * self.n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="alternating timed epochs of each side")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arch", default="fc,cnn")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ggtrain.formats.idx import load_mnist
    x, y = load_mnist(DATA, "train")
    x, y = x[:57000], y[:57000]  # the training split's size (95% of 60000)
    peak = Peak(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, "mnist.npz")
        np.savez(data_file, x=x, y=y)
        for arch in args.arch.split(","):
            ours, theirs = OursSide(arch, args.threads, x, y), TorchSide(arch, args.threads, data_file)
            t_ours, t_torch = [], []
            for _ in range(args.rounds):
                time.sleep(_SPIN_S)
                t_ours.append(ours.epoch())
                time.sleep(_SPIN_S)
                t_torch.append(theirs.epoch())
                peak.sample()
            theirs.close()
            rows.append((arch, min(t_ours), min(t_torch), ours.flop_per_epoch))
    print(f"{peak.describe()}; best of {args.rounds} alternating epochs")
    print(f"{'model':<6} {'ours s/epoch':>13} {'torch s/epoch':>14} {'ratio':>7} {'ours GFLOP/s':>13} {'%peak':>6}")
    for arch, t_ours, t_torch, flops in rows:
        gf = flops / t_ours / 1e9
        print(f"{arch:<6} {t_ours:>13.3f} {t_torch:>14.3f} {t_ours / t_torch:>7.2f} {gf:>13.1f} "
              f"{peak.percent(gf):>5.0f}%")


if __name__ == "__main__":
    main()
