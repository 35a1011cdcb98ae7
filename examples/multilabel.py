"""Multi-label classification with a model that needs the input shape: every 8x8 digit (scikit-learn's bundled
set) gets four yes/no labels at once (even, prime, five or more, drawn with a closed loop: 0 6 8 9), and an MLP
whose first layer is `nn.LazyLinear` learns its input size from the data. The template runs one forward pass
before it builds the optimizer and DDP, so lazy modules need nothing more. Binary cross-entropy; micro-F1
(monitored, higher is better), exact-match accuracy and per-label accuracy, all from sums: exact across ranks.

    torchrun --standalone --nproc_per_node=2 run.py --task examples/multilabel.py:DigitAttributes -e 20
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

LABELS = {"even": (0, 2, 4, 6, 8), "prime": (2, 3, 5, 7), "five_or_more": (5, 6, 7, 8, 9), "loop": (0, 6, 8, 9)}


class DigitAttributes:
    better = {"f1": "max", "exact": "max", "label_acc": "max"}
    monitor = "f1"

    @staticmethod
    def add_arguments(parser) -> None:
        g = parser.add_argument_group("task: digit attributes, multi-label (examples/multilabel.py)")
        g.add_argument("--hidden", type=int, default=128, help="units in the MLP's hidden layer")

    def __init__(self, args):
        if args.hidden < 1:
            from ddp_tricks import UserError

            raise UserError(f"--hidden must be a positive number of units, got {args.hidden}")
        self.hidden = args.hidden

    def datasets(self):
        from ddp_tricks.data import images

        train, val = images.digits()  # the built-in task's split and standardisation
        for dataset in (train, val):
            digits = dataset.targets
            dataset.targets = torch.stack([torch.isin(digits, torch.tensor(d)) for d in LABELS.values()], 1).float()
        return train, val

    def model(self):
        return nn.Sequential(nn.Flatten(), nn.LazyLinear(self.hidden), nn.ReLU(), nn.Linear(self.hidden, len(LABELS)))

    def loss(self, outputs, targets):
        return F.binary_cross_entropy_with_logits(outputs, targets)

    def metric_sums(self, outputs, targets):
        predicted = (outputs > 0).float()
        return {
            "true_positives": (predicted * targets).sum(),
            "false_positives": (predicted * (1 - targets)).sum(),
            "false_negatives": ((1 - predicted) * targets).sum(),
            "exact": (predicted == targets).all(1).sum(),
            "correct_labels": (predicted == targets).sum(),
        }

    def metrics(self, sums, count):
        tp, fp, fn = sums["true_positives"], sums["false_positives"], sums["false_negatives"]
        return {
            "f1": 2 * tp / max(2 * tp + fp + fn, 1.0),
            "exact": sums["exact"] / count,
            "label_acc": sums["correct_labels"] / (count * len(LABELS)),
        }
