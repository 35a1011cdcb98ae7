"""Seeds, deterministic mode, the default model and torchvision models by name, EarlyStopping."""

import contextlib
import os
import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from customized_function import EarlyStopping, same_seeds, seed_worker, use_deterministic_algorithms
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


@contextlib.contextmanager
def deterministic_mode(show_warnings=True):
    """use_deterministic_algorithms() for the block, with warnings recorded; torch's modes, the warning filters and
    CUBLAS_WORKSPACE_CONFIG as they were afterwards."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    benchmark, workspace = torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every warning repeated (as -W always would): only ours may cut them
            use_deterministic_algorithms(show_warnings)
            yield caught
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def nondeterministic_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "does not have a deterministic implementation" in str(w.message)]


def test_deterministic_mode_warns_once_per_op_without_a_deterministic_kernel_instead_of_failing():
    """torch.Tensor.put_ has no deterministic kernel on any device: the run goes on, and says so once, by name."""
    with deterministic_mode() as caught:
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] in (":4096:8", ":16:8")
        for _ in range(3):  # as a training loop would, step after step
            torch.zeros(3).put_(torch.tensor([1]), torch.tensor([2.0]))
    (message,) = nondeterministic_warnings(caught)
    assert message.startswith("put_ does not have a deterministic implementation")


def test_deterministic_mode_on_ranks_that_do_not_print_is_silent():
    with deterministic_mode(show_warnings=False) as caught:
        torch.zeros(3).put_(torch.tensor([1]), torch.tensor([2.0]))
    assert nondeterministic_warnings(caught) == []


def batch_norm(index: int) -> list[str]:
    return [
        f"features.{index}.{key}" for key in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")
    ]


TOY_KEYS = {
    "toy": ["features.0.weight", *batch_norm(1), "features.3.weight", *batch_norm(4), "head.weight", "head.bias"],
    "toy3": ["features.0.weight", *batch_norm(1), "features.4.weight", *batch_norm(5), "features.8.weight"]
    + [*batch_norm(9), "head.weight", "head.bias"],
}


@pytest.mark.parametrize("name, keys", TOY_KEYS.items(), ids=TOY_KEYS)
def test_toy_models_keep_the_parameter_names_checkpoints_hold(name, keys):
    assert list(models.build(name, 1, 10).state_dict()) == keys


TILINGS = [((8, 8), 2, (4, 4)), ((28, 28), 2, (14, 14)), ((7, 7), 1, (7, 7)), ((4, 6), 2, (2, 3))]
OVERLAPS = [((7, 7), 2, None), ((1, 1), 2, None)]


@pytest.mark.parametrize("size, output, kernel", TILINGS + OVERLAPS)
def test_tiling_windows_average_as_adaptive_pooling_does(size, output, kernel):
    """Where the windows tile the input, avg_pool2d (the toy models' pooling under --deterministic on CUDA: its
    backward is deterministic there) gives adaptive pooling's means and gradients."""
    assert models.tiling_kernel(size, output) == kernel
    if kernel is None:
        return
    x = torch.randn(2, 3, *size, dtype=torch.float64, requires_grad=True)
    y = torch.randn(2, 3, output, output, dtype=torch.float64)
    ours, theirs = F.avg_pool2d(x, kernel), F.adaptive_avg_pool2d(x, output)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(*(torch.autograd.grad((pooled * y).sum(), x)[0] for pooled in (ours, theirs)))


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
    """Each conv and linear layer's weights have He's std, sqrt(2 / fan) (fan_out for a conv, fan_in for a linear
    layer), within half the gap to Xavier's, sqrt(2 / (fan_in + fan_out)): 1.6 % for the first conv, 1.9 % for the
    head. The weights of 400 seeds pooled make the std's sampling error 0.2 % at most (0.07 % for the head). Broken
    on purpose: Xavier's init (the first conv's std 1.7 % low), or fan_in for the convs (5.6 times too high)."""
    pooled = {}
    for seed in range(400):
        torch.manual_seed(seed)
        for name, module in models.build("toy", 1, 10, init="he").named_modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                pooled.setdefault(name, []).append(module.weight.detach().flatten())
    assert pooled.keys() == {"features.0", "features.3", "head"}
    for name, weights in pooled.items():
        shape = dict(models.build("toy", 1, 10).named_parameters())[f"{name}.weight"].shape
        fan_in, fan_out = shape[1:].numel(), shape[0] * shape[2:].numel()
        he = (2.0 / (fan_out if len(shape) == 4 else fan_in)) ** 0.5
        gap = abs(he / (2.0 / (fan_in + fan_out)) ** 0.5 - 1)
        assert torch.cat(weights).std().item() == pytest.approx(he, rel=gap / 2), name


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


def test_a_checkpoint_sets_the_random_state_it_saves():
    """A resume sets torch's random state from the checkpoint, and setting it makes cuDNN's RNN dropout (on CUDA)
    draw its own dropout state anew: so the run that writes the checkpoint sets it there too, and goes on drawing as
    the resumed run does. Fails when Training.state_dict only reads the state (tests/test_cuda.py checks the draws on
    a GPU)."""
    import tiny
    from torch import nn

    from ddp_tricks.training.state import Best

    model = nn.Linear(3, 2)
    t = tiny.training(model, torch.optim.SGD(model.parameters(), lr=0.1), best=Best("loss", "min"))
    with tiny.RandomStates() as watched:
        state = t.state_dict()
    assert [kind for kind, _ in watched.events] == ["set"]
    assert torch.equal(watched.events[0][1], state["rng"][0]["torch"])
