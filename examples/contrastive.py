"""SimCLR (Chen et al., 2020) on the 8x8 digits: two augmented views of every image (random shifts, contrast,
cut-out, noise), a small CNN encoder with BatchNorm, a projection head, and the NT-Xent loss over the GLOBAL batch:
every rank's embeddings are gathered (`gather_with_grad`), so each sample's negatives come from every rank, as
SimCLR's recipe has them. Reported by the standard linear probe (a logistic regression on the frozen encoder's
features of the training digits, fit at every evaluation, scored on the validation digits) and the contrastive
top-1 (how often a view's nearest embedding in the global batch is its pair's other view). With `--accum-steps N`
the loss is over all N micro-batches of a step (cached accumulation: exact, at one micro-batch's memory).

    torchrun --standalone --nproc_per_node=2 run.py --task examples/contrastive.py:SimCLR --optimizer lars \\
        --bn-bias-separately --base-lr 10 -b 64 --accum-steps 4 -e 30 --warmup-epochs 3 --scheduler cosine --wd 1e-4

(global batch 512: 2 ranks x 4 micro-batches of 64, the loss over all of them; docs/tasks.md has LARS against SGD).
The contrastive top-1 gathers too: in training, one more all-gather of the embeddings per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ddp_tricks import InMemoryDataset, UserError, gather_with_grad

FIXED_SEED = 1234  # the views of `--views fixed` and of the validation set: the same at any world size


def augment(images: torch.Tensor, background: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random view of each image (n, 1, 8, 8): shifted by up to 2 pixels, contrast scaled by 0.6-1.4, a 3x3
    square blanked (half of them), Gaussian noise (0.2). Drawn from `generator` (default: torch's own)."""
    n, size = len(images), images.shape[-1]

    def uniform(*shape):
        return torch.rand(*shape, generator=generator)

    padded = F.pad(images, (2, 2, 2, 2), value=background)
    rows = torch.randint(0, 5, (n, 1), generator=generator) + torch.arange(size)
    cols = torch.randint(0, 5, (n, 1), generator=generator) + torch.arange(size)
    view = padded[torch.arange(n)[:, None, None], 0, rows[:, :, None], cols[:, None, :]].unsqueeze(1)
    view = background + (view - background) * (0.6 + 0.8 * uniform(n, 1, 1, 1))
    corner = torch.randint(0, size - 2, (n, 2), generator=generator)
    span = torch.arange(size)
    inside_rows = (span >= corner[:, :1]) & (span < corner[:, :1] + 3)
    inside_cols = (span >= corner[:, 1:]) & (span < corner[:, 1:] + 3)
    blank = inside_rows[:, :, None] & inside_cols[:, None, :] & (uniform(n, 1, 1) < 0.5)
    view = torch.where(blank.unsqueeze(1), torch.full_like(view, background), view)
    return view + 0.2 * torch.randn(view.shape, generator=generator)


class Views(InMemoryDataset):
    """Digits as (image and two views stacked: (n, 3, 1, 8, 8), label), the views drawn anew for every batch."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, background: float):
        super().__init__(images, labels)
        self.background = background

    def __getitem__(self, index: int):
        inputs, labels = self.__getitems__([index])
        return inputs[0], labels[0]

    def __getitems__(self, indices: list[int]):
        images, labels = super().__getitems__(indices)
        views = [augment(images, self.background), augment(images, self.background)]
        return torch.stack([images, *views], 1), labels


def fixed_views(images: torch.Tensor, labels: torch.Tensor, background: float, seed: int) -> InMemoryDataset:
    """Digits with two views drawn once (the same at every epoch and world size)."""
    generator = torch.Generator().manual_seed(seed)
    views = [augment(images, background, generator), augment(images, background, generator)]
    return InMemoryDataset(torch.stack([images, *views], 1), labels)


class Encoder(nn.Sequential):
    """Three 3x3 convolutions (width, 2 x width, 2 x width), each with BatchNorm (or none), ReLU, then average
    pooling: a (2 x width)-dimensional feature per image."""

    def __init__(self, width: int, batchnorm: bool):
        layers, channels = [], 1
        for out, pool in ((width, False), (2 * width, True), (2 * width, False)):
            layers += [nn.Conv2d(channels, out, 3, padding=1, bias=not batchnorm)]
            layers += [nn.BatchNorm2d(out)] if batchnorm else []
            layers += [nn.ReLU(inplace=True)] + ([nn.MaxPool2d(2)] if pool else [])
            channels = out
        super().__init__(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.features = channels


class SimCLRNet(nn.Module):
    """The encoder and SimCLR's projection head (Linear, BatchNorm, ReLU, Linear). Called on (n, 3, 1, 8, 8): the
    views' projections {"z": (n, 2, dim)}, and in eval mode also the image's encoder features {"h": (n, F)}."""

    def __init__(self, width: int, dim: int, batchnorm: bool):
        super().__init__()
        self.encoder = Encoder(width, batchnorm)
        hidden = self.encoder.features
        norm = [nn.BatchNorm1d(hidden)] if batchnorm else []
        self.head = nn.Sequential(
            nn.Linear(hidden, hidden, bias=not batchnorm), *norm, nn.ReLU(), nn.Linear(hidden, dim)
        )
        self.evaluations = 0  # the linear probe is fit anew for every evaluation (--model-ema swaps other weights in)

    def train(self, mode: bool = True):
        if not mode:  # every evaluation starts with model.eval()
            self.evaluations += 1
        return super().train(mode)

    def forward(self, x: torch.Tensor) -> dict:
        n = len(x)
        views = torch.cat([x[:, 1], x[:, 2]])  # both views in one batch: BatchNorm sees 2n samples, as in SimCLR
        z = self.head(self.encoder(views)).unflatten(0, (2, n)).transpose(0, 1).contiguous()
        return {"z": z} if self.training else {"z": z, "h": self.encoder(x[:, 0])}


def nt_xent(a: torch.Tensor, b: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's NT-Xent over N pairs (rows of a and b, L2-normalised): each of the 2N embeddings against the other
    2N - 1, its pair's other view the positive; the mean over the 2N anchors."""
    z = torch.cat([a, b])
    n = len(a)
    similarity = (z @ z.T / temperature).masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), -torch.inf)
    positives = (torch.arange(2 * n, device=z.device) + n) % (2 * n)
    return F.cross_entropy(similarity, positives)


def fit_probe(features: torch.Tensor, labels: torch.Tensor, classes: int, l2: float = 1e-4):
    """Multinomial logistic regression on standardised features (full-batch L-BFGS, deterministic): the standard
    linear probe. Returns a function from features to class scores."""
    mean, std = features.mean(0), features.std(0) + 1e-6
    x = (features - mean) / std
    weight = torch.zeros(x.shape[1], classes, device=x.device, requires_grad=True)
    bias = torch.zeros(classes, device=x.device, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], lr=1, max_iter=200, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, labels) + l2 * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    weight, bias = weight.detach(), bias.detach()
    return lambda h: (h - mean) / std @ weight + bias


class TwoViews:
    """What SimCLR and BYOL (examples/byol.py) share: the digits in two views, and their evaluation, the contrastive
    top-1 of the projections over the global batch and a linear probe of the encoder. A subclass sets `self.args`
    (with its --views) and builds `self.net` (with `encoder` and `evaluations`) in model()."""

    better = {"top1": "max", "probe_acc": "max"}
    monitor = "probe_acc"
    shown_as = {"probe_acc": ("linear-probe accuracy", "%"), "top1": ("contrastive top-1", "%")}

    def datasets(self):
        from ddp_tricks.data import images

        train, val = images.digits()  # the built-in task's split and standardisation
        background = float(train.inputs.min())  # a blank pixel, standardised
        self.classes = int(train.targets.max()) + 1
        self._probe_data = (train.inputs, train.targets)  # the probe's training set: the clean training digits
        self._probe, self._probe_version = None, None
        if self.args.views == "fixed":
            train_set = fixed_views(train.inputs, train.targets, background, FIXED_SEED)
        else:
            train_set = Views(train.inputs, train.targets, background)
        return train_set, fixed_views(val.inputs, val.targets, background, FIXED_SEED + 1)

    def metric_sums(self, outputs, targets):
        """top1: of this rank's 2n views, those whose nearest other embedding in the global batch is their pair's
        other view. probe: this rank's images the linear probe classifies right (evaluation; NaN in training)."""
        z = F.normalize(outputs["z"], dim=-1)
        everyone, offset = gather_with_grad(z, return_offset=True)
        n, total = len(z), len(everyone)
        flat = torch.cat([everyone[:, 0], everyone[:, 1]])  # 2N embeddings: the first views, then the second
        mine = torch.arange(offset, offset + n, device=z.device)
        anchors = torch.cat([mine, mine + total])
        similarity = torch.cat([z[:, 0], z[:, 1]]) @ flat.T
        similarity[torch.arange(2 * n, device=z.device), anchors] = -torch.inf  # not itself
        positives = torch.cat([mine + total, mine])
        sums = {"top1": (similarity.argmax(1) == positives).sum() if n else torch.zeros((), device=z.device)}
        if "h" not in outputs:
            return sums | {"probe": torch.full((), torch.nan, device=z.device)}
        return sums | {"probe": (self.probe()(outputs["h"]).argmax(1) == targets).sum()}

    def metrics(self, sums, count):
        return {"top1": sums["top1"] / (2 * count), "probe_acc": sums["probe"] / count}

    @torch.no_grad()
    def probe(self):
        """The linear probe of the current weights: fit on the frozen encoder's features of the training digits
        (eval mode: BatchNorm's running statistics, rank 0's at evaluation), once per evaluation."""
        if self._probe is None or self._probe_version != self.net.evaluations:
            device = next(self.net.parameters()).device
            images, labels = (t.to(device) for t in self._probe_data)
            self._probe = fit_probe(self.net.encoder(images), labels, self.classes)
            self._probe_version = self.net.evaluations
        return self._probe


class SimCLR(TwoViews):
    """SimCLR on the digits; see the module's docstring."""

    @staticmethod
    def add_arguments(parser) -> None:
        g = parser.add_argument_group("task: SimCLR on the digits (examples/contrastive.py)")
        g.add_argument("--temperature", type=float, default=0.2, help="NT-Xent's temperature")
        g.add_argument("--width", type=int, default=32, help="the encoder's first convolution's channels")
        g.add_argument("--projection-dim", type=int, default=32, help="the projection head's output size")
        g.add_argument("--encoder-norm", choices=("batch", "none"), default="batch",
                       help="BatchNorm in the encoder and head, or none")  # fmt: skip
        g.add_argument("--views", choices=("random", "fixed"), default="random",
                       help="random: new views every batch; fixed: drawn once per image (for tests)")  # fmt: skip
        g.add_argument("--accumulation", choices=("cached", "plain"), default="cached",
                       help="with --accum-steps N: cached: the loss over the whole step (GradCache); plain: over "
                            "each micro-batch alone")  # fmt: skip

    def __init__(self, args):
        if not args.temperature > 0:
            raise UserError(f"--temperature must be > 0, got {args.temperature}")
        if args.width < 1 or args.projection_dim < 1:
            raise UserError("--width and --projection-dim must be positive")
        self.args = args
        self.cached_accumulation = args.accumulation == "cached"  # the seam: the loss is over the step's batch

    def model(self):
        self.net = SimCLRNet(self.args.width, self.args.projection_dim, self.args.encoder_norm == "batch")
        return self.net

    def loss(self, outputs, targets):
        """NT-Xent over the global batch: every rank's pairs gathered, each rank computing the same loss (a rank's
        gradient reaches its own embeddings; DDP's average then gives one process's gradient)."""
        z = gather_with_grad(F.normalize(outputs["z"], dim=-1))
        return nt_xent(z[:, 0], z[:, 1], self.args.temperature)
