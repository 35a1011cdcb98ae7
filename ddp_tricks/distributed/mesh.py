"""`--fsdp-replicas R`: HSDP's 2-D device mesh, R replicas x world/R shards (torchtitan's `dp_replicate` x `fsdp`):
each parameter sharded within a group of world/R ranks (one node's GPUs, where R is the number of nodes: the
all-gathers stay inside a node) and replicated across the R groups (the gradients all-reduced between them). Ranks
r*S ... r*S + S-1 form replica r (torch's row-major mesh). Checked before the process group joins, built once
after.
"""

from __future__ import annotations

from ddp_tricks.errors import UserError


def check(world_size: int, replicas: int, strategy: str) -> None:
    """A layout that cannot be built, as one line (before any process group)."""
    if replicas == 1:
        return
    if strategy != "fsdp":
        raise UserError(f"--fsdp-replicas {replicas} acts only with --strategy fsdp: add it or drop --fsdp-replicas")
    if world_size % replicas:
        launch = " (and launch them with torchrun --nproc_per_node=N)" if world_size == 1 else ""
        raise UserError(
            f"--fsdp-replicas {replicas} does not divide the {world_size} process(es) into equal replicas: give a "
            f"divisor of {world_size}, or a multiple of {replicas} processes{launch} (each replica shards the model "
            "over world size / replicas processes)"
        )


def describe(world_size: int, replicas: int) -> str:
    """The start line's words for the mesh."""
    if replicas == 1:
        return f"sharded over all {world_size} process(es)"
    shards = world_size // replicas
    if shards == 1:  # every rank a whole replica: DDP's layout, through FSDP's gathers
        return f"HSDP: {replicas} replicas x 1 shard (nothing sharded: each process holds the whole model)"
    return f"HSDP: {replicas} replicas x {shards} shards (the shards of a replica: consecutive ranks)"


def build(device_type: str, world_size: int, replicas: int = 1):
    """The mesh `fsdp.shard` takes: 1-D over every rank, else (replicas, shards), named."""
    from torch.distributed.device_mesh import init_device_mesh

    if replicas == 1:
        return init_device_mesh(device_type, (world_size,))
    shape = (replicas, world_size // replicas)
    return init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard"))
