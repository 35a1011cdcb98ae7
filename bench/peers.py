"""The template side by side with the frameworks users choose between: the same model (the built-in toy CNN), data
(scikit-learn's digits, the training split 4 times over), batch (32 per process), optimizer (SGD, momentum 0.9,
weight decay 5e-4, the same LR) and precision (float32), trained through

    bare           a bare loop: forward, backward, step, on a plain DataLoader (DistributedSampler under DDP)
    bare-loader    the same bare loop on the template's own loader (its PlanSampler, the plan's steps)
    bare-loader-no-buffer-sync   (2 processes) that loop with DDP's per-forward broadcast of rank 0's buffers off,
                   as the template sets it for a model whose only buffers are BatchNorm's: the template's own setting
    template       the template as run.py builds it, with its defaults: exact epoch loss and accuracy (sums reduced
                   once per epoch), its warmup schedule, and at 2 processes the gradient noise scale
    template-no-noise   the template with --no-noise-scale (2 processes only: the noise scale's cost)
    template-noise-every-step   (--loops only) the template with --noise-scale-every 1: the old default's cost
    fabric         Lightning Fabric: fabric.setup, fabric.backward, the user's own loop
    accelerate     Hugging Face Accelerate: accelerator.prepare, accelerator.backward
    trainer        Lightning's Trainer, logging loss and accuracy per epoch (self.log(on_epoch=True, sync_dist=True))

each at 1 process and at 2 processes under DDP on gloo (torchrun for all but the Trainer, which launches its own
DDP processes). Each run is a fresh process (or group) that trains warm-up epochs, then timed ones; the time per
step is the median over the timed epochs of the epoch's wall time over its steps (rank 0's; the ranks step in
lockstep). A round runs every loop once (in an order that alternates between rounds); each round's ratio to the
bare loop and to the template sees the same machine; the medians of the rounds' ratios are printed with their
quartiles. Intra-op threads: the machine's cores over the processes, in every loop. The last line is one JSON object.

    pip install -r requirements-bench.txt                 # lightning, accelerate (bench only)
    python bench/peers.py                                 # the full run: 5 rounds at 1 and 2 processes
    python bench/peers.py --quick                         # 2 rounds, 1 timed epoch: a check that it all runs
    python bench/peers.py --plot docs/peers.png --from results.json    # the figure from a run's JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
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
    "template": "template (exact epoch loss + accuracy; noise scale at 2 processes)",
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


def template_worker(args, noise_scale: bool, every: int | None = None) -> dict | None:
    """run.py's own stages (check, join, build) and its training loop, epoch after epoch, with the watchdog's heartbeats
    and the SIGTERM agreement asked after every step (no evaluation between epochs: only the training is timed, as for
    the peers)."""
    sys.path.insert(0, str(REPO))
    import run
    from customized_function import same_seeds
    from ddp_tricks import cli
    from ddp_tricks.data import loaders
    from ddp_tricks.distributed import heartbeat, launch
    from ddp_tricks.distributed.preemption import Preemption
    from ddp_tricks.training import loop, preflight

    argv = ["--optimizer", "sgd", "-b", str(BATCH), "-l", str(LR), "--lr-scaling", "keep", "--no-progress",
            "-e", str(args.warmup + args.epochs), "-s", str(SEED)]  # fmt: skip
    argv += [] if noise_scale else ["--no-noise-scale"]
    argv += [] if every is None else ["--noise-scale-every", str(every)]
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
    stacks = tempfile.mkdtemp(prefix="peers-stacks-")  # the watchdog's heartbeats, as run.py runs them
    heartbeat.configure(stacks, process.world_size, **cli.hang_options(flags))
    dist = launch.setup(process, flags.device, flags.backend, flags.dist_timeout, False, flags.sigterm_grace)
    t = run.build_training(flags, task, model, found, plan, dist)
    train_loader, _ = loaders.both(train_set, val_set, dist, found.collate, **cli.loader_options(flags))
    preemption = Preemption(dist)  # asked after every step, as run.py's checkpoints ask it
    clock = Clock()
    try:
        for epoch in range(1, flags.epochs + 1):
            steps = plan.epoch(epoch, t.rank)
            first_step = loop.start_epoch(t, epoch, train_loader, steps, flags.seed)
            clock.tick(len(steps))
            loop.train_one_epoch(t, steps, train_loader, first_step, None, lambda t: preemption.agreed())
        clock.tick(len(steps))
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


# ---------------------------------------------------------------- the driver: paired rounds of fresh processes


def launch_one(args, loop: str, processes: int, out: Path) -> tuple[float, float]:
    """One run of `loop` on `processes` processes, in fresh processes: its median milliseconds per step, wall and
    CPU (rank 0's process)."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // processes)
    me = [str(Path(__file__).resolve()), "--worker", loop, "--processes-of-worker", str(processes), "--out", str(out),
          "--warmup", str(args.warmup), "--epochs", str(args.epochs), "--threads", str(threads)]  # fmt: skip
    if loop == "trainer" or processes == 1:  # the Trainer launches its own DDP processes
        command = [sys.executable, *me]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *me]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    for _ in range(2):  # once more after a failure, then stop
        out.unlink(missing_ok=True)
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if out.exists():  # rank 0 timed every epoch; a teardown that aborts (gloo's threads, now and then) is said
            if done.returncode != 0:
                print(f"  {loop} at {processes} process(es): timed, then exit {done.returncode} in its teardown",
                      file=sys.stderr, flush=True)  # fmt: skip
            break
        print(f"  {loop} at {processes} process(es) failed (exit {done.returncode})", file=sys.stderr, flush=True)
    if not out.exists():
        sys.exit(f"error: {loop} at {processes} process(es) failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(out.read_text())
    steps = -(-len(digits_x4()[0]) // (BATCH * processes))
    if result["world_size"] != processes or abs(result["steps_per_epoch"] - steps) > 1:
        sys.exit(f"error: {loop} ran {result['steps_per_epoch']} steps per epoch on {result['world_size']} processes, "
                 f"not about {steps} on {processes}")  # fmt: skip
    return result["ms_per_step"], result["cpu_ms_per_step"]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, median, high


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("torch", "lightning", "accelerate"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def machine() -> dict:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "system": platform.system()}


def drive(args) -> dict:
    loops = [loop for loop in args.loops.split(",") if loop]
    unknown = sorted(set(loops) - {*LOOPS, EVERY_STEP})
    if unknown:
        sys.exit(f"error: --loops names {', '.join(unknown)}; choose from {', '.join(LOOPS)}")
    sizes = [int(n) for n in args.processes_list.split(",")]
    result = {"versions": versions(), "machine": machine(), "rounds": args.rounds, "warmup_epochs": args.warmup,
              "timed_epochs": args.epochs, "threads": args.threads or "cores / processes", "batch_per_process": BATCH,
              "sizes": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for processes in sizes:
            here = [loop for loop in loops if not (loop in ONLY_DDP and processes == 1)]
            ms = {loop: [] for loop in here}
            cpu = {loop: [] for loop in here}
            for r in range(args.rounds):
                for loop in here if r % 2 == 0 else here[::-1]:
                    wall, cpu_ms = launch_one(args, loop, processes, Path(tmp) / "out.json")
                    ms[loop].append(wall)
                    cpu[loop].append(cpu_ms)
                    print(f"  {processes} process(es), round {r + 1}/{args.rounds}: {loop:18s} {ms[loop][-1]:.3f} "
                          "ms/step", file=sys.stderr, flush=True)  # fmt: skip
            rows = {}
            for loop in here:
                row = {"ms_per_step": quartiles(ms[loop]), "rounds_ms": [round(x, 4) for x in ms[loop]],
                       "cpu_ms_per_step": quartiles(cpu[loop])}  # fmt: skip
                for reference in ("bare", "template"):
                    if reference in ms:
                        row[f"vs_{reference}"] = quartiles([a / b for a, b in zip(ms[loop], ms[reference])])
                        row[f"cpu_vs_{reference}"] = quartiles([a / b for a, b in zip(cpu[loop], cpu[reference])])
                if "bare-loader" in ms:
                    row["vs_bare_loader"] = quartiles([a / b for a, b in zip(ms[loop], ms["bare-loader"])])
                rows[loop] = {k: [round(x, 4) for x in v] if k != "rounds_ms" else v for k, v in row.items()}
            result["sizes"][str(processes)] = rows
            for measured, key in (("template", "noise_scale_cost"), (EVERY_STEP, "noise_scale_cost_every_step")):
                if measured in ms and "template-no-noise" in ms:
                    cost = quartiles([a / b for a, b in zip(ms[measured], ms["template-no-noise"])])
                    result["sizes"][str(processes)][key] = [round(x, 4) for x in cost]
                    cost = quartiles([a / b for a, b in zip(cpu[measured], cpu["template-no-noise"])])
                    result["sizes"][str(processes)][f"{key}_cpu"] = [round(x, 4) for x in cost]
    return result


def table(result: dict) -> str:
    """The Markdown table of a run: medians with quartiles."""
    header = (
        "processes | loop | ms/step | vs bare loop | vs bare loop, template's loader | vs template | CPU vs template"
    )
    lines = [f"| {header} |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for processes, rows in result["sizes"].items():
        for loop, row in rows.items():
            if loop.startswith("noise_scale_cost"):
                continue

            def cell(key, row=row, digits=3):
                if key not in row:
                    return ""
                low, median, high = row[key]
                return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"

            name = f"**{NAMES[loop]}**" if loop == "template" else NAMES[loop]
            cells = " | ".join(
                cell(key) for key in ("ms_per_step", "vs_bare", "vs_bare_loader", "vs_template", "cpu_vs_template")
            )
            lines.append(f"| {processes} | {name} | {cells} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Bars: the median time per step of each loop at each size, its quartiles as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(result["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.5 * len(sizes), 4.2), squeeze=False)
    for ax, processes in zip(axes[0], sizes):
        rows = {k: v for k, v in result["sizes"][processes].items() if not k.startswith("noise_scale_cost")}
        names = list(rows)
        medians = [rows[n]["ms_per_step"][1] for n in names]
        errors = [[m - rows[n]["ms_per_step"][0] for n, m in zip(names, medians)],
                  [rows[n]["ms_per_step"][2] - m for n, m in zip(names, medians)]]  # fmt: skip
        colors = ["tab:red" if n.startswith("template") else "tab:gray" if n.startswith("bare") else "tab:blue"
                  for n in names]  # fmt: skip
        ax.barh(range(len(names)), medians, xerr=errors, color=colors, capsize=3)
        ax.set_yticks(range(len(names)), names)
        ax.invert_yaxis()
        ax.set_xlabel("ms per step (median of rounds; quartiles)")
        ax.set_title(f"{processes} process{'es' if processes != '1' else ''}" + (" (DDP, gloo)" if processes != "1"
                     else ""))  # fmt: skip
    v = result["versions"]
    fig.suptitle(f"toy CNN, digits x4, batch 32/process, SGD, fp32 on {result['machine']['cores']} CPU cores "
                 f"({result['threads']} threads), {result['rounds']} rounds: Python {v['python']}, torch {v['torch']}, "
                 f"lightning {v['lightning']}, accelerate {v['accelerate']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="epochs each run trains before the timed ones")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs of each run (their median)")
    parser.add_argument("--processes", dest="processes_list", default="1,2", help="sizes, e.g. 1,2")
    parser.add_argument("--loops", default=",".join(LOOPS),
                        help=f"a comma list from {', '.join(LOOPS)}, {EVERY_STEP} (default: all but it)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads per process (default: the cores over the processes)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 timed epoch: checks that it all runs")
    parser.add_argument("--plot", type=Path, default=None, help="draw the figure to this file (png)")
    parser.add_argument("--from", dest="from_json", type=Path, default=None,
                        help="with --plot: draw from this file's last line (a run's JSON), not a new run")  # fmt: skip
    parser.add_argument("--worker", choices=(*LOOPS, EVERY_STEP), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--processes-of-worker", dest="processes", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.rounds, args.epochs = 2, 1
    if args.from_json is not None:
        result = json.loads(args.from_json.read_text().strip().splitlines()[-1])
    else:
        result = drive(args)
        print(table(result))
        for processes, rows in result["sizes"].items():
            for key, how in (("noise_scale_cost", "the default"), ("noise_scale_cost_every_step", "every step")):
                if key in rows:
                    low, median, high = rows[key]
                    cpu_low, cpu_median, cpu_high = rows[f"{key}_cpu"]
                    print(f"noise scale's cost at {processes} processes, {how} (template / template --no-noise-scale): "
                          f"{median:.3f} ({low:.3f}-{high:.3f}); CPU time {cpu_median:.3f} ({cpu_low:.3f}-"
                          f"{cpu_high:.3f})")  # fmt: skip
    if args.plot is not None:
        plot(result, args.plot)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
