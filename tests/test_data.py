"""The embedded dataset, the training sampler's epochs, and the exact evaluation split."""

import argparse

import torch
from torch.utils.data import DistributedSampler

import data


def test_digits_split_is_fixed_and_disjoint():
    first, second = data._digits(), data._digits()
    assert len(first.train_set) + len(first.val_set) == 1797  # scikit-learn's bundled digits
    assert len(first.val_set) == 359
    assert torch.equal(first.val_set.inputs, second.val_set.inputs)
    train_rows = {tuple(x.flatten().tolist()) for x in first.train_set.inputs}
    overlap = sum(tuple(x.flatten().tolist()) in train_rows for x in first.val_set.inputs)
    assert overlap <= 5  # a few digits are pixel-identical in the raw data; the split itself is disjoint
    assert first.train_set.inputs.shape[1:] == (1, 8, 8)


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


def test_shard_sampler_gives_each_validation_sample_to_exactly_one_rank():
    for world in (1, 2, 3):
        shards = [list(data.ShardSampler(359, world, rank)) for rank in range(world)]
        flat = sorted(i for shard in shards for i in shard)
        assert flat == list(range(359))


def test_validation_set_smaller_than_world_is_refused():
    tiny = data.Data(
        data.InMemoryDataset(torch.zeros(4, 1), torch.zeros(4)),
        data.InMemoryDataset(torch.zeros(2, 1), torch.zeros(2)),
        2,
        1,
        1,
    )
    try:
        data.check_sizes(tiny, 3)
    except data.UserError as error:
        assert "validation set has 2 samples" in str(error)
    else:
        raise AssertionError("no error")


def test_missing_mnist_names_the_path_and_the_fix(tmp_path):
    cfg = argparse.Namespace(dataset="mnist", data_root=str(tmp_path / "nowhere"), download=False)
    try:
        data.load(cfg)
    except data.UserError as error:
        assert "nowhere" in str(error) and "--download" in str(error)
    else:
        raise AssertionError("no error")
