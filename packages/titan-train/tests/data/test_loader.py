"""build_dataloader: exact resume, state shape, dp ranks, the stdlib corpus."""

from __future__ import annotations

import io
import json
import time

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


def test_state_is_small_plain_and_per_rank():
    loader = _build(DatasetConfig(**SMALL_SYNTHETIC), rank=2, world=3)
    _take(loader, 3)
    state = loader.state_dict()
    assert list(state) == ["dp_rank_2"]
    assert json.loads(json.dumps(state)) == state  # plain ints/bools only
    assert state["dp_rank_2"]["batches_yielded"] == 3


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


def test_load_state_rejects_other_sharding_or_corpus():
    cfg = DatasetConfig(**SMALL_SYNTHETIC)
    state = _build(cfg, rank=0, world=2).state_dict()
    with pytest.raises(ValueError, match="no entry for data parallel rank 1"):
        _build(cfg, rank=1, world=2).load_state_dict(state)
    with pytest.raises(ValueError, match="dp_world_size=2"):
        _build(cfg, rank=0, world=4).load_state_dict(state)
    other = DatasetConfig(**{**SMALL_SYNTHETIC, "synthetic_documents": 31})
    with pytest.raises(ValueError, match="num_documents=30"):
        _build(other, rank=0, world=2).load_state_dict(state)


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


def test_stdlib_first_batch_is_fast_and_real_python():
    start = time.perf_counter()
    loader = _build(DatasetConfig(name="stdlib"), batch=8, seq_len=256)
    batch = next(loader)
    elapsed = time.perf_counter() - start
    assert batch["input_ids"].shape == (8, 256)
    assert elapsed < 1.0, f"first stdlib batch took {elapsed:.2f}s"
    text = ByteTokenizer().decode(batch["input_ids"].flatten().tolist())
    assert "import" in text or "def " in text


def test_stdlib_files_sorted_and_without_tests():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any("site-packages" in f or "/test/" in f for f in files)
