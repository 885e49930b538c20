"""Training metrics: loss, grad norm, lr, throughput, TFLOPs, MFU and peak memory.

Every ``log_freq`` steps rank 0 prints one line (with progress and ETA) and appends one JSON
object to ``<dump_folder>/metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from titan.train.device_peak import raise_cpu_peak_flops

logger = logging.getLogger("titan")

METRIC_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_second", "tflops", "mfu", "memory_peak_gib",
               "device_tokens", "elapsed_s")


@dataclass(kw_only=True)
class MetricsConfig:
    """What is logged and how often (``--metrics.*``)."""

    log_freq: int = 10
    """Log every this many steps (and always the first and last step)."""
    enable_jsonl: bool = True
    """Append one JSON object per logged step to <dump_folder>/metrics.jsonl."""
    enable_progress_bar: bool = True
    """Show a progress bar with ETA when stderr is a terminal."""

    def __post_init__(self) -> None:
        if self.log_freq < 1:
            raise ValueError(f"--metrics.log_freq must be >= 1, got {self.log_freq}")


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process on ``device`` in GiB: allocator peak on CUDA, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h02m05s``; short and fixed-format for log lines."""
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


class MetricsLogger:
    """Accumulates throughput between log steps and writes the logged metrics.

    Throughput is per device: tokens this rank processed divided by wall time since the last
    log, the convention peers use so numbers compare across world sizes. Each record carries the
    two operands (``device_tokens``, ``elapsed_s``) so the rate can be checked exactly.

    MFU never exceeds 100%: throughput above ``peak_flops`` proves the peak wrong (a CPU peak
    measured while other work loaded the machine), so the peak is raised to what was observed,
    and on CPU the cached peak is rewritten (rank 0) for the next run.
    ``clock`` (seconds, monotonic) is injectable for tests.
    """

    def __init__(
        self,
        cfg: MetricsConfig,
        *,
        dump_folder: Path,
        total_steps: int,
        flops_per_token: float,
        peak_flops: float | None,
        device: torch.device,
        is_rank0: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.total_steps = total_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.device = device
        self.is_rank0 = is_rank0
        self.jsonl_path = Path(dump_folder) / "metrics.jsonl"
        self._tokens_since_log = 0
        self._last_log_time = clock()
        self._start_time = self._last_log_time
        self._start_step = 0
        self._bar = self._make_progress_bar()

    def _make_progress_bar(self) -> Any:
        if not (self.is_rank0 and self.cfg.enable_progress_bar and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, desc="train", unit="step", dynamic_ncols=True, leave=False)

    def start(self, step: int) -> None:
        """Mark the beginning of training at ``step`` (after a resume, throughput and ETA count
        from here)."""
        self._start_step = step
        self._start_time = self._last_log_time = self.clock()
        if self._bar is not None:
            self._bar.update(step)

    def should_log(self, step: int) -> bool:
        """Whether ``step`` is a logging step."""
        return step == 1 or step % self.cfg.log_freq == 0 or step == self.total_steps

    def record_tokens(self, tokens: int) -> None:
        """Count tokens this rank processed in a step."""
        self._tokens_since_log += tokens
        if self._bar is not None:
            self._bar.update(1)

    def log(self, *, step: int, loss: float, grad_norm: float, lr: float, extra: dict[str, float] | None = None) -> dict[str, Any]:
        """Compute throughput since the last log and emit the metrics of ``step``."""
        now = self.clock()
        elapsed = max(now - self._last_log_time, 1e-9)
        tps = self._tokens_since_log / elapsed
        achieved = tps * self.flops_per_token
        tflops = achieved / 1e12
        mfu = None
        if self.peak_flops is not None:
            self._correct_peak(achieved)
            mfu = 100.0 * achieved / self.peak_flops
        record: dict[str, Any] = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_second": tps,
            "tflops": tflops,
            "mfu": mfu,
            "memory_peak_gib": peak_memory_gib(self.device),
            "device_tokens": self._tokens_since_log,
            "elapsed_s": elapsed,
        }
        record.update(extra or {})
        self._tokens_since_log = 0
        self._last_log_time = now
        if self.is_rank0:
            self._emit(record, eta=self._eta(step, now))
        return record

    def _correct_peak(self, achieved: float) -> None:
        """Raise the peak to ``achieved`` FLOP/s when throughput exceeds it (see the class doc)."""
        if achieved <= self.peak_flops:
            return
        if self.is_rank0:
            logger.warning(
                "observed %.3g FLOP/s exceeds the peak of %.3g FLOP/s used for MFU; the peak was "
                "measured too low (likely under load) and is raised to the observed value",
                achieved, self.peak_flops,
            )
        self.peak_flops = achieved
        if self.device.type == "cpu" and self.is_rank0:
            raise_cpu_peak_flops(achieved)

    def _eta(self, step: int, now: float) -> float:
        done = step - self._start_step
        if done <= 0:
            return math.nan
        return (now - self._start_time) / done * (self.total_steps - step)

    def _emit(self, record: dict[str, Any], *, eta: float) -> None:
        mfu = "n/a" if record["mfu"] is None else f"{record['mfu']:.2f}%"
        line = (
            f"step {record['step']:>{len(str(self.total_steps))}}/{self.total_steps}"
            f"  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}"
            f"  tps {record['tokens_per_second']:,.0f}  tflops {record['tflops']:.3f}  mfu {mfu}"
            f"  mem {record['memory_peak_gib']:.2f}GiB"
            f"  eta {'?' if math.isnan(eta) else format_duration(eta)}"
        )
        if self._bar is not None:
            self._bar.write(line)
        else:
            logger.info(line)
        if self.cfg.enable_jsonl:
            self.jsonl_path.parent.mkdir(parents=True, exist_ok=True)
            with self.jsonl_path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        """Close the progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
