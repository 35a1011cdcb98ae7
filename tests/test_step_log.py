"""Per-step rows (training/step_log.py): steps.csv and TensorBoard every --log-interval steps on 2 ranks, their
windows adding up to the epoch's metrics, FLOPs per sample as FlopCounterMode counts a plain forward and backward,
a resumed run's rows each written once, and the flags' mistakes as one line.
"""

import csv
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multiproc import REPO, launch, preempted, python_run
from resumed import assert_resumed
from step_rows import rows_of, rows_through
from torch.utils.flop_counter import FlopCounterMode

from ddp_tricks import models
from ddp_tricks.storage.step_sinks import CsvRows
from ddp_tricks.training import flops

ARGS = ["-e", "2", "-b", "16", "--log-interval", "5", "--no-progress"]
STEPS_PER_EPOCH = 45  # the digits' 1437 training samples at a global batch of 32 (2 ranks x 16)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    runs = tmp_path_factory.mktemp("steps")
    result = launch([*ARGS, "--tensorboard", "--runs-dir", str(runs), "-n", "run"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    return runs / "run", result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("step-log-two-ranks")
def test_steps_csv_has_a_row_every_interval_and_its_windows_make_the_epoch(two_ranks):
    """Broken on purpose: the window not restarted after a row (`_start_window` dropped from write) fails it (the
    windows' losses then overlap and no longer average to the epoch's)."""
    folder, _ = two_ranks
    rows = rows_of(folder / "steps.csv")
    steps = [int(r["step"]) for r in rows]
    assert steps == [1, *range(5, 2 * STEPS_PER_EPOCH + 1, 5)]
    epochs = list(csv.DictReader(open(folder / "metrics.csv")))
    for epoch, metrics in enumerate(epochs, start=1):
        mine = [r for r in rows if int(r["epoch"]) == epoch]
        before = 0 if epoch == 1 else int(rows[steps.index(STEPS_PER_EPOCH)]["samples"])
        samples = [int(r["samples"]) - before for r in mine]
        window = [b - a for a, b in zip([0, *samples], samples)]  # samples of each row's window
        # the epoch's mean loss and accuracy, from the windows' means weighted by their samples (units = samples)
        for name in ("train_loss", "train_acc"):
            mean = sum(float(r[name]) * n for r, n in zip(mine, window)) / sum(window)
            assert math.isclose(mean, float(metrics[name]), rel_tol=1e-9), (name, mean, metrics[name])
        assert samples[-1] == round(float(metrics["global_batch"]) * STEPS_PER_EPOCH)  # every sample of the epoch
    for r in rows:
        assert int(r["slowest_rank"]) in (0, 1)
        for name in ("step_seconds", "data_wait"):
            low, mid, high = (float(r[f"{name}_{s}"]) for s in ("min", "median", "max"))
            assert 0 <= low <= mid <= high
        assert 0 <= float(r["data_wait_share"]) <= 1
        assert float(r["grad_norm"]) > 0 and float(r["loss_scale"]) == 1.0 and int(r["skipped_steps"]) == 0
        assert float(r["samples_per_second"]) > 0 and float(r["tflops"]) > 0
        assert math.isnan(float(r["mfu"])) and math.isnan(float(r["peak_memory_gib"]))  # on the CPU: neither
        assert float(r["flops_per_sample"]) == float(rows[0]["flops_per_sample"]) > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.xdist_group("step-log-two-ranks")
def test_tensorboard_holds_the_rows_at_their_global_steps(two_ranks):
    """Broken on purpose: TensorBoard given the epoch as the step (`row["epoch"]` in TensorBoardRows) fails it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder, _ = two_ranks
    rows = rows_of(folder / "steps.csv")
    events = EventAccumulator(str(folder / "tb" / "steps"))
    events.Reload()
    for name in ("train_loss", "lr", "samples_per_second", "grad_norm", "data_wait_seconds", "tflops"):
        scalars = events.Scalars(f"steps/{name}")
        assert [s.step for s in scalars] == [int(r["step"]) for r in rows], name
        assert all(math.isclose(s.value, float(r[name]), rel_tol=1e-6) for s, r in zip(scalars, rows)), name


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-process run of one parameter group with TensorBoard: its folder."""
    runs = tmp_path_factory.mktemp("one-rank")
    args = ["-e", "1", "-b", "256", "--log-interval", "2", "--tensorboard", "--no-progress"]
    result = python_run([*args, "--runs-dir", str(runs), "-n", "run"])
    assert result.returncode == 0, result.stderr[-3000:]
    return runs / "run"


@pytest.mark.timeout(240)
def test_tensorboard_s_tags_are_steps_csv_s_columns(one_rank):
    """One parameter group: the row's `lr_0` is no column of steps.csv (only `lr` says it), nor a tag. Broken on
    purpose: TensorBoardRows writing every numeric field of the row fails it (a `steps/lr_0` tag)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open(one_rank / "steps.csv", newline="") as f:
        columns = next(csv.reader(f))
    rows = rows_of(one_rank / "steps.csv")
    events = EventAccumulator(str(one_rank / "tb" / "steps"))
    events.Reload()
    valued = [c for c in columns[1:] if any(not math.isnan(float(r[c])) for r in rows)]  # TensorBoard leaves NaN out
    assert "lr" in valued and not any(c.startswith("lr_") for c in columns)
    assert sorted(events.Tags()["scalars"]) == sorted(f"steps/{c}" for c in valued)


@pytest.mark.timeout(240)
def test_docs_say_nan_where_steps_csv_holds_it(one_rank):
    """On the CPU, one process: no MFU, no CUDA memory, no noise scale, each `nan` in the file, as docs/steps.md says.
    Broken on purpose: the page's old "the column is empty" fails it."""
    rows = rows_of(one_rank / "steps.csv")
    assert {r[c] for r in rows for c in ("mfu", "peak_memory_gib", "noise_scale")} == {"nan"}
    page = (REPO / "docs" / "steps.md").read_text()
    assert "the column holds `nan`" in page and "(`nan` on the CPU)" in page and "measured (else `nan`)" in page
    assert "empty" not in page


def count_plainly(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> int:
    """One forward and backward of `model` with cross-entropy, on real tensors, under FlopCounterMode."""
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
    return counter.get_total_flops()


class Classify:
    def loss(self, outputs, targets):
        return torch.nn.functional.cross_entropy(outputs, targets)


@pytest.mark.timeout(300)
def test_flops_per_sample_of_the_default_cnn_and_resnet50_are_a_plain_forward_and_backward_s():
    """With a frozen part too. Broken on purpose: the backward left out of flops.count fails it (a third of the
    count); a hook on every parameter, frozen ones too, fails the frozen model (counted nowhere: RuntimeError)."""
    torchvision = pytest.importorskip("torchvision")
    cases = [
        (models.build("toy", 1, 10), torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))),
        (torchvision.models.resnet50(), torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,))),
    ]
    frozen = models.build("toy", 1, 10)
    frozen.features.requires_grad_(False)  # a frozen part: its parameters take no gradient (nor a hook)
    cases.insert(1, (frozen, torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))))  # resnet50 stays last
    for model, inputs, targets in cases:
        measured = flops.measure(Classify(), model, inputs, targets, len(inputs))
        assert measured.counted_on == "meta"
        assert measured.per_sample == count_plainly(model, inputs, targets) / len(inputs)
    # torchvision's published 4.089 GMACs forward at 224 px: the forward is 2 x that, the backward about twice more
    assert 3 * 2 * 4.089e9 * 0.99 < measured.per_sample < 3 * 2 * 4.089e9 * 1.01


class ReadsAValue(torch.nn.Module):
    """A forward the meta device cannot run: it reads a value (`.item()`)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 10)
        self.norm = torch.nn.BatchNorm1d(64)

    def forward(self, x):
        return self.lin(self.norm(x)) * (1.0 if x.abs().max().item() > 0 else 0.0)


def test_where_the_meta_device_cannot_run_the_step_its_flops_are_counted_on_a_copy_sharing_the_weights():
    """The real-tensor count: the plain count; the model's weights, gradients and BatchNorm statistics untouched.
    Broken on purpose: counting on the model itself (no copy) fails it (its running mean moves, gradients set)."""
    model, inputs, targets = ReadsAValue(), torch.randn(4, 64), torch.randint(0, 10, (4,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    measured = flops.measure(Classify(), model, inputs, targets, len(inputs))
    assert measured.counted_on == "real" and "RuntimeError" in measured.note
    assert measured.per_sample == count_plainly(ReadsAValue(), inputs, targets) / len(inputs)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_resumed_run_s_rows_after_its_checkpoint_are_dropped(tmp_path):
    """Broken on purpose: CsvRows keeping every row it finds fails it (steps 25..50 twice after the rewrite)."""
    columns = ["step", "epoch", "train_loss"]
    first = CsvRows(tmp_path / "steps.csv", columns, through_step=0)
    for step in range(5, 55, 5):
        first.write({"step": step, "epoch": 1, "train_loss": 1.0})
    again = CsvRows(tmp_path / "steps.csv", columns, through_step=23)  # the checkpoint's global step
    for step in range(25, 55, 5):
        again.write({"step": step, "epoch": 1, "train_loss": 2.0})
    rows = rows_of(tmp_path / "steps.csv")
    assert [int(r["step"]) for r in rows] == list(range(5, 55, 5))
    assert [float(r["train_loss"]) for r in rows] == [1.0] * 4 + [2.0] * 6


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_mid_run_and_resume_auto_leave_each_step_s_row_once(tmp_path):
    """The stop comes after step 60's row (mid epoch 2): the resumed run writes the rows after its checkpoint once,
    and its samples seen go on from the checkpoint's. Broken on purpose: StepLog.load_state_dict ignoring its part
    of the checkpoint fails it (the samples seen start again from 0)."""
    folder = tmp_path / "run"
    args = [*ARGS, "--runs-dir", str(tmp_path), "-n", "run"]
    out, err = preempted(args, folder / "last.pt", ready=lambda: rows_through(folder, 60))
    assert (folder / "last.pt").exists(), err[-3000:]
    saved = tmp_path / "saved.pt"
    shutil.copy(folder / "last.pt", saved)
    result = launch([*args, "--resume", "auto"], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_resumed(result.stdout, saved, 2 * STEPS_PER_EPOCH)
    rows = rows_of(folder / "steps.csv")
    steps = [int(r["step"]) for r in rows]
    assert len(steps) == len(set(steps)) and set(range(5, 91, 5)) <= set(steps)
    assert sorted(steps) == steps
    # samples seen: 32 a step (the epoch's last step is short), counted across the stop
    samples = {int(r["step"]): int(r["samples"]) for r in rows}
    per_epoch = samples[STEPS_PER_EPOCH]
    assert samples[90] == 2 * per_epoch and samples[60] == per_epoch + 15 * 32


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "flags, says",
    [
        (["--log-interval", "-1"], "--log-interval must be >= 0"),
        (["--peak-tflops", "-3"], "--peak-tflops must be >= 0"),
    ],
)
def test_a_step_flag_s_mistake_is_one_line(flags, says, tmp_path):
    result = python_run([*flags, "--runs-dir", str(tmp_path)])
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and says in result.stderr, result.stderr


@pytest.mark.timeout(120)
def test_wandb_without_its_package_is_one_line(tmp_path):
    """Said before anything starts (no run folder). Where wandb is installed (requirements-dev.txt has it), a module
    of that name that fails to import, first on PYTHONPATH, hides it. Broken on purpose: the check dropped from
    check_step_flags fails it (the sink's own line then comes after the run folder is written)."""
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "wandb.py").write_text("raise ImportError('wandb hidden by the test')\n")
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(REPO / "run.py"), "--wandb", "--runs-dir", str(tmp_path), "-n", "w"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=100, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--wandb needs the wandb package: pip install wandb" in result.stderr
    assert not (tmp_path / "w").exists()


def _has_wandb() -> bool:
    return subprocess.run([sys.executable, "-c", "import wandb"], capture_output=True).returncode == 0


def wandb_records(path) -> list[bytes]:
    """The records of a .wandb file, read as what it is, a LevelDB log (leveldb's doc/log_format.md; wandb's own
    Python reader is gone from its newer releases): a 7-byte file header, then 32 KiB blocks of records, each a 7-byte
    header (checksum, little-endian length, type: 1 whole, 2 first, 3 middle, 4 last) and its bytes."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, position, block = [], b"", 7, 32768
    while position + 7 <= len(data):
        left = block - position % block
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        if left < 7 or (length == 0 and kind == 0):  # a block's tail, too short for a header, or zero padding
            position += left
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_wandb_offline_gets_the_rows(tmp_path):
    """The rows through W&B (offline, no network), read back from the run it wrote: every row at its global step,
    with its training loss. wandb is in requirements-dev.txt, so `make test` runs it. Broken on purpose:
    the sink logging at the epoch instead of the global step fails it."""
    if not _has_wandb():
        pytest.skip("wandb is not installed (pip install -e '.[wandb]')")
    env = os.environ | {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cmd = [sys.executable, str(REPO / "run.py"), "-e", "1", "-b", "64", "--log-interval", "5", "--no-progress"]
    cmd += ["--wandb", "steps-test", "--runs-dir", str(tmp_path), "-n", "w"]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    written = list((tmp_path / "w" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(written) == 1
    rows = rows_of(tmp_path / "w" / "steps.csv")
    from wandb.proto import wandb_internal_pb2

    logged = []
    for record in wandb_records(written[0]):
        parsed = wandb_internal_pb2.Record()
        parsed.ParseFromString(record)
        if parsed.WhichOneof("record_type") == "history":
            logged.append({item.key or "/".join(item.nested_key): item.value_json for item in parsed.history.item})
    assert [int(h["_step"]) for h in logged] == [int(r["step"]) for r in rows]
    assert [float(h["steps/train_loss"]) for h in logged] == pytest.approx([float(r["train_loss"]) for r in rows])


def test_peak_tflops_given_or_none_on_the_cpu():
    assert flops.peak_tflops(torch.device("cpu"), "bf16", 100.0)[0] == 100.0
    peak, note = flops.peak_tflops(torch.device("cpu"), "bf16")
    assert peak == 0.0 and "no MFU on cpu" in note


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(300)
def test_on_a_gpu_the_rows_hold_peak_memory_and_the_mfu_of_a_known_device(tmp_path):
    """One process on the GPU, bf16: peak memory is the allocator's (> 0); MFU is achieved TFLOP/s over the table's
    peak for this device's name, computed here from the row's own columns (nan where the device is not in the table)."""
    result = python_run(["-e", "1", "-b", "64", "--log-interval", "5", "--no-progress", "--device", "cuda", "--amp",
                         "bf16", "--runs-dir", str(tmp_path), "-n", "g"])  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    peak, _ = flops.peak_tflops(torch.device("cuda"), "bf16")
    for r in rows_of(tmp_path / "g" / "steps.csv"):
        assert float(r["peak_memory_gib"]) > 0
        tflops = float(r["flops_per_sample"]) * float(r["samples_per_second"]) / 1e12
        assert math.isclose(float(r["tflops"]), tflops, rel_tol=1e-9)
        if peak:
            assert math.isclose(float(r["mfu"]), tflops / peak, rel_tol=1e-9)
        else:
            assert math.isnan(float(r["mfu"]))
