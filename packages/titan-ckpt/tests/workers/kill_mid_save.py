"""Saves step 1, then stalls inside the save of step 2 until the test SIGKILLs it."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import titan.ckpt.manager as manager_mod  # noqa: E402
import torch  # noqa: E402
from ckpt_testlib import Run  # noqa: E402
from titan.ckpt import CheckpointConfig  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402


class StallingWriter(FileSystemWriter):
    """Writes the data, tells the test, and waits to be killed before the metadata."""

    sentinel = ""

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        future.wait()
        open(self.sentinel, "w").close()
        time.sleep(300)
        return future


def main(dump_folder: str, sentinel: str) -> None:
    cfg = CheckpointConfig(enable=True, interval=1, last_save_model_only=False)
    run = Run(cfg, dump_folder)
    run.train(1)
    torch.save(run.model.state_dict(), os.path.join(dump_folder, "weights_at_1.pt"))
    StallingWriter.sentinel = sentinel
    manager_mod._make_writer = StallingWriter
    run.train(1)
    raise SystemExit("not reached: the test kills this process during the save")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
