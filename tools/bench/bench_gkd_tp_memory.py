"""The memory of GKD's loss under tensor parallel with loss parallel: the vocab-parallel
divergence (`vocab_parallel_gkd_loss_sum`, each rank its columns of both models' logits)
against gathering both models' logits whole first (what `titan gkd` did before), on 2 gloo
ranks, forward and backward, with the teacher's logits (a sharded teacher's: this rank's
columns, or the gathered whole) counted as live.

    python tools/bench/bench_gkd_tp_memory.py                        # 512 tokens, vocab 32768
    python tools/bench/bench_gkd_tp_memory.py --tokens 1024 --vocab 65536 --chunk-tokens 256

Each rank's student logits come from a projection of a hidden state on its own vocabulary
columns, as the output layer makes them under loss parallel (a vocab-sharded DTensor); peaks
are the live tensors `torch.distributed._tools.mem_tracker` counts on the CPU, minus the
hidden state and its gradient. Prints each side's peak per rank and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HIDDEN = 64
SIDES = ("gathered", "vocab-parallel")


def _measure(side: str, args: argparse.Namespace, mesh) -> int:
    """One side's peak bytes on this rank (forward and backward of the loss)."""
    import torch
    from titan.rl.distill_loss import gkd_loss_sum, vocab_parallel_gkd_loss_sum
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    width = args.vocab // mesh.size()
    generator = torch.Generator().manual_seed(mesh.get_local_rank())
    hidden = torch.randn(1, args.tokens, HIDDEN, generator=generator, requires_grad=True)
    weight = torch.randn(width, HIDDEN, generator=generator) / HIDDEN**0.5
    teacher_weight = torch.randn(width, HIDDEN, generator=generator) / HIDDEN**0.5
    labels = torch.randint(0, args.vocab, (1, args.tokens), generator=generator)
    tracker = MemTracker()
    tracker.track_external(hidden)
    with tracker, loss_parallel():
        logits = DTensor.from_local(hidden @ weight.T, mesh, [Shard(2)], run_check=False)
        with torch.no_grad():  # the teacher's logits of a sharded teacher: this rank's columns
            teacher = hidden.detach() @ teacher_weight.T
        if side == "gathered":
            teacher = DTensor.from_local(teacher, mesh, [Shard(2)], run_check=False).full_tensor()
            loss = gkd_loss_sum(logits.full_tensor(), teacher, labels, beta=0.5, chunk_tokens=args.chunk_tokens)
        else:
            loss = vocab_parallel_gkd_loss_sum(logits, teacher, labels, beta=0.5, teacher_sharded=True,
                                               chunk_tokens=args.chunk_tokens)
        del logits, teacher
        loss.backward()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return peak - 2 * hidden.numel() * hidden.element_size()


def _worker(args: argparse.Namespace) -> None:
    """Both sides on this rank; rank 0 writes the peaks to ``args.out``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    peaks = {side: _measure(side, args, mesh) for side in SIDES}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(peaks))
    dist.barrier()  # no rank tears the group down while another still writes
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, int]:
    """Launch the 2 ranks, print each side's peak per rank and the ratio; returns the peaks."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="labelled positions of the microbatch")
    parser.add_argument("--vocab", type=int, default=32768, help="the vocabulary (even over the 2 ranks)")
    parser.add_argument("--chunk-tokens", type=int, default=0, help="--training.loss_chunk_tokens")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return {}
    with tempfile.TemporaryDirectory(prefix="bench-gkd-tp-") as tmp:
        out = Path(tmp) / "peaks.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", "localhost:0", __file__, "--worker", "--out", str(out), "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--chunk-tokens", str(args.chunk_tokens)]
        subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        peaks = json.loads(out.read_text())
    for side in SIDES:
        print(f"{side}: peak {peaks[side] / 2**20:.1f} MiB per rank ({args.tokens} tokens, vocab {args.vocab}, TP 2)")
    print(f"ratio vocab-parallel / gathered peak memory: {peaks['vocab-parallel'] / peaks['gathered']:.3f}")
    return peaks


if __name__ == "__main__":
    main()
