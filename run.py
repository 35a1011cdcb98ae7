"""Train a task (task.py, or --task FILE.py:NAME) with DistributedDataParallel and large-batch tricks.

    python run.py                                              # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node=2 run.py            # one node, 2 processes
    torchrun --nnodes=2 --node-rank=R --nproc_per_node=8 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT run.py   # two nodes
    python -m torch.distributed.launch --nproc_per_node=2 run.py   # the legacy launcher

The recipe: parse -> check -> join -> build -> train -> finish. `python run.py --help` lists the flags by
trick. A run writes runs/<name>/ (config.json, metrics.csv, train.log, last.pt, best.pt, curves.png).
"""

from __future__ import annotations

import sys

import config

if __name__ == "__main__":
    config.answer_early(sys.argv[1:])  # --help and flag errors answer before torch is imported

import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import batch_trace  # noqa: E402
import checkpoint  # noqa: E402
import data  # noqa: E402
import distributed  # noqa: E402
import engine  # noqa: E402
import models  # noqa: E402
import optimizers  # noqa: E402
import plan as planning  # noqa: E402
import plots  # noqa: E402
import run_folder  # noqa: E402
import schedulers  # noqa: E402
from customized_function import EarlyStopping, same_seeds, use_deterministic_algorithms  # noqa: E402
from precision import Precision  # noqa: E402

log = logging.getLogger("ddp_tricks")
PREEMPTED = 143  # exit code after SIGTERM: last.pt holds the state, `--resume auto` continues exactly
NONFINITE = 3  # exit code after a NaN/inf loss


def main(argv: list[str] | None = None) -> int:
    """Parse, check everything a user can get wrong (before any process group), join, train. The exit code."""
    launch = distributed.detect()
    try:
        args, task_class = config.parse(argv)
        launch = distributed.detect(args.local_rank)
        task = task_class(args)
        same_seeds(args.seed)  # the same data split and initial weights on every rank and at every world size
        train_set, val_set = task.datasets()
        data.check_sizes(len(train_set), len(val_set), launch.world_size)
        model = task.model()
        sum_names = engine.check_task(task, model, train_set)  # also initialises lazy modules
        trace = batch_trace.load_trace(args.batch_trace) if args.batch_trace else None
        plan = planning.make(
            num_train=len(train_set), world_size=launch.world_size, micro_batch=args.batch_size,
            accum_steps=args.accum_steps, epochs=args.epochs, seed=args.seed, base_lr=args.base_lr,
            lr_scaling=args.lr_scaling, base_batch=args.base_batch_size, warmup_epochs=args.warmup_epochs,
            trace=trace, batch_lr_rule=args.batch_lr_rule, ref_batch=args.ref_batch_size, trace_end=args.trace_end,
        )  # fmt: skip
        resume_from = checkpoint.resume_path(args.resume, args.run_dir)
        state = checkpoint.load(resume_from) if resume_from else None
        if state is not None:
            checkpoint.restore_model(model, state, str(resume_from))
        continues = args.resume is not None or args.eval_only or args.plot_lr  # these two add, never replace
        run_folder.check(Path(args.run_dir), resume=continues, overwrite=args.overwrite)
        dist = distributed.setup(launch, args.device, args.backend, args.dist_timeout)
        return train(args, task, model, sum_names, plan, dist, (train_set, val_set), state)
    except engine.NonFiniteLoss as error:  # raised on every rank together
        if launch.rank == 0:
            kept = "last.pt keeps the last good weights" if (Path(args.run_dir) / "last.pt").exists() else (
                "no checkpoint was written before it")  # fmt: skip
            config.report(f"{error}; {kept}. Lower --base-lr, add --clip-grad-norm, or pass --on-nonfinite skip",
                          Path(args.run_dir) / "train.log")  # fmt: skip
        return NONFINITE
    except config.UserError as error:
        error = config.blame(error)  # a value from --config FILE: the message names the file and the key
        if launch.rank == 0 or error.rank_specific:  # the same check fails on every rank: say it once
            config.report(str(error) if launch.rank == 0 else f"on rank {launch.rank}: {error}")
        return 2
    finally:
        distributed.cleanup()


def train(args, task, model, sum_names, plan, dist, datasets, state) -> int:
    """Build the training objects, then epochs of train -> evaluate -> decide -> checkpoint -> log."""
    train_set, val_set = datasets
    if args.deterministic:
        use_deterministic_algorithms()
    model = model.to(dist.device, memory_format=torch.channels_last if args.channels_last else torch.preserve_format)
    optimizer = optimizers.build(  # DDP and SyncBN keep these Parameter objects
        model, args.optimizer, lr=plan.lr, momentum=args.momentum, nesterov=args.nesterov,
        weight_decay=args.weight_decay, trust_coefficient=args.trust_coefficient, eps=args.epsilon,
        bn_bias_separately=args.bn_bias_separately, lars_wrap=args.lars_wrap, lookahead=args.lookahead,
        lookahead_k=args.lookahead_k, lookahead_alpha=args.lookahead_alpha,
    )  # fmt: skip
    apex_amp = None
    if args.amp_backend == "apex":
        from apex import amp as apex_amp

        model, optimizer = apex_amp.initialize(model, optimizer, opt_level="O1")  # before DDP
    if not plan.traced:  # a traced run reduces its gradients itself (batch_trace.TraceReduction)
        model = distributed.wrap(model, dist, args.sync_bn, static_graph=args.static_graph,
                                 bucket_cap_mb=args.bucket_cap_mb,
                                 find_unused_parameters=args.find_unused_parameters)  # fmt: skip
    if args.compile:
        model = models.compiled(model)
    mode = config.mode_of(task, args.monitor)
    params = [p for p in model.parameters() if p.requires_grad]
    adascale = batch_trace.AdaScale() if args.batch_lr_rule == "adascale" else None
    t = engine.Training(
        model, optimizer, make_schedule(args, plan, optimizer, mode), task, sum_names,
        Precision(args.amp, dist.device, apex_amp), dist.device, clip_grad_norm=args.clip_grad_norm,
        channels_last=args.channels_last, on_nonfinite=args.on_nonfinite,
        reduction=batch_trace.TraceReduction(params, plan.micro_batch, adascale) if plan.traced else None,
    )  # fmt: skip
    early_stopping = EarlyStopping(args.early_stop_patience, delta=args.early_stop_delta, mode=mode) if (
        args.early_stop_patience) else None  # fmt: skip
    best = {"metric": args.monitor, "value": math.inf if mode == "min" else -math.inf, "epoch": 0}
    start_epoch, start_step, start_sums = 1, 0, None
    if state is not None:
        start_epoch, start_step, start_sums, best = checkpoint.restore(
            state, t, early_stopping, dist.rank, dist.world_size, args.resume, best)  # fmt: skip
    distributed.require_same((start_epoch, start_step, t.global_step), "the checkpoint each rank resumes from; "
                             "put the runs folder on storage that every node shares")  # fmt: skip

    folder = run_folder.RunFolder(Path(args.run_dir), dist.is_main, run_folder.metric_columns(task))
    record = vars(args) | plan.summary() | {"val_samples": len(val_set), "task_info": run_folder.task_info(task)}
    folder.start(
        record, start_epoch - 1, args.overwrite, args.tensorboard, new_run=not (args.eval_only or args.plot_lr)
    )
    preemption = distributed.Preemption(dist)  # before workers.json: from then on, SIGTERM is agreed on
    folder.record_workers(distributed.gather_objects(os.getpid()))
    log.info("%s on %d process(es), device %s: %s, learning rate %.6g (--lr-scaling %s), %d steps/epoch",
             args.task, dist.world_size, dist.device, plan.describe(), plan.lr, args.lr_scaling,
             plan.steps_per_epoch)  # fmt: skip

    if args.plot_lr:
        if dist.is_main:
            log.info("learning-rate schedule: %s", preview_lr(args, plan, mode, folder.path))
        return 0
    val_loader = data.val_loader(val_set, args.val_batch_size, dist.rank, dist.world_size, dist.device, args.seed,
                                 args.workers, args.prefetch_factor)  # fmt: skip
    if args.eval_only:
        row = {"epoch": start_epoch - 1, "step": t.global_step, "lr": t.lr} | engine.evaluate(t, val_loader)
        folder.append(row, "eval.csv")  # beside the run's metrics.csv, never into it
        log.info("eval-only: %s -> %s", run_folder.describe(row), folder.path / "eval.csv")
        return 0
    train_loader = data.train_loader(train_set, dist.rank, dist.device, args.seed, args.workers, args.prefetch_factor)

    def save(next_epoch: int, step_in_epoch: int = 0, sums=None, also_best: bool = False) -> None:
        """Rank 0 writes last.pt (atomically); never over the last good weights with non-finite ones."""
        engine.raise_if_nonfinite(t, check_weights=True)
        snapshot = checkpoint.capture(t, next_epoch=next_epoch, step_in_epoch=step_in_epoch, sums=sums,
                                      early_stopping=early_stopping, best=best, rank=dist.rank,
                                      world_size=dist.world_size, config=vars(args))  # fmt: skip
        if snapshot is not None:
            checkpoint.save(snapshot, folder.path / "last.pt")
            if also_best:
                checkpoint.save(snapshot, folder.path / "best.pt")

    def after_step(steps_done: int, current_sums) -> bool:
        """Mid-epoch checkpoints, and the stop that every rank agrees on after SIGTERM."""
        stop = preemption.agreed()
        if stop or (args.checkpoint_every_steps and t.global_step % args.checkpoint_every_steps == 0):
            save(t.epoch, steps_done, current_sums())
        return stop

    for epoch in range(start_epoch, args.epochs + 1):
        first_step = start_step if epoch == start_epoch else 0
        steps = plan.epoch(epoch, dist.rank, first_trace_step=t.global_step - first_step)
        train_loader.batch_sampler.start(steps, first_step)
        data.seed_epoch(train_loader, epoch, args.seed, dist.rank)
        if first_step:
            checkpoint.restore_rng(state["rng"][dist.rank])
        t.epoch = epoch
        progress = engine.progress_bar(
            not args.no_progress and dist.is_main, len(steps), f"epoch {epoch}/{args.epochs}"
        )
        result = engine.train_one_epoch(t, steps, train_loader, first_step, start_sums if first_step else None,
                                        progress, args.log_interval, after_step)  # fmt: skip
        if progress is not None:
            progress.close()
        if result is None:
            log.info("preempted at epoch %d, step %d: last.pt written; continue with --resume auto", epoch,
                     t.global_step)  # fmt: skip
            return PREEMPTED
        engine.recompute_bn_stats(t, train_loader, steps, args.precise_bn, plan.micro_batch, dist.world_size)
        row = {"epoch": epoch, "step": t.global_step, "lr": t.lr} | result | engine.evaluate(t, val_loader)
        monitored = row[args.monitor]  # reduced across ranks: every rank takes the same decisions
        t.schedule.epoch_end(monitored)
        improved = monitored < best["value"] if mode == "min" else monitored > best["value"]
        if improved:
            best = {"metric": args.monitor, "value": monitored, "epoch": epoch,
                    "val": {k: v for k, v in row.items() if k.startswith("val_")}}  # fmt: skip
        if early_stopping is not None:
            early_stopping(monitored)
        stop = early_stopping is not None and early_stopping.early_stop
        folder.append(row)
        save(epoch + 1, also_best=improved)
        log.info("epoch %d: %s | lr %.4g | %.1fs, %.0f samples/s%s", epoch, run_folder.describe(row), row["lr"],
                 row["epoch_seconds"], row["samples_per_second"], " (early stop)" if stop else "")  # fmt: skip
        if stop:
            break
        if preemption.agreed(final=True) and epoch < args.epochs:
            log.info("preempted after epoch %d: last.pt written; continue with --resume auto", epoch)
            return PREEMPTED

    if dist.is_main:
        plots.curves(folder.path, t.lr_log, plan.steps_per_epoch)
    others = ", ".join(f"{k} {v:.4f}" for k, v in best.get("val", {}).items() if k != best["metric"])
    log.info("best %s %.4f at epoch %d (%s); run folder: %s", best["metric"], best["value"], best["epoch"], others,
             folder.path)  # fmt: skip
    return 0


def make_schedule(args, plan, optimizer, mode: str) -> schedulers.Schedule:
    return schedulers.build(
        optimizer, total_steps=plan.total_steps, warmup_steps=plan.warmup_steps,
        kind=schedulers.decay_kind(args.scheduler, args.warmup_type), end_lr=args.end_lr, power=args.lr_power,
        step_size=round(args.step_epochs * plan.steps_per_epoch), gamma=args.step_gamma,
        plateau_factor=args.plateau_factor, plateau_patience=args.plateau_patience, plateau_mode=mode,
    )  # fmt: skip


def preview_lr(args, plan, mode: str, run_dir: Path) -> Path:
    """The LR of every step of the run (with a trace, times its batch's linear/root factor), drawn and listed."""
    lrs = schedulers.lrs_over_run(lambda opt: make_schedule(args, plan, opt, mode), plan.lr, plan.total_steps,
                                  plan.lr_factor_at)  # fmt: skip
    kind = schedulers.decay_kind(args.scheduler, args.warmup_type)
    note = " (plateau cuts depend on the monitored metric: not shown)" if kind == "plateau" else ""
    if plan.traced:
        note += f", batch trace with the {plan.batch_lr_rule} rule" + (
            " (AdaScale's gain depends on the gradients: not shown)" if plan.batch_lr_rule == "adascale" else ""
        )
    title = (f"{kind} after {args.warmup_epochs:g} warmup epochs, LR {plan.lr:.4g} (--lr-scaling {args.lr_scaling}, "
             f"{plan.describe()}){note}")  # fmt: skip
    return plots.lr_schedule(lrs, plan.steps_per_epoch, run_dir, title)


if __name__ == "__main__":
    sys.exit(main())
