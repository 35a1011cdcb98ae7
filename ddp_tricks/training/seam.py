"""The task as the loop calls it (task.py's seam): the pre-flight checks of a task (its pieces on a few training
samples, how its evaluation is scored, BatchNorm against one-sample micro-batches, a loss over the global batch).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ddp_tricks import optim
from ddp_tricks.data.loaders import batch_of
from ddp_tricks.data.mixing import seeded
from ddp_tricks.distributed.collectives import gather_calls
from ddp_tricks.errors import UserError
from ddp_tricks.training.batches import describe, float_outputs
from ddp_tricks.training.metric_states import Layout, report

CHECKED = 4  # the training samples every check runs on


@contextlib.contextmanager
def as_loss_sees_it(task, model: nn.Module):
    """The model as the task's loss() sees its outputs, changing nothing: in eval mode (no BatchNorm statistics
    change), or, for a task that scores its evaluation itself (score(): its eval-mode outputs are predictions, such
    as a detector's boxes, not what loss() takes), in training mode with the random state and every buffer put
    back after."""
    training = model.training
    buffers = [b.detach().clone() for b in model.buffers()] if hasattr(task, "score") else None
    try:
        with torch.random.fork_rng(devices=[]) if buffers is not None else contextlib.nullcontext():
            model.train(buffers is not None)
            yield
    finally:
        model.train(training)
        if buffers is not None:
            with torch.no_grad():
                for buffer, saved in zip(model.buffers(), buffers):
                    buffer.copy_(saved)


def check_task(task, model: nn.Module, dataset, collate=None, transform=None) -> Layout:
    """One forward pass, loss, units and metric sums on four training samples, batched as the loader batches them
    (and, in training, batch-transformed: `transform`), before any process group: initialises lazy modules, and turns
    a task whose pieces do not fit together into one line. An error inside the model itself is the task's own and
    keeps its traceback. Returns the metric sums' layout (their names, in order, and shapes)."""
    indices = list(range(min(CHECKED, len(dataset))))
    inputs, targets = batch_of(dataset, indices, collate)
    shown = f"shape {tuple(inputs.shape)}" if isinstance(inputs, torch.Tensor) else describe(inputs)
    misfit = f"the task's model output (on inputs of {shown}) does not fit its"
    if transform is not None:  # the Feed's, seeded alike (data.mixing)
        with seeded(0, torch.device("cpu")):
            inputs, targets = _call(transform, inputs, targets, "the batch transform fails", "check batch_transform")
        misfit = f"the batch transform's targets ({describe(targets)}; --mixup, --cutmix: class probabilities) do not "
        misfit += "fit the task's (take probabilities, as F.cross_entropy does, or drop the batch transform):"
    with torch.no_grad(), as_loss_sees_it(task, model):
        outputs = float_outputs(model(inputs))
        loss = _call(task.loss, outputs, targets, f"{misfit} loss", "make model() return what loss() expects")
        sums = {}
        if hasattr(task, "metric_sums"):
            fix = "make metric_sums() read what model() returns"
            sums = _call(task.metric_sums, outputs, targets, f"{misfit} metric_sums()", fix)
        units = len(indices)
        if hasattr(task, "units"):
            fix = "make it count the batch's units (tokens, pixels)"
            units = _call(task.units, inputs, targets, "the task's units() fails on a batch", fix)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UserError("the task's loss() must return the batch mean as a scalar tensor, e.g. F.mse_loss(...)")
    if not isinstance(sums, dict) or any(not isinstance(v, torch.Tensor) for v in sums.values()):
        raise UserError(
            f"the task's metric_sums() must give a dict of tensors (batch sums: a scalar, or a per-class count, of "
            f"one shape in every batch), not {describe(sums)}"
        )
    if not isinstance(units, (int, float, torch.Tensor)) or isinstance(units, torch.Tensor) and units.numel() != 1:
        raise UserError(f"the task's units() must give the batch's count of units as one number, not {describe(units)}")
    if not 0 <= float(units) < float("inf"):
        raise UserError(f"the task's units() must give a count >= 0, got {float(units)}")
    if float(units) != int(float(units)):
        raise UserError(
            f"the task's units() must count the units the loss averages over (a whole number, e.g. mask.sum()), "
            f"got {float(units):.6g}: a mean or a fraction would weigh the batches wrongly"
        )
    modes = getattr(task, "better", {})
    if any(mode not in ("min", "max") for mode in modes.values()):
        raise UserError(f"the task's `better` must map each metric to 'min' or 'max', got {modes}")
    layout = Layout.of_states(sums)
    values = [float(loss) * float(units), *(float(v) for part in layout.flat(sums) for v in part.tolist())]
    try:  # the names metrics() reports, from these samples' sums (a degenerate sample may not compute: no check)
        reported = set(report(task, layout, "", values, float(units))) - {"_loss"}
    except (ArithmeticError, ValueError):
        reported = None
    declared = {f"_{name}" for name in modes}
    scored = hasattr(task, "score")
    if reported is not None and (reported > declared if scored else reported != declared):
        raise UserError(
            f"the task reports metrics {sorted(m[1:] for m in reported)} but its `better` names "
            f"{sorted(m[1:] for m in declared)}: give each reported metric 'min' or 'max' in `better`"
        )
    return layout


def check_scoring(task, model: nn.Module, dataset, collate=None) -> Layout | None:
    """A task that scores its evaluation itself (`score(outputs, targets)`: a validation batch's metric states from
    the model's eval-mode outputs, no loss): score() on the check batch, in eval mode, before any process group.
    Returns the states' layout (the summed ones' shapes, the gathered ones' names), or None for a task without
    score(), whose evaluation is its loss and metric sums."""
    gathered = tuple(getattr(task, "gathered", ()))
    if not hasattr(task, "score"):
        if gathered:
            raise UserError(
                f"the task's `gathered` names {list(gathered)}, states of score(), which it does not have: add "
                "score(outputs, targets) giving them (rows of each validation batch), or drop `gathered`"
            )
        return None
    indices = list(range(min(CHECKED, len(dataset))))
    inputs, targets = batch_of(dataset, indices, collate)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = float_outputs(model(inputs))
            fix = "make score() read what model() returns in eval mode"
            problem = "the task's score() fails on the model's eval-mode outputs"
            states = _call(task.score, outputs, targets, problem, fix)
    finally:
        model.train(training)
    if not isinstance(states, dict) or any(not isinstance(v, torch.Tensor) for v in states.values()):
        raise UserError(
            f"the task's score() must give a dict of tensors (sums, and the rows `gathered` names), not "
            f"{describe(states)}"
        )
    missing = [name for name in gathered if name not in states]
    if missing:
        raise UserError(f"the task's `gathered` names {missing}, which score() does not give: it gives {list(states)}")
    flat = [name for name in gathered if states[name].dim() == 0]
    if flat:
        raise UserError(
            f"the task's score() gives {flat[0]!r}, which `gathered` names, as a scalar: gathered states are rows "
            "(a first dimension, concatenated over the whole validation set), e.g. the batch's scores"
        )
    layout = Layout.of_states(states, gathered)
    values = [float(v) for part in layout.flat(states) for v in part.tolist()]
    rows = {name: states[name] for name in gathered}
    declared = {f"_{name}" for name in getattr(task, "better", {})}
    try:  # a few samples may not compute (one class only for an AUC): no check then
        reported = set(report(task, layout, "", values, float(len(indices)), rows, loss=False))
    except (ArithmeticError, ValueError):
        reported = None
    if reported is not None and reported != declared:
        raise UserError(
            f"the task's evaluation (score() and metrics()) reports {sorted(m[1:] for m in reported)} but its "
            f"`better` names {sorted(m[1:] for m in declared)}: give each reported metric 'min' or 'max' in `better`"
        )
    return layout


def gradient_kinds(loss, params: list[torch.Tensor]) -> list[str | None]:
    """What one backward of `loss` gives each of `params`: "dense", "sparse" or None (no gradient). Each gradient is
    read and dropped as autograd hands it over (a hook after it is accumulated), so no more than a few are ever held:
    a model on the meta device's stand-in (meta_init.checkable) is checked in little more than its activations.
    The parameters' .grad are as they were after."""
    kinds: dict[int, str] = {}
    saved = [p.grad for p in params]

    def read(p):
        kinds[id(p)] = "sparse" if p.grad.is_sparse else "dense"
        p.grad = None

    hooks = [p.register_post_accumulate_grad_hook(read) for p in params]
    try:
        for p in params:
            p.grad = None
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.backward()
    finally:
        for hook, p, grad in zip(hooks, params, saved):
            hook.remove()
            p.grad = grad
    return [kinds.get(id(p)) for p in params]


def sparse_parameters(task, model: nn.Module, dataset, collate=None) -> list[str]:
    """The names of the parameters that get sparse gradients (nn.Embedding(sparse=True), F.embedding(...,
    sparse=True)), from one backward of the task's loss on check_task's four training samples (the model as the loss
    sees it: as_loss_sees_it), before any process group; every gradient is cleared after."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not params:
        return []
    inputs, targets = batch_of(dataset, list(range(min(CHECKED, len(dataset)))), collate)
    with torch.enable_grad(), as_loss_sees_it(task, model):
        kinds = gradient_kinds(task.loss(float_outputs(model(inputs)), targets), [p for _, p in params])
    return [name for (name, _), kind in zip(params, kinds) if kind == "sparse"]


def check_sparse(
    names: list[str], optimizer: str, lars_wrap: bool, strategy: str, traced: bool, nccl: bool, apex: bool
) -> None:
    """Sparse gradients (`names`, from sparse_parameters) where this run could not take them, in one line with the
    fix; they train with --optimizer sgd on gloo (or in one process): the rest of the template takes
    them as they are (accumulation, clipping, AMP, Lookahead, every schedule). Found here, not at the first step.
    `nccl`, `apex`: that backend, or Apex's amp, with more than one process."""
    if not names:
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    what = f"the model's {shown} get{'s' if len(names) == 1 else ''} sparse gradients (an nn.Embedding(sparse=True))"
    dense = "or make the tables dense (sparse=False)"
    if optimizer != "sgd":
        raise UserError(
            f"{what}, which --optimizer {optimizer} cannot step: use --optimizer sgd (it steps them without "
            f"momentum or weight decay), {dense}"
        )
    if lars_wrap:
        raise UserError(f"{what}, which --lars-wrap cannot scale (LARS takes dense ones): drop --lars-wrap, {dense}")
    if strategy == "fsdp":
        raise UserError(f"{what}, which FSDP cannot shard or reduce-scatter: use --strategy ddp, {dense}")
    if traced:
        raise UserError(
            f"{what}, which a --batch-trace run cannot reduce (it sums all gradients as one dense buffer): drop "
            f"--batch-trace, {dense}"
        )
    if nccl:
        raise UserError(
            f"{what}, which the template averages across processes on gloo only (the rows' counts travel as CPU "
            f"tensors): pass --backend gloo, {dense}"
        )
    if apex:
        raise UserError(
            f"{what}, which the template averages across processes after the backward, where --amp-backend apex "
            f"has already unscaled them and judged an overflow on each rank alone: use --amp-backend native, {dense}"
        )


GROUP_KEYS = ("params", "lr_mult", "weight_decay", "name")  # what a group of the task's param_groups() may say
SWITCHES = ("lars", "nesterov", "amsgrad", "bias_correction", "trust_clip", "always_adapt")  # a group's True/False


def param_groups(task, model: nn.Module, optimizer: str | None = "sgd", lars_wrap: bool = False) -> tuple[dict, ...]:
    """The task's optional `param_groups(model)`, checked before any process group and kept by parameter NAME (the
    model is sharded or wrapped later, its parameters then other objects): ({"params": [names], "lr_mult",
    "weight_decay" (absent: --wd), "name", 'lars' (False: no trust ratio), the keys of `--optimizer optimizer`:
    optim.group_keys; None: the task's own optimizer's, checked when it is built}, ...). Every trainable parameter in
    one group; frozen ones may be named and are left out. A mistake is one line naming the parameter or the group."""
    if not callable(getattr(task, "param_groups", None)):
        return ()
    groups = task.param_groups(model)
    fix = 'return a list of dicts, e.g. [{"params": model.head.parameters(), "lr_mult": 1.0}, ...]'
    if not isinstance(groups, (list, tuple)) or not groups or not all(isinstance(g, dict) for g in groups):
        raise UserError(f"the task's param_groups() gave {describe(groups)[:60]}, not a list of groups: {fix}")
    names = {id(p): name for name, p in model.named_parameters()}  # a tied parameter: its first name
    allowed = optim.group_keys(optimizer, lars_wrap) if optimizer is not None else None
    owner: dict[int, str] = {}
    found = []
    for i, group in enumerate(groups):
        label = str(group.get("name", f"group {i}"))
        where = f"the task's param_groups(), {label!r},"
        unknown = sorted(set(group) - set(allowed)) if allowed is not None else []
        if unknown or "params" not in group:
            what = f"the key {unknown[0]!r}" if unknown else "no 'params'"
            whose = f"--optimizer {optimizer}{' --lars-wrap' if lars_wrap else ''}"
            takes = f"a group under {whose} takes {', '.join(map(repr, allowed))}" if allowed else "a group needs one"
            raise UserError(f"{where} has {what}: {takes}")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in params:
            if id(p) not in names:
                raise UserError(f"{where} holds {describe(p)[:60]}, which is not a parameter of the model it was given")
            if id(p) in owner:
                raise UserError(
                    f"{where} names the parameter {names[id(p)]!r} that {owner[id(p)]!r} names too: give each "
                    "parameter one group"
                )
            owner[id(p)] = label
        numbers = {"lr_mult": group.get("lr_mult", 1.0)}
        numbers |= {key: group[key] for key in ("weight_decay", "eps", "momentum", "dampening") if key in group}
        for key, value in numbers.items():
            positive = key == "lr_mult"
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or not (value > 0 if positive else value >= 0):
                raise UserError(f"{where} {key} must be a number {'>' if positive else '>='} 0, got {value!r}")
        own = {key: value for key, value in group.items() if key not in GROUP_KEYS}
        _check_own(where, own)
        kept = [names[id(p)] for p in params if p.requires_grad]
        if kept:
            found.append({"params": kept, "name": label} | {k: float(v) for k, v in numbers.items()} | own)
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise UserError(
            f"the task's param_groups() leaves out the trainable parameter(s) {shown}: every one needs a group (put "
            "the rest in one with lr_mult 1.0), or freeze it (requires_grad=False)"
        )
    return tuple(found)


def _check_own(where: str, own: dict) -> None:
    """A group's own keys that the template knows, one line each: switches True or False, betas two numbers in
    [0, 1); momentum below 1."""
    for key in SWITCHES:
        if key in own and not isinstance(own[key], bool):
            raise UserError(f"{where} {key} must be True or False, got {own[key]!r}")
    betas = own.get("betas", (0.0, 0.0))
    numbers = isinstance(betas, (tuple, list)) and all(isinstance(b, (int, float)) for b in betas)
    if not (numbers and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
        raise UserError(f"{where} betas must be two numbers in [0, 1), got {betas!r}")
    if not own.get("momentum", 0.0) < 1:  # a number >= 0: checked with the numbers
        raise UserError(f"{where} momentum must be in [0, 1), got {own['momentum']!r}")


def _call(method, first, second, problem: str, fix: str):
    """A task method on a batch; an exception becomes one line: the problem, torch's reason, the fix."""
    try:
        return method(first, second)
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:160]
        raise UserError(f"{problem} ({reason}); {fix}") from None


def check_batchnorm(model: nn.Module, dataset, collate, smallest_micro_batch: int, why: str) -> None:
    """A micro-batch of one sample trains BatchNorm only where each channel still has several values (a feature
    map); where it has one (BatchNorm1d on features, a 1x1 map) torch stops mid-epoch. Found at start: one forward
    of one sample, in eval mode, measuring every BatchNorm's values per channel; refused naming --drop-last."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if smallest_micro_batch > 1 or not layers:
        return
    values = []

    def measure(_, args):
        values.append(args[0].numel() // args[0].shape[1])  # one sample: its values per channel

    hooks = [m.register_forward_pre_hook(measure) for m in layers]
    inputs, _ = batch_of(dataset, [0], collate)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    if values and min(values) <= 1:
        raise UserError(
            f"{why}, and the model's BatchNorm cannot train on one sample (one value per channel): pass --drop-last "
            "(training leaves out the samples that do not fill a micro-batch; validation keeps every one) or "
            "choose another --batch-size"
        )


def check_unused_parameters(task, model: nn.Module, dataset, collate=None) -> None:
    """DDP over several processes without --find-unused-parameters waits in every backward for every parameter's
    gradient: a parameter that gets none leaves the ranks waiting for each other. One forward and backward of the
    task's loss on the check batch (the four samples of check_task), in training mode as a step runs it (the RNG
    and BatchNorm statistics put back, no .grad touched): parameters that require a gradient and get none are
    named in one line with the fix, before any process group. Frozen parameters (requires_grad=False) are fine."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not params:
        return
    inputs, targets = batch_of(dataset, list(range(min(4, len(dataset)))), collate)
    buffers = [b.detach().clone() for b in model.buffers()]
    training = model.training
    try:
        with torch.random.fork_rng(devices=[]):
            model.train()
            kinds = gradient_kinds(task.loss(float_outputs(model(inputs)), targets), [p for _, p in params])
    finally:
        model.train(training)
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)
    unused = [name for (name, _), kind in zip(params, kinds) if kind is None]
    if unused:
        shown = ", ".join(repr(n) for n in unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise UserError(
            f"parameters {shown} get no gradient from the task's loss on {min(4, len(dataset))} training samples, "
            "and DDP over several processes waits for every parameter's gradient (the run would hang): pass "
            "--find-unused-parameters if some batches use them, or freeze them (requires_grad=False) if none does"
        )


def check_global_loss(task, model: nn.Module, dataset, collate=None, traced: bool = False) -> bool:
    """Whether the task's loss, metric sums or score() gather from every rank (call gather_with_grad), found on the
    check batch before any process group (where the gather is the identity). A traced run, whose ranks run different
    numbers of micro-batches, would leave a gather waiting: one line here. (Evaluation needs nothing more: every rank
    runs the same batches of equal rows, loaders.EvalSampler.)"""
    indices = list(range(min(CHECKED, len(dataset))))
    inputs, targets = batch_of(dataset, indices, collate)
    before = gather_calls()
    scored = hasattr(task, "score")
    with torch.no_grad():
        with as_loss_sees_it(task, model):
            outputs = float_outputs(model(inputs))
            task.loss(outputs, targets)
            if hasattr(task, "metric_sums"):
                task.metric_sums(outputs, targets)
        training = model.training
        model.eval()
        try:
            if scored:
                task.score(float_outputs(model(inputs)), targets)
            if gather_calls() == before:
                return False
            if traced:
                raise UserError(
                    "the task's loss gathers from every rank (gather_with_grad), and a --batch-trace step gives the "
                    "ranks different numbers of micro-batches, so a gather would wait for a rank that never comes: "
                    "drop --batch-trace"
                )
        finally:
            model.train(training)
    return True


def module_calls(model: nn.Module, dataset, collate=None) -> list[set[int]]:
    """For each of the start-up check's forwards (the check batch, then each of its samples alone), the ids of the
    modules it called: what --strategy fsdp holds its units against (a unit that a forward skips, an expert no sample
    chose, would leave the ranks that call it waiting in its all-gather). In training mode as a step runs it, except
    BatchNorm layers in eval mode for a forward of one sample (training mode refuses it); a forward of one sample that
    the model refuses even so is left out. The RNG and every buffer are put back."""
    count = min(CHECKED, len(dataset))
    batches = [list(range(count))] + ([[i] for i in range(count)] if count > 1 else [])
    called: set[int] = set()
    hooks = [m.register_forward_pre_hook(lambda module, _: called.add(id(module))) for m in model.modules()]
    buffers = [b.detach().clone() for b in model.buffers()]
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    training, calls = model.training, []
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for indices in batches:
                inputs, _ = batch_of(dataset, indices, collate)
                called.clear()
                model.train()
                for norm in norms if len(indices) == 1 else []:
                    norm.eval()
                try:
                    model(inputs)
                except Exception:  # a model that takes no single sample: the batch's forward alone says it
                    if len(indices) > 1:
                        raise
                    continue
                calls.append(set(called))
    finally:
        for hook in hooks:
            hook.remove()
        model.train(training)
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)
    return calls
