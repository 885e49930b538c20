"""One context-parallel rank's attention: titan's (each query chunk over the keys it can see,
the causal mask aligned to the lower right) against the straightforward form (the rank's
queries over every key of the sequence with a boolean [S / cp, S] mask).

    python tools/bench/bench_cp_attention.py                          # seq 8192, cp 2 and 4, fp32, CPU
    python tools/bench/bench_cp_attention.py --dtype bfloat16 --cp 2 4 8
    python tools/bench/bench_cp_attention.py --device cuda --dtype bfloat16 --seq-len 65536 --cp 8

Both sides get the same gathered K and V (what the all-gather hands every rank) and the
rank's head-tail queries, run forward + backward, and must agree (aborts if not); they run
interleaved in rounds (A B, B A, ...), and the script prints per rank count the ratio of the
medians and, on CUDA, the allocator's peak of each side. The rank's index does not matter:
titan's chunks cost every rank the same (2 cp + 1) chunks of keys.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from benchstats import ratio_line  # this folder is on sys.path when a script runs
from titan.dist.context_parallel import attend_local_chunks, shard_positions, shard_sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def whole_row_attention(q: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, cp_rank: int,
                        cp_size: int) -> torch.Tensor:
    """The reference: every local query against every key under a mask built from positions."""
    seq_len = k_full.shape[2]
    q_pos = shard_positions(seq_len, cp_rank, cp_size, q.device)
    mask = q_pos[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, enable_gqa=k_full.shape[1] != q.shape[1])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(fn, q, k, v, grad, device) -> float:
    """Seconds of one forward + backward."""
    _sync(device)
    start = time.perf_counter()
    fn(q, k, v).backward(grad)
    _sync(device)
    return time.perf_counter() - start


def _peak_mib(fn, q, k, v, grad, device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn(q, k, v).backward(grad)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def bench_one(args: argparse.Namespace, cp_size: int) -> dict[str, list[float]]:
    """Rounds of both sides for one CP degree; prints the ratio line."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    g = torch.Generator(device="cpu").manual_seed(0)
    shape = (args.batch_size, args.heads, args.seq_len, args.head_dim)
    kv_shape = (args.batch_size, args.kv_heads, args.seq_len, args.head_dim)
    q_all = torch.randn(shape, generator=g).to(device, dtype)
    rank = 0
    q = shard_sequence(q_all, rank, cp_size, seq_dim=2).requires_grad_()
    k = torch.randn(kv_shape, generator=g).to(device, dtype).requires_grad_()
    v = torch.randn(kv_shape, generator=g).to(device, dtype).requires_grad_()
    sides = {"titan": lambda q, k, v: attend_local_chunks(q, k, v, rank, cp_size),
             "whole rows": lambda q, k, v: whole_row_attention(q, k, v, rank, cp_size)}
    with torch.no_grad():
        a, b = (fn(q, k, v) for fn in sides.values())
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        if not torch.allclose(a.float(), b.float(), rtol=tol, atol=tol):
            raise SystemExit(f"cp {cp_size}: the two sides disagree (max diff {(a - b).abs().max().item():.3g})")
    grad = torch.randn_like(a)
    for fn in sides.values():
        for _ in range(args.warmup):
            _step(fn, q, k, v, grad, device)
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        order = list(sides) if round_index % 2 == 0 else list(reversed(sides))
        for name in order:
            seconds[name].append(_step(sides[name], q, k, v, grad, device))
    print(f"cp {cp_size}: {args.seq_len // cp_size} local queries x {args.seq_len} keys, "
          + ", ".join(f"{n} {statistics.median(s) * 1e3:.1f} ms" for n, s in seconds.items()))
    peaks = {name: _peak_mib(fn, q, k, v, grad, device) for name, fn in sides.items()}
    if all(p is not None for p in peaks.values()):
        print("  peak MiB above the inputs: " + ", ".join(f"{n} {p:.0f}" for n, p in peaks.items()))
    print("  " + ratio_line(f"whole rows/titan (cp {cp_size})", seconds["whole rows"], seconds["titan"],
                            "seconds (>1: titan faster)"))
    return seconds


def main(argv: list[str] | None = None) -> dict[int, dict[str, list[float]]]:
    """Run the benchmark for every CP degree asked; returns the per-round seconds."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    for cp_size in args.cp:
        if args.seq_len % (2 * cp_size):
            p.error(f"--seq-len {args.seq_len} must be divisible by 2 x cp = {2 * cp_size}")
    return {cp_size: bench_one(args, cp_size) for cp_size in args.cp}


if __name__ == "__main__":
    main()
