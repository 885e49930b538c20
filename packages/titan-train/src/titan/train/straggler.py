"""Straggler warnings: a step far slower than the running median, and the rank behind it.

In synchronous training one slow rank slows every rank (the others wait in the next
collective), so each rank's step time says *that* a step was slow, not *who*. What differs
between ranks is the work each does alone, outside collectives: loading its batch. Every rank
keeps its slowest step since the last log (its wall time and its own data-loading time); at
each log step, where the ranks already meet to reduce the loss, the records are gathered and
rank 0 warns when the slowest step exceeds ``factor`` times the running median (and the
median by at least ``MIN_EXCESS_S``), naming the rank whose own work explains it, or saying
that none does (a slow collective, device or link).

Step time is the host's wall time from asking for the batch to the end of the optimizer step;
steps that only enqueue work on an accelerator are averaged into the next step that syncs, so
on GPU the check sees the device's pace at the steps that sync.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

logger = logging.getLogger("titan")


@dataclass(frozen=True)
class SlowStep:
    """One rank's slowest step since the last check."""

    step: int
    seconds: float
    local_seconds: float
    """Of ``seconds``, the time this rank spent alone (loading its batch)."""


class StragglerWatch:
    """Tracks step times against their running median and names the rank behind a slow step.

    ``record`` after every step (local, no communication); ``check`` at the steps where every
    rank logs (one small all-gather over the default group).
    """

    MIN_EXCESS_S = 1.0
    """A step must also exceed the median by this many seconds: a 10 ms step that takes 60 ms
    is noise, not a straggler."""

    WARMUP_STEPS = 5
    """Steps recorded before any warning: the first steps compile, warm caches and allocate."""

    def __init__(self, factor: float, window: int = 50) -> None:
        self.factor = factor
        self._recent: deque[float] = deque(maxlen=window)
        self._slowest: SlowStep | None = None
        self._median_then = 0.0

    @property
    def enabled(self) -> bool:
        """Whether warnings are on (``--metrics.straggler_factor`` > 0)."""
        return self.factor > 0

    def record(self, step: int, seconds: float, local_seconds: float) -> None:
        """Account one step: its wall time and the part this rank spent alone."""
        if not self.enabled:
            return
        median = statistics.median(self._recent) if len(self._recent) >= self.WARMUP_STEPS else 0.0
        if median and (self._slowest is None or seconds > self._slowest.seconds):
            self._slowest, self._median_then = SlowStep(step, seconds, local_seconds), median
        self._recent.append(seconds)

    def check(self, rank: int, world_size: int, device: torch.device) -> str | None:
        """Gather every rank's slowest step since the last check; on rank 0, return (and log)
        the warning when one exceeds ``factor`` x the running median. Collective: every rank
        calls it at the same steps."""
        if not self.enabled:
            return None
        slow, median = self._slowest, self._median_then
        self._slowest = None
        mine = torch.tensor([slow.step, slow.seconds, slow.local_seconds, median] if slow else [0.0] * 4,
                            dtype=torch.float64, device=device)
        rows = [mine]
        if world_size > 1 and dist.is_initialized():
            rows = [torch.empty_like(mine) for _ in range(world_size)]
            dist.all_gather(rows, mine)
        if rank != 0:
            return None
        message = describe([row.tolist() for row in rows], self.factor)
        if message:
            logger.warning(message)
        return message


def describe(rows: list[list[float]], factor: float) -> str | None:
    """The warning for the gathered ``[step, seconds, local_seconds, median]`` of every rank
    (None when no rank's slowest step exceeds ``factor`` x its median)."""
    slow = [(rank, row) for rank, row in enumerate(rows)
            if row[3] > 0 and row[1] > factor * row[3] and row[1] - row[3] >= StragglerWatch.MIN_EXCESS_S]
    if not slow:
        return None
    _, (step, seconds, _, median) = max(slow, key=lambda item: item[1][1])
    culprit, culprit_row = max(enumerate(rows), key=lambda item: item[1][2])
    excess = seconds - median
    head = (f"straggler: step {int(step)} took {seconds:.2f} s, {seconds / median:.1f}x the running median "
            f"{median:.3f} s")
    if culprit_row[2] >= 0.5 * excess:
        return f"{head}; rank {culprit} spent {culprit_row[2]:.2f} s of it loading its batch alone"
    return (f"{head}; no rank's own work explains it (the most: rank {culprit}, {culprit_row[2]:.2f} s "
            "loading its batch): a collective, a device or the network was slow")


__all__ = ["SlowStep", "StragglerWatch", "describe"]
