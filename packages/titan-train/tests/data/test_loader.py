"""build_dataloader: exact resume (under any data-parallel degree), state shape, dp ranks, the
stdlib corpus."""

from __future__ import annotations

import io
import json

import pytest
import torch
from titan.train.data import ByteTokenizer, DatasetConfig, build_dataloader, stdlib_files

SMALL_SYNTHETIC = dict(synthetic_documents=30, synthetic_mean_length=20, synthetic_symbols=50)


def _build(cfg, *, rank=0, world=1, batch=4, seq_len=32, seed=0, tokenizer=None):
    return build_dataloader(
        cfg,
        tokenizer or ByteTokenizer(),
        dp_rank=rank,
        dp_world_size=world,
        local_batch_size=batch,
        seq_len=seq_len,
        seed=seed,
    )


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def _checkpoint_round_trip(state):
    """What a checkpoint does to the state: serialize, then load safely."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize(
    "cfg",
    [
        DatasetConfig(**SMALL_SYNTHETIC),
        DatasetConfig(**SMALL_SYNTHETIC, shuffle=False),
        DatasetConfig(name="stdlib"),
    ],
    ids=["synthetic", "synthetic-noshuffle", "stdlib"],
)
@pytest.mark.parametrize("n_before", [0, 1, 7, 40])  # 40 crosses several synthetic epochs
def test_resume_yields_exactly_the_next_batches(cfg, n_before):
    original = _build(cfg, rank=1, world=2, seed=3)
    _take(original, n_before)
    state = _checkpoint_round_trip(original.state_dict())
    expected = _take(original, 6)

    restored = _build(cfg, rank=1, world=2, seed=3)
    restored.load_state_dict(state)
    _assert_same(_take(restored, 6), expected)


def test_state_is_small_plain_and_global():
    loader = _build(DatasetConfig(**SMALL_SYNTHETIC), rank=2, world=3, batch=4, seq_len=32)
    _take(loader, 3)
    state = loader.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain ints/bools only
    assert sorted(state) == [
        "cursor",
        "epoch",
        "num_documents",
        "offset",
        "seed",
        "seq_len",
        "shuffle",
        "version",
        "windows",
    ]
    assert state["version"] == 3 and state["seq_len"] == 32
    assert state["windows"] == 3 * 3 * 4  # three global microbatches of 3 ranks x 4 rows


def test_iter_and_next_share_one_position():
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    a, b = _build(cfg), _build(cfg)
    it = iter(a)
    mixed = [next(it), next(a), next(iter(a))]
    _assert_same(mixed, _take(b, 3))


def test_for_loop_continues_after_break():
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    a, b = _build(cfg), _build(cfg)
    got = []
    for _ in range(2):
        for batch in a:
            got.append(batch)
            break
    _assert_same(got, _take(b, 2))


def test_seed_changes_order_and_saved_seed_wins():
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    a, b = _build(cfg, seed=0), _build(cfg, seed=1)
    assert not torch.equal(next(a)["input_ids"], next(b)["input_ids"])
    # Resuming under a different seed keeps the checkpointed order.
    state = a.state_dict()
    expected = _take(a, 3)
    c = _build(cfg, seed=99)
    c.load_state_dict(state)
    _assert_same(_take(c, 3), expected)


def test_load_state_rejects_other_windows_corpus_or_shuffling():
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    state = _build(cfg, rank=0, world=2).state_dict()
    with pytest.raises(
        ValueError, match=r"seq_len=32, this run has seq_len=16.*--training.seq_len"
    ):
        _build(cfg, seq_len=16).load_state_dict(state)
    other = DatasetConfig(**{**SMALL_SYNTHETIC, "synthetic_documents": 31})
    with pytest.raises(
        ValueError, match=r"num_documents=30, this run has num_documents=31.*--dataset"
    ):
        _build(other).load_state_dict(state)
    unshuffled = DatasetConfig(**SMALL_SYNTHETIC, shuffle=False)
    with pytest.raises(ValueError, match=r"shuffle=True.*--dataset.no_shuffle"):
        _build(unshuffled).load_state_dict(state)


def test_old_per_rank_state_is_refused_clearly():
    """Version 2 kept one entry per dp rank; it is refused, whatever the degree, with the fix."""
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    v2 = {
        "dp_rank_0": {
            "epoch": 0,
            "cursor": 3,
            "offset": 5,
            "seed": 0,
            "version": 2,
            "dp_world_size": 1,
            "num_documents": 30,
            "shuffle": True,
            "batches_yielded": 2,
        }
    }
    for state in (v2, {**v2["dp_rank_0"], "seq_len": 32, "windows": 8}):
        with pytest.raises(
            ValueError, match=r"version 2 is not 3.*--checkpoint.exclude_from_loading dataloader"
        ):
            _build(cfg).load_state_dict(state)


def _stream(cfg, n_windows, *, seq_len=16, seed=3):
    """The first `n_windows` windows of the global stream, as one process reads them."""
    return torch.cat(
        [b["input_ids"] for b in _take(_build(cfg, batch=1, seq_len=seq_len, seed=seed), n_windows)]
    )


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ((2, 2, 1), (1, 4, 1)),  # FSDP 2 -> one process
        ((1, 4, 1), (4, 1, 1)),  # one process -> FSDP 4
        ((2, 1, 2), (4, 1, 1)),  # 2 ranks accumulating 2 microbatches -> 4 ranks, none
        ((4, 1, 1), (1, 2, 2)),  # 4 ranks -> one process accumulating 2
        ((2, 2, 1), (3, 2, 1)),  # another global batch (4 -> 6 windows): positions are in windows
    ],
    ids=["2to1", "1to4", "2x2accum-to-4", "4-to-1x2accum", "batch4-to-batch6"],
)
@pytest.mark.parametrize("steps_before", [1, 13])  # 13 steps cross several epochs
def test_resume_under_another_data_parallel_degree(before, after, steps_before):
    """The property a resharded resume relies on. A run of (dp ranks, local batch, accumulation
    steps) = `before` trains `steps_before` steps and saves; every rank's state is the same.
    A run of layout `after` loads it on each of its ranks. Then, fetch by fetch, the rows of its
    ranks stacked in rank order are the next windows of the global stream: exactly what one
    process reading the stream from the start, uninterrupted, gets after the windows already
    consumed, so the union of the ranks' rows of every following global batch is what an
    uninterrupted run of either layout would train on next."""
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    (world0, batch0, accum0), (world1, batch1, accum1) = before, after
    old = [
        _build(cfg, rank=r, world=world0, batch=batch0, seq_len=16, seed=3) for r in range(world0)
    ]
    for _ in range(steps_before * accum0):  # every rank fetches every microbatch of a step
        for loader in old:
            next(loader)
    states = [_checkpoint_round_trip(loader.state_dict()) for loader in old]
    assert all(state == states[0] for state in states)  # one global record
    consumed = steps_before * accum0 * world0 * batch0
    assert states[0]["windows"] == consumed

    new = [
        _build(cfg, rank=r, world=world1, batch=batch1, seq_len=16, seed=0) for r in range(world1)
    ]
    for loader in new:
        loader.load_state_dict(states[0])  # the saved seed wins over this run's
    steps_after = 3
    global_batch = accum1 * world1 * batch1
    stream = _stream(cfg, consumed + steps_after * global_batch)
    for step in range(steps_after):
        rows = []
        for _ in range(accum1):
            rows += [next(loader)["input_ids"] for loader in new]  # micro 0 of all ranks, then 1
        start = consumed + step * global_batch
        assert torch.equal(torch.cat(rows), stream[start : start + global_batch])
    assert all(loader.state_dict() == new[0].state_dict() for loader in new)


def test_empty_state_is_a_fresh_start():
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    a, b = _build(cfg), _build(cfg)
    b.load_state_dict({})
    _assert_same(_take(a, 2), _take(b, 2))


def test_ranks_never_share_a_sample():
    cfg = DatasetConfig(synthetic_documents=200, synthetic_mean_length=30)
    windows = []
    for rank in range(4):
        for batch in _take(_build(cfg, rank=rank, world=4, batch=2, seq_len=16), 10):
            windows.append({tuple(row) for row in batch["input_ids"].tolist()})
    per_rank = [set().union(*windows[r * 10 : (r + 1) * 10]) for r in range(4)]
    for r in range(4):
        for s in range(r + 1, 4):
            assert not per_rank[r] & per_rank[s]


@pytest.mark.parametrize("world", [2, 4])
def test_global_batch_is_independent_of_the_data_parallel_degree(world):
    """dp ranks split each global batch by rows: the same samples, in the same order, as one
    process reading the whole global batch, or accumulating world microbatches of it."""
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    ranks = [_build(cfg, rank=r, world=world, batch=2) for r in range(world)]
    whole = _build(cfg, batch=2 * world)
    accumulating = _build(cfg, batch=2)
    for _ in range(5):
        split = [next(loader) for loader in ranks]
        full = next(whole)
        micro = _take(accumulating, world)
        for key in ("input_ids", "labels"):
            joined = torch.cat([b[key] for b in split])
            assert torch.equal(joined, full[key])
            assert torch.equal(joined, torch.cat([b[key] for b in micro]))


def test_bad_loader_arguments():
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    with pytest.raises(ValueError, match="dp_rank 2"):
        _build(cfg, rank=2, world=2)
    with pytest.raises(ValueError, match="batch size"):
        _build(cfg, batch=0)
    with pytest.raises(ValueError, match="seq_len"):
        _build(cfg, seq_len=0)


def test_stdlib_first_batch_reads_only_what_it_needs_and_is_real_python(monkeypatch):
    """The first batch is fast by construction, not by a wall-clock budget that a loaded
    machine can miss: it tokenizes only the documents that fill it, never the whole standard
    library (~650 files) up front."""
    from titan.train.data.sources import StdlibSource

    read_tokens: list[int] = []
    original_text = StdlibSource.text

    def counting_text(self, index):
        text = original_text(self, index)
        read_tokens.append(len(ByteTokenizer().encode(text)))
        return text

    monkeypatch.setattr(StdlibSource, "text", counting_text)
    loader = _build(DatasetConfig(name="stdlib"), batch=8, seq_len=256)
    batch = next(loader)
    assert batch["input_ids"].shape == (8, 256)
    # Every document but the last one read was needed: together they hold fewer tokens than
    # the batch's 8 rows of 256 (+1 for the shifted labels).
    assert 1 <= len(read_tokens) and sum(read_tokens[:-1]) < 8 * 257, read_tokens
    text = ByteTokenizer().decode(batch["input_ids"].flatten().tolist())
    assert "import" in text or "def " in text


def test_stdlib_files_sorted_and_without_tests():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any("site-packages" in f or "/test/" in f for f in files)


class _Stateful:
    """A state holding a fixed dict (what an older titan-train saved)."""

    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def _manager(folder, loader):
    """A CheckpointManager configured as the trainer configures it (the loader not rank-local)."""
    from titan.ckpt import CheckpointConfig, CheckpointManager

    return CheckpointManager(
        CheckpointConfig(enable=True, interval=1),
        dump_folder=str(folder),
        states={"dataloader": loader},
        model_parts=[torch.nn.Linear(2, 2)],
        rank_local=("rng",),
    )


def test_checkpoint_round_trip_through_dcp_and_old_format_refused(tmp_path):
    """Through titan.ckpt as the trainer uses it: a global position saved by rank 1 of 2 loads
    into one process (which continues with the next windows); a version 2 per-rank checkpoint
    is refused before training with the flag that restarts the stream."""
    from titan.ckpt import CheckpointError

    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    saver = _build(cfg, rank=1, world=2, batch=2, seq_len=16)
    _take(saver, 5)
    _manager(tmp_path / "new", saver).maybe_save(1)
    resumed = _build(cfg, batch=4, seq_len=16)
    _manager(tmp_path / "new", resumed).load()
    assert resumed.state_dict() == saver.state_dict()
    assert torch.equal(next(resumed)["input_ids"], _stream(cfg, 24, seed=0)[20:24])

    old = {
        f"dp_rank_{r}": {
            "epoch": 0,
            "cursor": 1,
            "offset": 0,
            "seed": 0,
            "version": 2,
            "dp_world_size": 1,
            "num_documents": 30,
            "shuffle": True,
            "batches_yielded": 1,
        }
        for r in range(1)
    }
    _manager(tmp_path / "old", _Stateful(old)).maybe_save(1)
    with pytest.raises(CheckpointError) as err:
        _manager(tmp_path / "old", _build(cfg)).load()
    assert "dp_rank_0" in str(err.value) and "--checkpoint.exclude_from_loading dataloader" in str(
        err.value
    )


def test_every_training_loader_saves_and_checks_through_one_base(tmp_path):
    """Pretraining on the fly, pre-tokenized and SFT loaders extend `ResumableLoader`: the same
    state format (a version, the position, what it is measured against) and the same checks —
    a future version is refused with the restart flag, a missing field is named."""
    from titan.train.data import (
        SFTDataConfig,
        TokenizerConfig,
        build_sft_dataloader,
        tokenize_corpus,
    )
    from titan.train.data.resumable import ResumableLoader

    tok = ByteTokenizer()
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i} " * (i % 4 + 1)}) + "\n" for i in range(20)))
    corpus = tmp_path / "corpus"
    tokenize_corpus(str(source), corpus, TokenizerConfig(), progress=False)
    loaders = [
        _build(DatasetConfig(**SMALL_SYNTHETIC)),
        _build(DatasetConfig(name="tokenized", path=str(corpus))),
        build_sft_dataloader(SFTDataConfig(), tok, dp_rank=0, dp_world_size=1, local_batch_size=2, seq_len=64, seed=0),
    ]
    for loader in loaders:
        assert isinstance(loader, ResumableLoader)
        next(loader)
        state = _checkpoint_round_trip(loader.state_dict())
        assert state["version"] == type(loader).STATE_VERSION
        assert set(loader.measured_against()) <= set(state)
        with pytest.raises(ValueError, match="--checkpoint.exclude_from_loading dataloader"):
            loader.load_state_dict({**state, "version": type(loader).STATE_VERSION + 1})
        field = next(iter(loader.measured_against()))
        with pytest.raises(ValueError, match=f"the checkpoint has {field}=None"):
            loader.load_state_dict({k: v for k, v in state.items() if k != field})
        loader.load_state_dict(state)  # its own state loads
