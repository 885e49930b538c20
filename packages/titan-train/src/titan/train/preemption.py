"""Graceful stops: the first SIGTERM or SIGINT finishes the current step, saves a checkpoint
and ends the run with exit code 0; a second one exits at once.

Checkpoints are published atomically (written to a temporary folder, then renamed), so an
immediate exit never leaves a corrupt "latest" checkpoint: the next run resumes from the last
complete one.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger("titan")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    """Installs the handlers for the life of a run (main thread only; elsewhere a no-op).

    ``requested()`` is collective: every rank learns whether any rank was signalled, so all
    of them stop after the same step (torchrun and Slurm signal every rank, but not at the
    same instant).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.signalled = False
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        if self.signalled:
            logger.warning("second %s: exiting now; the last complete checkpoint is intact", signal.Signals(signum).name)
            os._exit(128 + signum)
        self.signalled = True
        logger.warning("%s received: finishing this step, then saving a checkpoint (send it again to exit at once)",
                       signal.Signals(signum).name)

    def requested(self) -> bool:
        """Whether any rank was signalled (a MAX all-reduce over the world when distributed)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signalled
        flag = torch.tensor([1.0 if self.signalled else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def close(self) -> None:
        """Restore the handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def save_for_preemption(checkpointer, step: int) -> None:
    """Save the step just finished so the same command resumes from it, and say so (a run
    with checkpointing off says that nothing was saved)."""
    if checkpointer.save_now(step):
        logger.warning("stopped at step %d and saved a checkpoint in %s; run the same command to resume",
                       step, checkpointer.folder)
    else:
        logger.warning("stopped at step %d; checkpointing is off (--checkpoint.enable), nothing was saved", step)
