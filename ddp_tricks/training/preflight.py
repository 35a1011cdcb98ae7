"""The start-up checks, in one call, before any process group: the task's pieces on a few training samples
(seam.py's checks), what this run's choices cannot do with them, and one small record of what was found, which
everything after takes (the metric sums and how the evaluation is scored, sparse parameters, FSDP units, whether the
loss gathers from every rank, the accumulation, whether and why not the gradient noise scale is measured). A mistake
here is one line on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn
from torch.optim import Optimizer

from ddp_tricks import activations
from ddp_tricks.data.mixing import Mixing
from ddp_tricks.data.recipe import ImageRecipe
from ddp_tricks.distributed import fsdp
from ddp_tricks.distributed.mesh import Mesh
from ddp_tricks.errors import UserError
from ddp_tricks.optim import groups, muon
from ddp_tricks.plan import Plan
from ddp_tricks.training import auto_batch, cached, flops, seam
from ddp_tricks.training.flops import Flops
from ddp_tricks.training.metric_states import Layout


@dataclass(frozen=True)
class Setup:
    """This run's choices that the checks hold the task against (from the flags and the launch)."""

    world_size: int
    strategy: str = "ddp"  # --strategy
    optimizer: str = "sgd"  # --optimizer
    lars_wrap: bool = False
    nccl: bool = False  # the backend between the ranks is nccl
    apex: bool = False  # --amp-backend apex
    fp16: bool = False  # --amp fp16
    ddp_waits_for_every_gradient: bool = False  # DDP without --find-unused-parameters or --static-graph
    traced: bool = False  # --batch-trace: a traced run reduces its gradients itself (no DDP reducer)
    sync_bn: bool = False  # --sync-bn
    noise_scale: bool = True  # not --no-noise-scale
    noise_scale_every: int = 1  # --noise-scale-every: measured on every K-th optimizer step
    checkpointing: str | None = None  # --activation-checkpointing: its mode (activations.py), or None
    fsdp_replicas: int = 1  # --fsdp-replicas: HSDP's replicas (distributed/mesh.py)
    count_flops: bool = False  # a training run with per-step rows: a step's FLOPs counted (flops.py)
    mixing: dict | None = None  # --mixup, --cutmix: data.mixing.Mixing's settings (None: neither)
    recipe: dict | None = None  # the image recipe's flags (data.recipe.ImageRecipe's settings)
    aug_repeats: int = 0  # --aug-repeats


@dataclass(frozen=True)
class Findings:
    """What the start-up checks found."""

    sum_names: list[str]  # the task's metric_sums() keys, in the order the sums vector holds them
    collate: Callable | None = None  # the task's own batching, when it has one
    sparse: tuple[str, ...] = ()  # the parameters that get sparse gradients
    units: tuple = ()  # what is sharded as one (fsdp.shard_units): --strategy fsdp, or the blocks checkpointed
    global_loss: bool = False  # the task's loss gathers from every rank (gather_with_grad)
    accumulation: Callable | None = None  # how a step's micro-batches make its gradient (None: loop.py's plain one)
    no_noise_scale: str | None = None  # why the gradient noise scale is not measured (None: it is)
    sum_shapes: dict = field(default_factory=dict)  # the metric sums that are not scalars: {name: shape}
    scoring: Layout | None = None  # the task's score() states (summed and gathered), which evaluate it (None: its loss)
    own_units: bool = False  # the task counts units of its own (units()): the noise scale's batch sizes are in them
    groups: tuple[dict, ...] = ()  # the task's param_groups(), by parameter name (seam.param_groups); () : none
    shard_line: str | None = None  # --strategy fsdp: the units, for the start line (fsdp.describe_units)
    noise_every: int = 1  # the noise scale is measured on every K-th optimizer step (a traced run: every step)
    checkpointing_line: str | None = None  # --activation-checkpointing: what is checkpointed, for the start line
    flops: Flops | None = None  # a training step's FLOPs per sample, counted (None: not counted)
    mesh: Mesh | None = None  # --strategy fsdp: the ranks' mesh, checked, to be built once after joining
    batch_transform: Callable | None = None  # the task's batch_transform, or --mixup's (data.mixing), or None
    own_optimizer: Callable | None = None  # the task's optimizer(param_groups), which the run steps (None: --optimizer)
    head: tuple[str, ...] = ()  # --optimizer muon: the output head's parameters, which AdamW steps (muon.output_head)

    def batching(self) -> tuple[Callable | None, Callable | None]:
        """data.loaders.both's collate and batch transform (the task's, or --mixup's)."""
        return self.collate, self.batch_transform

    def optimizer_options(self) -> dict:
        """optim.build.build's settings that come from the task: its sparse parameters, parameter groups and own
        optimizer."""
        return {"sparse": self.sparse, "groups": self.groups, "own": self.own_optimizer, "head": self.head}

    @property
    def measures_noise(self) -> bool:
        return self.no_noise_scale is None

    def notes(self, plan: Plan, noise_flag: bool, optimizer: Optimizer | None = None) -> list[str]:
        """What the run's log says about them at its start (and the `optimizer` the run steps: its class, settings and
        groups, the exclusion rule and the task's groups applied)."""
        notes = [groups.describe(optimizer)] if optimizer is not None else []
        notes += [line for line in (self.shard_line, self.checkpointing_line) if line]
        if self.batch_transform is not None:
            notes.append(describe_transform(self.batch_transform))
        notes += [self.flops.describe()] if self.flops is not None else []
        if self.measures_noise:
            notes.append(auto_batch.describe(plan, self.own_units, self.noise_every))
        elif noise_flag:
            notes.append(f"gradient noise scale: not measured: {self.no_noise_scale}")
        if self.global_loss and plan.accum_steps > 1 and self.accumulation is None:
            notes.append(
                "the task's loss gathers from every rank but sees one micro-batch at a time: set cached_accumulation"
            )
        if self.groups and optimizer is None:
            shown = ", ".join(describe_group(group) for group in self.groups)
            notes.append(f"the task's parameter groups: {shown}")
        if self.sparse:
            notes.append(
                f"sparse gradients in {', '.join(self.sparse)}: plain SGD steps them, without momentum or weight decay"
            )
        return notes


def describe_group(group: dict) -> str:
    """`backbone (12 tensors, LR x0.1, wd 0)`: one of the task's parameter groups, for the start line."""
    decay = f", wd {group['weight_decay']:g}" if "weight_decay" in group else ""
    return f"{group['name']} ({len(group['params'])} tensors, LR x{group['lr_mult']:g}{decay})"


def describe_transform(transform) -> str:
    """The batch transform for the start line: --mixup's says itself; a task's is named."""
    if hasattr(transform, "describe"):
        return transform.describe()
    name = getattr(transform, "__qualname__", type(transform).__name__)
    return f"batch transform: the task's ({name}), drawn from (seed, step, micro-batch): a resume repeats its draws"


def batch_transform(task, mixing: dict | None) -> Callable | None:
    """The training batches' transform: the task's `batch_transform`, or --mixup / --cutmix's (`mixing`), or None."""
    own = getattr(task, "batch_transform", None)
    if own is not None and mixing is not None:
        raise UserError("--mixup and --cutmix would replace the task's own batch_transform: drop them, or the task's")
    if mixing is None:
        return own
    classes = getattr(task, "num_classes", None)
    if not isinstance(classes, int):
        raise UserError("--mixup and --cutmix need the task's number of classes: set self.num_classes in datasets()")
    return Mixing(classes, **mixing)


def check_recipe(setup: Setup, dataset) -> None:
    """The image recipe's flags act on image folders read by data.decoded; on another training set, or with
    --aug-repeats on one that cannot repeat a sample, they would be ignored: one line."""
    flags = ImageRecipe(**(setup.recipe or {}))
    if flags != ImageRecipe() and getattr(dataset, "recipe", None) != flags:
        name = next(name for name, value in vars(flags).items() if value != getattr(ImageRecipe(), name))
        raise UserError(
            f"--{name.replace('_', '-')} acts on image folders (--dataset imagefolder, --data-backend torchvision), "
            f"and this run's training set ({type(dataset).__name__}) would ignore it: drop it"
        )
    if setup.aug_repeats > 1 and not getattr(dataset, "repeats", False):
        raise UserError(
            f"--aug-repeats augments each repeat anew, which this run's training set ({type(dataset).__name__}) "
            "cannot (image folders can: --dataset imagefolder, --data-backend torchvision): drop it"
        )


def equal_shares(setup: Setup, task, sparse: list[str], global_loss: bool) -> str:
    """What in this run needs every rank to run as many of a step's micro-batches ("": nothing). Without it, a world
    size that does not divide them (a resume on another number of processes) spreads them unevenly, the gradients
    summed by hand; with it, such a world size is refused in one line (plan.layout)."""
    if setup.strategy == "fsdp":
        return "--strategy fsdp (each forward gathers from every rank; --strategy ddp takes uneven shares)"
    if setup.sync_bn:
        return "--sync-bn (each forward is a collective)"
    if global_loss:
        return "the task's loss, which gathers from every rank (gather_with_grad),"
    if getattr(task, "cached_accumulation", False):
        return "the task's cached accumulation (cached_accumulation = True)"
    if getattr(task, "collectives", False):
        return "the task's own collectives (collectives = True), which every rank must call as often,"
    if sparse:
        return "the model's sparse gradients (averaged over the ranks, each rank's with the same weight)"
    return ""


def check(task, model: nn.Module, dataset, setup: Setup, make_plan: Callable[[str], Plan]) -> tuple[Plan, Findings]:
    """Every start-up check of the task against this run, in order: the task's own pieces first (a task that does
    not fit together is said before anything that depends on it), then `make_plan(equal_shares)` (the run's plan,
    given what needs equal shares of a step's micro-batches; its own mistakes come next), then the task against the
    plan. The plan and the record of what was found. Also initialises lazy modules (the first forward)."""
    mesh = Mesh.check(setup.world_size, setup.fsdp_replicas, setup.strategy)
    collate = getattr(task, "collate", None)
    check_recipe(setup, dataset)
    transform = batch_transform(task, setup.mixing)
    sums = seam.check_task(task, model, dataset, collate, transform)
    scoring = seam.check_scoring(task, model, dataset, collate)
    if setup.ddp_waits_for_every_gradient and setup.world_size > 1 and not setup.traced:
        seam.check_unused_parameters(task, model, dataset, collate)  # one that gets none: said here, not a hang
    own_optimizer = getattr(task, "optimizer", None) if callable(getattr(task, "optimizer", None)) else None
    optimizer = setup.optimizer if own_optimizer is None else None  # the task's own: its keys checked when built
    groups = seam.param_groups(task, model, optimizer, setup.lars_wrap)  # by name: sharded or wrapped later
    head = muon.output_head(task, model) if optimizer == "muon" else ()
    if optimizer == "muon":
        muon.check_matrices(model, head)
    sparse = seam.sparse_parameters(task, model, dataset, collate)  # one backward: which get sparse gradients
    units, shard_line, checkpointing_line = [], None, None
    if setup.strategy == "fsdp":
        fsdp.check_scalars(model, setup.fp16)
        units = fsdp.shard_units(task, model)
        skipped = fsdp.skipped(model, units, seam.module_calls(model, dataset, collate))
        folded = [units[i] for i in skipped]
        units = [unit for i, unit in enumerate(units) if i not in skipped]
        shard_line = fsdp.describe_units(model, units, folded)
        if setup.fsdp_replicas > 1:
            shard_line += f"; {mesh.describe()}"
    elif setup.checkpointing:  # the blocks are the units FSDP would shard
        units = fsdp.shard_units(task, model)
    if setup.checkpointing:
        checkpointing_line = activations.describe(model, units, setup.checkpointing)
    global_loss = seam.check_global_loss(task, model, dataset, collate, traced=setup.traced)
    if setup.traced and setup.world_size > 1 and getattr(task, "collectives", False):
        raise UserError(
            "the task calls collectives itself in training (collectives = True), and a --batch-trace step gives the "
            "ranks different numbers of micro-batches (some none), so their calls would not meet: drop --batch-trace"
        )
    plan = make_plan(equal_shares(setup, task, sparse, global_loss))
    apex = setup.apex and setup.world_size > 1
    seam.check_sparse(sparse, setup.optimizer, setup.lars_wrap, setup.strategy, plan.traced, setup.nccl, apex)
    seam.check_batchnorm(model, dataset, collate, plan.smallest_micro_batch, plan.why_small())
    accumulation = cached.choose(task, plan.accum_steps, plan.traced, setup.apex)
    no_noise_scale = "--no-noise-scale"
    if setup.noise_scale:
        whole_steps = accumulation is not None or setup.apex
        no_noise_scale = auto_batch.not_measured(
            setup.world_size,
            plan.accum_steps,
            setup.strategy,
            plan.manual_reduction,
            whole_steps,
            bool(sparse),
            global_loss,
        )
    if plan.auto:
        auto_batch.refuse_auto_without(no_noise_scale)
    return plan, Findings(
        sums.names,
        collate,
        tuple(sparse),
        tuple(units),
        global_loss,
        accumulation,
        no_noise_scale,
        sums.shapes,
        scoring,
        hasattr(task, "units"),
        groups,
        shard_line,
        noise_every=1 if plan.manual_reduction else setup.noise_scale_every,
        checkpointing_line=checkpointing_line,
        flops=flops.of_task(task, model, dataset, collate, plan.micro_batch) if setup.count_flops else None,
        mesh=mesh if setup.strategy == "fsdp" else None,
        batch_transform=transform,
        own_optimizer=own_optimizer,
        head=head,
    )
