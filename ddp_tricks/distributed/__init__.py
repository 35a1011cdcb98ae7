"""Distributed plumbing: `launch` (how we were started, device, backend, process group), `wrap` (DDP, and keeping
gradients local while accumulating), `fsdp` (FSDP2 sharding), `collectives` (values reduced across ranks) and
`preemption` (SIGTERM, agreed on by every rank)."""
