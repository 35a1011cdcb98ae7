"""Rating prediction, as a recommender learns it: matrix factorisation with biases (a user table, an item table,
and a bias table of each) on synthetic ratings that behave like real ones (users who rate a few items or many, a
few popular items and a long tail, each user's and item's own bias, taste as a dot product of hidden factors,
noise, whole stars from 1 to 5), generated in memory from a fixed seed. RMSE and MAE in stars reported, the
validation RMSE monitored; and, in evaluation, the ROC AUC of "liked" (4 stars or more) against the predicted
rating: how often a liked pair is ranked above one that is not, over the whole validation set (its predictions are
gathered from every rank: `score()` and `gathered`, see docs/tasks.md). RMSE stays the monitored metric: it is what
the squared error trains; `--monitor-metric auc` follows the ranking instead.

    torchrun --standalone --nproc_per_node=2 run.py --task examples/recommender.py:Ratings --optimizer adam \\
        -l 0.01 -e 5                                                           # dense tables: RMSE 0.878
    torchrun --standalone --nproc_per_node=2 run.py --task examples/recommender.py:Ratings --sparse -l 2 -e 5
                                                                               # sparse tables: RMSE 0.945

--sparse gives the tables sparse gradients (nn.Embedding(sparse=True)): a step touches only the rows of its
batch's users and items, which is how large tables stay cheap. Plain SGD steps them (the only optimizer that
can: run.py refuses the others at start, and gives the tables no momentum and no weight decay); the template
averages them over the ranks on gloo, apart from DDP (distributed/sparse.py). A table row is used by few samples
of a batch, so it needs a larger LR than SGD's default 0.05.

Written against the task seam only (see task.py): nothing else in the template knows about recommenders.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ddp_tricks import InMemoryDataset

USERS, ITEMS, FACTORS, SEED, VAL_FRACTION = 600, 400, 6, 0, 0.2
LIKED = 4.0  # the stars from which a rating counts as liked (the AUC's positives)


def ratings(users: int = USERS, items: int = ITEMS, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs [N, 2] of user and item ids, ratings [N] in whole stars 1..5): the same for every run and rank."""
    g = torch.Generator().manual_seed(seed)
    activity = torch.exp(torch.randn(users, generator=g) * 0.8 + math.log(15)).clamp(3, items // 2).long()
    popularity = 1.0 / torch.arange(1, items + 1, dtype=torch.float64) ** 0.9  # Zipf: a few hits, a long tail
    popularity = popularity[torch.randperm(items, generator=g)]
    user_bias, item_bias = torch.randn(users, generator=g) * 0.4, torch.randn(items, generator=g) * 0.5
    taste = torch.randn(users, FACTORS, generator=g) / FACTORS**0.25
    traits = torch.randn(items, FACTORS, generator=g) / FACTORS**0.25
    user_ids = torch.repeat_interleave(torch.arange(users), activity)
    item_ids = torch.cat([torch.multinomial(popularity, int(n), generator=g) for n in activity])  # no repeats
    score = 3.6 + user_bias[user_ids] + item_bias[item_ids] + (taste[user_ids] * traits[item_ids]).sum(1)
    stars = (score + torch.randn(len(score), generator=g) * 0.5).round().clamp(1, 5)
    return torch.stack([user_ids, item_ids], dim=1), stars.float()


class Factorization(nn.Module):
    """Matrix factorisation with biases, its factors weighed by a learned vector (the GMF of He et al., 2017):
    rating = mean + user bias + item bias + w . (user factors * item factors). Four embedding tables; `w` dense."""

    def __init__(self, users: int, items: int, dim: int, sparse: bool, mean: float):
        super().__init__()
        self.user, self.item = nn.Embedding(users, dim, sparse=sparse), nn.Embedding(items, dim, sparse=sparse)
        self.user_bias, self.item_bias = nn.Embedding(users, 1, sparse=sparse), nn.Embedding(items, 1, sparse=sparse)
        for table in (self.user, self.item):
            nn.init.normal_(table.weight, std=0.1)
        for table in (self.user_bias, self.item_bias):
            nn.init.zeros_(table.weight)
        self.weigh = nn.Linear(dim, 1, bias=False)
        nn.init.ones_(self.weigh.weight)
        self.register_buffer("mean", torch.tensor(mean))

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        user, item = pairs[:, 0], pairs[:, 1]
        biases = self.user_bias(user) + self.item_bias(item)
        return self.mean + (biases + self.weigh(self.user(user) * self.item(item))).squeeze(-1)


def roc_auc(scores: torch.Tensor, positive: torch.Tensor) -> float:
    """The area under the ROC curve: the chance that a positive scores above a negative, ties counted half (the
    Mann-Whitney U over the ranks of all scores, tied scores sharing their mean rank). NaN without both classes. Its
    value does not depend on the order of the scores."""
    scores, positive = scores.double(), positive.bool()
    n_pos = int(positive.sum())
    n_neg = len(scores) - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    ordered, order = scores.sort()
    _, group, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).double()  # the 1-based rank of each tie group's last score
    mean_rank = last - (counts.double() - 1) / 2
    ranks = torch.empty_like(scores)
    ranks[order] = mean_rank[group]
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


class Ratings:
    """Predicted stars against the given ones: mean squared error trained, RMSE and MAE reported, and in evaluation
    the ROC AUC of liked ratings (4 stars or more) over the whole validation set."""

    better = {"rmse": "min", "mae": "min", "auc": "max"}
    monitor = "rmse"
    gathered = ("predicted", "liked")  # score()'s states gathered over the whole set: rows, not sums

    @staticmethod
    def add_arguments(parser) -> None:
        g = parser.add_argument_group("task: rating prediction (examples/recommender.py)")
        g.add_argument("--sparse", action="store_true", help="sparse gradients for the embedding tables")
        g.add_argument("--embedding-dim", type=int, default=16, help="width of each user's and item's embedding")

    def __init__(self, args):
        if args.embedding_dim < 1:
            from ddp_tricks import UserError

            raise UserError(f"--embedding-dim must be a positive width, got {args.embedding_dim}")
        self.sparse, self.dim = args.sparse, args.embedding_dim

    def datasets(self):
        pairs, stars = ratings()
        order = torch.randperm(len(stars), generator=torch.Generator().manual_seed(SEED))
        n_val = round(len(stars) * VAL_FRACTION)
        train, val = order[n_val:], order[:n_val]
        self.mean = stars[train].mean().item()
        return InMemoryDataset(pairs[train], stars[train]), InMemoryDataset(pairs[val], stars[val])

    def model(self):
        return Factorization(USERS, ITEMS, self.dim, self.sparse, self.mean)

    def loss(self, outputs, targets):
        return F.mse_loss(outputs, targets)

    def metric_sums(self, outputs, targets):
        error = outputs - targets
        return {"sq_error": (error**2).sum(), "abs_error": error.abs().sum()}

    def score(self, outputs, targets):  # a validation batch: its sums, and its rows for the AUC
        return self.metric_sums(outputs, targets) | {"predicted": outputs, "liked": targets >= LIKED}

    def metrics(self, sums, count):
        reported = {"rmse": math.sqrt(sums["sq_error"] / count), "mae": sums["abs_error"] / count}
        if "predicted" in sums:  # evaluation: every validation rating's prediction, from every rank
            reported["auc"] = roc_auc(sums["predicted"], sums["liked"])
        return reported
