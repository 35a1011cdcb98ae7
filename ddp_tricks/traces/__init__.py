"""Variable batch size from a trace: `batch_trace` (trace files, how an epoch is cut, AdaScale, the traced
reduction) and `original_api` (the original project's CustomSampler and rule optimizers)."""
