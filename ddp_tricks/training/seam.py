"""The task as the loop calls it (task.py's seam): the pre-flight check of a task on a few training samples, and
the reported metrics from sums over a whole set.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_tricks.errors import UserError


def report(task, sum_names: list[str], prefix: str, values: list[float], count: float) -> dict[str, float]:
    """`{prefix}_loss` and `{prefix}_<metric>` from a set's sums: [loss x samples, *metric sums] over `count`."""
    count = max(count, 1.0)  # an epoch with no step left (resumed at its very end) has no samples
    sums = dict(zip(sum_names, values[1:]))
    metrics = task.metrics(sums, count) if hasattr(task, "metrics") else {k: v / count for k, v in sums.items()}
    return {f"{prefix}_loss": values[0] / count} | {f"{prefix}_{k}": float(v) for k, v in metrics.items()}


def check_task(task, model: nn.Module, dataset) -> list[str]:
    """One forward pass and loss on four training samples, before any process group: initialises lazy modules,
    and turns a model that does not fit the loss into one line. Returns the task's metric-sum names."""
    inputs, targets = torch.utils.data.default_collate([dataset[i] for i in range(min(4, len(dataset)))])
    training = model.training
    model.eval()  # no BatchNorm statistics change
    try:
        with torch.no_grad():
            outputs = model(inputs)
            loss = task.loss(outputs.float(), targets)
            sums = task.metric_sums(outputs.float(), targets) if hasattr(task, "metric_sums") else {}
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]
        raise UserError(
            f"the task's model output (on inputs of shape {tuple(inputs.shape)}) does not fit its loss or metrics "
            f"({reason}); make model() return what loss() expects"
        ) from None
    finally:
        model.train(training)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UserError("the task's loss() must return the batch mean as a scalar tensor, e.g. F.mse_loss(...)")
    shaped = [k for k, v in sums.items() if not isinstance(v, torch.Tensor) or v.dim() != 0]
    if shaped:
        raise UserError(f"the task's metric_sums() must give scalar tensors (batch sums); {shaped[0]!r} is not")
    modes = getattr(task, "better", {})
    if any(mode not in ("min", "max") for mode in modes.values()):
        raise UserError(f"the task's `better` must map each metric to 'min' or 'max', got {modes}")
    values = [float(loss) * len(targets), *(float(v) for v in sums.values())]
    try:  # the names metrics() reports, from these samples' sums (a degenerate sample may not compute: no check)
        reported = set(report(task, list(sums), "", values, float(len(targets)))) - {"_loss"}
    except ArithmeticError:
        reported = None
    declared = {f"_{name}" for name in getattr(task, "better", {})}
    if reported is not None and reported != declared:
        raise UserError(
            f"the task reports metrics {sorted(m[1:] for m in reported)} but its `better` names "
            f"{sorted(m[1:] for m in declared)}: give each reported metric 'min' or 'max' in `better`"
        )
    return list(sums)
