"""Profiling a run (``--profiling.*``): ``torch.profiler`` traces every ``profile_freq`` steps,
memory snapshots on CUDA and a memory report on CPU.

A loop builds one :class:`StepProfiler` before its first step, calls :meth:`StepProfiler.step`
after every optimizer step and :meth:`StepProfiler.close` at the end. Every ``profile_freq``
steps the profiler records a short window (``profiler_warmup`` steps warming up, then
``profiler_active`` steps recorded) ending at a multiple of ``profile_freq`` and writes

- ``<dump_folder>/<save_traces_folder>/iteration_<N>/rank<R>_trace.json``: a Chrome trace
  (open it in https://ui.perfetto.dev or chrome://tracing), CPU ops plus GPU kernels on CUDA;
- ``.../rank<R>_memory.txt``: the ops that allocated the most memory in that window (self
  device memory on accelerators, self CPU memory on CPU) and the process's resident memory.

With ``--profiling.enable_memory_snapshot``, at the same steps,
``<dump_folder>/<save_memory_snapshot_folder>/iteration_<N>/rank<R>_memory_snapshot.pickle``
holds the CUDA caching allocator's history (drag it onto https://pytorch.org/memory_viz); on a
CPU run, where no allocator history exists, ``rank<R>_memory.txt`` there reports the resident
memory (current and peak) instead.
"""

from __future__ import annotations

import logging
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerAction

logger = logging.getLogger("titan")

# Allocation events the CUDA allocator keeps for a snapshot: enough for a few steps of a big model.
MEMORY_HISTORY_ENTRIES = 100_000


@dataclass(kw_only=True)
class ProfilerConfig:
    """``torch.profiler`` traces and memory snapshots (``--profiling.*``)."""

    enable_profiling: bool = False
    """Record a torch.profiler trace every profile_freq steps."""
    save_traces_folder: str = "profile_traces"
    """Folder under <dump_folder> for the traces (iteration_<N>/rank<R>_trace.json)."""
    profile_freq: int = 10
    """Profile the steps ending at every multiple of this."""
    profiler_warmup: int = 3
    """Steps run under the profiler, not recorded, before each recorded window (fewer when the
    period is too short to hold them)."""
    profiler_active: int = 1
    """Steps recorded in each window (a short one: traces grow fast)."""
    enable_memory_snapshot: bool = False
    """Save a CUDA memory snapshot every profile_freq steps (a resident-memory report on CPU)."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Folder under <dump_folder> for the memory snapshots."""

    def __post_init__(self) -> None:
        if self.profile_freq < 1:
            raise ValueError(f"--profiling.profile_freq must be >= 1, got {self.profile_freq}")
        if self.profiler_active < 1:
            raise ValueError(f"--profiling.profiler_active must be >= 1, got {self.profiler_active}")
        if self.profiler_warmup < 0:
            raise ValueError(f"--profiling.profiler_warmup must be >= 0, got {self.profiler_warmup}")
        if self.profiler_active > self.profile_freq:
            raise ValueError(
                f"--profiling.profiler_active ({self.profiler_active}) must not exceed "
                f"--profiling.profile_freq ({self.profile_freq}); raise --profiling.profile_freq or "
                "record fewer steps"
            )
        for flag in ("save_traces_folder", "save_memory_snapshot_folder"):
            if not getattr(self, flag):
                raise ValueError(f"--profiling.{flag} must not be empty")


def window_action(step: int, cfg: ProfilerConfig) -> ProfilerAction:
    """What the profiler does during training step ``step`` (1-based): record the
    ``profiler_active`` steps ending at each multiple of ``profile_freq`` (saving at the last),
    warm up for the ``profiler_warmup`` steps before them, and stay idle otherwise."""
    position = (step - 1) % cfg.profile_freq + 1  # 1..profile_freq within the period
    if position == cfg.profile_freq:
        return ProfilerAction.RECORD_AND_SAVE
    if position > cfg.profile_freq - cfg.profiler_active:
        return ProfilerAction.RECORD
    if position > cfg.profile_freq - cfg.profiler_active - cfg.profiler_warmup:  # <= 0: whole rest
        return ProfilerAction.WARMUP
    return ProfilerAction.NONE


def resident_memory_gib() -> tuple[float, float]:
    """This process's (current, peak) resident memory in GiB; current is 0 where unknown.

    The two come from different counters read one after the other (statm, then rusage), so
    memory that grows in between, or the counters' own accounting, could show a current
    above the peak; the peak is at least the current by definition.
    """
    current = 0.0
    try:
        with open("/proc/self/statm") as f:  # Linux: pages
            current = int(f.read().split()[1]) * resource.getpagesize() / 2**30
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**30 if sys.platform == "darwin" else 2**20)
    return current, max(peak, current)


def _activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    """CPU always, plus the accelerator's own activity where the profiler has one."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    accelerator = getattr(torch.profiler.ProfilerActivity, device.type.upper(), None)
    if device.type != "cpu" and accelerator in torch.profiler.supported_activities():
        activities.append(accelerator)
    return activities


class StepProfiler:
    """Traces and memory snapshots on the schedule of a :class:`ProfilerConfig`.

    ``start_step`` is the step the loop resumes from (0 for a fresh run), so windows stay on
    multiples of ``profile_freq`` after a resume. Disabled (both switches off), every method is
    a no-op. Also a context manager that closes itself.
    """

    def __init__(self, cfg: ProfilerConfig, *, dump_folder: str | Path, rank: int,
                 device: torch.device, start_step: int = 0) -> None:
        self.cfg = cfg
        self.rank = rank
        self.device = torch.device(device)
        self.step_num = start_step
        self.trace_dir = Path(dump_folder) / cfg.save_traces_folder
        self.snapshot_dir = Path(dump_folder) / cfg.save_memory_snapshot_folder
        self.saved: list[Path] = []
        """Every file written so far (traces, reports, snapshots), for the loop's summary."""
        self._profiler: torch.profiler.profile | None = None
        self._cuda_history = False
        if cfg.enable_profiling:
            self._start_profiler()
        if cfg.enable_memory_snapshot:
            self._start_memory_history()

    def _start_profiler(self) -> None:
        start = self.step_num
        self._profiler = torch.profiler.profile(
            activities=_activities(self.device),
            # The profiler counts its own steps from 0; step k of it is training step start+k+1.
            schedule=lambda k: window_action(start + k + 1, self.cfg),
            on_trace_ready=self._save_trace,
            profile_memory=True,
            record_shapes=True,
            with_stack=False,
        )
        self._profiler.start()
        logger.info("profiling: traces every %d steps into %s", self.cfg.profile_freq, self.trace_dir)

    def _start_memory_history(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            self._cuda_history = True
        elif self.device.type != "cpu":
            logger.warning("--profiling.enable_memory_snapshot: no allocator history on %s; "
                           "writing resident-memory reports instead", self.device.type)

    def _save_trace(self, prof: torch.profiler.profile) -> None:
        """Write the window that just ended: the Chrome trace and the memory table."""
        folder = self.trace_dir / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"rank{self.rank}_trace.json"
        prof.export_chrome_trace(str(trace))
        sort_by = "self_cpu_memory_usage" if self.device.type == "cpu" else f"self_{self.device.type}_memory_usage"
        try:
            table = prof.key_averages().table(sort_by=sort_by, row_limit=25)
        except (KeyError, AttributeError, RuntimeError):  # a device without memory columns
            table = prof.key_averages().table(sort_by="self_cpu_memory_usage", row_limit=25)
        report = folder / f"rank{self.rank}_memory.txt"
        report.write_text(self._rss_line() + "\n\n" + table + "\n")
        self.saved += [trace, report]
        logger.info("profiler trace of step %d: %s", self.step_num, trace)

    def _rss_line(self) -> str:
        current, peak = resident_memory_gib()
        return f"step {self.step_num} rank {self.rank}: resident memory {current:.3f} GiB (peak {peak:.3f} GiB)"

    def _save_memory_snapshot(self) -> None:
        folder = self.snapshot_dir / f"iteration_{self.step_num}"
        folder.mkdir(parents=True, exist_ok=True)
        if self._cuda_history:
            path = folder / f"rank{self.rank}_memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
        else:
            path = folder / f"rank{self.rank}_memory.txt"
            path.write_text(self._rss_line() + "\n")
        self.saved.append(path)

    def step(self) -> None:
        """Mark the end of one training step (call once per optimizer step)."""
        self.step_num += 1
        if self._profiler is not None:
            self._profiler.step()  # saves the trace when a window ends at this step
        if self.cfg.enable_memory_snapshot and self.step_num % self.cfg.profile_freq == 0:
            self._save_memory_snapshot()

    def close(self) -> None:
        """Stop profiling (an unfinished window is dropped) and the allocator history."""
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.on_trace_ready = None  # a window cut short by the end of the run is not saved
            profiler.stop()
        if self._cuda_history:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._cuda_history = False

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
