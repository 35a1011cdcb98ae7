"""What a run leaves on disk: `run_folder` (runs/<name>/: config, metrics, log), `checkpoint` (when, what
--resume means, safe loads), `files` (atomic saves) and `sharded` (FSDP's sharded checkpoints)."""
