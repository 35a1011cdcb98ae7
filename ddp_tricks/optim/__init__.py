"""The optimizer a run names (`build.py`). The optimizers themselves stand at the top of the repository, each
usable alone: lars.py, lamb.py, lookahead.py. Here: the names the command line offers and each one's default
learning rate, without importing torch.
"""

from __future__ import annotations

NAMES = ("sgd", "adam", "adamw", "lars", "lamb", "muon")  # --optimizer

# The keys a task's parameter group may set beyond the template's own ('params', 'lr_mult', 'weight_decay', 'name'):
# each optimizer's own; 'lars' (False: no trust ratio) where a trust ratio is taken (LARS, LAMB, --lars-wrap).
OWN_KEYS = {
    "sgd": ("momentum", "dampening", "nesterov"),
    "adam": ("betas", "eps", "amsgrad"),
    "adamw": ("betas", "eps", "amsgrad"),
    "lars": ("momentum", "nesterov", "trust_coefficient", "eps"),
    "lamb": ("betas", "eps", "bias_correction", "trust_clip", "always_adapt"),
    "muon": ("momentum", "nesterov", "ns_steps", "betas", "eps"),  # Muon's, and its AdamW part's
}
TRUST_RATIO = ("lars", "lamb")  # the optimizers that take a trust ratio themselves


def group_keys(optimizer: str, lars_wrap: bool = False) -> tuple[str, ...]:
    """The keys a task's parameter group may set under `--optimizer optimizer [--lars-wrap]`."""
    trust = ("lars",) if optimizer in TRUST_RATIO or lars_wrap else ()
    return ("params", "lr_mult", "weight_decay", "name", *trust, *OWN_KEYS[optimizer])


# --base-lr when it is not given: each optimizer's own, picked by a grid on the built-in task (digits, the toy model,
# 2 processes x 32, 3 epochs; docs/tricks.md has the table). LARS multiplies its LR by a trust ratio of about
# --trust-coefficient (1e-3), so its useful LRs are ~100x SGD's: with SGD's 0.05 it did not learn (17.6 %).
# Muon's: AdamW's, as its RMS-matching LR rule means (docs/tricks.md).
DEFAULT_LR = {"sgd": 0.05, "adam": 0.003, "adamw": 0.003, "lars": 5.0, "lamb": 0.02, "muon": 0.003}
# --lars-wrap: over SGD the trust ratio scales the step as LARS's does; over Adam, AdamW and LAMB their running
# moments mostly cancel it (lars.LARSWrapper), and their own defaults did best wrapped too.
LARS_WRAPPED_LR = {"sgd": 5.0}


def default_lr(optimizer: str, lars_wrap: bool = False) -> float:
    """The learning rate `--optimizer optimizer [--lars-wrap]` takes when --base-lr is not given."""
    if lars_wrap and optimizer in LARS_WRAPPED_LR:
        return LARS_WRAPPED_LR[optimizer]
    return DEFAULT_LR[optimizer]


def described_defaults() -> str:
    """The defaults as --help shows them."""
    plain = ", ".join(f"{name} {lr:g}" for name, lr in DEFAULT_LR.items())
    wrapped = ", ".join(f"{name} {lr:g}" for name, lr in LARS_WRAPPED_LR.items())
    return f"{plain}; with --lars-wrap: {wrapped}, the others their own"
