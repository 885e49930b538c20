"""``--profiling.*``: the window schedule, Chrome traces a tiny training loop writes, memory
reports on CPU, CUDA snapshots where a GPU exists."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from titan.train.profiling import ProfilerConfig, StepProfiler, window_action
from torch.profiler import ProfilerAction as A


def test_windows_end_on_multiples_of_profile_freq():
    cfg = ProfilerConfig(enable_profiling=True, profile_freq=5, profiler_warmup=2, profiler_active=2)
    assert [window_action(s, cfg) for s in range(1, 11)] == [
        A.NONE, A.WARMUP, A.WARMUP, A.RECORD, A.RECORD_AND_SAVE] * 2
    every_step = ProfilerConfig(profile_freq=1, profiler_warmup=0, profiler_active=1)
    assert {window_action(s, every_step) for s in range(1, 5)} == {A.RECORD_AND_SAVE}
    short = ProfilerConfig(profile_freq=3, profiler_warmup=5, profiler_active=1)  # warmup cut to fit
    assert [window_action(s, short) for s in range(1, 4)] == [A.WARMUP, A.WARMUP, A.RECORD_AND_SAVE]


@pytest.mark.parametrize("kw,flag", [
    ({"profile_freq": 0}, "--profiling.profile_freq"),
    ({"profiler_active": 0}, "--profiling.profiler_active"),
    ({"profile_freq": 3, "profiler_active": 4}, "--profiling.profiler_active"),
    ({"save_traces_folder": ""}, "--profiling.save_traces_folder"),
])
def test_bad_values_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        ProfilerConfig(**kw)


def _train(profiler: StepProfiler, steps: int, device: str = "cpu") -> None:
    """A tiny model trained for ``steps`` steps, the profiler stepped after each."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with profiler:
        for _ in range(steps):
            loss = model(torch.randn(16, 32, device=device)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            profiler.step()


def _trace_events(path) -> list[dict]:
    trace = json.loads(path.read_text())  # valid JSON, as Perfetto reads it
    return trace["traceEvents"]


def test_a_training_loop_writes_chrome_traces_of_the_profiled_steps(tmp_path):
    cfg = ProfilerConfig(enable_profiling=True, profile_freq=3, profiler_warmup=1, profiler_active=1)
    profiler = StepProfiler(cfg, dump_folder=tmp_path, rank=0, device=torch.device("cpu"))
    _train(profiler, steps=7)  # windows end at steps 3 and 6; step 7's is cut by the end
    folders = sorted(p.name for p in (tmp_path / "profile_traces").iterdir())
    assert folders == ["iteration_3", "iteration_6"]
    for name in folders:
        events = _trace_events(tmp_path / "profile_traces" / name / "rank0_trace.json")
        names = {e.get("name", "") for e in events}
        # One recorded step (profiler_active=1), with the model's matmuls and the optimizer in it.
        assert len([n for n in names if n.startswith("ProfilerStep#")]) == 1
        assert {"aten::addmm", "aten::mm"} & names
        assert any("AdamW" in n or "Optimizer.step" in n for n in names)
        assert any(e.get("name") == "[memory]" for e in events)  # profile_memory=True
        report = (tmp_path / "profile_traces" / name / "rank0_memory.txt").read_text()
        assert report.startswith(f"step {name.split('_')[1]} rank 0: resident memory ")
        assert "CPU Mem" in report
    assert len(profiler.saved) == 4


def test_windows_stay_on_multiples_after_a_resume(tmp_path):
    cfg = ProfilerConfig(enable_profiling=True, profile_freq=4, profiler_warmup=1, profiler_active=2,
                         save_traces_folder="traces")
    profiler = StepProfiler(cfg, dump_folder=tmp_path, rank=3, device=torch.device("cpu"), start_step=5)
    _train(profiler, steps=4)  # steps 6..9: the window of steps 7-8 is saved at 8
    assert [p.name for p in (tmp_path / "traces").iterdir()] == ["iteration_8"]
    events = _trace_events(tmp_path / "traces" / "iteration_8" / "rank3_trace.json")
    assert len({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}) == 2


def test_cpu_memory_snapshot_is_a_resident_memory_report(tmp_path):
    cfg = ProfilerConfig(enable_memory_snapshot=True, profile_freq=2)
    profiler = StepProfiler(cfg, dump_folder=tmp_path, rank=0, device=torch.device("cpu"))
    _train(profiler, steps=4)
    assert sorted(p.name for p in (tmp_path / "memory_snapshot").iterdir()) == ["iteration_2", "iteration_4"]
    text = (tmp_path / "memory_snapshot" / "iteration_4" / "rank0_memory.txt").read_text()
    current, peak = (float(w) for w in text.replace("(", " ").split() if w.replace(".", "").isdigit() and "." in w)
    assert 0 < current <= peak < 1024
    assert not (tmp_path / "profile_traces").exists()


def test_disabled_profiler_writes_nothing(tmp_path):
    profiler = StepProfiler(ProfilerConfig(), dump_folder=tmp_path, rank=0, device=torch.device("cpu"))
    _train(profiler, steps=3)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_traces_hold_kernels_and_snapshots_hold_the_allocator_history(tmp_path):
    cfg = ProfilerConfig(enable_profiling=True, enable_memory_snapshot=True, profile_freq=2, profiler_warmup=1)
    profiler = StepProfiler(cfg, dump_folder=tmp_path, rank=0, device=torch.device("cuda"))
    _train(profiler, steps=2, device="cuda")
    events = _trace_events(tmp_path / "profile_traces" / "iteration_2" / "rank0_trace.json")
    assert any(e.get("cat") == "kernel" for e in events)
    assert "CUDA Mem" in (tmp_path / "profile_traces" / "iteration_2" / "rank0_memory.txt").read_text()
    with open(tmp_path / "memory_snapshot" / "iteration_2" / "rank0_memory_snapshot.pickle", "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["segments"] and any(snapshot["device_traces"])
