"""The logged `aux_loss` is the part of the logged `loss` that is the routers' balancing loss,
on one process and on two pipeline stages (each stage adds its own layers' share)."""

import json

from forked_cli import run_titan
from launching import launch_train_runs

# DeepSeek-V3's sequence-wise balance loss is exact under pipeline parallel (per layer, per
# sequence), so both layouts compute the same auxiliary loss.
FLAGS = ["--config", "deepseek_v3_debug", "--model.n_layers", "4", "--training.steps", "1",
         "--training.seq_len", "32", "--training.local_batch_size", "4", "--metrics.no_enable_progress_bar"]


def first_record(dump):
    return json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])


def test_the_aux_loss_is_logged_and_is_the_difference_the_coefficient_makes(tmp_path):
    runs = {}
    for name, coef in (("with", "0.01"), ("without", "0")):
        dump = tmp_path / name
        result = run_titan(["train", *FLAGS, "--model.router_aux_loss_coef", coef, "--job.dump_folder", dump],
                           timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = first_record(dump)
    # Same weights, same batch: the first step's losses differ by the auxiliary loss alone.
    aux = runs["with"]["aux_loss"]
    assert aux > 0 and runs["without"]["aux_loss"] == 0.0
    assert abs((runs["with"]["loss"] - runs["without"]["loss"]) - aux) <= 1e-6 * runs["with"]["loss"]

    pp2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.pipeline_parallel_schedule", "1F1B"]
    launch_train_runs(2, [("pp", [*FLAGS, *pp2, "--model.router_aux_loss_coef", "0.01",
                                  "--job.dump_folder", str(tmp_path / "pp")])], tmp_path / "launch.log")
    staged = first_record(tmp_path / "pp")
    assert abs(staged["aux_loss"] - aux) <= 1e-5 * aux, (staged["aux_loss"], aux)
    assert abs(staged["loss"] - runs["with"]["loss"]) <= 1e-5 * runs["with"]["loss"]
