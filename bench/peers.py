"""The template side by side with the frameworks users choose between: the same model (the built-in toy CNN), data
(scikit-learn's digits, the training split 4 times over), batch (32 per process), optimizer (SGD, momentum 0.9,
weight decay 5e-4, the same LR) and precision (float32), trained through

    bare           a bare loop: forward, backward, step, on a plain DataLoader (DistributedSampler under DDP)
    bare-loader    the same bare loop on the template's own loader (its PlanSampler, the plan's steps)
    bare-loader-no-buffer-sync   (2 processes) that loop with DDP's per-forward broadcast of rank 0's buffers off,
                   as the template sets it for a model whose only buffers are BatchNorm's: the template's own setting
    template       the template as run.py builds it, with its defaults: exact epoch loss and accuracy (sums reduced
                   once per epoch), its warmup schedule, a row in steps.csv every 20 steps, the SIGTERM agreement,
                   and at 2 processes the gradient noise scale
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
The loops themselves, each in the process that trains it, are bench/peer_loops.py's; this file drives them.

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
from pathlib import Path

from peer_loops import BATCH, EVERY_STEP, LOOPS, NAMES, ONLY_DDP, digits_x4, worker

REPO = Path(__file__).resolve().parent.parent


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
