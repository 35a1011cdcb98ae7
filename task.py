"""WHAT is trained: the datasets, the model, the loss and the metrics. The one file a fork edits.

The rest of the template (DDP, exact evaluation, accumulation, AMP, LARS/LAMB/Lookahead, schedules, early
stopping, batch traces, checkpoints, preemption, plots) reads a task through these names only:

    add_arguments(parser)        optional staticmethod: the task's own flags (shown by `run.py --help`)
    __init__(self, args)         the parsed flags: the task's own and the template's
    datasets(self)               -> (train_set, val_set): torch Datasets; a batch of them is (inputs, targets),
                                 each a tensor or a dict / tuple / dataclass of tensors
    model(self)                  -> nn.Module, called as model(inputs); called after datasets(), so it can use
                                 what they showed. It may return any structure: loss() and metric_sums() get it
    loss(self, outputs, targets) -> the MEAN loss over the batch's units (a scalar tensor)
    units(self, inputs, targets) optional: how many units that mean is over (real tokens, pixels); default:
                                 the batch's samples. Accumulation, uneven batches and evaluation weigh by them
    collate(self, samples)       optional: a list of dataset items -> one (inputs, targets) batch (padding)
    shard_units(self, model)     optional, --strategy fsdp: the blocks of the model sharded one by one, a
                                 list of modules as one unit (default: each direct child of the model that
                                 holds parameters, children that share a parameter as one unit)
    metric_sums(self, outputs, targets)  optional: {name: SUM over the batch}, a tensor of one shape in every
                                 batch (a count, per-class counts); sums stay exact across ranks
    metrics(self, sums, count)   optional: {reported name: value} from the sums over a whole set (and the rows
                                 `gathered` names), count = its units (default: each sum / count, under its name)
    score(self, outputs, targets)  optional: a validation batch's metric states from the model's eval-mode
                                 outputs (predictions), in place of loss() and metric_sums(): no val_loss, and
                                 `monitor` names a metric (a detector: examples/detection.py)
    gathered = ("scores",)       optional: score()'s states that are rows, concatenated over the whole validation
                                 set from every rank instead of summed (an AUC's scores: examples/recommender.py)
    better = {"acc": "max"}      every reported metric besides the loss, and whether higher or lower is better
    monitor = "loss"             the validation metric that picks best.pt and drives early stopping and
                                 ReduceLROnPlateau (`--monitor NAME` chooses another reported one)
    shown_as = {"acc": ("top-1 accuracy", "%")}   optional: how sweeps and figures name a metric, and its unit
    cached_accumulation = True   optional: with --accum-steps N, loss() gets the outputs of all N micro-batches of
                                 a step at once (GradCache: exact for a loss over the batch, such as a contrastive
                                 one; costs a second forward, keeps one micro-batch's memory)
    batch_transform(inputs, targets)  optional: a training batch on the device before the forward (v2.CutMix as it
                                 is), its draws seeded per (seed, step, micro-batch); --mixup/--cutmix: the built-in
    after_step(self, model, step, progress)  optional: once after every optimizer step taken, on every rank, under
                                 no_grad, with the unwrapped model, the run's step and its progress in (0, 1]: a
                                 teacher's EMA, a momentum schedule (examples/byol.py)
    state_dict(self), load_state_dict(self, state)  optional: the task's own state, checkpointed and resumed
    param_groups(self, model)    optional: [{"params": ..., "lr_mult": 0.1, "weight_decay": 0.0}, ...]: an LR
                                 multiplier and weight decay per group of parameters (fine-tuning); also "lars": False
                                 (no trust ratio) and the optimizer's own keys ("betas", "eps", "momentum", ...)
    optimizer(self, param_groups)  optional: any torch.optim.Optimizer built on the template's groups (RAdam, ...)
    output_head(self, model)     optional: the module --optimizer muon leaves to AdamW (default: the last Linear)

What a task file imports from the template comes from one place: `from ddp_tricks import InMemoryDataset,
UserError` (raise UserError for a mistake in the task's own flags: one line, exit 2). A loss over the global batch
uses `from ddp_tricks import gather_with_grad, rank, world_size`: gather_with_grad(z) is every rank's z, in rank
order, with gradients back to each rank's rows (the identity in one process); see docs/tasks.md. `python run.py --task
path/to/file.py:ClassName` trains a task from another file; examples/ has six. Heavy imports (torch,
torchvision) sit inside the methods so that `run.py --help` answers at once. docs/tasks.md has the rules in full.
"""

from __future__ import annotations

DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10", "imagefolder", "mnist-idx")
BACKENDS = ("torchvision", "gpu-decode", "dali")  # --dataset imagefolder's decoders (ddp_tricks/data/images.py)


class Task:
    """Image classification: digits (default, ships with scikit-learn), MNIST-like, CIFAR-10, image folders;
    the small CNN or any torchvision classifier; cross-entropy; top-1 accuracy."""

    better = {"acc": "max"}
    monitor = "loss"
    shown_as = {"acc": ("top-1 accuracy", "%")}  # how sweeps and figures name the metric, and its unit

    @staticmethod
    def add_arguments(parser) -> None:
        g = parser.add_argument_group("task: image classification (task.py)")
        g.add_argument("--dataset", choices=DATASETS, default="digits",
                       help="digits: scikit-learn's bundled 8x8 digits, no download")  # fmt: skip
        g.add_argument("-d", "--data-root", "--data_path", dest="data_root", default="data",
                       help="folder holding mnist/fashion-mnist/cifar10/mnist-idx files")  # fmt: skip
        g.add_argument("--download", action="store_true", help="let torchvision download the dataset")
        g.add_argument("--train-dir", default=None, help="imagefolder: training images, one folder per class")
        g.add_argument("--val-dir", default=None, help="imagefolder: validation images, one folder per class")
        g.add_argument("--image-size", type=int, default=None,
                       help="imagefolder: crop size (default 224); digits, mnist-idx, mnist, fashion-mnist: resize "
                            "every image to SIZE x SIZE once at load (default: as stored)")  # fmt: skip
        g.add_argument("--data-backend", choices=BACKENDS, default="torchvision",
                       help="imagefolder: where JPEGs are decoded: torchvision (CPU workers, uint8 batches), "
                            "gpu-decode (decode_jpeg on the GPU), dali (NVIDIA DALI, an extra)")  # fmt: skip
        g.add_argument("--model", default="toy",
                       help="toy (a small CNN for any input size), toy3 (three blocks, learns more per step) "
                            "or a torchvision classifier name")  # fmt: skip
        g.add_argument("--init", choices=("default", "he"), default="default",
                       help="he: Kaiming-normal init of conv and linear weights")  # fmt: skip
        g.add_argument("--label-smoothing", "--smoothing", type=float, default=0.0,
                       help="cross-entropy label smoothing (--smoothing: timm's name)")  # fmt: skip

    def __init__(self, args):
        from ddp_tricks import UserError

        if args.dataset == "imagefolder" and not (args.train_dir and args.val_dir):
            raise UserError("--dataset imagefolder needs --train-dir and --val-dir (one sub-folder per class)")
        folders = [flag for flag, path in (("--train-dir", args.train_dir), ("--val-dir", args.val_dir)) if path]
        if folders and args.dataset != "imagefolder":  # said, not ignored: the run would train on the other data
            raise UserError(
                f"{folders[0]} is read only with --dataset imagefolder, and this run trains on --dataset "
                f"{args.dataset}: add --dataset imagefolder, or leave {' and '.join(folders)} out"
            )
        if args.data_backend != "torchvision" and args.dataset != "imagefolder":
            raise UserError(f"--data-backend {args.data_backend} applies to --dataset imagefolder only; leave it out")
        if not 0.0 <= args.label_smoothing < 1.0:
            raise UserError(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
        if args.image_size is not None and args.image_size < 1:
            raise UserError(f"--image-size must be a positive integer, got {args.image_size}")
        if args.image_size is not None and args.dataset == "cifar10":
            raise UserError("--image-size does not apply to --dataset cifar10 (its 32x32 crops); leave it out")
        from ddp_tricks import models

        models.check_name(args.model)
        self.args = args

    def datasets(self):
        from ddp_tricks.cli.image_flags import image_options
        from ddp_tricks.data import images
        from ddp_tricks.data.recipe import ImageRecipe

        a = self.args
        if a.dataset == "digits":
            train, val = images.digits()
        elif a.dataset == "mnist-idx":
            train, val = images.mnist_idx(a.data_root)
        elif a.dataset in ("mnist", "fashion-mnist"):
            train, val = images.mnist_like(a.dataset, a.data_root, a.download)
        elif a.dataset == "cifar10":
            train, val = images.cifar10(a.data_root, a.download)
        else:
            recipe = ImageRecipe(**image_options(a))  # timm's flags: the crop, --aa, erasing, mean and std
            train, val = images.image_folders(a.train_dir, a.val_dir, a.image_size or 224, True, a.data_backend, recipe)
        if a.image_size and a.dataset in ("digits", "mnist-idx", "mnist", "fashion-mnist"):
            train, val = images.resized(train, a.image_size), images.resized(val, a.image_size)
        shape = getattr(train, "image_shape", None) or tuple(train[0][0].shape)  # a folder's: what its batches hold
        self.in_channels = shape[0]
        self._image_size = tuple(shape[1:])  # private: not a finding of task_info
        self.num_classes = count_classes(train, val)
        return train, val

    def model(self):
        from ddp_tricks import UserError, models

        need, size = models.min_input_size(self.args.model), getattr(self, "_image_size", None)  # a fork may not say
        if size is not None and (size[0] < need[0] or size[1] < need[1]):
            fix = (
                "choose another --model"
                if self.args.dataset == "cifar10"
                else (f"pass --image-size {max(need)} or more, or choose another --model")
            )
            raise UserError(
                f"--model {self.args.model} needs images of at least {need[0]}x{need[1]} to train, "
                f"these are {size[0]}x{size[1]}: {fix} (toy, toy3 and resnet18 take any size)"
            )
        return models.build(self.args.model, self.in_channels, self.num_classes, self.args.init)

    def loss(self, outputs, targets):
        """Cross-entropy on the logits, against labels or class probabilities (--mixup, --cutmix: soft targets);
        GoogLeNet's and Inception-v3's auxiliary heads (their training-mode outputs) add theirs, weighted as
        models.AUX_WEIGHTS says."""
        import torch.nn.functional as F

        from ddp_tricks import models

        logits, aux = models.main_and_aux(outputs)
        smoothing = self.args.label_smoothing
        loss = F.cross_entropy(logits, targets, label_smoothing=smoothing)
        for weight, aux_logits in aux:
            loss = loss + weight * F.cross_entropy(aux_logits, targets, label_smoothing=smoothing)
        return loss

    def metric_sums(self, outputs, targets):
        from ddp_tricks import models

        labels = targets.argmax(1) if targets.is_floating_point() else targets  # mixed: the larger share's class
        return {"acc": (models.main_and_aux(outputs)[0].argmax(1) == labels).sum()}


def count_classes(train, val) -> int:
    """The number of classes, from the data: a dataset's `classes`, else the largest label + 1."""
    if hasattr(train, "classes"):
        return len(train.classes)
    return int(max(train.targets.max(), val.targets.max())) + 1
