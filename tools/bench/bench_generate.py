"""Native RL generator throughput and colocated weight-sync time.

    python tools/bench/bench_generate.py                       # debugmodel, 16 prompts x 128 new tokens, fp32, CPU
    python tools/bench/bench_generate.py --rounds 5 --no-reference

Generation: `titan.rl.generate.NativeGenerator` (batched left-padded prefill, then one token
per forward over a KV cache) against the reference without a cache (the whole sequence
re-run for every new token, the trainer's forward), greedy, interleaved in rounds. Both must
produce the same tokens (checked first). Reported: new tokens/s of each and their ratio.

Sync: `titan.rl.weight_sync.sync_colocated` from a 1-process `TrainingEngine` into the
generator (full tensors by name, checksum verification included) against the reference
`model.load_state_dict` of the same tensors already gathered (the floor: one copy per tensor).

`--vllm` also times `titan.rl.generate.vllm.VLLMGenerator` (vLLM running the same titan model
code, in-process, fp32) against the native generator on the same weights and prompts, greedy
and sampled (temperature 1, one completion per prompt), interleaved in rounds; greedy tokens
must be equal first. Needs vLLM (`make setup-vllm`, then run with `.venv-vllm/bin/python`).

`--disaggregated 2` also times `WeightBroadcaster` in a torchrun job of 2 trainer ranks (the
model sharded with FSDP2 over them) + 2 generator ranks, gloo, 64 MiB buckets (no reference:
absolute seconds per sync, as seen by the first trainer rank).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from benchstats import ratio_line  # this folder is on sys.path when a script runs
from titan.models.llama3 import LLAMA3_FLAVORS, Llama3StateDictAdapter, build_llama3
from titan.rl.generate import NativeGenerator, SamplingConfig
from titan.rl.weight_sync import sync_colocated


@torch.no_grad()
def uncached_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The reference: right-padded full forward of every sequence for every new token."""
    seqs = [list(p) for p in prompts]
    for _ in range(new_tokens):
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, : len(s)] = torch.tensor(s)
        logits = model(ids)
        for row, s in enumerate(seqs):
            s.append(int(logits[row, len(s) - 1].argmax()))
    return [s[len(p):] for s, p in zip(seqs, prompts, strict=True)]


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _engine(flavor: str, vocab: int, seq_len: int, folder: str):
    from titan.ckpt import CheckpointConfig
    from titan.dist import ActivationCheckpointConfig, CompileConfig, ParallelismConfig
    from titan.train.engine import TrainingEngine
    from titan.train.lr_scheduler import LRSchedulerConfig
    from titan.train.model_spec import ModelSpec
    from titan.train.optimizer import OptimizerConfig

    spec = ModelSpec(name="llama3", flavors=LLAMA3_FLAVORS, build=build_llama3,
                     adapter=lambda model: Llama3StateDictAdapter(model.args))
    return TrainingEngine(
        model_spec=spec, flavor=flavor, vocab_size=vocab, seq_len=seq_len, steps=1,
        parallelism=ParallelismConfig(), activation_checkpoint=ActivationCheckpointConfig(),
        compile=CompileConfig(), optimizer=OptimizerConfig(), lr_scheduler=LRSchedulerConfig(),
        checkpoint=CheckpointConfig(), dump_folder=folder, local_batch_size=1, seed=0,
    )


def bench_generation(args) -> dict[str, list[float]]:
    """Interleaved rounds of cached generation and the uncached reference."""
    model = build_llama3(args.flavor, vocab_size=args.vocab_size, max_seq_len=args.prompt_len + args.new_tokens)
    model.init_weights(seed=0)
    model.eval()
    generator = NativeGenerator(model, device="cpu", max_batch_size=args.prompts)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab_size, (args.prompt_len - (i % 4),), generator=g).tolist()
               for i in range(args.prompts)]
    sampling = SamplingConfig(temperature=0, max_new_tokens=args.new_tokens)

    def cached():
        return [group[0].token_ids for group in generator.generate(prompts, sampling)]

    got = cached()
    tokens = sum(len(t) for t in got)
    times = {"native": [], "uncached": []}
    if not args.no_reference:
        ref = uncached_greedy(model, prompts, args.new_tokens)
        if got != ref:
            raise SystemExit("native generation and the uncached reference disagree; not timing")
    for r in range(args.rounds):
        order = ("native", "uncached") if r % 2 == 0 else ("uncached", "native")
        for name in order:
            if name == "uncached" and args.no_reference:
                continue
            fn = cached if name == "native" else (lambda: uncached_greedy(model, prompts, args.new_tokens))
            times[name].append(_time(fn))
    med = statistics.median(times["native"])
    print(f"native generate: {args.prompts} prompts x {args.new_tokens} new tokens, {args.flavor}, fp32, CPU: "
          f"median {med:.3f} s, {tokens / med:,.0f} new tokens/s")
    if times["uncached"]:
        ref_med = statistics.median(times["uncached"])
        print(f"uncached reference: median {ref_med:.3f} s, {tokens / ref_med:,.0f} new tokens/s")
        print(ratio_line("native/uncached", [tokens / t for t in times["native"]],
                         [tokens / t for t in times["uncached"]], "tokens/s"))
    return times


def bench_vllm(args) -> dict[str, list[float]]:
    """Interleaved rounds of the vLLM and the native generator on the same weights."""
    from titan.rl.generate.vllm import VLLMGenerator

    max_len = args.prompt_len + args.new_tokens
    model = build_llama3(args.flavor, vocab_size=args.vocab_size, max_seq_len=max_len)
    model.init_weights(seed=0)
    model.eval()
    native = NativeGenerator(model, device="cpu", max_batch_size=args.prompts)
    vllm_gen = VLLMGenerator(Llama3StateDictAdapter(model.args).hf_config(), architecture="TitanLlama3ForCausalLM",
                             kv_cache_memory_bytes=256 << 20, max_num_seqs=args.prompts)
    vllm_gen.load_weights(model.state_dict().items(), version=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, args.vocab_size, (args.prompt_len - (i % 4),), generator=g).tolist()
               for i in range(args.prompts)]
    greedy = SamplingConfig(temperature=0, max_new_tokens=args.new_tokens)
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    first = [[grp[0].token_ids for grp in gen.generate(prompts, greedy)] for gen in (native, vllm_gen)]
    if first[0] != first[1]:
        raise SystemExit("vLLM and native greedy tokens disagree; not timing")
    times: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    for r in range(args.rounds):
        order = [("native", native), ("vllm", vllm_gen)]
        for name, gen in order if r % 2 == 0 else order[::-1]:
            for mode, sampling in (("greedy", greedy), ("sampled", sampled)):
                start = time.perf_counter()
                out = gen.generate(prompts, sampling)
                times.setdefault(f"{name} {mode}", []).append(time.perf_counter() - start)
                tokens[f"{name} {mode}"] = sum(len(grp[0].token_ids) for grp in out)
    for mode in ("greedy", "sampled"):
        rates = {name: [tokens[f"{name} {mode}"] / t for t in times[f"{name} {mode}"]] for name in ("vllm", "native")}
        print(f"{mode}: vLLM median {statistics.median(rates['vllm']):,.0f} new tokens/s, native "
              f"{statistics.median(rates['native']):,.0f} ({args.prompts} prompts x {args.new_tokens} new tokens, "
              f"{args.flavor}, fp32, CPU)")
        print(ratio_line(f"vllm/native {mode}", rates["vllm"], rates["native"], "tokens/s"))
    return times


def bench_sync(args) -> dict[str, list[float]]:
    """Interleaved rounds of a colocated sync and the plain load_state_dict floor."""
    with tempfile.TemporaryDirectory() as folder:
        engine = _engine(args.flavor, args.vocab_size, args.prompt_len + args.new_tokens, folder)
        try:
            model = build_llama3(args.flavor, vocab_size=args.vocab_size, max_seq_len=args.prompt_len + args.new_tokens)
            model.init_weights(seed=1)
            generator = NativeGenerator(model, device="cpu")
            gathered = {k: v.clone() for k, v in engine.full_state_dict()}
            nbytes = sum(t.numel() * t.element_size() for t in gathered.values())
            times = {"sync": [], "load_state_dict": []}
            for r in range(args.rounds):
                order = ("sync", "load_state_dict") if r % 2 == 0 else ("load_state_dict", "sync")
                for name in order:
                    if name == "sync":
                        times[name].append(sync_colocated(engine, generator, version=r + 1).seconds)
                    else:
                        times[name].append(_time(lambda: model.load_state_dict(gathered)))
        finally:
            engine.close()
    print(f"colocated sync ({args.flavor}, {nbytes / 2**20:.1f} MiB fp32, verified): "
          f"median {statistics.median(times['sync']) * 1e3:.1f} ms; load_state_dict floor "
          f"{statistics.median(times['load_state_dict']) * 1e3:.1f} ms")
    print(ratio_line("sync/load_state_dict", times["sync"], times["load_state_dict"], "seconds"))
    return times


def disaggregated_worker(flavor: str, vocab: int, rounds: int) -> None:
    """One rank of the disaggregated sync job (run under torchrun by `bench_disaggregated`)."""
    from datetime import timedelta

    import torch.distributed as dist
    from titan.rl.weight_sync import WeightBroadcaster
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    trainers, generators = list(range(world // 2)), list(range(world // 2, world))
    trainer_group = dist.new_group(trainers)
    sync = WeightBroadcaster(trainer_ranks=trainers, generator_ranks=generators)
    model = build_llama3(flavor, vocab_size=vocab, max_seq_len=256)
    model.init_weights(seed=rank)
    if rank in trainers:
        mesh = DeviceMesh.from_group(trainer_group, "cpu")
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        times = []
        for version in range(1, rounds + 1):
            dist.barrier(trainer_group)
            full = ((n, p.full_tensor()) for n, p in model.named_parameters())
            times.append(sync.send(full, version=version).seconds)
        if rank == 0:
            print(f"disaggregated sync ({flavor}, {len(trainers)} trainer + {len(generators)} generator gloo "
                  f"ranks, verified): median {statistics.median(times) * 1e3:.1f} ms over {rounds} syncs")
    else:
        generator = NativeGenerator(model, device="cpu")
        for _ in range(rounds):
            sync.receive(generator)
    dist.barrier()
    dist.destroy_process_group()


def bench_disaggregated(args) -> None:
    """Run `disaggregated_worker` on 2 x `--disaggregated` ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(2 * args.disaggregated),
           "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", __file__, "--worker",
           "--flavor", args.flavor, "--vocab-size", str(args.vocab_size), "--rounds", str(args.rounds)]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"disaggregated sync job failed:\n{done.stderr[-3000:]}")
    print(done.stdout.strip())


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    """Run both benchmarks; returns the per-round times of each variant."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="debugmodel", choices=list(LLAMA3_FLAVORS))
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32, help="longest prompt (others up to 3 shorter)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-reference", action="store_true", help="skip the uncached reference")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 keeps the default)")
    parser.add_argument("--disaggregated", type=int, default=0,
                        help="also time a disaggregated sync with this many trainer and generator ranks each")
    parser.add_argument("--vllm", action="store_true", help="also time the vLLM generator against the native one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        disaggregated_worker(args.flavor, args.vocab_size, args.rounds)
        return {}
    results = {"generate": bench_generation(args), "sync": bench_sync(args)}
    if args.vllm:
        results["vllm"] = bench_vllm(args)
    if args.disaggregated:
        bench_disaggregated(args)
    return results


if __name__ == "__main__":
    main()
