"""Calibrate `titan plan` on this CPU: its predicted peak memory and step time against real
`titan train` runs of the same model in several layouts (gloo, one thread per rank).

    python tools/plan_calibrate_cpu.py [--steps 6] [--json] [--layouts 'fsdp 2' 'tp 2' ...]

The hardware profile is measured here first: the fp32 GEMM rate of one thread (the "peak")
and how it falls for few tokens,
the bandwidth and per-call cost of a 2-rank gloo all-gather and how much longer a
reduce-scatter of the same bytes takes (gloo sums on the CPU) and how much of an all-gather
hides behind matmuls running meanwhile (little: every core runs a rank), and the memory a rank holds before training (the
interpreter with torch and titan loaded, which a GPU's memory does not contain). The kernel
efficiency is then fitted on the one-process run's step time; every other layout's time,
and every memory figure, is a prediction. Memory is the peak resident set of the largest rank
(`memory_peak_gib` in metrics.jsonl) in a second run of each layout whose allocator returns
every freed tensor to the system (glibc's `MALLOC_MMAP_THRESHOLD_` fixed at 128 KiB): with
glibc's defaults the resident set also keeps freed heap, which grows over the steps and with
the threads a process runs (6-27% above the live peak, measured on two machines), and is
printed beside it.
Takes several minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from titan.dist.pipeline import SINGLE_STAGE
from titan.dist.planner import Hardware, Layout, predict

from titan.recipes.cli import parse_train_args
from titan.recipes.plan import model_facts, workload_for

MODEL = ["--config", "llama3_debug", "--training.seq_len", "512"]
LAYOUTS = {
    # name: (ranks, layout flags, local batch)
    "one process": (1, [], 8),
    "fsdp 2": (2, ["--parallelism.data_parallel_shard_degree", "2"], 4),
    "tp 2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"], 8),
    "pp 2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
                 "--parallelism.pipeline_parallel_microbatch_size", "2"], 8),
    "pp 2 interleaved": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
                             "--parallelism.pipeline_parallel_microbatch_size", "2",
                             "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], 8),
    # Zero-bubble schedules: each backward split into input and weight gradients (the V-shaped
    # one holds the first and the last stage on rank 0).
    "pp 2 interleaved zero bubble": (2, ["--parallelism.data_parallel_shard_degree", "1",
                                         "--parallelism.pipeline_parallel_degree", "2",
                                         "--parallelism.pipeline_parallel_microbatch_size", "2",
                                         "--parallelism.pipeline_parallel_schedule", "InterleavedZeroBubble"], 8),
    "pp 2 ZBV zero bubble": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree",
                                 "2", "--parallelism.pipeline_parallel_microbatch_size", "2",
                                 "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], 8),
    "cp 2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"], 8),
    # Gradient accumulation: 2 microbatches of 2 per step and rank (FSDP's traffic twice; the
    # replicas' all-reduce once, after the last).
    "fsdp 2, 2 x 2 accumulated": (2, ["--parallelism.data_parallel_shard_degree", "2",
                                      "--training.global_batch_size", "8"], 2),
    "ddp 2, 2 x 2 accumulated": (2, ["--parallelism.data_parallel_shard_degree", "1",
                                     "--parallelism.data_parallel_replicate_degree", "2",
                                     "--training.global_batch_size", "8"], 2),
    # FSDP's reshard policy, which `titan plan` ranks: "never" keeps every block gathered from
    # its forward to its backward (one all-gather per microbatch instead of two); "always"
    # under PP frees the stage after each microbatch's forward (two per microbatch, not one).
    "fsdp 2, 2 x 2 accumulated, reshard never": (2, ["--parallelism.data_parallel_shard_degree", "2",
                                                     "--training.global_batch_size", "8",
                                                     "--parallelism.fsdp_reshard_after_forward", "never"], 2),
}


def gemm_tflops(n: int = 1024, repeats: int = 10) -> float:
    """fp32 matmul rate of one thread, TFLOP/s (best of three timings)."""
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 * repeats / best / 1e12


def half_efficiency_tokens(dim: int = 256, small: int = 64, large: int = 4096) -> float:
    """Tokens M at which a [M, dim] x [dim, 3 dim] matmul runs at half its large-M rate,
    from the rates at `small` and `large` M (rate = R M / (M + h), solved for h)."""
    torch.set_num_threads(1)
    weight = torch.randn(dim, 3 * dim)

    def rate(m: int) -> float:
        x = torch.randn(m, dim)
        x @ weight
        repeats = max(1, 2**16 // m)
        start = time.perf_counter()
        for _ in range(repeats):
            x @ weight
        return 2 * m * dim * 3 * dim * repeats / (time.perf_counter() - start)

    r_small, r_large = rate(small), rate(large)
    return max(0.0, (r_large - r_small) / (r_small / small - r_large / large))


def _timed(work, repeats: int) -> float:
    """Seconds per call of `work()`, after one untimed call."""
    work()
    start = time.perf_counter()
    for _ in range(repeats):
        work()
    return (time.perf_counter() - start) / repeats


def _gathers_beside_matmuls(full: torch.Tensor, shard: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """5 asynchronous all-gathers issued, 40 matmuls run while they proceed, then waited for."""
    works = [dist.all_gather_single(full, shard, async_op=True) for _ in range(5)]
    for _ in range(40):
        a @ b
    for work in works:
        work.wait()


def _collectives_worker(rank: int, store_path: str, out: str, megabytes: int) -> None:
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.set_num_threads(1)
    shard = torch.ones(megabytes * 2**20 // 4)
    full = torch.empty(2 * shard.numel())
    gather = _timed(lambda: dist.all_gather_single(full, shard), 5)
    reduce = _timed(lambda: dist.reduce_scatter_single(shard, full), 5)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    compute = _timed(lambda: a @ b, 40)
    both = _timed(lambda: _gathers_beside_matmuls(full, shard, a, b), 1)
    overlap = min(max((40 * compute + 5 * gather - both) / (5 * gather), 0.0), 1.0)
    tiny, gathered, calls = torch.ones(1), torch.empty(2), []
    for _ in range(50):
        calls.append(_timed(lambda: dist.all_gather_single(gathered, tiny), 1))
    if rank == 0:
        Path(out).write_text(json.dumps([shard.numel() * 4 / gather / 1e9, 1e6 * statistics.median(calls),
                                         reduce / gather, overlap]))
    dist.barrier()
    dist.destroy_process_group()


def gloo_link(megabytes: int = 32) -> tuple[float, float, float, float]:
    """(GB/s each of 2 gloo ranks receives in a large all-gather, microseconds of a tiny one,
    the time of a reduce-scatter of the same bytes relative to the all-gather, the fraction of
    all-gather time hidden behind matmuls running meanwhile)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rate")
        mp.spawn(_collectives_worker, args=(os.path.join(tmp, "store"), out, megabytes), nprocs=2)
        rate, latency, reduce_cost, overlap = json.loads(Path(out).read_text())
        return rate, latency, reduce_cost, overlap


def process_gib() -> float:
    """Resident memory of an interpreter with torch and titan's trainer imported."""
    code = ("import resource, titan.recipes.cli, titan.train.trainer; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) * 1024 / 2**30


RETURN_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""glibc serves every allocation above 128 KiB with its own mapping and unmaps it when freed
(a fixed threshold also stops glibc from raising it after the first frees)."""


def train(name: str, folder: Path, steps: int, env: dict[str, str] | None = None) -> dict:
    """One `titan train` run of a layout: its peak memory (GiB) and median step time (s)."""
    ranks, flags, local = LAYOUTS[name]
    launch = [sys.executable] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
        "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
    cmd = [*launch, "-m", "titan.recipes.cli", "train", *MODEL, *flags, "--training.local_batch_size", str(local),
           "--training.steps", str(steps), "--metrics.log_freq", "1", "--metrics.no_enable_progress_bar",
           "--job.dump_folder", str(folder)]
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                   timeout=900)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return {"memory_gib": max(r["memory_peak_gib"] for r in rows),
            "step_s": statistics.median(r["elapsed_s"] for r in rows[2:])}


def layout_of(name: str) -> Layout:
    """The planner's `Layout` for a calibration run (AC off, titan's defaults otherwise)."""
    ranks, flags, local = LAYOUTS[name]
    degrees = dict(zip(flags[::2], flags[1::2], strict=True))
    pp = int(degrees.get("--parallelism.pipeline_parallel_degree", 1))
    schedule = degrees.get("--parallelism.pipeline_parallel_schedule", "1F1B")
    replicate = int(degrees.get("--parallelism.data_parallel_replicate_degree", 1))
    shard = int(degrees.get("--parallelism.data_parallel_shard_degree", ranks))
    # With --training.global_batch_size the local batch is one accumulated microbatch.
    per_step = int(degrees.get("--training.global_batch_size", local * replicate * shard)) // (replicate * shard)
    micro = local if pp == 1 else int(degrees.get("--parallelism.pipeline_parallel_microbatch_size", local))
    return Layout(pp=pp, dp_replicate=replicate, dp_shard=shard,
                  cp=int(degrees.get("--parallelism.context_parallel_degree", 1)),
                  tp=int(degrees.get("--parallelism.tensor_parallel_degree", 1)), ep=1, ac="none",
                  local_batch_size=per_step, microbatch_size=micro, schedule=schedule,
                  stages_per_rank=1 if schedule in SINGLE_STAGE else 2,
                  reshard_after_forward=degrees.get("--parallelism.fsdp_reshard_after_forward", "default"))


def main() -> None:
    """Measure the profile, run every layout, print predicted vs measured."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layouts", nargs="+", default=[], metavar="NAME",
                        help="the layouts to run, each one argument (their names hold commas), e.g. --layouts "
                             "'fsdp 2' 'tp 2'; the one-process run, which fits the kernel efficiency, always runs")
    args = parser.parse_args()
    names = ["one process", *(n.strip() for n in args.layouts if n.strip() != "one process")]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {list(LAYOUTS)}")
    layouts = names if args.layouts else list(LAYOUTS)
    peak, half, base = gemm_tflops(), half_efficiency_tokens(), process_gib()
    link, latency, reduce_cost, overlap = gloo_link()
    config = parse_train_args(MODEL)
    facts, _, _ = model_facts(config)
    with tempfile.TemporaryDirectory() as tmp:
        measured = {name: train(name, Path(tmp) / name.replace(" ", "_"), args.steps) for name in layouts}
        live = {name: train(name, Path(tmp) / (name.replace(" ", "_") + "_live"), args.steps, RETURN_FREED_MEMORY)
                for name in layouts}
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    hw = Hardware(name="this CPU (1 thread per rank)", peak_bf16_tflops=peak, peak_fp8_tflops=0, memory_gib=ram_gib,
                  memory_tbps=0.0,  # only float8's casts use it, and float8 is off here
                  intra_node_gbps=link, inter_node_gbps=link, devices_per_node=8, link_efficiency=1.0,
                  half_efficiency_tokens=half, collective_latency_us=latency, reduce_scatter_cost=reduce_cost,
                  comm_overlap=overlap)
    # No headroom: the CPU allocator returns freed memory, and the peak is what is resident.
    work = workload_for(config, 1, 8 * 512, 0.0)
    # Fit the one free constant on the one-process run's time, as on GPUs.
    first = predict(facts, layout_of("one process"), work, hw)
    efficiency = hw.matmul_efficiency * first.times["step"] / measured["one process"]["step_s"]
    hw = dataclasses.replace(hw, matmul_efficiency=efficiency)
    rows = []
    for name in layouts:
        p = predict(facts, layout_of(name), work, hw)
        memory = p.memory["total"] / 2**30 + base
        rows.append({"layout": name, "memory_gib": live[name]["memory_gib"], "predicted_memory_gib": memory,
                     "memory_error": memory / live[name]["memory_gib"] - 1,
                     "default_allocator_memory_gib": measured[name]["memory_gib"],
                     "step_s": measured[name]["step_s"], "predicted_step_s": p.times["step"],
                     "time_error": p.times["step"] / measured[name]["step_s"] - 1, "dominant": p.dominant})
    profile = {"gemm_tflops_1_thread": peak, "half_efficiency_tokens": half, "collective_latency_us": latency,
               "gloo_gbps": link, "reduce_scatter_cost": reduce_cost, "comm_overlap": overlap, "process_gib": base, "fitted_efficiency": efficiency}
    if args.json:
        print(json.dumps({"profile": profile, "rows": rows}, indent=1))
        return
    print(f"profile: fp32 GEMM {peak * 1e3:.1f} GFLOP/s per thread (half of it at {half:.0f} tokens), gloo all-gather {link:.2f} GB/s "
          f"({latency:.0f} us per call; a reduce-scatter {reduce_cost:.2f}x its time; {overlap:.0%} of it hidden "
          f"behind matmuls), "
          f"{base:.2f} GiB per process before training; fitted kernel efficiency {efficiency:.2f}")
    print("| layout | measured peak | predicted | error | peak, glibc defaults | measured step | predicted | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['memory_gib']:.2f} GiB | {r['predicted_memory_gib']:.2f} GiB | "
              f"{100 * r['memory_error']:+.0f}% | {r['default_allocator_memory_gib']:.2f} GiB | "
              f"{r['step_s']:.2f} s | {r['predicted_step_s']:.2f} s | "
              f"{100 * r['time_error']:+.0f}% |")


if __name__ == "__main__":
    main()
