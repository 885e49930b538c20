"""Python's cyclic garbage collector under the training loop's control (``--training.gc_freq``,
``--training.gc_debug``: torchtitan's flags).

Left automatic, the collector runs whenever enough objects were allocated, at a different
moment on every rank; a full collection of a large process takes long enough that the other
ranks wait for it at their next collective. The loop turns it off while it trains and
collects the young generations itself every ``gc_freq`` optimizer steps, the same steps on
every rank; when the loop ends the collector is left as it was found.
"""

from __future__ import annotations

import gc
import logging
import time
from types import TracebackType

logger = logging.getLogger("titan")


class GarbageCollection:
    """The collector's schedule for one training run (a context manager).

    ``freq`` > 0: automatic collection off inside the ``with`` block, one collection of
    generations 0-1 on entry and after every ``freq``-th optimizer step (``after_step``).
    0: Python's automatic collection, untouched. ``debug``: a full collection after every
    step, logged with what it freed, and (rank 0) torch's warning for reference cycles that
    hold tensors, which keep device memory alive until a full collection."""

    def __init__(self, freq: int, *, debug: bool = False, rank: int = 0) -> None:
        if freq < 0:
            raise ValueError(f"--training.gc_freq must be >= 0 (0: Python's automatic collection), got {freq}")
        self.freq, self.debug, self.rank = freq, debug, rank
        self._was_enabled: bool | None = None

    @property
    def controls(self) -> bool:
        """Whether the loop collects instead of Python's automatic collector."""
        return self.freq > 0 or self.debug

    def __enter__(self) -> GarbageCollection:
        if self.controls:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self._collect(1, "at the start")
            if self.debug and self.rank == 0:
                self._warn_tensor_cycles()
        return self

    def after_step(self, step: int) -> None:
        """Collect when optimizer step ``step`` is due (every ``freq``; every step with ``debug``)."""
        if self.debug:
            self._collect(2, f"after step {step}", level=logging.INFO)
        elif self.freq > 0 and step % self.freq == 0:
            self._collect(1, f"after step {step}")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    @staticmethod
    def _warn_tensor_cycles() -> None:
        """torch's warning for collected reference cycles that held CUDA tensors (it reads
        the CUDA allocator's history: nothing to watch without CUDA)."""
        import torch

        if not torch.cuda.is_available():
            logger.info("--training.gc_debug: reference cycles holding tensors are reported on CUDA only")
            return
        from torch.utils.viz._cycles import warn_tensor_cycles

        warn_tensor_cycles()

    @staticmethod
    def _collect(generation: int, when: str, *, level: int = logging.DEBUG) -> None:
        start = time.perf_counter()
        found = gc.collect(generation)
        logger.log(level, "garbage collection %s: %d unreachable objects, %.3fs", when, found,
                   time.perf_counter() - start)
