"""`--fsdp-replicas R`: HSDP's 2-D device mesh, R replicas x world/R shards (torchtitan's `dp_replicate` x `fsdp`):
each parameter sharded within a group of world/R ranks (one node's GPUs, where R is the number of nodes: the
all-gathers stay inside a node) and replicated across the R groups (the gradients all-reduced between them). Ranks
r*S ... r*S + S-1 form replica r (torch's row-major mesh). One `Mesh`: checked before the process group joins,
built once after, and handed to what needs it (fsdp.shard, the optimizers' norms, the clipping, the EMA).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ddp_tricks.errors import UserError


@dataclass(frozen=True)
class Mesh:
    """`replicas` x `shards` ranks (1 replica: a 1-D mesh over every rank). `check` makes one from the flags before
    any process group; `build` adds torch's DeviceMesh, made once, after the group is joined."""

    world_size: int
    replicas: int = 1
    device_mesh: object = field(default=None, repr=False, compare=False)  # torch's DeviceMesh, once built

    @classmethod
    def check(cls, world_size: int, replicas: int, strategy: str) -> Mesh:
        """The mesh of these flags, or a layout that cannot be built as one line (before any process group)."""
        if replicas != 1 and strategy != "fsdp":
            raise UserError(
                f"--fsdp-replicas {replicas} acts only with --strategy fsdp: add it or drop --fsdp-replicas"
            )
        if world_size % replicas:
            launch = " (and launch them with torchrun --nproc_per_node=N)" if world_size == 1 else ""
            raise UserError(
                f"--fsdp-replicas {replicas} does not divide the {world_size} process(es) into equal replicas: give "
                f"a divisor of {world_size}, or a multiple of {replicas} processes{launch} (each replica shards the "
                "model over world size / replicas processes)"
            )
        return cls(world_size, replicas)

    @property
    def shards(self) -> int:
        """The ranks that share the slices of one replica."""
        return self.world_size // self.replicas

    def describe(self) -> str:
        """The start line's words for the mesh."""
        if self.replicas == 1:
            return f"sharded over all {self.world_size} process(es)"
        if self.shards == 1:  # every rank a whole replica: DDP's layout, through FSDP's gathers
            return f"HSDP: {self.replicas} replicas x 1 shard (nothing sharded: each process holds the whole model)"
        return f"HSDP: {self.replicas} replicas x {self.shards} shards (the shards of a replica: consecutive ranks)"

    def build(self, device_type: str) -> Mesh:
        """This mesh with torch's DeviceMesh: 1-D over every rank, else (replicas, shards), named (a 2-D one makes
        its process groups: a collective)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.replicas == 1:
            return replace(self, device_mesh=init_device_mesh(device_type, (self.world_size,)))
        shape = (self.replicas, self.shards)
        return replace(self, device_mesh=init_device_mesh(device_type, shape, mesh_dim_names=("replicate", "shard")))

    def shard_group(self):
        """The process group of the shard dimension, over which a sharded tensor's norm sums its slices: a 2-D
        mesh's is one replica's ranks (every replica holds the same slices: a whole-world sum would count each of
        them once per replica)."""
        if self.replicas == 1:
            return self.device_mesh.get_group()
        return self.device_mesh.get_group(mesh_dim="shard")

    @property
    def placements(self) -> tuple:
        """How FSDP lays a parameter, and the optimizer state like it, on the mesh: dim 0 split over the shard
        dimension, the replicas each holding the same slices."""
        from torch.distributed.tensor import Replicate, Shard

        return (Shard(0),) if self.replicas == 1 else (Replicate(), Shard(0))
