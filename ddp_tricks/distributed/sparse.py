"""Sparse gradients (an nn.Embedding(sparse=True)'s) averaged over the ranks by the template, not by DDP's reducer.

DDP takes sparse gradients on gloo, but its reducer's sparse path corrupts the heap now and then (torch 2.14.1 on
CPU: glibc's "malloc(): unaligned tcache chunk detected" and an abort, inside backward(), about once in a few
thousand steps of 2 processes, in a plain torch script as in the template; the same tensors reduced after the
backward, on the calling thread, never did). So DDP is built without the sparse tables (`wrap(apart=...)`), and
after a step's last backward `SparseGradients.reduce()` averages their gradients: each rank's coalesced rows go out
in one all-gather of the row counts (a host read: sparse sizes are data, a CPU collective on gloo) and one of the
indices and one of the values (per dtype), padded to the longest rank's (collectives.gather_rows; none when no
rank has a row); every rank then sums the same rows in the same order and divides by the world size, as DDP's
mean does. A table this rank did not touch in the step
takes part with no rows; one that no rank touched is left without a gradient on every rank, as DDP leaves it.
Rows are indexed by the first dimension (an embedding's gradient; any other sparse gradient is made so first).
"""

from __future__ import annotations

import torch

from ddp_tricks.distributed.collectives import gather_from_ranks, gather_rows
from ddp_tricks.distributed.stacks import waits_for


class SparseGradients:
    """The gradients of the parameters named `names` (of `model`, before any wrapper), averaged over the ranks by
    `reduce()`, which every rank calls once per optimizer step, after the step's last backward."""

    def __init__(self, model: torch.nn.Module, names, world_size: int):
        named = dict(model.named_parameters())
        self.params = [named[name] for name in names]
        self.world_size = world_size

    @waits_for("all_gather")  # its reads of the counts: where nccl's host waits
    def reduce(self) -> None:
        grads = [_coalesced(p) for p in self.params]
        counts = gather_from_ranks(torch.tensor([g._nnz() for g in grads]))  # [ranks, tables]: rows of each
        # every table's indices, then every table's values of each dtype, in one flat buffer per kind and rank
        indices = _gathered([g._indices().reshape(-1) for g in grads], counts)
        values = {}
        for dtype in dict.fromkeys(g.dtype for g in grads):
            mine = [k for k, g in enumerate(grads) if g.dtype == dtype]
            parts = [grads[k]._values().reshape(-1) for k in mine]
            values[dtype] = (mine, _gathered(parts, counts[:, mine] * _row_sizes([grads[k] for k in mine])))
        for k, (param, grad) in enumerate(zip(self.params, grads)):
            if int(counts[:, k].sum()) == 0:  # no rank has a row of it (on every rank alike)
                param.grad = None
                continue
            mine, gathered = values[grad.dtype]
            rows = torch.cat([part[mine.index(k)] for part in gathered]).reshape(-1, *grad.shape[1:])
            where = torch.cat([part[k] for part in indices]).reshape(1, -1)
            total = torch.sparse_coo_tensor(where, rows, grad.shape, check_invariants=False).coalesce()
            param.grad = total / self.world_size


def _coalesced(param: torch.Tensor) -> torch.Tensor:
    """This rank's gradient of `param` as a coalesced sparse tensor of rows (one sparse dimension, one row per index):
    none is no rows."""
    grad = param.grad
    if grad is None:
        return torch.sparse_coo_tensor(
            torch.empty(1, 0, dtype=torch.int64, device=param.device),
            torch.empty(0, *param.shape[1:], dtype=param.dtype, device=param.device),
            param.shape,
        )
    if not grad.is_sparse or grad.sparse_dim() != 1:
        grad = grad.to_dense().to_sparse(1)
    return grad.coalesce()


def _row_sizes(grads) -> torch.Tensor:
    """The values in one row of each gradient."""
    return torch.tensor([g.shape[1:].numel() for g in grads])


def _gathered(parts: list[torch.Tensor], lengths: torch.Tensor) -> list[list[torch.Tensor]]:
    """This rank's flat `parts` concatenated and all-gathered, each rank's cut back into its parts; `lengths`
    [ranks, parts] are every rank's part lengths (all known from the counts: no all-gather of sizes)."""
    every = gather_rows(torch.cat(parts), sizes=lengths.sum(1).tolist()).split(lengths.flatten().tolist())
    return [list(every[rank * len(parts) : (rank + 1) * len(parts)]) for rank in range(len(lengths))]
