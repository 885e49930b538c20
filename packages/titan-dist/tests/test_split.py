"""A launch split into two parts with their own default groups and a bridge (gloo ranks with
torchrun's worker environment, forked from the suite's preloaded server)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("split_worker.py")


def run_split(ranks: int, first: int, out: Path, *extra: str) -> list[dict]:
    from launching import launch  # the repository's tests/ (root conftest.py)

    launch(ranks, [str(WORKER), str(first), str(out), *extra], out / "launch.log", timeout=300, torchrun=False)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(ranks)]


@pytest.mark.slow
def test_a_split_job_has_two_default_groups_and_a_bridge(tmp_path):
    trainer0, trainer1, generator0, generator1 = run_split(4, 2, tmp_path)
    for seen, part, rank in ((trainer0, 0, 0), (trainer1, 0, 1), (generator0, 1, 0), (generator1, 1, 1)):
        assert (seen["part"], seen["rank"], seen["size"], seen["sizes"]) == (part, rank, 2, (2, 2))
        assert seen["env"] == (rank, 2) and seen["group_size"] == 2 and seen["same_split"]
    # Each part's default group sums over its own ranks only (global ranks 0+1 and 2+3).
    assert trainer0["part_sum"] == trainer1["part_sum"] == 1.0
    assert generator0["part_sum"] == generator1["part_sum"] == 5.0
    assert trainer1["bridge"] is None  # only the first trainer rank is on the bridge
    assert [s["bridge"] for s in (trainer0, generator0, generator1)] == [(0, 3), (1, 3), (2, 3)]
    for seen in (trainer0, generator0, generator1):
        assert seen["command"] == {"op": "go", "from": 0}
        assert seen["reply"] == ["reply", 3]
        assert seen["tensor"] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert seen["all_true"] is True and seen["one_false"] is False
    assert trainer0["received"] == [{"bridge_rank": 1, "payload": [0]}, {"bridge_rank": 2, "payload": [0, 1]}]


@pytest.mark.slow
def test_a_part_of_one_rank_starts_no_default_group(tmp_path):
    trainer, generator = run_split(2, 1, tmp_path)
    for seen, part in ((trainer, 0), (generator, 1)):
        assert (seen["part"], seen["rank"], seen["size"], seen["env"], seen["group_size"]) == (part, 0, 1, (0, 1), 1)
        assert "part_sum" not in seen
    assert trainer["received"] == [{"bridge_rank": 1, "payload": [0]}]


@pytest.mark.slow
def test_a_part_started_without_a_group_has_none(tmp_path):
    """The generator side of disaggregated RL starts no group: its ranks may start their own
    (an in-process vLLM engine does); the bridge still reaches each of them."""
    trainer, generator0, generator1 = run_split(3, 1, tmp_path, "nogroup1")
    assert trainer["env"] == (0, 1) and not trainer["has_group"]
    for rank, seen in enumerate((generator0, generator1)):
        assert (seen["part"], seen["rank"], seen["has_group"], seen["group_size"]) == (1, rank, False, 1)
        assert "without a process group" in seen["env"]  # no multi-rank engine there
        assert seen["command"] == {"op": "go", "from": 0}
    assert trainer["received"] == [{"bridge_rank": 1, "payload": [0]}, {"bridge_rank": 2, "payload": [0, 1]}]


def test_split_job_refuses_an_empty_part(monkeypatch):
    from titan.dist import split_job

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for first in (0, 2):
        with pytest.raises(ValueError, match="both parts need at least one rank"):
            split_job(first)


def test_closing_a_bridge_releases_its_group_at_once():
    """A gloo group alive while the interpreter shuts down aborted its process in about one
    two-rank launch of four: `Bridge.close` (registered at exit by `split_job`) drops the
    bridge's only reference, so the group is destroyed then; closing twice is harmless."""
    import gc
    import weakref

    from titan.dist import Bridge

    class Group:  # stands in for the process group (a C++ object torch owns through this reference)
        pass

    group = Group()
    released = weakref.ref(group)
    bridge = Bridge(group, rank=0, size=2, device=torch.device("cpu"))
    del group
    gc.collect()
    assert released() is not None
    bridge.close()
    assert released() is None and bridge.group is None
    bridge.close()
