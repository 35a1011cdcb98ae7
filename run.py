"""Train a classifier with DistributedDataParallel and large-batch tricks. The one entry point.

    python run.py                                              # one process (CPU or one GPU)
    torchrun --standalone --nproc_per_node=2 run.py            # one node, 2 processes
    torchrun --nnodes=2 --node-rank=R --nproc_per_node=8 \\
        --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT run.py   # two nodes
    python -m torch.distributed.launch --nproc_per_node=2 run.py   # the legacy launcher

`python run.py --help` lists the flags by trick. A run writes runs/<name>/ (config.json, metrics.csv,
train.log, last.pt, best.pt, curves.png).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

import batch_trace
import checkpoint
import config
import data
import distributed
import models
import plots
import schedulers
from customized_function import EarlyStopping, same_seeds
from engine import AMP_DTYPES, NonFiniteLoss, Training, evaluate, raise_if_nonfinite, train_one_epoch
from lamb import LAMB
from lars import LARS, LARSWrapper, parameter_groups
from lookahead import Lookahead

log = logging.getLogger("ddp_tricks")
PREEMPTED = 143  # exit code after SIGTERM: last.pt holds the state, `--resume auto` continues exactly
NONFINITE = 3  # exit code after a NaN/inf loss: last.pt keeps the last good weights
METRICS = [
    "epoch",
    "step",
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "lr",
    "epoch_seconds",
    "samples_per_second",
    "skipped_steps",
]


def main(argv: list[str] | None = None) -> int:
    """Parse, check everything a user can get wrong, join the processes, train. Returns the exit code."""
    launch = distributed.detect()
    try:
        cfg = config.parse(argv)
        launch = distributed.detect(cfg.local_rank)
        models.check_name(cfg.model)
        datasets = data.load(cfg)
        data.check_sizes(datasets, launch.world_size)
        trace, trace_steps = batch_trace.check_run(cfg, len(datasets.train_set)) if cfg.batch_trace else (None, 0)
        resume_from = checkpoint.resume_path(cfg.resume, cfg.run_dir)
        state = checkpoint.load(resume_from) if resume_from else None
        check_run_dir_writable(Path(cfg.run_dir))
        dist = distributed.setup(launch, cfg.device, cfg.backend, cfg.dist_timeout)
        return train(cfg, dist, datasets, state, trace, trace_steps)
    except NonFiniteLoss as error:  # raised on every rank together
        if launch.rank == 0:
            print(f"error: {error}; last.pt keeps the last good weights. Lower --base-lr, add --clip-grad-norm, "
                  "or pass --on-nonfinite skip", file=sys.stderr)  # fmt: skip
        return NONFINITE
    except config.UserError as error:
        where = "" if launch.rank == 0 else f" on rank {launch.rank}"
        print(f"error{where}: {error}", file=sys.stderr)
        return 2
    finally:
        distributed.cleanup()


def train(
    cfg: argparse.Namespace, dist: distributed.Dist, datasets: data.Data, state: dict | None,
    trace: list[int] | None = None, trace_steps: int = 0,
) -> int:  # fmt: skip
    run_dir = Path(cfg.run_dir)
    setup_logging(run_dir, dist.is_main)

    same_seeds(cfg.seed)  # the same initial weights on every rank and at every world size
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    model = models.build(cfg.model, datasets.in_channels, datasets.num_classes, cfg.init)
    if state is not None:
        load_model_state(model, state, cfg)
    model = model.to(dist.device, memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format)

    cfg.global_batch_size = cfg.batch_size * dist.world_size * cfg.accum_steps
    cfg.effective_lr = scaled_lr(cfg.base_lr, cfg.lr_scaling, cfg.global_batch_size, cfg.base_batch_size)
    optimizer = build_optimizer(cfg, model, cfg.effective_lr)  # DDP and SyncBN keep these Parameter objects
    apex_amp = None
    if cfg.amp_backend == "apex":
        from apex import amp as apex_amp

        model, optimizer = apex_amp.initialize(model, optimizer, opt_level="O1")
    model = wrap_model(cfg, model, dist)  # each epoch's randomness: data.start_epoch, from (seed, rank, epoch)

    train_loader = data.train_loader(cfg, datasets.train_set, dist.rank, dist.world_size, dist.device)
    val_loader = data.val_loader(cfg, datasets.val_set, dist.rank, dist.world_size, dist.device)
    steps_per_epoch = math.ceil(len(train_loader) / cfg.accum_steps)
    if trace is not None:
        steps_per_epoch = max(1, round(trace_steps / cfg.epochs))  # what the schedule counts epochs in
        cfg.ref_batch_size = cfg.ref_batch_size or trace[0]
    training = Training(
        model=model,
        optimizer=optimizer,
        schedule=schedulers.build(cfg, optimizer, steps_per_epoch),
        device=dist.device,
        amp_dtype=None if apex_amp is not None else AMP_DTYPES[cfg.amp],
        scaler=torch.amp.GradScaler(dist.device.type) if cfg.amp == "fp16" and apex_amp is None else None,
        apex_amp=apex_amp,
        accum_steps=cfg.accum_steps,
        clip_grad_norm=cfg.clip_grad_norm,
        label_smoothing=cfg.label_smoothing,
        channels_last=cfg.channels_last,
        on_nonfinite=cfg.on_nonfinite,
        adascale=batch_trace.AdaScale() if cfg.batch_lr_rule == "adascale" else None,
    )
    early_stopping = (
        EarlyStopping(cfg.early_stop_patience, delta=cfg.early_stop_delta) if cfg.early_stop_patience else None
    )
    best = {"val_loss": math.inf, "val_acc": 0.0}
    start_epoch, start_step, start_sums = 1, 0, None
    if state is not None:
        start_epoch, start_step, start_sums = restore(state, training, early_stopping, best, cfg, dist)

    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(vars(cfg) | {"world_size": dist.world_size}, indent=2))
        keep_metrics_through(run_dir / "metrics.csv", start_epoch - 1)
    record_workers(run_dir, dist)
    log.info(
        "%s on %d process(es), device %s: global batch %d, learning rate %.6g (--lr-scaling %s), %d steps/epoch",
        cfg.model, dist.world_size, dist.device, cfg.global_batch_size, cfg.effective_lr, cfg.lr_scaling,
        steps_per_epoch,
    )  # fmt: skip

    if cfg.plot_lr:
        if dist.is_main:
            path = preview_lr(cfg, steps_per_epoch, run_dir, trace, trace_steps)
            log.info("learning-rate schedule: %s", path)
        return 0

    if cfg.eval_only:
        row = {"epoch": start_epoch - 1, "step": training.global_step} | evaluate(training, val_loader)
        if dist.is_main:
            append_metrics(run_dir / "metrics.csv", row | {"lr": current_lr(training)})
        log.info("eval-only: val_loss %.4f, val_acc %.2f%% -> %s", row["val_loss"], 100 * row["val_acc"], run_dir)
        return 0

    preemption = distributed.Preemption(dist)
    tensorboard = tensorboard_writer(run_dir) if cfg.tensorboard and dist.is_main else None

    def after_step(steps_done: int, current_sums) -> bool:
        """Mid-epoch checkpoints, and the stop that every rank agrees on after SIGTERM."""
        stop = preemption.agreed()
        every = cfg.checkpoint_every_steps
        if stop or (every and training.global_step % every == 0):
            save_last(run_dir, training, cfg, dist, training.epoch, steps_done, current_sums(), early_stopping, best)
        return stop

    for epoch in range(start_epoch, cfg.epochs + 1):
        first_step = start_step if epoch == start_epoch else 0
        data.start_epoch(
            train_loader, epoch, cfg.seed, dist.rank, skip_samples=first_step * cfg.accum_steps * cfg.batch_size
        )
        if first_step:
            restore_rng(state["rng"][dist.rank])
        training.epoch = epoch

        progress = progress_bar(cfg, dist, steps_per_epoch, f"epoch {epoch}/{cfg.epochs}")
        if trace is not None:
            result = batch_trace.train_trace_epoch(
                training, datasets.train_set, trace, epoch, cfg, dist.rank, dist.world_size, training.adascale
            )
        else:
            result = train_one_epoch(
                training,
                train_loader,
                progress,
                cfg.log_interval,
                first_step,
                start_sums if first_step else None,
                after_step,
            )
        if progress is not None:
            progress.close()
        if result is None:
            log.info("preempted at epoch %d, step %d: last.pt written; continue with --resume auto", epoch,
                     training.global_step)  # fmt: skip
            return PREEMPTED
        row = {"epoch": epoch} | result
        row |= evaluate(training, val_loader) | {"step": training.global_step, "lr": current_lr(training)}
        training.schedule.epoch_end(row["val_loss"])  # the same reduced value on every rank
        improved = row["val_loss"] < best["val_loss"]
        if improved:
            best.update(val_loss=row["val_loss"], val_acc=row["val_acc"])
        if early_stopping is not None:
            early_stopping(row["val_loss"])  # the reduced loss: every rank stops after the same epoch
        stop = early_stopping is not None and early_stopping.early_stop
        if dist.is_main:
            append_metrics(run_dir / "metrics.csv", row)
        if tensorboard is not None:
            for key in METRICS[2:]:
                tensorboard.add_scalar(key, row[key], epoch)
            tensorboard.flush()
        save_last(run_dir, training, cfg, dist, epoch + 1, 0, None, early_stopping, best, also_best=improved)
        log.info(
            "epoch %d: train loss %.4f acc %.2f%% | val loss %.4f acc %.2f%% | lr %.4g | %.1fs, %.0f samples/s%s",
            epoch, row["train_loss"], 100 * row["train_acc"], row["val_loss"], 100 * row["val_acc"], row["lr"],
            row["epoch_seconds"], row["samples_per_second"], " (early stop)" if stop else "",
        )  # fmt: skip
        if stop:
            break
        if preemption.agreed(final=True) and epoch < cfg.epochs:
            log.info("preempted after epoch %d: last.pt written; continue with --resume auto", epoch)
            return PREEMPTED

    if dist.is_main:
        plots.curves(run_dir, training.lr_trace, steps_per_epoch)
    log.info(
        "best validation accuracy %.2f%% (val loss %.4f); run folder: %s",
        100 * best["val_acc"],
        best["val_loss"],
        run_dir,
    )
    return 0


def preview_lr(
    cfg: argparse.Namespace, steps_per_epoch: int, run_dir: Path, trace: list[int] | None = None, trace_steps: int = 0
) -> Path:
    """Step a copy of the run's schedule over the whole run, on a throwaway optimizer; draw it, list it.

    With a batch trace, each step's LR includes the linear/root rule for that step's batch size.
    """
    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.effective_lr)
    schedule = schedulers.build(cfg, probe, steps_per_epoch)
    lrs = []
    for step in range(trace_steps if trace else cfg.epochs * steps_per_epoch):
        factor = 1.0
        if trace and cfg.batch_lr_rule in ("linear", "root"):
            batch = batch_trace.batch_at(trace, step, repeat_last=True)
            factor = batch_trace.lr_factor(cfg.batch_lr_rule, batch, cfg.ref_batch_size)
        lrs.append(probe.param_groups[0]["lr"] * factor)
        probe.step()
        schedule.step()
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "lr_schedule.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "lr"])
        writer.writerows(enumerate(lrs, start=1))
    kind = schedulers.decay_kind(cfg)
    note = " (plateau cuts depend on the validation loss: not shown)" if kind == "plateau" else ""
    if trace:
        note += f", batch trace with the {cfg.batch_lr_rule} rule" + (
            " (AdaScale's gain depends on the gradients: not shown)" if cfg.batch_lr_rule == "adascale" else ""
        )
    title = (f"{kind} after {cfg.warmup_epochs:g} warmup epochs, LR {cfg.effective_lr:.4g} "
             f"(--lr-scaling {cfg.lr_scaling}, global batch {cfg.global_batch_size}){note}")  # fmt: skip
    return plots.lr_schedule(lrs, steps_per_epoch, run_dir / "lr_schedule.png", title)


def tensorboard_writer(run_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run_dir / "tb"))


def setup_logging(run_dir: Path, is_main: bool) -> None:
    """Rank 0 logs to stdout and run_dir/train.log; other ranks only report errors."""
    log.handlers.clear()
    log.propagate = False
    if not is_main:
        log.setLevel(logging.ERROR)
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    log.setLevel(logging.INFO)
    for handler in (logging.StreamHandler(sys.stdout), logging.FileHandler(run_dir / "train.log")):
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)


def check_run_dir_writable(run_dir: Path) -> None:
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK) or not existing.is_dir():
        raise config.UserError(f"cannot write the run folder {str(run_dir)!r}: choose a writable --runs-dir")


def wrap_model(cfg: argparse.Namespace, model: torch.nn.Module, dist: distributed.Dist) -> torch.nn.Module:
    """SyncBatchNorm and DDP in a distributed run; torch.compile on request."""
    if dist.enabled and not cfg.batch_trace:  # a traced run reduces its gradients itself (batch_trace.trace_step)
        if cfg.sync_bn:
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = DistributedDataParallel(
            model,
            device_ids=[dist.device] if dist.device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            static_graph=cfg.static_graph,
            bucket_cap_mb=cfg.bucket_cap_mb,
            find_unused_parameters=cfg.find_unused_parameters,
        )
    if cfg.compile:
        model = compiled(model)
    return model


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """torch.compile; where it cannot work, one warning and eager mode (now, or at the first failing call)."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True  # a graph that fails to compile runs eagerly instead
    try:
        return torch.compile(model)
    except Exception as error:  # torch.compile refuses some platforms outright
        log.warning("warning: --compile is not available here (%s); training in eager mode", error)
        return model


def scaled_lr(base_lr: float, rule: str, global_batch: int, base_batch: int) -> float:
    """The LR for the global batch: keep, linear (x batch ratio) or sqrt (x its square root)."""
    ratio = global_batch / base_batch
    return base_lr * {"keep": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


def build_optimizer(cfg: argparse.Namespace, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The optimizer the flags name, LARSWrapper around it and Lookahead on top when asked."""
    groups = parameter_groups(model, cfg.weight_decay, cfg.bn_bias_separately)
    if cfg.optimizer == "sgd":
        optimizer = torch.optim.SGD(
            groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
        )
    elif cfg.optimizer == "adam":
        optimizer = torch.optim.Adam(groups, lr=lr, weight_decay=cfg.weight_decay)
    elif cfg.optimizer == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=cfg.weight_decay)
    elif cfg.optimizer == "lars":
        optimizer = LARS(
            groups,
            lr=lr,
            momentum=cfg.momentum,
            weight_decay=cfg.weight_decay,
            trust_coefficient=cfg.trust_coefficient,
            eps=cfg.epsilon,
            nesterov=cfg.nesterov,
        )
    else:
        optimizer = LAMB(groups, lr=lr, weight_decay=cfg.weight_decay)
    if cfg.lars_wrap:
        optimizer = LARSWrapper(optimizer, trust_coefficient=cfg.trust_coefficient, eps=cfg.epsilon)
    if cfg.lookahead:
        optimizer = Lookahead(optimizer, k=cfg.lookahead_k, alpha=cfg.lookahead_alpha)
    return optimizer


def progress_bar(cfg: argparse.Namespace, dist: distributed.Dist, total: int, description: str):
    if cfg.no_progress or not dist.is_main:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=description, leave=False, dynamic_ncols=True, file=sys.stderr)


def current_lr(training: Training) -> float:
    return training.optimizer.param_groups[0]["lr"]


def save_last(
    run_dir: Path,
    training: Training,
    cfg: argparse.Namespace,
    dist: distributed.Dist,
    next_epoch: int,
    step_in_epoch: int,
    sums: torch.Tensor | None,
    early_stopping,
    best: dict,
    also_best: bool = False,
) -> None:
    """Every rank hands over its RNG state (and mid-epoch, its running sums); rank 0 writes last.pt atomically.

    A non-finite loss or weight stops every rank here, before such weights can replace the last good ones.
    """
    raise_if_nonfinite(training, check_weights=True)
    rng = distributed.gather_objects(rng_state())
    all_sums = distributed.gather_from_ranks(sums.to(training.device)).cpu() if sums is not None else None
    if not dist.is_main:
        return
    snapshot = {
        "model": training.raw_model.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "optimizer_name": describe_optimizer(training.optimizer),
        "schedule": training.schedule.state_dict(),
        "scaler": training.scaler.state_dict() if training.scaler is not None else None,
        "early_stopping": early_stopping.state_dict() if early_stopping is not None else None,
        "adascale": training.adascale.state_dict() if training.adascale is not None else None,
        "epoch": next_epoch - 1,  # epochs completed
        "step_in_epoch": step_in_epoch,  # optimizer steps already taken in epoch `epoch + 1`
        "epoch_sums": all_sums,  # each rank's running (loss, correct, samples) of that epoch, mid-epoch only
        "global_step": training.global_step,
        "skipped_steps": training.skipped_steps,
        "best": dict(best),
        "rng": rng,
        "world_size": dist.world_size,
        "config": {k: v for k, v in vars(cfg).items() if isinstance(v, (str, int, float, bool, type(None)))},
        "torch_version": str(torch.__version__),
    }
    checkpoint.save(snapshot, run_dir / "last.pt")
    if also_best:
        checkpoint.save(snapshot, run_dir / "best.pt")


def rng_state() -> dict:
    """This process's random generators, as tensors and plain values (safe for weights_only loading)."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(keys), gauss],
        "numpy": [name, torch.from_numpy(np_keys.astype(np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def restore_rng(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def record_workers(run_dir: Path, dist: distributed.Dist) -> None:
    """run_dir/workers.json: each rank's process id (for operators, and the restart test)."""
    pids = distributed.gather_objects(os.getpid())
    if dist.is_main:
        (run_dir / "workers.json").write_text(
            json.dumps({"pids": pids, "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")})
        )


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """`Lookahead(LARSWrapper(SGD))`: the optimizer and the wrappers around it."""
    inner = getattr(optimizer, "optimizer", None)
    return type(optimizer).__name__ + (f"({describe_optimizer(inner)})" if inner is not None else "")


def load_model_state(model: torch.nn.Module, state: dict, cfg: argparse.Namespace) -> None:
    try:
        model.load_state_dict(state["model"])
    except RuntimeError:
        saved = state.get("config", {}).get("model", "another model")
        raise config.UserError(
            f"checkpoint {cfg.resume!r} holds weights of {saved!r} that do not fit --model {cfg.model} "
            f"on --dataset {cfg.dataset}; resume with the flags it was trained with"
        ) from None


def restore(
    state: dict, training: Training, early_stopping, best: dict, cfg: argparse.Namespace, dist: distributed.Dist
) -> tuple[int, int, torch.Tensor | None]:
    """Put the optimizer, schedule, scaler and counters back; return where to continue: the epoch, the steps
    already taken in it, and this rank's running sums of it."""
    saved, ours = state.get("optimizer_name"), describe_optimizer(training.optimizer)
    if saved != ours:
        raise config.UserError(
            f"checkpoint {cfg.resume!r} was trained with {saved}, these flags build {ours}; "
            "resume with the optimizer flags it was trained with"
        )
    try:
        training.optimizer.load_state_dict(state["optimizer"])
        training.schedule.load_state_dict(state["schedule"])
    except (ValueError, KeyError, RuntimeError) as error:
        saved = state.get("config", {}).get("optimizer", "another optimizer")
        raise config.UserError(
            f"checkpoint {cfg.resume!r} holds the state of {saved!r} that does not fit --optimizer {cfg.optimizer} "
            f"with these flags ({str(error).splitlines()[0][:80]}); resume with the flags it was trained with"
        ) from None
    if training.scaler is not None and state.get("scaler"):
        training.scaler.load_state_dict(state["scaler"])
    if early_stopping is not None and state.get("early_stopping"):
        early_stopping.load_state_dict(state["early_stopping"])
    if training.adascale is not None and state.get("adascale"):
        training.adascale.load_state_dict(state["adascale"])
    training.global_step = state["global_step"]
    training.skipped_steps = state.get("skipped_steps", 0)
    best.update(state["best"])
    step_in_epoch = state.get("step_in_epoch", 0)
    if step_in_epoch and state.get("world_size") != dist.world_size:
        raise config.UserError(
            f"checkpoint {cfg.resume!r} was written mid-epoch by {state.get('world_size')} processes; "
            f"resume it with that many (this run has {dist.world_size})"
        )
    sums = state["epoch_sums"][dist.rank] if step_in_epoch else None
    return state["epoch"] + 1, step_in_epoch, sums


def keep_metrics_through(path: Path, last_epoch: int) -> None:
    """On resume, drop rows of epochs after the checkpoint (they are about to be trained again)."""
    if not path.exists():
        return
    with open(path, newline="") as f:
        rows = [row for row in csv.DictReader(f) if int(row["epoch"]) <= last_epoch]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=METRICS)
        writer.writeheader()
        writer.writerows(rows)


def append_metrics(path: Path, row: dict) -> None:
    new = not path.exists()
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=METRICS, restval="nan", extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


if __name__ == "__main__":
    sys.exit(main())
