"""Distributed evaluation equals a single-process evaluation of the same weights, at world sizes 1, 2, 3."""

import pytest
import tiny
import torch
from multiproc import run_ranks
from torch import nn

from ddp_tricks import models
from ddp_tricks.data import images as image_data
from ddp_tricks.data import loaders as data
from ddp_tricks.training.loop import evaluate


def _model():
    torch.manual_seed(123)
    return models.build("toy", 1, 10)


def _evaluate_on_ranks(rank, world_size, n_val):
    _, val_set = image_data.digits()
    val = data.InMemoryDataset(val_set.inputs[:n_val], val_set.targets[:n_val])
    model = _model()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.fill_(float(rank))  # evaluate must use rank 0's statistics everywhere
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    t = tiny.training(model, optimizer)
    loader = data.val_loader(val, 16, rank, world_size, tiny.CPU)
    return evaluate(t, loader)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_distributed_eval_equals_single_process(world_size):
    n_val = 359  # divisible by neither 2 nor 3
    results = run_ranks(_evaluate_on_ranks, world_size, n_val, timeout=120)

    # Ground truth, written plainly: one process, one batch, mean loss and accuracy.
    _, val_set = image_data.digits()
    model = _model().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.fill_(0.0)
    x, y = val_set.inputs[:n_val], val_set.targets[:n_val]
    with torch.no_grad():
        logits = model(x)
    expected_loss = nn.functional.cross_entropy(logits.double(), y).item()
    expected_acc = (logits.argmax(1) == y).double().mean().item()
    for result in results:
        assert result["val_loss"] == pytest.approx(expected_loss, rel=1e-6)
        assert result["val_acc"] == pytest.approx(expected_acc, abs=1e-12)
