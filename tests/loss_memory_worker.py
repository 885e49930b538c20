"""One rank of ``test_plan``'s loss-memory check: the peak bytes of titan's loss, forward and
backward, over one microbatch's logits, as ``torch.distributed._tools.mem_tracker`` counts
live tensors.

    python tests/loss_memory_worker.py OUT TOKENS VOCAB CHUNK   (one process: plain loss;
                                                                 ranks with torchrun's
                                                                 environment: loss parallel)

The logits come from a bf16 projection of a hidden state, as the output layer makes them
(vocab-sharded DTensor logits under loss parallel, over all ranks); the engine's order
follows: loss, free the logits, backward. Writes ``OUT/rank<R>.json`` with the peak minus
the hidden state and its gradient, which the planner counts elsewhere.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.distributed._tools.mem_tracker import MemTracker

HIDDEN = 64


def main(out: Path, tokens: int, vocab: int, chunk: int) -> None:
    """Measure the loss's peak on this rank; write ``{"rank", "peak_bytes"}``."""
    from titan.train.loss import cross_entropy_sum

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor.parallel import loss_parallel

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(rank)
    labels = torch.randint(0, vocab, (1, tokens))
    weight = torch.randn(vocab // world, HIDDEN, dtype=torch.bfloat16)
    hidden = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    tracker = MemTracker()
    tracker.track_external(hidden)
    with tracker, (loss_parallel() if world > 1 else nullcontext()):
        logits = (hidden @ weight.T).unsqueeze(0)
        if world > 1:
            logits = DTensor.from_local(logits, mesh, [Shard(2)], run_check=False)
        loss = cross_entropy_sum(logits, labels, chunk_tokens=chunk)
        del logits  # as the engine does before backward
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    out.mkdir(parents=True, exist_ok=True)
    result = {"rank": rank, "peak_bytes": peak - 2 * hidden.numel() * hidden.element_size()}
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
