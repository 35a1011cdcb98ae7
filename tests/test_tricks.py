"""Mixed precision, gradient accumulation, early stopping across ranks, and the original command lines."""

import csv
import json

import pytest
import tiny
import torch
from multiproc import launch, legacy_launch
from torch import nn

from ddp_tricks import plan
from ddp_tricks.data import images as image_data
from ddp_tricks.schedules.curves import WarmupDecay
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.training.loop import optimizer_step, train_one_epoch


def _rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_fp16_overflow_skips_the_step_and_the_schedule():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    t = tiny.training(model, opt, Schedule(WarmupDecay(opt, warmup_steps=10, decay_steps=0)), amp="fp16")
    t.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    params = list(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    t.precision.backward(model(torch.full((3, 4), float("inf"))).sum(), opt)  # inf gradients
    optimizer_step(t, params)
    assert t.progress.skipped_steps == 1 and t.progress.global_step == 1
    assert t.schedule.per_step.last_epoch == 0  # the schedule did not advance
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert t.precision.scaler.get_scale() == 2.0**7
    t.precision.backward(model(torch.ones(3, 4)).sum(), opt)
    optimizer_step(t, params)
    assert t.progress.skipped_steps == 1 and t.schedule.per_step.last_epoch == 1
    assert not torch.equal(before[0], model.weight)


def _accumulate(rank, world_size, accum_steps, batch_size):
    """One epoch of a model without batch statistics; returns the final weights."""
    train_set, _ = image_data.digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    ddp = nn.parallel.DistributedDataParallel(model) if world_size > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    the_plan = plan.make(num_train=len(train_set), world_size=world_size, micro_batch=batch_size,
                         accum_steps=accum_steps, epochs=1, seed=0, base_lr=0.1, lr_scaling="keep", base_batch=32,
                         warmup_epochs=0)  # fmt: skip
    steps = the_plan.epoch(1, rank)
    t = tiny.training(ddp, opt)
    train_one_epoch(t, steps, tiny.loader_for(train_set, steps, rank))
    return [p.detach().clone() for p in model.parameters()], t.progress.global_step


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_accumulating_4_batches_of_b_equals_one_batch_of_4b(world_size):
    from multiproc import run_ranks

    accumulated = run_ranks(_accumulate, world_size, 4, 8)
    single = run_ranks(_accumulate, world_size, 1, 32)
    # the same samples in every step (plan.py); the last is short (29 samples) and weighted by its size
    assert accumulated[0][1] == single[0][1] == -(-1437 // world_size // 32)
    for (weights_a, _), (weights_b, _) in zip(accumulated, single):
        for a, b in zip(weights_a, weights_b):
            assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_early_stop_ends_every_rank_after_the_same_epoch(tmp_path):
    # Ranks evaluate different shards (different local losses); the decision uses the reduced loss.
    result = launch(
        [
            "--epochs",
            "8",
            "--early-stop-patience",
            "2",
            "--early-stop-delta",
            "100",
            "-n",
            "es",
            "--runs-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["epoch"] for r in _rows(tmp_path / "es")] == ["1", "2", "3"]
    assert "epoch 3:" in result.stdout and "(early stop)" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_mixed_precision_trains_on_cpu_end_to_end(amp, tmp_path):
    result = launch(
        ["--epochs", "2", "--amp", amp, "-n", amp, "--runs-dir", str(tmp_path), "--no-progress"], nproc=None
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _rows(tmp_path / amp)
    assert float(rows[-1]["val_acc"]) > 0.9
    skipped = [int(r["skipped_steps"]) for r in rows]  # counted per epoch (the overflow path: test above)
    if amp == "bf16":
        assert skipped == [0, 0]  # no scaler, nothing to skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_lr_scaling_is_printed_and_stored(tmp_path):
    result = launch(
        [
            "--epochs",
            "1",
            "--lr-scaling",
            "linear",
            "--base-lr",
            "0.1",
            "--base-batch-size",
            "32",
            "--accum-steps",
            "2",
            "-n",
            "scaled",
            "--runs-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((tmp_path / "scaled" / "config.json").read_text())
    assert config["global_batch_size"] == 32 * 2 * 2 and config["effective_lr"] == pytest.approx(0.4)
    assert "global batch 128 (32 x 2 process(es) x accumulation 2), learning rate 0.4" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_original_template_command_line_runs_unchanged(tmp_path):
    """`python -m torch.distributed.launch --nproc_per_node=2 run.py -n=DDP_warmup --epochs 2`, from another
    folder: the legacy launcher passes --local-rank, and the run has both ranks."""
    result = legacy_launch(
        [
            "-n=DDP_warmup",
            "--epochs",
            "2",
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(_rows(tmp_path / "runs" / "DDP_warmup")) == 2
    assert json.loads((tmp_path / "runs" / "DDP_warmup" / "config.json").read_text())["world_size"] == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_original_lars_command_line_runs_unchanged(tmp_path):
    args = [
        "--batch-size",
        "128",
        "--warmup-epochs",
        "0.3125",
        "--base-lr",
        "5.6568542494924",
        "--base-op",
        "lars",
        "--bn-bias-separately",
        "--wd",
        "0.0001",
        "--lr-scaling",
        "keep",
        "--epochs",
        "2",
    ]
    # run.py's part of that command line, from another folder (torchrun itself runs run.py in test_end_to_end.py)
    result = launch(args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["optimizer"] == "lars" and config["bn_bias_separately"] and config["lr_power"] == 2.0
    assert len(_rows(run_dir)) == 2


def test_which_models_ddp_broadcasts_buffers_for_at_every_forward():
    from ddp_tricks.distributed.wrap import only_norm_statistics

    norms = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.InstanceNorm2d(4, track_running_stats=True))
    assert only_norm_statistics(norms)
    assert only_norm_statistics(nn.Linear(3, 3))  # no buffer: nothing to broadcast
    queue = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    queue.register_buffer("queue", torch.zeros(8, 3))
    assert not only_norm_statistics(queue)


class LastBatchMean(nn.Module):
    """A model whose forward reads a buffer it updates (as a queue or a memory bank does): its output is a linear
    map plus the sum of the previous batch's mean, which it then stores."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 1)
        self.register_buffer("memory", torch.zeros(3))

    def forward(self, x):
        y = self.linear(x) + self.memory.sum()
        self.memory.copy_(x.detach().mean(0))
        return y


def _rank_batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * rank + step))


def _ddp_buffer_broadcast(rank, world_size):
    """wrap() on 2 ranks: what DDP was built with for a model of norm statistics only and for one with another buffer,
    and the second step's outputs of the model whose forward reads its buffer."""
    from ddp_tricks.distributed.launch import Dist
    from ddp_tricks.distributed.wrap import wrap

    here = Dist(rank, world_size, rank, torch.device("cpu"), "gloo")
    torch.manual_seed(rank)  # DDP gives every rank rank 0's parameters and buffers when it is built
    norms = wrap(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), here)
    memory = wrap(LastBatchMean(), here)
    outputs = []
    for step in range(2):
        y = memory(_rank_batch(rank, step))
        y.sum().backward()  # no optimizer step: the weights stay rank 0's initial ones
        outputs.append(y.detach())
    weights = {k: v.detach().clone() for k, v in memory.module.linear.state_dict().items()}
    return norms.broadcast_buffers, memory.broadcast_buffers, outputs[1], weights


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_broadcasts_rank_0_s_buffers_at_every_forward_only_where_a_forward_reads_them():
    """2 ranks, the models as wrap() builds DDP for them: a model whose buffers are all norm statistics without the
    per-forward broadcast (DDP's own attribute read back), a model with another buffer with it; and that buffer, which
    the forward updates from each rank's own batch, is rank 0's at the next forward on every rank: the second step's
    output on rank r is W x_r + b + sum(mean of rank 0's first batch), written here from the formula. Broken on purpose:
    `buffer_sync(only_norm_statistics(model))` in wrap() (the rule inverted) fails both the flags and rank 1's output,
    which then adds its own first batch's mean."""
    from multiproc import run_ranks

    ranks = run_ranks(_ddp_buffer_broadcast, 2)
    assert [(norms, memory) for norms, memory, _, _ in ranks] == [(False, True), (False, True)]
    rank0_first_mean = _rank_batch(0, 0).mean(0)
    for rank, (_, _, output, weights) in enumerate(ranks):
        x = _rank_batch(rank, 1)
        expected = x @ weights["weight"].T + weights["bias"] + rank0_first_mean.sum()
        torch.testing.assert_close(output, expected, rtol=0, atol=1e-6)
    assert all(torch.equal(ranks[0][3][k], ranks[1][3][k]) for k in ranks[0][3])  # rank 0's weights on both


@pytest.mark.timeout(300)
def test_without_the_per_step_buffer_broadcast_training_evaluation_and_checkpoints_are_unchanged(tmp_path):
    """2 ranks, the built-in BatchNorm model: DDP without its per-forward broadcast of rank 0's buffers (the
    template's choice when every buffer is a norm layer's statistic) against DDP with it (the same model with one
    more, constant buffer, which keeps DDP's default): the weights, BatchNorm statistics, training loss and validation
    metrics of every epoch are equal bit for bit. Broken on purpose (evaluation without rank 0's buffers first), the
    validation metrics differ."""
    from ddp_tricks.storage import checkpoint

    flags = ["-b", "16", "-e", "2", "--no-progress", "-s", "0", "--no-noise-scale"]
    plain = launch([*flags, "-n", "plain", "--runs-dir", str(tmp_path)])
    kept = launch([*flags, "--task", "tests/rank_tasks.py:ConstantBuffer", "-n", "kept", "--runs-dir", str(tmp_path)])
    assert plain.returncode == 0 and kept.returncode == 0, plain.stderr[-2000:] + kept.stderr[-2000:]
    got, expected = (checkpoint.load(tmp_path / name / "last.pt", "ddp")["model"] for name in ("plain", "kept"))
    assert set(expected) - set(got) == {"constant"}
    for key, value in got.items():
        assert torch.equal(value, expected[key]), key
    columns = ("train_loss", "val_loss", "val_acc")

    def metrics(name):
        with open(tmp_path / name / "metrics.csv") as f:
            return [[row[c] for c in columns] for row in csv.DictReader(f)]

    assert len(metrics("plain")) == 2 and metrics("plain") == metrics("kept")
