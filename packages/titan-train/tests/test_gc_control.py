"""The training loop's control of Python's garbage collector (``--training.gc_freq``)."""

from __future__ import annotations

import gc

import pytest
from titan.train.config import TrainingConfig
from titan.train.gc_control import GarbageCollection


@pytest.fixture
def collections(monkeypatch):
    """Every gc.collect call's generation, instead of collecting."""
    calls: list[int] = []
    monkeypatch.setattr(gc, "collect", lambda generation=2: calls.append(generation) or 0)
    return calls


def test_collects_every_freq_steps_with_the_automatic_collector_off_and_restores_it(collections):
    assert gc.isenabled()
    with GarbageCollection(3) as collector:
        assert not gc.isenabled()
        for step in range(1, 10):
            collector.after_step(step)
    assert gc.isenabled()
    assert collections == [1, 1, 1, 1]  # on entry, after steps 3, 6 and 9


def test_zero_leaves_python_in_charge_and_a_disabled_collector_stays_disabled(collections):
    with GarbageCollection(0) as collector:
        assert gc.isenabled()
        collector.after_step(50)
    assert collections == []
    gc.disable()
    try:
        with GarbageCollection(2):
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()


def test_debug_collects_fully_after_every_step(collections):
    with GarbageCollection(50, debug=True, rank=1) as collector:  # rank 1: no tensor-cycle hook
        collector.after_step(1)
        collector.after_step(2)
    assert collections == [1, 2, 2]


def test_negative_freq_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--training.gc_freq must be >= 0"):
        TrainingConfig(gc_freq=-1)
    with pytest.raises(ValueError, match="--training.gc_freq must be >= 0"):
        GarbageCollection(-1)
