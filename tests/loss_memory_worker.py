"""One rank of ``test_plan``'s loss-memory check: the peak bytes of titan's loss, forward and
backward, over one microbatch's logits, as ``torch.distributed._tools.mem_tracker`` counts
live tensors.

    python tests/loss_memory_worker.py OUT TOKENS VOCAB CHUNK   (one process: plain loss;
                                                                 ranks with torchrun's
                                                                 environment: loss parallel)
    python tests/loss_memory_worker.py OUT TOKENS VOCAB CHUNK compiled   (one process: the
                                                                 compiled loss)

The logits come from a bf16 projection of a hidden state, as the output layer makes them
(vocab-sharded DTensor logits under loss parallel, over all ranks); the engine's order
follows: loss, free the logits, backward. Writes ``OUT/rank<R>.json`` with the peak minus
the hidden state and its gradient, which the planner counts elsewhere.

`MemTracker` sees tensors through a dispatch mode, under which torch.compile does not run the
compiled graph; the compiled loss is measured as the process's peak resident set instead
(Linux: the peak is reset through ``/proc/self/clear_refs``, and glibc maps every tensor
above 128 KiB on its own so that a freed one leaves the resident set), after a first call
that compiles it at the same shapes.
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
        dist.barrier()  # no rank tears the group down while another still writes
        dist.destroy_process_group()


def _resident(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (VmRSS: now; VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main_compiled(out: Path, tokens: int, vocab: int, chunk: int) -> None:
    """The compiled loss's peak, as the resident set measures it (module docstring)."""
    import ctypes

    from titan.train.loss import cross_entropy_sum

    m_mmap_threshold = -3  # glibc's mallopt parameter
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 128 * 1024)
    torch.manual_seed(0)
    labels = torch.randint(0, vocab, (1, tokens))
    weight = torch.randn(vocab, HIDDEN, dtype=torch.bfloat16)
    peaks = []
    for _ in range(2):  # the first call compiles
        hidden = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set
        before = _resident("VmRSS")
        logits = (hidden @ weight.T).unsqueeze(0)
        loss = cross_entropy_sum(logits, labels, chunk_tokens=chunk, compiled=True)
        del logits
        loss.backward()
        peaks.append(_resident("VmHWM") - before - hidden.numel() * hidden.element_size())
        del hidden, loss
    out.mkdir(parents=True, exist_ok=True)
    (out / "rank0.json").write_text(json.dumps({"rank": 0, "peak_bytes": peaks[-1]}))


if __name__ == "__main__":
    args = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    if sys.argv[5:] == ["compiled"]:
        main_compiled(*args)
    else:
        main(*args)
