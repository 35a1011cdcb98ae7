"""The task as the loop calls it (task.py's seam): the pre-flight checks of a task (its pieces on a few training
samples, BatchNorm against one-sample micro-batches, a loss over the global batch), and the reported metrics from
sums over a whole set.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ddp_tricks.data.loaders import batch_of
from ddp_tricks.distributed.collectives import gather_calls
from ddp_tricks.errors import UserError
from ddp_tricks.training.batches import describe, float_outputs, no_rows, samples_in


def report(task, sum_names: list[str], prefix: str, values: list[float], count: float) -> dict[str, float]:
    """`{prefix}_loss` and `{prefix}_<metric>` from a set's sums: [loss x units, *metric sums] over `count`, the
    set's units (samples unless the task counts others)."""
    count = max(count, 1.0)  # an epoch with no step left (resumed at its very end) has no units
    sums = dict(zip(sum_names, values[1:]))
    metrics = task.metrics(sums, count) if hasattr(task, "metrics") else {k: v / count for k, v in sums.items()}
    return {f"{prefix}_loss": values[0] / count} | {f"{prefix}_{k}": float(v) for k, v in metrics.items()}


def check_task(task, model: nn.Module, dataset, collate=None) -> list[str]:
    """One forward pass, loss, units and metric sums on four training samples, batched as the loader batches them,
    before any process group: initialises lazy modules, and turns a task whose pieces do not fit together into one
    line. An error inside the model itself is the task's own and keeps its traceback. Returns the metric-sum names.
    """
    inputs, targets = batch_of(dataset, list(range(min(4, len(dataset)))), collate)
    shown = f"shape {tuple(inputs.shape)}" if isinstance(inputs, torch.Tensor) else describe(inputs)
    training = model.training
    model.eval()  # no BatchNorm statistics change
    misfit = f"the task's model output (on inputs of {shown}) does not fit its"
    try:
        with torch.no_grad():
            outputs = float_outputs(model(inputs))
            loss = _call(task.loss, outputs, targets, f"{misfit} loss", "make model() return what loss() expects")
            sums = {}
            if hasattr(task, "metric_sums"):
                fix = "make metric_sums() read what model() returns"
                sums = _call(task.metric_sums, outputs, targets, f"{misfit} metric_sums()", fix)
            units = samples_in(targets, inputs)
            if hasattr(task, "units"):
                fix = "make it count the batch's units (tokens, pixels)"
                units = _call(task.units, inputs, targets, "the task's units() fails on a batch", fix)
    finally:
        model.train(training)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise UserError("the task's loss() must return the batch mean as a scalar tensor, e.g. F.mse_loss(...)")
    shaped = [k for k, v in sums.items() if not isinstance(v, torch.Tensor) or v.dim() != 0]
    if shaped:
        raise UserError(f"the task's metric_sums() must give scalar tensors (batch sums); {shaped[0]!r} is not")
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
    values = [float(loss) * float(units), *(float(v) for v in sums.values())]
    try:  # the names metrics() reports, from these samples' sums (a degenerate sample may not compute: no check)
        reported = set(report(task, list(sums), "", values, float(units))) - {"_loss"}
    except ArithmeticError:
        reported = None
    declared = {f"_{name}" for name in getattr(task, "better", {})}
    if reported is not None and reported != declared:
        raise UserError(
            f"the task reports metrics {sorted(m[1:] for m in reported)} but its `better` names "
            f"{sorted(m[1:] for m in declared)}: give each reported metric 'min' or 'max' in `better`"
        )
    return list(sums)


def sparse_parameters(task, model: nn.Module, dataset, collate=None) -> list[str]:
    """The names of the parameters that get sparse gradients (nn.Embedding(sparse=True), F.embedding(...,
    sparse=True)), from one backward of the task's loss on check_task's four training samples, in eval mode,
    before any process group; every gradient is cleared after."""
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not params:
        return []
    inputs, targets = batch_of(dataset, list(range(min(4, len(dataset)))), collate)
    training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            loss = task.loss(float_outputs(model(inputs)), targets)
        if loss.requires_grad:
            loss.backward()
        return [name for name, p in params if p.grad is not None and p.grad.is_sparse]
    finally:
        model.train(training)
        for _, p in params:
            p.grad = None


def check_sparse(names: list[str], optimizer: str, lars_wrap: bool, strategy: str, traced: bool, nccl: bool) -> None:
    """Sparse gradients (`names`, from sparse_parameters) where this run could not take them, in one line with the
    fix; they train with --optimizer sgd on DDP over gloo (or in one process): the rest of the template takes
    them as they are (accumulation, clipping, AMP, Lookahead, every schedule). Found here, not at the first step."""
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
            f"{what}, which DDP reduces on gloo only (nccl has no sparse all-reduce): pass --backend gloo, {dense}"
        )


GROUP_KEYS = ("params", "lr_mult", "weight_decay", "name")  # what a group of the task's param_groups() may say


def param_groups(task, model: nn.Module) -> tuple[dict, ...]:
    """The task's optional `param_groups(model)`, checked before any process group and kept by parameter NAME (the
    model is sharded or wrapped later, its parameters then other objects): ({"params": [names], "lr_mult",
    "weight_decay" (absent: --wd), "name"}, ...). Every trainable parameter in exactly one group; frozen ones
    (requires_grad=False) may be named and are left out. A mistake is one line naming the parameter or the group."""
    if not callable(getattr(task, "param_groups", None)):
        return ()
    groups = task.param_groups(model)
    fix = 'return a list of dicts, e.g. [{"params": model.head.parameters(), "lr_mult": 1.0}, ...]'
    if not isinstance(groups, (list, tuple)) or not groups or not all(isinstance(g, dict) for g in groups):
        raise UserError(f"the task's param_groups() gave {describe(groups)[:60]}, not a list of groups: {fix}")
    names = {id(p): name for name, p in model.named_parameters()}  # a tied parameter: its first name
    owner: dict[int, str] = {}
    found = []
    for i, group in enumerate(groups):
        label = str(group.get("name", f"group {i}"))
        where = f"the task's param_groups(), {label!r},"
        unknown = sorted(set(group) - set(GROUP_KEYS))
        if unknown or "params" not in group:
            what = f"the key {unknown[0]!r}" if unknown else "no 'params'"
            raise UserError(f"{where} has {what}: a group takes {', '.join(map(repr, GROUP_KEYS))}")
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
        if "weight_decay" in group:
            numbers["weight_decay"] = group["weight_decay"]
        for key, value in numbers.items():
            positive = key == "lr_mult"
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number or not (value > 0 if positive else value >= 0):
                raise UserError(f"{where} {key} must be a number {'>' if positive else '>='} 0, got {value!r}")
        kept = [names[id(p)] for p in params if p.requires_grad]
        if kept:
            found.append({"params": kept, "name": label} | {k: float(v) for k, v in numbers.items()})
    missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise UserError(
            f"the task's param_groups() leaves out the trainable parameter(s) {shown}: every one needs a group (put "
            "the rest in one with lr_mult 1.0), or freeze it (requires_grad=False)"
        )
    return tuple(found)


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
            loss = task.loss(float_outputs(model(inputs)), targets)
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
            else:
                grads = [None] * len(params)
    finally:
        model.train(training)
        with torch.no_grad():
            for buffer, saved in zip(model.buffers(), buffers):
                buffer.copy_(saved)
    unused = [name for (name, _), grad in zip(params, grads) if grad is None]
    if unused:
        shown = ", ".join(repr(n) for n in unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        raise UserError(
            f"parameters {shown} get no gradient from the task's loss on {min(4, len(dataset))} training samples, "
            "and DDP over several processes waits for every parameter's gradient (the run would hang): pass "
            "--find-unused-parameters if some batches use them, or freeze them (requires_grad=False) if none does"
        )


def check_global_loss(task, model: nn.Module, dataset, collate=None, traced: bool = False) -> bool:
    """Whether the task's loss or metric sums gather from every rank (call gather_with_grad), found on the check
    batch before any process group (where the gather is the identity). Such a task must also take a batch of no
    sample, which a rank with fewer validation batches runs while the others finish theirs; a traced run, whose ranks
    run different numbers of micro-batches, would leave a gather waiting. Either is one line here."""
    inputs, targets = batch_of(dataset, list(range(min(4, len(dataset)))), collate)
    before = gather_calls()
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = float_outputs(model(inputs))
            task.loss(outputs, targets)
            if hasattr(task, "metric_sums"):
                task.metric_sums(outputs, targets)
            if gather_calls() == before:
                return False
            if traced:
                raise UserError(
                    "the task's loss gathers from every rank (gather_with_grad), and a --batch-trace step gives the "
                    "ranks different numbers of micro-batches, so a gather would wait for a rank that never comes: "
                    "drop --batch-trace"
                )
            empty_inputs, empty_targets = no_rows(inputs), no_rows(targets)
            fix = "make the model, loss() and metric_sums() take a batch of 0 samples (a mean over none is NaN: fine)"
            why = "the task's loss gathers from every rank, so a rank with fewer validation batches runs"
            problem = f"{why} an empty batch through its model, which fails"
            outputs = _call(lambda x, _: model(x), empty_inputs, None, problem, fix)
            outputs = float_outputs(outputs)
            _call(task.loss, outputs, empty_targets, f"{why} an empty batch through its loss(), which fails", fix)
            if hasattr(task, "metric_sums"):
                problem = f"{why} an empty batch through its metric_sums(), which fails"
                _call(task.metric_sums, outputs, empty_targets, problem, fix)
    finally:
        model.train(training)
    return True
