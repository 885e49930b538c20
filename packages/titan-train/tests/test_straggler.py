"""The straggler watch: running median, the slowest step per check, the rank named."""

from __future__ import annotations

import pytest
import torch
from titan.train.metrics import MetricsConfig
from titan.train.straggler import StragglerWatch, describe


def test_a_step_far_beyond_the_median_is_reported_with_its_rank_and_median():
    watch = StragglerWatch(factor=5.0)
    for step in range(1, 11):
        watch.record(step, 0.1, 0.0)
    watch.record(11, 1.2, 1.0)  # 12x the median, 1.0 s of it loading alone
    watch.record(12, 0.1, 0.0)
    message = watch.check(rank=0, world_size=1, device=torch.device("cpu"))
    assert message == ("straggler: step 11 took 1.20 s, 12.0x the running median 0.100 s; "
                       "rank 0 spent 1.00 s of it loading its batch alone")
    assert watch.check(rank=0, world_size=1, device=torch.device("cpu")) is None  # reported once


def test_no_warning_during_warmup_or_below_the_factor_or_when_off():
    watch = StragglerWatch(factor=5.0)
    for step in range(1, StragglerWatch.WARMUP_STEPS + 1):
        watch.record(step, 10.0 if step == 1 else 0.1, 0.0)  # a compiling first step
    watch.record(6, 0.45, 0.0)  # 4.5x: below the factor
    assert watch.check(rank=0, world_size=1, device=torch.device("cpu")) is None
    off = StragglerWatch(factor=0)
    for step in range(1, 20):
        off.record(step, 0.1 if step < 19 else 100.0, 0.0)
    assert off.check(rank=0, world_size=1, device=torch.device("cpu")) is None


def test_the_rank_whose_own_work_explains_the_step_is_named():
    # [step, seconds, local_seconds, median] per rank: rank 2 loaded for 3 s, the others waited.
    rows = [[40, 3.1, 0.0, 0.1], [40, 3.1, 0.01, 0.1], [40, 3.1, 3.0, 0.1], [40, 3.1, 0.0, 0.1]]
    assert "rank 2 spent 3.00 s of it loading its batch alone" in describe(rows, 5.0)
    # Nobody's own work explains it: a slow collective or device.
    rows = [[40, 3.1, 0.0, 0.1], [40, 3.1, 0.2, 0.1]]
    assert "no rank's own work explains it (the most: rank 1, 0.20 s" in describe(rows, 5.0)
    assert describe([[3, 0.2, 0.0, 0.1], [0, 0.0, 0.0, 0.0]], 5.0) is None
    assert describe([[3, 0.9, 0.0, 0.01]], 5.0) is None  # 90x, but 0.89 s: noise of tiny steps


def test_the_factor_flag_is_checked():
    with pytest.raises(ValueError, match="--metrics.straggler_factor must be > 1"):
        MetricsConfig(straggler_factor=0.5)
    assert MetricsConfig(straggler_factor=0).straggler_factor == 0
