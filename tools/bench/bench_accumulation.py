"""Gradient accumulation across data-parallel replicas: the step with the replicas' all-reduce
deferred to the last microbatch (titan's `replicas_sync_later`, what the engine runs) against
the step that all-reduces after every microbatch (DDP's default), on 2 gloo ranks.

    python tools/bench/bench_accumulation.py                    # debugmodel, DDP 2, 4 microbatches of 2 x 256
    python tools/bench/bench_accumulation.py --hsdp --microbatches 8

Both sides start from the same weights and data and must produce the same gradients (checked
first, then every round); they run interleaved (A B, B A, ...) and rank 0 prints the median
step of each and the ratio. On 2 CPU cores every rank computes on one thread, so the
all-reduce competes with nothing but itself: a network between nodes makes the saving larger.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from benchstats import ratio_line  # this folder is on sys.path when a script runs


def _step(model, batches, defer: bool) -> None:
    """One accumulation step's forwards and backwards (no optimizer: it is the same on both)."""
    from titan.dist import replicas_sync_later

    for i, (inputs, labels) in enumerate(batches):
        last = i == len(batches) - 1
        with replicas_sync_later([model]) if defer and not last else contextlib.nullcontext():
            logits = model(inputs)
            F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()


def _grads(model) -> list[torch.Tensor]:
    """The model's whole gradients (then cleared)."""
    grads = [p.grad for p in model.parameters()]
    out = [g.full_tensor() if hasattr(g, "full_tensor") else g.detach().clone() for g in grads]
    model.zero_grad(set_to_none=True)
    return out


def _worker(rank: int, store_path: str, out: str, args: argparse.Namespace) -> None:
    """One rank: build, check both sides' gradients agree, time interleaved rounds."""
    from titan.dist import apply_ddp
    from titan.models.llama3 import build_llama3
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_llama3(args.flavor, vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    model.init_weights(seed=0)
    if args.hsdp:  # 2 replicas of a 1-rank shard group
        fully_shard(model, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard")))
    else:
        apply_ddp(model, init_device_mesh("cpu", (2,)), None)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [(torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=g),
                torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=g))
               for _ in range(args.microbatches)]
    sides = {"deferred": True, "every microbatch": False}
    results = {}
    for name, defer in sides.items():
        _step(model, batches, defer)
        results[name] = _grads(model)
    for a, b in zip(results["deferred"], results["every microbatch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            _step(model, batches, sides[name])
            seconds[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Run both sides on 2 ranks; prints and returns rank 0's per-round seconds."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2, help="sequences per microbatch and rank")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--hsdp", action="store_true", help="HSDP (FSDP2, 2 replicas) instead of DDP")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds.json")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), out, args), nprocs=2)
        seconds = json.loads(Path(out).read_text())
    kind = "HSDP" if args.hsdp else "DDP"
    print(f"{kind} 2, {args.microbatches} microbatches of {args.batch_size} x {args.seq_len}: "
          + ", ".join(f"{n} {statistics.median(s):.3f} s" for n, s in seconds.items()))
    print(ratio_line("every microbatch/deferred", seconds["every microbatch"], seconds["deferred"],
                     "seconds (>1: deferring is faster)"))
    return seconds


if __name__ == "__main__":
    main()
