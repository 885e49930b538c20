"""Logging backends: TensorBoard event files and W&B runs hold what metrics.jsonl holds,
including the extra metrics a loop logs; every rank writes on request; missing packages stop
the run with one line."""

from __future__ import annotations

import json
import struct
import sys
import types
from pathlib import Path

import pytest
import torch
from forked_cli import run_command
from titan.train import metrics as metrics_mod
from titan.train.metrics import MetricsConfig, MetricsLogger, scalar_metrics


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def _logger(tmp_path: Path, *, rank: int = 0, run_config=None, **cfg) -> MetricsLogger:
    return MetricsLogger(
        MetricsConfig(log_freq=1, enable_progress_bar=False, **cfg),
        dump_folder=tmp_path,
        total_steps=3,
        flops_per_token=1e6,
        peak_flops=1e12,
        device=torch.device("cpu"),
        is_rank0=rank == 0,
        rank=rank,
        run_config=run_config,
        clock=FakeClock(),
    )


def _run_three_steps(log: MetricsLogger) -> list[dict]:
    """Three logged steps whose extras have every kind of value a loop may log."""
    log.start(0)
    records = []
    for step in (1, 2, 3):
        log.record_tokens(100 * step)
        log.clock.now += 0.5 * step
        extra = {
            "reward_mean": 0.25 * step,                       # an RL loop's float
            "epoch": step // 2,                               # an int
            "expert_load": {"layer0": torch.tensor(0.1 * step), "layer1": 1.0 - 0.1 * step},
            "note": f"step {step}",                           # not a number: JSONL only
        }
        records.append(log.log(step=step, loss=3.0 - 0.5 * step, grad_norm=1.0 / step, lr=1e-3 * step, extra=extra))
    log.close()
    return records


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _expected_series(rows: list[dict]) -> dict[str, dict[int, float]]:
    """key -> {step: value} of the numeric fields of JSONL rows, computed here by hand."""
    series: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key in ("step", "note") or value is None:
                continue
            if isinstance(value, dict):
                for sub, inner in value.items():
                    series.setdefault(f"{key}/{sub}", {})[row["step"]] = float(inner)
            else:
                series.setdefault(key, {})[row["step"]] = float(value)
    return series


def _tensorboard_series(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the event files in ``log_dir``, read with TensorBoard's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _assert_same_series(got: dict, expected: dict) -> None:
    assert set(got) == set(expected)
    for key, by_step in expected.items():
        assert set(got[key]) == set(by_step), key
        for step, value in by_step.items():
            # TensorBoard stores float32.
            assert got[key][step] == pytest.approx(value, rel=1e-6, abs=1e-12), (key, step)


def test_tensorboard_events_equal_the_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    _run_three_steps(_logger(tmp_path, enable_tensorboard=True))
    rows = _jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["note"] == "step 1" and rows[2]["expert_load"]["layer0"] == pytest.approx(0.3)
    expected = _expected_series(rows)
    # The extras are there, next to the standard keys.
    assert {"loss", "lr", "tokens_per_second", "mfu", "reward_mean", "epoch", "expert_load/layer0"} <= set(expected)
    _assert_same_series(_tensorboard_series(tmp_path / "tb" / "rank0"), expected)


def test_a_resumed_run_replaces_the_rolled_back_steps_in_tensorboard(tmp_path):
    """An attempt logged steps 1-3 and died; its relaunch resumed from step 1's checkpoint and
    logged steps 2-3 again: TensorBoard shows the relaunch's values for them, once."""
    pytest.importorskip("tensorboard")
    _run_three_steps(_logger(tmp_path, enable_tensorboard=True))
    relaunch = _logger(tmp_path, enable_tensorboard=True)
    relaunch.start(1)
    for step in (2, 3):
        relaunch.record_tokens(10)
        relaunch.clock.now += 1.0
        relaunch.log(step=step, loss=10.0 * step, grad_norm=1.0, lr=1e-3)
    relaunch.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "rank0"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 2.5), (2, 20.0), (3, 30.0)]


def _log_one_step(log: MetricsLogger, step: int, loss: float, **start) -> Path | None:
    """Start ``log`` at ``step - 1`` (``start``: its keywords), log ``step`` and close; returns
    the folder `start` set an earlier run's records aside in."""
    aside = log.start(step - 1, **start)
    log.record_tokens(10)
    log.clock.now += 1.0
    log.log(step=step, loss=loss, grad_norm=1.0, lr=1e-3)
    log.close()
    return aside


def test_a_fresh_start_sets_an_earlier_runs_records_aside(tmp_path, caplog):
    """A run that starts afresh in a folder an earlier run logged to (no checkpoint to
    continue) moves that run's JSONL file and TensorBoard events to earlier_runs/<n>/ instead
    of interleaving its steps with them; each is kept whole, and TensorBoard reads both."""
    pytest.importorskip("tensorboard")
    first = _run_three_steps(_logger(tmp_path, enable_tensorboard=True))
    with caplog.at_level("INFO", logger="titan"):
        aside = _log_one_step(_logger(tmp_path, enable_tensorboard=True), 1, 7.0)
    assert aside == tmp_path / "earlier_runs" / "1"
    assert f"{tmp_path} held an earlier run's metrics (steps 1-3) and this run starts afresh: moved them to {aside}" \
        in caplog.text
    assert [(r["step"], r["loss"]) for r in _jsonl(tmp_path / "metrics.jsonl")] == [(1, 7.0)]
    assert [r["loss"] for r in _jsonl(aside / "metrics.jsonl")] == [r["loss"] for r in first]
    assert _tensorboard_series(tmp_path / "tb" / "rank0")["loss"] == {1: 7.0}
    _assert_same_series(_tensorboard_series(aside / "tb" / "rank0"), _expected_series(_jsonl(aside / "metrics.jsonl")))
    # The next fresh start takes the next folder; the one before is left as it was.
    assert _log_one_step(_logger(tmp_path, enable_tensorboard=True), 1, 8.0) == tmp_path / "earlier_runs" / "2"
    assert [r["loss"] for r in _jsonl(tmp_path / "earlier_runs" / "2" / "metrics.jsonl")] == [7.0]
    assert [r["loss"] for r in _jsonl(tmp_path / "earlier_runs" / "1" / "metrics.jsonl")] == [r["loss"] for r in first]


def test_a_run_that_continues_appends_and_an_empty_folder_sets_nothing_aside(tmp_path):
    """A resumed run (step > 0, or step 0 with progress: ``continues``) appends to the
    earlier records, as before; a first run has nothing to set aside."""
    assert _log_one_step(_logger(tmp_path), 1, 1.0) is None
    assert _log_one_step(_logger(tmp_path), 2, 2.0) is None
    assert _log_one_step(_logger(tmp_path), 1, 3.0, continues=True) is None
    assert [r["loss"] for r in _jsonl(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 3.0]
    assert not (tmp_path / "earlier_runs").exists()


def test_every_writing_rank_sets_its_own_records_aside_in_the_same_folder(tmp_path):
    """Under --metrics.save_for_all_ranks each rank moves its own file, into the same
    earlier_runs/<n> as rank 0; a rank that writes nothing moves nothing."""
    for rank in (0, 1):
        _log_one_step(_logger(tmp_path, rank=rank, save_for_all_ranks=True), 1, 1.0 + rank)
    assert _log_one_step(_logger(tmp_path, rank=2), 1, 5.0) is None
    for rank, name in ((0, "metrics.jsonl"), (1, "metrics_rank1.jsonl")):
        aside = _log_one_step(_logger(tmp_path, rank=rank, save_for_all_ranks=True), 1, 10.0 + rank)
        assert aside == tmp_path / "earlier_runs" / "1"
        assert [r["loss"] for r in _jsonl(aside / name)] == [1.0 + rank]
        assert [r["loss"] for r in _jsonl(tmp_path / name)] == [10.0 + rank]


def test_the_logged_step_range_reads_the_ends_of_a_file(tmp_path):
    """First and last step, the last read from the file's end past a cut last line."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "pad": "x" * 100}) + "\n" for s in range(5, 2000, 5)) + '{"step": 20')
    assert metrics_mod.logged_step_range(path) == (5, 1995)
    path.write_text("not json\n")
    assert metrics_mod.logged_step_range(path) is None


# ---- W&B: a real offline run, read back from its .wandb file ------------------------------

def _wandb_records(run_file: Path) -> list:
    """The protobuf records of a .wandb file: a 7-byte header, then LevelDB-style log blocks
    of 32 KiB whose chunks carry (crc32c, length, type) headers."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_run(tmp_path: Path) -> tuple[dict[str, dict[int, float]], dict]:
    """Series and config of the single offline W&B run under ``tmp_path``."""
    import wandb

    wandb.teardown()  # the W&B service writes the run file asynchronously: stop it to flush
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    series: dict[str, dict[int, float]] = {}
    config = {}
    for record in _wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = items.pop("_step")
            for key, value in items.items():
                if not key.startswith("_"):
                    series.setdefault(key, {})[step] = value
        elif kind in ("run", "config"):
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates})
    return series, config


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, with every folder it writes inside tmp_path."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    return tmp_path / "run"


@pytest.mark.slow
def test_wandb_offline_run_and_tensorboard_equal_the_jsonl(offline_wandb):
    """Every backend gets the same numbers, extras included; W&B also gets the run config."""
    pytest.importorskip("tensorboard")
    dump = offline_wandb
    _run_three_steps(_logger(dump, enable_tensorboard=True, enable_wandb=True,
                             run_config={"optimizer": {"lr": 1e-3}, "training": {"steps": 3}}))
    expected = _expected_series(_jsonl(dump / "metrics.jsonl"))
    series, config = _wandb_run(dump)
    _assert_same_series(series, expected)
    _assert_same_series(_tensorboard_series(dump / "tb" / "rank0"), expected)
    assert config["optimizer"] == {"lr": 1e-3} and config["training"] == {"steps": 3}


def _log_steps(log: MetricsLogger, start: int, steps) -> None:
    log.start(start)
    for step in steps:
        log.record_tokens(100)
        log.clock.now += 0.5
        log.log(step=step, loss=10.0 - step, grad_norm=1.0, lr=1e-3)
    log.close()


@pytest.mark.slow
def test_a_resumed_run_continues_its_wandb_run_and_a_fresh_start_opens_another(offline_wandb, caplog):
    """The relaunch that resumes from step 3 logs into the W&B run of steps 1-3 (same id, the
    offline folders `wandb sync` merges); one that starts over gets a new run; one resumed from
    before the run's last logged step says that W&B keeps the first values."""
    import wandb

    dump = offline_wandb
    _log_steps(_logger(dump, enable_wandb=True), 0, (1, 2, 3))
    first = json.loads((dump / "wandb-run.json").read_text())
    assert first["last_step"] == 3
    _log_steps(_logger(dump, enable_wandb=True), 3, (4, 5))
    wandb.teardown()
    runs = [_wandb_records(next(run.glob("run-*.wandb"))) for run in sorted((dump / "wandb").glob("offline-run-*"))]
    assert len(runs) == 2
    assert [[r.run.run_id for r in records if r.WhichOneof("record_type") == "run"] for records in runs] == \
        [[first["id"]], [first["id"]]]
    steps = [json.loads(i.value_json) for r in runs[1] if r.WhichOneof("record_type") == "history"
             for i in r.history.item if (i.key or "/".join(i.nested_key)) == "_step"]
    assert steps == [4, 5]
    assert json.loads((dump / "wandb-run.json").read_text()) == {"id": first["id"], "last_step": 5}
    with caplog.at_level("WARNING", logger="titan"):
        _log_steps(_logger(dump, enable_wandb=True), 4, (5,))
    assert "logged up to step 5, this run resumes from step 4: W&B keeps the first values of steps 5-5" in caplog.text
    _log_steps(_logger(dump, enable_wandb=True), 0, (1,))
    assert json.loads((dump / "wandb-run.json").read_text())["id"] != first["id"]


# ---- ranks ---------------------------------------------------------------------------------

def test_only_rank0_writes_by_default(tmp_path):
    pytest.importorskip("tensorboard")
    _run_three_steps(_logger(tmp_path, rank=1, enable_tensorboard=True))
    assert list(tmp_path.iterdir()) == []


def test_every_rank_writes_its_own_files_on_request(tmp_path):
    pytest.importorskip("tensorboard")
    for rank in (0, 1):
        _run_three_steps(_logger(tmp_path, rank=rank, enable_tensorboard=True, save_for_all_ranks=True))
    for rank, name in ((0, "metrics.jsonl"), (1, "metrics_rank1.jsonl")):
        expected = _expected_series(_jsonl(tmp_path / name))
        _assert_same_series(_tensorboard_series(tmp_path / "tb" / f"rank{rank}"), expected)


class FakeWandb(types.ModuleType):
    """A stand-in ``wandb`` module that records what the logger asks of it."""

    def __init__(self, fail: Exception | None = None) -> None:
        super().__init__("wandb")
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = 0
        self.fail = fail

    def init(self, **kwargs):
        if self.fail is not None:
            raise self.fail
        self.inits.append(kwargs)
        return types.SimpleNamespace(
            log=lambda data, step: self.logged.append((data, step)),
            finish=lambda: setattr(self, "finished", self.finished + 1),
        )


def test_wandb_runs_per_rank_are_named_and_grouped(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(metrics_mod.importlib.util, "find_spec", lambda name: object())
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    dump = tmp_path / "my_run"
    for rank in (0, 1):
        _run_three_steps(_logger(dump, rank=rank, enable_wandb=True, save_for_all_ranks=True, wandb_mode="offline"))
    assert [i["name"] for i in fake.inits] == ["my_run-rank0", "my_run-rank1"]
    assert {i["group"] for i in fake.inits} == {"my_run"}
    assert {i["mode"] for i in fake.inits} == {"offline"} and {i["project"] for i in fake.inits} == {"titan"}
    assert [step for _, step in fake.logged] == [1, 2, 3, 1, 2, 3]
    assert fake.finished == 2
    assert "note" not in fake.logged[0][0] and fake.logged[0][0]["reward_mean"] == 0.25


def test_a_wandb_run_that_cannot_start_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail=RuntimeError("api_key not configured (no-tty)\ndetails")))
    monkeypatch.setattr(metrics_mod.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ValueError, match=r"--metrics.enable_wandb: .*api_key not configured.*offline"):
        _logger(tmp_path, enable_wandb=True)


@pytest.mark.parametrize("flag,package", [("enable_tensorboard", "tensorboard"), ("enable_wandb", "wandb")])
def test_a_missing_package_names_the_flag_and_the_extra(flag, package, monkeypatch):
    real = metrics_mod.importlib.util.find_spec
    monkeypatch.setattr(metrics_mod.importlib.util, "find_spec", lambda name: None if name == package else real(name))
    with pytest.raises(ValueError, match=rf"--metrics.{flag} needs the {package} package: pip install 'titan-train\[{package}\]'"):
        MetricsConfig(**{flag: True})


def test_scalar_metrics_keeps_numbers_and_warns_once_per_other_key(caplog):
    import numpy as np

    skipped: set[str] = set()
    record = {"step": 4, "loss": 1.5, "mfu": None, "ok": True, "n": np.int64(3), "t": torch.tensor(2.0),
              "load": {"a": 1, "b": {"c": 0.5}}, "name": "x", "hist": [1, 2]}
    with caplog.at_level("WARNING", logger="titan"):
        assert scalar_metrics(record, skipped=skipped) == {
            "loss": 1.5, "ok": 1.0, "n": 3.0, "t": 2.0, "load/a": 1.0, "load/b/c": 0.5}
        scalar_metrics(record, skipped=skipped)
    assert skipped == {"name", "hist"}
    assert len([r for r in caplog.records if "not a number" in r.message]) == 2


def test_jsonl_writes_tensors_and_numpy_scalars_as_numbers(tmp_path):
    import numpy as np

    log = _logger(tmp_path)
    log.start(0)
    log.record_tokens(1)
    log.clock.now += 1
    log.log(step=1, loss=1.0, grad_norm=1.0, lr=1.0,
            extra={"t": torch.tensor(0.5), "f": np.float32(0.25), "obj": Path("a")})
    row = _jsonl(tmp_path / "metrics.jsonl")[0]
    assert (row["t"], row["f"], row["obj"]) == (0.5, 0.25, "a")


@pytest.mark.slow
def test_titan_train_flags_write_tensorboard_events_equal_to_the_jsonl(tmp_path):
    """Through the command line: a tiny real run with --metrics.enable_tensorboard."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("titan.recipes")
    import os

    cmd = [sys.executable, "-m", "titan.recipes.cli", "train", "--config", "llama3_debug_synthetic",
           "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32", "--training.local_batch_size", "2",
           "--training.steps", "4", "--metrics.log_freq", "2", "--metrics.no_enable_progress_bar",
           "--metrics.enable_tensorboard", "--job.dump_folder", str(tmp_path)]
    done = run_command(cmd, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 4]
    expected = _expected_series(rows)
    assert {"loss", "lr", "tokens_per_second", "memory_peak_gib", "tokens_seen"} <= set(expected)
    _assert_same_series(_tensorboard_series(tmp_path / "tb" / "rank0"), expected)


def test_a_record_of_ones_own_reaches_every_backend(tmp_path):
    """`log_record` (evaluations, say): the JSONL line and the TensorBoard scalars of any
    record with a step; a record without one is refused."""
    pytest.importorskip("tensorboard")
    metrics = _logger(tmp_path, enable_tensorboard=True)
    metrics.log_record({"step": 5, "eval_reward": 0.25, "eval_exact_match": 0.125})
    with pytest.raises(ValueError, match="needs a 'step'"):
        metrics.log_record({"eval_reward": 1.0})
    metrics.close()
    rows = _jsonl(tmp_path / "metrics.jsonl")
    assert rows == [{"step": 5, "eval_reward": 0.25, "eval_exact_match": 0.125}]
    _assert_same_series(_tensorboard_series(tmp_path / "tb" / "rank0"), _expected_series(rows))
