"""The embedded dataset, the training sampler's epochs, and the exact evaluation split."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_tricks import UserError
from ddp_tricks.data import images as image_data
from ddp_tricks.data import loaders as data


def test_digits_split_is_fixed_and_disjoint():
    (train, val), (_, val_again) = image_data.digits(), image_data.digits()
    assert len(train) + len(val) == 1797  # scikit-learn's bundled digits
    assert len(val) == 359
    assert torch.equal(val.inputs, val_again.inputs)
    train_rows = {tuple(x.flatten().tolist()) for x in train.inputs}
    overlap = sum(tuple(x.flatten().tolist()) in train_rows for x in val.inputs)
    assert overlap <= 5  # a few digits are pixel-identical in the raw data; the split itself is disjoint
    assert train.inputs.shape[1:] == (1, 8, 8)


def test_digits_read_without_scikit_learn_equal_its_load_digits(monkeypatch):
    """The file scikit-learn ships, read directly, gives load_digits' images split and standardised as documented
    (80/20 by a permutation of seed 0, the training part's mean and std); load_digits is also the fallback."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(bunch.target)
    order = torch.randperm(1797, generator=torch.Generator().manual_seed(0))
    val_idx, train_idx = order[:359], order[359:]
    mean, std = images[train_idx].mean(), images[train_idx].std()
    expected_train, expected_val = (images[train_idx] - mean) / std, (images[val_idx] - mean) / std

    for found in (True, False):
        if found:  # the file itself: load_digits must not be what answers
            monkeypatch.setattr("sklearn.datasets.load_digits", lambda: pytest.fail("load_digits was called"))
        else:  # as if the file were not where scikit-learn keeps it: load_digits, the fallback
            monkeypatch.undo()
            monkeypatch.setattr(image_data.importlib.util, "find_spec", lambda name: None)
        train, val = image_data.digits()
        assert torch.allclose(train.inputs, expected_train, atol=1e-6) and torch.equal(train.targets, labels[train_idx])
        assert torch.allclose(val.inputs, expected_val, atol=1e-6) and torch.equal(val.targets, labels[val_idx])


def test_in_memory_batches_are_single_index_operations():
    ds = data.InMemoryDataset(torch.arange(10.0).view(10, 1), torch.arange(10))
    x, y = ds.__getitems__([3, 1, 4])
    assert x.flatten().tolist() == [3.0, 1.0, 4.0] and y.tolist() == [3, 1, 4]


def test_every_epoch_covers_every_sample_in_a_new_order():
    n, world = 103, 3
    orders = []
    for epoch in range(3):
        seen = []
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
            sampler.set_epoch(epoch)
            seen.append(list(sampler))
        flat = [i for rank_indices in seen for i in rank_indices]
        assert set(flat) == set(range(n))
        assert len(flat) - n < world  # only the padding that gives every rank the same number of steps
        orders.append(flat)
    assert orders[0] != orders[1] != orders[2]


def test_the_validation_split_counts_each_sample_on_exactly_one_rank():
    for world in (1, 2, 3):
        samplers = [data.EvalSampler(359, world, rank, 16) for rank in range(world)]
        flat = sorted(i for s in samplers for batch, counted in zip(s.batches, s.counted()) if counted for i in batch)
        assert flat == list(range(359))


def test_validation_set_smaller_than_world_is_refused():
    with pytest.raises(UserError, match="validation set has 2 samples"):
        data.check_sizes(4, 2, 3)


def test_missing_mnist_names_the_path_and_the_fix(tmp_path):
    with pytest.raises(UserError) as error:
        image_data.mnist_like("mnist", str(tmp_path / "nowhere"), download=False)
    assert "nowhere" in str(error.value) and "--download" in str(error.value)


def test_the_plan_covers_every_sample_once_per_epoch_in_micro_batches_and_steps():
    from ddp_tricks import plan

    p = plan.make(num_train=103, world_size=3, micro_batch=4, accum_steps=3, epochs=1, seed=7, base_lr=0.1,
                  lr_scaling="keep", base_batch=36, warmup_epochs=0)  # fmt: skip
    epochs = [[p.epoch(e, rank) for rank in range(3)] for e in (1, 2)]
    for ranks in epochs:
        assert all(len(steps) == p.steps_per_epoch == 3 for steps in ranks)  # 36, 36 and the last 31 samples
        seen = [i for steps in ranks for step in steps for micro in step.micro_batches for i in micro]
        assert sorted(seen) == list(range(103))  # each sample once: no padding
        for steps in ranks:  # DDP averages the ranks: each weighs its samples by the step's samples / 3
            assert [s.divisor for s in steps] == [12, 12, 31 / 3] and [s.batch for s in steps] == [36, 36, 31]
            assert [len(s.micro_batches) for s in steps] == [3, 3, 3]
    assert epochs[0][0][0].micro_batches != epochs[1][0][0].micro_batches  # a new order every epoch


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_step_has_the_same_micro_batches_at_every_world_size(drop_last):
    from ddp_tricks import plan

    def steps(world_size, accum_steps):
        p = plan.make(num_train=103, world_size=world_size, micro_batch=4, accum_steps=accum_steps, epochs=1, seed=7,
                      base_lr=0.1, lr_scaling="keep", base_batch=24, warmup_epochs=0, drop_last=drop_last)  # fmt: skip
        ranks = [p.epoch(2, rank) for rank in range(world_size)]
        assert len({len(r) for r in ranks}) == 1 and len(ranks[0]) == p.steps_per_epoch
        # each step as the set of its micro-batches (whichever rank runs them), and its global batch
        return [
            (sorted(tuple(m) for r in ranks for m in r[s].micro_batches), {r[s].batch for r in ranks})
            for s in range(p.steps_per_epoch)
        ]

    one = steps(1, 6)
    assert steps(2, 3) == steps(3, 2) == steps(6, 1) == one  # global batch 24 in micro-batches of 4
    assert len(one) == (4 if drop_last else 5)


def test_a_step_takes_the_same_samples_whatever_its_micro_batch():
    from ddp_tricks import plan

    def step_sets(micro_batch, accum_steps):
        p = plan.make(num_train=103, world_size=2, micro_batch=micro_batch, accum_steps=accum_steps, epochs=1,
                      seed=7, base_lr=0.1, lr_scaling="keep", base_batch=24, warmup_epochs=0)  # fmt: skip
        ranks = [p.epoch(3, rank) for rank in range(2)]
        return [sorted(i for r in ranks for m in r[s].micro_batches for i in m) for s in range(p.steps_per_epoch)]

    whole = step_sets(12, 1)
    assert step_sets(6, 2) == step_sets(4, 3) == whole  # global batch 24
    assert [len(s) for s in whole] == [24, 24, 24, 24, 7]  # the last step short: 7 samples in 2, 4 or 6 slots
    assert step_sets(2, 6) == whole[:4]  # 7 samples cannot fill 12 slots: left out (the next epoch has them)


def test_an_unaccumulated_rank_takes_what_distributed_sampler_gives_it():
    from ddp_tricks import plan

    p = plan.make(num_train=50, world_size=2, micro_batch=8, accum_steps=1, epochs=1, seed=3, base_lr=0.1,
                  lr_scaling="keep", base_batch=16, warmup_epochs=0)  # fmt: skip
    for rank in range(2):
        sampler = DistributedSampler(range(50), 2, rank, shuffle=True, seed=3)
        sampler.set_epoch(4)
        expected = list(sampler)  # 25 each: nothing padded
        assert [i for step in p.epoch(4, rank) for m in step.micro_batches for i in m] == expected


def test_a_resumed_run_keeps_its_global_batch_at_another_world_size():
    from ddp_tricks import plan

    def resumed(world_size, batch_size=16, equal_shares=""):
        return plan.make(num_train=500, world_size=world_size, micro_batch=batch_size, accum_steps=1, epochs=1,
                         seed=0, base_lr=0.1, lr_scaling="keep", base_batch=96, warmup_epochs=0,
                         run_batch=(96, 16), equal_shares=equal_shares)  # fmt: skip

    assert [(p.micro_batch, p.accum_steps, p.global_batch) for p in map(resumed, (1, 2, 3, 6))] == [
        (16, 6, 96), (16, 3, 96), (16, 2, 96), (16, 1, 96)]  # fmt: skip
    assert resumed(2).relayout == (
        "the run's global batch 96 is kept on 2 process(es) (this command's --batch-size/--accum-steps, which give "
        "32, are not used): micro-batch 16 x accumulation 3"
    )
    four = resumed(4)  # 6 micro-batches of 16 on 4: the run's micro-batches, in uneven shares
    assert (four.micro_batch, four.accum_steps, four.shares(), four.uneven_shares) == (16, 2, [2, 2, 1, 1], True)
    assert "6 micro-batches of 16 spread 2,2,1,1" in four.relayout and "BatchNorm" not in four.relayout
    # what needs equal shares (FSDP) takes a micro-batch the world size divides: 96 = 12 x 4 x 2, and says so
    four = resumed(4, equal_shares="--strategy fsdp")
    assert (four.micro_batch, four.accum_steps, four.uneven_shares) == (12, 2, False) and "BatchNorm" in four.relayout
    assert resumed(4, batch_size=8).micro_batch == 8  # --batch-size stays the ceiling (12 slots: 3 each)
    assert resumed(6).relayout == ""  # the layout it was written with
    assert resumed(5).shares() == [2, 1, 1, 1, 1]
    with pytest.raises(UserError) as error:
        resumed(5, equal_shares="--strategy fsdp (why)")
    assert str(error.value).startswith(
        "the run's global batch 96 cannot be kept on 5 processes: --strategy fsdp (why) needs every rank to run as "
        "many micro-batches in a step"
    )
    assert "1, 2, 3, 4, 6, 8, 12, 16, ..." in str(error.value)


def test_the_global_batch_of_a_checkpoint_from_before_the_plan_was_recorded_comes_from_its_flags():
    from ddp_tricks import plan

    assert plan.recorded(None) is None
    assert plan.recorded({"plan": {"global_batch_size": 96, "micro_batch": 16}}) == (96, 16)
    old = {"config": {"batch_size": 8, "accum_steps": 3}, "world_size": 2}
    assert plan.recorded(old) == (48, 8)
    assert plan.recorded({"config": {"batch_size": 8, "batch_trace": "t.csv"}, "world_size": 2}) is None


def test_a_resume_that_must_change_the_micro_batch_keeps_the_run_s_steps_per_epoch():
    from ddp_tricks import plan

    def planned(world_size, batch_size=8, num_train=99, equal_shares="--strategy fsdp"):
        return plan.make(num_train=num_train, world_size=world_size, micro_batch=batch_size, accum_steps=1,
                         epochs=2, seed=0, base_lr=0.1, lr_scaling="keep", base_batch=24, warmup_epochs=0,
                         run_batch=(24, 8), equal_shares=equal_shares)  # fmt: skip

    # 99 = 4 x 24 + 3: the short step's 3 samples fill the 3 slots of 8, so the run takes 5 steps an epoch
    assert (planned(1).micro_batch, planned(1).accum_steps, planned(1).steps_per_epoch) == (8, 3, 5)
    assert (planned(3).micro_batch, planned(3).accum_steps) == (8, 1)
    with pytest.raises(UserError) as error:  # on 4 processes every micro-batch (6, 3, 2, 1) makes 4+ slots: 4 steps
        planned(4)
    assert "cannot be kept on 4 processes" in str(error.value) and "in 5 steps an epoch" in str(error.value)
    uneven = planned(4, equal_shares="")  # in uneven shares, the run's 3 micro-batches of 8 keep the 5 steps
    assert (uneven.micro_batch, uneven.shares(), uneven.steps_per_epoch) == (8, [1, 1, 1, 0], 5)
    with pytest.raises(UserError) as error:  # a ceiling under the run's micro-batch: 6, 4, 3, 2, 1 make 4 steps
        planned(4, batch_size=4, equal_shares="")
    assert "none that divides it makes its 5 steps an epoch; pass --batch-size 8" in str(error.value)
    # 100 = 4 x 24 + 4: on 2 processes with --batch-size 6, micro-batches of 6 (4 slots) keep the 5th step
    two = planned(2, batch_size=6, num_train=100)
    assert (two.micro_batch, two.accum_steps, two.steps_per_epoch) == (6, 2, 5)
    assert two.total_steps == planned(1, num_train=100).total_steps == 10


def test_a_run_comes_back_to_its_own_micro_batch_after_a_forced_change():
    from ddp_tricks import plan

    def planned(world_size, state):  # under FSDP, whose ranks need equal shares
        return plan.make(num_train=1000, world_size=world_size, micro_batch=8, accum_steps=3, epochs=1, seed=0,
                         base_lr=0.1, lr_scaling="keep", base_batch=24, warmup_epochs=0,
                         run_batch=plan.recorded(state), equal_shares="--strategy fsdp")  # fmt: skip

    one = planned(1, {"plan": {"global_batch_size": 24, "micro_batch": 8}})
    two = planned(2, {"plan": one.summary()})  # 24 = 8 x 2 x 1.5: the micro-batch must change
    assert two.micro_batch == 6 and "the run's micro-batch was 8" in two.relayout
    back = planned(1, {"plan": two.summary()})
    assert (back.micro_batch, back.accum_steps, back.relayout) == (8, 3, "")


def test_a_checkpoint_with_an_empty_plan_falls_back_to_its_flags():
    from ddp_tricks import plan

    assert plan.recorded({"plan": {}, "config": {"batch_size": 4, "accum_steps": 2}, "world_size": 2}) == (16, 4)


def test_the_feed_finishes_each_batch_and_keeps_no_wait_of_its_own():
    """The loader's wait is the step log's (it times each next() of the loop): the Feed holds its loader, device,
    finishing and batch transform only. Broken on purpose: the Feed's own `waited` counter (read by nothing) back
    fails it."""
    from torch.utils.data import DataLoader, TensorDataset

    from ddp_tricks.data.feed import Feed

    inputs, targets = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=4)
    feed = Feed(loader, torch.device("cpu"), lambda x, device: (2 * x).to(device))
    batches = list(feed)
    assert [len(t) for _, t in batches] == [4, 2] and len(feed) == 2
    assert torch.equal(torch.cat([x for x, _ in batches]), 2 * inputs)
    assert torch.equal(torch.cat([t for _, t in batches]), targets)
    assert sorted(vars(feed)) == ["device", "finish", "loader", "transform"]
