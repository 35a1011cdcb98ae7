"""Matplotlib figures of a run (loss, accuracy and LR per epoch), drawn headless from its metrics.csv."""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    with open(Path(run_dir) / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def curves(run_dir: str | Path) -> Path:
    """Write run_dir/curves.png: loss, accuracy and LR against epoch."""
    rows = read_metrics(run_dir)
    epochs = [r["epoch"] for r in rows]
    fig, (ax_loss, ax_acc, ax_lr) = plt.subplots(1, 3, figsize=(14, 4))
    ax_loss.plot(epochs, [r["train_loss"] for r in rows], "o-", label="train")
    ax_loss.plot(epochs, [r["val_loss"] for r in rows], "o-", label="validation")
    ax_loss.set(title="Loss", xlabel="epoch", ylabel="cross-entropy")
    ax_acc.plot(epochs, [100 * r["train_acc"] for r in rows], "o-", label="train")
    ax_acc.plot(epochs, [100 * r["val_acc"] for r in rows], "o-", label="validation")
    ax_acc.set(title="Accuracy", xlabel="epoch", ylabel="top-1 accuracy (%)")
    ax_lr.plot(epochs, [r["lr"] for r in rows], "o-")
    ax_lr.set(title="Learning rate (end of epoch)", xlabel="epoch", ylabel="learning rate")
    for ax in (ax_loss, ax_acc):
        ax.legend()
    for ax in (ax_loss, ax_acc, ax_lr):
        ax.grid(alpha=0.3)
    fig.suptitle(Path(run_dir).name)
    fig.tight_layout()
    out = Path(run_dir) / "curves.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
