"""`titan train` in a dump folder another live run holds stops before writing anything; once
that run is gone the same command trains."""

from forked_cli import run_titan
from titan.train.run_lock import RunFolderLock

FLAGS = ["train", "--config", "llama3_debug", "--model.flavor", "debugmodel_tiny", "--training.steps", "2",
         "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.no_enable_progress_bar"]


def test_a_second_run_in_a_busy_dump_folder_stops_and_writes_nothing(tmp_path):
    dump = tmp_path / "run"
    other = RunFolderLock(dump).acquire()  # a live run holding the folder
    try:
        busy = run_titan([*FLAGS, "--job.dump_folder", dump], timeout=300)
    finally:
        other.release()
    assert busy.returncode == 2, busy.stderr[-3000:]
    assert "is in use by another titan run (pid" in busy.stderr
    assert sorted(p.name for p in dump.iterdir()) == [".titan-run.lock"]  # no config.json, no metrics

    done = run_titan([*FLAGS, "--job.dump_folder", dump], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (dump / "metrics.jsonl").is_file()
