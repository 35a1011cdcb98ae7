"""Distributed plumbing: `launch` (how we were started, device, backend, process group), `wrap` (DDP, and keeping
gradients local while accumulating), `fsdp` (FSDP2 sharding), `collectives` (values reduced across ranks),
`preemption` (SIGTERM, agreed on by every rank), `watchdog` (a failing or stuck rank ends the job in seconds) and
`heartbeat` (a silent rank, or a job without progress, ends it with a line per rank saying where it waits)."""
