"""Checks of the parsed flags, before any process exists: impossible values one flag at a time, flags that
contradict each other or that the machine cannot do, and flags that would be ignored without another setting.
"""

from __future__ import annotations

import argparse
import copy

from ddp_tricks import schedules
from ddp_tricks.cli.image_flags import check_image_flags
from ddp_tricks.cli.init_flags import check_init_flags
from ddp_tricks.cli.optimizer_flags import ONLY_WITH as OPTIMIZER_ONLY_WITH
from ddp_tricks.cli.optimizer_flags import check_optimizer_flags
from ddp_tricks.cli.step_flags import check_step_flags
from ddp_tricks.errors import UserError


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> set[str]:
    """The destinations of the flags the command line spells out (not left at their defaults)."""
    parser = copy.deepcopy(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(argv)))


# Flags that act only with another setting: given without it, they would be accepted and ignored.
ONLY_WITH = (
    (("lookahead_k", "lookahead_alpha"), lambda cfg: cfg.lookahead, "--lookahead"),
    (("plateau_factor", "plateau_patience"), lambda cfg: cfg.scheduler == "plateau", "--scheduler plateau"),
    (("step_epochs", "step_gamma"), lambda cfg: cfg.scheduler == "step", "--scheduler step"),
    (("lr_power",), lambda cfg: cfg.scheduler == "poly", "--scheduler poly"),
    (
        ("end_lr",),
        lambda cfg: schedules.decay_kind(cfg.scheduler, cfg.warmup_type) in ("poly", "cosine"),
        "--scheduler poly or --scheduler cosine",
    ),
    (
        ("trust_coefficient", "epsilon"),
        lambda cfg: cfg.optimizer == "lars" or cfg.lars_wrap,
        "--optimizer lars or --lars-wrap",
    ),
    (("momentum", "nesterov"), lambda cfg: cfg.optimizer in ("sgd", "lars"), "--optimizer sgd or --optimizer lars"),
    (("trace_end",), lambda cfg: cfg.batch_trace and cfg.batch_trace != "auto", "--batch-trace FILE"),
    (("max_global_batch",), lambda cfg: cfg.batch_trace == "auto", "--batch-trace auto"),
    (
        ("ref_batch_size",),
        lambda cfg: cfg.batch_lr_rule in ("linear", "root") or (cfg.batch_trace and cfg.lr_scaling != "keep"),
        "--batch-lr-rule linear or --batch-lr-rule root (or a trace with --lr-scaling linear or sqrt)",
    ),
    (("early_stop_delta",), lambda cfg: cfg.early_stop_patience > 0, "--early-stop-patience N"),
    (
        ("static_graph", "bucket_cap_mb", "find_unused_parameters"),
        lambda cfg: cfg.strategy == "ddp",
        "--strategy ddp",
    ),
    (("prefetch_factor",), lambda cfg: cfg.workers > 0, "--workers N"),
    (("model_ema_warmup",), lambda cfg: cfg.model_ema is not None, "--model-ema DECAY"),
    (("base_batch_size",), lambda cfg: cfg.lr_scaling != "keep", "--lr-scaling linear or --lr-scaling sqrt"),
    *OPTIMIZER_ONLY_WITH,
)


def flag_name(parser: argparse.ArgumentParser, dest: str) -> str:
    """The long spelling of a destination, as --help shows it first (e.g. `--end-lr`)."""
    for action in parser._actions:
        if action.dest == dest:
            return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
    return dest


def check(
    cfg: argparse.Namespace, parser: argparse.ArgumentParser, given: set[str] | frozenset[str] = frozenset()
) -> None:
    """Impossible values and combinations, found before any process exists. `given`: the flags spelled out
    on the command line (`given_flags`), so a flag that would be ignored is refused rather than dropped."""
    _check_values(cfg)
    check_optimizer_flags(cfg)
    check_step_flags(cfg, given)
    check_init_flags(cfg)
    check_image_flags(cfg)
    _check_combinations(cfg)
    ignored = [(dest, needs) for dests, acts, needs in ONLY_WITH for dest in dests if dest in given and not acts(cfg)]
    if ignored:
        dest, needs = ignored[0]
        flag = flag_name(parser, dest)
        raise UserError(
            f"{flag} acts only with {needs}, so it would be ignored: add {needs.split(' or ')[0]} or drop {flag}"
        )


def _check_values(cfg: argparse.Namespace) -> None:
    """One flag at a time. Written `not value > 0` so that nan is refused too."""
    if not cfg.base_lr > 0:
        raise UserError(f"--base-lr must be > 0, got {cfg.base_lr}")
    if cfg.workers < 0:
        raise UserError(f"--workers must be >= 0, got {cfg.workers}")
    if cfg.precise_bn < 0:
        raise UserError(f"--precise-bn must be >= 0 (training samples; 0 turns it off), got {cfg.precise_bn}")
    if not cfg.warmup_epochs >= 0:
        raise UserError(f"--warmup-epochs must be >= 0, got {cfg.warmup_epochs}")
    if cfg.warmup_epochs > cfg.epochs:
        raise UserError(f"--warmup-epochs {cfg.warmup_epochs} exceeds --epochs {cfg.epochs}; shorten the warmup")
    if not 0.0 <= cfg.momentum < 1.0:
        raise UserError(f"--momentum must be in [0, 1), got {cfg.momentum}")
    if not cfg.weight_decay >= 0:
        raise UserError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    if not 0.0 < cfg.lookahead_alpha <= 1.0:
        raise UserError(f"--lookahead-alpha must be in (0, 1], got {cfg.lookahead_alpha}")
    if not cfg.trust_coefficient > 0:
        raise UserError(f"--trust-coefficient must be > 0, got {cfg.trust_coefficient}")
    if not cfg.epsilon >= 0:
        raise UserError(f"--epsilon must be >= 0, got {cfg.epsilon}")
    if not 0.0 < cfg.plateau_factor < 1.0:
        raise UserError(f"--plateau-factor must be in (0, 1), got {cfg.plateau_factor}")
    if cfg.plateau_patience < 0:
        raise UserError(f"--plateau-patience must be >= 0 (epochs without improvement), got {cfg.plateau_patience}")
    if not cfg.step_epochs > 0:
        raise UserError(f"--step-epochs must be > 0 (epochs between decays), got {cfg.step_epochs}")
    if not 0.0 < cfg.step_gamma <= 1.0:
        raise UserError(f"--step-gamma must be in (0, 1], got {cfg.step_gamma}")
    if not cfg.end_lr >= 0:
        raise UserError(f"--end-lr must be >= 0, got {cfg.end_lr}")
    if cfg.lr_power is not None and not cfg.lr_power > 0:
        raise UserError(f"--lr-power must be > 0, got {cfg.lr_power}")
    if not cfg.dist_timeout > 0:
        raise UserError(f"--dist-timeout must be > 0 seconds, got {cfg.dist_timeout}")
    if not cfg.sigterm_grace > 0:
        raise UserError(f"--sigterm-grace must be > 0 seconds, got {cfg.sigterm_grace}")
    for name in ("heartbeat_timeout", "hang_factor", "hang_timeout"):
        if not getattr(cfg, name) > 0:
            flag = "--" + name.replace("_", "-")
            raise UserError(f"{flag} must be > 0, got {getattr(cfg, name)}")
    if not cfg.bucket_cap_mb > 0:
        raise UserError(f"--bucket-cap-mb must be > 0, got {cfg.bucket_cap_mb}")
    if not cfg.early_stop_delta >= 0:
        raise UserError(f"--early-stop-delta must be >= 0, got {cfg.early_stop_delta}")
    if cfg.checkpoint_every_steps < 0:
        raise UserError(f"--checkpoint-every-steps must be >= 0, got {cfg.checkpoint_every_steps}")
    if cfg.early_stop_patience < 0:
        raise UserError(f"--early-stop-patience must be >= 0, got {cfg.early_stop_patience}")
    if cfg.model_ema is not None and not 0.0 < cfg.model_ema < 1.0:
        raise UserError(f"--model-ema DECAY must be in (0, 1), e.g. 0.999, got {cfg.model_ema}")
    if not cfg.clip_grad_norm >= 0:
        raise UserError(f"--clip-grad-norm must be >= 0, got {cfg.clip_grad_norm}")
    if cfg.name is not None and ("/" in cfg.name or cfg.name in ("", ".", "..")):
        raise UserError(f"--name {cfg.name!r} must be a plain folder name, without '/'")


def _check_combinations(cfg: argparse.Namespace) -> None:
    """Flags that contradict each other, and what the machine or the installed packages cannot do."""
    if cfg.optimizer == "lars" and cfg.lars_wrap:
        raise UserError(
            "--lars-wrap wraps the optimizer in LARS and --optimizer lars is LARS already: use one of them "
            "(--optimizer lars, or --optimizer sgd --lars-wrap)"
        )
    if cfg.warmup_type == "cosine" and cfg.scheduler not in ("constant", "cosine"):
        raise UserError(
            f"--warmup-type cosine means cosine decay after warmup, but --scheduler {cfg.scheduler} asks for "
            f"another decay: keep --scheduler {cfg.scheduler} with --warmup-type linear, or use --scheduler cosine"
        )
    if cfg.batch_trace and cfg.batch_trace != "auto" and cfg.accum_steps > 1:
        raise UserError("--batch-trace sets the accumulation of every step itself: drop --accum-steps")
    if cfg.batch_trace == "auto":
        _check_auto_batch(cfg)
    if cfg.drop_last and cfg.batch_trace:
        raise UserError("--drop-last has nothing to drop in a traced run (a trace's batches are whole micro-batches)")
    if cfg.batch_lr_rule != "none" and not cfg.batch_trace:
        raise UserError("--batch-lr-rule needs --batch-trace FILE")
    if cfg.nesterov and cfg.momentum == 0:
        raise UserError("--nesterov needs --momentum > 0")
    if cfg.backend == "nccl" and (cfg.device == "cpu" or _runs_on_cpu(cfg)):
        raise UserError("--backend nccl needs CUDA devices; use --backend gloo with --device cpu")
    if cfg.sync_bn and cfg.batch_trace:
        raise UserError(
            "--sync-bn cannot work with --batch-trace: a traced step gives the ranks different numbers of "
            "micro-batches (an idle rank none), and SyncBatchNorm needs every rank in each forward; drop one of them"
        )
    if cfg.sync_bn and _runs_on_cpu(cfg) and cfg.strategy != "fsdp":  # one process too: dropped silently there
        raise UserError("--sync-bn needs CUDA devices (SyncBatchNorm does not run on CPU/gloo); drop --sync-bn")
    if cfg.strategy == "fsdp":
        _check_fsdp(cfg)
    elif not cfg.meta_init:
        raise UserError("--no-meta-init acts only with --strategy fsdp (DDP builds the model on the CPU): drop it")
    if cfg.amp_backend == "apex":
        _check_apex()
    if cfg.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise UserError("--tensorboard needs the tensorboard package: pip install tensorboard") from None


def _check_auto_batch(cfg: argparse.Namespace) -> None:
    """--batch-trace auto grows the batch with the noise scale it measures from each step's micro-batches."""
    if not cfg.noise_scale:
        raise UserError("--batch-trace auto follows the gradient noise scale: drop --no-noise-scale")
    if cfg.batch_lr_rule == "adascale":
        raise UserError(
            "--batch-trace auto takes --batch-lr-rule linear, root or none (LARS/LAMB's trust ratios): AdaScale's "
            "schedule counts steps, which a batch chosen as the run goes cannot say ahead"
        )


def _runs_on_cpu(cfg: argparse.Namespace) -> bool:
    import torch

    return cfg.device == "cpu" or not torch.cuda.is_available()


def _check_apex() -> None:
    try:
        from apex import amp  # noqa: F401
    except ImportError:
        raise UserError(
            "--amp-backend apex needs NVIDIA Apex with apex.amp (removed from Apex in release 25.07); "
            "use native mixed precision: --amp fp16 or --amp bf16"
        ) from None


def _check_fsdp(cfg: argparse.Namespace) -> None:
    """What sharded training does not do, and why."""
    if cfg.batch_trace:
        raise UserError(
            "--strategy fsdp does not take --batch-trace: a traced run sums its ranks' gradients itself, while FSDP "
            "reduce-scatters them as it goes; use --strategy ddp for a batch trace"
        )
    if cfg.sync_bn:
        raise UserError("--sync-bn converts BatchNorm for DistributedDataParallel; drop it with --strategy fsdp")
    if cfg.channels_last:
        raise UserError(
            "--channels-last gives convolution weights a memory order FSDP2 cannot shard (it needs contiguous "
            "parameters); drop it with --strategy fsdp"
        )
    if cfg.amp_backend == "apex":
        raise UserError("--amp-backend apex wraps the whole model before DDP; use --amp with --strategy fsdp")
