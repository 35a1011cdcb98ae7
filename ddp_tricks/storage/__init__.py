"""What a run leaves on disk: `run_folder` (runs/<name>/: config, metrics, log) and `checkpoint` (atomic saves,
safe loads, what --resume means)."""
