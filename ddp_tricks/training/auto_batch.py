"""The gradient noise scale's decisions, in one place: whether a run measures it (and why not), where its small
batches come from and how its estimator is attached to the model (noise.py holds the estimator), and
`--batch-trace auto`, whose global batch starts from the flags (or a resumed run's trace) and grows towards the
measured noise scale at each epoch's start (batch_trace.next_batch's rule), its rows written to the run folder.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ddp_tricks.errors import UserError
from ddp_tricks.plan import Plan
from ddp_tricks.traces import batch_trace
from ddp_tricks.training import noise

log = logging.getLogger("ddp_tricks")


def not_measured(
    world_size: int,
    accum_steps: int,
    strategy: str,
    traced: bool,
    whole_steps: bool,
    sparse: bool = False,
    global_loss: bool = False,
) -> str | None:
    """Why this run cannot measure the noise scale (None: it can). `whole_steps`: a step's gradient is made at once
    or scaled unseen (cached accumulation, Apex); `sparse`: some gradients are sparse; `global_loss`: the loss
    gathers from every rank, so no rank has a gradient of its own samples."""
    if sparse:
        return "not with sparse gradients (an embedding's with sparse=True)"
    if whole_steps:
        return "not with cached accumulation or Apex"
    if global_loss and world_size > 1:
        return "not with a loss over the global batch (no rank's gradient is its own samples')"
    if strategy == "fsdp":
        return "not under --strategy fsdp (each rank holds slices of the gradients)"
    if traced:  # or unevenly shared: reduced by hand alike
        return None  # a traced step's micro-batches are its small batches (TraceReduction); a step of one is skipped
    if world_size == 1 and accum_steps == 1:
        return "it needs two batch sizes per step: 2+ processes, or --accum-steps 2+ on one"
    return None


def refuse_auto_without(why_not: str | None) -> None:
    """--batch-trace auto follows the noise scale: a run that cannot measure it is one line, before it starts."""
    if why_not is not None:
        raise UserError(
            f"--batch-trace auto follows the gradient noise scale, which this run cannot measure: {why_not}; give "
            "the batches with --batch-trace FILE instead"
        )


def describe(plan: Plan, units: bool = False, every: int = 1) -> str:
    """Where a run's small batches come from, for its log; `units`: the task counts units of its own (units()), in
    which the batch sizes, and so the noise scale, are counted; `every`: measured on every K-th step."""
    when = "" if every == 1 else f", on one optimizer step in {every} (--noise-scale-every)"
    if plan.manual_reduction:  # traced, or uneven shares: TraceReduction reads each micro-batch's gradient
        small, source, big = plan.micro_batch, "each micro-batch's gradient", ""
    elif plan.world_size > 1:
        small, source, big = plan.micro_batch * plan.accum_steps, "each rank's gradient", f" ({plan.global_batch})"
    else:
        small, source, big = plan.micro_batch, "each micro-batch's", f" ({plan.global_batch})"
    if not units:
        return f"gradient noise scale: measured from {source} ({small} samples) and the step's{big}{when}"
    big = f" (of {plan.global_batch})" if big else ""
    return (
        f"gradient noise scale: measured from {source} (the units of {small} samples, as the task's units() counts "
        f"them) and the step's{big}{when}: the loss averages over units, so the batch sizes and the noise scale are in "
        "units"
    )


def attach(device, world_size: int, params, traced: bool, every: int = 1):
    """The noise scale's estimator, and its reader of the small batches' gradients in an untraced run: each rank's
    under DDP (RankGradient), each micro-batch's in one process (MicroBatches); a traced run's reduction reads each
    micro-batch's itself (TraceReduction: None here). `every`: an untraced run measures every K-th optimizer step."""
    estimator = noise.NoiseScale(device, every=1 if traced else every)
    if traced:
        return estimator, None
    if world_size > 1:
        return estimator, noise.RankGradient(estimator, params)
    return estimator, noise.MicroBatches(estimator, params)


def start(micro_batch: int, world_size: int, accum_steps: int, num_train: int, ceiling: int, state: dict | None):
    """--batch-trace auto's trace so far (a resumed run's, else one step of the flags' global batch) and the largest
    global batch it may grow to (`ceiling`, --max-global-batch; 0: 16x the start batch, at most the training set)."""
    trace = ((state or {}).get("plan") or {}).get("trace") or [micro_batch * world_size * accum_steps]
    return trace, ceiling or min(16 * trace[0], num_train)


def grow(plan: Plan, noise_scale: float, global_step: int, epoch: int) -> Plan:
    """At an epoch's start: the plan whose trace goes on with the batch the noise scale measured so far asks for
    (one agreed value: rank 0's, in samples: NoiseScale.agreed_scale), said in the log when it changes."""
    before = plan.rows(global_step)[-1] if global_step else plan.trace[0]
    plan = plan.grown(noise_scale, global_step)
    if plan.trace[-1] != before:
        log.info("--batch-trace auto: global batch %d -> %d from epoch %d", before, plan.trace[-1], epoch)
    return plan


def write(plan: Plan, global_step: int, folder: Path) -> None:
    """The batches chosen so far, as the run folder's batch_trace.csv (rank 0's to call): --batch-trace FILE
    replays them."""
    batch_trace.write_trace(Path(folder) / "batch_trace.csv", plan.rows(global_step))
