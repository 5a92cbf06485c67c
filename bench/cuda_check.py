"""The CUDA backend on a GPU machine, in one run: every op, the commands end to end, the speed.

Run on the device machine (bench/cuda_prepare.sh builds both libraries here, fetches the wheels
it lacks, and prints the commands that put them and this checkout on its PYTHONPATH, then run
this script):

    python3 bench/cuda_check.py [--out DIR] [--skip-ops] [--skip-e2e] [--skip-bench] [--mnist DIR]
                                [--smollm2 FILE --chat FILE]

1. Ops: the op-table and kernel tests (OP_TESTS) with the CUDA backend (GGTRAIN_TEST_BACKEND=cuda):
   every case forward against float64 numpy with the case's tolerance, backward against finite
   differences, every kernel's own tests; a junit XML of them goes to --out.
2. End to end, CUDA against the CPU, the same seeds: `mnist train` (fc, 2 epochs; the
   validation losses within 1e-3 relative, the parameters within 1e-3 absolute; cnn, 1 epoch);
   a LoRA `finetune` of stories260K Q8_0 (carried in .gpu-data/: the stored-type matmul on the
   device; 12 updates, every loss within 1e-3), then `generate` (greedy text equal) and `eval`
   (perplexity within 1e-4) with its adapter in f32; `train` of a small llama (20 updates; every
   update's loss within 1e-3 relative); a checkpoint written on CUDA at update 10 resumed on
   the CPU and the reverse (the losses of updates 11-20 within 1e-3 of the uninterrupted run's).
   NCCL with one rank (the all-reduce of a device buffer leaves it as it was).
3. Speed against PyTorch eager on the same GPU (same weights, batches, AdamW): llama configs a
   and b of bench/bench_llama.py and a dim 1024 / 16-layer / ctx 1024 model in tokens/s, and
   the fraction of the GPU's f32 peak (H100 SXM: 67 TFLOP/s without tensor cores), all f32;
   then the 1024 model with TF32 GEMMs on both sides (PyTorch's float32 matmul precision
   "high"), and PyTorch's bf16 autocast beside it, and ours with bf16 operands (cuda-bf16)
   against the same autocast; and one update of the --profile config by
   kernel and by node (GPU time between CUDA events). Each tensor-core precision also trains
   the small llama (every loss within its bound of the CPU's), and reads a product's inputs as
   it says (the product nearest the float64 one of inputs rounded so).
4. With --mnist DIR: an MNIST epoch (fc, cnn) against PyTorch on the GPU (bench_mnist.py's
   two sides). With --smollm2 FILE: a LoRA fine-tune of SmolLM2 against HF transformers + PEFT
   on the GPU (bench_finetune.py's two sides), ctx 256 b4 and ctx 1024 b8.

Every part prints one line a check, PASS or FAIL, and the script ends with a summary; exit
status 1 when anything failed. `--device-backend cpu` runs the whole script on the CPU
(both sides), to check the script itself on a machine without a GPU.
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
FP32_PEAK = {"H100": 67e12, "H200": 67e12, "A100": 19.5e12}
RESULTS: list = []


def report(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, ok))
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def cli(*args, env=None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "ggtrain", *map(str, args)], capture_output=True, text=True,
                              env={**os.environ, **(env or {})}, cwd=ROOT, timeout=180)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"ggtrain {args[0]} still running after 180 s")


def lines(path) -> list:
    return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines()]


# ---- 1. ops -------------------------------------------------------------------------------------

# the tests that run every op and kernel on the backend under test (tests/conftest.py: the
# `backend` fixture and run_kernel go to the GPU with GGTRAIN_TEST_BACKEND=cuda); some compare
# with a CPU path's exact bits, which a GPU need not give: their failures are read, not fixed blind
OP_TESTS = ("tests/test_ops.py", "tests/test_attention.py", "tests/test_kernels.py", "tests/test_matmul.py",
            "tests/test_quant_matmul.py", "tests/test_conv2d.py", "tests/test_linear_ce.py")

def ops(out: pathlib.Path, device: str, limit: int = 300) -> None:
    env = {**os.environ, "GGTRAIN_TEST_BACKEND": device, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    # on the GPU machine (16 cores, pytest-xdist and pytest-timeout installed) the cases run in 8
    # processes, and one case that hangs is stopped after a minute instead of ending the lease
    extra = []
    for module, flags in (("xdist", ["-n", "8"]), ("pytest_timeout", ["--timeout", "60"])):
        try:
            __import__(module)
            extra += flags
        except ImportError:
            pass
    # each case's line goes to ops.txt as it ends (-v), so a run stopped at its limit still says
    # which cases passed and failed
    log = out / "ops.txt"
    with open(log, "w") as f:
        try:
            r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *extra, *OP_TESTS,
                                f"--junitxml={out / 'ops.xml'}"], stdout=f, stderr=subprocess.STDOUT, text=True,
                               env=env, cwd=ROOT, timeout=limit)
            code = r.returncode
        except subprocess.TimeoutExpired:
            code = None
    text = log.read_text(errors="replace").splitlines()
    failed = sorted({l.split(" - ")[0] for l in text if l.startswith("FAILED") or " FAILED " in l})
    passed = sum(" PASSED " in l for l in text)
    if code is None:
        report("op table on " + device, False, f"still running after {limit} s: {passed} passed, "
                                               f"{len(failed)} failed so far")
    else:
        tail = [l for l in text if l.strip()][-1:] or ["(no output)"]
        report("op table on " + device, code == 0, f"{tail[0]} in {time.perf_counter() - t0:.0f} s")
    for l in failed[:60]:
        print("   ", l)


# ---- 2. end to end ------------------------------------------------------------------------------

def close(a, b, rtol=1e-3, atol=0.0) -> bool:
    return bool(np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol))


def inference(tmp: pathlib.Path, model: pathlib.Path, adapter: pathlib.Path, text: pathlib.Path, device: str) -> None:
    """generate and eval on both backends, in f32 (--exact: the CPU's llama.cpp numbers have no
    GPU kernels): the stored-type model with the CPU-trained adapter, greedy text equal (f32
    sums in another order could part at a near-tie of the top two logits: the detail shows
    both), and the perplexity of the text's first 6000 characters within 1e-4 relative."""
    out = {}
    part = tmp / "text-part.txt"     # a few windows of it
    part.write_text(text.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    for be in ("cpu", device):
        g = cli("generate", "--model", model, "--lora", adapter, "--prompt", "Once upon a time", "-n", 48, "--numerics", "exact",
                "--backend", be)
        e = cli("eval", "--model", model, "--lora", adapter, "--data", part, "--ctx", 128, "--json", "--quiet",
                "--backend", be)
        for r, what in ((g, "generate"), (e, "eval")):
            if r.returncode:
                report(f"{what} --backend {be}", False, r.stderr.strip()[-300:])
                return
        out.setdefault("text", []).append(g.stdout.strip())
        out.setdefault("ppl", []).append(json.loads(e.stdout.strip().splitlines()[-1])["perplexity"])
    a, b = out["text"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    report("generate (greedy, f32, LoRA) on cuda = cpu", a == b,
           "the same text" if a == b else f"they part at character {same}: {a[same:same + 40]!r} vs {b[same:same + 40]!r}")
    report("eval (f32, LoRA) on cuda = cpu", close(out["ppl"][0], out["ppl"][1], 1e-4),
           f"perplexity {out['ppl'][0]:.6f} vs {out['ppl'][1]:.6f}")


def end_to_end(tmp: pathlib.Path, device: str) -> None:
    from ggtrain.core.models.mnist import PARAM_SHAPES
    from ggtrain.formats.mnist import load_mnist_model

    runs = {}
    for be in ("cpu", device):
        out, log = tmp / f"mnist-{be}.gguf", tmp / f"mnist-{be}.jsonl"
        t0 = time.perf_counter()
        r = cli("mnist", "train", "--out", out, "--log", log, "--epochs", 2, "--backend", be, "--quiet")
        if r.returncode:
            report(f"mnist train --backend {be}", False, r.stderr.strip()[-300:])
            return
        runs[be] = ([l["val_loss"] for l in lines(log) if "train_loss" in l and "event" not in l],
                    load_mnist_model(out, PARAM_SHAPES)[1], time.perf_counter() - t0)
    (vc, pc, tc), (vg, pg, tg) = runs["cpu"], runs[device]
    ok = close(vc, vg) and all(close(pc[k], pg[k], 0, 1e-3) for k in pc)
    report("mnist fc, 2 epochs, cuda = cpu", ok, f"val losses {vc} vs {vg}; {tc:.1f} s vs {tg:.1f} s")

    cnn = []       # (lists, not keyed by backend: --device-backend cpu runs both sides on the CPU)
    for be in ("cpu", device):
        log = tmp / f"cnn-{be}.jsonl"
        r = cli("mnist", "train", "--arch", "cnn", "--out", tmp / f"cnn-{be}.gguf", "--log", log, "--epochs", 1,
                "--backend", be, "--quiet")
        if r.returncode:
            report(f"mnist train --model cnn --backend {be}", False, r.stderr.strip()[-300:])
            break
        cnn.append([l["val_loss"] for l in lines(log) if "train_loss" in l and "event" not in l])
    if len(cnn) == 2:
        report("mnist cnn, 1 epoch, cuda = cpu", close(cnn[0], cnn[1]), f"val losses {cnn[0]} vs {cnn[1]}")

    text = ROOT / "cli" / "data" / "tinyshakespeare.txt"
    model = ROOT / ".gpu-data" / "stories260K-Q8_0.gguf"     # carried (bench/cuda_prepare.sh copies it)
    if model.is_file():
        ft = []
        for be in ("cpu", device):
            log = tmp / f"ft-{be}.jsonl"
            r = cli("finetune", "--model", model, "--data", text, "--out", tmp / f"ft-{be}.gguf", "--log", log,
                    "--steps", 12, "--ctx", 64, "--batch", 4, "--lora-rank", 8, "--warmup", 2, "--quiet",
                    "--val-split", 0.05, "--backend", be)
            if r.returncode:
                report(f"finetune --backend {be}", False, r.stderr.strip()[-300:])
                break
            ft.append([l["loss"] for l in lines(log) if "loss" in l and "step" in l and "event" not in l])
        if len(ft) == 2:
            report("LoRA finetune stories260K Q8_0, 12 updates, cuda = cpu", close(ft[0], ft[1]),
                   f"first/last loss {ft[0][0]:.5f}/{ft[0][-1]:.5f} vs {ft[1][0]:.5f}/{ft[1][-1]:.5f}")
            inference(tmp, model, tmp / "ft-cpu.gguf", text, device)
    else:
        report("LoRA finetune (stories260K Q8_0 carried in .gpu-data)", False, f"{model} is missing")

    tiny = ["--data", text, "--dim", 64, "--layers", 2, "--heads", 4, "--kv-heads", 2, "--ff", 128, "--ctx", 64,
            "--batch", 4, "--steps", 20, "--warmup", 2, "--quiet", "--val-split", 0.05]
    losses = {}
    for be in ("cpu", device):
        log = tmp / f"train-{be}.jsonl"
        r = cli("train", *tiny, "--out", tmp / f"t-{be}.gguf", "--log", log, "--backend", be, "--checkpoint-dir",
                tmp / f"ck-{be}", "--save-every", 10)
        if r.returncode:
            report(f"train --backend {be}", False, r.stderr.strip()[-300:])
            return
        losses[be] = [l["loss"] for l in lines(log) if "loss" in l and "step" in l and "event" not in l]
    report("llama train, 20 updates, cuda = cpu", close(losses["cpu"], losses[device]),
           f"first/last loss {losses['cpu'][0]:.5f}/{losses['cpu'][-1]:.5f} vs "
           f"{losses[device][0]:.5f}/{losses[device][-1]:.5f}")
    for a, b in (("cpu", device), (device, "cpu")):
        log = tmp / f"resume-{a}-{b}.jsonl"
        r = cli("train", *tiny, "--out", tmp / f"r-{a}-{b}.gguf", "--log", log, "--backend", b, "--resume",
                tmp / f"ck-{a}" / "ckpt-000010.gguf")
        got = [l["loss"] for l in lines(log) if "loss" in l and "step" in l and "event" not in l] if not r.returncode else []
        report(f"checkpoint of {a} resumed on {b}", not r.returncode and close(got, losses[a][10:]),
               r.stderr.strip()[-300:] if r.returncode else f"last loss {got[-1]:.5f} vs {losses[a][-1]:.5f}")
    if device != "cuda":
        return
    # the tensor-core precisions: the same run, every loss within the --help's stated error
    from ggtrain.cli.common import BACKENDS
    for backend, (math, _) in BACKENDS.items():
        if math in (None, "f32"):
            continue
        log = tmp / f"train-{backend}.jsonl"
        r = cli("train", *tiny, "--out", tmp / f"t-{backend}.gguf", "--log", log, "--backend", backend)
        if r.returncode:
            report(f"train --backend {backend}", False, r.stderr.strip()[-300:])
            continue
        got = [l["loss"] for l in lines(log) if "loss" in l and "step" in l and "event" not in l]
        worst = float(np.max(np.abs(np.subtract(got, losses["cpu"])) / np.abs(losses["cpu"])))
        bound = {"tf32": 5e-3, "bf16": 3e-2}[math]
        report(f"llama train, 20 updates, {backend} = cpu within {bound:g}", worst < bound,
               f"largest relative loss difference {worst:.2e}")


def precision_rounding() -> None:
    """Each --backend precision reads a product's inputs as stated: the product of random
    matrices is nearest the float64 product of the inputs rounded to its fraction bits (f32
    23, TF32 10, bf16 7: tests/refs.py rounds to nearest even)."""
    from ggtrain.cli.common import BACKENDS
    from ggtrain.core.backend_kernel import run_kernel
    from ggtrain.core.backend_cuda import CudaBackend
    sys.path.insert(0, str(ROOT))
    from tests.refs import rounded

    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((256, 512)).astype(np.float32), rng.standard_normal((512, 256)).astype(np.float32)
    drops = {"f32": 0, "tf32": 13, "bf16": 16}     # (bf16: a precision that must not be the one read)
    refs = {m: (rounded(a, d) if d else a).astype(np.float64) @ (rounded(b, d) if d else b).astype(np.float64)
            for m, d in drops.items()}
    for backend, (math, _) in BACKENDS.items():
        if math is None:
            continue
        out = run_kernel("matmul_fwd_f32", np.zeros((256, 256), np.float32), [a, b], backend=CudaBackend(math=math))
        errs = {m: float(np.abs(out - r).max()) for m, r in refs.items()}
        report(f"--backend {backend} reads the products' inputs as {math}", min(errs, key=errs.get) == math,
               "largest difference from the product of inputs rounded to " +
               ", ".join(f"{m} {e:.1e}" for m, e in errs.items()))


def nccl() -> None:
    """NCCL with one rank: the all-reduce of a device buffer leaves it as it was."""
    from ggtrain.core.backend_cuda import CudaBackend

    class OneRank:
        rank, size = 0, 1

        def broadcast(self, obj):
            return obj

        def reduce_host(self, array):
            raise AssertionError("the staged all-reduce ran instead of NCCL")
    be = CudaBackend()
    buf = be.alloc(4 * 1000)
    want = np.arange(1000, dtype=np.float32)
    be.copy_in(buf, 0, want)
    try:
        be.allreduce(buf, 1000, OneRank())
        got = be.copy_out(buf, 0, np.empty(1000, np.float32))
        report("NCCL all-reduce, one rank", be._nccl is True and np.array_equal(got, want))
    except Exception as e:  # noqa: BLE001
        report("NCCL all-reduce, one rank", False, str(e)[:300])


# ---- 3. speed against PyTorch -------------------------------------------------------------------

CONFIGS = {
    "a": dict(vocab=256, dim=256, layers=4, heads=8, kv_heads=8, ff=768, ctx=128, batch=8),
    "b": dict(vocab=256, dim=512, layers=8, heads=8, kv_heads=8, ff=1376, ctx=256, batch=4),
    "1024": dict(vocab=256, dim=1024, layers=16, heads=16, kv_heads=16, ff=2816, ctx=1024, batch=4),
}


# PyTorch's float32 matmul precision for each of ours
TORCH_PRECISION = {"f32": "highest", "tf32": "high"}


def torch_llama(cfg: dict, init: dict, device: str, math: str = "f32", autocast: bool = False):
    """PyTorch's eager step on the same weights (bench_llama.py's model, on the GPU): f32
    tensors, the matrix products in `math`'s precision; or with autocast, bf16 activations."""
    import torch
    import torch.nn.functional as F

    torch.set_float32_matmul_precision(TORCH_PRECISION[math])
    C, H, Hkv, L, T = cfg["dim"], cfg["heads"], cfg["kv_heads"], cfg["layers"], cfg["ctx"]
    D = C // H
    P = {k: torch.nn.Parameter(torch.from_numpy(v.copy()).to(device)) for k, v in init.items()}
    i = torch.arange(D // 2, dtype=torch.float64)
    theta = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-2 * i / D)
    cos = torch.cos(theta).float()[None, :, None, :].to(device)
    sin = torch.sin(theta).float()[None, :, None, :].to(device)

    def rms(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w

    def rope(x):
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), -1).flatten(-2)

    def loss_fn(w):
        x = P["token_embd.weight"][w[:, :-1]]
        b, t = w.shape[0], w.shape[1] - 1
        for l in range(L):
            p = f"blk.{l}."
            h = rms(x, P[p + "attn_norm.weight"])
            q = rope((h @ P[p + "attn_q.weight"].T).view(b, t, H, D)).transpose(1, 2)
            k = rope((h @ P[p + "attn_k.weight"].T).view(b, t, Hkv, D)).transpose(1, 2)
            v = (h @ P[p + "attn_v.weight"].T).view(b, t, Hkv, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, C)
            x = x + o @ P[p + "attn_output.weight"].T
            h = rms(x, P[p + "ffn_norm.weight"])
            x = x + (F.silu(h @ P[p + "ffn_gate.weight"].T) * (h @ P[p + "ffn_up.weight"].T)) @ P[p + "ffn_down.weight"].T
        logits = rms(x, P["output_norm.weight"]) @ P["output.weight"].T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))

    decay = [p for p in P.values() if p.ndim >= 2]
    rest = [p for p in P.values() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3)

    def step(w: np.ndarray) -> tuple:
        wt = torch.from_numpy(w).long().to(device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
            loss = loss_fn(wt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(P.values()), 1.0)
        opt.step()
        value = float(loss.detach())    # (waits for the GPU)
        return time.perf_counter() - t0, value
    return step


def profile_step(run, w: np.ndarray) -> None:
    """Each kernel's share of one update of a TextRun on windows w."""
    profile_plans(run.step, [run.feed(w)])


def profile_plans(step, batches: list) -> None:
    """Each kernel's share of one update of `step` on `batches` (GPU time between events, so a
    little over the unprofiled step)."""
    import collections

    from ggtrain.core.tensor import is_contiguous
    plans = [p for p in (step._micro, step._update) if p is not None]
    for plan in plans:
        plan.plan.profile()
    step.step(batches, 1e-3)
    by, nodes, count = collections.Counter(), collections.Counter(), collections.Counter()
    for plan in plans:
        for call, sec in zip(plan.plan.calls, plan.plan.node_seconds()):
            by[call.kernel] += sec
            shapes = ", ".join("x".join(map(str, t.shape)) + ("" if is_contiguous(t.shape, t.strides) else " (view)")
                               for t in call.srcs)
            key = f"{call.kernel} {'x'.join(map(str, call.dst.shape))} <- {shapes}"
            nodes[key] += sec
            count[key] += 1
        plan.plan.profile(False)
    total = sum(by.values())
    print(f"  profile: {total * 1e3:.1f} ms of kernels in one update")
    for k, v in by.most_common(14):
        print(f"  {v * 1e3:8.2f} ms {100 * v / total:5.1f}%  {k}")
    print("  by node:")
    for k, v in nodes.most_common(16):
        print(f"  {v * 1e3:8.2f} ms x{count[k]:<3} {k}")



def bench(device: str, steps: int, profile: str | None = None, configs: tuple = tuple(CONFIGS),
          maths: tuple = ("f32", "tf32", "bf16")) -> None:
    from ggtrain.cli.common import make_backend
    from ggtrain.core.models.config import ModelConfig, init_params
    from ggtrain.core.train import TextConfig, TextRun

    be = make_backend(device)
    name = getattr(be, "device", ("cpu",))[0]
    peak = next((v for k, v in FP32_PEAK.items() if k in name), None)
    print(f"device: {name}; f32 peak {peak / 1e12 if peak else float('nan'):.1f} TFLOP/s", flush=True)
    try:
        import torch
        torch_ok = torch.cuda.is_available()
    except ImportError:
        torch_ok = False
    runs = [(key, CONFIGS[key], be, "f32") for key in configs] if "f32" in maths else []
    if device == "cuda":     # and the GEMMs on TF32 / bf16 tensor cores, on both sides
        from ggtrain.core.backend_cuda import CudaBackend
        runs += [("1024", CONFIGS["1024"], None, m) for m in ("tf32", "bf16") if m in maths]
    for key, cfg, backend, math in runs:
        if math != "f32":
            backend = CudaBackend(math=math)
        model = ModelConfig(**{k: v for k, v in cfg.items() if k != "batch"})
        init = init_params(model, 0)
        rng = np.random.default_rng(1)
        windows = rng.integers(0, cfg["vocab"], (steps + 2, cfg["batch"], cfg["ctx"] + 1)).astype(np.int32)
        tc = TextConfig(steps=10**6, batch=cfg["batch"], lr=1e-3, lr_min=1e-3, warmup=0, weight_decay=0.1,
                        grad_clip=1.0, checkpointing=False)
        name = f"llama {key}" + (f" {math}" if math != "f32" else "")
        try:
            run = TextRun(model, init, tc, backend)
        except Exception as e:  # noqa: BLE001 - reported, the next config goes on
            report(f"{name} on {device}", False, str(e)[:300])
            continue
        ours = []
        for s in range(steps + 2):
            w = windows[s]
            t0 = time.perf_counter()
            run.step.step([run.feed(w)], 1e-3)
            ours.append(time.perf_counter() - t0)
        tokens = cfg["batch"] * cfg["ctx"]
        best = min(ours[2:])
        flops = run.step.flops
        line = f"{name}: ours {tokens / best:,.0f} tok/s ({flops / best / 1e12:.2f} TFLOP/s"
        line += f", {100 * flops / best / peak:.1f}% of the f32 peak)" if peak else ")"
        if torch_ok and device == "cuda" and math != "bf16":
            step = torch_llama(cfg, init, "cuda", math)
            theirs = min(step(windows[s])[0] for s in range(steps + 2))
            line += f"; PyTorch eager {math} {tokens / theirs:,.0f} tok/s; ratio {theirs / best:.2f}x"
        if torch_ok and device == "cuda" and math != "f32":   # what a PyTorch user runs for speed: bf16 autocast
            step = torch_llama(cfg, init, "cuda", "f32", autocast=True)
            theirs = min(step(windows[s])[0] for s in range(steps + 2))
            line += f"; PyTorch autocast bf16 {tokens / theirs:,.0f} tok/s; ratio {theirs / best:.2f}x"
        if torch_ok:
            torch.set_float32_matmul_precision("highest")
        print(line, flush=True)
        report(f"{name} ran on {device}", True)
        if profile and key == profile and math == "f32":
            profile_step(run, windows[0])
        del run


def mnist_speed(data: pathlib.Path, rounds: int = 3) -> None:
    """One MNIST epoch (the 57,000 training images of --mnist DIR, bench_mnist.py's batches
    and AdamW), ours on the GPU against PyTorch eager on the GPU, alternating epoch by epoch."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_mnist import OursSide, TorchSide

    from ggtrain.core.backend_cuda import CudaBackend
    from ggtrain.formats.idx import load_mnist

    x, y = load_mnist(data, "train")
    x, y = x[:57000], y[:57000]
    os.environ.setdefault("GGTRAIN_TORCH_PYTHON", sys.executable)
    with tempfile.TemporaryDirectory() as tmp:
        npz = os.path.join(tmp, "mnist.npz")
        np.savez(npz, x=x, y=y)
        for arch in ("fc", "cnn"):
            ours, theirs = OursSide(arch, 1, x, y, backend=CudaBackend()), TorchSide(arch, 1, npz, device="cuda")
            t_ours, t_theirs = [], []
            for _ in range(rounds):
                t_ours.append(ours.epoch())
                t_theirs.append(theirs.epoch())
            theirs.close()
            if min(t_ours) > min(t_theirs):     # where our time goes: one update by kernel
                profile_plans(ours.run.step, ours.batches(0))
            gf = ours.flop_per_epoch / min(t_ours) / 1e9
            print(f"mnist {arch}, one epoch of {len(y)} images: ours {min(t_ours):.3f} s, PyTorch eager "
                  f"{min(t_theirs):.3f} s; ratio {min(t_theirs) / min(t_ours):.2f}x ({gf:.0f} GFLOP/s)", flush=True)
            report(f"mnist {arch} epoch timed on cuda", True)


def smollm2_speed(model: pathlib.Path, chat: pathlib.Path, steps: int = 12) -> None:
    """LoRA fine-tuning of SmolLM2-135M-Instruct (r16, the seven projections, AdamW, chat data),
    bench_finetune.py's two sides on the GPU: `ggtrain finetune --backend cuda` on the Q4_1 file
    as stored, HF transformers + PEFT on its f32 dequantization (torch there, in this python)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_finetune

    os.environ.setdefault("GGTRAIN_TORCH_PYTHON", sys.executable)
    for ctx, batch in ((256, 4), (1024, 8)):
        try:
            a = bench_finetune.ours(model, steps, 1, data=chat, ctx=ctx, batch=batch, backend="cuda")
            b = bench_finetune.theirs(model, steps, 1, data=chat, ctx=ctx, batch=batch, device="cuda")
        except SystemExit as e:      # (the bench's own words for a failed side)
            report(f"SmolLM2 LoRA ctx {ctx} b{batch} on cuda", False, str(e)[-400:])
            continue
        print(f"SmolLM2 LoRA r16 ctx {ctx} b{batch}: ours (Q4_1) {a['tokens_per_s']:,.0f} tok/s, HF + PEFT (f32) "
              f"{b['tokens_per_s']:,.0f} tok/s; ratio {a['tokens_per_s'] / b['tokens_per_s']:.2f}x; load "
              f"{a['load_s']:.1f} s vs {b['load_s']:.1f} s; their GPU memory {b.get('gpu_mib') or 0:.0f} MiB; "
              f"host RSS {a['rss_mib']:.0f} vs {b['rss_mib']:.0f} MiB", flush=True)
        report(f"SmolLM2 LoRA ctx {ctx} b{batch} ran on cuda", True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="cuda-check-"))
    ap.add_argument("--device-backend", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--skip-ops", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--mnist", type=pathlib.Path, help="a folder of the MNIST IDX files: time an epoch against PyTorch")
    ap.add_argument("--smollm2", type=pathlib.Path, help="SmolLM2-135M-Instruct.Q4_1.gguf: LoRA against HF + PEFT")
    ap.add_argument("--chat", type=pathlib.Path, default=ROOT / ".gpu-data3" / "dummy_conversation.json",
                    help="the chat data of --smollm2's fine-tune")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--ops-limit", type=int, default=300, help="seconds the op table may run")
    ap.add_argument("--profile", default="1024", help="the config whose update is profiled by kernel ('' for none)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="the llama configs timed in f32")
    ap.add_argument("--maths", default="f32,tf32,bf16", help="the precisions timed (tf32, bf16: the 1024 config)")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device_backend == "cuda":
        from ggtrain.core.backend_cuda import unavailable_reason
        why = unavailable_reason()
        if why:
            report("the CUDA backend starts", False, why)
            sys.exit(1)
    if not args.skip_ops:
        ops(out, args.device_backend, args.ops_limit)
    if not args.skip_e2e:
        with tempfile.TemporaryDirectory() as tmp:
            end_to_end(pathlib.Path(tmp), args.device_backend)
        if args.device_backend == "cuda":
            nccl()
            precision_rounding()
    if not args.skip_bench:
        bench(args.device_backend, args.steps, args.profile or None, tuple(args.configs.split(",")),
              tuple(args.maths.split(",")))
    if args.mnist and args.device_backend == "cuda":
        mnist_speed(args.mnist)
    if args.smollm2 and args.device_backend == "cuda":
        smollm2_speed(args.smollm2, args.chat)
    failed = [n for n, ok in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed" + (f"; failed: {', '.join(failed)}"
                                                                             if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
