"""The flags, grouped by trick as `python run.py --help` shows them, with the original projects' spellings as
aliases; the parser that says a mistake in one line and suggests the flag a typo meant. No torch import here.
"""

from __future__ import annotations

import argparse
import difflib

from ddp_tricks import optim, schedules
from ddp_tricks.cli.optimizer_flags import add_optimizer_flags
from ddp_tricks.cli.step_flags import add_step_flags
from ddp_tricks.cli.tasks import DEFAULT_TASK, example_hint
from ddp_tricks.errors import UserError


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors on one line (exit code 2, as argparse does) and suggests the flag
    an unknown one was probably meant to be."""

    def error(self, message: str) -> None:  # noqa: D102 - argparse's own contract
        raise UserError(f"{message} (see `python run.py --help`)")

    def parse_args(self, args=None, namespace=None):  # noqa: D102 - argparse's own contract
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._did_you_mean(extras)}")
        return namespace

    def _did_you_mean(self, extras: list[str]) -> str:
        known = [option for action in self._actions for option in action.option_strings]
        for token in extras:
            flag = token.split("=", 1)[0]
            if flag in getattr(self, "builtin_task_flags", ()):
                return f"; {flag} is a flag of the built-in task (task.py), and --task names another"
            hint = example_hint(flag) if getattr(self, "default_task", False) else None
            if hint:  # the built-in task runs: a flag of an example's, given without its --task
                return f"; {hint}"
            if flag.startswith("-") and len(flag) > 2:
                # suggest the dashed spellings; the original projects' snake_case ones only to snake_case
                candidates = known if "_" in flag else [option for option in known if "_" not in option]
                close = difflib.get_close_matches(flag, candidates, n=1)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says it (on/off flags: off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default is argparse.SUPPRESS
            or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        ):
            return text
        return f"{text} (default: {'none' if action.default is None else '%(default)s'})"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


# the gradient noise scale is measured on every K-th step: at 4, under 2 % of a 2-process step on the built-in task
# (bench/peers.py), and the estimate within 15 % of per-sample truth (tests/test_noise_scale.py)
NOISE_SCALE_EVERY = 4
NUMBERS = (int, float, positive_int)  # the types whose values a config file must write as TOML numbers


def build_parser() -> argparse.ArgumentParser:
    """The full command line. Long flags read as English; the original projects' spellings are aliases."""
    p = Parser(
        prog="run.py",
        formatter_class=_HelpFormatter,
        description="Train with DistributedDataParallel and large-batch tricks. "
        "Launch with `torchrun --nproc_per_node=N run.py ...` or plain `python run.py ...`.",
        allow_abbrev=False,
    )
    _run_flags(p.add_argument_group("run"))
    _launch_flags(p.add_argument_group("launch and devices"))
    _data_loading_flags(p.add_argument_group("data loading"))
    _optimizer_flags(p.add_argument_group("optimizer"))
    _schedule_flags(p.add_argument_group("learning-rate schedule"))
    _batching_and_precision_flags(p.add_argument_group("batching and precision"))
    _batch_trace_flags(p.add_argument_group("variable batch size (a trace)"))
    _early_stopping_flags(p.add_argument_group("early stopping"))
    _ddp_performance_flags(p.add_argument_group("DDP performance"))
    add_step_flags(p)
    return p


def _run_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--config",
        dest="config_file",
        default=None,
        metavar="FILE.toml",
        help="flags from a TOML file, keys named like the long flags (base-lr = 0.1, nesterov = true); flags on "
        "the command line override it; recipes/ holds published and tuned settings",
    )
    g.add_argument(
        "--task",
        default=DEFAULT_TASK,
        metavar="FILE.py[:NAME]",
        help="what is trained: a task class in a file (default: task.py:Task, image classification)",
    )
    g.add_argument(
        "--monitor-metric",
        "--monitor",
        dest="monitor",
        default=None,
        metavar="METRIC",
        help="the validation metric that picks best.pt and drives early stopping and plateau (default: the task's); "
        "under torchrun spell it --monitor-metric: torchrun takes --monitor for its own --monitor-interval",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run folder that holds a run (clears it); without it such a folder is refused",
    )
    g.add_argument(
        "-n",
        "--name",
        "--exp_name",
        dest="name",
        default=None,
        help="run folder name under --runs-dir (default: a timestamp)",
    )
    g.add_argument(
        "-p",
        "--runs-dir",
        "--model_path",
        dest="runs_dir",
        default="runs",
        help="parent folder of run folders (default: runs)",
    )
    g.add_argument("-e", "--epochs", type=positive_int, default=10, help="epochs to train (default: 10)")
    g.add_argument("-s", "--seed", "--seed_num", dest="seed", type=int, default=0, help="random seed (default: 0)")
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True) for bit-reproducible runs",
    )
    g.add_argument(
        "--eval-only",
        action="store_true",
        help="evaluate the starting weights (fresh or --resume), write the metrics row, exit",
    )
    g.add_argument(
        "--resume",
        default=None,
        metavar="auto|PATH",
        help="continue from a checkpoint; `auto` takes runs/<name>/last.pt (sharded: last.dcp) when it exists",
    )
    g.add_argument(
        "--checkpoint-every-steps",
        type=int,
        default=0,
        metavar="K",
        help="also write the checkpoint every K optimizer steps, mid-epoch (0: only after each epoch)",
    )
    g.add_argument(
        "--on-nonfinite",
        choices=("stop", "skip"),
        default="stop",
        help="a NaN/inf loss (without fp16's scaler): stop every rank (default), or skip that step "
        "on every rank (costs one host sync per step)",
    )
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    g.add_argument(
        "--plot-lr",
        action="store_true",
        help="draw the LR schedule these flags produce into runs/<name>/lr_schedule.png, and exit",
    )
    g.add_argument("--tensorboard", action="store_true", help="also write TensorBoard events to runs/<name>/tb/")


def _launch_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--strategy",
        choices=("ddp", "fsdp"),
        default="ddp",
        help="ddp: every rank holds the whole model (DistributedDataParallel); fsdp: the model, its gradients and "
        "the optimizer state sharded over the ranks (FSDP2), for a model that outgrows one GPU",
    )
    g.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda:LOCAL_RANK when CUDA is available (cuda:0 where a process sees one GPU), else cpu",
    )
    g.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="process-group backend (auto: nccl on cuda, gloo on cpu)",
    )
    g.add_argument(
        "--local-rank",
        "--local_rank",
        dest="local_rank",
        type=int,
        default=None,
        help="set by the legacy `python -m torch.distributed.launch`; torchrun uses LOCAL_RANK",
    )
    g.add_argument(
        "--dist-timeout",
        type=float,
        default=600.0,
        help="seconds a collective may wait before the run fails instead of hanging (default: 600)",
    )
    g.add_argument(
        "--sigterm-grace",
        type=float,
        default=25.0,
        help="after SIGTERM, seconds a rank stuck in one call (a collective whose peer is gone) is given before it "
        "exits 143; torchrun, SLURM and Kubernetes kill 30 s after their SIGTERM (default: 25)",
    )
    hangs = {  # the progress watchdog (distributed/heartbeat.py): the job ends with exit code 4, a line per rank
        "--heartbeat-timeout": (30, "seconds without a rank's heartbeat (a stopped process, a frozen node) before "),
        "--hang-timeout": (120, "seconds, at the least, without progress on any rank (a stuck collective) before "),
    }
    for flag, (default, what) in hangs.items():
        g.add_argument(
            flag, type=float, default=float(default), help=f"{what}the job ends with exit code 4 (default: {default})"
        )
    g.add_argument(
        "--hang-factor",
        type=float,
        default=10.0,
        help="no progress on any rank for this many times the slowest step seen (or --hang-timeout) ends the job; "
        "evaluation, checkpoints and a first step count only while a rank waits in a collective (default: 10)",
    )


def _data_loading_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "-b",
        "--batch-size",
        "--batch_size",
        dest="batch_size",
        type=positive_int,
        default=32,
        help="micro-batch per rank (default: 32)",
    )
    g.add_argument("--val-batch-size", type=positive_int, default=256, help="evaluation batch per rank")
    g.add_argument(
        "--workers",
        type=int,
        default=0,
        help="DataLoader workers per rank (default: 0, right for the in-memory default data)",
    )
    g.add_argument("--prefetch-factor", type=positive_int, default=2, help="batches prefetched per worker")
    g.add_argument(
        "--drop-last",
        action="store_true",
        help="training leaves out the samples that do not fill a whole micro-batch on every rank (a new shuffle "
        "each epoch decides which); validation always keeps every sample",
    )


def _optimizer_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--optimizer",
        "--base-op",
        dest="optimizer",
        choices=optim.NAMES,
        default="sgd",
        help="sgd, adam, adamw, lars (standalone), lamb, muon (hidden matrices; AdamW the rest) (default: sgd)",
    )
    g.add_argument(
        "-l",
        "--base-lr",
        "--learning-rate",
        "--learning_rate",
        "--lr",
        dest="base_lr",
        type=float,
        default=None,
        help=f"learning rate before scaling (default: the optimizer's: {optim.described_defaults()})",
    )
    g.add_argument("--momentum", type=float, default=0.9, help="SGD/LARS momentum (default: 0.9)")
    g.add_argument("--nesterov", action="store_true", help="Nesterov momentum (SGD, LARS)")
    g.add_argument(
        "--wd", "--weight-decay", dest="weight_decay", type=float, default=5e-4, help="weight decay (default: 5e-4)"
    )
    g.add_argument("--lars-wrap", action="store_true", help="LARSWrapper over the chosen optimizer")
    g.add_argument("--trust-coefficient", type=float, default=0.001, help="LARS trust coefficient (default: 0.001)")
    g.add_argument("--epsilon", type=float, default=1e-8, help="LARS's trust-ratio epsilon (default: 1e-8)")
    add_optimizer_flags(g)  # the exclusion rule, betas, eps, LAMB's and Muon's settings
    g.add_argument("--lookahead", action="store_true", help="Lookahead over the optimizer")
    g.add_argument("--lookahead-k", type=positive_int, default=5, help="Lookahead sync period (default: 5)")
    g.add_argument("--lookahead-alpha", type=float, default=0.5, help="Lookahead slow step (default: 0.5)")
    g.add_argument("--clip-grad-norm", type=float, default=0.0, help="clip the global gradient norm (0: off)")
    g.add_argument(
        "--model-ema",
        type=float,
        default=None,
        metavar="DECAY",
        help="keep an EMA of the weights, ema = DECAY x ema + (1 - DECAY) x weights after every optimizer step "
        "(timm's ModelEmaV3), evaluated every epoch beside them (val_ema_* columns) and checkpointed; e.g. 0.999",
    )
    g.add_argument(
        "--model-ema-warmup",
        action="store_true",
        help="the EMA's decay at its update u is min(DECAY, (1 + u) / (10 + u)): the first steps move it more",
    )


def _schedule_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "-w",
        "--warmup-epochs",
        "--warmup_epochs",
        dest="warmup_epochs",
        type=float,
        default=0.0,
        help="linear warmup length in epochs, fractions allowed (default: 0)",
    )
    g.add_argument(
        "-t",
        "--warmup-type",
        "--warmup_type",
        dest="warmup_type",
        choices=("linear", "cosine"),
        default="linear",
        help="cosine: warmup, then cosine decay to --end-lr (the same as --scheduler cosine)",
    )
    g.add_argument("--scheduler", choices=schedules.KINDS, default="constant", help="schedule after warmup")
    g.add_argument("--plateau-factor", type=float, default=0.1, help="plateau: LR multiplier on a cut")
    g.add_argument("--plateau-patience", type=int, default=2, help="plateau: epochs without improvement")
    g.add_argument("--lr-power", type=float, default=None, help="poly: decay power (default: 2 with LARS, else 1)")
    g.add_argument("--end-lr", type=float, default=0.0, help="poly/cosine: the LR of the run's last step (default: 0)")
    g.add_argument("--step-epochs", type=float, default=30.0, help="step: epochs between decays")
    g.add_argument("--step-gamma", type=float, default=0.1, help="step: LR multiplier at each decay")
    g.add_argument(
        "--lr-scaling",
        choices=("keep", "linear", "sqrt"),
        default="keep",
        help="scale --base-lr by global batch / --base-batch-size (or its square root)",
    )
    g.add_argument("--base-batch-size", type=positive_int, default=256, help="reference batch of --lr-scaling")


def _batching_and_precision_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--accum-steps",
        "--batches-per-allreduce",
        dest="accum_steps",
        type=positive_int,
        default=1,
        help="micro-batches per optimizer step (gradient accumulation)",
    )
    g.add_argument(
        "--no-noise-scale",
        dest="noise_scale",
        action="store_false",
        help="do not measure the gradient noise scale (measured by default where a step sees two batch sizes: 2+ "
        "processes, or --accum-steps 2+ on one)",
    )
    g.add_argument(
        "--noise-scale-every",
        type=positive_int,
        default=NOISE_SCALE_EVERY,
        metavar="K",
        help=f"measure the gradient noise scale on every K-th optimizer step, its averages over those steps (default: "
        f"{NOISE_SCALE_EVERY}, so that it costs under 2%% of a step; 1: every step; a traced run: every step)",
    )
    g.add_argument("--amp", choices=("off", "fp16", "bf16"), default="off", help="mixed precision (torch.amp)")
    g.add_argument(
        "--amp-backend",
        choices=("native", "apex"),
        default="native",
        help="apex only where NVIDIA Apex's apex.amp imports",
    )


def _batch_trace_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--batch-trace",
        default=None,
        metavar="FILE|auto",
        help="CSV `step,batchsize`: the global batch of every optimizer step (multiples of --batch-size); auto: start "
        "at --batch-size x processes x --accum-steps and grow at each epoch's start towards the measured gradient "
        "noise scale, up to --max-global-batch, writing the trace to the run folder (batch_trace.csv)",
    )
    g.add_argument(
        "--max-global-batch",
        type=positive_int,
        default=None,
        help="--batch-trace auto: the largest global batch (default: 16 x the start batch, at most the training set)",
    )
    g.add_argument(
        "--trace-end",
        choices=("error", "repeat-last"),
        default="error",
        help="a trace shorter than the run: an error (default) or repeat its last batch size",
    )
    g.add_argument(
        "--batch-lr-rule",
        choices=("none", "linear", "root", "adascale"),
        default="none",
        help="LR of step i = LR x B_i / ref (linear), x sqrt of it (root), x AdaScale's gain",
    )
    g.add_argument(
        "--ref-batch-size",
        type=positive_int,
        default=None,
        help="the batch the LR is given for (default: the trace's first batch size)",
    )


def _early_stopping_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--early-stop-patience", type=int, default=0, help="epochs without improvement (0: off)")
    g.add_argument("--early-stop-delta", type=float, default=0.0, help="smallest change that counts")


def _ddp_performance_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm before DDP (CUDA only)")
    g.add_argument(
        "--precise-bn",
        type=int,
        default=0,
        metavar="SAMPLES",
        help="before each evaluation, recompute BatchNorm's running statistics with the current weights "
        "as the average over about SAMPLES training samples (whole micro-batches, split over the "
        "ranks; precise BN: for runs of few steps, such as very large batches); 0: off",
    )
    g.add_argument("--static-graph", action="store_true", help="DDP static_graph=True")
    g.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket size (default: 25)")
    g.add_argument(
        "--find-unused-parameters",
        action="store_true",
        help="DDP find_unused_parameters=True: for parameters some steps leave unused (MoE, branches); FSDP needs none",
    )
    g.add_argument("--channels-last", action="store_true", help="channels-last memory format")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (eager with a warning if not)")
