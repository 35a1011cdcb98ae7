"""A dataset held as one tensor of inputs and one of targets: a batch is one indexing operation."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class InMemoryDataset(Dataset):
    """Samples held as one tensor: a batch is one indexing operation, with no per-sample Python."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor):
        if len(inputs) != len(targets):
            raise ValueError(f"{len(inputs)} inputs but {len(targets)} targets")
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        return self.inputs[index], self.targets[index]
