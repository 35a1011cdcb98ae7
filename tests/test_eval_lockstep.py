"""Evaluation in lockstep by construction (#39): every rank runs the same number of validation batches, each global
batch dealt out over the ranks (rows differing by at most one, a batch empty only where the set is too small), so a
task whose loss() or metric_sums() calls torch.distributed itself (torch.distributed.nn.functional.all_gather, an
autograd gather of its own, an all_reduce) finishes on an uneven split, with one process's exact metrics."""

import pytest
import tiny
import torch
import torch.distributed as dist
import torch.nn.functional as F
from multiproc import run_ranks
from torch import nn

from ddp_tricks import InMemoryDataset
from ddp_tricks.data import loaders
from ddp_tricks.training import loop

TEMPERATURE = 0.5
SAMPLES, VAL_BATCH = 361, 60  # 181 and 180 on 2 ranks: an uneven split


# -- the split ---------------------------------------------------------------------------------------------------------


SPLITS = [
    (length, world, batch)
    for world in (1, 2, 3, 4, 7)
    for length in (1, 4, 7, 8, 25, 120, 121, 241, 361, 1000)
    for batch in (1, 2, 3, 60)
    if length >= world  # fewer samples than ranks: refused at start (loaders.check_sizes)
]


@pytest.mark.parametrize(("length", "world", "batch"), SPLITS)
def test_every_rank_runs_the_same_rounds_each_sample_once_rows_within_one(length, world, batch):
    """Broken on purpose (full global batches of world x batch, then the rest: 361 on 2 ranks at 60 as 120, 120, 120,
    1): failed for 34 splits (241 and 361 on 2 ranks at 60 among them): a batch empty where the split allows none."""
    samplers = [loaders.EvalSampler(length, world, rank, batch) for rank in range(world)]
    rounds = -(-length // (world * batch))  # as few batches as --val-batch-size allows
    assert {s.rounds for s in samplers} == {rounds}
    batches = [s.batches + [[]] * (s.rounds - len(s)) for s in samplers]  # the empty ones the loop runs itself
    assert sorted(i for b in batches for batch_ in b for i in batch_) == list(range(length))  # once each
    sizes = [[len(b[k]) for b in batches] for k in range(rounds)]
    assert all(max(s) <= batch and max(s) - min(s) <= 1 for s in sizes)
    # every batch holds a sample exactly where the split allows one for every rank in every batch
    assert all(min(s) >= 1 for s in sizes) == (length >= rounds * world)
    one = loaders.EvalSampler(length, 1, 0, world * batch).batches  # one process at world x batch: the same batches
    assert [sorted(i for b in batches for i in b[k]) for k in range(rounds)] == one
    for b in batches:  # a rank's empty batches come last: the loader yields the others
        assert all(len(x) for x in b[: len([x for x in b if x])])


# -- a loss and metric sums that call torch.distributed themselves -----------------------------------------------------


def _padded_gather(z: torch.Tensor) -> torch.Tensor:
    """Every rank's rows with torch.distributed.nn.functional.all_gather, which moves equal shapes: the rows counts
    first, each rank's rows padded to the longest, cut back after (what a loss must do where ranks' rows differ)."""
    if not dist.is_initialized():
        return z
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(z)]))
    counts = [int(c) for c in counts]
    padded = torch.cat([z, z.new_zeros(max(counts) - len(z), *z.shape[1:])])
    parts = torch.distributed.nn.functional.all_gather(padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


class _OwnGather(torch.autograd.Function):
    """A hand-written autograd gather (padded as above): backward sums the gradient over the ranks, keeps its rows."""

    @staticmethod
    def forward(ctx, z, counts):
        padded = torch.cat([z, z.new_zeros(max(counts) - len(z), *z.shape[1:])])
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded)
        rank = dist.get_rank()
        ctx.rows = slice(sum(counts[:rank]), sum(counts[: rank + 1]))
        return torch.cat([part[:n] for part, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad[ctx.rows], None


def _own_gather(z: torch.Tensor) -> torch.Tensor:
    if not dist.is_initialized():
        return z
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(z)]))
    return _OwnGather.apply(z, [int(c) for c in counts])


def _offset(rows: int) -> int:
    """Where this rank's rows start in the gathered batch (rank order)."""
    if not dist.is_initialized():
        return 0
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([rows]))
    return int(sum(counts[: dist.get_rank()]))


class SimCLRStyle:
    """Two fixed views of each digit; NT-Xent of this rank's anchors against the whole global batch, gathered with
    torch.distributed.nn.functional.all_gather (padded); `spread`: each row's squared distance to the global batch's
    mean, the mean from an all_reduce inside metric_sums()."""

    better = {"spread": "min"}
    monitor = "loss"
    gather = staticmethod(_padded_gather)

    def loss(self, outputs, targets):
        z = F.normalize(outputs, dim=-1)  # (rows, 2, d)
        everyone = type(self).gather(z)
        mine = slice(_offset(len(z)), _offset(len(z)) + len(z))
        flat = torch.cat([everyone[:, 0], everyone[:, 1]])
        n = len(everyone)
        similarity = (flat @ flat.T / TEMPERATURE).fill_diagonal_(-torch.inf)
        anchors = torch.cat([torch.arange(n)[mine], torch.arange(n)[mine] + n])
        positives = (anchors + n) % (2 * n)
        per_anchor = torch.logsumexp(similarity[anchors], 1) - similarity[anchors, positives]
        return per_anchor.mean()  # the mean over this rank's samples' anchors (2 per sample)

    def metric_sums(self, outputs, targets):
        flat = outputs.flatten(1).double()
        total = torch.cat([flat.sum(0), torch.tensor([len(flat)], dtype=torch.float64)])
        if dist.is_initialized():
            dist.all_reduce(total)
        mean = total[:-1] / total[-1].clamp(min=1)
        return {"spread": (flat - mean).square().sum()}

    def metrics(self, sums, count):
        return {"spread": float(sums["spread"]) / count}


class OwnGather(SimCLRStyle):
    gather = staticmethod(_own_gather)


def _data():
    from ddp_tricks.data import images

    val = images.digits()[0]  # the training digits: the validation ones are 359
    x = val.inputs[:SAMPLES].reshape(SAMPLES, -1)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    return InMemoryDataset(torch.stack([x, x + 0.3 * noise], 1), val.targets[:SAMPLES])


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 16))


def _evaluate(rank, world, task, batch, sharded=False):
    model = _model()
    if sharded:
        from ddp_tricks.distributed import fsdp

        model = fsdp.shard(model, [model[0], model[2]])
    t = tiny.training(model, torch.optim.SGD(model.parameters(), lr=0.1), rank=rank, world_size=world)
    t.task, t.sum_names = task, ["spread"]
    return loop.evaluate(t, loaders.val_loader(_data(), batch, rank, world, tiny.CPU))


def _on_two_ranks(rank, world):
    return {
        "all_gather": _evaluate(rank, world, SimCLRStyle(), VAL_BATCH),
        "own gather": _evaluate(rank, world, OwnGather(), VAL_BATCH),
        "fsdp": _evaluate(rank, world, SimCLRStyle(), VAL_BATCH, sharded=True),
        "batch 1": _evaluate(rank, world, SimCLRStyle(), 1),  # 181 rounds: rank 1 holds no sample of the last
    }


def _plain(data, model, sizes):
    """The test's own reference: NT-Xent and the spread over each global batch (contiguous, of these sizes), written
    out sample by sample; the means over all samples."""
    losses, spread, start = 0.0, 0.0, 0
    with torch.no_grad():
        for size in sizes:
            z = F.normalize(model(data.inputs[start : start + size]), dim=-1).double()
            flat = torch.cat([z[:, 0], z[:, 1]])
            n = len(z)
            for i in range(2 * n):
                logits = [flat[i] @ flat[j] / TEMPERATURE for j in range(2 * n) if j != i]
                positive = flat[i] @ flat[(i + n) % (2 * n)] / TEMPERATURE
                losses += (torch.logsumexp(torch.stack(logits), 0) - positive).item() / 2
            out = model(data.inputs[start : start + size]).reshape(size, -1).double()
            spread += (out - out.mean(0)).square().sum().item()
            start += size
    return losses / start, spread / start


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_loss_and_metric_sums_that_call_torch_distributed_finish_on_an_uneven_split_with_one_process_s_values():
    """Broken on purpose (each rank's samples cut into batches of 60 on their own: 4 batches on rank 0, 3 on rank 1,
    as before #39): rank 1 waited in the gather until gloo's 60 s timeout. Broken otherwise (a rank's empty round not
    run): the same timeout in the `--val-batch-size 1` evaluation."""
    got = run_ranks(_on_two_ranks, 2, timeout=240)
    assert got[0] == got[1]  # every rank reports the same
    one = _evaluate(0, 1, SimCLRStyle(), 2 * VAL_BATCH)  # one process at the global batch 2 x 60
    loss, spread = _plain(_data(), _model(), [91, 90, 90, 90])  # 361 in 4 batches of at most 120, as equal as can be
    assert one["val_loss"] == pytest.approx(loss, rel=1e-6) and one["val_spread"] == pytest.approx(spread, rel=1e-6)
    for way in ("all_gather", "own gather", "fsdp"):
        for key, value in one.items():
            assert got[0][way][key] == pytest.approx(value, rel=1e-6), (way, key)
    single = _evaluate(0, 1, SimCLRStyle(), 2)  # batch 1 on 2 ranks: one process's global batches of 2 (the last of 1)
    for key, value in single.items():
        assert got[0]["batch 1"][key] == pytest.approx(value, rel=1e-6), key


def test_a_task_that_says_it_calls_collectives_gets_equal_shares_of_every_step():
    """Broken on purpose (the attribute not read): no reason was given, so a world size that does not divide a step's
    micro-batches would run them in uneven shares, and the task's collectives would wait for a rank with fewer."""
    from ddp_tricks.training import preflight

    setup = preflight.Setup(world_size=3)
    assert preflight.equal_shares(setup, SimCLRStyle(), [], False) == ""  # evaluation alone needs nothing

    class InTraining(SimCLRStyle):
        collectives = True

    assert "the task's own collectives (collectives = True)" in preflight.equal_shares(setup, InTraining(), [], False)
