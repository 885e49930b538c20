"""``titan plot``: the plotted data equals metrics.jsonl, and valid PNGs are written, one per
metric, several runs overlaid."""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
from titan.train.plot import (
    DEFAULT_KEYS,
    choose_keys,
    main,
    plot_runs,
    read_series,
    run_labels,
    smooth,
)

# matplotlib keeps its font cache in the user's folders unless told otherwise; the suite must not.
os.environ.setdefault("MPLCONFIGDIR", tempfile.mkdtemp(prefix="titan-test-matplotlib-"))
pytest.importorskip("matplotlib")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _fake_run(folder: Path, *, steps: range, lr: float, extra: bool = False) -> list[dict]:
    """A metrics.jsonl like a real run's: decaying loss, throughput, memory, lr (and extras)."""
    rows = []
    for step in steps:
        row = {"step": step, "loss": 5.0 * lr * 1e3 / step, "grad_norm": 1.0, "lr": lr * min(1.0, step / 4),
               "tokens_per_second": 1000.0 + step, "tflops": 0.1, "mfu": None, "memory_peak_gib": 0.5 + step / 100,
               "device_tokens": 512, "elapsed_s": 0.5}
        if extra:
            row.update({"reward_mean": step / 10, "expert_load": {"e0": 0.25, "e1": 0.75}, "note": "text"})
        rows.append(row)
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (checks the signature too)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_series_equal_the_jsonl(tmp_path):
    rows = _fake_run(tmp_path / "a", steps=range(1, 11), lr=1e-3, extra=True)
    series = read_series(tmp_path / "a")
    for key in ("loss", "lr", "tokens_per_second", "memory_peak_gib", "reward_mean"):
        assert series[key] == ([r["step"] for r in rows], [r[key] for r in rows])
    assert series["expert_load/e1"][1] == [0.75] * 10
    assert "mfu" not in series and "note" not in series  # null and text are not series


def test_a_resumed_run_keeps_the_later_record_of_each_step(tmp_path):
    _fake_run(tmp_path / "a", steps=range(1, 7), lr=1e-3)
    path = tmp_path / "a" / "metrics.jsonl"
    # Resumed from step 4: steps 5-6 logged again, then 7-8; the line cut by the kill is skipped.
    with path.open("a") as f:
        for step in (5, 6, 7, 8):
            f.write(json.dumps({"step": step, "loss": 100.0 + step}) + "\n")
        f.write('{"step": 9, "lo')
    steps, values = read_series(tmp_path / "a")["loss"]
    assert steps == list(range(1, 9))
    assert values[4:] == [105.0, 106.0, 107.0, 108.0]


def test_two_runs_give_one_png_per_default_metric_with_both_runs(tmp_path):
    _fake_run(tmp_path / "lr_1e-3", steps=range(1, 41), lr=1e-3)
    _fake_run(tmp_path / "lr_3e-4", steps=range(1, 21), lr=3e-4)
    runs = [tmp_path / "lr_1e-3", tmp_path / "lr_3e-4"]
    paths = plot_runs(runs, out=tmp_path / "plots")
    assert [p.name for p in paths] == [f"{k}.png" for k in DEFAULT_KEYS]
    for path in paths:
        assert _png_size(path) == (700, 400)
        assert path.stat().st_size > 10_000  # axes, two lines and a legend, not a blank canvas
    assert run_labels(runs) == ["lr_1e-3", "lr_3e-4"]


def test_an_earlier_run_a_folder_set_aside_is_labelled_by_its_folder(tmp_path):
    _fake_run(tmp_path / "run", steps=range(1, 4), lr=1e-3)
    _fake_run(tmp_path / "run" / "earlier_runs" / "2", steps=range(1, 4), lr=1e-3)
    assert run_labels([tmp_path / "run", tmp_path / "run" / "earlier_runs" / "2"]) == ["run", "run earlier run 2"]


def test_the_figure_holds_each_run_as_a_labelled_line(tmp_path, monkeypatch):
    """What is drawn is the data read: capture the figure before it is saved."""
    from matplotlib.figure import Figure

    a = _fake_run(tmp_path / "a", steps=range(1, 6), lr=1e-3)
    b = _fake_run(tmp_path / "b", steps=range(1, 4), lr=2e-3)
    figures = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kw: (figures.append(self), real_savefig(self, *args, **kw)))
    plot_runs([tmp_path / "a", tmp_path / "b"], out=tmp_path / "p", keys=["loss"])
    (ax,) = figures[0].axes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert lines == {"a": ([r["step"] for r in a], [r["loss"] for r in a]),
                     "b": ([r["step"] for r in b], [r["loss"] for r in b])}
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"]


def test_keys_on_request_and_all(tmp_path):
    _fake_run(tmp_path / "a", steps=range(1, 5), lr=1e-3, extra=True)
    series = [read_series(tmp_path / "a")]
    assert choose_keys(series, ["reward_mean", "expert_load/e0"]) == ["reward_mean", "expert_load/e0"]
    assert "expert_load/e1" in choose_keys(series, ["all"])
    paths = plot_runs([tmp_path / "a"], keys=["expert_load/e0"])
    assert paths == [tmp_path / "a" / "plots" / "expert_load_e0.png"]  # one run: plots go beside it
    with pytest.raises(ValueError, match=r"--keys 'rewrd_mean' is not a logged series .*did you mean reward_mean"):
        choose_keys(series, ["rewrd_mean"])


def test_a_folder_without_metrics_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in"):
        read_series(tmp_path)


def test_main_prints_the_written_paths(tmp_path, capsys):
    _fake_run(tmp_path / "a", steps=range(1, 5), lr=1e-3)
    assert main([str(tmp_path / "a"), "--out", str(tmp_path / "o"), "--keys", "loss,grad_norm"]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "o" / "loss.png"), str(tmp_path / "o" / "grad_norm.png")]


def test_the_titan_command_has_plot(tmp_path, capsys):
    cli = pytest.importorskip("titan.recipes.cli")
    _fake_run(tmp_path / "a", steps=range(1, 5), lr=1e-3)
    assert cli.main(["plot", str(tmp_path / "a"), "--keys", "loss"]) == 0
    assert (tmp_path / "a" / "plots" / "loss.png").is_file()
    assert cli.main(["plot", str(tmp_path / "missing")]) == 2
    assert "titan plot: error: no metrics.jsonl in" in capsys.readouterr().err


def test_smoothing_is_a_moving_average_over_the_raw_line(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    assert smooth([1.0, 3.0, 3.0], 0.5) == [1.0, 2.0, 2.5]  # by hand
    assert smooth([1.0, 3.0], 0.0) == [1.0, 3.0]
    rows = _fake_run(tmp_path / "a", steps=range(1, 6), lr=1e-3)
    figures = []
    real_savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kw: (figures.append(self), real_savefig(self, *args, **kw)))
    main([str(tmp_path / "a"), "--keys", "loss", "--smooth", "0.5"])
    raw, smoothed = figures[0].axes[0].get_lines()
    assert list(raw.get_ydata()) == [r["loss"] for r in rows]
    assert list(smoothed.get_ydata()) == smooth([r["loss"] for r in rows], 0.5)
    assert smoothed.get_label() == "a" and raw.get_color() == smoothed.get_color()
    with pytest.raises(ValueError, match="--smooth must be in"):
        plot_runs([tmp_path / "a"], smoothing=1.0)
