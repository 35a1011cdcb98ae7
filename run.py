"""Train a task (task.py, or --task FILE.py:NAME) with DistributedDataParallel and large-batch tricks.

    python run.py                                              # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node=2 run.py            # one node, 2 processes
    torchrun --nnodes=2 --node-rank=R --nproc_per_node=8 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT run.py   # two nodes
    python -m torch.distributed.launch --nproc_per_node=2 run.py   # the legacy launcher

The recipe: parse -> check -> join -> build -> train -> finish. `python run.py --help` lists the flags by
trick. A run writes runs/<name>/ (config.json, metrics.csv, train.log, last.pt or, sharded, last.dcp, best.pt,
curves.png).
"""

from __future__ import annotations

import sys

from ddp_tricks import cli

if __name__ == "__main__":
    cli.answer_early(sys.argv[1:])  # --help and flag errors answer before torch is imported; SIGTERM held from here

import logging
import os
import traceback
from pathlib import Path

import torch

from customized_function import EarlyStopping, same_seeds, use_deterministic_algorithms
from ddp_tricks import models, plots
from ddp_tricks import plan as planning
from ddp_tricks.data import loaders
from ddp_tricks.distributed import collectives, fsdp, launch, watchdog, wrap
from ddp_tricks.distributed.preemption import Preemption
from ddp_tricks.errors import UserError, report
from ddp_tricks.optim import build as optimizers
from ddp_tricks.schedules import decay_kind, schedule
from ddp_tricks.storage import checkpoint, run_folder
from ddp_tricks.traces import batch_trace
from ddp_tricks.training import cached, loop, noise, seam
from ddp_tricks.training.precision import DTYPES, Precision
from ddp_tricks.training.state import Best, NonFiniteLoss, Training

log = logging.getLogger("ddp_tricks")
PREEMPTED = 143  # exit code after SIGTERM: the last checkpoint holds the state, `--resume auto` continues exactly
NONFINITE = 3  # exit code after a NaN/inf loss


def main(argv: list[str] | None = None) -> int:
    """Parse, check everything a user can get wrong (before any process group), join, train. The exit code."""
    process = launch.detect()
    flags = None
    watchdog.hold_sigterm()  # until the group: a rank still checking says its error before a SIGTERM ends it
    try:
        flags, task_class = cli.parse(argv)
        process = launch.detect(flags.local_rank)
        return run(flags, task_class(flags), process)
    except NonFiniteLoss as error:  # raised on every rank together
        watchdog.fail(NONFINITE)
        if process.rank == 0:
            run_dir = Path(flags.run_dir)
            kept = "no checkpoint was written before it"
            last = checkpoint.LAST[flags.strategy]
            if (run_dir / last).exists():
                kept = f"{last} keeps the last good weights"
            fix = "Lower --base-lr, add --clip-grad-norm, or pass --on-nonfinite skip"
            report(f"{error}; {kept}. {fix}", run_dir / "train.log")
        return watchdog.leave(NONFINITE)
    except UserError as error:
        first = watchdog.fail(2)  # the other ranks learn it at once: none waits in a collective for this one
        error = cli.blame(error)  # a value from --config FILE: the message names the file and the key
        # with a process group, the job's first failure says it (on whichever rank); before one, every rank fails
        # the same check: rank 0 says it, unless only this rank is concerned
        said = first if watchdog.active() else process.rank == 0 or error.rank_specific
        if said:
            report(str(error) if process.rank == 0 else f"on rank {process.rank}: {error}")
        return watchdog.leave(2, said)  # before the group, one that leaves it to rank 0 lingers first
    except BaseException as error:  # a bug: the first rank that fails shows its traceback, the others end quietly
        if not watchdog.active():
            raise
        if watchdog.fail(1):
            gone = watchdog.lost_peer(error)  # not a bug here: another process died first, without a word
            if gone:
                restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
                restarts = restarts and getattr(flags, "resume", None) == "auto"
                then = "torchrun restarts the job from the last checkpoint" if restarts else "resume it with -n NAME"
                report(
                    f"on rank {process.rank}: another process of the job is gone (killed, or its node lost: {gone}); "
                    f"{then}{'' if restarts else ' --resume auto'}"
                )
            else:
                traceback.print_exc()
        return watchdog.leave(1)
    finally:
        launch.cleanup(ending=__name__ == "__main__")  # as a script, the process ends next: SIGTERM stays held


def run(flags, task, process: launch.Launch) -> int:
    """Data, model and plan before any process group (a user error ends here, on every rank alike), then join,
    build the training objects, train, finish."""
    same_seeds(flags.seed)  # the same data split and initial weights on every rank and at every world size
    train_set, val_set = task.datasets()
    loaders.check_sizes(len(train_set), len(val_set), process.world_size)
    model = task.model()
    collate = getattr(task, "collate", None)  # the task's own batching (padding sequences, say), when it has one
    sum_names = seam.check_task(task, model, train_set, collate)  # also initialises lazy modules
    reducer = flags.strategy == "ddp" and process.world_size > 1 and not flags.batch_trace  # DDP's, which waits
    if reducer and not (flags.find_unused_parameters or flags.static_graph):  # for every parameter's gradient
        seam.check_unused_parameters(task, model, train_set, collate)  # one that gets none: said here, not a hang
    sparse = seam.sparse_parameters(task, model, train_set, collate)  # one backward: which get sparse gradients
    units = fsdp.shard_units(task, model) if flags.strategy == "fsdp" else []  # what is sharded as one
    resume_from = checkpoint.resume_path(flags.resume, flags.run_dir, flags.strategy)
    state = checkpoint.load(resume_from, flags.strategy) if resume_from else None
    # the run's global batch: a resumed run keeps its own at any world size, the layout adapting
    trains = not (flags.eval_only or flags.plot_lr)
    run_batch = planning.recorded(state) if trains else None
    plan = make_plan(flags, len(train_set), process.world_size, run_batch, state)
    nccl = process.world_size > 1 and launch.backend_of(flags.backend, launch.device_type(flags.device)) == "nccl"
    seam.check_sparse(sparse, flags.optimizer, flags.lars_wrap, flags.strategy, plan.traced, nccl)
    seam.check_batchnorm(model, train_set, collate, plan.smallest_micro_batch, plan.why_small())
    global_loss = seam.check_global_loss(task, model, train_set, collate, traced=plan.traced)  # gathers from ranks
    accumulation = cached.choose(task, plan.accum_steps, plan.traced, flags.amp_backend == "apex")  # None: plain
    no_noise_scale = noise_note(flags, plan, process.world_size, accumulation, sparse, global_loss)  # None: measured
    if plan.auto and no_noise_scale is not None:
        raise UserError(
            f"--batch-trace auto follows the gradient noise scale, which this run cannot measure: "
            f"{no_noise_scale}; give the batches with --batch-trace FILE instead"
        )
    if state is not None:
        checkpoint.restore_model(model, state, str(resume_from))  # weights of another model: said here
    continues = flags.resume is not None or flags.eval_only or flags.plot_lr  # these two add, never replace
    run_folder.check(Path(flags.run_dir), resume=continues, overwrite=flags.overwrite)

    dist = launch.setup(
        process,
        flags.device,
        flags.backend,
        flags.dist_timeout,
        group=flags.strategy == "fsdp",
        sigterm_grace=flags.sigterm_grace,
    )
    t = build_training(
        flags, task, model, sum_names, plan, dist, units, sparse, global_loss, accumulation, no_noise_scale is None
    )
    if state is not None:
        t.load_state_dict(state, str(resume_from))
    collectives.require_same(
        (t.completed_epochs, t.step_in_epoch, t.global_step),
        "the checkpoint each rank resumes from; put the runs folder on storage that every node shares",
    )
    folder = run_folder.RunFolder(Path(flags.run_dir), dist.is_main, run_folder.metric_columns(task))
    record = vars(flags) | plan.summary() | {"val_samples": len(val_set), "task_info": run_folder.task_info(task)}
    record["task_metrics"] = run_folder.task_metrics(task)
    folder.start(record, t.completed_epochs, flags.overwrite, flags.tensorboard, new_run=trains)
    preemption = Preemption(dist)  # before workers.json: from then on, SIGTERM is agreed on
    folder.record_workers(collectives.gather_objects(os.getpid()))
    log.info(
        "%s on %d process(es), device %s: %s, %s, %d steps/epoch",
        flags.task,
        dist.world_size,
        dist.device,
        plan.describe(),
        cli.describe_lr(flags, plan.lr),
        plan.steps_per_epoch,
    )
    if state is not None and trains:
        log.info(t.describe_resume(resume_from))
    if plan.relayout:
        log.info("resumed: %s", plan.relayout)
    if no_noise_scale is None:
        log.info(noise.describe(dist.world_size, plan.micro_batch, plan.accum_steps, plan.global_batch, plan.traced))
    elif flags.noise_scale:
        log.info("gradient noise scale: not measured: %s", no_noise_scale)
    if global_loss and plan.accum_steps > 1 and accumulation is None:
        log.info("the task's loss gathers from every rank but sees one micro-batch at a time: set cached_accumulation")
    if flags.deterministic:
        log.info(
            "--deterministic: an op without a deterministic kernel warns once, by name, instead of stopping the run; "
            "a run that uses one is not bit-reproducible"
        )
    if sparse:
        log.info("sparse gradients in %s: plain SGD steps them, without momentum or weight decay", ", ".join(sparse))
    if flags.plot_lr:
        if dist.is_main:
            log.info("learning-rate schedule: %s", preview_lr(flags, plan, t.best.mode, folder.path))
        return 0
    val_loader = loaders.val_loader(
        val_set,
        flags.val_batch_size,
        dist.rank,
        dist.world_size,
        dist.device,
        flags.seed,
        flags.workers,
        flags.prefetch_factor,
        collate,
    )
    if flags.eval_only:
        row = {"epoch": t.completed_epochs, "step": t.global_step, "lr": t.lr} | loop.evaluate(t, val_loader)
        folder.append(row, "eval.csv")  # beside the run's metrics.csv, never into it
        log.info("eval-only: %s -> %s", run_folder.describe(row), folder.path / "eval.csv")
        return 0
    train_loader = loaders.train_loader(
        train_set, t.rank, t.device, flags.seed, flags.workers, flags.prefetch_factor, collate
    )
    return train(flags, t, plan, train_loader, val_loader, folder, preemption)


def train(flags, t: Training, plan: planning.Plan, train_loader, val_loader, folder, preemption) -> int:
    """Epochs of train -> evaluate -> decide -> checkpoint -> log, from where the state stands."""
    every = flags.checkpoint_every_steps
    checkpoints = checkpoint.Checkpoints(
        folder.path, t.rank == 0, every, preemption, vars(flags), flags.strategy, plan.summary()
    )
    for epoch in range(t.completed_epochs + 1, flags.epochs + 1):
        if plan.auto and t.step_in_epoch == 0:  # the epoch's batch, from the noise scale measured so far
            before = plan.rows(t.global_step)[-1] if t.global_step else plan.trace[0]
            plan = plan.grown(t.noise.agreed_scale(), t.global_step)
            checkpoints.plan = plan.summary()
            if plan.trace[-1] != before:
                log.info("--batch-trace auto: global batch %d -> %d from epoch %d", before, plan.trace[-1], epoch)
        steps = plan.epoch(epoch, t.rank, first_trace_step=t.global_step - t.step_in_epoch)
        first_step = loop.start_epoch(t, epoch, train_loader, steps, flags.seed)
        show = not flags.no_progress and t.rank == 0
        progress = loop.progress_bar(show, len(steps), f"epoch {epoch}/{flags.epochs}")
        try:
            result = loop.train_one_epoch(
                t, steps, train_loader, first_step, progress, flags.log_interval, checkpoints.after_step
            )
        except RuntimeError as error:
            wrap.name_unused_parameters(error, t.model)  # DDP's "expected to have finished reduction": one line
            raise
        finally:  # an error's line then starts a line of its own
            if progress is not None:
                progress.close()
        if result is None:
            log.info(checkpoint.preempted(f"at epoch {epoch}, step {t.global_step}", flags.strategy))
            log.info(t.describe_steps())
            return PREEMPTED
        loop.recompute_bn_stats(t, train_loader, steps, flags.precise_bn, plan.micro_batch, t.world_size)
        row = {"epoch": epoch, "step": t.global_step, "lr": t.lr} | result | loop.evaluate(t, val_loader)
        row |= {"world_size": t.world_size, "accum_steps": plan.accum_steps}  # the layout that ended the epoch
        improved = t.end_epoch(row)  # plateau, best and early stopping, on the monitored metric
        folder.append(row)
        checkpoints.save(t, also_best=improved)
        if plan.auto and t.rank == 0:  # the batches chosen so far: --batch-trace FILE replays them
            batch_trace.write_trace(folder.path / "batch_trace.csv", plan.rows(t.global_step))
        log.info(
            "epoch %d: %s | lr %.4g | %.1fs, %.0f samples/s%s",
            epoch,
            run_folder.describe(row),
            row["lr"],
            row["epoch_seconds"],
            row["samples_per_second"],
            " (early stop)" if t.stopped_early else "",
        )
        if t.stopped_early:
            break
        if preemption.agreed(final=True) and epoch < flags.epochs:
            log.info(checkpoint.preempted(f"after epoch {epoch}", flags.strategy))
            log.info(t.describe_steps())
            return PREEMPTED

    if t.rank == 0:
        plots.curves(folder.path, t.lr_log, plan.steps_per_epoch)
    log.info(t.describe_steps())
    log.info(t.best.describe(folder.path))
    return 0


def make_plan(
    flags, num_train: int, world_size: int, run_batch: tuple[int, int] | None = None, state: dict | None = None
) -> planning.Plan:
    """Every number derived from the flags, the world and the data, once (`run_batch`: a resumed run's global batch
    and micro-batch, kept; `state`: a resumed checkpoint, whose --batch-trace auto trace goes on)."""
    trace = batch_trace.load_trace(flags.batch_trace) if flags.batch_trace not in (None, "auto") else None
    max_global_batch = 0
    if flags.batch_trace == "auto":
        start = flags.batch_size * world_size * flags.accum_steps
        trace = ((state or {}).get("plan") or {}).get("trace") or [start]
        max_global_batch = flags.max_global_batch or min(16 * trace[0], num_train)
    return planning.make(
        num_train=num_train,
        world_size=world_size,
        micro_batch=flags.batch_size,
        accum_steps=flags.accum_steps,
        epochs=flags.epochs,
        seed=flags.seed,
        base_lr=flags.base_lr,
        lr_scaling=flags.lr_scaling,
        base_batch=flags.base_batch_size,
        warmup_epochs=flags.warmup_epochs,
        trace=trace,
        batch_lr_rule=flags.batch_lr_rule,
        ref_batch=flags.ref_batch_size,
        trace_end="repeat-last" if max_global_batch else flags.trace_end,
        optimizer=flags.optimizer,
        lr_power=flags.lr_power,
        step_epochs=flags.step_epochs,
        drop_last=flags.drop_last,
        run_batch=run_batch,
        max_global_batch=max_global_batch,
    )


def build_training(
    flags,
    task,
    model,
    sum_names,
    plan: planning.Plan,
    dist: launch.Dist,
    units,
    sparse,
    global_loss=False,
    accumulation=None,
    measure_noise=False,
) -> Training:
    """The model on its device and wrapped (DDP) or sharded (FSDP), the optimizer (the parameters named in `sparse`
    get sparse gradients), the schedule, precision, best and early stopping; the task's loss gathers from every rank
    (`global_loss`), a step's micro-batches make its gradient by `accumulation` (None: plain), and the gradient noise
    scale is measured where `measure_noise`."""
    if flags.deterministic:
        use_deterministic_algorithms(show_warnings=dist.is_main)
    memory_format = torch.channels_last if flags.channels_last else torch.preserve_format
    model = model.to(dist.device, memory_format=memory_format)
    if flags.strategy == "fsdp":  # before the optimizer: it steps the sharded parameters
        model = fsdp.shard(model, units, DTYPES[flags.amp])
    optimizer = optimizers.build(  # DDP and SyncBN keep these Parameter objects
        model,
        flags.optimizer,
        lr=plan.lr,
        momentum=flags.momentum,
        nesterov=flags.nesterov,
        weight_decay=flags.weight_decay,
        trust_coefficient=flags.trust_coefficient,
        eps=flags.epsilon,
        bn_bias_separately=flags.bn_bias_separately,
        lars_wrap=flags.lars_wrap,
        lookahead=flags.lookahead,
        lookahead_k=flags.lookahead_k,
        lookahead_alpha=flags.lookahead_alpha,
        sparse=sparse,
    )
    apex_amp = None
    if flags.amp_backend == "apex":
        from apex import amp as apex_amp

        model, optimizer = apex_amp.initialize(model, optimizer, opt_level="O1")  # before DDP
    if not plan.traced and flags.strategy == "ddp":  # a traced run reduces its gradients itself (TraceReduction)
        model = wrap.wrap(
            model,
            dist,
            flags.sync_bn,
            static_graph=flags.static_graph,
            bucket_cap_mb=flags.bucket_cap_mb,
            find_unused_parameters=flags.find_unused_parameters,
        )
    params = [p for p in model.parameters() if p.requires_grad]
    noise_scale, noise_parts = measured_noise(dist, model, params, plan.traced) if measure_noise else (None, None)
    if flags.compile:
        model = models.compiled(model)
    mode = cli.mode_of(task, flags.monitor)
    adascale = batch_trace.AdaScale() if flags.batch_lr_rule == "adascale" else None
    early_stopping = None
    if flags.early_stop_patience:
        early_stopping = EarlyStopping(flags.early_stop_patience, delta=flags.early_stop_delta, mode=mode)
    return Training(
        model,
        optimizer,
        make_schedule(flags, plan, optimizer, mode),
        task,
        sum_names,
        Precision(flags.amp, dist.device, apex_amp, sharded=flags.strategy == "fsdp"),
        dist.device,
        clip_grad_norm=flags.clip_grad_norm,
        channels_last=flags.channels_last,
        on_nonfinite=flags.on_nonfinite,
        reduction=batch_trace.TraceReduction(params, plan.micro_batch, adascale, noise_scale) if plan.traced else None,
        best=Best(flags.monitor, mode),
        early_stopping=early_stopping,
        accumulation=accumulation,
        global_loss=global_loss,
        noise=noise_scale,
        noise_parts=noise_parts,
        rank=dist.rank,
        world_size=dist.world_size,
    )


def noise_note(flags, plan: planning.Plan, world_size: int, accumulation, sparse, global_loss) -> str | None:
    """Why the run does not measure the gradient noise scale (None: it does)."""
    if not flags.noise_scale:
        return "--no-noise-scale"
    whole_steps = accumulation is not None or flags.amp_backend == "apex"
    return noise.not_measured(
        world_size, plan.accum_steps, flags.strategy, plan.traced, whole_steps, bool(sparse), global_loss
    )


def measured_noise(dist: launch.Dist, model, params, traced: bool):
    """The gradient noise scale's estimator and, in one untraced process, its micro-batch reader."""
    estimator = noise.NoiseScale(dist.device)
    if traced:  # the trace's reduction reads each micro-batch's gradient (TraceReduction)
        return estimator, None
    if dist.world_size > 1:  # DDP: each rank's gradient, read as its buckets are all-reduced
        model.register_comm_hook(None, noise.ddp_hook(estimator, params))
        return estimator, None
    return estimator, noise.MicroBatches(estimator, params)


def make_schedule(flags, plan: planning.Plan, optimizer, mode: str) -> schedule.Schedule:
    return schedule.build(
        optimizer,
        total_steps=plan.total_steps,
        warmup_steps=plan.warmup_steps,
        kind=decay_kind(flags.scheduler, flags.warmup_type),
        end_lr=flags.end_lr,
        power=plan.lr_power,
        step_size=plan.step_size,
        gamma=flags.step_gamma,
        plateau_factor=flags.plateau_factor,
        plateau_patience=flags.plateau_patience,
        plateau_mode=mode,
    )


def preview_lr(flags, plan: planning.Plan, mode: str, run_dir: Path) -> Path:
    """The LR of every step of the run (with a trace, times its batch's linear/root factor), drawn and listed."""
    lrs = schedule.lrs_over_run(
        lambda opt: make_schedule(flags, plan, opt, mode), plan.lr, plan.run_steps, plan.lr_factor_at, plan.progress_at
    )
    kind = decay_kind(flags.scheduler, flags.warmup_type)
    note = " (plateau cuts depend on the monitored metric: not shown)" if kind == "plateau" else ""
    if plan.traced:
        note += f", batch trace with the {plan.batch_lr_rule} rule"
        if plan.batch_lr_rule == "adascale":
            note += " (AdaScale's gain depends on the gradients: not shown)"
        if plan.auto:
            note += " (auto: shown at the start batch; the batches it grows to depend on the gradients)"
    title = (
        f"{kind} after {flags.warmup_epochs:g} warmup epochs, LR {plan.lr:.4g} (--lr-scaling {flags.lr_scaling}, "
        f"{plan.describe()}){note}"
    )
    return plots.lr_schedule(lrs, plan.steps_per_epoch, run_dir, title)


if __name__ == "__main__":
    sys.exit(main())
