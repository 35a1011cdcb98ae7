"""What each component takes from the flags, under the component's own argument names: the plan's numbers, the
optimizer's, the schedule's and the loaders' settings, and the choices the start-up checks hold a task against.
Below run.py, components take these values, never the whole namespace. No torch import here.
"""

from __future__ import annotations

import argparse

from ddp_tricks.cli.image_flags import image_options, mixing_options
from ddp_tricks.cli.optimizer_flags import optimizer_flag_options
from ddp_tricks.schedules import decay_kind


def plan_options(flags: argparse.Namespace) -> dict:
    """plan.make's arguments that come from the flags as they are."""
    return {
        "micro_batch": flags.batch_size,
        "accum_steps": flags.accum_steps,
        "epochs": flags.epochs,
        "seed": flags.seed,
        "base_lr": flags.base_lr,
        "lr_scaling": flags.lr_scaling,
        "base_batch": flags.base_batch_size,
        "warmup_epochs": flags.warmup_epochs,
        "batch_lr_rule": flags.batch_lr_rule,
        "ref_batch": flags.ref_batch_size,
        "trace_end": flags.trace_end,
        "optimizer": flags.optimizer,
        "lr_power": flags.lr_power,
        "step_epochs": flags.step_epochs,
        "drop_last": flags.drop_last,
        "max_steps": flags.max_steps,
        "aug_repeats": flags.aug_repeats,
    }


def optimizer_options(flags: argparse.Namespace) -> dict:
    """optim.build.build's settings: the optimizer, its hyper-parameters, LARS wrapping and Lookahead."""
    return {
        "name": flags.optimizer,
        "momentum": flags.momentum,
        "nesterov": flags.nesterov,
        "weight_decay": flags.weight_decay,
        "trust_coefficient": flags.trust_coefficient,
        "eps": flags.epsilon,
        "bn_bias_separately": flags.bn_bias_separately,
        "lars_wrap": flags.lars_wrap,
        "lookahead": flags.lookahead,
        "lookahead_k": flags.lookahead_k,
        "lookahead_alpha": flags.lookahead_alpha,
        **optimizer_flag_options(flags),
    }


def schedule_options(flags: argparse.Namespace) -> dict:
    """schedule.build's settings beyond the plan's steps: what follows warmup, and its parameters."""
    return {
        "kind": decay_kind(flags.scheduler, flags.warmup_type),
        "end_lr": flags.end_lr,
        "gamma": flags.step_gamma,
        "plateau_factor": flags.plateau_factor,
        "plateau_patience": flags.plateau_patience,
    }


def loader_options(flags: argparse.Namespace) -> dict:
    """data.loaders.both's settings: the validation batch, the seed, worker processes and their prefetching."""
    return {
        "val_batch_size": flags.val_batch_size,
        "seed": flags.seed,
        "workers": flags.workers,
        "prefetch_factor": flags.prefetch_factor,
        "channels_last": flags.channels_last,
    }


def check_options(flags: argparse.Namespace) -> dict:
    """training.preflight.Setup's fields that the flags give (the launch gives the world size and the backend)."""
    return {
        "strategy": flags.strategy,
        "optimizer": flags.optimizer,
        "lars_wrap": flags.lars_wrap,
        "apex": flags.amp_backend == "apex",
        "fp16": flags.amp == "fp16",
        "ddp_waits_for_every_gradient": flags.strategy == "ddp"
        and not (flags.find_unused_parameters or flags.static_graph),
        "traced": flags.batch_trace is not None,
        "sync_bn": flags.sync_bn,
        "noise_scale": flags.noise_scale,
        "noise_scale_every": flags.noise_scale_every,
        "checkpointing": flags.activation_checkpointing,
        "fsdp_replicas": flags.fsdp_replicas,
        "count_flops": flags.log_interval > 0 and not (flags.eval_only or flags.plot_lr),
        "mixing": mixing_options(flags),
        "recipe": image_options(flags),
        "aug_repeats": flags.aug_repeats,
    }


def model_options(flags: argparse.Namespace) -> dict:
    """distributed.placement.build's settings: the strategy, the memory format and activation checkpointing."""
    return {
        "strategy": flags.strategy,
        "channels_last": flags.channels_last,
        "checkpointing": flags.activation_checkpointing,
    }


def hang_options(flags: argparse.Namespace) -> dict:
    """distributed.heartbeat.configure's thresholds: a silent rank, and no progress on any rank."""
    return {
        "heartbeat_timeout": flags.heartbeat_timeout,
        "hang_factor": flags.hang_factor,
        "hang_timeout": flags.hang_timeout,
    }
