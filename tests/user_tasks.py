"""Tasks of families the template does not ship, written from docs/tasks.md alone as a user would (#38), each
evaluated otherwise than by a mean of per-sample values:

- Segmentation: per-pixel classes on small synthetic images, the loss the mean over pixels (units() counts them),
  mIoU and pixel accuracy from a confusion matrix summed over the set (a metric sum with a shape);
- Retrieval: an embedding of the 8x8 digits, recall@1 over the whole validation set (is each digit's nearest other
  digit of its class?), from every rank's embeddings gathered (score() and `gathered`).

    torchrun --standalone --nproc_per_node=2 run.py --task tests/user_tasks.py:Segmentation -b 8 -e 2
    torchrun --standalone --nproc_per_node=2 run.py --task tests/user_tasks.py:Retrieval -b 16 -e 2 --strategy fsdp
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddp_tricks import InMemoryDataset

CLASSES = 4  # background and three kinds of rectangle


def rectangles(count: int, seed: int, size: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (count, 1, size, size) of 1 to 3 filled rectangles, each class its own brightness, with noise; the
    label of every pixel (count, size, size)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.zeros(count, size, size, dtype=torch.long)
    for n in range(count):
        for _ in range(int(torch.randint(1, 4, (), generator=g))):
            x, y = torch.randint(0, size - 3, (2,), generator=g).tolist()
            w, h = torch.randint(3, size // 2, (2,), generator=g).tolist()
            labels[n, y : y + h, x : x + w] = int(torch.randint(1, CLASSES, (), generator=g))
    images = labels.float().unsqueeze(1) / CLASSES + 0.3 * torch.randn(count, 1, size, size, generator=g)
    return images, labels


class Segmentation:
    better = {"miou": "max", "pixel_acc": "max"}
    monitor = "miou"

    def __init__(self, args):
        pass

    def datasets(self):
        return InMemoryDataset(*rectangles(96, 1)), InMemoryDataset(*rectangles(37, 2))

    def model(self):
        return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, CLASSES, 3, padding=1))

    def loss(self, outputs, targets):
        return F.cross_entropy(outputs, targets)  # the mean over pixels

    def units(self, inputs, targets):
        return targets.numel()

    def metric_sums(self, outputs, targets):
        predicted = outputs.argmax(1)
        confusion = torch.bincount((targets * CLASSES + predicted).flatten(), minlength=CLASSES**2)
        return {"confusion": confusion.reshape(CLASSES, CLASSES)}

    def metrics(self, sums, count):
        confusion = sums["confusion"]  # rows: the true class, columns: the predicted one
        hits = confusion.diag()
        union = confusion.sum(0) + confusion.sum(1) - hits
        present = union > 0
        return {"miou": float((hits[present] / union[present]).mean()), "pixel_acc": float(hits.sum()) / count}


class Retrieval:
    better = {"recall_at_1": "max"}
    monitor = "recall_at_1"
    gathered = ("embedding", "label")

    def __init__(self, args):
        pass

    def datasets(self):
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16
        y = torch.tensor(y)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
        train, val = order[:1200], order[1200:1461]  # 261 validation digits: 131 and 130 on 2 ranks
        return InMemoryDataset(x[train], y[train]), InMemoryDataset(x[val], y[val])

    def model(self):
        return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))

    def loss(self, outputs, targets):  # trained as a classifier on the embedding's first 10 dimensions
        return F.cross_entropy(outputs[:, :10], targets)

    def score(self, outputs, targets):
        return {"embedding": F.normalize(outputs, dim=1), "label": targets}

    def metrics(self, sums, count):
        embedding, label = sums["embedding"], sums["label"]
        similarity = embedding @ embedding.T
        similarity.fill_diagonal_(-2.0)  # a digit is not its own neighbour
        nearest = similarity.argmax(1)
        return {"recall_at_1": float((label[nearest] == label).double().mean())}


class FewRetrieval(Retrieval):
    """Retrieval with 5 validation digits (on 4 ranks at --val-batch-size 1, a rank may hold none of them), its
    metrics also counting the gathered rows: every digit once."""

    better = {"recall_at_1": "max", "rows": "max"}

    def datasets(self):
        train, val = super().datasets()
        return train, InMemoryDataset(val.inputs[:5], val.targets[:5])

    def metrics(self, sums, count):
        return super().metrics(sums, count) | {"rows": float(len(sums["label"]))}
