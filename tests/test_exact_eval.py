"""Distributed evaluation equals a single-process evaluation of the same weights, at world sizes 1, 2, 3."""

import argparse

import pytest
import torch
from multiproc import run_ranks
from torch import nn

import data
import models
import schedulers
from engine import Training, evaluate


def _cfg():
    return argparse.Namespace(val_batch_size=16, workers=0, seed=0, prefetch_factor=2)


def _model():
    torch.manual_seed(123)
    return models.build("toy", 1, 10)


def _evaluate_on_ranks(rank, world_size, n_val):
    datasets = data._digits()
    val = data.InMemoryDataset(datasets.val_set.inputs[:n_val], datasets.val_set.targets[:n_val])
    model = _model()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.fill_(float(rank))  # evaluate must use rank 0's statistics everywhere
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    t = Training(model, optimizer, schedulers.Schedule(schedulers.WarmupDecay(optimizer, 0, 1)), torch.device("cpu"))
    loader = data.val_loader(_cfg(), val, rank, world_size, torch.device("cpu"))
    return evaluate(t, loader)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_distributed_eval_equals_single_process(world_size):
    n_val = 359  # divisible by neither 2 nor 3
    results = run_ranks(_evaluate_on_ranks, world_size, n_val, timeout=120)

    # Ground truth, written plainly: one process, one batch, mean loss and accuracy.
    datasets = data._digits()
    model = _model().eval()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.fill_(0.0)
    x, y = datasets.val_set.inputs[:n_val], datasets.val_set.targets[:n_val]
    with torch.no_grad():
        logits = model(x)
    expected_loss = nn.functional.cross_entropy(logits.double(), y).item()
    expected_acc = (logits.argmax(1) == y).double().mean().item()
    for result in results:
        assert result["val_loss"] == pytest.approx(expected_loss, rel=1e-6)
        assert result["val_acc"] == pytest.approx(expected_acc, abs=1e-12)
