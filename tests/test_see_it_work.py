"""The evidence tools: the batch-size sweep, overlaid run plots, the LR-schedule preview, IDX reading."""

import csv
import gzip
import subprocess
import sys

import pytest
import torch
from multiproc import REPO, launch, python_run
from sweep_harness import load_tool, warm_sweep

from ddp_tricks import UserError
from ddp_tricks.data import images as image_data


def _png(path):
    return path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sweep_on_a_2x2_grid_writes_both_tables_and_figures_and_resumes(tmp_path, monkeypatch, capsys):
    """The sweep (its cells on warm ranks), then the same command line again as a user types it: every cell is
    found finished."""
    argv = [
        "--batch-sizes",
        "32",
        "256",
        "--optimizers",
        "sgd",
        "lars",
        "--epochs",
        "1",
        "--warmup-epochs",
        "0.5",
        "--out",
        str(tmp_path),
        "--",
        "--log-interval",
        "5",
    ]
    assert warm_sweep(monkeypatch).main(argv) == 0, capsys.readouterr().err[-3000:]
    results = (tmp_path / "results.md").read_text()
    assert "## sgd" in results and "## lars" in results
    header = "| Batch | Base LR | top-1 accuracy, final | vs best batch-32 | best epoch | time to train | runs |"
    assert results.count(header) == 2
    assert "| 256 | 0.4 |" in results  # sgd: 0.05 x 256/32, linear scaling
    assert _png(tmp_path / "accuracy_vs_batch.png") and _png(tmp_path / "curves.png")
    cmd = [sys.executable, str(REPO / "tools" / "sweep.py"), *argv]
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and again.stdout.count("finished before, skipped") == 4

    plot_runs = load_tool("plot_runs")  # its command line: test_plot_runs_refuses_a_folder_without_metrics
    cells = tmp_path / "cells"
    assert plot_runs.main([str(cells / "sgd-b32"), str(cells / "lars-b32"), "-o", str(tmp_path / "two.png")]) == 0
    assert _png(tmp_path / "two.png") and _png(tmp_path / "cells" / "sgd-b32" / "curves.png")
    by_step = [str(cells / "sgd-b32"), str(cells / "sgd-b256"), "--x", "step", "-o", str(tmp_path / "steps.png")]
    assert plot_runs.main(by_step) == 0 and _png(tmp_path / "steps.png")


def test_plot_runs_refuses_a_folder_without_metrics(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plot_runs.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "no metrics.csv" in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plot_lr_draws_the_schedule_training_then_follows(tmp_path):
    flags = [
        "--epochs",
        "3",
        "--warmup-epochs",
        "0.5",
        "--scheduler",
        "poly",
        "--lr-scaling",
        "linear",
        "--base-batch-size",
        "64",
        "--runs-dir",
        str(tmp_path),
        "--no-progress",
    ]
    preview = launch([*flags, "--plot-lr", "-n", "preview"], nproc=None)
    assert preview.returncode == 0, preview.stderr[-3000:]
    assert _png(tmp_path / "preview" / "lr_schedule.png")
    assert not (tmp_path / "preview" / "metrics.csv").exists()  # nothing trained
    with open(tmp_path / "preview" / "lr_schedule.csv", newline="") as f:
        planned = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}
    steps_per_epoch = len(planned) // 3
    # by hand: 0.05 x 32/64 = 0.025 peak; warmup 0.5 epoch; poly power 1 to 0 over the rest
    warmup = round(0.5 * steps_per_epoch)
    assert planned[1] == pytest.approx(0.025 / warmup) and planned[warmup] == pytest.approx(0.025)
    trained = python_run([*flags, "-n", "trained"])  # `python run.py` itself: a training run in one process
    assert trained.returncode == 0, trained.stderr[-3000:]
    with open(tmp_path / "trained" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:  # the LR an epoch's last step applied: the preview's at that step
        assert float(row["lr"]) == pytest.approx(planned[int(row["step"])], rel=1e-12)


def _lr_line(monkeypatch, argv: list[str]) -> tuple[list[float], list[float]]:
    """run.main(argv) in this process, and the per-step line of its curves.png's learning-rate panel (x, y)."""
    import run
    from ddp_tricks import plots

    figures, make = [], plots._figure
    monkeypatch.setattr(plots, "_figure", lambda **kw: figures.append(make(**kw)) or figures[-1])
    assert run.main(argv) == 0
    (ax,) = [ax for ax in figures[-1].axes if ax.get_title().startswith("learning rate")]
    (line,) = [line for line in ax.get_lines() if line.get_label() != "end of epoch"]  # the per-step one
    return list(line.get_xdata()), list(line.get_ydata())


def _steps_csv(folder) -> list[dict]:
    with open(folder / "steps.csv", newline="") as f:
        return [{"step": int(r["step"]), "epoch": int(r["epoch"]), "lr": float(r["lr"])} for r in csv.DictReader(f)]


@pytest.mark.timeout(240)
def test_curves_draw_the_lr_of_a_resumed_run_from_its_first_step(tmp_path, monkeypatch):
    """The LR panel is drawn from steps.csv, which a resumed run continues. Broken on purpose: the panel drawn from
    the process's own list of LRs (run.py's old `plots.curves(folder.path, t.lr_log, ...)`) fails it: its line
    starts at the resume, at epoch 1."""
    flags = ["-b", "256", "--log-interval", "2", "--warmup-epochs", "0.5", "--no-progress", "--runs-dir",
             str(tmp_path), "-n", "r"]  # fmt: skip
    import run

    assert run.main([*flags, "-e", "1"]) == 0
    x, y = _lr_line(monkeypatch, [*flags, "-e", "2", "--resume", "auto"])
    rows = _steps_csv(tmp_path / "r")
    steps_per_epoch = max(r["step"] for r in rows if r["epoch"] == 1)  # 1,438 digits in steps of 256: 6
    assert [r["step"] for r in rows] == [1, 2, 4, 6, 8, 10, 12]  # every 2nd, the first and each epoch's last
    assert x[0] == pytest.approx(1 / steps_per_epoch)  # from step 1, not from the resume
    assert x == pytest.approx([r["step"] / steps_per_epoch for r in rows])
    assert y == [r["lr"] for r in rows]


@pytest.mark.timeout(240)
def test_curves_place_a_traced_run_s_lr_in_its_own_epochs(tmp_path, monkeypatch):
    """A traced epoch's steps are as many as its batches need: each epoch's last row sits at that epoch's end, the
    run's last at its last epoch. Broken on purpose: the old x of step / a fixed steps-per-epoch fails it (the run
    ends before its last epoch)."""
    trace = str(REPO / "examples" / "traces" / "doubling.csv")
    argv = ["--batch-trace", trace, "-e", "3", "--log-interval", "5", "--no-progress", "--runs-dir", str(tmp_path),
            "-n", "t"]  # fmt: skip
    x, y = _lr_line(monkeypatch, argv)
    rows = _steps_csv(tmp_path / "t")
    ends = [max(r["step"] for r in rows if r["epoch"] == e) for e in (1, 2, 3)]
    assert ends[1] - ends[0] != ends[0] or ends[2] - ends[1] != ends[0]  # epochs of different lengths in steps
    starts = [0, *ends[:2]]
    expected = [r["epoch"] - 1 + (r["step"] - starts[r["epoch"] - 1]) / (ends[r["epoch"] - 1] - starts[r["epoch"] - 1])
                for r in rows]  # fmt: skip
    assert x[-1] == 3.0 and x == pytest.approx(expected)
    assert [x[[r["step"] for r in rows].index(end)] for end in ends] == [1.0, 2.0, 3.0]
    assert y == [r["lr"] for r in rows]


def test_curves_without_steps_csv_say_the_lr_has_no_per_step_line(tmp_path, monkeypatch):
    """--log-interval 0 writes no steps.csv: the LR panel keeps the epochs' ends and says why there is no line."""
    from ddp_tricks import plots

    (tmp_path / "metrics.csv").write_text("epoch,step,train_loss,val_loss,lr\n1,6,2.0,1.9,0.1\n2,12,1.5,1.4,0.05\n")
    figures, make = [], plots._figure
    monkeypatch.setattr(plots, "_figure", lambda **kw: figures.append(make(**kw)) or figures[-1])
    assert _png(plots.curves(tmp_path))
    (ax,) = [ax for ax in figures[0].axes if ax.get_title().startswith("learning rate")]
    assert ax.get_title() == "learning rate (per step: no steps.csv, --log-interval 0)"
    assert [line.get_label() for line in ax.get_lines()] == ["end of epoch"]


def test_idx_files_are_read_and_split(tmp_path):
    images = torch.randint(0, 256, (50, 28, 28), dtype=torch.uint8)
    labels = torch.arange(50, dtype=torch.uint8) % 10
    header = lambda dims: bytes([0, 0, 8, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)  # noqa: E731
    with gzip.open(tmp_path / "t10k-images-idx3-ubyte.gz", "wb") as f:
        f.write(header([50, 28, 28]) + images.numpy().tobytes())
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(header([50]) + labels.numpy().tobytes())
    assert torch.equal(image_data.read_idx(tmp_path / "t10k-images-idx3-ubyte.gz"), images)
    train, val = image_data.mnist_idx(str(tmp_path))
    assert len(train) == 40 and len(val) == 10
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(header([50]) + labels.numpy().tobytes()[:20])
    with pytest.raises(UserError, match="truncated"):
        image_data.read_idx(tmp_path / "t10k-labels-idx1-ubyte")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sweep_and_plots_follow_the_task_s_monitored_metric(tmp_path, monkeypatch, capsys):
    """A fork that reports `mae` (examples/regression.py) sweeps and plots its own metric, lower is better."""
    argv = ["--batch-sizes", "16", "64", "--optimizers", "adamw", "--epochs", "1", "--out", str(tmp_path), "--",
            "--task", "examples/regression.py:Diabetes"]  # fmt: skip
    assert warm_sweep(monkeypatch).main(argv) == 0, capsys.readouterr().err[-3000:]
    table = (tmp_path / "results.md").read_text()
    assert "| Batch | Base LR | mae, final | vs best batch-16 | best epoch | time to train | runs |" in table
    with open(tmp_path / "cells" / "adamw-b16" / "metrics.csv", newline="") as f:
        mae = float(list(csv.DictReader(f))[-1]["val_mae"])
    assert f"| 16 | 0.0007071 | {mae:.2f} | +0.00 |" in table  # as metrics.csv has it, in its units (LR: sqrt rule)
    assert _png(tmp_path / "accuracy_vs_batch.png") and _png(tmp_path / "curves.png")
    plot_runs, cells = load_tool("plot_runs"), tmp_path / "cells"
    assert plot_runs.main([str(cells / "adamw-b16"), str(cells / "adamw-b64"), "-o", str(tmp_path / "two.png")]) == 0
    assert _png(tmp_path / "two.png")
    capsys.readouterr()
    assert plot_runs.main([str(cells / "adamw-b16"), "--metric", "acc", "-o", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reports no metric 'acc'" in err, err


def test_no_tool_names_a_metric_of_the_built_in_task():
    """Sweeps, plots and the BatchNorm check read the run's metrics from its config.json, not `val_acc`."""
    for path in [*REPO.glob("tools/*.py"), *REPO.glob("*.py"), *REPO.glob("ddp_tricks/**/*.py")]:
        if path.name != "task.py":
            assert "val_acc" not in path.read_text(), path
