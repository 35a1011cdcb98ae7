"""A sharded checkpoint (`--strategy fsdp`: runs/NAME/last.dcp) as one plain file: the whole model's weights, and
with --optimizer the optimizer's per-parameter tensors too (momentum, moments, Lookahead's slow weights) whole,
gathered from every rank's slices. One process, no GPU needed.

    python tools/export.py runs/NAME/last.dcp -o weights.pt
    python -c "import torch; model.load_state_dict(torch.load('weights.pt', weights_only=True)['model'])"

The file holds {"model": {name: tensor}, "weights": which weights they are} (plus "optimizer": {key: tensor} with
--optimizer; the step counts and hyper-parameters stay in the checkpoint's state.pt), readable with
`torch.load(..., weights_only=True)` into the unwrapped model, outside the template. A run with --model-ema holds
two sets of weights: the trained ones (the default) and their EMA (`--weights ema`, written under "model" all the
same, so that it loads the same way). (best.pt of a sharded run is such a file already, written at the best epoch,
with the EMA's weights, if any, in its ["ema"]["weights"].)
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
    result = {"model": {}, "optimizer": {}, "ema": {}}
    parts = {"model": "state/model/", "optimizer": "state/optimizer/", "ema": "state/ema/weights/"}
    for part, prefix in parts.items():
        result[part] |= {k[len(prefix) :]: v for k, v in whole.items() if k.startswith(prefix)}
    kept = [("model", skeleton["model"])] + ([("ema", skeleton["ema"]["weights"])] if skeleton.get("ema") else [])
    for part, entries in kept:  # buffers, and what was not sharded, sit in state.pt
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                result[part][name] = value
    result["weights"] = skeleton.get("weights", {})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a sharded checkpoint: runs/NAME/last.dcp (or a folder it points to)")
    parser.add_argument("-o", "--output", required=True, help="the file to write")
    parser.add_argument("--optimizer", action="store_true", help="the optimizer state too")
    parser.add_argument(
        "--weights",
        choices=("trained", "ema"),
        default="trained",
        help="which weights go under 'model': the trained ones, or their EMA (a run with --model-ema)",
    )
    args = parser.parse_args(argv)
    try:
        if not Path(args.checkpoint).is_dir():
            raise UserError(f"{args.checkpoint!r} is not a sharded checkpoint's folder: give runs/NAME/last.dcp")
        state = full_state(args.checkpoint)
        if args.weights == "ema" and not state["ema"]:
            raise UserError(f"{args.checkpoint!r} holds no EMA of the weights (its run had no --model-ema)")
    except UserError as error:
        report(str(error))
        return 2
    described = state.pop("weights")
    ema = state.pop("ema")
    if args.weights == "ema":
        state["model"] = ema
    state["weights"] = described.get("ema" if args.weights == "ema" else "model", "the trained weights")
    if not args.optimizer:
        del state["optimizer"]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.output)
    extra = ", the optimizer state" if args.optimizer else ""
    print(f"{args.output}: {len(state['model'])} model tensors ({state['weights']}){extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
