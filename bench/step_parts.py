"""What the template's step costs on the host beyond a bare loop, part by part: run.py's loop (train_one_epoch) and a
bare loop on a one-layer model (its step almost all overhead), in one process, interleaved rounds; then the same
with one part of the template's step replaced by nothing at a time. The median microseconds per step beyond the bare
loop, each with its quartiles, then the JSON of them on the last line.

    python bench/step_parts.py [--rounds 30] [--threads 1]
    python bench/step_parts.py --built [--rounds 20]   # the template as run.py builds it, the toy CNN, 2 threads

With --built: the template as run.py builds it (bench/peer_loops.built_template: its rows, heartbeats and SIGTERM
agreement) and the bare loop, each variant of the template with one part left out, all interleaved in every round;
each one's time over the bare loop's (median, quartiles), then the JSON of them on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from e2e import bare_epoch
from torch import nn

from ddp_tricks import cli, plan
from ddp_tricks.data import images, loaders
from ddp_tricks.schedules import schedule as schedules
from ddp_tricks.training import loop, step_log
from ddp_tricks.training.precision import Precision
from ddp_tricks.training.state import Training

CPU = torch.device("cpu")

# each part, and how it is taken out (on the task, the Training, or the modules the loop calls)
PARTS = {
    "the task's metric sums": "metrics",
    "the epoch meter's adds": "meter",
    "the optimizer step's bookkeeping": "optimizer_step",
    "timing the loader's next()": "timed",
}


def one_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)


def without(part: str, t: Training):
    """Take `part` out of the template's step; returns what puts it back."""
    if part == "metrics":
        zero = {"acc": torch.zeros((), dtype=torch.int64)}
        t.task.metric_sums = lambda outputs, targets: zero
        return lambda: delattr(t.task, "metric_sums")
    if part == "meter":
        t.meter.add = lambda *args: None
        return lambda: delattr(t.meter, "add")
    if part == "optimizer_step":
        kept = loop.optimizer_step

        def bare_step(t, params, lr_factor=1.0, progress=1.0):
            t.optimizer.step()
            t.optimizer.zero_grad(set_to_none=True)
            return True

        loop.optimizer_step = bare_step
        return lambda: setattr(loop, "optimizer_step", kept)
    if part == "timed":
        kept = step_log.StepLog.begin
        step_log.StepLog.begin = lambda self, t, batches: (self._start_window(t), batches)[1]
        return lambda: setattr(step_log.StepLog, "begin", kept)
    raise ValueError(part)


def extra_per_step(t, model, optimizer, loader, the_plan, rounds: int) -> tuple[float, float, float]:
    """The template's time per step beyond the bare loop's, in µs: median and quartiles over interleaved rounds."""
    steps = []
    template = lambda: loop.train_one_epoch(t, steps, loader)  # noqa: E731
    bare = lambda: bare_epoch(model, optimizer, loader, CPU, None, None)  # noqa: E731 (e2e.py's bare loop, fp32)
    extra = []
    for r in range(rounds + 1):  # the first warms up
        times = {}
        for name, fn in (("template", template), ("bare", bare))[:: 1 if r % 2 else -1]:
            steps[:] = the_plan.epoch(r, 0)
            loader.batch_sampler.start(steps)
            start = time.perf_counter()
            fn()
            times[name] = time.perf_counter() - start
        if r:
            extra.append(1e6 * (times["template"] - times["bare"]) / len(steps))
    low, median, high = statistics.quantiles(extra, n=4, method="inclusive")
    return median, low, high


def built_parts(rounds: int) -> dict:
    """--built: {variant: (median, low, high) of its time over the bare loop's}, every variant in every round."""
    from peer_loops import built_template, sgd, toy_model

    from ddp_tricks.distributed import heartbeat

    t, the_plan, loader, trained, _ = built_template(rounds + 1)
    zero = {"acc": torch.zeros((), dtype=torch.int64)}
    model = toy_model()
    optimizer = sgd(model.parameters())

    def bare(number: int) -> None:
        loader.batch_sampler.start(the_plan.epoch(number, 0))
        bare_epoch(model, optimizer, loader, CPU, None, None)

    def template(*left_out: str):
        def epoch(number: int) -> None:
            kept = loop.metric_sums, heartbeat.step
            if "metric sums" in left_out:
                loop.metric_sums = lambda t, outputs, targets: zero
            if "meter" in left_out:
                t.meter.add = lambda *args: None
            if "heartbeat" in left_out:
                heartbeat.step = lambda *args, **kwargs: None
            trained(number, step_log.StepLog(0, CPU) if "rows" in left_out else None)
            loop.metric_sums, heartbeat.step = kept
            t.meter.__dict__.pop("add", None)

        return epoch

    variants = {"the template": template(), "without its rows": template("rows"),
                "without the task's metric sums": template("metric sums"),
                "without the meter's adds": template("meter"), "without the heartbeat": template("heartbeat"),
                "without all four": template("rows", "metric sums", "meter", "heartbeat"), "bare": bare}  # fmt: skip
    ratios = {name: [] for name in variants if name != "bare"}
    for number in range(rounds + 1):  # the first warms up
        times = {}
        for name, fn in list(variants.items())[:: 1 if number % 2 else -1]:
            start = time.perf_counter()
            fn(number)
            times[name] = time.perf_counter() - start
        for name in ratios if number else ():
            ratios[name].append(times[name] / times["bare"])
    return {name: statistics.quantiles(values, n=4, method="inclusive") for name, values in ratios.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds per measurement (default 30)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1: the steadiest)")
    parser.add_argument("--built", action="store_true", help="the template as run.py builds it, each part left out "
                        "in turn, against the bare loop (the toy CNN; default: off)")  # fmt: skip
    args = parser.parse_args()
    if args.built:
        torch.set_num_threads(2)
        result = built_parts(args.rounds)
        print(f"torch {torch.__version__}, 2 threads, the toy CNN as run.py builds it, batch 32, {args.rounds} rounds: "
              "time per step over the bare loop's (median, quartiles)")  # fmt: skip
        for name, (low, median, high) in result.items():
            print(f"  {name:32s} {median:.3f}  ({low:.3f}-{high:.3f})")
        print(json.dumps({name: [round(v, 3) for v in values] for name, values in result.items()}))
        return
    torch.set_num_threads(args.threads)
    digits, _ = images.digits()
    train_set = loaders.InMemoryDataset(digits.inputs.repeat(4, 1, 1, 1), digits.targets.repeat(4))
    the_plan = plan.make(num_train=len(train_set), world_size=1, micro_batch=32, accum_steps=1, epochs=1, seed=0,
                         base_lr=0.01, lr_scaling="keep", base_batch=32, warmup_epochs=0)  # fmt: skip
    loader = loaders.train_loader(train_set, 0, CPU, seed=0)
    flags, task_class = cli.parse([])
    model_t, opt_t = one_layer()
    t = Training(model_t, opt_t, schedules.Schedule(schedules.WarmupDecay(opt_t, 0, 0)), task_class(flags), ["acc"],
                 Precision("off", CPU), CPU)  # fmt: skip
    model_b, opt_b = one_layer()
    result = {"all of it": extra_per_step(t, model_b, opt_b, loader, the_plan, args.rounds)}
    for name, part in PARTS.items():
        put_back = without(part, t)
        result[name] = extra_per_step(t, model_b, opt_b, loader, the_plan, args.rounds)
        put_back()
    total = result["all of it"][0]
    print(f"torch {torch.__version__}, {args.threads} thread(s), one-layer model, batch 32, {args.rounds} rounds: "
          "microseconds per step beyond the bare loop (median, quartiles)")  # fmt: skip
    print(f"  {'all of it':40s} {total:6.1f}  ({result['all of it'][1]:.1f}-{result['all of it'][2]:.1f})")
    for name in PARTS:
        median, low, high = result[name]
        print(f"  {name:40s} {total - median:6.1f}  (without it: {median:.1f}, {low:.1f}-{high:.1f})")
    print(json.dumps({name: [round(v, 1) for v in values] for name, values in result.items()}))


if __name__ == "__main__":
    main()
