"""Training checkpoints as GGUF (layer 5): everything a bit-identical resume needs.

A checkpoint is a llama model file plus training state, so `ggtrain info` and gguf-py
read it, but llama.cpp refuses it (extra tensors): `ggtrain train --out` writes the
clean model, and `convert-checkpoint` turns a checkpoint into one.

Keys (besides llama.cpp's llama.* / general.* / tokenizer.ggml.* keys):
    ggtrain.checkpoint.version   UINT32   2 (version 1, without kind and run_config, reads as "train")
    ggtrain.checkpoint.kind      STRING   "train" (a llama from scratch), "finetune-lora" (adapter
                                          factors on a frozen base), "finetune-full", "model"
                                          (a model's weights before any training, made by
                                          `convert-checkpoint --to checkpoint`: no optimizer state,
                                          no data; `train --resume` and `finetune --full --resume`
                                          start a run from it with their own options), or "mnist"
                                          (`mnist train`: an MNIST classifier's header,
                                          formats/mnist.py, instead of a language model's, no
                                          vocabulary; model_config {"arch": "fc" | "cnn"})
    ggtrain.model_config         STRING   JSON of the ModelConfig fields
    ggtrain.train_config         STRING   JSON of the TextConfig fields (and the command's data options)
    ggtrain.run_config           STRING   JSON of what else the command needs to resume (finetune:
                                          the LoRA settings, the base model's fingerprint, ...); "{}"
    ggtrain.updates              UINT64   optimizer updates done
    ggtrain.tokens_seen          UINT64   training tokens consumed (0 for mnist)
    ggtrain.data_rng             STRING   the batch source's state (JSON: numpy RNG state, cursor)
    ggtrain.data_fingerprint     STRING   sha256 of the training data as tokens
    ggtrain.early_stop           STRING   JSON {"best", "best_step", "bad"} (only with early stopping)
    ggtrain.run_state            STRING   JSON of a run's own counters (mnist: samples seen, the
                                          current epoch's totals, the best and last epochs)
Tensors: what is trained (the model's parameters under llama.cpp names, or the adapter
factors "<weight>.lora_a" / ".lora_b"), F32, then the optimizer's state: for each
parameter its AdamW moments `adam_m.<name>` and `adam_v.<name>` or its SGD momentum
`momentum.<name>` (F32, same shape), or L-BFGS's history of the whole run, `lbfgs.s` and
`lbfgs.y` (m, n), `lbfgs.curv` (m, 2: y.s, y.y) and `lbfgs.ring` (pair count, newest slot);
with early stopping, the best evaluation's parameters `best.<name>`; for DPO the reference
model's NLL of each pair's chosen and rejected completion, `preference.reference_nll`
(pairs, 2). All bit-exact. The
keys a model carries besides hparams and vocabulary (its chat template:
model_file.CARRIED_PREFIXES) are kept, so the model written from a checkpoint has them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
from gguf import GGUFValueType as VT

from ggtrain.errors import FormatError
from ggtrain.formats.gguf import GGUFFile, read_gguf, write_gguf
from ggtrain.core.models.config import ModelConfig
from ggtrain.formats.model import CHECKPOINT_KEY, config_to_kv
from ggtrain.formats.mnist import model_kv
from ggtrain.formats.model_file import carried_kv
from ggtrain.formats.tokenizer import tokenizer_from_gguf

VERSION = 2
READ_VERSIONS = (1, 2)
KINDS = ("train", "finetune-lora", "finetune-full", "model", "mnist")
_MOMENTS = {".adam_m": "adam_m.", ".adam_v": "adam_v.", ".momentum": "momentum."}
_RUN_STATE = "lbfgs."   # optimizer state of the whole run, not per parameter: stored under its name
_BEST = "best."
_REFERENCE = "preference.reference_nll"


@dataclass
class Checkpoint:
    """The one record of a resumable run that `train` and `finetune` (and `convert-checkpoint`)
    write and read: kind (KINDS); model_config, train_config, run_config (dicts, stored as
    JSON); state (TextRun.state() or ClassifierRun.state(): {"params", "optimizer", "updates",
    "tokens_seen"[, "early_stop", "best_params", "reference", "run"]}; optimizer names are "<param>.adam_m" /
    ".adam_v" / ".momentum", or "lbfgs.*" for the whole run); tokenizer; data_rng (the batch
    source's state); data_fingerprint (sha256 of the training data: token ids, or mnist's images
    and labels); tokenizer None for mnist; extra_kv
    (key/values of the model to keep: model_file.carried_kv of the base)."""
    kind: str
    model_config: dict
    train_config: dict
    state: dict
    tokenizer: object
    data_rng: str = ""
    data_fingerprint: str = ""
    run_config: dict = field(default_factory=dict)
    extra_kv: list = field(default_factory=list)


def save_checkpoint(path, ckpt: Checkpoint, progress=None) -> None:
    """Write a checkpoint atomically (see the module docstring for the layout)."""
    kind, model_config, train_config, state = ckpt.kind, ckpt.model_config, ckpt.train_config, ckpt.state
    tokenizer, data_rng, data_fingerprint = ckpt.tokenizer, ckpt.data_rng, ckpt.data_fingerprint
    run_config, extra_kv = ckpt.run_config, ckpt.extra_kv
    if kind not in KINDS:
        raise ValueError(f"checkpoint kind {kind!r} is not one of {KINDS}")
    if kind == "mnist":
        kv = model_kv(model_config["arch"])
    else:
        kv = config_to_kv(ModelConfig(**model_config), "ggtrain checkpoint", file_type=0)
        kv += list(tokenizer.gguf_kv()) + list(extra_kv)
    kv += [(CHECKPOINT_KEY, VERSION, VT.UINT32),
           ("ggtrain.checkpoint.kind", kind, VT.STRING),
           ("ggtrain.run_config", json.dumps(run_config or {}, sort_keys=True), VT.STRING),
           ("ggtrain.model_config", json.dumps(model_config, sort_keys=True), VT.STRING),
           ("ggtrain.train_config", json.dumps(train_config, sort_keys=True), VT.STRING),
           ("ggtrain.updates", int(state["updates"]), VT.UINT64),
           ("ggtrain.tokens_seen", int(state.get("tokens_seen", 0)), VT.UINT64),
           ("ggtrain.data_rng", data_rng, VT.STRING),
           ("ggtrain.data_fingerprint", data_fingerprint, VT.STRING)]
    if "early_stop" in state:
        kv.append(("ggtrain.early_stop", json.dumps(state["early_stop"], sort_keys=True), VT.STRING))
    if state.get("run") is not None:
        kv.append(("ggtrain.run_state", json.dumps(state["run"], sort_keys=True), VT.STRING))
    tensors = [(name, np.ascontiguousarray(v, np.float32), "F32") for name, v in state["params"].items()]
    for name, v in state["optimizer"].items():
        v = np.ascontiguousarray(v, np.float32)
        if name.startswith(_RUN_STATE):
            tensors.append((name, v, "F32"))
            continue
        for suffix, prefix in _MOMENTS.items():
            if name.endswith(suffix):
                tensors.append((prefix + name[:-len(suffix)], v, "F32"))
                break
        else:
            raise FormatError(f"{path}: optimizer state {name!r} has no checkpoint name")
    for name, v in (state.get("best_params") or {}).items():
        tensors.append((_BEST + name, np.ascontiguousarray(v, np.float32), "F32"))
    if state.get("reference") is not None:
        tensors.append((_REFERENCE, np.ascontiguousarray(state["reference"], np.float32), "F32"))
    write_gguf(path, kv, tensors, progress=progress)


def load_checkpoint(path) -> Checkpoint:
    """The Checkpoint a file holds.

    Raises FormatError when the file is not a ggtrain checkpoint (e.g. a plain model).
    """
    f = read_gguf(path)
    version = f.value(CHECKPOINT_KEY, None)
    if version is None:
        raise FormatError(f"{path}: not a ggtrain checkpoint (no ggtrain.checkpoint.version key); "
                          "a plain model can be converted with `ggtrain convert-checkpoint`")
    if version not in READ_VERSIONS:
        raise FormatError(f"{path}: checkpoint version {version}, this ggtrain reads "
                          f"{', '.join(map(str, READ_VERSIONS))}")
    kind = f.value("ggtrain.checkpoint.kind", "train")
    if kind not in KINDS:
        raise FormatError(f"{path}: unknown checkpoint kind {kind!r} (known: {', '.join(KINDS)})")
    try:
        model_config = json.loads(f.value("ggtrain.model_config"))
        train_config = json.loads(f.value("ggtrain.train_config"))
        run_config = json.loads(f.value("ggtrain.run_config", "{}"))
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: damaged ggtrain config ({exc})") from None
    params, optimizer, best, reference = {}, {}, {}, None
    for name in f.tensors:
        arr = f.read_tensor(name)
        if name == _REFERENCE:
            reference = arr
            continue
        if name.startswith(_RUN_STATE):
            optimizer[name] = arr
            continue
        if name.startswith(_BEST):
            best[name[len(_BEST):]] = arr
            continue
        for suffix, prefix in _MOMENTS.items():
            if name.startswith(prefix):
                optimizer[name[len(prefix):] + suffix] = arr
                break
        else:
            params[name] = arr
    state = {"params": params, "optimizer": optimizer, "updates": int(f.value("ggtrain.updates")),
             "tokens_seen": int(f.value("ggtrain.tokens_seen"))}
    if reference is not None:
        state["reference"] = reference
    for key, name in (("ggtrain.early_stop", "early_stop"), ("ggtrain.run_state", "run")):
        text = f.value(key, None)
        if text is not None:
            try:
                state[name] = json.loads(text)
            except json.JSONDecodeError as exc:
                raise FormatError(f"{path}: damaged {key} ({exc})") from None
    if "early_stop" in state:
        state["best_params"] = best
    return Checkpoint(kind, model_config, train_config, state, None if kind == "mnist" else tokenizer_from_gguf(f),
                      data_rng=f.value("ggtrain.data_rng"), data_fingerprint=f.value("ggtrain.data_fingerprint"),
                      run_config=run_config, extra_kv=carried_kv(f))


def is_checkpoint(f: GGUFFile) -> bool:
    return CHECKPOINT_KEY in f.kv


def checkpoint_summary(f: GGUFFile) -> dict:
    """What a checkpoint is, from its keys and tensor list (nothing read): {"kind",
    "version", "updates", "tokens_seen", "steps" (planned updates), "epochs" (mnist's
    planned epochs), "optimizer" ("adamw",
    or None before any training), "trained_tensors", "trained_parameters", "model" (the
    model config), "lora" (rank, alpha, targets) or None, "base" (path and fingerprint of
    a fine-tune's base model) or None, "data_fingerprint"}."""
    def config(key):
        try:
            return json.loads(f.value(key, "{}"))
        except json.JSONDecodeError:
            raise FormatError(f"{f.path}: damaged {key}") from None
    kind = f.value("ggtrain.checkpoint.kind", "train")
    run, train = config("ggtrain.run_config"), config("ggtrain.train_config")
    not_trained = tuple(_MOMENTS.values()) + (_RUN_STATE, _BEST, _REFERENCE)   # optimizer state, best model
    trained = [t for n, t in f.tensors.items() if not n.startswith(not_trained)]
    base = None
    if run.get("base_fingerprint"):
        base = {"path": run.get("base"), "fingerprint": run["base_fingerprint"]}
    return {"kind": kind, "version": int(f.value(CHECKPOINT_KEY)),
            "updates": int(f.value("ggtrain.updates", 0)), "tokens_seen": int(f.value("ggtrain.tokens_seen", 0)),
            "steps": train.get("steps"), "epochs": train.get("epochs"), "lr": train.get("lr"),
            "optimizer": None if kind == "model" else train.get("optimizer", "adamw"),
            "trained_tensors": len(trained), "trained_parameters": int(sum(t.n_elements for t in trained)),
            "model": config("ggtrain.model_config"), "lora": run.get("lora"), "base": base,
            "data_fingerprint": f.value("ggtrain.data_fingerprint", "") or None}
