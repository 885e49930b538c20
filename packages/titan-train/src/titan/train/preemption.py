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
    same instant). Distributed, it answers for the call before (one step late) so the host
    never waits for the device: each call starts the reduction of this step's flag and copies
    the result to the host behind the step's work, and the next call reads that copy, long
    done by then.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.signalled = False
        self._in_flight: tuple[torch.Tensor, object | None] | None = None
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
        """Whether any rank was signalled (a MAX all-reduce over the world when distributed,
        by the previous call: every rank gets the same answer at the same call)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return self.signalled
        # Filled on the device: a tensor made from host data would be a copy from pageable
        # memory, which on CUDA waits for the queued steps.
        flag = torch.full((1,), 1.0 if self.signalled else 0.0, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        previous, self._in_flight = self._in_flight, self._copy_to_host(flag)
        if previous is None:
            return False
        host, ready = previous
        if ready is not None:
            ready.synchronize()  # the previous step's copy: finished long ago
        return bool(host[0] > 0)

    def _copy_to_host(self, flag: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """A host copy of ``flag`` queued behind the device's work, and the event marking it
        done (None where the copy is already done: a CPU device)."""
        if self.device.type != "cuda":
            return flag, None
        host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready

    def close(self) -> None:
        """Restore the handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def save_for_preemption(checkpointer, step: int, *, resave: bool = False) -> None:
    """Save the step just finished so the same command resumes from it, and say so (a run
    with checkpointing off says that nothing was saved). ``resave``: replace the step's
    checkpoint if this run saved it already (work done since, without a step)."""
    if checkpointer.save_now(step, resave=resave):
        logger.warning("stopped at step %d and saved a checkpoint in %s; run the same command to resume",
                       step, checkpointer.folder)
    else:
        logger.warning("stopped at step %d; checkpointing is off (--checkpoint.enable), nothing was saved", step)
