"""When each rollout is generated, and with which weights: the staleness bound.

``--rl.max_policy_staleness 0`` is on-policy: the generator gets the current weights before
every rollout, generated while training waits. With ``k >= 1`` rollout ``i + 1`` is generated
in the background (a thread of rank 0, or the generator ranks of a disaggregated run) while
rollout ``i`` trains; before launching it the schedule syncs the generator if its weights are
older than ``v + u - k u`` (the rollout trains at version ``v + u`` at the latest, ``u``
optimizer steps per rollout), so no rollout trains more than ``k`` rollouts behind the
weights that generated it, and larger ``k`` means fewer syncs.

Every trainer rank runs the same schedule (its sync decisions are collective: every rank
takes part in a weight sync); only the ranks that generate — rank 0 colocated, the driver of
the generator ranks disaggregated — start anything.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from titan.rl.rollouts import Rollout


class Deferred:
    """A rollout being produced elsewhere (the generator ranks): collected when first waited
    for; an error is kept, to be raised by ``result()`` where every rank hears of it."""

    def __init__(self, collect: Callable[[], Any]) -> None:
        self._collect, self._done, self._value, self._error = collect, False, None, None

    def wait(self) -> None:
        """Collect the result now (first call only)."""
        if not self._done:
            try:
                self._value = self._collect()
            except Exception as err:  # raised by result(), inside the rollout broadcast
                self._error = err
            self._done = True

    def result(self) -> Any:
        """The collected result (collecting it first), or the error collecting it raised."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._value


def settle(future: concurrent.futures.Future | Deferred) -> None:
    """Wait until ``future`` holds its result or error, without raising it."""
    if isinstance(future, Deferred):
        future.wait()
    else:
        concurrent.futures.wait([future])


class RolloutSchedule:
    """The staleness bound of the module docstring over four callables of the controller:

    - ``sync()``: copy the current weights into the generator(s) (collective);
    - ``produce(index)``: generate and score rollout ``index`` now (called on the generating
      rank only, inside ``broadcast``);
    - ``broadcast(result)``: the generating rank's result (or the result of calling it, when
      callable) on every trainer rank;
    - ``request(index)``: ask the generator ranks for rollout ``index`` and return the function
      that collects it (the driver of a disaggregated run; None elsewhere).

    ``background``: this rank generates itself and may do so in a thread (colocated rank 0).
    """

    def __init__(self, *, max_staleness: int, updates_per_rollout: int, total_steps: int,
                 sync: Callable[[], None], produce: Callable[[int], Rollout], broadcast: Callable[[Any], Any],
                 request: Callable[[int], Callable[[], Rollout]] | None = None, background: bool = False) -> None:
        self.updates = updates_per_rollout
        self.bound = max_staleness * updates_per_rollout  # in policy versions
        self.total_steps = total_steps
        self._sync, self._produce, self._broadcast, self._request = sync, produce, broadcast, request
        self._executor = concurrent.futures.ThreadPoolExecutor(1) if background and self.bound else None
        self._pending: tuple[int, concurrent.futures.Future | Deferred | None] | None = None
        self.generator_version = -1
        """The policy version the generator holds (tracked on every rank: syncs are collective);
        -1 until the first sync: whatever it was built with is no version of this run."""

    def sync_to(self, version: int) -> None:
        """Give the generator the current weights (version ``version``) unless it has them."""
        if self.generator_version != version:
            self._sync_now(version)

    def _sync_now(self, version: int) -> None:
        """Copy the current weights (version ``version``) into the generator."""
        self._sync()
        self.generator_version = version

    def _sync_if_older(self, oldest: int, version: int) -> None:
        """Sync when the generator's weights are older than ``oldest``, or were never synced
        (a run that starts from loaded weights, or resumes, must not generate with the
        generator's freshly built ones)."""
        if self.generator_version < 0 or self.generator_version < oldest:
            self._sync_now(version)

    def _launch(self, index: int) -> None:
        """Start generating rollout ``index``: on the generator ranks (collected when first
        waited for), or in the background thread; nothing on the other ranks."""
        future = None
        if self._request is not None:
            future = Deferred(self._request(index))
        elif self._executor is not None:
            future = self._executor.submit(self._produce, index)
        self._pending = (index, future)

    def next_rollout(self, index: int, version: int) -> Rollout:
        """Rollout ``index`` for a step at policy version ``version``, on every trainer rank,
        within the staleness bound; launches rollout ``index + 1`` when another step needs it."""
        if self.bound == 0:
            self.sync_to(version)
            return self._broadcast(lambda: self._produce(index))
        if self._pending is None or self._pending[0] != index:
            self._sync_if_older(version - self.bound, version)
            self._launch(index)
        future = self._pending[1]
        if future is not None:  # done before the generator's weights may change below
            settle(future)
        self._pending = None
        # The next rollout trains at version + updates at the latest (this rollout takes at
        # most that many optimizer steps), so its weights must be of version >= that - bound.
        if version + self.updates < self.total_steps:  # another step will need a rollout
            self._sync_if_older(version + self.updates - self.bound, version)
            self._launch(index + 1)
        return self._broadcast(future.result if future is not None else None)

    def wait(self) -> None:
        """Let a background generation finish (before using the generator otherwise); a
        failure stays in the future, for :meth:`next_rollout` to report on every rank."""
        if self._pending is not None and self._pending[1] is not None:
            settle(self._pending[1])

    def close(self) -> None:
        """Stop the background thread (a generation still running finishes first)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
