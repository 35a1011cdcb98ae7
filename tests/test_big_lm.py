"""What a billion-parameter language model needs, on the language-model example kept tiny (issue #51): packed
sequences (--pack) and activation checkpointing (--activation-checkpointing)."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F
from multiproc import launch
from test_cuda import cuda_test

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


# ---------------------------------------------------------------- --activation-checkpointing


def _lm(depth=2):
    from examples.language_model import CausalTransformer

    torch.manual_seed(0)
    return CausalTransformer(16, depth, 2, 32, tie=True)


def _lm_batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (4, 32), generator=g)
    return {"tokens": tokens, "mask": torch.ones(4, 32, dtype=torch.bool)}, torch.randint(0, 256, (4, 32), generator=g)


def _grads_and_saved(model, compile_backend=None):
    """(the gradients of one loss, by name; the bytes autograd held for the backward; calls of the first block's
    first linear layer), counted with saved_tensors_hooks."""
    inputs, targets = _lm_batch()
    saved, calls = [0], [0]
    model.blocks.layers[0].linear1.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    run = torch.compile(model, backend=compile_backend) if compile_backend else model
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits, _ = run(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, saved[0], calls[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["full", "ops", "2"])
def test_activation_checkpointing_keeps_names_and_gradients_and_holds_fewer_bytes(mode):
    """Checkpointed blocks: the same parameter and state-dict names, the same gradients (≤ 1e-6), fewer bytes held
    for the backward; the first block's forward runs again in the backward; a deep copy
    (an EMA) runs its own weights. Broken on purpose: apply() checkpointing nothing fails it (bytes and calls)."""
    import copy

    from ddp_tricks import activations

    plain, checkpointed = _lm(), _lm()
    units = [*checkpointed.blocks.layers, [checkpointed.embed, checkpointed.head]]
    names = [n for n, _ in checkpointed.named_parameters()], list(checkpointed.state_dict())
    chosen = activations.apply(checkpointed, units, mode)
    assert ([n for n, _ in checkpointed.named_parameters()], list(checkpointed.state_dict())) == names
    assert len(chosen) == {"full": 4, "ops": 4, "2": 2}[mode]
    how = {"full": "each recomputed whole", "ops": "except their matrix products", "2": "every 2nd block, recomputed"}
    assert how[mode] in activations.describe(checkpointed, units, mode)
    expected, plain_bytes, plain_calls = _grads_and_saved(plain)
    grads, saved, calls = _grads_and_saved(checkpointed)
    assert plain_calls == 1 and calls == 2  # "ops" runs the forward again too, reading the products it kept
    assert saved < plain_bytes, (saved, plain_bytes)
    for name, grad in expected.items():
        assert torch.allclose(grads[name], grad, atol=1e-6, rtol=0), name
    twin = copy.deepcopy(checkpointed)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
        assert not torch.equal(twin(_lm_batch()[0])[0], checkpointed(_lm_batch()[0])[0])


def _stateful_blocks():
    """Blocks whose training forward updates state of their own (InstanceNorm's running statistics, spectral norm's
    power iteration, as a parametrization and as the older hook), and two whose parametrizations update nothing."""
    from torch import nn
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(  # recomputed past the norm (Tanh saves its output): its statistics would update again
            nn.Linear(6, 6),
            nn.Unflatten(1, (2, 3)),
            nn.InstanceNorm1d(2, track_running_stats=True),
            nn.Flatten(),
            nn.Tanh(),
        ),  # fmt: skip
        parametrizations.spectral_norm(nn.Linear(6, 6)),
        nn.utils.spectral_norm(nn.Linear(6, 6)),
        parametrizations.weight_norm(nn.Linear(6, 6)),
        parametrizations.orthogonal(nn.Linear(6, 6)),  # a buffer of its own ('base'), never updated
    )


@pytest.mark.timeout(120)
def test_blocks_whose_forward_updates_their_state_are_not_checkpointed():
    """A recomputed forward would update a block's own state twice: after two training steps, the checkpointed
    model's buffers (running statistics, spectral norm's vectors) and gradients equal the plain model's; the start
    line names the blocks left alone; weight_norm and orthogonal (a constant buffer) are checkpointed. Broken on
    purpose: _keeps_statistics seeing BatchNorm alone (as before a review) fails it (InstanceNorm's running mean);
    without the parametrizations' check, spectral norm's u."""
    from ddp_tricks import activations

    plain, checkpointed = _stateful_blocks(), _stateful_blocks()
    units = list(checkpointed)
    chosen = activations.apply(checkpointed, units, "full")
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2))
    for model in (plain, checkpointed):
        for _ in range(2):
            model.zero_grad()
            model(x).square().sum().backward()
    for (name, a), (_, b) in zip(plain.named_buffers(), checkpointed.named_buffers()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-7, rtol=0), name
    assert chosen == [checkpointed[3], checkpointed[4]]
    line = activations.describe(checkpointed, units, "full")
    why = "a recomputed forward would update their running statistics or spectral norm's vectors twice"
    assert line.endswith(f"; not '0', '1', '2' ({why})"), line


@pytest.mark.timeout(300)
def test_activation_checkpointing_composes_with_compile():
    """torch.compile (aot_eager: autograd traced, no C++ compiler needed) of a checkpointed model gives the eager
    gradients. Broken on purpose: a block forward that returns its output times 2 under compile fails it."""
    from ddp_tricks import activations

    plain, checkpointed = _lm(), _lm()
    activations.apply(checkpointed, list(checkpointed.blocks.layers), "ops")
    expected, _, _ = _grads_and_saved(plain)
    grads, _, _ = _grads_and_saved(checkpointed, compile_backend="aot_eager")
    for name, grad in expected.items():
        assert torch.allclose(grads[name], grad, atol=1e-6, rtol=0), name


CACHED = """
from examples.language_model import PythonSourceLM


class CachedLM(PythonSourceLM):
    cached_accumulation = True  # one loss over the step's micro-batches, their forwards run twice
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_language_model_trains_alike_with_and_without_activation_checkpointing_on_2_ranks(tmp_path):
    """2 ranks, one epoch: --strategy fsdp with --activation-checkpointing full gives the losses of the run without
    (≤ 1e-5 relative), and so does DDP with op-level checkpointing and cached accumulation of 2 micro-batches of 4
    (the same tokens a step); their start lines say what is checkpointed. Broken on purpose: the checkpointed
    forward adding 1e-3 x the feature index to the block's output fails it (a constant shift vanishes in LayerNorm)."""
    (tmp_path / "cached.py").write_text(CACHED)
    runs, lm = ["--runs-dir", str(tmp_path)], [*PACKED, "--depth", "2"]
    plain = launch([*lm, *runs, "-n", "plain", "--strategy", "fsdp"])
    full = launch([*lm, *runs, "-n", "full", "--strategy", "fsdp", "--activation-checkpointing", "full"])
    cached = [*lm, "--task", f"{tmp_path / 'cached.py'}:CachedLM", "-b", "4", "--accum-steps", "2"]
    ops = launch([*cached, *runs, "-n", "ops", "--activation-checkpointing", "ops"])
    for done in (plain, full, ops):
        assert done.returncode == 0, done.stderr[-3000:]
    assert "activation checkpointing (full): 2 block(s), 'blocks.layers.0', 'blocks.layers.1': each" in full.stdout
    assert "activation checkpointing (ops): 2 block(s)" in ops.stdout
    expected = _rows(tmp_path / "plain")[-1]
    for run_dir in ("full", "ops"):
        row = _rows(tmp_path / run_dir)[-1]
        for name in ("train_loss", "val_loss", "val_ppl"):
            assert float(row[name]) == pytest.approx(float(expected[name]), rel=1e-5), (run_dir, name)


@cuda_test
@pytest.mark.timeout(600)
def test_on_a_gpu_activation_checkpointing_under_fsdp_gives_the_losses_of_the_run_without(tmp_path):
    """One GPU, nccl, --strategy fsdp, --amp bf16, deterministic kernels: --activation-checkpointing full and ops
    give the run without's losses (≤ 1e-5 relative: the recomputed forward is the same kernels on the same
    inputs)."""
    common = [*PACKED, "--depth", "2", "--strategy", "fsdp", "--backend", "nccl", "--device", "cuda", "--amp",
              "bf16", "--deterministic", "--runs-dir", str(tmp_path)]  # fmt: skip
    runs = {mode: launch([*common, "-n", mode, *(["--activation-checkpointing", mode] if mode != "plain" else [])],
                         nproc=1, timeout=300) for mode in ("plain", "full", "ops")}  # fmt: skip
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-3000:]
    expected = _rows(tmp_path / "plain")[-1]
    for mode in ("full", "ops"):
        row = _rows(tmp_path / mode)[-1]
        for name in ("train_loss", "val_loss"):
            assert float(row[name]) == pytest.approx(float(expected[name]), rel=1e-5), (mode, name)
