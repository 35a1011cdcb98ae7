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
import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

import checkpoint
import config
import data
import distributed
import models
import plots
import schedulers
from customized_function import EarlyStopping, same_seeds
from engine import AMP_DTYPES, Training, evaluate, train_one_epoch
from lamb import LAMB
from lars import LARS, LARSWrapper, parameter_groups
from lookahead import Lookahead

log = logging.getLogger("ddp_tricks")
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
        resume_from = checkpoint.resume_path(cfg.resume, cfg.run_dir)
        state = checkpoint.load(resume_from) if resume_from else None
        check_run_dir_writable(Path(cfg.run_dir))
        dist = distributed.setup(launch, cfg.device, cfg.backend, cfg.dist_timeout)
        return train(cfg, dist, datasets, state)
    except config.UserError as error:
        where = "" if launch.rank == 0 else f" on rank {launch.rank}"
        print(f"error{where}: {error}", file=sys.stderr)
        return 2
    finally:
        distributed.cleanup()


def train(cfg: argparse.Namespace, dist: distributed.Dist, datasets: data.Data, state: dict | None) -> int:
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
    model = wrap_model(cfg, model, dist)
    torch.manual_seed(cfg.seed + dist.rank)  # augmentation and dropout differ between ranks

    train_loader = data.train_loader(cfg, datasets.train_set, dist.rank, dist.world_size, dist.device)
    val_loader = data.val_loader(cfg, datasets.val_set, dist.rank, dist.world_size, dist.device)
    steps_per_epoch = math.ceil(data.micro_batches_per_epoch(train_loader) / cfg.accum_steps)
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
    )
    early_stopping = (
        EarlyStopping(cfg.early_stop_patience, delta=cfg.early_stop_delta) if cfg.early_stop_patience else None
    )
    best = {"val_loss": math.inf, "val_acc": 0.0}
    start_epoch = 1
    if state is not None:
        start_epoch = restore(state, training, early_stopping, best, cfg)

    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(vars(cfg) | {"world_size": dist.world_size}, indent=2))
        keep_metrics_through(run_dir / "metrics.csv", start_epoch - 1)
    log.info(
        "%s on %d process(es), device %s: global batch %d, learning rate %.6g (--lr-scaling %s), %d steps/epoch",
        cfg.model,
        dist.world_size,
        dist.device,
        cfg.global_batch_size,
        cfg.effective_lr,
        cfg.lr_scaling,
        steps_per_epoch,
    )

    if cfg.eval_only:
        row = {"epoch": start_epoch - 1, "step": training.global_step} | evaluate(training, val_loader)
        if dist.is_main:
            append_metrics(run_dir / "metrics.csv", row | {"lr": current_lr(training)})
        log.info("eval-only: val_loss %.4f, val_acc %.2f%% -> %s", row["val_loss"], 100 * row["val_acc"], run_dir)
        return 0

    for epoch in range(start_epoch, cfg.epochs + 1):
        train_loader.sampler.set_epoch(epoch)
        progress = progress_bar(cfg, dist, steps_per_epoch, f"epoch {epoch}/{cfg.epochs}")
        row = {"epoch": epoch} | train_one_epoch(training, train_loader, progress, cfg.log_interval)
        if progress is not None:
            progress.close()
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
            snapshot = checkpoint_state(training, cfg, epoch, early_stopping, best)
            checkpoint.save(snapshot, run_dir / "last.pt")
            if improved:
                checkpoint.save(snapshot, run_dir / "best.pt")
        log.info(
            "epoch %d: train loss %.4f acc %.2f%% | val loss %.4f acc %.2f%% | lr %.4g | %.1fs, %.0f samples/s%s",
            epoch,
            row["train_loss"],
            100 * row["train_acc"],
            row["val_loss"],
            100 * row["val_acc"],
            row["lr"],
            row["epoch_seconds"],
            row["samples_per_second"],
            " (early stop)" if stop else "",
        )
        if stop:
            break

    if dist.is_main:
        plots.curves(run_dir)
    log.info(
        "best validation accuracy %.2f%% (val loss %.4f); run folder: %s",
        100 * best["val_acc"],
        best["val_loss"],
        run_dir,
    )
    return 0


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
    if dist.enabled:
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


def checkpoint_state(training: Training, cfg: argparse.Namespace, epoch: int, early_stopping, best: dict) -> dict:
    """Everything needed to continue after `epoch`: only tensors and plain containers (weights_only loads)."""
    return {
        "model": training.raw_model.state_dict(),
        "optimizer": training.optimizer.state_dict(),
        "optimizer_name": describe_optimizer(training.optimizer),
        "schedule": training.schedule.state_dict(),
        "scaler": training.scaler.state_dict() if training.scaler is not None else None,
        "early_stopping": early_stopping.state_dict() if early_stopping is not None else None,
        "epoch": epoch,
        "global_step": training.global_step,
        "skipped_steps": training.skipped_steps,
        "best": dict(best),
        "config": {k: v for k, v in vars(cfg).items() if isinstance(v, (str, int, float, bool, type(None)))},
        "torch_version": str(torch.__version__),
    }


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


def restore(state: dict, training: Training, early_stopping, best: dict, cfg: argparse.Namespace) -> int:
    """Put the optimizer, schedule, scaler and counters back; return the first epoch still to train."""
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
    training.global_step = state["global_step"]
    training.skipped_steps = state.get("skipped_steps", 0)
    best.update(state["best"])
    return state["epoch"] + 1


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
