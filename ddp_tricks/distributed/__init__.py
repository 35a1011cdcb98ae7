"""Distributed plumbing: `launch` (how we were started, device, backend, process group), `wrap` (DDP),
`collectives` (values reduced across ranks) and `preemption` (SIGTERM, agreed on by every rank)."""
