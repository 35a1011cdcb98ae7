"""A small causal transformer language model on text that ships with Python itself: the standard library's own
source files, read as bytes (a vocabulary of 256 bytes and a padding token). Each sample is one paragraph of code
(the text between blank lines, at most --max-length bytes), so sequences have different lengths and a batch is
padded to its longest. What it exercises that the image task does not:

- batches as dicts: inputs {"tokens": (B, L) ids, "mask": (B, L) True on real tokens}, targets (B, L) with the
  padding marked -100; the task's own `collate()` pads each batch;
- a model that returns a tuple (the logits and the final hidden states);
- a per-TOKEN loss: cross-entropy averaged over the real tokens of a batch, and `units()` saying how many those
  are, so accumulation, uneven batches and the evaluation weight every token alike at any world size;
- perplexity (monitored, lower is better) and token accuracy, both computed exactly from sums;
- `--tie-weights`: the output projection shares its weight with the input embedding (GPT-2, BERT, T5 do), one
  Parameter under two names, also under --strategy fsdp (the two modules sharded as one unit) and after resume;
- `--pack`: pre-training's packed sequences instead: the paragraphs (whole, each followed by the blank line that
  ended it) concatenated into one stream per split and cut into sequences of exactly --max-length predicted bytes,
  so no batch holds a padding token and every byte of the stream but its first is a target exactly once (the last,
  incomplete sequence dropped); the same sequences at any world size. Attention runs across the documents of a
  sequence (GPT-2's packing): the blank line between them is the only boundary the model sees;
- `--positions N`: the position table's size (default: --max-length), so a first phase can train short sequences
  with the table a second, longer phase needs: every tensor then matches, and `--init-from` the first phase's run
  re-initialises nothing (BERT's two phases, recipes/lm-lamb-phase{1,2}.toml and docs/tasks.md).

    torchrun --standalone --nproc_per_node=2 run.py --task examples/language_model.py:PythonSourceLM \\
        --optimizer lamb -l 0.01 --wd 0.01 -b 16 -e 10 --warmup-epochs 1 --scheduler cosine

Written against the task seam only (see task.py): nothing else in the template knows about text.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ddp_tricks import UserError

PAD = 256  # the padding token's id: the 256 byte values come first
IGNORE = -100  # a target cross-entropy skips (F.cross_entropy's ignore_index)
SPLIT_SEED, VAL_FRACTION = 0, 0.1
WHOLE = 1 << 30  # --pack: paragraphs are not cut


def paragraphs(max_length: int, limit: int) -> list[bytes]:
    """Up to `limit` paragraphs (8 bytes or more, cut at `max_length`) of the standard library's top-level
    modules, in a fixed order: the same on every run, rank and world size of one Python version."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(stdlib.glob("*.py")):
        for block in path.read_bytes().split(b"\n\n"):
            block = block.strip(b"\n")
            if len(block) >= 8:
                found.append(block[:max_length])
    order = torch.randperm(len(found), generator=torch.Generator().manual_seed(SPLIT_SEED))
    return [found[i] for i in order[:limit].tolist()]


def packed(texts: list[bytes], length: int) -> list[bytes]:
    """`texts` (each followed by a blank line) as one stream, cut into windows of `length` + 1 bytes that overlap by
    one (a window's last byte is the next one's first input): every byte but the stream's first is a target exactly
    once. The last, incomplete window is dropped."""
    stream = b"".join(text + b"\n\n" for text in texts)
    return [stream[start : start + length + 1] for start in range(0, len(stream) - length, length)]


class Sequences(Dataset):
    """Byte sequences of different lengths; a sample is one 1-D tensor of token ids."""

    def __init__(self, texts: list[bytes]):
        self.sequences = [torch.tensor(list(text), dtype=torch.long) for text in texts]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.sequences[index]


class CausalTransformer(nn.Module):
    """Token and position embeddings, pre-norm transformer blocks under a causal mask that also hides the
    padding, a final norm and a linear head. Returns (logits, hidden states)."""

    def __init__(
        self, width: int, depth: int, heads: int, max_length: int, vocabulary: int = PAD + 1, tie: bool = False
    ):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Embedding(max_length, width)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocabulary, bias=False)
        if tie:  # one Parameter, read as the embedding's rows and as the projection's
            self.head.weight = self.embed.weight

    def forward(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, mask = batch["tokens"], batch["mask"]
        length = tokens.shape[1]
        x = self.embed(tokens) + self.position(torch.arange(length, device=tokens.device))
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).triu(1)
        hidden = self.norm(self.blocks(x, mask=causal, src_key_padding_mask=~mask, is_causal=True))
        return self.head(hidden), hidden


class PythonSourceLM:
    """Next-byte prediction on Python's own source code."""

    better = {"ppl": "min", "token_acc": "max"}
    monitor = "ppl"
    shown_as = {"ppl": ("perplexity", ""), "token_acc": ("token accuracy", "%")}

    @staticmethod
    def add_arguments(parser) -> None:
        g = parser.add_argument_group("task: language model on Python's source (examples/language_model.py)")
        g.add_argument("--max-sequences", type=int, default=6000, help="paragraphs in all, train and validation")
        g.add_argument("--max-length", type=int, default=128, help="bytes per paragraph at most")
        g.add_argument(
            "--positions",
            type=int,
            default=None,
            help="the model's position table size, at least --max-length (default: --max-length): a short first "
            "phase with the table of a longer second one",
        )
        g.add_argument("--width", type=int, default=64, help="the transformer's width")
        g.add_argument("--depth", type=int, default=2, help="transformer blocks")
        g.add_argument("--heads", type=int, default=4, help="attention heads per block")
        g.add_argument("--tie-weights", action="store_true", help="the output projection is the input embedding")
        g.add_argument(
            "--pack", action="store_true", help="whole paragraphs packed into sequences of --max-length (no padding)"
        )

    def __init__(self, args):
        for flag in ("max_sequences", "max_length", "width", "depth", "heads"):
            if getattr(args, flag) < 1:
                raise UserError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
        if args.max_sequences < 20:
            raise UserError(f"--max-sequences {args.max_sequences} leaves no validation set: give 20 or more")
        if args.positions is not None and args.positions < args.max_length:
            raise UserError(
                f"--positions {args.positions} is shorter than --max-length {args.max_length}: give at least "
                f"{args.max_length}, or leave it out"
            )
        if args.width % args.heads:
            raise UserError(f"--width {args.width} must be a multiple of --heads {args.heads}")
        self.args = args

    def datasets(self):
        a = self.args
        whole = a.pack  # packed: documents whole, cut into sequences after they are joined
        texts = paragraphs(WHOLE if whole else a.max_length + 1, a.max_sequences)  # +1: inputs and targets overlap
        n_val = max(1, round(len(texts) * VAL_FRACTION))
        self.vocabulary = PAD + 1
        train, val = texts[n_val:], texts[:n_val]
        if a.pack:
            train, val = packed(train, a.max_length), packed(val, a.max_length)
            if not val:
                raise UserError(
                    f"--pack: the {n_val} validation paragraphs fill no sequence of --max-length {a.max_length}: "
                    "give more --max-sequences or a smaller --max-length"
                )
        return Sequences(train), Sequences(val)

    def collate(self, samples: list[torch.Tensor]):
        """A batch: each sequence predicts its own next bytes; right-padded to the batch's longest."""
        length = max(len(s) for s in samples) - 1
        tokens = torch.full((len(samples), length), PAD, dtype=torch.long)
        targets = torch.full((len(samples), length), IGNORE, dtype=torch.long)
        for row, sequence in enumerate(samples):
            tokens[row, : len(sequence) - 1] = sequence[:-1]
            targets[row, : len(sequence) - 1] = sequence[1:]
        return {"tokens": tokens, "mask": targets != IGNORE}, targets

    def model(self):
        a = self.args
        positions = a.max_length if a.positions is None else a.positions
        return CausalTransformer(a.width, a.depth, a.heads, positions, tie=a.tie_weights)

    def shard_units(self, model):
        """With --strategy fsdp: each transformer block is sharded on its own, tied embedding and projection
        together as one unit (a list: they share their weight), then the rest."""
        tied = [[model.embed, model.head]] if model.head.weight is model.embed.weight else []
        return [*model.blocks.layers, *tied]

    def loss(self, outputs, targets):
        logits, _ = outputs
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)  # mean over tokens

    def units(self, inputs, targets):
        return (targets != IGNORE).sum()  # the loss is a mean over these: the real tokens

    def metric_sums(self, outputs, targets):
        logits, _ = outputs
        real = targets != IGNORE
        nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return {"nll": nll, "correct": ((logits.argmax(-1) == targets) & real).sum()}

    def metrics(self, sums, count):
        """count: the real tokens of the whole set (the units)."""
        mean_nll = sums["nll"] / count
        return {"ppl": math.exp(mean_nll) if mean_nll < 700 else math.inf, "token_acc": sums["correct"] / count}
