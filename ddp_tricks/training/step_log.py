"""Per-step rows: every `--log-interval` optimizer steps (and at the first step and each epoch's and the run's last)
one row of the window since the last: loss and the task's metrics, LR per group, gradient norm, loss scale,
throughput, data wait, FLOPs and MFU, the noise scale, peak memory and the slowest rank. The loop asks `due(step)`
and calls `write(t)` only then: its values stay on the device between rows and are read in one all-gather per row.
steps.csv, TensorBoard, W&B and the tqdm bar are the sinks (step_sinks.py); rank 0 alone writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ddp_tricks.distributed.collectives import gather_from_ranks_later
from ddp_tricks.training.flops import peak_tflops as peak_of
from ddp_tricks.training.meter import Packed
from ddp_tricks.training.metric_states import report

log = logging.getLogger("ddp_tricks")

TIMES = ("step_seconds", "data_wait")  # the per-rank times each row shows as min, median and max


def columns(metric_names: list[str], group_names: list[str]) -> list[str]:
    """steps.csv's columns: where the run is, the window's training metrics, the LR of each parameter group (beside
    the schedule's `lr` where there are several), then the step's numbers and the ranks' spread."""
    lrs = [f"lr_{name or i}" for i, name in enumerate(group_names)] if len(group_names) > 1 else []
    spread = [f"{name}_{stat}" for name in TIMES for stat in ("min", "median", "max")]
    return ["step", "epoch", "samples", "units", *(f"train_{n}" for n in metric_names), "lr", *lrs, "grad_norm",
            "loss_scale", "skipped_steps", "samples_per_second", "units_per_second", "step_seconds",
            "data_wait_seconds", "data_wait_share", "flops_per_sample", "tflops", "mfu", "noise_scale",
            "peak_memory_gib", *spread, "slowest_rank"]  # fmt: skip


class StepLog:
    """The run's per-step rows: its window (started by `begin`, on every rank), its counters (samples and units seen
    before the epoch: a checkpoint's `step_log` part) and its sinks (rank 0's; none elsewhere)."""

    def __init__(
        self,
        interval: int,
        device: torch.device,
        sinks: tuple = (),
        bar=None,
        flops_per_sample: float = 0.0,
        peak_tflops: float = 0.0,
        world_size: int = 1,
        group_names: tuple[str, ...] = (),
    ):
        self.interval = interval  # 0: no rows
        self.device = device
        self.sinks = list(sinks)
        self.bar = bar  # a factory: (total, initial, description) -> a tqdm bar; None: no bar
        self.flops_per_sample = flops_per_sample
        self.peak_tflops = peak_tflops  # 0: no MFU
        self.world_size = world_size
        self.group_names = list(group_names)
        self.metric_names = ["loss"]  # the task's reported metrics, after the loss
        self.peak_note = ""  # where the peak for the MFU comes from, or why there is none
        self.is_main = True  # rank 0: the sinks are its
        self.wandb_run_id: str | None = None  # the W&B run a resumed run continues
        self.end_step = 0  # the epoch's last global step
        self.seen = {"epoch": 0, "samples": 0.0, "units": 0.0, "epoch_samples": 0.0, "epoch_units": 0.0}
        self._progress = None
        self._wait = 0.0
        self._grad_norm = None
        self._pending = None  # a row written and not yet settled: (t, its Packed, its all-gather, where it was)

    @classmethod
    def of(cls, t, flops=None, interval: int = 20, amp: str = "off", peak_tflops: float = 0.0) -> StepLog:
        """The step log of the run `t` trains: its device, world size, parameter groups and task's metrics; `flops`
        (training/flops.py's, or None) gives the FLOPs per sample; the device's peak for the MFU is `peak_tflops`
        (--peak-tflops) or the table's for the device and `amp`'s dtype."""
        groups = tuple(group.get("name", "") for group in t.optimizer.param_groups)
        peak, note = peak_of(t.device, amp, peak_tflops)
        made = cls(interval, t.device, flops_per_sample=flops.per_sample if flops is not None else 0.0,
                  peak_tflops=peak, world_size=t.world_size, group_names=groups)  # fmt: skip
        made.metric_names, made.peak_note, made.is_main = ["loss", *getattr(t.task, "better", {})], note, t.rank == 0
        return made

    def open(self, folder: Path, through_step: int, bar: bool = True, **outside) -> None:
        """Rank 0's sinks: steps.csv (rows after `through_step`, a resumed checkpoint's step, dropped), with
        `tensorboard` True runs/<name>/tb/steps, with `wandb` a project name W&B (`config`: the run's), and the bar."""
        from ddp_tricks.storage import step_sinks

        if not self.is_main:
            return
        self.bar = step_sinks.progress_bar if bar else None
        if self.interval <= 0:
            return
        shown = f"{self.peak_note}" if self.flops_per_sample else "FLOPs not counted: no MFU"
        log.info("a row every %d steps in %s; %s", self.interval, folder / "steps.csv", shown)
        self.sinks = [
            step_sinks.CsvRows(folder / "steps.csv", columns(self.metric_names, self.group_names), through_step)
        ]
        if outside.get("tensorboard"):
            self.sinks.append(step_sinks.TensorBoardRows(folder / "tb" / "steps", through_step))
        if outside.get("wandb"):
            config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
            sink = step_sinks.WandbRows(outside["wandb"], folder.name, folder, config, self.wandb_run_id)
            self.wandb_run_id = sink.run_id
            self.sinks.append(sink)

    def due(self, step: int) -> bool:
        """Whether global step `step` writes a row: every `interval` steps, the first, each epoch's last (the run's
        last too: --max-steps ends its last epoch there)."""
        if self.interval <= 0:
            return False
        return step % self.interval == 0 or step == 1 or step == self.end_step

    @contextlib.contextmanager
    def epoch(self, epoch: int, total: int, first_step: int, global_step: int, description: str = ""):
        """Around an epoch of `total` steps, resumed at `first_step` (at `global_step`): the bar's lifetime, and the
        counters moving on past the epoch before it."""
        if epoch > self.seen["epoch"]:
            self.seen["samples"] += self.seen["epoch_samples"]
            self.seen["units"] += self.seen["epoch_units"]
            self.seen.update(epoch=epoch, epoch_samples=0.0, epoch_units=0.0)
        self.end_step = global_step - first_step + total  # the epoch's last step: a row
        self._progress = self.bar(total, first_step, description) if self.bar is not None else None
        try:
            yield self
        finally:  # an error's line then starts a line of its own
            if self._progress is not None:
                self._progress.update(total - self._progress.n)
                self._progress.close()
            self._progress = None

    def begin(self, t, batches: Iterator) -> Iterator:
        """The window starts (the loop's epoch, its running sums set); returns `batches`, each next() timed."""
        self._start_window(t)
        return self._timed(batches)

    def _timed(self, batches: Iterator) -> Iterator:
        while True:
            start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                return
            self._wait += time.perf_counter() - start
            yield batch

    def _start_window(self, t) -> None:
        self._sums, self._units = t.meter.sums.clone(), _units(t)
        self._samples, self._step, self._wait = t.meter.samples, t.progress.global_step, 0.0
        self._skipped = t.progress.skipped_steps
        self._time = time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (a mid-epoch evaluation's) out of the window's time."""
        self._time += seconds

    def measure(self, t, params: list[torch.Tensor]) -> None:
        """Before the optimizer step of a row (it zeroes the gradients): their norm, unless clipping measures it.
        An fp16 step's gradients are scaled: divided by the scale here, on the device."""
        self._grad_norm = None
        if t.clip_grad_norm > 0:
            return
        grads = [p.grad.coalesce().values() if p.grad.is_sparse else p.grad for p in params if p.grad is not None]
        if not grads:
            return
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # sharded gradients: every rank's part
        self._grad_norm = norm.double() / t.precision.loss_scale()

    def write(self, t) -> None:
        """The row of the window ending now, started: its values packed on the device (with the checks of the loss and
        of the steps without units) and their one all-gather launched, without waiting (every rank calls). The row is
        read, checked and written by `settle()`: at the next step's end, so the collective runs during that step
        (on a 2-core CPU a gloo all-gather takes about 0.8 ms), before a checkpoint (the part's state_dict), and at
        the epoch's end."""
        self.settle()
        seconds, wait = time.perf_counter() - self._time, self._wait
        meter, units_now = t.meter, _units(t)
        norm = getattr(t.precision, "grad_norm", None) if t.clip_grad_norm > 0 else self._grad_norm
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a sharded model's clipped norm
        scale = t.precision.loss_scale()
        bad = t.nonfinite_flag()
        packed = Packed(
            self.device,
            sums=meter.sums - self._sums,
            units=units_now - self._units,
            epoch_units=units_now,
            noise=t.noise.corrected() if t.noise is not None else [],
            grad_norm=math.nan if norm is None else norm,
            loss_scale=scale if isinstance(scale, torch.Tensor) else 1.0,
            samples=float(meter.samples - self._samples),
            epoch_samples=float(meter.samples),
            seconds=seconds,
            wait=wait,
            nonfinite=[] if bad is None else bad,
            empty_steps=meter.empty_steps,
        )
        p = t.progress
        lrs = p.lrs or tuple(g["lr"] for g in t.optimizer.param_groups)  # the last step's: a trace's factor in it
        at = {"step": p.global_step, "epoch": p.epoch, "step_in_epoch": p.step_in_epoch, "lr": t.lr, "lrs": lrs,
              "steps": max(p.global_step - self._step, 1), "skipped": p.skipped_steps - self._skipped,
              "checks": bad is not None, "peak_memory_gib": peak_memory_gib(self.device)}  # fmt: skip
        self._pending = (t, packed, gather_from_ranks_later(packed.vector), at)
        self._start_window(t)

    def settle(self) -> dict | None:
        """The row started by `write`, if any: read (the all-gather's result, the row's one host read), checked (a
        non-finite loss, a step without units: raised on every rank together) and written by rank 0's sinks."""
        if self._pending is None:
            return None
        t, packed, gathered, at = self._pending
        self._pending = None
        ranks = [packed.named(r) for r in gathered().tolist()]  # the row's one host read
        if at["checks"]:
            t.raise_if_nonfinite(flags=[r["nonfinite"][0] for r in ranks], step=at["step"])
        t.meter.check_units(at["epoch"], empty=ranks[0]["empty_steps"][0])
        row = self._row(t, ranks, at)
        for sink in self.sinks:
            sink.write(row)
        self._show(at, row)
        return row

    def _row(self, t, ranks: list[dict[str, list[float]]], at: dict) -> dict:
        total = {name: [sum(column) for column in zip(*(r[name] for r in ranks))] for name in ranks[0]}
        first = ranks[0]
        (units,), (units_epoch,) = total["units"], total["epoch_units"]
        (samples,), (samples_epoch,) = total["samples"], total["epoch_samples"]
        noise = total["noise"]
        steps = at["steps"]
        seconds = first["seconds"][0]
        per_rank = {"step_seconds": [r["seconds"][0] / steps for r in ranks]}
        per_rank["data_wait"] = [r["wait"][0] for r in ranks]
        self.seen.update(epoch=at["epoch"], epoch_samples=samples_epoch, epoch_units=units_epoch)
        tflops = self.flops_per_sample * samples / max(seconds, 1e-12) / self.world_size / 1e12
        row = {"step": at["step"], "epoch": at["epoch"]}
        row |= {"samples": round(self.seen["samples"] + samples_epoch), "units": self.seen["units"] + units_epoch}
        row |= report(t.task, t.sums_layout, "train", total["sums"], units)
        lrs = enumerate(zip(self.group_names, at["lrs"]))
        row |= {"lr": at["lr"]} | {f"lr_{name or i}": lr for i, (name, lr) in lrs}
        row |= {
            "grad_norm": first["grad_norm"][0],
            "loss_scale": first["loss_scale"][0],
            "skipped_steps": at["skipped"],
            "samples_per_second": samples / max(seconds, 1e-12),
            "units_per_second": units / max(seconds, 1e-12),
            "step_seconds": seconds / steps,
            "data_wait_seconds": first["wait"][0],
            "data_wait_share": first["wait"][0] / max(seconds, 1e-12),
            "flops_per_sample": self.flops_per_sample or math.nan,
            "tflops": tflops if self.flops_per_sample else math.nan,
            "mfu": tflops / self.peak_tflops if self.peak_tflops and self.flops_per_sample else math.nan,
            "noise_scale": noise[0] / noise[1] if noise and noise[1] > 0 else math.nan,
            "peak_memory_gib": at["peak_memory_gib"],
        }
        for name, values in per_rank.items():
            row |= {f"{name}_min": min(values), f"{name}_median": statistics.median(values), f"{name}_max": max(values)}
        times = list(zip(per_rank["step_seconds"], per_rank["data_wait"]))
        row["slowest_rank"] = max(range(len(ranks)), key=times.__getitem__)
        return row

    def _show(self, at: dict, row: dict) -> None:
        if self._progress is None:
            return
        shown = {"loss": f"{row['train_loss']:.4f}", "lr": f"{row['lr']:.4g}",
                 "samples_per_s": f"{row['samples_per_second']:.0f}"}  # fmt: skip
        if not math.isnan(row["noise_scale"]):
            shown["noise_scale"] = f"{row['noise_scale']:.0f}"
        self._progress.set_postfix(**shown)
        self._progress.update(at["step_in_epoch"] - self._progress.n)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def state_dict(self) -> dict:
        """The counters a resumed run continues: samples and units seen before the epoch, and in it so far (a row
        still under way settled first: steps.csv holds every row up to the checkpoint's step)."""
        self.settle()
        return dict(self.seen) | {"wandb_run_id": self.wandb_run_id}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            state = dict(state)
            self.wandb_run_id = state.pop("wandb_run_id", None)
            self.seen = state


def peak_memory_gib(device: torch.device) -> float:
    """The most memory the run's tensors have held on a CUDA device, in GiB (the allocator's count: no sync)."""
    if device.type != "cuda":
        return math.nan
    return torch.cuda.max_memory_allocated(device) / 2**30


def _units(t) -> torch.Tensor | float:
    """The epoch's units so far on this rank: a host number while the meter counts them as one (samples, or before
    an epoch's first micro-batch of a task with units()), else a copy of its device tensor (added into in place)."""
    units = t.meter.units
    return units.to(torch.float64).reshape(1).clone() if isinstance(units, torch.Tensor) else float(units)
