"""The epoch's training metrics, as the loop keeps them (training/meter.py: each micro-batch's loss x units and the
task's metric sums added in place into float64 sums on the device), against a plain reference: every sample's loss
and correctness from the same weights, summed by hand. A learning rate of 0 keeps the weights, so the reference sees
the model each micro-batch saw.
"""

import pytest
import tiny
import torch
from torch import nn
from torch.nn import functional as F

from ddp_tricks import plan as planning
from ddp_tricks.data import images as image_data
from ddp_tricks.training.loop import train_one_epoch


class PerClass(tiny.Classify):
    """Top-1 accuracy, and the correct predictions by class: a summed state of shape (10,)."""

    def metric_sums(self, outputs, targets):
        correct = outputs.argmax(1) == targets
        by_class = torch.zeros(10, dtype=torch.int64).index_add_(0, targets, correct.long())
        return {"acc": correct.sum(), "by_class": by_class}

    def metrics(self, sums, count):
        return {"acc": sums["acc"] / count, "class3": float(sums["by_class"][3])}


def _epoch(task=None, sum_names=("acc",), shapes=None, accum_steps=3):
    """One epoch of a linear model at LR 0 on the digits through run.py's loop: its result and the reference's
    per-sample losses and correctness, over the samples the plan's steps hold (each once)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    t = tiny.training(model, torch.optim.SGD(model.parameters(), lr=0.0))
    if task is not None:
        from ddp_tricks.training.meter import EpochMeter
        from ddp_tricks.training.metric_states import Layout

        t.task = task
        t.meter = EpochMeter(Layout.scalars(list(sum_names), shapes), t.device)
    train_set, _ = image_data.digits()
    plan = planning.make(num_train=len(train_set), world_size=1, micro_batch=32, accum_steps=accum_steps, epochs=1,
                         seed=0, base_lr=0.0, lr_scaling="keep", base_batch=32 * accum_steps,
                         warmup_epochs=0)  # fmt: skip
    steps = plan.epoch(1, 0)
    result = train_one_epoch(t, steps, tiny.loader_for(train_set, steps))
    seen = torch.tensor([i for step in steps for micro in step.micro_batches for i in micro])
    with torch.no_grad():
        logits = model(train_set.inputs[seen])
    targets = train_set.targets[seen]
    return result, F.cross_entropy(logits, targets, reduction="none").double(), logits.argmax(1) == targets, targets


@pytest.mark.timeout(120)
def test_the_epoch_s_train_loss_and_accuracy_are_the_means_over_its_samples():
    """Accumulated steps of 3 micro-batches (the last step shorter): train_loss is the mean of every sample's loss,
    train_acc the share of samples classified right, exactly. Broken on purpose: the metric sums added x 0 in
    EpochMeter.add gives train_acc 0; the loss added with alpha 1 (not its units) gives a loss 32 times too small."""
    result, losses, correct, _ = _epoch()
    assert len(losses) > 1000
    assert result["train_loss"] == pytest.approx(losses.mean().item(), rel=1e-6)
    assert result["train_acc"] == correct.sum().item() / len(correct)


@pytest.mark.timeout(120)
def test_a_summed_state_with_a_shape_is_added_where_it_belongs():
    """A task's summed state of shape (10,) beside a scalar one: each kept in its place of the epoch's sums (a view
    of its shape), so metrics() reads the right class's count and the scalar beside it."""
    shapes = {"by_class": (10,)}
    result, _, correct, targets = _epoch(PerClass(), ("acc", "by_class"), shapes, accum_steps=1)
    assert result["train_acc"] == correct.sum().item() / len(correct)
    assert result["train_class3"] == correct[targets == 3].sum().item()


def test_a_summed_state_of_another_size_raises_instead_of_broadcasting():
    """A per-class count of 3 given as one element (a bincount without minlength on a batch of class 0 alone) raises;
    a loss of shape (1,) and a count of shape (1, 3) are taken as their layout's. Broken on purpose: EpochMeter.add
    adding the value as it is (no reshape to the layout's shape) broadcasts the one element over the three classes,
    silently."""
    from ddp_tricks.training.meter import EpochMeter
    from ddp_tricks.training.metric_states import Layout

    meter = EpochMeter(Layout.scalars(["acc", "by_class"], {"by_class": (3,)}), torch.device("cpu"))
    meter.start()
    meter.add(torch.tensor(0.5), {"acc": torch.tensor(2), "by_class": torch.tensor([1, 0, 1])}, 4, 4)
    meter.add(torch.tensor([0.25]), {"acc": torch.tensor(1), "by_class": torch.tensor([[0, 1, 0]])}, 4, 4)
    assert meter.sums.tolist() == [0.5 * 4 + 0.25 * 4, 3.0, 1.0, 1.0, 1.0]
    with pytest.raises(RuntimeError):
        meter.add(torch.tensor(0.5), {"acc": torch.tensor(1), "by_class": torch.tensor([1])}, 4, 4)
