"""What --optimizer muon costs: (1) under 2-process FSDP (gloo), the bytes Muon's two all-to-alls move per step
against the bytes of the gradient's reduce-scatter in the same step (both counted from the collectives' arguments);
(2) in one process, MuonAdamW's step time against torch's AdamW's (and torch.optim.Muon + AdamW's), measured
interleaved in one run after warm-up; (3) under 2-process DDP, every rank orthogonalising every matrix (what the
template does) against a bench-only variant that deals the matrices to the ranks (shards.deal) and broadcasts each
owner's results. The model: an embedding, --depth blocks of two hidden matrices (width x 4 width and back), layer
norms and the output head. The last line is one JSON object.

    python bench/muon.py [--width 256] [--depth 2] [--repeats 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ddp_tricks.optim import build as optimizers
from ddp_tricks.optim.muon import MuonAdamW, adjusted_lr, newton_schulz
from ddp_tricks.shards import deal

VOCAB, LR, WD = 512, 0.003, 0.01
HEAD = ("head.weight", "head.bias")


class Model(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x))


def model(args) -> Model:
    torch.manual_seed(0)
    return Model(args.width, args.depth)


def give_gradients(net: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=g) * 1e-2


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def timed(makers: dict, step_of, repeats: int, sync=lambda: None) -> dict[str, list[float]]:
    """Each of `makers`' optimizers stepped once per round, the order reversed every other round; the first round
    warms up. The seconds of each step (`sync` before the clock starts and before it stops)."""
    seconds = {name: [] for name in makers}
    for repeat in range(repeats + 1):
        for name, optimizer in makers.items() if repeat % 2 else reversed(makers.items()):
            step_of(name, repeat)
            sync()
            start = time.perf_counter()
            optimizer.step()
            sync()
            if repeat:
                seconds[name].append(time.perf_counter() - start)
    return seconds


class TorchMuonAdamW:
    """torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the rest: the reference (its step())."""

    def __init__(self, net: nn.Module, hidden: list[str]):
        named = dict(net.named_parameters())
        self.muon = torch.optim.Muon([named[n] for n in hidden], lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([p for n, p in named.items() if n not in hidden], lr=LR, weight_decay=WD)

    def step(self):
        self.muon.step()
        self.adamw.step()


def one_process(args) -> dict:
    """MuonAdamW's, torch's AdamW's and torch's Muon + AdamW's step times, each on its own copy of the model."""
    nets = {name: model(args) for name in ("adamw", "muon", "torch_muon")}
    muon = optimizers.build(nets["muon"], "muon", lr=LR, weight_decay=WD, head=HEAD)
    hidden = [n for n, p in nets["muon"].named_parameters() if any(p is q for g in muon.param_groups if g["muon"]
                                                                    for q in g["params"])]  # fmt: skip
    makers = {
        "adamw": torch.optim.AdamW(nets["adamw"].parameters(), lr=LR, weight_decay=WD),
        "muon": muon,
        "torch_muon": TorchMuonAdamW(nets["torch_muon"], hidden),
    }
    seconds = timed(makers, lambda name, k: give_gradients(nets[name], k), args.repeats)
    ms = {name: median_ms(s) for name, s in seconds.items()}
    return {"step_ms": ms, "muon_over_adamw": ms["muon"] / ms["adamw"], "hidden_matrices": len(hidden),
            "torch_muon_over_adamw": ms["torch_muon"] / ms["adamw"]}  # fmt: skip


def join(rank: int, world_size: int, port: int, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(threads)


def fsdp_bytes(rank: int, world_size: int, args, port: int, results) -> None:
    """One training step of the FSDP2-sharded model (a forward and backward on random tokens, then MuonAdamW's
    step): the bytes each collective's input holds, and what leaves this rank (its own split stays)."""
    from torch.distributed.fsdp import fully_shard

    join(rank, world_size, port, args.threads)
    net = model(args)
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    optimizer = optimizers.build(net, "muon", lr=LR, weight_decay=WD, head=HEAD)
    counted = {"reduce_scatter": 0, "all_to_all": 0, "all_to_all_sent": 0}
    reduce_scatter, all_to_all = dist.reduce_scatter_single, dist.all_to_all_single

    def counting_reduce_scatter(output, input, *a, **k):
        counted["reduce_scatter"] += input.numel() * input.element_size()
        return reduce_scatter(output, input, *a, **k)

    def counting_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **k):
        size = input.element_size()
        counted["all_to_all"] += input.numel() * size
        counted["all_to_all_sent"] += (input.numel() - input_split_sizes[dist.get_rank(group)]) * size
        return all_to_all(output, input, output_split_sizes, input_split_sizes, group=group, **k)

    dist.reduce_scatter_single, dist.all_to_all_single = counting_reduce_scatter, counting_all_to_all
    try:
        tokens = torch.randint(VOCAB, (8, 32), generator=torch.Generator().manual_seed(rank))
        nn.functional.cross_entropy(net(tokens).flatten(0, 1), tokens.flatten()).backward()
        after_backward = dict(counted)
        optimizer.step()
    finally:
        dist.reduce_scatter_single, dist.all_to_all_single = reduce_scatter, all_to_all
    assert counted["reduce_scatter"] == after_backward["reduce_scatter"] and not after_backward["all_to_all"]
    matrices = sum(p.numel() * 4 for g in optimizer.param_groups if g["muon"] for p in g["params"])
    counted |= {"gradient": sum(p.numel() * 4 for p in net.parameters()), "matrices": matrices}
    if rank == 0:
        results.put(counted)
    dist.destroy_process_group()


class SplitMuon(MuonAdamW):
    """Bench only, under DDP (every matrix whole on every rank): each matrix orthogonalised by its owner among the
    ranks (shards.deal, as under FSDP) and each owner's results broadcast from it, one broadcast per rank."""

    @torch.no_grad()
    def step(self, closure=None):
        rank, ranks = dist.get_rank(), dist.get_world_size()
        matrices = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                matrices += [(group, p, self._momentum(group, p)) for p in params]
            elif params:
                self._adamw(group, params)
        owners = deal([p.numel() for _, p, _ in matrices], ranks)
        results = [None] * len(matrices)
        for owner in range(ranks):
            ids = [i for i, o in enumerate(owners) if o == owner]
            if owner == rank:
                done = [newton_schulz(matrices[i][2].reshape(matrices[i][1].shape[0], -1), matrices[i][0]["ns_steps"])
                        for i in ids]  # fmt: skip
                flat = torch.cat([o.reshape(-1) for o in done])
            else:
                flat = matrices[0][2].new_empty(sum(matrices[i][1].numel() for i in ids))
            dist.broadcast(flat, src=owner)
            for i, piece in zip(ids, flat.split([matrices[i][1].numel() for i in ids])):
                results[i] = piece
        for (group, p, _), o in zip(matrices, results):
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(o.view_as(p), alpha=-adjusted_lr(group["lr"], p.shape))


def ddp_split(rank: int, world_size: int, args, port: int, results) -> None:
    """Every rank orthogonalising all (MuonAdamW) against SplitMuon, the same gradients on every rank (as after
    DDP's all-reduce); each step between two barriers; the two end bit-identical."""
    join(rank, world_size, port, args.threads)
    nets = {"all": model(args), "split": model(args)}
    makers = {
        "all": optimizers.build(nets["all"], "muon", lr=LR, weight_decay=WD, head=HEAD),
        "split": SplitMuon(
            optimizers.build(nets["split"], "muon", lr=LR, weight_decay=WD, head=HEAD).param_groups,
            lr=LR,
            weight_decay=WD,
        ),  # fmt: skip
    }
    seconds = timed(makers, lambda name, k: give_gradients(nets[name], k), args.repeats, sync=dist.barrier)
    same = all(torch.equal(a, b) for a, b in zip(nets["all"].parameters(), nets["split"].parameters()))
    if rank == 0:
        results.put({"step_ms": {name: median_ms(s) for name, s in seconds.items()}, "bit_identical": same})
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_ranks(fn, args, world_size: int = 2) -> dict:
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(fn, (world_size, args, free_port(), results), nprocs=world_size, start_method="spawn")
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sent = on_ranks(fsdp_bytes, args)
    rs_sent = sent["reduce_scatter"] // 2  # a reduce-scatter of 2 ranks: half the input leaves each rank
    share = sent["matrices"] / sent["gradient"]
    print(f"FSDP, 2 processes, per rank and step: the gradient's reduce-scatter takes {sent['reduce_scatter']:,} "
          f"bytes and sends {rs_sent:,}; Muon's all-to-alls take {sent['all_to_all']:,} and send "
          f"{sent['all_to_all_sent']:,} ({sent['all_to_all_sent'] / rs_sent:.3f} x the reduce-scatter's; the "
          f"hidden matrices are {share:.1%} of the gradient's {sent['gradient']:,} bytes)")  # fmt: skip
    one = one_process(args)
    ms = one["step_ms"]
    print(f"1 process, {one['hidden_matrices']} hidden matrices: AdamW {ms['adamw']:.2f} ms/step, MuonAdamW "
          f"{ms['muon']:.2f} ({one['muon_over_adamw']:.2f} x), torch Muon + AdamW {ms['torch_muon']:.2f} "
          f"({one['torch_muon_over_adamw']:.2f} x)")  # fmt: skip
    ddp = on_ranks(ddp_split, args)
    ms = ddp["step_ms"]
    print(
        f"DDP, 2 processes: every rank orthogonalising all {ms['all']:.2f} ms/step, split and broadcast "
        f"{ms['split']:.2f} ({ms['split'] / ms['all']:.2f} x); bit-identical: {ddp['bit_identical']}"
    )
    print(json.dumps({"width": args.width, "depth": args.depth, "threads": args.threads, "fsdp_bytes": sent,
                      "fsdp_muon_over_reduce_scatter_sent": sent["all_to_all_sent"] / rs_sent, "one_process": one,
                      "ddp": ddp | {"split_over_all": ms["split"] / ms["all"]}}))  # fmt: skip


if __name__ == "__main__":
    main()
