"""What a billion-parameter language model needs, on the language-model example kept tiny (issue #51): packed
sequences (--pack) and activation checkpointing (--activation-checkpointing)."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F
from multiproc import launch

from ddp_tricks import cli

PACKED = ["--task", "examples/language_model.py:PythonSourceLM", "--pack", "--max-sequences", "24", "--max-length",
          "32", "--width", "16", "--depth", "1", "--heads", "2", "-b", "8", "-e", "1", "--optimizer", "sgd", "-l",
          "0.5", "--no-progress"]  # fmt: skip


def _task(argv):
    flags, task_class = cli.parse(argv)
    return task_class(flags)


def _rows(run_dir) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_packed_sequences_are_the_stream_of_whole_paragraphs_cut_into_full_windows_without_padding():
    """Every packed sequence has --max-length + 1 bytes (inputs and targets overlap by one); joined without their
    overlap they are the paragraphs' stream from its start; a batch has no padding and its units are its tokens.
    Broken on purpose: windows that do not overlap (stride --max-length + 1) fail it."""
    from examples.language_model import PAD, WHOLE, paragraphs

    task = _task(PACKED)
    train, val = task.datasets()
    texts = paragraphs(WHOLE, 24)
    n_val = round(len(texts) * 0.1)
    for split, docs in ((train, texts[n_val:]), (val, texts[:n_val])):
        stream = b"".join(text + b"\n\n" for text in docs)
        assert all(len(s) == 33 for s in split.sequences)
        joined = torch.cat([split.sequences[0], *(s[1:] for s in split.sequences[1:])])
        assert bytes(joined.tolist()) == stream[: len(joined)] and len(stream) - len(joined) < 32
    inputs, targets = task.collate([train[i] for i in range(8)])
    assert inputs["tokens"].shape == (8, 32) and not (inputs["tokens"] == PAD).any() and inputs["mask"].all()
    assert int(task.units(inputs, targets)) == 8 * 32
    assert torch.equal(targets[:, :-1], inputs["tokens"][:, 1:])


def _plain_val_loss(run_dir) -> float:
    """The per-token loss of last.pt over the validation paragraphs' stream cut into windows of 33 bytes that overlap
    by one (written here), one window at a time, summed here."""
    from examples.language_model import WHOLE, paragraphs

    texts = paragraphs(WHOLE, 24)
    stream = b"".join(text + b"\n\n" for text in texts[: round(len(texts) * 0.1)])
    windows = [stream[32 * k : 32 * k + 33] for k in range((len(stream) - 1) // 32)]
    task = _task(PACKED)
    model = task.model()
    model.load_state_dict(torch.load(run_dir / "last.pt", weights_only=True)["model"])
    model.eval()
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for sequence in (torch.tensor(list(window)) for window in windows):
            inputs = {"tokens": sequence[None, :-1], "mask": torch.ones(1, len(sequence) - 1, dtype=torch.bool)}
            nll += F.cross_entropy(model(inputs)[0][0].double(), sequence[1:], reduction="sum").item()
            tokens += len(sequence) - 1
    return nll / tokens


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_packed_language_model_trains_alike_on_1_and_2_ranks_over_every_token(tmp_path):
    """--pack on 1 process (2 micro-batches a step) and on 2: the same losses (the same sequences and tokens at any
    world size), and the reported validation loss is the plain per-token loss over the packed stream (every token
    weighs one unit). Broken on purpose: datasets() ignoring --pack (padded paragraphs) fails it."""
    runs = ["--runs-dir", str(tmp_path)]
    one = launch([*PACKED, *runs, "-n", "one", "--accum-steps", "2"], nproc=None)  # the same global batch of 16
    two = launch([*PACKED, *runs, "-n", "two"])
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    a, b = _rows(tmp_path / "one")[-1], _rows(tmp_path / "two")[-1]
    for name in ("train_loss", "val_loss", "val_ppl", "val_token_acc"):
        assert float(a[name]) == pytest.approx(float(b[name]), rel=1e-5), name
    assert float(b["val_loss"]) == pytest.approx(_plain_val_loss(tmp_path / "two"), rel=2e-6)
