"""A batch's samples are the dataset items it was made of, whatever its structure (#38): targets that are a list of
dicts of boxes (a detector's), or a dict of labels concatenated over sequences with each sequence's count (CTC's).
The real loop at 1 and 2 ranks, with plain and cached accumulation: the global batch, samples per second, the
epoch's loss and the weights (every configuration of the same global batch trains the same weights)."""

import pytest
import torch
import torch.nn.functional as F
from multiproc import run_ranks
from torch import nn
from torch.utils.data import Dataset

from ddp_tricks import plan as planning
from ddp_tricks.data import loaders
from ddp_tricks.distributed.launch import Dist
from ddp_tricks.distributed.wrap import wrap
from ddp_tricks.schedules.curves import WarmupDecay
from ddp_tricks.schedules.schedule import Schedule
from ddp_tricks.training import cached
from ddp_tricks.training.loop import train_one_epoch
from ddp_tricks.training.precision import Precision
from ddp_tricks.training.state import Training

CPU = torch.device("cpu")
N_TRAIN, GLOBAL_BATCH = 44, 8  # 5 whole steps and a short last one of 4 samples, spread over its micro-batches


class Items(Dataset):
    """N samples: features (6,), 0 to 3 boxes (k, 4) with labels, and 1 to 3 labels of a sequence of 5 frames."""

    def __init__(self, n: int = N_TRAIN):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.frames = torch.randn(n, 5, 3, generator=g)
        counts = (torch.arange(n) * 7 + 3) % 4  # the first sample has 3 boxes: never the batch's samples
        self.boxes = [torch.rand(int(k), 4, generator=g) for k in counts]
        self.labels = [torch.randint(1, 4, (int(k) % 3 + 1,), generator=g) for k in counts]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return i


class Boxes:
    """Targets a list of one dict per sample (boxes of different counts); the loss the mean over samples of each
    sample's mean squared distance to its boxes (its prediction's square where it has none)."""

    def collate(self, indices):
        targets = [
            {"boxes": DATA.boxes[i], "labels": torch.ones(len(DATA.boxes[i]), dtype=torch.long)} for i in indices
        ]
        return DATA.x[indices], targets

    def model(self):
        torch.manual_seed(0)
        return nn.Linear(6, 4)

    def loss(self, outputs, targets):
        per_sample = [
            ((p - t["boxes"]) ** 2).mean() if len(t["boxes"]) else (p**2).mean() for p, t in zip(outputs, targets)
        ]
        return torch.stack(per_sample).mean()


class Sequences:
    """CTC: targets a dict of the batch's labels concatenated and each sequence's count; the loss the mean over
    labels (units() counts them)."""

    def collate(self, indices):
        data = DATA
        labels = [data.labels[i] for i in indices]
        return data.frames[indices], {"labels": torch.cat(labels), "lengths": torch.tensor([len(y) for y in labels])}

    def model(self):
        torch.manual_seed(0)
        return nn.Linear(3, 4)

    def loss(self, outputs, targets):
        log_probs = outputs.log_softmax(-1).transpose(0, 1)  # (frames, sequences, classes)
        frames = torch.full((outputs.shape[0],), outputs.shape[1], dtype=torch.long)
        nll = F.ctc_loss(log_probs, targets["labels"], frames, targets["lengths"], reduction="sum")
        return nll / targets["lengths"].sum()

    def units(self, inputs, targets):
        return targets["lengths"].sum()


DATA = Items()
TASKS = {"boxes": Boxes, "sequences": Sequences}


def _train(rank, world_size, kind, micro_batch, accumulation, lr=0.1):
    task = TASKS[kind]()
    task.better = {}
    accum_steps = GLOBAL_BATCH // (micro_batch * world_size)
    plan = planning.make(num_train=N_TRAIN, world_size=world_size, micro_batch=micro_batch, accum_steps=accum_steps,
                         epochs=1, seed=0, base_lr=0.1, lr_scaling="keep", base_batch=GLOBAL_BATCH,
                         warmup_epochs=0)  # fmt: skip
    steps = plan.epoch(1, rank)
    loader = loaders.train_loader(DATA, rank, CPU, seed=0, collate=task.collate)
    loader.batch_sampler.start(steps)
    model = task.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    t = Training(wrap(model, Dist(rank, world_size, rank, CPU, "gloo" if world_size > 1 else None)), optimizer,
                 Schedule(WarmupDecay(optimizer, 0, 0)), task, [], Precision("off", CPU), CPU, rank=rank,
                 world_size=world_size,
                 accumulation=cached.cached_accumulation if accumulation == "cached" else None)  # fmt: skip
    result = train_one_epoch(t, steps, loader)
    return result, [p.detach().clone() for p in model.parameters()]


def _plain(kind):
    """The epoch's loss at the initial weights, written plainly: each sample's loss alone, then the mean over
    samples (boxes) or over labels (sequences)."""
    task = TASKS[kind]()
    model = task.model()
    with torch.no_grad():
        losses = [task.loss(model(x), y) for x, y in (task.collate([i]) for i in range(N_TRAIN))]
    weights = torch.tensor([1.0 if kind == "boxes" else len(DATA.labels[i]) for i in range(N_TRAIN)])
    return float((torch.stack(losses) * weights).sum() / weights.sum())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind, configs", [
    ("boxes", [(1, 8, "plain"), (1, 4, "plain"), (2, 4, "plain"), (2, 2, "plain"), (1, 2, "cached"),
               (2, 2, "cached")]),
    ("sequences", [(1, 8, "plain"), (1, 4, "plain"), (2, 4, "plain"), (2, 2, "plain")]),
])  # fmt: skip
def test_the_global_batch_samples_per_second_and_weights_count_a_batch_s_items(kind, configs):
    """(world size, micro-batch, accumulation) for the global batch of 8; at a learning rate of 0, the epoch's loss
    is the plain mean over the samples (labels). Broken on purpose (a micro-batch's samples counted from the first
    dimension of its targets' first tensor, as before #38: the first sample's boxes, the labels concatenated), the
    global batch and samples per second are wrong, and so are the weights and the epoch's loss of the boxes."""
    results = {}
    for world_size, micro_batch, accumulation in configs:
        args = (kind, micro_batch, accumulation)
        ranks = run_ranks(_train, world_size, *args, timeout=120) if world_size > 1 else [_train(0, 1, *args)]
        results[(world_size, micro_batch, accumulation)] = ranks[0]
    reference = results[configs[0]][1]
    for config, (result, weights) in results.items():
        assert result["global_batch"] == pytest.approx(N_TRAIN / 6, rel=1e-12), config  # 44 samples in 6 steps
        assert result["samples_per_second"] * result["epoch_seconds"] == pytest.approx(N_TRAIN, rel=1e-12), config
        assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(weights, reference)), config
    still = run_ranks(_train, 2, kind, 2, "plain", 0.0, timeout=120)[0][0]  # fixed weights: the epoch's mean
    assert still["train_loss"] == pytest.approx(_plain(kind), rel=1e-6)
