"""Training metrics: loss, grad norm, lr, throughput, TFLOPs, MFU and peak memory.

Every ``log_freq`` steps rank 0 prints one line (with progress and ETA) and appends one JSON
object to ``<dump_folder>/metrics.jsonl``. TensorBoard event files and Weights & Biases runs
receive the same records when enabled (``--metrics.enable_tensorboard``,
``--metrics.enable_wandb``); ``--metrics.save_for_all_ranks`` makes every rank write its own.

What reaches each backend: every key of the record, including the ``extra`` fields a loop adds
(RL rewards, expert load, epoch). The JSONL file keeps every value (0-d tensors and numpy
scalars become numbers; other objects JSON does not know become their ``str``). TensorBoard
and W&B take numbers only: ints, floats and bools, 0-d tensors and numpy scalars; a dict of
numbers is flattened to ``key/subkey``; ``None`` (``mfu`` on an unknown device) is skipped;
any other value (strings, lists) is skipped with one warning per key.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import numbers
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from titan.train.device_peak import raise_cpu_peak_flops

logger = logging.getLogger("titan")

METRIC_KEYS = ("step", "loss", "grad_norm", "lr", "tokens_per_second", "tflops", "mfu", "memory_peak_gib",
               "device_tokens", "elapsed_s", "data_wait_s", "data_wait_pct")


@dataclass(kw_only=True)
class MetricsConfig:
    """What is logged and how often (``--metrics.*``)."""

    log_freq: int = 10
    """Log every this many steps (and always the first and last step)."""
    enable_jsonl: bool = True
    """Append one JSON object per logged step to <dump_folder>/metrics.jsonl."""
    enable_progress_bar: bool = True
    """Show a progress bar with ETA when stderr is a terminal."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files to <dump_folder>/<save_tb_folder>/rank<R> (needs the
    tensorboard package: pip install 'titan-train[tensorboard]')."""
    save_tb_folder: str = "tb"
    """Folder under <dump_folder> for the TensorBoard event files."""
    enable_wandb: bool = False
    """Log to Weights & Biases (needs wandb: pip install 'titan-train[wandb]'). Without network
    or API key use --metrics.wandb_mode offline (or WANDB_MODE=offline); `wandb sync` uploads
    the run later."""
    wandb_project: str | None = None
    """W&B project of the run (default: WANDB_PROJECT, else titan)."""
    wandb_run_name: str | None = None
    """W&B run name (default: the name of the dump folder)."""
    wandb_mode: str | None = None
    """W&B mode: online, offline or disabled (default: WANDB_MODE, else online)."""
    straggler_factor: float = 5.0
    """Warn (rank 0, at log steps) when a step took more than this many times the running
    median step time, naming the rank whose own work (loading its batch) explains it; 0 turns
    the check off (pretraining and SFT)."""
    save_for_all_ranks: bool = False
    """Every rank writes its own metrics (metrics_rank<R>.jsonl, tb/rank<R>, a W&B run per
    rank grouped by run name) instead of rank 0 only. The console stays rank 0's."""

    def __post_init__(self) -> None:
        if self.log_freq < 1:
            raise ValueError(f"--metrics.log_freq must be >= 1, got {self.log_freq}")
        if self.straggler_factor != 0 and self.straggler_factor <= 1:
            raise ValueError(
                f"--metrics.straggler_factor must be > 1 (times the median step time) or 0 (off), "
                f"got {self.straggler_factor}"
            )
        if self.wandb_mode not in (None, "online", "offline", "disabled"):
            raise ValueError(
                f"--metrics.wandb_mode must be online, offline or disabled, got {self.wandb_mode!r}"
            )
        if not self.save_tb_folder:
            raise ValueError("--metrics.save_tb_folder must not be empty")
        # Checked at parse time so a missing package stops the run before any work.
        if self.enable_tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                "--metrics.enable_tensorboard needs the tensorboard package: "
                "pip install 'titan-train[tensorboard]' (or drop the flag)"
            )
        if self.enable_wandb and importlib.util.find_spec("wandb") is None:
            raise ValueError(
                "--metrics.enable_wandb needs the wandb package: "
                "pip install 'titan-train[wandb]' (or drop the flag)"
            )


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


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a real number (bools, numpy scalars and one-element
    tensors included), else None."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            return None
        value = value.item()
    if isinstance(value, numbers.Real):  # bool, int, float and numpy's real scalars
        return float(value)
    return None


def scalar_metrics(record: Mapping[str, Any], *, skipped: set[str] | None = None) -> dict[str, float]:
    """The numeric fields of ``record`` as TensorBoard and W&B take them: ``step`` left out
    (it is the x axis), dicts flattened to ``key/subkey``, ``None`` dropped silently and any
    other non-number dropped with a warning, once per key (``skipped`` remembers the keys)."""
    out: dict[str, float] = {}
    skipped = set() if skipped is None else skipped

    def visit(key: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for sub, inner in value.items():
                visit(f"{key}/{sub}", inner)
            return
        number = _number(value)
        if number is not None:
            out[key] = number
        elif value is not None and key not in skipped:
            skipped.add(key)
            logger.warning(
                "metric %r is a %s, not a number: written to metrics.jsonl only, skipped by "
                "TensorBoard and W&B", key, type(value).__name__,
            )

    for key, value in record.items():
        if key != "step":
            visit(str(key), value)
    return out


def _json_default(value: Any) -> Any:
    """JSON for what ``json`` does not know: one-element tensors and numpy scalars become
    numbers, anything else its ``str``."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if hasattr(value, "item") and hasattr(value, "dtype"):  # numpy scalars
        return value.item()
    return str(value)


def logged_step_range(path: Path) -> tuple[int, int] | None:
    """The first and last ``step`` of a metrics JSONL file (read from its first line and its
    end, whatever its length); None when they cannot be read."""
    try:
        with path.open("rb") as f:
            first = json.loads(f.readline())["step"]
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = [line for line in f.read().splitlines() if line.strip()]
        for line in reversed(lines):  # a run killed mid-write may leave its last line cut
            try:
                return int(first), int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


class JsonlBackend:
    """Appends each record as one JSON object per line."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def log(self, record: Mapping[str, Any]) -> None:
        """Append ``record``."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=_json_default) + "\n")

    def close(self) -> None:
        """Nothing to release: every record is written when logged."""


class TensorBoardBackend:
    """Writes each numeric metric as a TensorBoard scalar at the record's step. The event file
    is opened at the first record, so a run that logs nothing (a finished run launched again,
    a run refused after its checkpoint loads) leaves no empty event file behind."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._writer: Any = None
        self._purge_step: int | None = None

    @property
    def writer(self) -> Any:
        """The open ``SummaryWriter`` (opened on first use)."""
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
        return self._writer

    def resume_at(self, step: int) -> None:
        """Training continues after ``step`` (a resumed run): TensorBoard drops the events an
        earlier attempt logged past it (``purge_step``), whose training was rolled back, so
        the curves do not double back over the redone steps."""
        self.close()
        self._purge_step = step + 1

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Add one scalar per metric and flush, so a live TensorBoard sees every log step."""
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file (if one was opened)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbBackend:
    """One Weights & Biases run per titan run (per rank with ``save_for_all_ranks``); metrics are
    logged at the record's step.

    The run's id is kept in the dump folder (``wandb-run.json``), so a relaunch that resumes
    from a checkpoint continues the same W&B run (``resume="allow"``) instead of opening a
    new one, and a relaunch that starts over opens a new one. A folder without a record opens
    its run at once, so a W&B that cannot start fails before anything is built."""

    def __init__(self, cfg: MetricsConfig, *, dump_folder: Path, rank: int,
                 run_config: Mapping[str, Any] | None) -> None:
        name = cfg.wandb_run_name or Path(dump_folder).resolve().name
        per_rank = cfg.save_for_all_ranks
        dump_folder.mkdir(parents=True, exist_ok=True)
        self._init_kwargs = dict(
            project=cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "titan",
            name=f"{name}-rank{rank}" if per_rank else name,
            group=name if per_rank else None,
            dir=str(dump_folder),
            config=dict(run_config) if run_config is not None else None,
            mode=cfg.wandb_mode,
            reinit="create_new",  # several loggers in one process (tests) get their own runs
        )
        self.record_path = dump_folder / (f"wandb-run-rank{rank}.json" if per_rank else "wandb-run.json")
        self.run: Any = None
        self._last_step = 0
        if not self.record_path.exists():
            self._open()

    def start(self, step: int) -> None:
        """Training starts after ``step``: a resumed run (``step`` > 0) continues the W&B run
        recorded in the folder; a run starting over opens a new one."""
        if self.run is not None:
            return
        record = self._record()
        if step > 0 and record.get("id"):
            if record.get("last_step", 0) > step:
                logger.warning(
                    "W&B run %s logged up to step %d, this run resumes from step %d: W&B keeps the first "
                    "values of steps %d-%d (it takes each step once); TensorBoard and metrics.jsonl show the "
                    "redone ones", record["id"], record["last_step"], step, step + 1, record["last_step"])
            self._last_step = int(record.get("last_step", 0))
            self._open(id=record["id"], resume="allow")
        else:
            self._open()

    def _record(self) -> dict[str, Any]:
        try:
            return json.loads(self.record_path.read_text())
        except (OSError, ValueError):
            return {}

    def _open(self, **resume: Any) -> None:
        import wandb

        try:
            self.run = wandb.init(**self._init_kwargs, **resume)
        except Exception as err:  # no API key, no network, bad project: the user's setup
            first = (str(err) or type(err).__name__).splitlines()[0]
            raise ValueError(
                f"--metrics.enable_wandb: could not start a W&B run ({first}); run `wandb "
                "login`, or log without network with --metrics.wandb_mode offline"
            ) from err
        self._save_record()

    def _save_record(self) -> None:
        run_id = getattr(self.run, "id", None)
        if run_id is not None:
            partial = self.record_path.with_name(self.record_path.name + ".tmp")
            partial.write_text(json.dumps({"id": run_id, "last_step": self._last_step}) + "\n")
            os.replace(partial, self.record_path)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        """Log the metrics of ``step``."""
        if self.run is None:
            self.start(0)
        self.run.log(dict(scalars), step=step)
        if step > self._last_step:
            self._last_step = step
            self._save_record()

    def close(self) -> None:
        """Finish the run (an offline run is then ready for ``wandb sync``)."""
        if self.run is not None:
            self.run.finish()


def current_rank(is_rank0: bool) -> int:
    """This process's global rank: the process group's, else ``RANK``, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    if is_rank0:
        return 0
    return int(os.environ.get("RANK", "0") or 0)


class MetricsLogger:
    """Accumulates throughput between log steps and writes the logged metrics.

    Throughput is per device: tokens this rank processed divided by wall time since the last
    log, the convention peers use so numbers compare across world sizes. Each record carries the
    two operands (``device_tokens``, ``elapsed_s``) so the rate can be checked exactly.

    MFU never exceeds 100%: throughput above ``peak_flops`` proves the peak wrong (a CPU peak
    measured while other work loaded the machine), so the peak is raised to what was observed,
    and on CPU the cached peak of ``compute_dtype`` (the dtype the peak was measured in) is
    rewritten (rank 0) for the next run. ``clock`` (seconds, monotonic) is injectable for tests.

    Rank 0 prints; the writing ranks (rank 0, or every rank with ``save_for_all_ranks``) send
    each record to the JSONL file and the enabled backends. ``rank`` defaults to the process
    group's; ``run_config`` (a plain dict of the resolved config) becomes the W&B run's config.
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
        compute_dtype: torch.dtype = torch.float32,
        rank: int | None = None,
        run_config: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.total_steps = total_steps
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.device = device
        self.compute_dtype = compute_dtype
        self.is_rank0 = is_rank0
        self.rank = current_rank(is_rank0) if rank is None else rank
        dump_folder = Path(dump_folder)
        suffix = "" if is_rank0 else f"_rank{self.rank}"
        self.jsonl_path = dump_folder / f"metrics{suffix}.jsonl"
        self.tb_dir = dump_folder / cfg.save_tb_folder / f"rank{self.rank}"
        self.dump_folder = dump_folder
        self._skipped: set[str] = set()
        self._jsonl: JsonlBackend | None = None
        self._backends: list[TensorBoardBackend | WandbBackend] = []
        # The event files an earlier run left here (this run's writer adds its own below).
        self._earlier_tb_files = sorted(self.tb_dir.glob("events.out.tfevents.*")) if self.tb_dir.is_dir() else []
        if is_rank0 or cfg.save_for_all_ranks:
            self._open_backends(dump_folder, run_config)
        self._tokens_since_log = 0
        self._data_wait_since_log: float | None = None
        self._last_log_time = clock()
        self._start_time = self._last_log_time
        self._start_step = 0
        self._bar = self._make_progress_bar()

    def _open_backends(self, dump_folder: Path, run_config: Mapping[str, Any] | None) -> None:
        if self.cfg.enable_jsonl:
            self._jsonl = JsonlBackend(self.jsonl_path)
        if self.cfg.enable_tensorboard:
            self._backends.append(TensorBoardBackend(self.tb_dir))
        if self.cfg.enable_wandb:
            self._backends.append(
                WandbBackend(self.cfg, dump_folder=dump_folder, rank=self.rank, run_config=run_config)
            )

    def _make_progress_bar(self) -> Any:
        if not (self.is_rank0 and self.cfg.enable_progress_bar and sys.stderr.isatty()):
            return None
        from tqdm import tqdm

        return tqdm(total=self.total_steps, desc="train", unit="step", dynamic_ncols=True, leave=False)

    def start(self, step: int, *, continues: bool | None = None) -> Path | None:
        """Mark the beginning of training at ``step`` (after a resume, throughput and ETA count
        from here). ``continues``: whether this run continues the records the dump folder
        holds (default: ``step > 0``, a resumed run, which appends to them). A run that does
        not (it starts afresh) first moves an earlier run's records out of its way
        (:meth:`set_aside_earlier_run`), so that metrics.jsonl and TensorBoard show this run
        alone; returns the folder they went to (None: there were none)."""
        aside = None
        if not (step > 0 if continues is None else continues):
            aside = self.set_aside_earlier_run()
        self._start_step = step
        self._start_time = self._last_log_time = self.clock()
        for backend in self._backends:
            if isinstance(backend, TensorBoardBackend) and step > 0:
                backend.resume_at(step)
            elif isinstance(backend, WandbBackend):
                backend.start(step)
        if self._bar is not None:
            self._bar.update(step)
        return aside

    def set_aside_earlier_run(self) -> Path | None:
        """Move the records an earlier run left in the dump folder (this rank's metrics JSONL
        file and TensorBoard event files) to ``<dump_folder>/earlier_runs/<n>/``, the first
        ``n`` that holds none of them yet, keeping their names (``tensorboard --logdir`` on
        the dump folder then shows that run beside this one, and ``titan plot`` reads the
        folder). Appending instead would interleave two runs' steps in one series. Only the
        writing ranks hold records; returns the folder (None: nothing to move)."""
        jsonl = self.jsonl_path if self.jsonl_path.is_file() and self.jsonl_path.stat().st_size else None
        tb_files = [f for f in self._earlier_tb_files if f.is_file()]
        if not (self.is_rank0 or self.cfg.save_for_all_ranks) or (jsonl is None and not tb_files):
            return None
        tb_rel = self.tb_dir.relative_to(self.dump_folder)
        n = 1
        while (self.dump_folder / "earlier_runs" / str(n) / self.jsonl_path.name).exists() or \
                (self.dump_folder / "earlier_runs" / str(n) / tb_rel).exists():
            n += 1
        aside = self.dump_folder / "earlier_runs" / str(n)
        aside.mkdir(parents=True, exist_ok=True)
        if jsonl is not None:
            steps = logged_step_range(jsonl)
            jsonl.rename(aside / jsonl.name)
        if tb_files:
            (aside / tb_rel).mkdir(parents=True, exist_ok=True)
            for event_file in tb_files:
                event_file.rename(aside / tb_rel / event_file.name)
        self._earlier_tb_files = []
        what = f"metrics (steps {steps[0]}-{steps[1]})" if jsonl is not None and steps else "metrics"
        logger.info("%s held an earlier run's %s and this run starts afresh: moved them to %s, so that its "
                    "metrics show this run alone", self.dump_folder, what, aside)
        return aside

    def should_log(self, step: int) -> bool:
        """Whether ``step`` is a logging step."""
        return step == 1 or step % self.cfg.log_freq == 0 or step == self.total_steps

    def record_tokens(self, tokens: int, *, data_wait_s: float | None = None) -> None:
        """Count tokens this rank processed in a step, and the seconds the step waited for its
        batches (logged as ``data_wait_s`` since the last log and its share of the time; None
        in the record when the loop does not measure it)."""
        self._tokens_since_log += tokens
        if data_wait_s is not None:
            self._data_wait_since_log = (self._data_wait_since_log or 0.0) + data_wait_s
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
            "data_wait_s": self._data_wait_since_log,
            "data_wait_pct": None if self._data_wait_since_log is None else 100.0 * self._data_wait_since_log / elapsed,
        }
        record.update(extra or {})
        self._tokens_since_log = 0
        self._data_wait_since_log = None if self._data_wait_since_log is None else 0.0
        self._last_log_time = now
        if self.is_rank0:
            self._print(record, eta=self._eta(step, now))
        self._write(record)
        return record

    def log_record(self, record: Mapping[str, Any]) -> None:
        """Send a record of the caller's own (an evaluation, say; it must carry ``step``) to
        this rank's JSONL file and every enabled backend, as `log` does with a step's."""
        if "step" not in record:
            raise ValueError(f"a metrics record needs a 'step'; got keys {sorted(record)}")
        self._write(record)

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
            raise_cpu_peak_flops(achieved, dtype=self.compute_dtype)

    def _eta(self, step: int, now: float) -> float:
        done = step - self._start_step
        if done <= 0:
            return math.nan
        return (now - self._start_time) / done * (self.total_steps - step)

    def _print(self, record: dict[str, Any], *, eta: float) -> None:
        mfu = "n/a" if record["mfu"] is None else f"{record['mfu']:.2f}%"
        line = (
            f"step {record['step']:>{len(str(self.total_steps))}}/{self.total_steps}"
            f"  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}"
            f"  tps {record['tokens_per_second']:,.0f}  tflops {record['tflops']:.3f}  mfu {mfu}"
            f"  mem {record['memory_peak_gib']:.2f}GiB"
            + ("" if record["data_wait_pct"] is None else f"  data {record['data_wait_pct']:.1f}%")
            + f"  eta {'?' if math.isnan(eta) else format_duration(eta)}"
        )
        if self._bar is not None:
            self._bar.write(line)
        else:
            logger.info(line)

    def _write(self, record: Mapping[str, Any]) -> None:
        """Send ``record`` to this rank's JSONL file and backends (none on non-writing ranks)."""
        if self._jsonl is not None:
            self._jsonl.log(record)
        if self._backends:
            scalars = scalar_metrics(record, skipped=self._skipped)
            for backend in self._backends:
                backend.log(record["step"], scalars)

    def close(self) -> None:
        """Close the progress bar and the backends (safe to call twice)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        backends, self._backends = self._backends, []
        for backend in backends:
            backend.close()
