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

import functools
import sys

from ddp_tricks import cli

if __name__ == "__main__":
    cli.answer_early(sys.argv[1:])  # --help and flag errors answer before torch is imported; SIGTERM held from here

import logging
import os
from pathlib import Path

from customized_function import DETERMINISTIC_NOTE, EarlyStopping, same_seeds, use_deterministic_algorithms
from ddp_tricks import failures, models, plots
from ddp_tricks import plan as planning
from ddp_tricks.data import loaders
from ddp_tricks.distributed import collectives, heartbeat, launch, meta_init, placement, watchdog, wrap
from ddp_tricks.distributed.preemption import Preemption
from ddp_tricks.distributed.sparse import SparseGradients
from ddp_tricks.distributed.trace_reduction import AdaScale, TraceReduction
from ddp_tricks.errors import UserError
from ddp_tricks.optim import build as optimizers
from ddp_tricks.schedules import decay_kind, schedule
from ddp_tricks.storage import checkpoint, init_from, run_folder
from ddp_tricks.traces import batch_trace
from ddp_tricks.training import auto_batch, loop, preflight, step_evaluations, step_log
from ddp_tricks.training.ema import ModelEma
from ddp_tricks.training.precision import DTYPES, Precision
from ddp_tricks.training.state import Best, NonFiniteLoss, Training

log = logging.getLogger("ddp_tricks")


def main(argv: list[str] | None = None) -> int:
    """Parse, check everything a user can get wrong (before any process group), join, train. The exit code; a
    failure ends every rank together, with one line that names its cause (failures.py)."""
    process = launch.detect()
    flags = None
    watchdog.hold_sigterm()  # until the group: a rank still checking says its error before a SIGTERM ends it
    try:
        flags, task_class = cli.parse(argv)
        process = launch.detect(flags.local_rank)
        return run(flags, task_class(flags), process)
    except NonFiniteLoss as error:  # raised on every rank together
        return failures.nonfinite(error, flags, process.rank)
    except UserError as error:
        return failures.user_error(error, process.rank)
    except BaseException as error:  # a bug: the first rank that fails shows its traceback, the others end quietly
        return failures.bug(error, flags, process.rank)
    finally:
        launch.cleanup(ending=__name__ == "__main__")  # as a script, the process ends next: SIGTERM stays held


def run(flags, task, process: launch.Launch) -> int:
    """Check (data, model, plan and the task against them, before any process group: a mistake ends here, on
    every rank alike), join, build the training objects, then train, evaluate only, or draw the LR schedule."""
    same_seeds(flags.seed)  # the same data split and initial weights on every rank and at every world size
    train_set, val_set = task.datasets()
    loaders.check_sizes(len(train_set), len(val_set), process.world_size)
    resume_from = checkpoint.resume_path(flags.resume, flags.run_dir, flags.strategy)
    state = checkpoint.load(resume_from, flags.strategy, evaluation=flags.eval_only) if resume_from else None
    init = init_from.read(flags.init_from, flags.init_optimizer) if flags.init_from and state is None else None
    whole = state or (init and {"model": init.model})  # whole weights: FSDP's model made whole, not on meta
    model, recipe, made = placement.make(task, flags.strategy, flags.meta_init, whole)
    nccl = process.world_size > 1 and launch.backend_of(flags.backend, launch.device_type(flags.device)) == "nccl"
    setup = preflight.Setup(process.world_size, nccl=nccl, **cli.check_options(flags))
    plan_for = functools.partial(make_plan, flags, len(train_set), process.world_size, state)  # given equal shares
    plan, found = meta_init.checked(  # one record of what the checks found (a meta-device model: on a stand-in)
        model, recipe, lambda m: preflight.check(task, m, train_set, setup, plan_for)
    )
    if state is not None:
        checkpoint.restore_model(model, state, str(resume_from))  # weights of another model: said here
    elif init is not None:  # before the wrapper, the optimizer and the EMA: they start from these weights
        made += init_from.start(model, init, **cli.init_options(flags))
    trains = not (flags.eval_only or flags.plot_lr)
    continues = flags.resume is not None or flags.eval_only or flags.plot_lr  # these two add, never replace
    run_folder.check(Path(flags.run_dir), resume=continues, overwrite=flags.overwrite)

    heartbeat.configure(flags.run_dir, process.world_size, **cli.hang_options(flags))  # the watchdog's thresholds
    dist = launch.setup(
        process, flags.device, flags.backend, flags.dist_timeout, flags.strategy == "fsdp", flags.sigterm_grace
    )
    t = build_training(flags, task, model, found, plan, dist, recipe)
    t.parts["step_log"] = rows = step_log.StepLog.of(t, found.flops, **cli.step_log_options(flags))  # a named part
    if state is not None:
        t.load_state_dict(state, str(resume_from))
    elif init is not None and flags.init_optimizer:
        made += init_from.load_optimizer(t.optimizer, init, t.header())
    collectives.require_same(
        (t.progress.completed_epochs, t.progress.step_in_epoch, t.progress.global_step),
        "the checkpoint each rank resumes from; put the runs folder on storage that every node shares",
    )
    folder = run_folder.RunFolder(Path(flags.run_dir), dist.is_main, run_folder.metric_columns(task, t.ema is not None))
    record = vars(flags) | plan.summary() | {"val_samples": len(val_set), "task_info": run_folder.task_info(task)}
    record["task_metrics"] = run_folder.task_metrics(task)
    at = t.progress
    folder.start(record, at.completed_epochs, flags.overwrite, flags.tensorboard, trains, at.global_step)
    preemption = Preemption(dist)  # before workers.json: from then on, SIGTERM is agreed on
    folder.record_workers(collectives.gather_objects(os.getpid()))
    where = f"{flags.task} on {dist.world_size} process(es), device {dist.device}"
    log.info(
        "%s: %s, %s, %d steps/epoch", where, plan.describe(), cli.describe_lr(flags, plan.lr), plan.steps_per_epoch
    )
    if state is not None and trains:
        log.info(t.describe_resume(resume_from))
    notes = found.notes(plan, flags.noise_scale, t.optimizer) + ([DETERMINISTIC_NOTE] if flags.deterministic else [])
    for note in made + ([f"resumed: {plan.relayout}"] if plan.relayout else []) + notes:
        log.info(note)
    if flags.plot_lr:
        if dist.is_main:
            log.info("learning-rate schedule: %s", preview_lr(flags, plan, t.best.mode, folder.path, found.groups))
        return 0
    train_loader, val_loader = loaders.both(train_set, val_set, dist, *found.batching(), **cli.loader_options(flags))
    if flags.eval_only:
        row = step_evaluations.metrics_row(t, val_loader)
        folder.append(row, "eval.csv")  # beside the run's metrics.csv, never into it
        log.info("eval-only: %s -> %s", run_folder.describe(row), folder.path / "eval.csv")
        return 0
    return train(flags, t, plan, (train_loader, val_loader), folder, preemption, rows)


def train(flags, t: Training, plan: planning.Plan, data, folder, preemption, rows: step_log.StepLog) -> int:
    """Epochs of train -> evaluate -> decide -> checkpoint -> log, from where the state stands; then finish."""
    train_loader, val_loader = data
    rows.open(folder.path, t.progress.global_step, **cli.step_sink_options(flags))  # rank 0's steps.csv, TB, W&B, bar
    checkpoints = checkpoint.Checkpoints(
        folder.path, t.rank == 0, flags.checkpoint_every_steps, preemption, vars(flags), flags.strategy, plan.summary()
    )
    evals = step_evaluations.StepEvaluations(flags.eval_every_steps, val_loader, folder, checkpoints, rows)
    for epoch in range(t.progress.completed_epochs + 1, plan.epochs + 1):
        if plan.auto and t.progress.step_in_epoch == 0:  # --batch-trace auto: the epoch's batch, from the noise scale
            plan = auto_batch.grow(plan, t.noise.agreed_scale(t.meter.units_per_sample), t.progress.global_step, epoch)
            checkpoints.plan = plan.summary()
        steps = plan.epoch(epoch, t.rank, first_trace_step=t.progress.global_step - t.progress.step_in_epoch)
        first_step = loop.start_epoch(t, epoch, train_loader, steps, flags.seed)
        with rows.epoch(epoch, len(steps), first_step, t.progress.global_step, f"epoch {epoch}/{plan.epochs}"):
            result = loop.train_one_epoch(t, steps, train_loader, first_step, rows, evals)
        if result is None and t.stopped_early:  # --eval-every-steps: stopped mid-epoch, its checkpoint written
            break
        if result is None:
            log.info(checkpoint.preempted(f"at epoch {epoch}, step {t.progress.global_step}", flags.strategy, t))
            return failures.PREEMPTED
        loop.recompute_bn_stats(t, train_loader, steps, flags.precise_bn, plan.micro_batch, t.world_size)
        row = step_evaluations.metrics_row(t, val_loader) | result
        row |= {"world_size": t.world_size, "accum_steps": plan.accum_steps}  # the layout that ended the epoch
        improved = t.end_epoch(row)  # plateau, best and early stopping, on the monitored metric
        folder.append(row)
        checkpoints.save(t, also_best=improved)
        if plan.auto and t.rank == 0:  # the batches chosen so far: --batch-trace FILE replays them
            auto_batch.write(plan, t.progress.global_step, folder.path)
        log.info(run_folder.epoch_line(row, t.stopped_early))
        if t.stopped_early:
            break
        if preemption.agreed(final=True) and epoch < plan.epochs:
            log.info(checkpoint.preempted(f"after epoch {epoch}", flags.strategy, t))
            return failures.PREEMPTED
    if t.rank == 0:
        heartbeat.phase("figures")  # long work on rank 0 alone: not a hang
        plots.curves(folder.path)  # the LR from steps.csv: whole after a resume, in epochs when traced
    log.info(t.describe_steps())
    log.info(t.best.describe(folder.path))
    return 0


def make_plan(flags, num_train: int, world_size: int, state: dict | None = None, equal: str = "") -> planning.Plan:
    """Every number derived from the flags, the world and the data, once. A resumed checkpoint (`state`) keeps its
    run's global batch and micro-batch at any world size (in uneven shares, unless `equal` says what needs equal
    ones), and its --batch-trace auto trace goes on."""
    trace, max_global_batch = None, 0
    if flags.batch_trace == "auto":
        trace, max_global_batch = auto_batch.start(
            flags.batch_size, world_size, flags.accum_steps, num_train, flags.max_global_batch, state
        )
    elif flags.batch_trace is not None:
        trace = batch_trace.load_trace(flags.batch_trace)
    run_batch = None if flags.eval_only or flags.plot_lr else planning.recorded(state, num_train)
    plan = planning.make(
        num_train=num_train,
        world_size=world_size,
        trace=trace,
        run_batch=run_batch,
        max_global_batch=max_global_batch,
        equal_shares=equal,
        **cli.plan_options(flags),
    )
    if run_batch is not None:  # a resume into another folder must leave it something to train
        checkpoint.check_left(state, flags.resume, flags.run_dir, plan.epochs, plan.max_steps)
    return plan


def build_training(flags, task, model, found: preflight.Findings, plan: planning.Plan, dist, recipe=None) -> Training:
    """The model on its device, sharded (FSDP) or wrapped (DDP; a traced or unevenly shared run reduces its gradients
    itself), the optimizer, the schedule, precision, the noise scale's estimator, best and early stopping."""
    if flags.deterministic:
        use_deterministic_algorithms(show_warnings=dist.is_main)
    model, mesh = placement.build(  # --strategy fsdp: sharded on the checked mesh, built there once (else None)
        model, found.units, dist.device, DTYPES[flags.amp], recipe, found.mesh, **cli.model_options(flags)
    )
    optimizer = optimizers.build(model, lr=plan.lr, **found.optimizer_options(), **cli.optimizer_options(flags))
    ema = ModelEma(model, flags.model_ema, flags.model_ema_warmup, mesh) if flags.model_ema else None  # of the shards
    apex_amp = None
    if flags.amp_backend == "apex":
        from apex import amp as apex_amp

        model, optimizer = apex_amp.initialize(model, optimizer, opt_level="O1")  # before DDP
    sparse = None
    if not plan.manual_reduction and flags.strategy == "ddp":
        if found.sparse and dist.world_size > 1:  # the sparse tables' gradients: averaged apart from DDP's reducer
            sparse = SparseGradients(model, found.sparse, dist.world_size)
        model = wrap.wrap(
            model,
            dist,
            flags.sync_bn,
            apart=found.sparse if sparse else (),
            static_graph=flags.static_graph,
            bucket_cap_mb=flags.bucket_cap_mb,
            find_unused_parameters=flags.find_unused_parameters,
        )
    params = [p for p in model.parameters() if p.requires_grad]
    noise, noise_parts = None, None
    if found.measures_noise:
        noise, noise_parts = auto_batch.attach(
            dist.device, dist.world_size, params, plan.manual_reduction, found.noise_every
        )
    if flags.compile:
        model = models.compiled(model)
    mode = cli.mode_of(task, flags.monitor)
    reduction = None
    if plan.manual_reduction:  # a traced run, or uneven shares: ranks run different numbers of backwards
        adascale = AdaScale() if flags.batch_lr_rule == "adascale" else None
        slots = plan.slots * plan.uneven_shares
        reduction = TraceReduction(params, plan.micro_batch, adascale, noise, slots, flags.bucket_cap_mb)
    early_stopping = None
    if flags.early_stop_patience:
        early_stopping = EarlyStopping(flags.early_stop_patience, delta=flags.early_stop_delta, mode=mode)
    return Training(
        model,
        optimizer,
        make_schedule(flags, plan, optimizer, mode),
        task,
        found.sum_names,
        Precision(flags.amp, dist.device, apex_amp, mesh),
        dist.device,
        clip_grad_norm=flags.clip_grad_norm,
        channels_last=flags.channels_last,
        on_nonfinite=flags.on_nonfinite,
        reduction=reduction,
        sparse=sparse,
        best=Best(flags.monitor, mode),
        early_stopping=early_stopping,
        ema=ema,
        epochs=plan.epochs,
        accumulation=found.accumulation,
        noise=noise,
        noise_parts=noise_parts,
        sum_shapes=found.sum_shapes,
        scoring=found.scoring,
        rank=dist.rank,
        world_size=dist.world_size,
    )


def make_schedule(flags, plan: planning.Plan, optimizer, mode: str) -> schedule.Schedule:
    """Warmup, then the decay the flags name (or ReduceLROnPlateau on the monitored metric, `mode` min or max)."""
    steps = {"total_steps": plan.total_steps, "warmup_steps": plan.warmup_steps, "step_size": plan.step_size}
    return schedule.build(optimizer, power=plan.lr_power, plateau_mode=mode, **steps, **cli.schedule_options(flags))


def preview_lr(flags, plan: planning.Plan, mode: str, run_dir: Path, groups: tuple[dict, ...] = ()) -> Path:
    """The LR of every step of the run (with a trace, times its batch's linear/root factor; with the task's parameter
    `groups`, each group's), drawn and listed."""
    steps, mults = (plan.run_steps, plan.lr_factor_at, plan.progress_at), [g["lr_mult"] for g in groups] or [1.0]
    lrs = schedule.lrs_over_run(lambda opt: make_schedule(flags, plan, opt, mode), plan.lr, *steps, tuple(mults))
    kind = decay_kind(flags.scheduler, flags.warmup_type)
    note = " (plateau cuts depend on the monitored metric: not shown)" if kind == "plateau" else ""
    title = (
        f"{kind} after {flags.warmup_epochs:g} warmup epochs, LR {plan.lr:.4g} (--lr-scaling {flags.lr_scaling}, "
        f"{plan.describe()}){note}{plan.trace_note()}"
    )
    names = [f"{group['name']} (x{group['lr_mult']:g})" for group in groups]
    return plots.lr_schedule(lrs, plan.steps_per_epoch, run_dir, title, names)


if __name__ == "__main__":
    sys.exit(main())
