"""torchrun entry point of the split-job test: ``split_worker.py FIRST_PART_SIZE OUT [nogroup1]``
(``nogroup1``: the second part starts without a default group).

Every rank calls `split_job`, then exercises its part's default group and, on bridge members,
every bridge collective; each writes OUT/rank<R>.pt with what it saw.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(first: int, out: Path, groups: tuple[bool, bool]) -> None:
    from titan.dist import current_split, destroy_distributed, init_distributed, split_job

    split = split_job(first, timeout_s=60, part_groups=groups)
    try:
        env = init_distributed()
        described = (env.rank, env.world_size)
    except RuntimeError as err:
        described = str(err)
    seen = {"part": split.part, "rank": split.rank, "size": split.size, "sizes": split.part_sizes,
            "env": described, "same_split": current_split() is split, "has_group": split.has_group,
            "group_size": dist.get_world_size() if dist.is_initialized() else 1}
    if dist.is_initialized():  # the part's own group: a sum over this part only
        total = torch.tensor([float(split.global_rank)])
        dist.all_reduce(total)
        seen["part_sum"] = total.item()
    bridge = split.bridge
    seen["bridge"] = None if bridge is None else (bridge.rank, bridge.size)
    if bridge is not None:
        seen["command"] = bridge.broadcast_object({"op": "go", "from": split.global_rank} if bridge.rank == 0 else None,
                                                  src=0)
        last = bridge.size - 1  # a generator side rank broadcasts too
        seen["reply"] = bridge.broadcast_object(["reply", split.global_rank] if bridge.rank == last else None, src=last)
        seen["tensor"] = bridge.broadcast(torch.arange(5.0) if bridge.rank == 0 else torch.zeros(5), src=0).tolist()
        if bridge.rank == 0:
            seen["received"] = [bridge.recv_object(src) for src in range(1, bridge.size)]
        else:
            bridge.send_object({"bridge_rank": bridge.rank, "payload": list(range(bridge.rank))}, 0)
        seen["all_true"] = bridge.all_true(True)
        seen["one_false"] = bridge.all_true(bridge.rank != last)
    torch.save(seen, out / f"rank{split.global_rank}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]), (True, not (len(sys.argv) > 3 and sys.argv[3] == "nogroup1")))
