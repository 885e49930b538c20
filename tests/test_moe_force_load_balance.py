"""`--debug.moe_force_load_balance` (torchtitan's benchmarking switch) through `titan train`:
every MoE layer's load is exactly even, it is not without the flag, and a dense model refuses
the flag by name."""

import json

from forked_cli import run_titan

# 4 rows x 32 tokens x top-2 = 256 assignments per step over 8 experts: 32 each when forced.
FLAGS = ["--config", "qwen3_moe_debug", "--training.steps", "2", "--training.seq_len", "32",
         "--training.local_batch_size", "4", "--metrics.log_freq", "1", "--metrics.no_enable_progress_bar"]


def _records(dump):
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_forced_routing_balances_every_layer_exactly(tmp_path):
    imbalance = {}
    for name, extra in (("forced", ["--debug.moe_force_load_balance"]), ("learned", [])):
        result = run_titan(["train", *FLAGS, *extra, "--job.dump_folder", tmp_path / name], timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        imbalance[name] = [r["moe/imbalance_max"] for r in _records(tmp_path / name)]
    assert imbalance["forced"] == [1.0, 1.0]
    assert all(value > 1.0 for value in imbalance["learned"])


def test_a_dense_model_refuses_the_flag(tmp_path):
    result = run_titan(["train", "--config", "llama3_debug_synthetic", "--training.steps", "1",
                        "--debug.moe_force_load_balance", "--job.dump_folder", tmp_path], timeout=300)
    assert result.returncode == 2
    assert "--debug.moe_force_load_balance routes the tokens of MoE layers; llama3 debugmodel has none" in result.stderr
