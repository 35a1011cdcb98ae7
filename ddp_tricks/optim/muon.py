"""--optimizer muon: Muon (Jordan et al., 2024; torch.optim.Muon's update) on the hidden weight matrices and AdamW on
the rest, as one torch.optim.Optimizer (`MuonAdamW`); which parameters are hidden matrices (`is_hidden`); under FSDP
each matrix orthogonalised whole, once per step (ddp_tricks/shards.py: `whole_matrices`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.optim import Optimizer

from ddp_tricks.errors import UserError
from ddp_tricks.shards import local, whole_matrices

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic Newton-Schulz iteration
EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def newton_schulz(matrix: torch.Tensor, steps: int, coefficients=COEFFICIENTS, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation (`_zeropower_via_newtonschulz`) of a 2-D matrix, line for line: in
    bfloat16 as torch's, except a float64 matrix, which stays float64 (the exactness tests); returned in the
    matrix's dtype (bfloat16 to float32 is exact: the same sum as torch's `param.add_(update)`)."""
    a, b, c = coefficients
    x = matrix.to(torch.float64 if matrix.dtype == torch.float64 else torch.bfloat16)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x.div(x.norm().clamp(min=eps))  # the spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.T if tall else x).to(matrix.dtype)


def adjusted_lr(lr: float, shape: torch.Size) -> float:
    """Muon's LR for a matrix of `shape` (rows x the rest) by the RMS-matching rule (Moonshot, "Muon is Scalable for
    LLM Training", 2025; torch's adjust_lr_fn="match_rms_adamw"): 0.2 sqrt(max(A, B)) x lr, so one --lr serves Muon
    and AdamW alike."""
    rows, columns = shape[0], math.prod(shape[1:])
    return lr * 0.2 * math.sqrt(max(rows, columns))


class MuonAdamW(Optimizer):
    r"""Muon on the groups with ``muon=True`` (their parameters 2-D or more, each taken as a matrix of its first
    dimension by the rest), AdamW on the others, in one optimizer (one ``state_dict``, one LR schedule).

    Muon, as torch.optim.Muon, for a matrix W with gradient G::

        B = momentum * B + (1 - momentum) * G                  (B starts at 0)
        U = G + momentum * (B - G)    if nesterov, else B
        O = NewtonSchulz(U, ns_steps)                           (the whole matrix, also when it is sharded)
        W = W * (1 - lr * weight_decay) - adjusted_lr(lr, shape) * O

    AdamW, as torch.optim.AdamW, for every other parameter w::

        m = lerp(m, g, 1 - beta1),  v = beta2 * v + (1 - beta2) * g^2
        w = w * (1 - lr * weight_decay) - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

    Args:
        params: parameter groups, each with ``muon`` True or False (default True).
        lr: the learning rate of both (Muon's adjusted by ``adjusted_lr``) (default 1e-3).
        weight_decay: decoupled weight decay of both (default 0.1).
        momentum, nesterov, ns_steps: Muon's (defaults 0.95, True, 5).
        betas, eps: AdamW's (defaults (0.9, 0.999), 1e-8).
        shard_group: the process group FSDP2's parameters are sharded over (the mesh's shard dimension); None finds
            it from the parameters' own mesh.

    Sharded (FSDP2) matrices are dealt to the shard group's ranks once (largest first, each to the least loaded);
    each step the owner gathers its matrices' U, orthogonalises each whole and scatters the slices of O back.
    """

    shard_group = None  # torch pickles an optimizer without it; the unpickled one finds it

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        *,
        shard_group=None,
    ):
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr} (must be >= 0)")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Invalid momentum value: {momentum} (must be in [0, 1))")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
        if not (isinstance(ns_steps, int) and 0 <= ns_steps < 100):
            raise ValueError(f"Invalid ns_steps: {ns_steps} (must be an integer in [0, 100))")
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid betas: {betas} (each must be in [0, 1))")
        if not eps >= 0.0:
            raise ValueError(f"Invalid eps value: {eps} (must be >= 0)")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        betas=betas, eps=eps, muon=True)  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            flat = [p for p in group["params"] if p.ndim < 2]
            if group["muon"] and flat:
                raise ValueError(f"Muon takes matrices (2-D or more), got a parameter of shape {tuple(flat[0].shape)}")
        self.shard_group = shard_group

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        matrices = []  # (group, parameter, its U's local slice)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("MuonAdamW does not support sparse gradients; use dense gradients")
            if group["muon"]:
                matrices += [(group, p, self._momentum(group, p)) for p in params]
            elif params:
                self._adamw(group, params)
        if matrices:
            orthogonal = whole_matrices(
                [(p, u) for _, p, u in matrices],
                lambda u, group: newton_schulz(u, group["ns_steps"]),
                [group for group, _, _ in matrices],
                self.shard_group,
            )
            for (group, p, _), o in zip(matrices, orthogonal):
                w = local(p)
                w.mul_(1 - group["lr"] * group["weight_decay"])
                w.add_(o.view_as(w), alpha=-adjusted_lr(group["lr"], p.shape))
        return loss

    def _momentum(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        """Muon's U for `p` (its local slice): the momentum buffer moved toward the gradient, Nesterov's look-ahead."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf, g = local(state["momentum_buffer"]), local(p.grad)
        buf.lerp_(g, 1 - group["momentum"])
        return g.lerp(buf, group["momentum"]) if group["nesterov"] else buf.clone()

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            w, g, m, v = local(p), local(p.grad), local(state["exp_avg"]), local(state["exp_avg_sq"])
            w.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            correction1 = 1 - beta1 ** state["step"]
            correction2 = math.sqrt(1 - beta2 ** state["step"])
            w.addcdiv_(m, (v.sqrt() / correction2).add_(eps), value=-lr / correction1)


def is_hidden(name: str, p: torch.Tensor, module: nn.Module, head: set[str], apart: set[int]) -> bool:
    """Whether Muon steps `p` (named `name`, a parameter of `module`): a matrix (2-D or more) that is neither an
    embedding's table, nor the output head's (`head`: names), nor one the exclusion rule keeps out (`apart`: ids,
    such as a pos_embed listed in no_weight_decay())."""
    return p.ndim >= 2 and not isinstance(module, EMBEDDINGS) and name not in head and id(p) not in apart


def output_head(task, model: nn.Module) -> tuple[str, ...]:
    """The names of the output head's parameters, which Muon leaves to AdamW: the task's `output_head(model)` (a
    module, or None: no head kept out), else the model's last nn.Linear (in the order of model.modules())."""
    if callable(getattr(task, "output_head", None)):
        module = task.output_head(model)
    else:
        module = next((m for m in reversed(list(model.modules())) if isinstance(m, nn.Linear)), None)
    if module is None:
        return ()
    ids = {id(p) for p in module.parameters()}
    return tuple(name for name, p in model.named_parameters() if id(p) in ids)


def hidden_names(model: nn.Module, head: tuple[str, ...], apart: set[int] = frozenset()) -> list[str]:
    """The names of the parameters Muon steps (`is_hidden`), in the model's order."""
    found = []
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            if p.requires_grad and is_hidden(full, p, module, set(head), apart):
                found.append(full)
    return found


def check_matrices(model: nn.Module, head: tuple[str, ...]) -> None:
    """--optimizer muon on a model without a hidden matrix: one line."""
    if not hidden_names(model, head):
        shown = f" (the output head {', '.join(head)} is AdamW's)" if head else ""
        raise UserError(
            f"--optimizer muon orthogonalises hidden weight matrices, and the model has none{shown}: embeddings, the "
            "output head and parameters of one dimension go to AdamW; use --optimizer adamw"
        )


def muon_groups(model: nn.Module, groups: list[dict], head: tuple[str, ...], apart: set[int]) -> list[dict]:
    """Each group split into its hidden matrices (`muon`: True) and the rest (`muon`: False), same settings."""
    hidden = {id(p) for name, p in model.named_parameters() if name in set(hidden_names(model, head, apart))}
    result = []
    for group in groups:
        matrices = [p for p in group["params"] if id(p) in hidden]
        rest = [p for p in group["params"] if id(p) not in hidden]
        result += [group | {"params": matrices, "muon": True}] if matrices else []
        result += [group | {"params": rest, "muon": False}] if rest else []
    return result
