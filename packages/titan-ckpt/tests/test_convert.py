"""DCP <-> plain state dict helpers and the tools/convert_hf.py command built on them."""

import os
import subprocess
import sys

import pytest
import torch
from ckpt_testlib import Run, TinyLM, tensors_equal
from titan.ckpt import CheckpointConfig, CheckpointError, load_dcp_model, load_hf, save_dcp_model

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "convert_hf.py")


def test_dcp_model_round_trip_without_a_model(tmp_path):
    run = Run(CheckpointConfig(enable=True, interval=1, last_save_model_only=False), str(tmp_path))
    run.train(2)
    run.manager.close()
    weights = load_dcp_model(str(tmp_path / "checkpoint"))  # the latest step
    assert tensors_equal(weights, run.model.state_dict())

    out = save_dcp_model(weights, str(tmp_path / "converted"))
    warm = Run(CheckpointConfig(enable=True, initial_load_path=out), str(tmp_path / "warm"), seed=9)
    assert warm.manager.load() == 0
    assert tensors_equal(warm.model.state_dict(), run.model.state_dict())
    warm.manager.close()
    with pytest.raises(CheckpointError, match="not empty"):
        save_dcp_model(weights, out)
    with pytest.raises(CheckpointError, match="neither a DCP step folder"):
        load_dcp_model(str(tmp_path))


@pytest.mark.skipif(not os.path.isfile(TOOL), reason="tools/convert_hf.py not in this checkout")
def test_convert_tool_both_ways(tmp_path):
    torch.manual_seed(0)
    weights = TinyLM().state_dict()
    save_dcp_model(weights, str(tmp_path / "dcp"))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(__file__))
    adapter = ["--adapter", "ckpt_testlib:NamesAsIs"]
    for cmd in (["to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf")],
                ["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]):
        result = subprocess.run([sys.executable, TOOL, *cmd, *adapter], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "hf" / "config.json").exists()
    assert tensors_equal(load_hf(str(tmp_path / "hf")), weights)
    assert tensors_equal(load_dcp_model(str(tmp_path / "back")), weights)
