"""Object detection with torchvision's own Faster R-CNN (`fasterrcnn_mobilenet_v3_large_320_fpn`, no pretrained
weights) on synthetic shapes drawn in memory from fixed seeds (squares, discs and triangles of random sizes and
colours on a noisy background, 1 to 3 per image): targets are a list of one dict per image (boxes and labels, of
different counts), the model returns a dict of losses in training and boxes with scores in evaluation. Evaluated by
its own `score()` (no validation loss): recall and mAP at IoU 0.5, over the whole validation set at any world size
(the detections of every rank gathered: `gathered`; docs/tasks.md).

    torchrun --standalone --nproc_per_node=2 run.py --task examples/detection.py:Shapes --optimizer adamw \\
        -l 0.001 -b 4 -e 12 --warmup-epochs 1 --scheduler cosine   # recall 0.881, mAP 0.426 (best 0.433)

A model that takes its targets in training (torchvision's detectors: `model(images, targets)`) gets them in its
inputs: `collate()` puts them there, and a small wrapper passes them on only in training mode.
Written against the task seam only (see task.py): nothing else in the template knows about detection.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import Dataset

CLASSES = ("square", "disc", "triangle")  # labels 1, 2, 3 (0 is the background, as torchvision counts)
TRAIN_SEED, VAL_SEED, IOU = 1, 2, 0.5


def draw(count: int, size: int, seed: int) -> tuple[torch.Tensor, list[dict]]:
    """`count` images (count, 3, size, size) with 1 to 3 shapes each, none overlapping, and their targets (boxes as
    x1, y1, x2, y2 in pixels, labels 1..3): the same for every run, rank and world size."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    images, targets = [], []
    for _ in range(count):
        image = torch.rand(3, 1, 1, generator=g) * 0.3 + 0.05 * torch.randn(3, size, size, generator=g)
        boxes, labels = [], []
        for _ in range(int(torch.randint(1, 4, (), generator=g))):
            for _ in range(20):  # a place that overlaps no shape so far
                side = int(torch.randint(size // 4, size // 2, (), generator=g))
                x, y = (int(v) for v in torch.randint(0, size - side + 1, (2,), generator=g))
                if all(x + side <= b[0] or b[2] <= x or y + side <= b[1] or b[3] <= y for b in boxes):
                    break
            else:
                continue
            label = int(torch.randint(1, len(CLASSES) + 1, (), generator=g))
            u, v = (cols - x) / side, (rows - y) / side  # 0..1 inside the box
            inside = (u >= 0) & (u < 1) & (v >= 0) & (v < 1)
            if label == 2:
                inside &= (u - 0.5) ** 2 + (v - 0.5) ** 2 < 0.25
            elif label == 3:
                inside &= v >= 2 * (u - 0.5).abs()  # apex at the top middle, base at the bottom
            colour = torch.rand(3, 1, 1, generator=g) * 0.5 + 0.5
            image = torch.where(inside, colour, image)
            boxes.append([x, y, x + side, y + side])
            labels.append(label)
        images.append(image)
        targets.append(
            {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4), "labels": torch.tensor(labels)}
        )
    return torch.stack(images), targets


class ShapeImages(Dataset):
    def __init__(self, count: int, size: int, seed: int):
        self.images, self.targets = draw(count, size, seed)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        return self.images[index], self.targets[index]


class Detector(nn.Module):
    """A torchvision detector called as the template calls a model, `model(inputs)`: its targets ride in the inputs
    and are passed on in training mode only (in eval mode it returns detections)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, batch: dict):
        return self.net(list(batch["images"]), batch["targets"] if self.training else None)


def match(detections: dict, truth: dict, iou: float = IOU) -> torch.Tensor:
    """Which detections are true positives: by descending score, each takes the unmatched ground-truth box of its
    class that it overlaps most, if by at least `iou` (PASCAL VOC's rule)."""
    from torchvision.ops import box_iou

    hit = torch.zeros(len(detections["boxes"]), dtype=torch.bool)
    if len(detections["boxes"]) == 0 or len(truth["boxes"]) == 0:
        return hit
    overlap = box_iou(detections["boxes"], truth["boxes"])
    overlap[detections["labels"][:, None] != truth["labels"][None, :]] = -1.0  # only a box of the same class
    taken = torch.zeros(len(truth["boxes"]), dtype=torch.bool)
    for i in detections["scores"].argsort(descending=True, stable=True).tolist():
        best = overlap[i].masked_fill(taken, -1.0).argmax()
        if overlap[i, best] >= iou and not taken[best]:
            hit[i], taken[best] = True, True
    return hit


def average_precision(scores: torch.Tensor, hit: torch.Tensor, positives: float) -> float:
    """The area under the precision-recall curve of one class (all-point interpolation: the precision at each recall
    is the best at that recall or above), its points at each distinct score (tied detections enter together, so the
    value does not depend on the order of the rows). NaN for a class with no ground-truth box."""
    if positives == 0:
        return math.nan
    if len(scores) == 0:
        return 0.0
    order = scores.argsort(descending=True)
    ranked, found = scores[order], hit[order].double().cumsum(0)
    last = torch.ones(len(ranked), dtype=torch.bool)
    last[:-1] = ranked[1:] != ranked[:-1]  # the last detection of each group of tied scores
    kept = torch.arange(1, len(ranked) + 1, dtype=torch.float64)[last]
    recall, precision = found[last] / positives, found[last] / kept
    precision = precision.flip(0).cummax(0).values.flip(0)
    return float(((recall - torch.cat([recall.new_zeros(1), recall[:-1]])) * precision).sum())


class Shapes:
    """Faster R-CNN (MobileNetV3-Large FPN, torchvision's, no pretrained weights) on synthetic shapes; its training
    loss the sum of torchvision's four; recall and mAP at IoU 0.5 reported, mAP monitored."""

    better = {"recall": "max", "map": "max"}
    monitor = "map"
    gathered = ("det_scores", "det_labels", "det_hits")  # every detection of the set, from every rank: for the mAP

    @staticmethod
    def add_arguments(parser) -> None:
        g = parser.add_argument_group("task: detection (examples/detection.py)")
        g.add_argument("--images", type=int, default=320, help="training images (a fifth as many for validation)")
        g.add_argument("--image-size", type=int, default=96, help="the images' side in pixels")

    def __init__(self, args):
        from ddp_tricks import UserError

        if args.images < 5 or args.image_size < 32:
            raise UserError(
                f"--images must be 5 or more and --image-size 32 or more, got {args.images}, {args.image_size}"
            )
        self.images, self.size = args.images, args.image_size

    def datasets(self):
        return ShapeImages(self.images, self.size, TRAIN_SEED), ShapeImages(self.images // 5, self.size, VAL_SEED)

    def collate(self, samples):
        images = torch.stack([image for image, _ in samples])
        targets = [target for _, target in samples]
        return {"images": images, "targets": targets}, targets

    def model(self):
        from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn
        from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead

        net = fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None,
            weights_backbone=None,
            num_classes=len(CLASSES) + 1,
            min_size=self.size,  # the images as they are: no resizing
            max_size=self.size,
            rpn_pre_nms_top_n_train=300,  # a few objects per small image: far fewer proposals and samples than
            rpn_post_nms_top_n_train=150,  # torchvision's defaults for 320-pixel photographs (CPU time)
            rpn_pre_nms_top_n_test=150,
            rpn_post_nms_top_n_test=75,
            rpn_batch_size_per_image=64,
            box_batch_size_per_image=64,
            box_detections_per_img=20,
        )
        # the box head's 1024-wide layers are most of the model's weights and time; 128 do for 3 classes
        net.roi_heads.box_head = TwoMLPHead(net.backbone.out_channels * 7 * 7, 128)
        net.roi_heads.box_predictor = FastRCNNPredictor(128, len(CLASSES) + 1)
        return Detector(net)

    def loss(self, outputs, targets):  # training mode: torchvision's losses (objectness, RPN boxes, classes, boxes)
        return sum(outputs.values())

    def score(self, outputs, targets):  # eval mode: the detections of each image against its boxes
        device = outputs[0]["scores"].device if outputs else torch.device("cpu")
        outputs = [{k: v.cpu() for k, v in d.items()} for d in outputs]  # matched on the host: a few boxes each
        targets = [{k: v.cpu() for k, v in t.items()} for t in targets]
        hits = [match(detections, truth) for detections, truth in zip(outputs, targets)]
        none = torch.zeros(0)
        states = {
            "boxes": torch.bincount(
                torch.cat([t["labels"] for t in targets] or [none.long()]), minlength=len(CLASSES) + 1
            ),
            "found": torch.cat(hits or [none.bool()]).sum(),  # the boxes some detection found: a sum
            "det_scores": torch.cat([d["scores"] for d in outputs] or [none]),  # rows: every detection
            "det_labels": torch.cat([d["labels"] for d in outputs] or [none.long()]),
            "det_hits": torch.cat(hits or [none.bool()]),
        }
        return {name: state.to(device) for name, state in states.items()}

    def metrics(self, sums, count):
        boxes = sums["boxes"]
        precisions = [
            average_precision(sums["det_scores"][mask].cpu(), sums["det_hits"][mask].cpu(), float(boxes[label]))
            for label in range(1, len(CLASSES) + 1)
            for mask in [sums["det_labels"] == label]
        ]
        found = [p for p in precisions if not math.isnan(p)]
        return {
            "recall": sums["found"] / max(float(boxes.sum()), 1.0),
            "map": sum(found) / len(found) if found else math.nan,
        }
