"""`ggtrain plot`: training and validation loss and the learning rate of --log files (layer 6).

matplotlib is an optional extra (`pip install 'ggtrain[plot]'`); without it the command
says so in one line.
"""
from __future__ import annotations

import json
import pathlib

import typer

from ggtrain.cli.common import file_errors
from ggtrain.cli.main import app
from ggtrain.errors import ConfigError
from ggtrain.formats.files import atomic_file


def read_log(path: pathlib.Path) -> dict:
    """The curves of one --log file: {"steps", "loss", "lr"} of the training steps and
    {"val_steps", "val_loss"} of the evaluations (mnist's per-epoch lines included)."""
    with file_errors(str(path), "--log file (JSON lines)"):
        lines = path.read_text(encoding="utf-8").splitlines()
    curves = {"steps": [], "loss": [], "lr": [], "val_steps": [], "val_loss": []}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: line {number} is not JSON ({exc.msg}); is it a --log file?") from None
        if not isinstance(rec, dict) or "event" in rec or "step" not in rec:
            continue   # the config record, start and done events
        if rec.get("loss") is not None:
            curves["steps"].append(rec["step"])
            curves["loss"].append(rec["loss"])
            curves["lr"].append(rec.get("lr"))
        if rec.get("val_loss") is not None:
            curves["val_steps"].append(rec["step"])
            curves["val_loss"].append(rec["val_loss"])
    if not curves["steps"]:
        raise ConfigError(f"{path}: no training steps in it (a --log file of train, finetune or mnist train?)")
    return curves


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("ggtrain plot needs matplotlib, the `plot` extra: pip install 'ggtrain[plot]'") from None
    matplotlib.use("Agg")   # files only, no display
    import matplotlib.pyplot as plt
    return plt


@app.command("plot", rich_help_panel="Files")
def plot(
    logs: list[pathlib.Path] = typer.Argument(..., help="--log files (JSON lines) of training runs; several "
                                              "are drawn over each other."),
    out: pathlib.Path = typer.Option("loss.png", "--out", help="The image to write (PNG; .svg and .pdf work too)."),
):
    """Plot training and validation loss, and the learning rate, against the update number."""
    curves = [(path, read_log(path)) for path in logs]
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: folder {out.parent} does not exist")
    plt = _pyplot()
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(3, 1))
    names = [p.name for p in logs]
    for i, (path, c) in enumerate(curves):
        label = path.name if names.count(path.name) == 1 else str(path)
        color = f"C{i % 10}"
        ax_loss.plot(c["steps"], c["loss"], color=color, lw=1, label=f"{label} train")
        if c["val_steps"]:
            ax_loss.plot(c["val_steps"], c["val_loss"], color=color, ls="--", marker="o", ms=3,
                         label=f"{label} validation")
        ax_lr.plot(c["steps"], [float("nan") if v is None else v for v in c["lr"]], color=color, lw=1)
    ax_loss.set_ylabel("loss")
    ax_loss.legend(fontsize="small")
    ax_loss.grid(alpha=0.3)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("update")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_file(out) as f:     # a temporary beside the target, renamed when complete
            fig.savefig(f, format=(out.suffix[1:] or "png").lower(), dpi=100)
    finally:
        plt.close(fig)
    typer.echo(f"wrote {out} ({len(curves)} run{'s' if len(curves) > 1 else ''})", err=True)
