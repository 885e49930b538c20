"""`shard_batch_dict_for_context_parallel`: every [B, S] key sharded alike, positions added."""

from __future__ import annotations

import torch
from titan.dist import shard_batch_dict_for_context_parallel


class FakeCPMesh:
    """Just what the sharding reads from a 1-D mesh: its size and this rank's place."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self._size = rank, size

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self.rank


def _batch():
    ids = torch.arange(16).reshape(2, 8)
    return {
        "input_ids": ids,
        "labels": ids + 100,
        "document_ids": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]] * 2),
        "loss_mask": torch.ones(2, 8, 3),  # [B, S, ...] is sharded too
        "scale": torch.tensor(2.0),  # not per token: passed through
    }


def test_each_rank_gets_head_and_tail_chunks_of_every_key():
    # cp=2: 4 chunks of 2 tokens; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    expected_index = {0: [0, 1, 6, 7], 1: [2, 3, 4, 5]}
    for rank, index in expected_index.items():
        out = shard_batch_dict_for_context_parallel(FakeCPMesh(rank, 2), _batch())
        assert out["input_ids"].tolist() == [index, [i + 8 for i in index]]
        assert out["labels"].tolist() == [[i + 100 for i in index], [i + 108 for i in index]]
        assert out["document_ids"][0].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2][i] for i in index]
        assert out["loss_mask"].shape == (2, 4, 3)
        assert out["scale"].item() == 2.0
        # No positions in the batch: the absolute positions of this rank's tokens.
        assert out["positions"].tolist() == index


def test_given_positions_are_sharded_not_replaced():
    batch = {**_batch(), "positions": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]] * 2)}
    out = shard_batch_dict_for_context_parallel(FakeCPMesh(1, 2), batch)
    assert out["positions"].tolist() == [[2, 0, 1, 2]] * 2  # tokens 2..5


def test_without_context_parallel_the_batch_is_unchanged():
    batch = _batch()
    for mesh in (None, FakeCPMesh(0, 1)):
        out = shard_batch_dict_for_context_parallel(mesh, batch)
        assert out is not batch and out.keys() == batch.keys()
        assert all(out[k] is batch[k] for k in batch)
