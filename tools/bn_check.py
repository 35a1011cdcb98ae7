"""Is it BatchNorm? Evaluate one checkpoint twice, with the same weights: once with the running statistics it
saved, once with statistics recomputed from training samples (precise_bn.py, what --precise-bn does). A large
gap means the running statistics, not the weights, make the validation loss.

    python tools/bn_check.py runs/NAME/last.pt -- --config recipes/mnist-large-batch-lars.toml

The flags after `--` are the run's task and data flags (the same as for run.py); one process, on the CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import checkpoint  # noqa: E402
import config  # noqa: E402
import precise_bn  # noqa: E402


def evaluate(task, model, dataset, batch: int = 1000) -> tuple[float, float]:
    """(mean loss, accuracy %) over the dataset, in eval mode; the accuracy from the task's `acc` sum."""
    model.eval()
    loss_sum, acc_sum = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, len(dataset), batch):
            inputs, targets = dataset[start : start + batch]
            outputs = model(inputs)
            loss_sum += float(task.loss(outputs, targets)) * len(targets)
            acc_sum += float(task.metric_sums(outputs, targets)["acc"])
    return loss_sum / len(dataset), 100 * acc_sum / len(dataset)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a last.pt or best.pt")
    parser.add_argument("--samples", type=int, default=8000, help="training samples for the recomputed statistics")
    args = parser.parse_args(argv)
    try:
        run_args, task_class = config.parse(flags)
        task = task_class(run_args)
        train, val = task.datasets()
        model = task.model()
        checkpoint.restore_model(model, checkpoint.load(Path(args.checkpoint)), args.checkpoint)
    except config.UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    saved_loss, saved_acc = evaluate(task, model, val)
    train_loss, train_acc = evaluate(task, model, train)
    limit = min(args.samples, len(train))
    batches = [train[i : min(i + 1000, limit)][0] for i in range(0, limit, 1000)]
    precise_bn.recompute(model, iter(batches), len(batches))
    new_loss, new_acc = evaluate(task, model, val)
    new_train_loss, _ = evaluate(task, model, train)
    print(f"{args.checkpoint}: the same weights, evaluated with")
    print(f"  the saved running statistics:      val loss {saved_loss:.4f}, val acc {saved_acc:.2f} %"
          f" (train loss {train_loss:.4f}, acc {train_acc:.2f} %)")  # fmt: skip
    print(f"  statistics of {sum(len(b) for b in batches)} training samples: val loss {new_loss:.4f}, "
          f"val acc {new_acc:.2f} % (train loss {new_train_loss:.4f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
