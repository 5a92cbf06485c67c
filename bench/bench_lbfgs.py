"""Full-batch L-BFGS on MNIST FC: ggtrain vs torch.optim.LBFGS, measured in one run.

Same model (784-500-10), the same initial weights (ggtrain's init), the same full batch of
N training images, history 6, strong Wolfe line search, first trial step 1, K iterations.
PyTorch runs in its own venv (bench/.venv-torch, see torch_venv.py). Prints, for each, the
loss after K iterations, the forward+backward evaluations it took, and seconds per
evaluation; the ratios are ours / PyTorch (time: lower is better); then our GFLOP/s (an
evaluation's FLOPs: the graph's count of the products of one forward and backward over the
batch) as a fraction of the FP32 peak measured in the same run (bench/peak.py).

    python bench/bench_lbfgs.py [--images 10000] [--iterations 20] [--threads 2]
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
from peak import Peak  # noqa: E402
from torch_venv import ensure_torch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "mnist"

TORCH_SCRIPT = r"""
import json, sys, time
import numpy as np, torch
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
d = np.load(args["data"])
X = torch.from_numpy(d["x"]).reshape(-1, 784); Y = torch.from_numpy(d["y"]).long()
model = torch.nn.Sequential(torch.nn.Linear(784, 500), torch.nn.ReLU(), torch.nn.Linear(500, 10))
with torch.no_grad():
    model[0].weight.copy_(torch.from_numpy(d["fc1.weight"])); model[0].bias.copy_(torch.from_numpy(d["fc1.bias"]))
    model[2].weight.copy_(torch.from_numpy(d["fc2.weight"])); model[2].bias.copy_(torch.from_numpy(d["fc2.bias"]))
lossf = torch.nn.CrossEntropyLoss()
evals = [0]
def closure():
    evals[0] += 1
    opt.zero_grad()
    loss = lossf(model(X), Y)
    loss.backward()
    return loss
opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=args["iterations"], max_eval=10 * args["iterations"],
                        history_size=6, line_search_fn="strong_wolfe", tolerance_grad=0.0, tolerance_change=0.0)
t = time.perf_counter()
opt.step(closure)
elapsed = time.perf_counter() - t
with torch.no_grad():
    loss = float(lossf(model(X), Y))
print(json.dumps({"loss": loss, "evals": evals[0], "s": elapsed}))
"""


def run_torch(threads, iterations, data_file):
    py = ensure_torch()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out = subprocess.run([str(py), "-c", TORCH_SCRIPT,
                          json.dumps({"threads": threads, "iterations": iterations, "data": data_file})],
                         capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_ours(threads, iterations, x, y, init):
    from ggtrain.core.backend_cpu import CpuBackend
    from ggtrain.core.models import mnist as model
    from ggtrain.core.train_classifier import ClassifierConfig, ClassifierRun

    physical = 1000 if len(y) % 1000 == 0 else len(y)
    cfg = ClassifierConfig(epochs=1, batch=len(y), physical_batch=physical, val_split=0.0, optimizer="lbfgs",
                           lr=1.0)
    run = ClassifierRun(lambda p, t: model.forward("fc", p, t), init, (28, 28), cfg, CpuBackend(threads))
    k = len(y) // physical
    batches = [{run.x: x[j * physical:(j + 1) * physical], run.y: y[j * physical:(j + 1) * physical]}
               for j in range(k)]
    evals = 0
    t = time.perf_counter()
    for i in range(iterations):
        run.step.step(batches, 1.0, same_batch=i > 0)
        evals += run.step.last_search["evals"]
    elapsed = time.perf_counter() - t
    return {"loss": run.evaluate(x, y)["loss"], "evals": evals, "s": elapsed, "flop_per_eval": run.step.flops}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=10000)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from ggtrain.core.models import mnist as model
    from ggtrain.formats.idx import load_mnist
    x, y = load_mnist(DATA, "train")
    x, y = x[:args.images], y[:args.images]
    init = model.init_params("fc", 0)
    peak = Peak(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, "mnist.npz")
        np.savez(data_file, x=x, y=y, **init)
        ours = run_ours(args.threads, args.iterations, x, y, init)
        peak.sample()
        ref = run_torch(args.threads, args.iterations, data_file)
        peak.sample()
    print(f"full-batch L-BFGS, MNIST FC, {args.images} images, {args.iterations} iterations, {args.threads} threads")
    print(f"{'':<8} {'loss':>8} {'evals':>6} {'s/eval':>8}")
    for name, r in (("ggtrain", ours), ("pytorch", ref)):
        print(f"{name:<8} {r['loss']:>8.4f} {r['evals']:>6} {r['s'] / r['evals']:>8.3f}")
    print(f"ratio    {ours['loss'] / ref['loss']:>8.2f} {ours['evals'] / ref['evals']:>6.2f} "
          f"{(ours['s'] / ours['evals']) / (ref['s'] / ref['evals']):>8.2f}")
    gf = ours["flop_per_eval"] / (ours["s"] / ours["evals"]) / 1e9
    print(f"ours: {gf:.1f} GFLOP/s = {peak.percent(gf):.0f}% of {peak.describe()}")


if __name__ == "__main__":
    main()
