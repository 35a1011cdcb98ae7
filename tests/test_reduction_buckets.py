"""The uneven-shares (and traced) reduction in buckets (#48): its all-reduces move DDP-sized buckets of one dtype, the
sums exact, and a step with the noise scale measured holds the gradients and one bucket, no copy of them (each
micro-batch's squared norm read by hooks as autograd hands its gradient over). bench/reduction_memory.py measures the
memory against DDP's."""

import json

import pytest
import torch
from multiproc import run_ranks
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ddp_tricks.distributed.trace_reduction import TraceReduction, buckets, reduce_gradients
from ddp_tricks.training.noise import NoiseScale

KIB = 1024
SHAPES = [((64, 64), torch.float32), ((64,), torch.float32), ((300,), torch.float64), ((40, 40), torch.float32),
          ((8,), torch.float64), ((3000,), torch.float32)]  # fmt: skip


def grads_of(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype) for shape, dtype in SHAPES]


def test_buckets_hold_one_dtype_each_at_most_the_cap_in_order_and_a_larger_tensor_alone():
    """Broken on purpose: one bucket for all the float32 tensors (the cap ignored) fails it."""
    tensors = grads_of(0)
    cap = 16 * KIB  # 4096 float32 numbers: the 64 x 64 weight fills one alone
    found = buckets(tensors, cap)
    assert [[id(t) for t in b] for b in found] == [
        [id(tensors[0])],  # 16 KiB: the cap
        [id(tensors[1]), id(tensors[3])],  # 256 B + 6400 B
        [id(tensors[5])],  # 12000 B: would pass the cap with the two before
        [id(tensors[2]), id(tensors[4])],  # float64 apart
    ]
    assert all(len({t.dtype for t in b}) == 1 for b in found)
    assert all(sum(t.numel() * t.element_size() for t in b) <= cap or len(b) == 1 for b in found)
    assert [[id(t) for t in b] for b in buckets(tensors[:2], 2**30)] == [[id(tensors[0]), id(tensors[1])]]


def _reduced(rank: int, world_size: int, cap_mb: float) -> list[torch.Tensor]:
    params = [nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape, dtype in SHAPES]
    reduce_gradients(params, grads_of(rank), 0.0, None, 1, bucket_mb=cap_mb)
    return [p.grad for p in params]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_bucketed_all_reduce_is_the_exact_sum_of_the_ranks_gradients_in_their_dtype():
    """Two ranks, buckets of 10 KiB (the first weight alone, in place; the rest packed per dtype): each gradient is
    exactly rank 0's plus rank 1's (one addition: no order to differ), in its own dtype. Broken on purpose: a bucket's
    copy back skipped (its flat buffer reduced, the gradients left as they were) fails it."""
    got = run_ranks(_reduced, 2, 10 / 1024, timeout=100)
    expected = [a + b for a, b in zip(grads_of(0), grads_of(1))]
    for rank in (0, 1):
        assert all(g.dtype == e.dtype and torch.equal(g, e) for g, e in zip(got[rank], expected))


def peak_bytes(run, trace) -> int:
    """The peak of the bytes allocated while `run()` runs, over those allocated before (the profiler's memory events,
    written to `trace`, carry the CPU allocator's running total)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    prof.export_chrome_trace(str(trace))
    events = [e["args"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "[memory]"]
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - before


@pytest.mark.timeout(120)
def test_a_step_with_the_noise_scale_holds_the_gradients_and_one_layer_s_more_not_a_copy(tmp_path):
    """Three micro-batches through 6 layers of 256 x 256 (256 KiB a weight), the noise scale measured, no process
    group: the step's peak is the gradients plus one weight's gradient as autograd hands it over (and small change),
    not twice the gradients; the micro-batches' squared norms summed are those the test reads from each gradient alone.
    Broken on purpose: the micro-batch gradients kept in a copy (an accumulation buffer beside .grad, as before)
    fails it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    params = list(model.parameters())
    inputs = [torch.randn(4, 256) for _ in range(3)]
    grads_bytes = sum(p.numel() * p.element_size() for p in params)
    reduction = TraceReduction(params, 4, noise=NoiseScale(torch.device("cpu")), slots=3)

    def step():
        for x in inputs:
            (model(x).square().mean() / 3).backward()
            reduction.after_backward(1.0 / 3)

    peak = peak_bytes(step, tmp_path / "trace.json")
    assert peak <= grads_bytes + 256 * KIB + 64 * KIB, (peak, grads_bytes)
    measured = reduction._sq_norms.item()
    alone = 0.0
    for x in inputs:  # each micro-batch's gradient alone, over its weight 1/3: what the hooks must have read
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        alone += sum(float(p.grad.double().square().sum()) for p in params)
    assert measured == pytest.approx(alone, rel=1e-6)
