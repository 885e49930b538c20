"""Metrics: MFU from device peaks, the JSONL log, durations."""

import json
import os

import pytest
import torch
from titan.train import device_peak
from titan.train.metrics import METRIC_KEYS, MetricsConfig, MetricsLogger, format_duration


def test_gpu_table_matches_specific_names_first():
    assert device_peak.gpu_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert device_peak.gpu_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak.gpu_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device_peak.gpu_peak_flops("Some Future GPU") is None


def test_unknown_device_reports_no_peak():
    assert device_peak.device_peak_flops(torch.device("meta")) is None


def test_cpu_peak_is_measured_once_then_cached(tmp_path, monkeypatch):
    calls = []

    def fake_measure(*args, **kwargs):
        calls.append(1)
        return 123e9

    monkeypatch.delenv("TITAN_CPU_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(device_peak, "measure_cpu_peak_flops", fake_measure)
    cache = tmp_path / "peak.json"
    assert device_peak.cpu_peak_flops(cache) == 123e9
    assert device_peak.cpu_peak_flops(cache) == 123e9
    assert len(calls) == 1
    assert list(json.loads(cache.read_text()).values()) == [123e9]


def test_cpu_peak_is_measured_and_cached_per_compute_dtype(tmp_path, monkeypatch):
    """A bf16 run's MFU is against the bf16 GEMM peak (AMX CPUs multiply bf16 several times
    faster than float32), cached beside the float32 one under its own key."""
    measured = []

    def fake_measure(trials=3, dtype=torch.float32):
        measured.append(dtype)
        return {torch.float32: 4e11, torch.bfloat16: 2.7e12}[dtype]

    monkeypatch.delenv("TITAN_CPU_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(device_peak, "measure_cpu_peak_flops", fake_measure)
    cache = tmp_path / "peak.json"
    assert device_peak.cpu_peak_flops(cache, dtype=torch.bfloat16) == 2.7e12
    assert device_peak.cpu_peak_flops(cache) == 4e11
    assert device_peak.cpu_peak_flops(cache, dtype=torch.bfloat16) == 2.7e12
    assert measured == [torch.bfloat16, torch.float32]
    cached = json.loads(cache.read_text())
    assert cached == {device_peak._cpu_cache_key(): 4e11, device_peak._cpu_cache_key(torch.bfloat16): 2.7e12}
    assert device_peak._cpu_cache_key(torch.bfloat16).endswith("|bfloat16")


def test_gemm_measurement_runs_in_the_asked_dtype(monkeypatch):
    dtypes = []
    real_mm = torch.mm

    def spy(a, b, **kwargs):
        dtypes.append(a.dtype)
        return real_mm(a, b, **kwargs)

    monkeypatch.setattr(device_peak.torch, "mm", spy)
    assert device_peak.measure_cpu_gemm_flops(size=64, repeats=2, warmup_s=0.0, dtype=torch.bfloat16) > 0
    assert set(dtypes) == {torch.bfloat16}


def test_pinned_cpu_peak_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CPU_PEAK_FLOPS", "5e11")
    assert device_peak.cpu_peak_flops(tmp_path / "unused.json") == 5e11
    assert not (tmp_path / "unused.json").exists()


def test_real_cpu_gemm_measurement_is_plausible():
    flops = device_peak.measure_cpu_gemm_flops(size=256, repeats=2, warmup_s=0.01)
    assert 1e8 < flops < 1e14


def test_peak_measurement_keeps_the_best_trial(monkeypatch):
    """A trial slowed by other load must not lower the peak: the best one wins."""
    readings = iter([1e9, 5e9, 2e9] * 3)
    monkeypatch.setattr(device_peak, "measure_cpu_gemm_flops", lambda size, repeats, dtype: next(readings))
    monkeypatch.setattr(device_peak.time, "sleep", lambda s: None)
    assert device_peak.measure_cpu_peak_flops(trials=3) == 5e9


def test_cache_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path / "c"))
    assert device_peak.default_cache_path() == tmp_path / "c" / "cpu_peak_flops.json"
    monkeypatch.delenv("TITAN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert device_peak.default_cache_path() == tmp_path / "xdg" / "titan" / "cpu_peak_flops.json"


def test_the_suite_never_uses_the_home_cache():
    """The root conftest points the cache at a temporary folder and pins the peak."""
    from pathlib import Path

    home_cache = Path.home() / ".cache" / "titan"
    assert not device_peak.default_cache_path().is_relative_to(home_cache)
    assert float(os.environ["TITAN_CPU_PEAK_FLOPS"]) > 0


class FakeClock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _logger(tmp_path, peak, clock=None, device="cpu", compute_dtype=torch.float32):
    return MetricsLogger(
        MetricsConfig(log_freq=5),
        dump_folder=tmp_path,
        total_steps=20,
        flops_per_token=1e6,
        peak_flops=peak,
        device=torch.device(device),
        is_rank0=True,
        compute_dtype=compute_dtype,
        **({"clock": clock} if clock else {}),
    )


def test_tokens_per_second_is_tokens_over_elapsed_with_a_fixed_clock(tmp_path):
    clock = FakeClock()
    log = _logger(tmp_path, peak=1e12, clock=clock)
    log.start(0)
    for _ in range(4):
        log.record_tokens(250)
    clock.now += 2.5
    rec = log.log(step=4, loss=1.0, grad_norm=1.0, lr=1.0)
    assert rec["device_tokens"] == 1000 and rec["elapsed_s"] == 2.5
    assert rec["tokens_per_second"] == 1000 / 2.5
    # The next interval counts from this log only.
    log.record_tokens(300)
    clock.now += 0.5
    rec = log.log(step=5, loss=1.0, grad_norm=1.0, lr=1.0)
    assert rec["device_tokens"] == 300 and rec["tokens_per_second"] == 300 / 0.5


def test_data_wait_is_the_interval_sum_and_its_share_of_the_time(tmp_path):
    clock = FakeClock()
    log = _logger(tmp_path, peak=1e12, clock=clock)
    log.start(0)
    for wait in (0.25, 0.5, 0.25):
        log.record_tokens(100, data_wait_s=wait)
    clock.now += 4.0
    rec = log.log(step=3, loss=1.0, grad_norm=1.0, lr=1.0)
    assert rec["data_wait_s"] == 1.0 and rec["data_wait_pct"] == 25.0
    clock.now += 1.0
    rec = log.log(step=4, loss=1.0, grad_norm=1.0, lr=1.0)  # a new interval without waits
    assert rec["data_wait_s"] == 0.0 and rec["data_wait_pct"] == 0.0


def test_data_wait_is_none_when_the_loop_does_not_measure_it(tmp_path):
    clock = FakeClock()
    log = _logger(tmp_path, peak=1e12, clock=clock)
    log.start(0)
    log.record_tokens(100)
    clock.now += 1.0
    rec = log.log(step=1, loss=1.0, grad_norm=1.0, lr=1.0)
    assert rec["data_wait_s"] is None and rec["data_wait_pct"] is None


def test_mfu_from_a_known_peak_equals_the_hand_computation(tmp_path):
    clock = FakeClock()
    log = _logger(tmp_path, peak=2e12, clock=clock)
    log.start(0)
    log.record_tokens(4000)
    clock.now += 4.0
    rec = log.log(step=1, loss=1.0, grad_norm=1.0, lr=1.0)
    # 4000 tokens / 4 s = 1000 tok/s; x 1e6 FLOP/token = 1e9 FLOP/s; / 2e12 = 0.05 %.
    assert rec["tflops"] == pytest.approx(1e-3)
    assert rec["mfu"] == pytest.approx(0.05)


def _write_cached_peak(cache_dir, flops):
    path = cache_dir / "cpu_peak_flops.json"
    path.write_text(json.dumps({device_peak._cpu_cache_key(): flops}))
    return path


def test_mfu_never_exceeds_100_with_a_low_cached_peak(tmp_path, monkeypatch):
    """A peak cached too low (measured under load) is raised by observed throughput."""
    monkeypatch.delenv("TITAN_CPU_PEAK_FLOPS", raising=False)
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path))
    path = _write_cached_peak(tmp_path, 1e8)
    monkeypatch.setattr(device_peak, "measure_cpu_peak_flops", lambda **_: pytest.fail("re-measured"))
    peak = device_peak.device_peak_flops(torch.device("cpu"))
    assert peak == 1e8
    clock = FakeClock()
    log = _logger(tmp_path, peak=peak, clock=clock)
    log.start(0)
    log.record_tokens(1000)
    clock.now += 1.0  # 1000 tok/s x 1e6 FLOP/token = 1e9 FLOP/s, ten times the cached peak
    rec = log.log(step=1, loss=1.0, grad_norm=1.0, lr=1.0)
    assert rec["mfu"] == pytest.approx(100.0)
    assert list(json.loads(path.read_text()).values()) == [pytest.approx(1e9)]
    assert device_peak.cpu_peak_flops() == pytest.approx(1e9)  # the next run reads the fix
    # Slower steps afterwards read below 100 % against the corrected peak.
    log.record_tokens(500)
    clock.now += 1.0
    assert log.log(step=2, loss=1.0, grad_norm=1.0, lr=1.0)["mfu"] == pytest.approx(50.0)


def test_a_bf16_run_corrects_only_the_bf16_peak(tmp_path, monkeypatch):
    """Throughput computed in bf16 says nothing about the float32 peak: it must not raise it."""
    monkeypatch.delenv("TITAN_CPU_PEAK_FLOPS", raising=False)
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path))
    path = tmp_path / "cpu_peak_flops.json"
    fp32_key, bf16_key = device_peak._cpu_cache_key(), device_peak._cpu_cache_key(torch.bfloat16)
    path.write_text(json.dumps({fp32_key: 1e8, bf16_key: 1e8}))
    clock = FakeClock()
    log = _logger(tmp_path, peak=1e8, clock=clock, compute_dtype=torch.bfloat16)
    log.start(0)
    log.record_tokens(1000)
    clock.now += 1.0  # 1e9 FLOP/s
    assert log.log(step=1, loss=1.0, grad_norm=1.0, lr=1.0)["mfu"] == pytest.approx(100.0)
    assert json.loads(path.read_text()) == {fp32_key: 1e8, bf16_key: pytest.approx(1e9)}


def test_pinned_or_missing_peaks_are_not_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TITAN_CPU_PEAK_FLOPS", "1e8")
    assert not device_peak.raise_cpu_peak_flops(1e9)
    monkeypatch.delenv("TITAN_CPU_PEAK_FLOPS")
    # No cached measurement: the next run measures rather than trusting one run's throughput.
    assert not device_peak.raise_cpu_peak_flops(1e9)
    assert not (tmp_path / "cpu_peak_flops.json").exists()
    _write_cached_peak(tmp_path, 2e9)
    assert not device_peak.raise_cpu_peak_flops(1e9)  # a higher peak is kept


def test_mfu_is_capped_for_a_table_peak_too(tmp_path):
    clock = FakeClock()
    log = _logger(tmp_path, peak=1e6, clock=clock, device="meta")  # no cache for non-CPU peaks
    log.start(0)
    log.record_tokens(10)
    clock.now += 1.0
    assert log.log(step=1, loss=1.0, grad_norm=1.0, lr=1.0)["mfu"] == pytest.approx(100.0)
    assert not (tmp_path / "cpu_peak_flops.json").exists()


def test_jsonl_holds_every_key_and_mfu_follows_peak(tmp_path):
    clock = FakeClock()
    log = _logger(tmp_path, peak=1e12, clock=clock)
    log.start(0)
    log.record_tokens(1000)
    clock.now += 1.0
    rec = log.log(step=1, loss=2.0, grad_norm=0.5, lr=1e-3)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and set(METRIC_KEYS) <= set(rows[0])
    assert rows[0]["loss"] == 2.0 and rows[0]["step"] == 1
    assert rec["tflops"] == pytest.approx(rec["tokens_per_second"] * 1e6 / 1e12)
    assert rec["mfu"] == pytest.approx(100 * rec["tflops"] * 1e12 / 1e12)
    assert rec["memory_peak_gib"] > 0


def test_unknown_peak_logs_null_mfu(tmp_path):
    log = _logger(tmp_path, peak=None)
    log.start(0)
    log.record_tokens(10)
    log.log(step=1, loss=1.0, grad_norm=1.0, lr=1.0)
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["mfu"] is None


def test_log_steps():
    log = MetricsLogger(
        MetricsConfig(log_freq=5), dump_folder=".", total_steps=12, flops_per_token=1,
        peak_flops=None, device=torch.device("cpu"), is_rank0=False,
    )
    assert [s for s in range(1, 13) if log.should_log(s)] == [1, 5, 10, 12]


def test_format_duration():
    assert format_duration(5) == "5s"
    assert format_duration(125) == "2m05s"
    assert format_duration(3725) == "1h02m05s"
