"""One live run per dump folder (`titan.train.run_lock`): a second run is refused naming the
first, and a run that dies (even by SIGKILL) leaves the folder free."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from titan.train.run_lock import RunFolderBusy, RunFolderLock, lock_run_folder


def test_a_second_lock_is_refused_naming_the_holder_and_free_after_release(tmp_path):
    first = RunFolderLock(tmp_path / "run").acquire()
    with pytest.raises(RunFolderBusy) as info:
        RunFolderLock(tmp_path / "run").acquire()
    message = str(info.value)
    assert f"pid {os.getpid()} on host" in message and "--job.dump_folder" in message
    first.release()
    second = RunFolderLock(tmp_path / "run").acquire()
    assert second.held
    second.release()
    second.release()  # idempotent


def test_only_rank_0_locks(tmp_path):
    held = lock_run_folder(tmp_path, rank=0)
    other = lock_run_folder(tmp_path, rank=1)  # another rank of the same run: no conflict
    assert held.held and not other.held
    held.release()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    """The kernel drops the lock with the process: a SIGKILLed run's relaunch starts."""
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from titan.train.run_lock import RunFolderLock
            lock = RunFolderLock({str(tmp_path)!r}).acquire()
            print("held", flush=True)
            time.sleep(600)
        """)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid} "):
            RunFolderLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
    RunFolderLock(tmp_path).acquire().release()
