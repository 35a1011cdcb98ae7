"""Data: `in_memory` (a dataset held as one tensor), `loaders` (the plan's batch sampler, the exact evaluation
split, loaders and their seeds), `workers` (DataLoader workers leave SIGTERM and SIGINT to the rank) and `images`
(the built-in task's readers)."""
