"""Matplotlib figures of runs, drawn headless from their metrics.csv and steps.csv: the task's metrics per epoch and
the LR per step, the LR schedule, several runs overlaid, a metric against the batch size."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path


def _figure(**kwargs):
    """A matplotlib Figure that the Agg backend draws, without pyplot (no global figure registry, no GUI backend to
    choose, ~0.3 s less to import). Imported when a figure is drawn, not when a run starts: only rank 0 draws, at
    the end."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def per_step(ax, rows: list[dict[str, float]]) -> None:
    """steps.csv's training loss per window against the global step, and samples/s on a second axis."""
    ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], "-", lw=1, label="train loss (window)")
    ax.set(title="per step (steps.csv)", xlabel="optimizer step", ylabel="loss")
    speed = ax.twinx()
    speed.plot([r["step"] for r in rows], [r["samples_per_second"] for r in rows], ":", color="gray", lw=1)
    speed.set_ylabel("samples/s (dotted)")
    ax.legend()
    ax.grid(alpha=0.3)


def read_metrics(run_dir: str | Path, name: str = "metrics.csv") -> list[dict[str, float]]:
    with open(Path(run_dir) / name, newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def epoch_positions(rows: list[dict[str, float]], steps_per_epoch: int = 0) -> list[float]:
    """Where each steps.csv row is in epochs (2.5: half-way through the second), from the rows: an epoch ends at its
    last row (each epoch's last step writes one) and begins where the one before ended, so a traced epoch's steps
    count as they are. The run's last epoch may end early (--max-steps, early stopping): it is `steps_per_epoch`
    long where that is known (an untraced run: config.json's), else as long as its rows."""
    ends: dict[int, float] = {}
    firsts: dict[int, float] = {}
    for row in rows:
        epoch = int(row["epoch"])
        ends[epoch] = max(ends.get(epoch, 0.0), row["step"])
        firsts[epoch] = min(firsts.get(epoch, math.inf), row["step"])
    last = max(ends, default=0)
    positions = []
    for row in rows:
        epoch = int(row["epoch"])
        # where the epoch before ended; without its rows, just before this epoch's first
        start = ends.get(epoch - 1, 0.0 if epoch == 1 else firsts[epoch] - 1)
        length = ends[epoch] - start
        if epoch == last and steps_per_epoch:
            length = max(length, steps_per_epoch)
        positions.append(epoch - 1 + (row["step"] - start) / max(length, 1.0))
    return positions


def curves(run_dir: str | Path) -> Path:
    """Write run_dir/curves.png: one panel per reported metric (train and validation against epoch, and the EMA
    weights' validation with --model-ema; the loss first), and the LR: at each epoch's end (metrics.csv), and at each
    steps.csv row, placed in epochs by `epoch_positions` (no line without steps.csv: --log-interval 0, said on the
    panel). The files hold the whole run, a resumed one's too. The panels follow metrics.csv's columns, i.e. the
    task, titled as the task shows them (its `shown_as`, kept in the run's config.json)."""
    rows = read_metrics(run_dir)
    config_file = Path(run_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    shown = config.get("task_metrics", {})
    epochs = [r["epoch"] for r in rows]
    names = list(
        dict.fromkeys(
            k.split("_", 1)[1] for k in rows[0] if k.startswith(("train_", "val_")) and not k.startswith("val_ema_")
        )
    )
    noise = [r.get("noise_scale", math.nan) for r in rows]
    measured = any(math.isfinite(v) for v in noise)  # a run that saw two batch sizes per step (training/noise.py)
    steps = read_metrics(run_dir, "steps.csv") if (Path(run_dir) / "steps.csv").is_file() else []
    panels = len(names) + 1 + measured + bool(steps)
    fig = _figure(figsize=(4.6 * panels, 4))
    axes = list(fig.subplots(1, panels))
    if steps:  # the per-step rows (training/step_log.py): the window's loss and throughput at each logged step
        per_step(axes.pop(), steps)
    for ax, name in zip(axes, names):
        for split, label in (("train", "train"), ("val", "validation"), ("val_ema", "validation, EMA weights")):
            if f"{split}_{name}" in rows[0]:
                ax.plot(epochs, [r[f"{split}_{name}"] for r in rows], "o-", label=label)
        ax.set(title=shown.get(name, {}).get("title", name), xlabel="epoch", ylabel=name)
    if measured:
        ax_noise = axes[-1]
        ax_noise.plot(epochs, noise, "o-", label="B_simple = tr(Σ) / |G|²")
        ax_noise.plot(epochs, [r["global_batch"] for r in rows], "--", label="global batch")
        ax_noise.set(title="gradient noise scale", xlabel="epoch", ylabel="samples", yscale="log")
    ax_lr = axes[len(names)]
    ax_lr.plot(epochs, [r["lr"] for r in rows], "o", label="end of epoch")
    title = "learning rate"
    if steps:
        untraced = config.get("steps_per_epoch", 0) if not config.get("batch_trace") else 0
        ax_lr.plot(epoch_positions(steps, untraced), [r["lr"] for r in steps], "-", lw=1, label="steps.csv rows")
    else:
        title += " (per step: no steps.csv, --log-interval 0)"
    ax_lr.set(title=title, xlabel="epoch", ylabel="learning rate")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    return out


def lr_schedule(
    lrs: list[list[float]], steps_per_epoch: int, run_dir: str | Path, title: str, groups: list[str] | None = None
) -> Path:
    """run_dir/lr_schedule.png: the learning rate at every optimizer step (a line per parameter group: `lrs` holds
    one list per group, `groups` their names), epoch boundaries marked; and the numbers in run_dir/lr_schedule.csv
    (`lr`, or one column per group)."""
    run_dir = Path(run_dir)
    columns = ["lr"] if len(lrs) == 1 else [f"lr_{name}" for name in groups]
    with open(run_dir / "lr_schedule.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *columns])
        writer.writerows((step, *values) for step, values in enumerate(zip(*lrs), start=1))
    path = run_dir / "lr_schedule.png"
    fig = _figure(figsize=(8, 4))
    ax = fig.subplots()
    steps = range(1, len(lrs[0]) + 1)
    for group, values in zip(groups or [None], lrs):
        ax.plot(steps, values, lw=1.5, label=group)
    if len(lrs) > 1:
        ax.legend()
    for epoch_end in range(steps_per_epoch, len(lrs[0]), steps_per_epoch):
        ax.axvline(epoch_end + 0.5, color="grey", lw=0.5, alpha=0.4)
    ax.set(title=title, xlabel=f"optimizer step ({steps_per_epoch} per epoch; grey lines: epochs)",
           ylabel="learning rate")  # fmt: skip
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def overlay(run_dirs: list[str | Path], path: str | Path, metric: dict, by: str = "epoch") -> Path:
    """One validation metric (`metric`: storage.run_folder.headline), the loss and the LR of several runs on one
    figure, one colour per run; and the gradient noise scale, where a run measured it (its global batch dashed).
    `by`: the x axis, "epoch" (samples) or "step" (optimizer steps, on a log scale: runs of other batch sizes)."""
    runs = {Path(run_dir).name: read_metrics(run_dir) for run_dir in run_dirs}
    measured = any(math.isfinite(r.get("noise_scale", math.nan)) for rows in runs.values() for r in rows)
    fig = _figure(figsize=(5 * (3 + measured), 4.5))
    axes = fig.subplots(1, 3 + measured)
    ax_metric, ax_loss, ax_lr = axes[:3]
    name, scale, unit = metric["name"], metric["scale"], f" ({metric['unit']})" if metric["unit"] else ""
    for label, rows in runs.items():
        epochs = [r[by] for r in rows]
        (line,) = ax_metric.plot(epochs, [scale * r[f"val_{name}"] for r in rows], "o-", label=f"{label} (val)")
        if f"train_{name}" in rows[0]:
            train = [scale * r[f"train_{name}"] for r in rows]
            ax_metric.plot(epochs, train, "--", color=line.get_color(), alpha=0.6)
        losses = [r.get("val_loss", math.nan) for r in rows]  # none where the task's score() evaluates
        ax_loss.plot(epochs, losses, "o-", color=line.get_color(), label=label)
        ax_lr.plot(epochs, [r["lr"] for r in rows], "o-", color=line.get_color(), label=label)
        if measured:
            axes[3].plot(epochs, [r.get("noise_scale", math.nan) for r in rows], "o-", color=line.get_color(),
                         label=label)  # fmt: skip
            axes[3].plot(epochs, [r["global_batch"] for r in rows], "--", color=line.get_color(), alpha=0.6)
    x = "epoch" if by == "epoch" else "optimizer step (log scale)"
    ax_metric.set(title=f"{metric['title']} (solid: validation, dashed: train)", xlabel=x,
                  ylabel=f"{metric['title']}{unit}")  # fmt: skip
    ax_loss.set(title="Validation loss", xlabel=x, ylabel="loss")
    ax_lr.set(title="Learning rate (end of epoch)", xlabel=x, ylabel="learning rate")
    if measured:
        axes[3].set(title="Gradient noise scale (dashed: global batch)", xlabel=x, ylabel="samples",
                    yscale="log")  # fmt: skip
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        if by == "step":
            ax.set_xscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def accuracy_vs_batch(results: dict[str, list[dict]], path: str | Path, metric: dict) -> Path:
    """The final value of a validation metric (`metric`: storage.run_folder.headline) against global batch size
    (log scale), one line per optimizer; with several runs per cell (seeds), the mean with a bar from the lowest
    to the highest run."""
    fig = _figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for optimizer, cells in results.items():
        x, y = [c["batch"] for c in cells], [c["value"] for c in cells]
        if all("value_min" in c for c in cells):
            bars = [[c["value"] - c["value_min"] for c in cells], [c["value_max"] - c["value"] for c in cells]]
            ax.errorbar(x, y, yerr=bars, fmt="o-", capsize=4, label=optimizer)
        else:
            ax.plot(x, y, "o-", label=optimizer)
    ax.set_xscale("log", base=2)
    unit = f" ({metric['unit']})" if metric["unit"] else ""
    ax.set(title=f"Validation {metric['title']} against batch size", xlabel="global batch size (samples, log scale)",
           ylabel=f"final {metric['title']}{unit}: mean, min-max")  # fmt: skip
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def phases(first: str | Path, after: list[str | Path], path: str | Path, start: str | Path | None = None) -> Path:
    """A run in phases: `first` (phase 1) from 0, then each run of `after` placed where `first` ended (its units and
    optimizer steps counted on from there), so a phase 2 started from phase 1 (`--init-from`) reads as its
    continuation and a phase 2 from scratch starts at the same place beside it. `start`: an `--eval-only
    --init-from` run folder (its eval.csv): the first phase's weights on the second phase's validation set, drawn
    where phase 2 begins and joined to the runs that start from it. Three panels: the validation loss per epoch
    against the training units (the task's units(): tokens), the per-step training loss and the LR (steps.csv)
    against the global step."""
    fig = _figure(figsize=(16, 5.5))
    ax_val, ax_loss, ax_lr = fig.subplots(1, 3)
    units_end = step_end = 0.0
    begin = None  # where the runs started from the first phase begin, on the validation panel
    for index, run_dir in enumerate([first, *after]):
        epochs, steps = read_metrics(run_dir), read_metrics(run_dir, "steps.csv")
        units_at = {r["step"]: r["units"] for r in steps}  # each epoch's last step has a row
        units = [(units_end + units_at[r["step"]]) / 1e6 for r in epochs]
        losses = [r["val_loss"] for r in epochs]
        config = json.loads((Path(run_dir) / "config.json").read_text())
        label = Path(run_dir).name
        if config.get("init_from"):
            label += " (--init-from" + (" --init-optimizer)" if config.get("init_optimizer") else ")")
        (line,) = ax_val.plot(units, losses, "o-", label=label)
        if index and config.get("init_from") and begin:
            ax_val.plot([begin[0], units[0]], [begin[1], losses[0]], ":", color=line.get_color())
        x = [step_end + r["step"] for r in steps]
        ax_loss.plot(x, [r["train_loss"] for r in steps], "-", lw=1, color=line.get_color(), label=label)
        ax_lr.plot(x, [r["lr"] for r in steps], "-", color=line.get_color(), label=label)
        if index == 0:
            units_end, step_end = steps[-1]["units"], steps[-1]["step"]
            if start is not None:
                begin = (units_end / 1e6, read_metrics(start, "eval.csv")[0]["val_loss"])
                ax_val.plot(*begin, "kx", ms=9, label=f"{Path(first).name}'s weights on the next phase's validation")
    for ax in (ax_loss, ax_lr):
        ax.axvline(step_end, color="gray", lw=0.8, ls="--")
    ax_val.axvline(units_end / 1e6, color="gray", lw=0.8, ls="--")
    ax_val.set(title="Validation loss per epoch (each phase on its own validation set)",
               xlabel="training units (tokens), millions", ylabel="loss")  # fmt: skip
    ax_loss.set(title="Training loss per steps.csv row", xlabel="global optimizer step", ylabel="loss")
    ax_lr.set(title="Learning rate (steps.csv)", xlabel="global optimizer step", ylabel="learning rate")
    for ax in (ax_val, ax_loss, ax_lr):
        ax.grid(alpha=0.3)
    fig.legend(*ax_val.get_legend_handles_labels(), loc="lower center", ncol=3, fontsize=9)  # one for the three
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=100)
    return Path(path)
