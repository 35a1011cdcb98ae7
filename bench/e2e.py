"""run.py's own training loop (ddp_tricks.training.loop.train_one_epoch) against a minimal bare loop doing the same
work: same model, data, batch, optimizer and AMP setting, measured interleaved in one run after warm-up. Also the data
path alone (loader iteration without the model), and the bare loop on one batch already resident on the
device (the model's own ceiling: no data path at all). The last line is one JSON object.

    python bench/e2e.py [--model toy] [--batch-size 32] [--amp off|bf16|fp16] [--optimizer sgd|lars] [--repeats 7]
    python bench/e2e.py --profile     # the torch operators each loop runs per step, and what the template adds
    python bench/e2e.py --data imagenet --model resnet50 --amp bf16 --channels-last --batch-size 128 \
        --optimizer lars --device cuda        # synthetic ImageNet-shaped data (3x224x224, 1000 classes)
    python bench/e2e.py --processes 2         # the template as run.py builds it, against a bare DDP loop

With --processes N (1 or more, under torchrun, gloo on the CPU): the template as run.py builds it with its defaults
(the toy CNN on the digits x4, SGD, batch 32 per process; a row in steps.csv every 20 steps, the SIGTERM agreement,
the watchdog's heartbeats, and at 2+ processes the gradient noise scale) against a bare loop (forward, backward,
step) on the same loader, under DDP with the template's settings (no per-forward broadcast of the buffers, gradients
as views of DDP's buckets), both in the same N processes, epochs interleaved; `--profile` then adds cProfile's
per-step cost of the template's own functions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from ddp_tricks import cli as config
from ddp_tricks import models, plan
from ddp_tricks.data import images as image_data
from ddp_tricks.data import loaders as data
from ddp_tricks.schedules import schedule as schedulers
from ddp_tricks.training.loop import train_one_epoch
from ddp_tricks.training.precision import DTYPES, Precision
from ddp_tricks.training.state import Training
from lars import LARS

BATCH_OF_RUN = 32  # --processes: the batch per process of the run-built template (bench/peer_loops.py's)


def make_optimizer(name: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    if name == "lars":
        return LARS(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)


def build(args, device, channels: int, classes: int):
    torch.manual_seed(0)
    memory_format = torch.channels_last if args.channels_last else torch.preserve_format
    model = models.build(args.model, channels, classes).to(device, memory_format=memory_format)
    optimizer = make_optimizer(args.optimizer, model, 0.01)
    return model, optimizer


def bare_epoch(model, optimizer, batches, device, amp_dtype, scaler, channels_last=False, sums=False) -> None:
    """The loop a user would write by hand: forward, backward, step; nothing else. With `sums`, also the epoch's
    exact loss and accuracy as such a user keeps them: float64 sums on the device, read once at the epoch's end."""
    model.train()
    criterion = nn.CrossEntropyLoss()
    loss_sum, correct = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
    for inputs, targets in batches:
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(inputs).float()
            loss = criterion(logits, targets)
        if sums:
            with torch.no_grad():
                loss_sum.add_(loss, alpha=len(targets))
                correct.add_((logits.argmax(1) == targets).sum())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if sums:
        loss_sum.item(), correct.item()


def profile_ops(loops: dict, the_plan, loader, steps: list) -> None:
    """One epoch of each loop under torch.profiler (after one without): the aten operators per step, their self
    CPU time per step (inflated by the profiler; compare the two loops, not with the timings), and the operators
    the template runs more often than the bare loop."""
    from torch.profiler import ProfilerActivity, profile

    per_step = {}
    for name, fn in loops.items():
        for profiled in (False, True):
            steps[:] = the_plan.epoch(0, 0)
            loader.batch_sampler.start(steps)
            if not profiled:
                fn()
                continue
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
        per_step[name] = {e.key: (e.count / len(steps), e.self_cpu_time_total / len(steps))
                          for e in prof.key_averages() if e.key.startswith("aten::")}  # fmt: skip
        count, micros = (sum(v[i] for v in per_step[name].values()) for i in (0, 1))
        print(f"{name:9s} {count:6.1f} aten operators per step, {micros:7.0f} us self CPU per step (profiled)")
    template, bare = per_step["template"], per_step["bare"]
    extra = {k: (c - bare.get(k, (0, 0))[0], us - bare.get(k, (0, 0))[1]) for k, (c, us) in template.items()}
    print("operators the template runs more often per step (count, self CPU):")
    for key, (count, micros) in sorted(extra.items(), key=lambda kv: -kv[1][1]):
        if count >= 0.5:
            print(f"  {key:28s} +{count:4.1f}  {micros:+6.1f} us")


def paired(args) -> None:
    """--processes N, in each of the N processes: the run-built template and a bare DDP loop, epochs interleaved
    (each started together on every rank); rank 0 prints the ratios and, with --profile, cProfile's per-step
    cumulative time of the template's own functions."""
    import cProfile

    import torch.distributed as tdist
    from peer_loops import built_template, sgd, toy_model

    from ddp_tricks.distributed import launch
    from ddp_tricks.distributed.wrap import buffer_sync

    rounds = args.repeats + 1  # the first warms up
    t, plan, loader, template_epoch, dist = built_template(rounds, extra=args.flags.split())

    def bare_loop():
        model = toy_model()
        if dist.world_size > 1:  # the template's settings: no per-forward broadcast (BatchNorm's buffers only), and
            # the gradients as views of DDP's buckets (no copy in and out of them)
            model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True, **buffer_sync(False))
        optimizer = sgd(model.parameters())

        def bare(number: int) -> int:
            steps = plan.epoch(number, dist.rank)
            loader.batch_sampler.start(steps)
            bare_epoch(model, optimizer, loader, torch.device("cpu"), None, None, sums=args.bare_sums)
            return len(steps)

        return bare

    bare = bare_loop()
    if args.against_itself:  # the bare loop against a second one: how far apart two equal loops measure here
        template_epoch = bare_loop()

    profiler = cProfile.Profile() if args.profile and dist.rank == 0 else None
    seconds, steps = {"template": [], "bare": []}, 0
    for number in range(1, rounds + 1):
        for name, fn in (("template", template_epoch), ("bare", bare))[:: 1 if number % 2 else -1]:
            if dist.world_size > 1:
                tdist.barrier()
            start = time.perf_counter()
            if profiler is not None and name == "template" and number > 1:
                steps += profiler.runcall(fn, number)
            else:
                fn(number)
            if number > 1:
                seconds[name].append(time.perf_counter() - start)
    if dist.rank == 0:
        report_paired(args, seconds, plan.steps_per_epoch, dist.world_size, profiler, steps)
    launch.cleanup()


def report_paired(args, seconds: dict, steps_per_epoch: int, world: int, profiler, profiled_steps: int) -> None:
    ratios = sorted(a / b for a, b in zip(seconds["template"], seconds["bare"]))
    low, ratio, high = statistics.quantiles(ratios, n=4, method="inclusive")
    template_ms, bare_ms = (1e3 * statistics.median(seconds[k]) / steps_per_epoch for k in ("template", "bare"))
    print(f"torch {torch.__version__}, {world} process(es), {torch.get_num_threads()} thread(s) each, toy CNN, batch "
          f"{BATCH_OF_RUN} per process, {steps_per_epoch} steps per epoch, {args.repeats} epochs of each")  # fmt: skip
    print(f"  bare DDP loop  {bare_ms:.3f} ms/step")
    shown = (
        "a second bare DDP loop (--against-itself)"
        if args.against_itself
        else ("as run.py builds it, its default rows and agreement")
    )
    print(f"  template       {template_ms:.3f} ms/step ({shown})")
    print(f"  template / bare time per step: {ratio:.3f} (median of the rounds' ratios; quartiles {low:.3f}-"
          f"{high:.3f})")  # fmt: skip
    if profiler is not None:
        import io
        import pstats

        stats = pstats.Stats(profiler, stream=io.StringIO())
        print(f"  the template's own functions, cumulative microseconds per step (cProfile, {profiled_steps} steps; "
              "inflated by the profiler: compare them with one another):")  # fmt: skip
        rows = [(cum, calls, f"{func[0].split('/ddp_tricks/')[-1].split('/main/')[-1]}:{func[2]}")
                for func, (_, calls, _, cum, _) in stats.stats.items()
                if "ddp_tricks" in func[0] or func[0].endswith(("task.py", "lars.py"))]  # fmt: skip
        for cum, calls, name in sorted(rows, reverse=True)[:25]:
            print(f"    {1e6 * cum / profiled_steps:8.1f} us  {calls / profiled_steps:5.2f} calls  {name}")
    result = {"processes": world, "against_itself": args.against_itself, "bare_sums": args.bare_sums}
    result["template_vs_bare"] = round(ratio, 3)
    result["template_vs_bare_quartiles"] = [round(low, 3), round(high, 3)]
    result |= {"template_ms_per_step": round(template_ms, 4), "bare_ms_per_step": round(bare_ms, 4)}
    print(json.dumps(result))


def launch_paired(args) -> None:
    """Run `paired` in --processes N processes under torchrun; print rank 0's lines."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve()
    threads = max(1, (os.cpu_count() or 1) // args.processes)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.processes}",
               str(here), "--rank-worker", "--processes", str(args.processes),
               "--repeats", str(args.repeats), f"--flags={args.flags}"]  # fmt: skip
    command += ["--profile"] if args.profile else []
    command += ["--against-itself"] if args.against_itself else []
    command += ["--bare-sums"] if args.bare_sums else []
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    paths = [str(here.parent.parent), str(here.parent), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    done = subprocess.run(command, cwd=here.parent.parent, env=env, capture_output=True, text=True, timeout=1800)
    print(done.stdout, end="")
    if done.returncode != 0 and not done.stdout.rstrip().endswith("}"):
        sys.exit(f"error: the {args.processes}-process run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="toy")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off")
    parser.add_argument("--optimizer", choices=("sgd", "lars"), default="sgd")
    parser.add_argument("--repeats", type=int, default=15, help="epochs timed for each loop (median)")
    parser.add_argument("--copies", type=int, default=4, help="the digits training set repeated, for longer epochs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's, one per core)")
    parser.add_argument("--data", choices=("digits", "imagenet"), default="digits",
                        help="imagenet: synthetic 3x224x224 images in memory, 1000 classes")  # fmt: skip
    parser.add_argument("--samples", type=int, default=2048, help="--data imagenet: images per epoch")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--profile", action="store_true", help="count the operators per step of each loop instead")
    parser.add_argument("--processes", type=int, default=0,
                        help="N: the run-built template against a bare DDP loop in N processes (default 0: in this "
                        "process, a Training built by hand)")  # fmt: skip
    parser.add_argument("--flags", default="", help="--processes: more run.py flags for the template, in one string "
                        "(e.g. '--log-interval 0', '--no-noise-scale'; default: none)")  # fmt: skip
    parser.add_argument("--against-itself", action="store_true",
                        help="--processes: a second bare loop in the template's place: the ratio two equal loops "
                        "measure on this machine (default: off)")  # fmt: skip
    parser.add_argument("--bare-sums", action="store_true",
                        help="--processes: the bare loop keeps the epoch's exact loss and accuracy too, as float64 "
                        "sums on the device (the work of the template's default train_loss and train_acc; default: "
                        "off)")  # fmt: skip
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        return paired(args)
    if args.processes:
        return launch_paired(args)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.data == "digits":
        digits, _ = image_data.digits()
        train_set = data.InMemoryDataset(digits.inputs.repeat(args.copies, 1, 1, 1), digits.targets.repeat(args.copies))
        channels, classes = 1, 10
    else:
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(args.samples, 3, 224, 224, generator=generator)
        train_set = data.InMemoryDataset(images, torch.randint(0, 1000, (args.samples,), generator=generator))
        channels, classes = 3, 1000
    the_plan = plan.make(num_train=len(train_set), world_size=1, micro_batch=args.batch_size, accum_steps=1,
                         epochs=1, seed=0, base_lr=0.01, lr_scaling="keep", base_batch=args.batch_size,
                         warmup_epochs=0)  # fmt: skip
    loader = data.train_loader(train_set, 0, device, seed=0)
    amp_dtype = DTYPES[args.amp]
    flags, task_class = config.parse(["--model", args.model])  # the built-in task: its loss and accuracy

    model_t, opt_t = build(args, device, channels, classes)
    training = Training(model_t, opt_t, schedulers.Schedule(schedulers.WarmupDecay(opt_t, 0, 0)), task_class(flags),
                        ["acc"], Precision(args.amp, device), device, channels_last=args.channels_last)  # fmt: skip
    model_b, opt_b = build(args, device, channels, classes)
    scaler_b = torch.amp.GradScaler(device.type) if args.amp == "fp16" else None
    steps = []

    def template():
        train_one_epoch(training, steps, loader)

    def bare():
        bare_epoch(model_b, opt_b, loader, device, amp_dtype, scaler_b, args.channels_last)

    def resident():  # one batch already on the device, used for every step: the model's own ceiling
        first = next(iter(loader))
        batch = (first[0].to(device), first[1].to(device))
        bare_epoch(model_b, opt_b, [batch] * len(loader), device, amp_dtype, scaler_b, args.channels_last)

    def data_only():
        for inputs, targets in loader:
            inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)

    if args.profile:
        return profile_ops({"template": template, "bare": bare}, the_plan, loader, steps)
    timings = {"template": [], "bare": [], "data": [], "resident": []}
    cpu_times = {"template": [], "bare": [], "data": [], "resident": []}
    main_thread = {"template": [], "bare": [], "data": [], "resident": []}
    order = [("template", template), ("bare", bare), ("data", data_only), ("resident", resident)]
    for run in range(args.repeats + 1):  # the first round warms up; the order alternates so neither loop gains
        for name, fn in order if run % 2 else order[::-1]:
            steps[:] = the_plan.epoch(run, 0)  # DistributedSampler's order for this epoch, as run.py draws it
            loader.batch_sampler.start(steps)
            sync(device)
            start, cpu, own = time.perf_counter(), time.process_time(), time.thread_time()
            fn()
            sync(device)
            if run:
                timings[name].append(time.perf_counter() - start)
                cpu_times[name].append(time.process_time() - cpu)
                main_thread[name].append(time.thread_time() - own)
    samples = len(train_set)
    template_s, bare_s, data_s, resident_s = (statistics.median(timings[k]) for k in timings)
    # Each round times both loops back to back, so a round's ratio sees the same machine: the median of the rounds'
    # ratios (with its quartiles) is the statistic to trust on a shared machine. The ratio of the two medians mixes
    # rounds that saw different loads; where the two disagree by more than the quartiles' spread, the machine was
    # too busy for this measurement.
    ratios = sorted(t / b for t, b in zip(timings["template"], timings["bare"]))
    ratio, (low, _, high) = statistics.median(ratios), statistics.quantiles(ratios, n=4)
    ratio_of_medians = template_s / bare_s
    cpu_ratio = statistics.median(t / b for t, b in zip(cpu_times["template"], cpu_times["bare"]))  # all threads
    # the main thread's own CPU time: the template's extra work, without the intra-op threads' waiting and spinning
    main_ratio = statistics.median(t / b for t, b in zip(main_thread["template"], main_thread["bare"]))
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, model {args.model}, "
          f"batch {args.batch_size}, amp {args.amp}, optimizer {args.optimizer}, {samples} samples per epoch, "
          f"median of {args.repeats} epochs")  # fmt: skip
    print(f"  bare loop      {samples / bare_s:9.0f} samples/s  ({bare_s:.3f} s/epoch)")
    print(f"  template loop  {samples / template_s:9.0f} samples/s  ({template_s:.3f} s/epoch)")
    print(f"  data path only {samples / data_s:9.0f} samples/s  ({data_s:.3f} s/epoch)")
    print(f"  resident batch {samples / resident_s:9.0f} samples/s  ({resident_s:.3f} s/epoch: the model's ceiling)")
    print(f"  template / bare time per step: {ratio:.3f} (median of the rounds' ratios; quartiles {low:.3f}-"
          f"{high:.3f}; ratio of the medians {ratio_of_medians:.3f}); CPU time {cpu_ratio:.3f} (all threads), "
          f"{main_ratio:.3f} (main thread)")  # fmt: skip
    print(f"  bare throughput / resident ceiling: {resident_s / bare_s:.3f}")
    print(
        json.dumps(
            {
                "template_vs_bare": round(ratio, 3),
                "template_vs_bare_quartiles": [round(low, 3), round(high, 3)],
                "template_vs_bare_ratio_of_medians": round(ratio_of_medians, 3),
                "template_vs_bare_cpu": round(cpu_ratio, 3),
                "template_vs_bare_main_thread_cpu": round(main_ratio, 3),
                "template_samples_per_s": round(samples / template_s),
                "bare_samples_per_s": round(samples / bare_s),
                "data_epoch_seconds": round(data_s, 4),
                "bare_vs_resident_throughput": round(resident_s / bare_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
