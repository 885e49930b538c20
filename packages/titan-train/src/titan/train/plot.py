"""``titan plot``: PNG pictures of the series in runs' ``metrics.jsonl``, several runs overlaid.

One PNG per metric (``<out>/<key>.png``), one line per run, labelled by the run folder's name
(``--smooth W``: a moving average over the faint raw values).
Reading and drawing are separate: :func:`read_series` is what the picture shows, so tests
check the data without looking at pixels. Needs matplotlib (``pip install 'titan-train[plot]'``).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import numbers
from collections.abc import Sequence
from pathlib import Path

DEFAULT_KEYS = ("loss", "tokens_per_second", "memory_peak_gib", "lr")
"""What ``titan plot`` draws without ``--keys``: loss, throughput, memory and learning rate."""

TITLES = {
    "loss": "training loss",
    "tokens_per_second": "throughput (tokens/s per device)",
    "memory_peak_gib": "peak memory (GiB)",
    "lr": "learning rate",
    "grad_norm": "gradient norm",
    "mfu": "MFU (%)",
    "tflops": "TFLOP/s per device",
    "validation_loss": "validation loss",
}

Series = tuple[list[int], list[float]]


def metrics_file(run: str | Path) -> Path:
    """The ``metrics.jsonl`` of ``run`` (a run folder, or the file itself)."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run}: give a run's --job.dump_folder")
    return path


def _flatten(prefix: str, value: object, out: dict[str, float]) -> None:
    """Numbers of ``value`` into ``out``; dicts (e.g. per-expert load) become ``key/subkey``."""
    if isinstance(value, dict):
        for sub, inner in value.items():
            _flatten(f"{prefix}/{sub}", inner, out)
    elif isinstance(value, numbers.Real):
        out[prefix] = float(value)


def read_series(run: str | Path) -> dict[str, Series]:
    """Every numeric series of a run: ``key -> (steps, values)``, sorted by step.

    A run resumed from a checkpoint logs its steps after the checkpoint again; the later
    record of a step wins, as it is the one the run continued from. ``None`` (e.g. ``mfu`` on
    an unknown device), strings and lists are left out; NaN and infinities are kept (a
    diverged run should show it).
    """
    by_key: dict[str, dict[int, float]] = {}
    path = metrics_file(run)
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # a run killed mid-write may leave its last line cut
                continue
            raise ValueError(f"{path}:{n} is not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{n} is not a metrics record (no integer step)")
        values: dict[str, float] = {}
        for key, value in record.items():
            if key != "step":
                _flatten(key, value, values)
        for key, value in values.items():
            by_key.setdefault(key, {})[record["step"]] = value
    return {key: (sorted(points), [points[s] for s in sorted(points)]) for key, points in by_key.items()}


def run_labels(runs: Sequence[str | Path]) -> list[str]:
    """Legend labels: each run folder's name (an earlier run a folder set aside,
    ``RUN/earlier_runs/<n>``, as ``RUN earlier run <n>``), or its full path where names repeat."""
    folders = [Path(r) if Path(r).is_dir() else Path(r).parent for r in runs]
    names = [_run_name(f.resolve()) or str(f) for f in folders]
    return [name if names.count(name) == 1 else str(folder) for name, folder in zip(names, folders, strict=True)]


def _run_name(folder: Path) -> str:
    if folder.parent.name == "earlier_runs" and folder.name.isdigit():  # MetricsLogger.set_aside_earlier_run
        return f"{folder.parent.parent.name} earlier run {folder.name}"
    return folder.name


def choose_keys(series: Sequence[dict[str, Series]], keys: Sequence[str] | None) -> list[str]:
    """The metrics to draw: ``keys`` (each must exist in some run; ``all`` means every series),
    or the default ones the runs have."""
    available = sorted(set().union(*(s.keys() for s in series)))
    if keys is None:
        return [k for k in DEFAULT_KEYS if k in available]
    if list(keys) == ["all"]:
        return available
    for key in keys:
        if key not in available:
            close = difflib.get_close_matches(key, available, n=1)
            hint = f"did you mean {close[0]}?" if close else f"logged: {', '.join(available)}"
            raise ValueError(f"--keys {key!r} is not a logged series of these runs; {hint}")
    return list(keys)


def smooth(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average: ``s[0] = v[0]``, ``s[i] = weight * s[i-1] + (1 - weight) * v[i]``
    (``weight`` 0 returns the values unchanged)."""
    out: list[float] = []
    for value in values:
        out.append(value if not out else weight * out[-1] + (1 - weight) * value)
    return out


def _new_figure():
    """A matplotlib figure drawn off screen (no pyplot: no global state, no display needed)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError(
            "titan plot needs matplotlib: pip install 'titan-train[plot]'"
        ) from None
    return Figure(figsize=(7, 4), dpi=100, layout="constrained")


def plot_key(key: str, runs: dict[str, dict[str, Series]], path: Path, *, smoothing: float = 0.0) -> Path:
    """Draw ``key`` of every run in ``runs`` (label -> series) into the PNG ``path``; with
    ``smoothing`` > 0 the raw values stay as a faint line under their moving average."""
    fig = _new_figure()
    ax = fig.add_subplot()
    for label, series in runs.items():
        if key in series:
            steps, values = series[key]
            if smoothing > 0:
                raw = ax.plot(steps, values, linewidth=0.8, alpha=0.3)[0]
                ax.plot(steps, smooth(values, smoothing), label=label, linewidth=1.6, color=raw.get_color())
            else:
                ax.plot(steps, values, label=label, linewidth=1.4, marker="." if len(steps) < 30 else None)
    ax.set_xlabel("step")
    ax.set_title(TITLES.get(key, key))
    ax.grid(True, alpha=0.3)
    finite = [v for s in runs.values() if key in s for v in s[key][1] if math.isfinite(v)]
    if key == "lr" or (finite and min(finite) > 0 and max(finite) / min(finite) > 1e3):
        ax.set_yscale("log")  # spans of several decades (warmup from ~0, decay) read on a log axis
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_runs(runs: Sequence[str | Path], *, out: str | Path | None = None,
              keys: Sequence[str] | None = None, smoothing: float = 0.0) -> list[Path]:
    """Write one PNG per metric of ``runs`` into ``out`` and return their paths.

    ``out`` defaults to ``<run>/plots`` for one run and ``./plots`` for several.
    """
    if not runs:
        raise ValueError("titan plot needs at least one RUN_DIR")
    if not 0 <= smoothing < 1:
        raise ValueError(f"--smooth must be in [0, 1), got {smoothing}")
    series = [read_series(r) for r in runs]
    chosen = choose_keys(series, keys)
    if not chosen:
        raise ValueError(f"no numeric series to plot in {', '.join(map(str, runs))}")
    if out is None:
        out = Path(runs[0]) / "plots" if len(runs) == 1 and Path(runs[0]).is_dir() else Path("plots")
    by_label = dict(zip(run_labels(runs), series, strict=True))
    return [plot_key(key, by_label, Path(out) / f"{key.replace('/', '_')}.png", smoothing=smoothing)
            for key in chosen]


def main(argv: Sequence[str]) -> int:
    """``titan plot RUN_DIR [RUN_DIR ...] [--out DIR] [--keys k1,k2]``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="titan plot",
        description="Draw the metrics of one or more runs (their metrics.jsonl) as PNGs, one per "
                    "metric, the runs overlaid.",
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="a run's --job.dump_folder (or its metrics.jsonl)")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: RUN_DIR/plots for one run, ./plots for several)")
    parser.add_argument("--keys", default=None,
                        help=f"comma-separated metrics (default: {','.join(DEFAULT_KEYS)}; 'all' for every logged series)")
    parser.add_argument("--smooth", type=float, default=0.0, metavar="W",
                        help="draw a moving average of weight W in [0, 1) over the faint raw values (e.g. 0.8)")
    args = parser.parse_args(list(argv))
    keys = [k.strip() for k in args.keys.split(",") if k.strip()] if args.keys else None
    for path in plot_runs(args.runs, out=args.out, keys=keys, smoothing=args.smooth):
        print(path)
    return 0
