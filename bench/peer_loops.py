"""The loops bench/peers.py compares, each in the process (or rank) that trains it: the same model (the built-in toy
CNN), data (the digits' training split 4 times over), batch, optimizer and precision, through a bare loop, the
template, Lightning Fabric, Accelerate and Lightning's Trainer. `worker(args)` runs the one named by `args.worker`
and writes its timing as JSON to `args.out`; bench/peers.py launches it (`--worker LOOP`) and compares.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOOPS = ("bare", "bare-loader", "bare-loader-no-buffer-sync", "template", "template-no-noise", "fabric", "accelerate",
         "trainer")  # fmt: skip
ONLY_DDP = ("bare-loader-no-buffer-sync", "template-no-noise", "template-noise-every-step")  # not at 1 process
EVERY_STEP = "template-noise-every-step"  # --loops only: the noise scale measured on every step (the old default)
NAMES = {
    "bare": "bare loop, plain DataLoader",
    "bare-loader": "bare loop on the template's loader",
    "bare-loader-no-buffer-sync": "bare loop on the template's loader, no per-step buffer broadcast",
    "template": "template (exact epoch loss + accuracy, a row every 20 steps; noise scale at 2 processes)",
    "template-no-noise": "template, --no-noise-scale",
    EVERY_STEP: "template, --noise-scale-every 1",
    "fabric": "Lightning Fabric",
    "accelerate": "Hugging Face Accelerate",
    "trainer": "Lightning Trainer, logging loss + accuracy per epoch",
}
BATCH, LR, MOMENTUM, WEIGHT_DECAY, COPIES, SEED = 32, 0.01, 0.9, 5e-4, 4, 0


# ---------------------------------------------------------------- the worker: one loop, in this process (or rank)


def digits_x4():
    """The built-in task's training split repeated COPIES times (longer epochs), and its validation split."""
    from ddp_tricks.data import images, loaders

    train, val = images.digits()
    return loaders.InMemoryDataset(train.inputs.repeat(COPIES, 1, 1, 1), train.targets.repeat(COPIES)), val


def plain_digits_x4():
    """The same samples as a plain TensorDataset, for the loops that use a plain DataLoader (one sample at a time,
    collated), as their users write them."""
    from torch.utils.data import TensorDataset

    train, _ = digits_x4()
    return TensorDataset(train.inputs, train.targets)


def toy_model():
    import torch

    from ddp_tricks import models

    torch.manual_seed(SEED)
    return models.build("toy", 1, 10, "default")


def sgd(params):
    import torch

    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def leave_group() -> None:
    """The process group destroyed before the interpreter ends (else gloo's threads may abort the exit)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class Clock:
    """The wall time of each epoch, and this process's CPU time (all its threads): `tick()` at each epoch's start and
    once after the last. On a busy machine the CPU time moves less than the wall time."""

    def __init__(self):
        self.marks: list[float] = []
        self.cpu: list[float] = []
        self.steps: list[int] = []

    def tick(self, steps: int = 0) -> None:
        self.marks.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if len(self.marks) > 1:
            self.steps.append(steps)

    def result(self, warmup: int, world: int) -> dict:
        """The median time per step of the epochs after `warmup`, with the steps per epoch and the world size (the
        driver checks that every loop ran the same steps on as many processes)."""
        seconds = [b - a for a, b in zip(self.marks, self.marks[1:])][warmup:]
        ms = 1e3 * statistics.median(s / n for s, n in zip(seconds, self.steps[warmup:]))
        cpu = [b - a for a, b in zip(self.cpu, self.cpu[1:])][warmup:]
        cpu_ms = 1e3 * statistics.median(s / n for s, n in zip(cpu, self.steps[warmup:]))
        return {"ms_per_step": ms, "cpu_ms_per_step": cpu_ms, "steps_per_epoch": self.steps[-1], "world_size": world}


def bare_worker(args, template_loader: bool, sync_buffers: bool = True) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from ddp_tricks import plan as planning
    from ddp_tricks.data import loaders
    from ddp_tricks.distributed.wrap import buffer_sync

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    train_set = digits_x4()[0] if template_loader else plain_digits_x4()
    model = toy_model()
    if world > 1 and sync_buffers:
        model = DDP(model)
    elif world > 1:
        model = DDP(model, **buffer_sync(False))  # the option's name in this torch
    optimizer = sgd(model.parameters())
    criterion = torch.nn.CrossEntropyLoss()
    if template_loader:
        the_plan = planning.make(num_train=len(train_set), world_size=world, micro_batch=BATCH, accum_steps=1,
                                 epochs=1, seed=SEED, base_lr=LR, lr_scaling="keep", base_batch=BATCH,
                                 warmup_epochs=0)  # fmt: skip
        loader = loaders.train_loader(train_set, rank, torch.device("cpu"), seed=SEED)
    else:
        sampler = DistributedSampler(train_set, seed=SEED) if world > 1 else None
        loader = DataLoader(train_set, batch_size=BATCH, shuffle=sampler is None, sampler=sampler)
    clock = Clock()
    model.train()
    for epoch in range(args.warmup + args.epochs):
        if template_loader:
            loader.batch_sampler.start(the_plan.epoch(epoch + 1, rank))
        elif world > 1:
            sampler.set_epoch(epoch)
        clock.tick(len(loader))
        for inputs, targets in loader:
            loss = criterion(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    clock.tick(len(loader))
    return clock.result(args.warmup, world) if rank == 0 else None


def built_template(epochs: int, noise_scale: bool = True, every: int | None = None, extra=()):
    """The template as run.py builds it (check, join, build), with the watchdog's heartbeats, the SIGTERM agreement and
    the default per-step rows (steps.csv every --log-interval steps: their gradient norm and one all-gather each):
    (t, its plan, its training loader, `epoch(number)` that trains one epoch as run.py's loop does, its DistInfo).
    `extra`: more run.py flags (e.g. --log-interval 0). No evaluation between epochs: only the training is timed."""
    sys.path.insert(0, str(REPO))
    import run
    from customized_function import same_seeds
    from ddp_tricks import cli
    from ddp_tricks.data import loaders
    from ddp_tricks.distributed import heartbeat, launch
    from ddp_tricks.distributed.preemption import Preemption
    from ddp_tricks.training import loop, preflight, step_log

    argv = ["--optimizer", "sgd", "-b", str(BATCH), "-l", str(LR), "--lr-scaling", "keep", "--no-progress",
            "-e", str(epochs), "-s", str(SEED)]  # fmt: skip
    argv += [] if noise_scale else ["--no-noise-scale"]
    argv += [] if every is None else ["--noise-scale-every", str(every)]
    argv += list(extra)
    flags, task_class = cli.parse(argv)
    task = task_class(flags)
    process = launch.detect()
    same_seeds(flags.seed)
    task.datasets()  # the task learns the data's shape and classes from its own datasets
    train_set, val_set = digits_x4()
    model = task.model()
    setup = preflight.Setup(process.world_size, nccl=False, **cli.check_options(flags))
    plan, found = preflight.check(
        task,
        model,
        train_set,
        setup,
        lambda equal: run.make_plan(flags, len(train_set), process.world_size, None, equal),
    )
    folder = tempfile.mkdtemp(prefix="peers-run-")  # the watchdog's heartbeats and steps.csv, as run.py writes them
    heartbeat.configure(folder, process.world_size, **cli.hang_options(flags))
    dist = launch.setup(process, flags.device, flags.backend, flags.dist_timeout, False, flags.sigterm_grace)
    t = run.build_training(flags, task, model, found, plan, dist)
    train_loader, _ = loaders.both(train_set, val_set, dist, found.collate, **cli.loader_options(flags))
    preemption = Preemption(dist)  # asked after every step, as run.py's checkpoints ask it
    rows = step_log.StepLog.of(t, found.flops, **cli.step_log_options(flags))  # the default rows, as run.py's
    rows.open(Path(folder), 0, **cli.step_sink_options(flags))  # steps.csv (rank 0), every --log-interval steps

    def epoch(number: int, log: step_log.StepLog | None = None) -> int:
        """One epoch as run.py trains it; `log` in place of the default rows (a StepLog(0): none)."""
        log = log or rows
        steps = plan.epoch(number, t.rank)
        first_step = loop.start_epoch(t, number, train_loader, steps, flags.seed)
        with log.epoch(number, len(steps), first_step, t.progress.global_step):
            loop.train_one_epoch(t, steps, train_loader, first_step, log, lambda t: preemption.agreed())
        return len(steps)

    return t, plan, train_loader, epoch, dist


def template_worker(args, noise_scale: bool, every: int | None = None) -> dict | None:
    """The template (`built_template`), epoch after epoch."""
    from ddp_tricks.distributed import launch

    _, plan, _, epoch, dist = built_template(args.warmup + args.epochs, noise_scale, every)
    clock = Clock()
    try:
        steps = 0
        for number in range(1, args.warmup + args.epochs + 1):
            clock.tick(steps)
            steps = epoch(number)
        clock.tick(steps)
    finally:
        launch.cleanup()
    return clock.result(args.warmup, dist.world_size) if dist.rank == 0 else None


def fabric_worker(args) -> dict | None:
    import torch
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    world = int(os.environ.get("WORLD_SIZE", "1"))
    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
    fabric.launch()
    train_set = plain_digits_x4()
    model = toy_model()
    optimizer = sgd(model.parameters())
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(train_set, batch_size=BATCH, shuffle=True))
    criterion = torch.nn.CrossEntropyLoss()
    clock = Clock()
    model.train()
    for epoch in range(args.warmup + args.epochs):
        if world > 1:
            loader.sampler.set_epoch(epoch)
        clock.tick(len(loader))
        for inputs, targets in loader:
            loss = criterion(model(inputs), targets)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    clock.tick(len(loader))
    result = clock.result(args.warmup, fabric.world_size) if fabric.global_rank == 0 else None
    return result


def accelerate_worker(args) -> dict | None:
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader

    accelerator = Accelerator(cpu=True)
    set_seed(SEED)
    train_set = plain_digits_x4()
    model = toy_model()
    optimizer = sgd(model.parameters())
    loader = DataLoader(train_set, batch_size=BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    criterion = torch.nn.CrossEntropyLoss()
    clock = Clock()
    model.train()
    for epoch in range(args.warmup + args.epochs):
        loader.set_epoch(epoch)
        clock.tick(len(loader))
        for inputs, targets in loader:
            loss = criterion(model(inputs), targets)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    clock.tick(len(loader))
    result = clock.result(args.warmup, accelerator.num_processes) if accelerator.is_main_process else None
    accelerator.end_training()
    return result


def trainer_worker(args) -> dict | None:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    clock = Clock()

    class Classifier(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = toy_model()

        def training_step(self, batch, batch_index):
            inputs, targets = batch
            logits = self.model(inputs)
            loss = torch.nn.functional.cross_entropy(logits, targets)
            accuracy = (logits.argmax(1) == targets).float().mean()
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            self.log("train_acc", accuracy, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return sgd(self.parameters())

    class EpochClock(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            clock.tick(trainer.num_training_batches)

        def on_train_end(self, trainer, module):
            clock.tick(trainer.num_training_batches)

    world = args.processes
    train_set = plain_digits_x4()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        max_epochs=args.warmup + args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[EpochClock()],
    )
    trainer.fit(Classifier(), DataLoader(train_set, batch_size=BATCH, shuffle=True))
    result = clock.result(args.warmup, trainer.world_size) if trainer.global_rank == 0 else None
    return result


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // args.processes))
    run = {
        "bare": lambda: bare_worker(args, template_loader=False),
        "bare-loader": lambda: bare_worker(args, template_loader=True),
        "bare-loader-no-buffer-sync": lambda: bare_worker(args, template_loader=True, sync_buffers=False),
        "template": lambda: template_worker(args, noise_scale=True),
        "template-no-noise": lambda: template_worker(args, noise_scale=False),
        EVERY_STEP: lambda: template_worker(args, noise_scale=True, every=1),
        "fabric": lambda: fabric_worker(args),
        "accelerate": lambda: accelerate_worker(args),
        "trainer": lambda: trainer_worker(args),
    }[args.worker]
    result = run()
    if result is not None:  # written before the group is torn down: a teardown that aborts loses no timing
        Path(args.out).write_text(json.dumps(result))
    leave_group()
