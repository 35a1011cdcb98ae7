"""Host syncs in a training step, counted on the CPU in the real loop (`train_one_epoch`): every call that, on a GPU,
makes the host wait for the device (a read of a tensor's value, a copy to the host, a tensor made on the device from
host data, an op whose output's shape depends on the values: a boolean-mask index, nonzero, masked_select, unique,
repeat_interleave by a tensor). docs/performance.md lists what each option costs per step; these tests pin those
numbers.
"""

import pytest
import tiny
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ddp_tricks import models
from ddp_tricks import plan as planning
from ddp_tricks.data import images as image_data
from ddp_tricks.distributed import trace_reduction
from ddp_tricks.schedules.curves import WarmupDecay
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.training.loop import train_one_epoch
from ddp_tricks.training.step_log import StepLog
from lamb import LAMB
from lars import LARS, LARSWrapper
from lookahead import Lookahead

T = torch.Tensor
READS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.cpu, T.numpy, T.__array__}
FROM_HOST = {torch.tensor, torch.as_tensor}  # with a device: a blocking copy from pageable host memory there
# an output whose shape depends on the values: the host waits for the device to learn how much memory to allocate
DATA_SHAPED = {torch.nonzero, T.nonzero, torch.argwhere, T.argwhere, torch.masked_select, T.masked_select,
               torch.unique, T.unique, torch.unique_consecutive, T.unique_consecutive, torch.bincount,
               T.bincount}  # fmt: skip
INDEXED = {T.__getitem__, T.__setitem__, torch.index_put, T.index_put, T.index_put_}  # by a boolean mask: nonzero
REPEATED = {torch.repeat_interleave, T.repeat_interleave}  # by a tensor of repeats, without output_size
STEPS = 4  # the first step (it creates the optimizer's state) is left out of the count


class HostSyncs(TorchFunctionMode):
    """The host syncs of each optimizer step (its `after_step` closes a step): reads of a tensor's value, copies to
    the host, and tensors made on a device from host data.

    A CPU cannot tell a copy between devices from one within a device, so only `.cpu()` counts as a copy to the host
    here (test_cuda.py's set_sync_debug_mode test sees every kind on a GPU). A torch function written in Python
    (F.cross_entropy) is seen as one call: the mode is off inside it."""

    def __init__(self):
        super().__init__()
        self.now: list[str] = []
        self.per_step: list[list[str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in READS
            or func in DATA_SHAPED
            or (func in FROM_HOST and "device" in kwargs and not isinstance(args[0], T))
            or (func in INDEXED and any(_boolean_mask(i) for i in _indices(args[1:2] or kwargs.values())))
            or (func in REPEATED and "output_size" not in kwargs and isinstance(_repeats(args, kwargs), T))
            or (func is torch.where and len(args) + len(kwargs) == 1)  # where(condition): nonzero
        ):
            self.now.append(func.__name__)
        return func(*args, **kwargs)

    def after_step(self, t) -> bool:
        self.per_step.append(self.now)
        self.now = []
        return False


def _indices(index) -> list:
    """The parts of an index (a tensor, or a tuple or list of them and of slices, ints, None, Ellipsis)."""
    return [part for i in index for part in (i if isinstance(i, (tuple, list)) else (i,))]


def _boolean_mask(part) -> bool:
    return isinstance(part, T) and part.dtype == torch.bool


def _repeats(args, kwargs):
    """repeat_interleave's repeats: its second argument, or its first in the one-argument form."""
    if "repeats" in kwargs:
        return kwargs["repeats"]
    return args[1] if len(args) > 1 else args[0]


def syncs_per_step(t, trace=None, accum_steps=1, nonfinite_at=None, micro_batch=32, log=None, count=STEPS,
                   **resumed) -> list[list[str]]:  # fmt: skip
    """Train `t` for `count` steps on the digits with the loop run.py runs; the host syncs of each step after the
    first. The micro-batches are fetched beforehand (data loading happens on the host: no device to wait for).
    `nonfinite_at`: the step whose inputs are NaN; `log`: a StepLog; `resumed`: a resume's world_size and run_batch
    (rank 0's steps)."""
    train_set, _ = image_data.digits()
    the_plan = planning.make(num_train=len(train_set), micro_batch=micro_batch, accum_steps=accum_steps, epochs=1,
                             seed=0, base_lr=0.05, lr_scaling="keep", base_batch=32, warmup_epochs=0, trace=trace,
                             trace_end="repeat-last", **({"world_size": 1} | resumed))  # fmt: skip
    steps = the_plan.epoch(1, 0)[:count]
    batches = list(tiny.loader_for(train_set, steps))
    if nonfinite_at is not None:
        first = sum(len(s.micro_batches) for s in steps[:nonfinite_at])
        batches[first] = (torch.full_like(batches[first][0], float("nan")), batches[first][1])
    counter = HostSyncs()
    with counter:
        train_one_epoch(t, steps, batches, log=log, after_step=counter.after_step)
    assert len(counter.per_step) == count
    return counter.per_step[1:]


def toy(optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), amp="off", reduction=None, **options):
    """The default model (`toy`) and an optimizer in a Training, with a warmup schedule (a skipped step must not
    advance it); `reduction(params)`: a traced run's gradient reduction of the model's parameters."""
    torch.manual_seed(0)
    model = models.build("toy", 1, 10)
    opt = optimizer(model.parameters())
    if reduction is not None:
        options["reduction"] = reduction([p for p in model.parameters() if p.requires_grad])
    return tiny.training(model, opt, Schedule(WarmupDecay(opt, warmup_steps=100, decay_steps=0)), amp=amp, **options)


def overflowing(t):
    """fp16 gradients overflow at every step: the scaler skips them all (and halves a scale that stays too big)."""
    t.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    return t


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_a_plain_step_makes_no_host_sync(amp):
    """Broken on purpose: a boolean-mask index in the loop's step (`row[row == row]` in train_one_epoch) is counted."""
    assert syncs_per_step(toy(amp=amp)) == [[]] * (STEPS - 1)


@pytest.mark.parametrize("amp", ["off", "bf16", "fp16"])
def test_a_whole_log_interval_window_makes_no_host_sync_but_at_its_rows(amp):
    """Two windows of --log-interval 5 with the run's step log (training/step_log.py), its non-finite check included:
    the rows of steps 1 and 5 are read once each, a step later (steps 2 and 6: their all-gather runs during that
    step), and the last one (step 10) at the epoch's end; the other steps read nothing (fp16: GradScaler's own read).
    Broken on purpose: the loop's `if due:` before the row as `if True:` fails it, and so does a non-finite check of
    its own."""
    scaler = ["item"] if amp == "fp16" else []
    log = StepLog(5, torch.device("cpu"))
    t = toy(amp=amp)
    steps = syncs_per_step(t, log=log, count=10)  # steps 2..10
    for step, syncs in enumerate(steps, start=2):
        if step in (2, 6):
            # the row's one read, which carries the non-finite check (without fp16's scaler) and the empty steps' count
            assert syncs.count("tolist") == 1 and "item" not in syncs[len(scaler) :], (step, syncs)
        elif step in (5, 10):  # a row starts: the host's numbers (times, counts) copied to the device, nothing read
            assert "tolist" not in syncs and "item" not in syncs[len(scaler) :], (step, syncs)
        else:
            assert syncs == scaler, (step, syncs)


def test_an_fp16_step_makes_only_the_grad_scaler_s_own_sync():
    t = toy(amp="fp16")
    assert syncs_per_step(t) == [["item"]] * (STEPS - 1)  # GradScaler.step reads found_inf once
    assert t.progress.skipped_steps == 0 and t.schedule.per_step.last_epoch == STEPS


def test_an_fp16_step_the_scaler_skips_is_counted_and_holds_the_schedule_with_one_sync():
    t = overflowing(toy(amp="fp16"))
    before = [p.detach().clone() for p in t.model.parameters() if p.is_floating_point()]
    assert syncs_per_step(t) == [["item"]] * (STEPS - 1)
    assert t.progress.skipped_steps == STEPS and t.progress.global_step == STEPS
    assert t.schedule.per_step.last_epoch == 0  # no step taken: the warmup did not advance
    assert t.precision.scaler.get_scale() == 2.0 ** (60 - STEPS)
    assert all(torch.equal(a, b) for a, b in zip(before, (p for p in t.model.parameters() if p.is_floating_point())))


OPTIMIZERS = {
    "LARS": lambda ps: LARS(ps, lr=0.1, weight_decay=1e-4),
    "LAMB": lambda ps: LAMB(ps, lr=1e-3),
    "LARSWrapper(SGD)": lambda ps: LARSWrapper(torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
    # (torch's Adam keeps its step count on the host: reading it is no sync on a GPU, but would count here)
    "Lookahead(LARSWrapper(SGD))": lambda ps: Lookahead(LARSWrapper(torch.optim.SGD(ps, lr=0.1, momentum=0.9)), k=2),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_every_optimizer_s_fp16_step_makes_one_sync_and_a_skip_is_seen(make):
    t = toy(make, amp="fp16")
    assert syncs_per_step(t) == [["item"]] * (STEPS - 1)
    assert t.progress.skipped_steps == 0 and t.schedule.per_step.last_epoch == STEPS
    t = overflowing(toy(make, amp="fp16"))
    assert syncs_per_step(t) == [["item"]] * (STEPS - 1)
    assert t.progress.skipped_steps == STEPS and t.schedule.per_step.last_epoch == 0


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_on_nonfinite_skip_makes_one_sync_per_step_and_skips_the_bad_one(amp):
    t = toy(amp=amp, on_nonfinite="skip")
    assert syncs_per_step(t, nonfinite_at=2) == [["item"]] * (STEPS - 1)
    assert t.progress.skipped_steps == 1 and t.progress.global_step == STEPS
    assert t.schedule.per_step.last_epoch == STEPS - 1  # the skipped step did not advance the schedule
    assert torch.isfinite(t.meter.sums).all()  # the bad batch was kept out of the epoch's sums


def test_clipping_and_accumulation_make_no_host_sync():
    assert syncs_per_step(toy(clip_grad_norm=1.0), accum_steps=2, micro_batch=16) == [[]] * (STEPS - 1)


def test_clipping_an_fp16_step_adds_no_sync_to_the_scaler_s():
    assert syncs_per_step(toy(amp="fp16", clip_grad_norm=1.0)) == [["item"]] * (STEPS - 1)


class Units(tiny.Classify):
    """A task that counts its own units (a tensor, as a token count would be)."""

    def units(self, inputs, targets):
        return (targets >= 0).sum()


def test_a_task_s_units_make_no_host_sync():
    t = toy()
    t.task = Units()
    assert syncs_per_step(t, accum_steps=2, micro_batch=16) == [[]] * (STEPS - 1)


def traced(adascale=None):
    return toy(reduction=lambda params: trace_reduction.TraceReduction(params, 16, adascale))


def test_an_uneven_share_s_step_makes_no_host_sync():
    """Broken on purpose: an `.item()` in TraceReduction.finish for uneven shares is counted, once a step."""
    # 64 as 4 micro-batches of 16 on 3 processes: rank 0 runs 2 a step, its gradients summed by hand (TraceReduction;
    # no process group here: its all-reduce is left out, which syncs nothing on the host either)
    t = toy(reduction=lambda params: trace_reduction.TraceReduction(params, 16, slots=4))
    steps = syncs_per_step(t, micro_batch=16, world_size=3, run_batch=(64, 16))
    assert steps == [[]] * (STEPS - 1)
    assert t.progress.global_step == STEPS and t.meter.samples == STEPS * 2 * 16  # rank 0's 2 micro-batches a step


def test_a_traced_step_makes_no_host_sync_and_adascale_its_documented_one():
    trace = [32, 16, 48, 32]  # 2, 1, 3 and 2 micro-batches of 16
    assert syncs_per_step(traced(), trace=trace, micro_batch=16) == [[]] * (STEPS - 1)
    assert syncs_per_step(traced(trace_reduction.AdaScale()), trace=trace, micro_batch=16) == [["tolist"]] * (STEPS - 1)


def test_an_idle_rank_s_adascale_step_makes_only_its_one_sync():
    """A traced step can leave a rank without a micro-batch: its sum of squared norms is then a host 0."""
    model = nn.Linear(4, 2)
    reduction = trace_reduction.TraceReduction(list(model.parameters()), 8, trace_reduction.AdaScale())
    counter = HostSyncs()
    with counter:
        assert reduction.finish(16) == 1.0
    counter.after_step(None)
    assert counter.per_step == [["tolist"]]


def test_the_counter_sees_each_op_whose_output_shape_depends_on_values():
    counter = HostSyncs()
    x, mask = torch.arange(4.0), torch.tensor([True, False, True, False])
    with counter:
        x[mask], x[1:][mask[1:]], x[:, None][mask, 0], x.nonzero(), torch.nonzero(x), torch.argwhere(x)
        x.masked_select(mask), torch.masked_select(x, mask), x.unique(), torch.unique(x)
        torch.unique_consecutive(x), x.long().bincount(), torch.where(mask)
        torch.repeat_interleave(x, torch.tensor([1, 2, 1, 2])), x.repeat_interleave(torch.tensor([1, 2, 1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]))
        y = x.clone()
        y[mask] = 0.0
        # none of these: shapes known ahead
        x[1:], x[torch.tensor([0, 2])], x.masked_fill(mask, 0.0), torch.where(mask, x, 0.0), x.repeat_interleave(2)
        torch.repeat_interleave(x, torch.tensor([1, 2, 1, 2]), output_size=6)
    counter.after_step(None)
    assert counter.per_step == [["__getitem__"] * 3 + ["nonzero"] * 2 + ["argwhere"] + ["masked_select"] * 2
                                + ["unique"] * 2 + ["unique_consecutive", "bincount", "where"]
                                + ["repeat_interleave"] * 3 + ["__setitem__"]]  # fmt: skip


class MaskedLoss(tiny.Classify):
    """A loss over the samples a boolean mask keeps (a data-dependent shape: on a GPU, one wait per step)."""

    def loss(self, outputs, targets):
        keep = targets >= 0
        return super().loss(outputs[keep], targets[keep])


def test_a_boolean_mask_in_a_task_s_loss_is_counted_once_per_micro_batch():
    t = toy()
    t.task = MaskedLoss()
    assert syncs_per_step(t, accum_steps=2, micro_batch=16) == [["__getitem__", "__getitem__"] * 2] * (STEPS - 1)


def test_the_counter_sees_each_kind_of_host_sync():
    """The counter itself: every read it claims to count, and a device tensor made from host data."""
    counter = HostSyncs()
    x = torch.ones(2)
    with counter:
        x[0].item(), x.tolist(), bool(x[0]), float(x[0]), int(x[0]), x.cpu(), x.numpy()
        torch.tensor([1.0], device="cpu"), torch.as_tensor(2.0, device="cpu")
        torch.tensor([1.0]), torch.full((), 1.0, device="cpu"), x.sum(), nn.functional.relu(x)  # none of these
    counter.after_step(None)
    assert counter.per_step == [["item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy", "tensor",
                                 "as_tensor"]]  # fmt: skip
