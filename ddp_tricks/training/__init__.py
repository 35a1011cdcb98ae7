"""The loop and its state: `loop` (train_one_epoch, the exact evaluation), `state` (the training state a
checkpoint holds), `seam` (the task as the loop calls it), `batches` (batches and outputs of any structure),
`precision` and `precise_bn`."""
