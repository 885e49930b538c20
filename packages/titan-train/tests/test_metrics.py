"""Metrics: MFU from device peaks, the JSONL log, durations."""

import json

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


def test_pinned_cpu_peak_wins(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_CPU_PEAK_FLOPS", "5e11")
    assert device_peak.cpu_peak_flops(tmp_path / "unused.json") == 5e11
    assert not (tmp_path / "unused.json").exists()


def test_real_cpu_gemm_measurement_is_plausible():
    flops = device_peak.measure_cpu_gemm_flops(size=256, repeats=2)
    assert 1e8 < flops < 1e14


def _logger(tmp_path, peak):
    return MetricsLogger(
        MetricsConfig(log_freq=5),
        dump_folder=tmp_path,
        total_steps=20,
        flops_per_token=1e6,
        peak_flops=peak,
        device=torch.device("cpu"),
        is_rank0=True,
    )


def test_jsonl_holds_every_key_and_mfu_follows_peak(tmp_path):
    log = _logger(tmp_path, peak=1e12)
    log.start(0)
    log.record_tokens(1000)
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
