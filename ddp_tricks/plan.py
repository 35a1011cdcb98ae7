"""Numbers derived once from the flags, the world and the data: the global batch, the learning rate, steps per
epoch and warmup steps, and each epoch's per-step plan (this rank's samples in every micro-batch, what their
loss is divided by, the step's global batch and LR factor), for plain, accumulated and traced runs alike.

The plan does not depend on the world size beyond how the ranks split each step: step s of an epoch takes the
samples at positions s*G .. (s+1)*G - 1 of the epoch's permutation (DistributedSampler's shuffle; G the global
batch), cut into micro-batches ("slots", G / micro-batch of them: slot k takes every (G / micro-batch)-th sample
from position k, as the k-th of that many DistributedSamplers would, unpadded), and rank r runs slots r, r + world,
r + 2 world, ... So a run resumed at another world size (`layout`) takes the same samples in the same steps,
grouped into the same micro-batches (BatchNorm sees what it saw); with another micro-batch (accumulation instead of
a larger batch), the same samples in the same steps. Where the world size does not divide the slots (64 in 4
slots of 16, resumed on 3 processes), ranks run different numbers of them (2, 1, 1; on 7: 1, 1, 1, 1, 0, 0, 0):
the plan's shares are uneven, the ranks' gradients are summed by hand (`manual_reduction`, as in a traced run), each
micro-batch's loss weighted by its samples over the step's, and an idle rank adds zeros. The epoch's last step may
be short (its micro-batches a sample apart in length); one that would leave a slot empty (fewer samples than slots)
is left out: those samples skip this epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.utils.data import DistributedSampler

from ddp_tricks.errors import UserError
from ddp_tricks.traces import batch_trace
from ddp_tricks.traces.batch_trace import lr_factor


@dataclass(frozen=True)
class Step:
    """One optimizer step as this rank sees it."""

    micro_batches: list[list[int]]  # this rank's sample indices, one list per micro-batch (none on an idle rank)
    divisor: float  # a micro-batch's mean loss is weighted by its samples / this: the step's samples / world size
    # under DDP (which averages the ranks' gradients), or the step's samples where the ranks' gradients are summed
    batch: int  # the step's global batch: samples over all ranks
    lr_factor: float = 1.0  # the step's LR is the schedule's x this (a trace's linear/root rule)
    progress: float = 1.0  # how far the step advances the schedule: a traced step, its samples / the reference batch
    uneven: bool = False  # the ranks' micro-batches differ in length (an epoch's short last step): a gather of rows
    # from every rank exchanges the row counts in this step (collectives.uneven_rows), in no other
    slots: tuple[int, ...] = ()  # each micro-batch's place among the step's over all ranks: the same samples at any
    # world size, which seed its batch transform (data.mixing)


@dataclass(frozen=True)
class Plan:
    """What a run does, step by step; frozen, computed once, before any process group exists."""

    num_train: int
    world_size: int
    micro_batch: int  # --batch-size: samples per forward pass on one rank
    accum_steps: int
    seed: int
    lr: float  # the schedule's base LR: --base-lr after --lr-scaling
    global_batch: int  # samples per step (a traced run: the reference batch its LR is given for)
    steps_per_epoch: int  # a traced run: in steps of the reference batch (AdaScale: the average), as the schedule
    total_steps: int  # the schedule's length (a traced run: in steps of the reference batch; AdaScale: in steps)
    warmup_steps: int
    trace: tuple[int, ...] | None = None
    batch_lr_rule: str = "none"
    repeat_last: bool = False
    lr_power: float = 1.0  # poly decay's power: --lr-power, else 2 with LARS and 1 otherwise
    step_size: int = 1  # step decay: optimizer steps between decays (--step-epochs in steps)
    drop_last: bool = False  # training leaves out the samples that do not fill a whole micro-batch of every slot
    relayout: str = ""  # how a resumed run keeps its global batch at this world size, when the layout changed
    run_micro_batch: int = 0  # the micro-batch the run started with, which a resume comes back to where it fits
    max_global_batch: int = 0  # --batch-trace auto: the largest global batch it grows to (0: not auto)
    run_steps: int = 0  # the optimizer steps of the whole run (a traced run: the trace's rows it uses; auto: so far)
    epochs: int = 1  # the epochs the run trains: --epochs, or those --max-steps needs (its last cut short)
    max_steps: int = 0  # --max-steps: the run ends after this many optimizer steps (0: after its epochs)
    aug_repeats: int = 0  # --aug-repeats: each sample R times a step, on other slots (0, 1: off)

    @property
    def auto(self) -> bool:
        """--batch-trace auto: the trace is the run's own, grown at each epoch's start (`grown`)."""
        return self.max_global_batch > 0

    def rows(self, steps: int) -> list[int]:
        """The global batch of each of the run's first `steps` steps (the trace, its last row repeated)."""
        return [batch_trace.batch_at(list(self.trace), step, True) for step in range(steps)]

    def grown(self, noise_scale: float, first_step: int) -> Plan:
        """--batch-trace auto at an epoch's start (run step `first_step`): the plan whose trace goes on with the
        batch the measured `noise_scale` asks for (batch_trace.next_batch) from this step."""
        batch = batch_trace.batch_at(list(self.trace), max(first_step - 1, 0), True)  # the last step's
        unit = self.micro_batch * self.world_size
        new = batch_trace.next_batch(noise_scale, batch, unit, self.max_global_batch)
        return replace(self, trace=tuple(self.rows(first_step)) + (new,))

    @property
    def slots(self) -> int:
        """The micro-batches of one step over all ranks (an untraced run): each one the same samples at any world
        size."""
        return self.global_batch // self.micro_batch

    @property
    def traced(self) -> bool:
        return self.trace is not None

    @property
    def uneven_shares(self) -> bool:
        """An untraced run whose world size does not divide a step's micro-batches (a resume on another number of
        processes): ranks run different numbers of them, some maybe none (`shares`)."""
        return not self.traced and self.slots % self.world_size != 0

    @property
    def manual_reduction(self) -> bool:
        """The ranks' gradients are summed by hand at the end of a step (trace_reduction.py), not by DDP: a traced
        run, or uneven shares, where ranks run different numbers of backwards (DDP's reducer would wait for a rank
        that runs none)."""
        return self.traced or self.uneven_shares

    def shares(self) -> list[int]:
        """The micro-batches each rank runs in a step (an untraced run): rank r runs slots r, r + world, ..."""
        return shares(self.slots, self.world_size)

    def describe_shares(self) -> str:
        """`64 as 4 micro-batches of 16 on 3 processes: 2,1,1`, for the start line and the resume line."""
        return (
            f"{self.global_batch} as {self.slots} micro-batches of {self.micro_batch} on {self.world_size} "
            f"processes: {','.join(map(str, self.shares()))}"
        )

    def lr_factor_at(self, step: int) -> float:
        """The LR factor of run step `step` (0-based) that the plan knows ahead: a trace's linear/root rule."""
        if not self.traced:
            return 1.0
        return lr_factor(self.batch_lr_rule, batch_trace.batch_at(list(self.trace), step, True), self.global_batch)

    def progress_at(self, step: int) -> float:
        """How far run step `step` advances the schedule, as far as the plan knows ahead (AdaScale's gain it does
        not): a traced step, its batch over the reference batch."""
        if not self.traced or self.batch_lr_rule == "adascale":
            return 1.0
        return batch_trace.batch_at(list(self.trace), step, True) / self.global_batch

    @property
    def smallest_micro_batch(self) -> int:
        """The fewest samples a rank's micro-batch holds in any step (an epoch's last, without --drop-last)."""
        last = self.num_train % self.global_batch  # the samples of an epoch's last, short step
        if self.traced or self.drop_last or last < self.slots:  # none, or left out
            return self.micro_batch  # a trace's batches are whole multiples of the micro-batch
        return last // self.slots

    def why_small(self) -> str:
        """Where the smallest micro-batch comes from, for a message."""
        if self.smallest_micro_batch == self.micro_batch:
            return f"--batch-size {self.micro_batch} gives micro-batches of {self.micro_batch} sample(s)"
        return (
            f"with {self.num_train} training samples in steps of {self.slots} micro-batches of {self.micro_batch} "
            f"(--batch-size), the last micro-batch of every epoch holds {self.smallest_micro_batch} sample(s)"
        )

    def describe(self) -> str:
        if self.auto:
            return (
                f"global batch {self.trace[-1]} growing with the gradient noise scale up to {self.max_global_batch} "
                f"(--batch-trace auto; micro-batches of {self.micro_batch}, LR given for {self.global_batch})"
            )
        if self.traced:
            return (
                f"global batch from the trace, {min(self.trace)}..{max(self.trace)} (LR given for {self.global_batch})"
            )
        if self.uneven_shares:
            return (
                f"global batch {self.describe_shares()} (uneven: gradients summed by hand, each micro-batch weighted "
                "by its samples)"
            )
        accumulation = f" x accumulation {self.accum_steps}" if self.accum_steps > 1 else ""
        return f"global batch {self.global_batch} ({self.micro_batch} x {self.world_size} process(es){accumulation})"

    def trace_note(self) -> str:
        """What an LR preview of a traced run shows and cannot show, for its title ("" untraced)."""
        if not self.traced:
            return ""
        note = f", batch trace with the {self.batch_lr_rule} rule"
        if self.batch_lr_rule == "adascale":
            note += " (AdaScale's gain depends on the gradients: not shown)"
        if self.auto:
            note += " (auto: shown at the start batch; the batches it grows to depend on the gradients)"
        return note

    def summary(self) -> dict:
        """The derived numbers, for config.json and every checkpoint (`recorded` reads the global batch back)."""
        return {
            "world_size": self.world_size,
            "global_batch_size": self.global_batch,
            "micro_batch": self.micro_batch,
            "run_micro_batch": self.run_micro_batch or self.micro_batch,
            "accum_steps": self.accum_steps,
            "effective_lr": self.lr,
            "steps_per_epoch": self.steps_per_epoch,
            "total_steps": self.total_steps,
            "epochs": self.epochs,  # with --max-steps, those its steps need (not --epochs')
            "train_samples": self.num_train,
            "lr_power": self.lr_power,
            "step_size": self.step_size,
        } | ({"trace": list(self.trace)} if self.auto else {})

    def epoch(self, epoch: int, rank: int, first_trace_step: int = 0) -> list[Step]:
        """The steps of `epoch` on `rank`; a traced epoch starts at trace row `first_trace_step`."""
        if self.traced:
            return self._traced_epoch(epoch, rank, first_trace_step)
        # the epoch's permutation: DistributedSampler's shuffle (seeded by seed + epoch: set_epoch), once
        sampler = DistributedSampler(range(self.num_train), 1, 0, shuffle=True, seed=self.seed)
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        if self.aug_repeats > 1:  # DeiT's: the epoch's first N / R samples R times in a row (consecutive slots),
            r, kept = self.aug_repeats, order[: -(-len(order) // self.aug_repeats)]  # copy c of i as i + c N
            order = (kept.repeat_interleave(r) + torch.arange(r).repeat(len(kept)) * self.num_train)[: len(order)]
        if self.drop_last:  # the samples that divide evenly over the slots
            order = order[: self.num_train // self.slots * self.slots]
        mine = [order[k :: self.slots].split(self.micro_batch) for k in range(rank, self.slots, self.world_size)]
        ranks = 1 if self.manual_reduction else self.world_size  # DDP averages the ranks' gradients: b / (B / W)
        steps = []
        for s in range(self.steps_per_epoch):
            group = [slot[s].tolist() for slot in mine]
            batch = min(self.global_batch, self.num_train - s * self.global_batch)  # short: the epoch's last
            # slot k holds ceil((n - k) / slots) samples: the micro-batches differ unless the batch fills the slots
            slots = tuple(range(rank, self.slots, self.world_size))
            steps.append(Step(group, batch / ranks, batch, uneven=batch % self.slots != 0, slots=slots))
        if self.max_steps:  # --max-steps: the run's last epoch ends at its step (the global step at its start: given)
            return steps[: max(0, self.max_steps - (first_trace_step or (epoch - 1) * self.steps_per_epoch))]
        return steps

    def _traced_epoch(self, epoch: int, rank: int, first_step: int) -> list[Step]:
        """Trace step i takes the next B_i samples of the epoch's permutation, cut into micro-batches dealt
        round-robin; every rank divides by B_i, and the summed gradients are the exact mean over them."""
        steps = []
        for _, indices in batch_trace.epoch_steps(
            self.num_train, list(self.trace), first_step, self.seed, epoch, self.repeat_last
        ):
            mine = [m.tolist() for m in batch_trace.deal(indices, self.micro_batch, self.world_size, rank)]
            batch = len(indices)
            factor = lr_factor(self.batch_lr_rule, batch, self.global_batch)
            progress = 1.0 if self.batch_lr_rule == "adascale" else batch / self.global_batch  # AdaScale's: its gain
            slots = tuple(range(rank, -(-batch // self.micro_batch), self.world_size))  # deal's: j to rank j % world
            steps.append(Step(mine, batch, batch, factor, progress, slots=slots))
        return steps


def make(
    *,
    num_train: int,
    world_size: int,
    micro_batch: int,
    accum_steps: int,
    epochs: int,
    seed: int,
    base_lr: float,
    lr_scaling: str,
    base_batch: int,
    warmup_epochs: float,
    trace: list[int] | None = None,
    batch_lr_rule: str = "none",
    ref_batch: int | None = None,
    trace_end: str = "error",
    optimizer: str = "sgd",
    lr_power: float | None = None,
    step_epochs: float = 1.0,
    drop_last: bool = False,
    run_batch: tuple[int, int] | None = None,
    max_global_batch: int = 0,
    equal_shares: str = "",
    max_steps: int = 0,
    aug_repeats: int = 0,
) -> Plan:
    """The plan for these numbers; an impossible combination is a UserError that names the fix. `run_batch`: a
    resumed run's (global batch, micro-batch), which it keeps at this world size (`layout`), whatever the flags'
    --batch-size (then the micro-batch's ceiling) and --accum-steps give. `equal_shares`: what in this run needs
    every rank to run as many micro-batches in a step ("": nothing; the world size may then leave them uneven)."""
    relayout, run_micro_batch = "", micro_batch
    if max_global_batch:  # --batch-trace auto: the trace so far, its last batch until the next epoch grows it
        trace_end = "repeat-last"
    if trace is None and run_batch is not None:
        flags_batch = micro_batch * world_size * accum_steps
        run_global, run_micro = run_batch
        run_micro_batch = run_micro
        micro_batch = layout(run_global, world_size, micro_batch, run_micro, num_train, drop_last, equal_shares)
        slots = run_global // micro_batch
        accum_steps = -(-slots // world_size)  # the most micro-batches a rank runs in a step
        if flags_batch != run_global or micro_batch != run_micro or slots % world_size:
            relayout = f"the run's global batch {run_global} is kept on {world_size} process(es)"
            if flags_batch != run_global:
                relayout += f" (this command's --batch-size/--accum-steps, which give {flags_batch}, are not used)"
            if slots % world_size:
                spread = ",".join(map(str, shares(slots, world_size)))
                relayout += (
                    f": {slots} micro-batches of {micro_batch} spread {spread} over the ranks (uneven: a step lasts as "
                    f"long as {accum_steps} micro-batch(es), and its gradients are summed across the ranks after them)"
                )
            else:
                relayout += f": micro-batch {micro_batch} x accumulation {accum_steps}"
            if micro_batch != run_micro:
                relayout += (
                    f"; the run's micro-batch was {run_micro}: the steps keep their samples, a model with BatchNorm "
                    "normalizes over other groups of them"
                )
    if max_global_batch and max_global_batch < trace[0]:
        raise UserError(
            f"--max-global-batch {max_global_batch} is below the start batch {trace[0]} (--batch-size {micro_batch} x "
            f"{world_size} processes x --accum-steps {accum_steps}): raise it, or start smaller"
        )
    if max_global_batch and trace[-1] == micro_batch:  # --batch-trace auto at one micro-batch a step
        raise UserError(
            "--batch-trace auto measures the noise scale from a step's micro-batches, and a step of one has no "
            "second: start with --accum-steps 2 (or 2+ processes)"
        )
    if trace is None:
        global_batch = micro_batch * world_size * accum_steps if run_batch is None else run_batch[0]
        if global_batch > num_train:
            raise UserError(
                f"the global batch {global_batch} (--batch-size {micro_batch} x {world_size} processes x "
                f"--accum-steps {accum_steps}) exceeds the {num_train} training samples: lower --batch-size"
                + (" or --accum-steps" if accum_steps > 1 else "")
            )
        if aug_repeats > 1 and global_batch % aug_repeats:
            raise UserError(
                f"--aug-repeats {aug_repeats} must divide the global batch {global_batch}, so that each sample's "
                "repeats are in one step: change --batch-size, --accum-steps or the processes"
            )
        steps_per_epoch = epoch_steps(num_train, global_batch, micro_batch, drop_last)
        if max_steps:  # the schedule's length is the run's steps; the epochs are as many as they need
            epochs = -(-max_steps // steps_per_epoch)
        total_steps = run_steps = max_steps or epochs * steps_per_epoch
    else:
        if max_steps:
            raise UserError("--max-steps counts steps of one batch size: a --batch-trace run is given in --epochs")
        batch_trace.check_trace(trace, micro_batch)
        total_steps = batch_trace.steps_needed(num_train, trace, epochs, seed)
        if total_steps == 0:
            raise UserError(f"the trace's first batch ({trace[0]}) is larger than the {num_train} training samples")
        if trace_end == "error" and len(trace) < total_steps:
            raise UserError(
                f"the trace has {len(trace)} steps but {epochs} epochs need {total_steps}: "
                "extend it, train fewer epochs, or pass --trace-end repeat-last"
            )
        global_batch = ref_batch or trace[0]
        run_steps = total_steps
        if batch_lr_rule == "adascale":  # counted in steps, each advancing the schedule by AdaScale's gain
            steps_per_epoch = max(1, round(total_steps / epochs))
        else:  # counted in steps of the reference batch: a step of B samples advances it by B / reference
            steps_per_epoch = max(1, num_train // global_batch)
            total_steps = epochs * steps_per_epoch
    return Plan(
        num_train=num_train,
        world_size=world_size,
        micro_batch=micro_batch,
        accum_steps=accum_steps,
        seed=seed,
        lr=base_lr * lr_factor(lr_scaling, global_batch, base_batch),
        global_batch=global_batch,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        warmup_steps=min(round(warmup_epochs * steps_per_epoch), total_steps),
        trace=tuple(trace) if trace is not None else None,
        batch_lr_rule=batch_lr_rule,
        repeat_last=trace_end == "repeat-last",
        lr_power=lr_power if lr_power is not None else (2.0 if optimizer == "lars" else 1.0),
        step_size=max(1, round(step_epochs * steps_per_epoch)),
        drop_last=drop_last and trace is None,
        relayout=relayout,
        run_micro_batch=run_micro_batch if trace is None else micro_batch,
        max_global_batch=max_global_batch,
        run_steps=run_steps,
        epochs=epochs,
        max_steps=max_steps if trace is None else 0,
        aug_repeats=aug_repeats,
    )


def epoch_steps(num_train: int, global_batch: int, micro_batch: int, drop_last: bool) -> int:
    """Optimizer steps per epoch (untraced): the whole steps, and a short last one unless it would leave one of the
    step's micro-batches empty; with drop_last, the whole micro-batches of the samples that divide over them."""
    slots = global_batch // micro_batch
    if drop_last:
        return num_train // slots // micro_batch
    return num_train // global_batch + (num_train % global_batch >= slots)


def shares(slots: int, world_size: int) -> list[int]:
    """The micro-batches of a step's `slots` that each rank runs: rank r runs slots r, r + world, ..."""
    return [len(range(rank, slots, world_size)) for rank in range(world_size)]


def layout(
    global_batch: int,
    world_size: int,
    ceiling: int,
    prefer: int,
    num_train: int,
    drop_last: bool = False,
    equal_shares: str = "",
) -> int:
    """The micro-batch that keeps `global_batch` on `world_size` processes: one that divides it and keeps the run's
    steps per epoch (its schedule), at most `ceiling` (--batch-size). The run's own micro-batch `prefer` where it fits
    under the ceiling, whether or not the world size divides the step's micro-batches (the ranks' shares may be
    uneven: the same micro-batches as the run's, BatchNorm's groups included); else the largest that the world size
    divides, failing that the largest. With `equal_shares` (what needs every rank to run as many micro-batches), only
    one the world size divides: the run's own if it is one, else the largest."""
    steps = epoch_steps(num_train, global_batch, prefer, drop_last)
    sizes = [
        m
        for m in range(min(ceiling, global_batch), 0, -1)
        if global_batch % m == 0 and epoch_steps(num_train, global_batch, m, drop_last) == steps
    ]
    even = [m for m in sizes if global_batch // m % world_size == 0]
    if equal_shares:
        fits = even
    else:
        fits = [prefer] if prefer in sizes else even or sizes
    if not fits and not equal_shares:
        raise UserError(
            f"the run's global batch {global_batch} cannot be kept with micro-batches of at most --batch-size "
            f"{ceiling}: none that divides it makes its {steps} steps an epoch; pass --batch-size {prefer} (the run's "
            "micro-batch), or start a new run (another -n)"
        )
    if not fits:
        sizes = [n for n in range(1, global_batch + 1) if global_batch % n == 0][:8]
        raise UserError(
            f"the run's global batch {global_batch} cannot be kept on {world_size} processes: {equal_shares} needs "
            f"every rank to run as many micro-batches in a step, and micro-batch x {world_size} x accumulation never "
            f"makes {global_batch} in {steps} steps an epoch (the micro-batch at most --batch-size {ceiling}): launch "
            f"a number of processes that divides it ({', '.join(map(str, sizes))}"
            f"{', ...' if global_batch > sizes[-1] else ''}), or start a new run (another -n)"
        )
    return prefer if prefer in fits else fits[0]


def recorded(state: dict | None, num_train: int = 0) -> tuple[int, int] | None:
    """A checkpoint's (global batch, micro-batch): what its plan recorded, else what the flags it was written
    with made (a checkpoint from before the plan was kept); None for a traced run or without a checkpoint. A resume
    is the same run: a training set of another size (`num_train`) is a UserError naming --init-from."""
    config = (state or {}).get("config") or {}
    if state is None or config.get("batch_trace"):
        return None
    plan = state.get("plan")
    if num_train and (plan or {}).get("train_samples", num_train) != num_train:
        raise UserError(
            f"--resume continues the same run, and its training set changed: {plan['train_samples']} samples in the "
            f"checkpoint's run, {num_train} now; to train on other data, start a new run from its weights with "
            "--init-from PATH"
        )
    if plan:
        return plan["global_batch_size"], plan.get("run_micro_batch", plan["micro_batch"])
    if "batch_size" not in config or "world_size" not in state:
        return None
    return config["batch_size"] * state["world_size"] * config.get("accum_steps", 1), config["batch_size"]
