"""Benchmark: a LoRA step of a small Qwen3-MoE and of a small Qwen3.5 (gated DeltaNet layers and
gated attention), ggtrain against Hugging Face transformers + PEFT on the same weights.

The weights are transformers': the bench builds each model from a config with random weights
(torch seed 0) in bench/.venv-torch (transformers, peft added on first use; or the python
GGTRAIN_TORCH_PYTHON names), saves it, and writes the GGUF our families read from its state
dict with llama.cpp's tensor names (gguf-py's TensorNameMap) and the facts of llama.cpp's
converter (conversion/qwen.py): transformers' fused experts split into gate and up, Qwen3.5's
A = -exp(A_log), its RMSNorm scales 1 + w stored as such, the convolution's (channels, 1, K)
squeezed. Both sides then compute the loss of the same first batch before any update and the
bench prints both (they must agree to 1e-3, else it stops: not the same model).

Both sides: rank 16, alpha 32, the same targets (Qwen3-MoE: the attention's q, k, v, o, the
router is no nn.Linear in transformers 5, so PEFT cannot adapt it; Qwen3.5: q (with its gate),
k, v, o, the DeltaNet's qkv, z and out projections and the FFN), AdamW (lr 2e-4, decay 0.01,
clip 1.0), random token windows (ctx x batch), 2 threads (torch.set_num_threads; ours
--threads). Each side runs in its own process that stays up (its peak RSS is its VmHWM: not
ru_maxrss, which keeps the bench's own RSS at the fork across the exec), and the two alternate
step by step, as in bench_llama, so a busy moment of a shared machine hits both: 2 warm-up
steps, then the best of --steps (the median beside it). Ours runs as `ggtrain finetune` would
(TextRun with gradient checkpointing, the adapters fused into the frozen products); theirs
without checkpointing, with transformers' eager attention, its PyTorch DeltaNet (the chunked
gated delta rule; no flash-linear-attention kernels on a CPU) and its MoE block as transformers
5 writes it.

% of the FP32 peak (bench/peak.py, measured in the same sitting) counts the FLOPs the step
needs, not what either side does: per token 2 x the active parameters forward and 2 x them for
the gradient with respect to the inputs (the frozen weights get no weight gradient: the usual
6 x is 4 x here), plus 6 x the adapters' parameters; active parameters are the matrices a token
is multiplied by: every 2-D weight but the embedding table, and of the experts' stacked 3-D
weights the routed share (experts_used / experts). Attention's scores and the DeltaNet's
recurrence are not counted, so the figure is a floor. Our graph's own count of the update's
products is printed beside it.

    python bench/bench_families.py [--steps 6] [--threads 2] [--ctx 256] [--batch 4] [--only qwen3moe|qwen35]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))    # tests/test_families.py writes GGUFs as llama.cpp's converters do
from bench_generate import active_params  # noqa: E402
from bench_llama import _SPIN_S  # noqa: E402
from peak import Peak  # noqa: E402
from torch_venv import TorchProcess, ensure_torch  # noqa: E402

RANK, ALPHA, LR, DECAY = 16, 32, 2e-4, 0.01
WARMUP = 2
# transformers configs (model_type first); ours: the GGUF's ModelConfig from the same numbers
MODELS = {
    "qwen3moe": dict(model_type="qwen3_moe", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=64, intermediate_size=1024, moe_intermediate_size=256,
                     num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1e6),
                     tie_word_embeddings=False, initializer_range=0.05),
    # 3 DeltaNet layers, then attention (full_attention_interval 4); as many V heads as K heads
    # (Qwen3.5-0.8B's 16 and 16), so the converter's V-head reordering does not apply
    "qwen35": dict(model_type="qwen3_5_text", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64, intermediate_size=1024, linear_conv_kernel_dim=4,
                   linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4,
                   linear_num_value_heads=4, full_attention_interval=4, rms_norm_eps=1e-6,
                   layer_types=["linear_attention"] * 3 + ["full_attention"],
                   rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                        mrope_section=[3, 3, 2], mrope_interleaved=True),
                   tie_word_embeddings=False, initializer_range=0.05),
}
# LoRA targets: ours (llama.cpp's names), theirs (transformers' module names), the same weights
TARGETS = {
    "qwen3moe": (("attn_q", "attn_k", "attn_v", "attn_output"), ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "qwen35": (("attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_out", "ffn_gate",
                "ffn_up", "ffn_down"),
               ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj",
                "up_proj", "down_proj"]),
}
LABELS = {"qwen3moe": "Qwen3-MoE 512d/4L, 16 experts top 2", "qwen35": "Qwen3.5 512d/4L (3 DeltaNet + 1 attn)"}

# both sides' peak RSS: this process's VmHWM (KiB)
_PEAK_RSS = r"""
def _HWM():
    return int(next(x for x in open("/proc/self/status") if x.startswith("VmHWM:")).split()[1])
"""

_THEIRS = _PEAK_RSS + r"""
import json, sys, time
a = json.loads(sys.argv[1])
import numpy as np, torch
torch.set_num_threads(a["threads"])
from transformers import AutoConfig, AutoModelForCausalLM
if a["mode"] == "build":      # random weights from the config; the state dict for the GGUF
    cfg = dict(a["config"]); kind = cfg.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=a["vocab"], **cfg),
                                             dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():     # the norms, A_log, dt_bias off their constant starts: the conversion shows
        for p in model.parameters():
            if p.ndim == 1:
                p += 0.1 * torch.randn_like(p)
    model.save_pretrained(a["dir"])
    np.savez(a["dir"] + "/weights.npz", **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    print(json.dumps({"class": type(model).__name__}))
    sys.exit()
from peft import LoraConfig, get_peft_model
import torch.nn.functional as F
model = AutoModelForCausalLM.from_pretrained(a["dir"], dtype=torch.float32, attn_implementation="eager")
model = get_peft_model(model, LoraConfig(r=a["rank"], lora_alpha=a["alpha"], lora_dropout=0.0,
                                         target_modules=a["targets"], task_type="CAUSAL_LM"))
windows = torch.from_numpy(np.load(a["windows"])).long()
params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=a["lr"], weight_decay=a["decay"])
model.train()
print("ready", flush=True)
for line in sys.stdin:    # one timed step per command: the index of its window (or "peak": peak RSS)
    if line.strip() == "peak":
        print(json.dumps({"peak_kib": _HWM(),
                          "adapter_params": sum(p.numel() for p in params)}), flush=True)
        continue
    w = windows[int(line)]
    t = time.perf_counter()
    logits = model(input_ids=w[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad()
    print(json.dumps({"time": time.perf_counter() - t, "loss": float(loss.detach())}), flush=True)
"""

_OURS = _PEAK_RSS + r"""
import json, sys, time
import numpy as np
from ggtrain.core.backend_cpu import CpuBackend
from ggtrain.core.models.config import ModelConfig
from ggtrain.core.models.lora import LoraConfig, init_lora
from ggtrain.core.train import TextConfig, TextRun
from ggtrain.formats.model_file import open_model
a = json.loads(sys.argv[1])
be = CpuBackend(a["threads"])
hp, weights, _ = open_model(a["model"], be)
model = ModelConfig(**hp)
lora = LoraConfig(rank=a["rank"], alpha=a["alpha"], targets=tuple(a["targets"]))
init = init_lora(lora, {w: weights[w].shape for w in lora.weights(model)}, 0)
windows = np.load(a["windows"])
run = TextRun(model, init, TextConfig(steps=10**6, batch=windows.shape[1], lr=a["lr"], warmup=0,
                                      weight_decay=a["decay"], grad_clip=1.0),
              be, frozen=weights, lora=lora, ctx=windows.shape[2] - 1)
print("ready", flush=True)
for line in sys.stdin:    # as theirs
    if line.strip() == "peak":
        print(json.dumps({"peak_kib": _HWM(),
                          "adapter_params": int(sum(v.size for v in init.values())),
                          "flop_per_token": run.flop_per_token()}), flush=True)
        continue
    w = windows[int(line)]
    t = time.perf_counter()
    loss = run.step.step([run.feed(w)], a["lr"])
    print(json.dumps({"time": time.perf_counter() - t, "loss": float(loss)}), flush=True)
"""


def _torch_python() -> pathlib.Path:
    """bench/.venv-torch's python, completed with transformers (a version with both families:
    5.24 has them) and peft."""
    py = ensure_torch()
    probe = [str(py), "-c", "import peft; from transformers import Qwen3MoeForCausalLM, Qwen3_5ForCausalLM"]
    if subprocess.run(probe, capture_output=True).returncode:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "-U", "transformers", "peft"], check=True)
    return py


def gguf_weights(arch: str, hf: dict, layers: int) -> dict:
    """transformers' state dict as the GGUF tensors llama.cpp's converter writes (names by gguf-py's
    TensorNameMap; the changes of conversion/qwen.py for these two families)."""
    import gguf

    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), layers)
    out = {}
    for name, x in hf.items():
        if name.endswith("mlp.experts.gate_up_proj"):       # (experts, 2 ff, dim): gate rows, then up
            ff = x.shape[1] // 2
            stem = name.removesuffix("gate_up_proj")
            parts = [(stem + "gate_proj", x[:, :ff]), (stem + "up_proj", x[:, ff:])]
        elif name.endswith(".A_log"):
            parts = [(name, -np.exp(x))]
        elif name.endswith(".dt_bias"):
            parts = [(name.removesuffix("dt_bias") + "dt_proj.bias", x)]
        elif "conv1d" in name:
            parts = [(name, x.squeeze(1))]
        elif arch == "qwen35" and name.endswith("norm.weight") and ".linear_attn." not in name:
            parts = [(name, x + 1.0)]                         # Qwen3.5's RMSNorm multiplies by 1 + w
        else:
            parts = [(name, x)]
        for n, v in parts:
            stem, suffix = (n.rsplit(".", 1)[0], "." + n.rsplit(".", 1)[1]) if n.endswith((".weight", ".bias")) \
                else (n, "" if n.endswith("A_log") else ".weight")
            mapped = names.get_name(stem)
            if mapped is None:
                sys.exit(f"no GGUF name for transformers' {n}")
            out[mapped + suffix] = np.ascontiguousarray(v, np.float32)
    return out


def model_config(arch: str, hf: dict, vocab: int, ctx: int):
    """Our ModelConfig of the transformers config hf."""
    from ggtrain.core.models.config import ModelConfig

    rope = hf["rope_parameters"]
    common = dict(arch=arch, vocab=vocab, dim=hf["hidden_size"], layers=hf["num_hidden_layers"],
                  heads=hf["num_attention_heads"], kv_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"],
                  ff=hf["intermediate_size"], ctx=ctx, norm_eps=hf["rms_norm_eps"], rope_base=rope["rope_theta"])
    if arch == "qwen3moe":
        return ModelConfig(**common, experts=hf["num_experts"], experts_used=hf["num_experts_per_tok"],
                           expert_ff=hf["moe_intermediate_size"])
    rot = int(hf["head_dim"] * rope["partial_rotary_factor"])
    return ModelConfig(**common, rope_dims=rot, ssm_conv=hf["linear_conv_kernel_dim"],
                       ssm_state=hf["linear_key_head_dim"], ssm_groups=hf["linear_num_key_heads"],
                       ssm_heads=hf["linear_num_value_heads"],
                       ssm_inner=hf["linear_value_head_dim"] * hf["linear_num_value_heads"],
                       attn_interval=hf["full_attention_interval"], rope_sections=(*rope["mrope_section"], 0))


def bench(arch: str, args, peak, tmp: pathlib.Path) -> dict:
    """Build the model, check both sides' first losses, time both; the figures."""
    from ggtrain.formats.tokenizer import ByteTokenizer
    from tests.test_families import write_with_gguf_py

    py = _torch_python()
    tok = ByteTokenizer()
    hf_dir = tmp / arch
    hf = MODELS[arch]
    common = {"threads": args.threads, "rank": RANK, "alpha": ALPHA, "lr": LR, "decay": DECAY,
              "windows": str(tmp / "windows.npy")}
    built = subprocess.run([str(py), "-c", _THEIRS, json.dumps({**common, "mode": "build", "config": hf,
                                                                "vocab": tok.n_vocab, "dir": str(hf_dir)})],
                           stdout=subprocess.PIPE, text=True)
    if built.returncode:
        sys.exit("building the transformers model failed (its error is above)")
    cfg = model_config(arch, hf, tok.n_vocab, args.ctx)
    with np.load(hf_dir / "weights.npz") as z:
        weights = gguf_weights(arch, {k: z[k] for k in z.files}, cfg.layers)
    model = tmp / f"{arch}.gguf"
    write_with_gguf_py(model, cfg, weights, tok)
    windows = np.random.default_rng(0).integers(0, tok.n_vocab, (WARMUP + args.steps, args.batch, args.ctx + 1))
    np.save(tmp / "windows.npy", windows.astype(np.int32))
    ours_t, theirs_t = TARGETS[arch]
    sides = {"ours": TorchProcess(_OURS, {**common, "model": str(model), "targets": ours_t}, args.threads,
                                  python=sys.executable),
             "theirs": TorchProcess(_THEIRS, {**common, "mode": "train", "dir": str(hf_dir), "targets": theirs_t},
                                    args.threads)}
    steps = {side: [] for side in sides}
    for s in range(len(windows)):      # step by step, alternating: a noisy moment hits both
        for side, proc in sides.items():
            time.sleep(_SPIN_S)        # the other side's idle threads stop spinning
            steps[side].append(proc.ask(str(s)))
        if s % 2 == 1:
            peak.sample()
    res = {}
    for side, proc in sides.items():
        info = proc.ask("peak")
        proc.close()
        times = [x["time"] for x in steps[side][WARMUP:]]
        tokens = args.batch * args.ctx
        res[side] = {**info, "rss_mib": info["peak_kib"] / 1024, "loss": steps[side][0]["loss"],
                     "tokens_per_s": tokens / min(times), "median_tokens_per_s": tokens / statistics.median(times)}
    a, b = res["ours"], res["theirs"]
    if abs(a["loss"] - b["loss"]) > 1e-3:
        sys.exit(f"{arch}: first losses differ (ours {a['loss']:.6f}, theirs {b['loss']:.6f}): not the same model")
    active = active_params(model)
    return dict(arch=arch, hf_class=json.loads(built.stdout.strip().splitlines()[-1])["class"], ours=a, theirs=b,
                active=active, need=4 * active + 6 * a["adapter_params"])


def table(r: dict, peak) -> None:
    a, b = r["ours"], r["theirs"]
    need_gf_a, need_gf_b = r["need"] * a["tokens_per_s"] / 1e9, r["need"] * b["tokens_per_s"] / 1e9
    graph_gf = a["flop_per_token"] * a["tokens_per_s"] / 1e9
    print(f"{LABELS[r['arch']]} (transformers {r['hf_class']}); first loss ours {a['loss']:.6f}, "
          f"theirs {b['loss']:.6f}")
    print(f"  {'':22s} {'ours':>10s} {'HF+PEFT':>10s} {'ratio':>7s}")
    print(f"  {'tokens/s (best step)':22s} {a['tokens_per_s']:10.0f} {b['tokens_per_s']:10.0f} "
          f"{a['tokens_per_s'] / b['tokens_per_s']:7.2f}")
    print(f"  {'tokens/s (median)':22s} {a['median_tokens_per_s']:10.0f} {b['median_tokens_per_s']:10.0f} "
          f"{a['median_tokens_per_s'] / b['median_tokens_per_s']:7.2f}")
    print(f"  {'peak RSS MiB':22s} {a['rss_mib']:10.0f} {b['rss_mib']:10.0f} {a['rss_mib'] / b['rss_mib']:7.2f}")
    print(f"  {'% of FP32 peak':22s} {peak.percent(need_gf_a):9.1f}% {peak.percent(need_gf_b):9.1f}%")
    print(f"  needed: {r['need'] / 1e6:.1f} MFLOP a token (4 x {r['active'] / 1e6:.2f} M active params + 6 x "
          f"{a['adapter_params'] / 1e6:.2f} M adapter params); ours {need_gf_a:.1f} GFLOP/s, theirs "
          f"{need_gf_b:.1f}; our graph counts {a['flop_per_token'] / 1e6:.1f} MFLOP a token ({graph_gf:.1f} GFLOP/s, "
          f"{peak.percent(graph_gf):.1f}% of peak)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="timed steps (after 2 warm-up steps)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--only", choices=sorted(MODELS))
    args = ap.parse_args()
    peak = Peak(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in [args.only] if args.only else list(MODELS):
            results.append(bench(arch, args, peak, pathlib.Path(tmp)))
    print(f"LoRA r {RANK}, alpha {ALPHA}, AdamW, ctx {args.ctx}, batch {args.batch}, {args.threads} threads, "
          f"{args.steps} steps (best after {WARMUP}); {peak.describe()}")
    for r in results:
        table(r, peak)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
