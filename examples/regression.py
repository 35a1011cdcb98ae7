"""Regression on scikit-learn's bundled diabetes data (442 patients, 10 features -> disease progression one year
later): an MLP, mean squared error, MAE and R² reported, the validation MAE monitored (lower is better).

    torchrun --standalone --nproc_per_node=2 run.py --task examples/regression.py:Diabetes \\
        --optimizer adamw -l 0.003 --wd 0.01 -b 16 -e 60

Written against the task seam only (see task.py): nothing else in the template knows about regression.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddp_tricks import InMemoryDataset

VAL_FRACTION, SPLIT_SEED = 0.2, 0


def split(num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed 80/20 split (train indices, validation indices), the same for every run and world size."""
    order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_val = round(num_samples * VAL_FRACTION)
    return order[n_val:], order[:n_val]


class Diabetes:
    """An MLP on the 10 standardised features; the target is standardised for training, metrics are in its units."""

    better = {"mae": "min", "r2": "max"}
    monitor = "mae"

    @staticmethod
    def add_arguments(parser) -> None:
        g = parser.add_argument_group("task: diabetes regression (examples/regression.py)")
        g.add_argument("--hidden", type=int, default=64, help="units in each of the MLP's two hidden layers")

    def __init__(self, args):
        if args.hidden < 1:
            from ddp_tricks import UserError

            raise UserError(f"--hidden must be a positive number of units, got {args.hidden}")
        self.hidden = args.hidden

    def datasets(self):
        from sklearn.datasets import load_diabetes

        x, y = (torch.tensor(a, dtype=torch.float32) for a in load_diabetes(return_X_y=True))
        train, val = split(len(y))
        x = (x - x[train].mean(0)) / x[train].std(0)
        self.target_mean, self.target_std = y[train].mean().item(), y[train].std().item()
        y = (y - self.target_mean) / self.target_std
        self.num_features = x.shape[1]
        return InMemoryDataset(x[train], y[train]), InMemoryDataset(x[val], y[val])

    def model(self):
        h = self.hidden
        return nn.Sequential(nn.Linear(self.num_features, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 1))

    def loss(self, outputs, targets):
        return F.mse_loss(outputs.squeeze(-1), targets)

    def metric_sums(self, outputs, targets):
        error = outputs.squeeze(-1) - targets
        return {"abs_error": error.abs().sum(), "sq_error": (error**2).sum(), "y": targets.sum(),
                "y_sq": (targets**2).sum()}  # fmt: skip

    def metrics(self, sums, count):
        """MAE in the target's own units; R² = 1 - SSE / SST, with SST = sum(y²) - (sum y)² / n."""
        total = sums["y_sq"] - sums["y"] ** 2 / count
        return {"mae": sums["abs_error"] / count * self.target_std, "r2": 1 - sums["sq_error"] / total}
