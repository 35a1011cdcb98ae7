"""--precise-bn: BatchNorm statistics recomputed as the plain average of batch statistics, checked against the
formulas written out here, on 2 gloo ranks against one process, and through run.py against the saved weights."""

import json

import pytest
import torch
from multiproc import run_ranks
from torch import nn

import run
from ddp_tricks.data import images as image_data
from ddp_tricks.training import precise_bn


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 3), nn.BatchNorm1d(3))


def _batches(seed, count, size=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, 4, generator=g) * 3 + 1 for _ in range(count)]


def _reference(net, batches):
    """Each BatchNorm's running mean/var as the average over the batches of the batch mean and unbiased variance,
    propagating through the first BatchNorm in training mode by its formula."""
    bn1, linear, _ = net
    means1, vars1, means2, vars2 = [], [], [], []
    for x in batches:
        m, v = x.mean(0), x.var(0, unbiased=False)
        means1.append(m), vars1.append(x.var(0, unbiased=True))
        h = (x - m) / torch.sqrt(v + bn1.eps) * bn1.weight + bn1.bias
        h = h @ linear.weight.T + linear.bias
        means2.append(h.mean(0)), vars2.append(h.var(0, unbiased=True))
    avg = lambda xs: torch.stack(xs).mean(0)  # noqa: E731
    return avg(means1), avg(vars1), avg(means2), avg(vars2)


def test_statistics_are_the_average_of_batch_statistics():
    net = _net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p))  # weights away from the identity, so the second layer's input depends on them
    for m in (net[0], net[2]):
        m.running_mean.fill_(7.0), m.num_batches_tracked.fill_(123)
    params = [p.detach().clone() for p in net.parameters()]
    net.eval()
    batches = _batches(1, 5)

    used = precise_bn.recompute(net, iter(batches + _batches(2, 3)), 5)  # more offered than asked for

    assert used == 5
    mean1, var1, mean2, var2 = _reference(net, batches)
    torch.testing.assert_close(net[0].running_mean, mean1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(net[0].running_var, var1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(net[2].running_mean, mean2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(net[2].running_var, var2, rtol=1e-5, atol=1e-5)
    assert not net.training  # mode, momentum, step count and parameters as they were
    assert net[0].momentum == 0.1 and int(net[0].num_batches_tracked) == 123
    assert all(torch.equal(a, b) for a, b in zip(params, net.parameters()))


def test_a_model_without_batchnorm_or_zero_batches_is_left_alone():
    assert precise_bn.recompute(nn.Linear(4, 2), iter(_batches(0, 2)), 2) == 0
    net = _net()
    before = net[0].running_var.clone()
    assert precise_bn.recompute(net, iter([]), 0) == 0
    assert torch.equal(net[0].running_var, before)


def test_too_few_batches_keep_the_old_statistics():
    net = _net()
    net[0].running_mean.fill_(5.0)
    with pytest.raises(ValueError, match="2 input batches where 4 were needed"):
        precise_bn.recompute(net, iter(_batches(0, 2)), 4)
    assert torch.all(net[0].running_mean == 5.0) and net[0].momentum == 0.1


def _on_ranks(rank, world_size):
    net = _net()
    offered = 4 if rank == 0 else 3  # ranks disagree: every rank must use the smallest count
    used = precise_bn.recompute(net, iter(_batches(10 + rank, offered)), offered)
    return used, [b.clone() for b in net.buffers()]


@pytest.mark.slow
def test_two_ranks_average_equals_one_process_over_all_their_batches():
    results = run_ranks(_on_ranks, 2, timeout=120)
    assert [used for used, _ in results] == [3, 3]
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=0)  # identical on every rank
    net = _net()  # single-process ground truth over the 3 + 3 batches (equal counts: the mean of the means)
    mean1, var1, mean2, var2 = _reference(net, _batches(10, 3) + _batches(11, 3))
    buffers = results[0][1]
    torch.testing.assert_close(buffers[0], mean1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(buffers[1], var1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(buffers[3], mean2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buffers[4], var2, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("first_step", [0, 9])
@pytest.mark.parametrize(("samples", "world_size", "expected"), [(200, 1, 7), (32, 1, 1), (65, 2, 2), (10**6, 1, 10)])
def test_samples_become_whole_micro_batches_per_rank(samples, world_size, expected, first_step):
    """ceil(samples / (micro-batch x ranks)), capped by the epoch's micro-batches (10 of 32 here), counted from the
    epoch's first micro-batch also when training left the loader at a later one (`first_step`: a resumed epoch)."""
    import tiny

    from ddp_tricks.plan import Step

    train, _ = image_data.digits()
    steps = [Step([list(range(i * 32, (i + 1) * 32))], 32, 32, 1.0) for i in range(10)]
    model = _net_cnn()
    t = tiny.training(model, torch.optim.SGD(model.parameters(), lr=0.1))
    from ddp_tricks.training import loop as engine

    assert (
        engine.recompute_bn_stats(
            t, tiny.loader_for(train, steps, first_step=first_step), steps, samples, 32, world_size
        )
        == expected
    )


def _net_cnn():
    from ddp_tricks import models

    torch.manual_seed(0)
    return models.build("toy", 1, 10)


def test_run_py_saves_the_statistics_of_the_whole_training_set(tmp_path):
    """One step per epoch (batch = the training set) and --precise-bn 1 (rounded up to one micro-batch): the
    saved first BatchNorm's statistics are the mean and unbiased variance of the first convolution's output over
    every training image, computed here from the saved weights."""
    train, _ = image_data.digits()
    argv = ["-b", str(len(train)), "-e", "2", "--warmup-epochs", "0", "-l", "0.5", "--precise-bn", "1",
            "--runs-dir", str(tmp_path), "-n", "r", "--no-progress"]  # fmt: skip
    assert run.main(argv) == 0
    state = torch.load(tmp_path / "r" / "last.pt", weights_only=True)["model"]
    conv = nn.functional.conv2d(train.inputs, state["features.0.weight"], padding=1)
    torch.testing.assert_close(state["features.1.running_mean"], conv.mean((0, 2, 3)), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(
        state["features.1.running_var"], conv.transpose(0, 1).reshape(conv.shape[1], -1).var(1), rtol=1e-4, atol=1e-5
    )
    assert json.loads((tmp_path / "r" / "config.json").read_text())["precise_bn"] == 1


@pytest.mark.slow
def test_precise_bn_brings_evaluation_to_the_trained_network(tmp_path):
    """Few large steps (10, LAMB at 0.1): without it the validation loss sits far above what the same weights score
    in training mode (measured 3.05 against the last step's training loss 1.59); with it, evaluation describes the
    trained network (1.51). Asserted: more than 1.5 times, and within 15 %. Broken on purpose: statistics not
    recomputed (precise_bn.py) leave 3.05 (the cause measured in docs/large-batch.md)."""
    val, train = {}, {}
    for n in (0, 1):
        argv = ["-b", "1437", "-e", "10", "--warmup-epochs", "1", "--optimizer", "lamb", "-l", "0.1",
                "--precise-bn", str(n), "--runs-dir", str(tmp_path), "-n", f"p{n}", "--no-progress"]  # fmt: skip
        assert run.main(argv) == 0
        rows = (tmp_path / f"p{n}" / "metrics.csv").read_text().splitlines()
        header, last = rows[0].split(","), rows[-1].split(",")
        val[n], train[n] = (float(last[header.index(name)]) for name in ("val_loss", "train_loss"))
    assert train[0] == train[1]  # the same training: only the evaluation's statistics differ
    assert val[0] > 1.5 * train[0] and val[0] > 1.5 * val[1], (val, train)
    assert val[1] == pytest.approx(train[1], rel=0.15), (val, train)


def test_bn_check_evaluates_the_same_weights_both_ways(tmp_path, capsys):
    """tools/bn_check.py: the saved statistics' line equals run.py's own evaluation of that checkpoint."""
    import importlib.util

    from multiproc import REPO

    argv = ["-b", "1437", "-e", "3", "--warmup-epochs", "0", "--optimizer", "lamb", "-l", "0.05",
            "--runs-dir", str(tmp_path), "-n", "r", "--no-progress"]  # fmt: skip
    assert run.main(argv) == 0
    last = (tmp_path / "r" / "metrics.csv").read_text().splitlines()
    header, row = last[0].split(","), last[-1].split(",")
    spec = importlib.util.spec_from_file_location("bn_check", REPO / "tools" / "bn_check.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    capsys.readouterr()
    assert tool.main([str(tmp_path / "r" / "last.pt"), "--samples", "1200", "--", "--dataset", "digits"]) == 0
    out = capsys.readouterr().out
    val_loss = float(row[header.index("val_loss")])
    assert f"val loss {val_loss:.4f}" in out.splitlines()[1]
    assert "statistics of 1200 training samples" in out.splitlines()[2]
