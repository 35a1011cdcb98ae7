"""Sharded tensors for the optimizers: FSDP2 holds each parameter as a DTensor, every rank a slice of it. The
optimizers update the slices in place (`local`), keep their state sharded like the parameter (`like`), and get
the norm of each WHOLE tensor from the slices' squared norms, summed across the ranks in one all-reduce for all
the tensors of a step (`whole_norms`). Whole (unsharded) tensors pass through every function unchanged; beside sharded
ones (the 0-d parameters FSDP keeps whole on every rank) their squared norms enter that all-reduce from rank 0 only.
Muon's step transforms each WHOLE matrix once per step (`whole_matrices`: dealt to the ranks, gathered by its owner,
the result scattered back).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


def is_dtensor(tensor) -> bool:
    """Whether `tensor` is a DTensor, without importing torch.distributed.tensor (up to a second), so that
    `import lars` stays light: until FSDP (or anything else) has imported it, no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _norm_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float32 if tensor.dtype in (torch.float16, torch.bfloat16) else tensor.dtype


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a tensor this rank holds: a DTensor's local slice (sharing its storage), else the tensor."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


def shard_group(params: list[torch.Tensor], given=None):
    """The process group over which some of `params` are sharded (None: all whole tensors): `given` (the template's
    mesh's shard dimension, distributed/mesh.py), else, for an optimizer used alone, found from the first sharded
    one's mesh: a 2-D (HSDP) mesh's shard dimension."""
    sharded = [p for p in params if is_dtensor(p)]
    if not sharded:
        return None
    if given is not None:
        return given
    mesh = sharded[0].device_mesh
    if mesh.ndim == 1:
        return mesh.get_group()
    # HSDP (replicas x shards): the norms are summed over the shard dimension only; every replica holds the same
    # slices, and a whole-world sum would count each of them once per replica
    return mesh.get_group(mesh_dim=next(i for i, p in enumerate(sharded[0].placements) if p.is_shard()))


def like(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`value` (a local slice) as a tensor like `param`: a DTensor sharded as it is, or `value` itself."""
    if not is_dtensor(param):
        return value
    from torch.distributed.tensor import DTensor

    mesh, placements = param.device_mesh, param.placements
    return DTensor.from_local(value, mesh, placements, shape=param.shape, stride=param.stride(), run_check=False)


def whole_norms(
    lists: list[list[torch.Tensor]], group=None, whole: list[list[bool]] | None = None
) -> list[torch.Tensor]:
    """The 2-norm of every tensor in `lists` (one 1-D tensor per list). The tensors are whole ones, or this rank's
    slices of tensors sharded over `group`: then the squared norms of all the slices of all the lists are summed
    across the ranks in one all-reduce, whatever the number of tensors. `whole` (like `lists`): True where a tensor
    is whole on every rank beside sharded ones: counted from rank 0 only. No host sync."""
    norms = [torch.stack(torch._foreach_norm(tensors, 2, dtype=_norm_dtype(tensors[0]))) for tensors in lists]
    if group is None or not norms:
        return norms
    dtype = torch.float64 if any(n.dtype == torch.float64 for n in norms) else torch.float32
    squares = torch.cat([n.to(dtype) for n in norms]).square()
    if whole is not None and dist.get_rank(group) != 0 and any(any(w) for w in whole):
        counted = torch.tensor([not w for ws in whole for w in ws], dtype=dtype, device=squares.device)
        squares = squares * counted
    dist.all_reduce(squares, group=group)
    return [part.sqrt().to(n.dtype) for part, n in zip(squares.split([len(n) for n in norms]), norms)]


def trust_ratios(work: list[tuple], tensors_of, coefficients, ratio, on=None) -> list[torch.Tensor | None]:
    """The layer-wise ratios of each item of `work` (a param group, its parameters with gradients, their shard
    group, ...) whose group has lars on (or `on(group)`; None for the others): `ratio(w, u, *coefficients(group))`
    from the norms of the two lists `tensors_of(item)` gives (the weights, and what the ratio compares them with), all
    of them from one `whole_norms` call: one all-reduce per step however many tensors are sharded."""
    on = on or (lambda group: group.get("lars", True))
    scaled = [item for item in work if on(item[0])]
    shards = {item[2] for item in scaled if item[2] is not None}
    if len(shards) > 1:
        raise ValueError("the optimizer's parameters are sharded over different process groups; shard them over one")
    lists, whole = [], []
    for item in scaled:
        for tensors in tensors_of(item):
            lists.append(tensors)
            whole.append([not is_dtensor(p) for p in item[1]])
    norms = iter(whole_norms(lists, shards.pop() if shards else None, whole))
    taken = {id(item) for item in scaled}
    return [ratio(next(norms), next(norms), *coefficients(item[0])) if id(item) in taken else None for item in work]


def clip_grad_norm_(params: list[torch.Tensor], max_norm: float, group=None) -> torch.Tensor:
    """torch's `clip_grad_norm_` (2-norm), also where sharded parameters sit beside whole ones (which torch's refuses
    to stack): the total norm from `whole_norms` (one all-reduce over the shard group: `group`, else found from the
    gradients), every gradient scaled by the same coefficient. The total norm before clipping, on the device (no host
    sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [is_dtensor(g) for g in grads]
    if all(sharded) or not any(sharded):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = whole_norms([[local(g)] for g in grads], shard_group(grads, group), [[not s] for s in sharded])
    total = torch.linalg.vector_norm(torch.cat([n.float() for n in norms]))
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local(g).mul_(coefficient.to(g.dtype))
    return total


def deal(sizes: list[int], ranks: int) -> list[int]:
    """Each matrix's owner among `ranks`: largest first, each to the least loaded rank so far (by elements; ties to
    the lowest rank). The same on every rank."""
    loads, owners = [0] * ranks, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        owners[i] = min(range(ranks), key=lambda r: (loads[r], r))
        loads[owners[i]] += sizes[i]
    return owners


def whole_matrices(items: list[tuple], transform, contexts: list, given=None) -> list[torch.Tensor]:
    """`transform(U, context)` of each parameter's WHOLE matrix U (its first dimension by the rest), as this rank's
    slice of the result. `items`: (a parameter, its U's local slice); `contexts`: one per item. A whole parameter's U
    is transformed here. Sharded ones (FSDP2: dimension 0 over `given`, else the shard group of their mesh) are dealt
    to the group's ranks (`deal`); each owner gathers its matrices' slices, transforms each once, and the result's
    slices go back: two all-to-alls per step (per dtype), whatever the number of matrices."""
    results: list = [None] * len(items)
    sharded: dict[torch.dtype, list[int]] = {}
    for i, (p, u) in enumerate(items):
        if is_dtensor(p):
            sharded.setdefault(u.dtype, []).append(i)
        else:
            results[i] = transform(u.reshape(u.shape[0], -1), contexts[i]).view_as(u)
    if sharded:
        group = shard_group([items[i][0] for ids in sharded.values() for i in ids], given)
        for ids in sharded.values():
            _exchange([items[i] for i in ids], transform, [contexts[i] for i in ids], group, ids, results)
    return results


def _exchange(items: list[tuple], transform, contexts: list, group, ids: list[int], results: list) -> None:
    """whole_matrices for sharded matrices of one dtype: each rank's slice padded to ceil(rows / ranks) rows (FSDP2's
    torch.chunk split), sent to the matrix's owner in one all-to-all; the owner's results back in another."""
    ranks, me = dist.get_world_size(group), dist.get_rank(group)
    for p, _ in items:
        if not any(placement.is_shard(0) for placement in p.placements):
            raise ValueError(f"a matrix sharded as {p.placements} (whole_matrices takes them sharded on dimension 0)")
    rows = [p.shape[0] for p, _ in items]
    columns = [p.numel() // max(p.shape[0], 1) for p, _ in items]
    chunks = [-(-n // ranks) for n in rows]
    sizes = [c * m for c, m in zip(chunks, columns)]  # one rank's padded slice
    owners = deal([n * m for n, m in zip(rows, columns)], ranks)
    like = items[0][1]
    pieces, sent = [], [0] * ranks
    for owner in range(ranks):
        for j, (_, u) in enumerate(items):
            if owners[j] == owner:
                padded = u.new_zeros(sizes[j])
                padded[: u.numel()] = u.reshape(-1)
                pieces.append(padded)
                sent[owner] += sizes[j]
    mine = [j for j in range(len(items)) if owners[j] == me]
    each = sum(sizes[j] for j in mine)
    received = like.new_empty(each * ranks)
    dist.all_to_all_single(received, torch.cat(pieces), [each] * ranks, sent, group=group)
    blocks, back, offset = received.split(each) if each else [], [[] for _ in range(ranks)], 0
    for j in mine:
        parts = [block[offset : offset + sizes[j]].view(chunks[j], columns[j]) for block in blocks]
        whole = torch.cat(parts)[: rows[j]]
        result = whole.new_zeros(chunks[j] * ranks, columns[j])
        result[: rows[j]] = transform(whole, contexts[j])
        for rank in range(ranks):
            back[rank].append(result[rank * chunks[j] : (rank + 1) * chunks[j]].reshape(-1))
        offset += sizes[j]
    outgoing = torch.cat([piece for rank in back for piece in rank]) if mine else like.new_empty(0)
    returned = like.new_empty(sum(sent))
    dist.all_to_all_single(returned, outgoing, sent, [each] * ranks, group=group)
    offset = 0
    for owner in range(ranks):
        for j, (_, u) in enumerate(items):
            if owners[j] == owner:
                results[ids[j]] = returned[offset : offset + u.numel()].view_as(u)
                offset += sizes[j]
