"""A sharded checkpoint (`--strategy fsdp`: runs/NAME/last.dcp) as one plain file: the whole model's weights, and
with --optimizer the optimizer's per-parameter tensors too (momentum, moments, Lookahead's slow weights) whole,
gathered from every rank's slices. One process, no GPU needed.

    python tools/export.py runs/NAME/last.dcp -o weights.pt
    python -c "import torch; model.load_state_dict(torch.load('weights.pt', weights_only=True)['model'])"

The file holds {"model": {name: tensor}} (plus "optimizer": {key: tensor} with --optimizer; the step counts and
hyper-parameters stay in the checkpoint's state.pt), readable with
`torch.load(..., weights_only=True)` into the unwrapped model, outside the template. (best.pt of a sharded run is
such a file already, written at the best epoch.)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from ddp_tricks.errors import UserError, report
from ddp_tricks.storage import sharded


def full_state(path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """{"model": ..., "optimizer": ...} of a sharded checkpoint, every tensor whole, by its name in the state."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = Path(path).resolve()
    skeleton = sharded.read(path)  # a UserError where the checkpoint is not whole
    with tempfile.TemporaryDirectory() as scratch:
        dcp_to_torch_save(path, Path(scratch) / "whole.pt")
        whole = torch.load(Path(scratch) / "whole.pt", weights_only=True)
    result = {"model": {}, "optimizer": {}}
    for part in result:
        prefix = f"state/{part}/"
        result[part] |= {k[len(prefix) :]: v for k, v in whole.items() if k.startswith(prefix)}
    for name, value in skeleton["model"].items():  # buffers, and what was not sharded, sit in state.pt
        if isinstance(value, torch.Tensor):
            result["model"][name] = value
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a sharded checkpoint: runs/NAME/last.dcp (or a folder it points to)")
    parser.add_argument("-o", "--output", required=True, help="the file to write")
    parser.add_argument("--optimizer", action="store_true", help="the optimizer state too")
    args = parser.parse_args(argv)
    try:
        if not Path(args.checkpoint).is_dir():
            raise UserError(f"{args.checkpoint!r} is not a sharded checkpoint's folder: give runs/NAME/last.dcp")
        state = full_state(args.checkpoint)
    except UserError as error:
        report(str(error))
        return 2
    if not args.optimizer:
        del state["optimizer"]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.output)
    print(f"{args.output}: {len(state['model'])} model tensors" + (", the optimizer state" if args.optimizer else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
