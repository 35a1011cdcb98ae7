"""Variable batch size from a trace: `batch_trace` (trace files, how an epoch is cut, the LR rules; the traced
reduction and AdaScale are distributed/trace_reduction.py's) and `original_api` (the original project's
CustomSampler and rule optimizers)."""
