"""Seeds, the default model and torchvision models by name, EarlyStopping."""

import random

import numpy as np
import pytest
import torch

from customized_function import EarlyStopping, same_seeds, seed_worker
from ddp_tricks import models


def test_same_seeds_repeats_python_numpy_and_torch():
    def draw():
        return random.random(), float(np.random.rand()), torch.rand(1).item()

    same_seeds(5)
    first = draw()
    same_seeds(5)
    assert draw() == first
    same_seeds(6)
    assert draw() != first


def test_seed_worker_seeds_numpy_from_torch():
    torch.manual_seed(1234)
    seed_worker(0)
    a = np.random.rand()
    torch.manual_seed(1234)
    seed_worker(0)
    assert np.random.rand() == a


@pytest.mark.parametrize("name", ["toy", "toy3"])
@pytest.mark.parametrize("channels, size", [(1, 1), (1, 7), (1, 8), (1, 14), (1, 28), (3, 32), (3, 224)])
def test_toy_model_fits_any_input(name, channels, size):
    model = models.build(name, channels, 7)
    assert model(torch.randn(2, channels, size, size)).shape == (2, 7)


def test_toy3_runs_its_blocks_at_full_half_and_quarter_resolution():
    model = models.build("toy3", 1, 10)
    convs = [m for m in model.features if isinstance(m, torch.nn.Conv2d)]
    shapes = []
    hooks = [c.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape[1:]))) for c in convs]
    model(torch.randn(2, 1, 14, 14))
    for h in hooks:
        h.remove()
    assert shapes == [(32, 14, 14), (64, 7, 7), (128, 4, 4)]  # docs/large-batch.md describes toy3 so


def test_torchvision_model_by_name_with_grey_input():
    model = models.build("resnet18", 1, 10)
    assert model(torch.randn(2, 1, 32, 32)).shape == (2, 10)


def test_he_init_gives_kaiming_scale():
    torch.manual_seed(0)
    model = models.build("toy", 1, 10, init="he")
    w = model.head.weight
    assert w.std().item() == pytest.approx((2.0 / w.shape[1]) ** 0.5, rel=0.15)


def test_early_stopping_counts_epochs_without_improvement():
    stopper = EarlyStopping(patience=2, delta=0.1)
    decisions = []
    for loss in [1.0, 0.95, 0.8, 0.85, 0.79, 0.5]:
        stopper(loss)
        decisions.append((stopper.counter, stopper.early_stop))
    # 0.95 is not better than 1.0 by more than 0.1; 0.8 is; 0.85 and 0.79 are not -> stop after 0.79.
    assert decisions[:5] == [(0, False), (1, False), (0, False), (1, False), (2, True)]
    restored = EarlyStopping(patience=2)
    restored.load_state_dict(stopper.state_dict())
    assert restored.early_stop and restored.best == 0.5  # a later best is still recorded


def test_early_stopping_max_mode():
    stopper = EarlyStopping(patience=1, mode="max")
    stopper(0.5)
    assert stopper(0.6) is True and not stopper.early_stop
    stopper(0.6)
    assert stopper.early_stop
