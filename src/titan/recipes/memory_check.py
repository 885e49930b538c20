"""Refuse a run that cannot fit, before anything is built.

A run whose activations outgrow the machine does not fail at once: on CPU it grows until the
kernel's OOM killer ends it minutes later (exit 137, no message); on a GPU it dies at the
first large allocation, after the set-up. `check_memory` estimates this rank's peak with the
dry run's estimator (`titan.dist.dry_run`: parameters, gradients, optimizer states,
activations, the block a checkpointed backward recomputes), adds what the process already
holds (on CPU), compares it with the device's memory and refuses with one line that names the
flags that would fit; ``--debug.skip_memory_check`` runs it anyway.

A generator rank of a disaggregated ``titan rl`` run (the launch's last ``--rl.generator_ranks``)
trains nothing: it checks its generating copy instead (the dry run's ``generator_bytes``: a
native float32 copy, or vLLM's share of the weights plus its KV cache bound), and its refusal
names the ``--generator.*`` flags that would fit (a vLLM engine that does not fit its GPU
otherwise fails minutes later in vLLM's own start-up).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist
from titan.dist.dry_run import RankEstimate, format_bytes

from titan.recipes.dry_run import (
    generator_bytes,
    generator_copy_description,
    generator_ranks_of,
    policy_params,
    run_dry_run,
    with_rl_models,
)


class MemoryCheckError(ValueError):
    """The run's estimated peak memory per rank exceeds the device's (a usage error: exit 2)."""


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _resident_bytes() -> int:
    """What this process holds in RAM now (the interpreter, torch and titan loaded)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def device_memory() -> tuple[int, str] | None:
    """(bytes one rank may use, where that figure comes from): the GPU's memory (the one this
    rank's LOCAL_RANK names), or on CPU the available RAM shared by this node's ranks. None
    where it cannot be read (the check is then skipped)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        return torch.cuda.get_device_properties(index).total_memory, f"the memory of cuda:{index}"
    available = _meminfo_bytes("MemAvailable")
    if available is None:
        return None
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = f", shared by {ranks} ranks" if ranks > 1 else ""
    return available // ranks, f"available RAM{share}"


def trainer_world_size(config: Any) -> int:
    """The ranks that train: the launch's, less the generator ranks of a disaggregated RL run
    (a launch with none left to train is refused: ValueError)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return world_size - generator_ranks_of(config, world_size)


def generator_rank_of(config: Any) -> int | None:
    """This process's rank when it is one of a disaggregated ``titan rl`` run's generator ranks
    (the launch's last ``--rl.generator_ranks``); None on a rank that trains."""
    try:
        trainers = trainer_world_size(config)
    except ValueError:  # no rank left to train: the run refuses it with that message
        return None
    rank = int(os.environ.get("RANK", "0"))
    return rank if rank >= trainers else None


def _generator_fitting_flags(generator: Any, params: int, generator_ranks: int, budget: int) -> list[str]:
    """``--generator.*`` flags under which one generator rank's copy of a ``params``-parameter
    model fits ``budget`` bytes: vLLM (bfloat16, sharded as little as fits) in place of the
    native float32 copy; for vLLM,
    the least engine sharding the generator ranks allow that fits (in the engine's dtype, and
    in bfloat16 for a float32 engine), and the largest KV cache bound (whole MiB) that fits
    beside the weights."""

    def fits(**changes: Any) -> bool:
        return generator_bytes(dataclasses.replace(generator, **changes), params) <= budget

    def shardings(start: int) -> list[int]:
        return [n for n in range(start, generator_ranks + 1) if generator_ranks % n == 0 or n == start]

    if generator.kind == "native":
        n = next((n for n in shardings(1) if fits(kind="vllm", dtype="bfloat16", tensor_parallel_size=n)), None)
        return [] if n is None else [
            "--generator.kind vllm --generator.dtype bfloat16" + (f" --generator.tensor_parallel_size {n}" if n > 1 else "")]
    flags = []
    current = generator.tensor_parallel_size
    dtypes = [generator.dtype] + (["bfloat16"] if generator.dtype == "float32" else [])
    for dtype in dtypes:
        # The least sharding that fits in this dtype (the current one only in another dtype).
        n = next((n for n in shardings(current) if (dtype, n) != (generator.dtype, current)
                  and fits(dtype=dtype, tensor_parallel_size=n)), None)
        if n is not None:
            flags.append(" ".join([f"--generator.tensor_parallel_size {n}"] * (n != current)
                                  + [f"--generator.dtype {dtype}"] * (dtype != generator.dtype)))
    room = budget - (generator_bytes(generator, params) - generator.kv_cache_memory_bytes)  # beside the weights
    if room >= 1 << 20:
        flags.append(f"--generator.kv_cache_memory_bytes {room >> 20 << 20}")
    return flags


def _check_generator_rank(config: Any, rank: int, limit: int, source: str, process: int) -> None:
    """Refuse a generator rank whose generating copy does not fit ``limit`` bytes (with what
    the process already holds), naming the ``--generator.*`` flags that would."""
    generator = config.generator
    params = policy_params(config)
    held = generator_bytes(generator, params)
    if held + process <= limit:
        return
    flags = _generator_fitting_flags(generator, params, config.rl.generator_ranks, limit - process)
    fits = f"it fits with {' or '.join(flags)}; " if flags else "a larger device or a smaller model is needed; "
    parts = f"{generator_copy_description(generator)} {format_bytes(held)}" + (
        f", process {format_bytes(process)}" if process else "")
    raise MemoryCheckError(
        f"generator rank {rank} (--rl.generator_ranks {config.rl.generator_ranks}) needs about "
        f"{format_bytes(held + process)} ({parts}), more than the {format_bytes(limit)} of {source}: {fits}"
        "--debug.skip_memory_check runs it anyway"
    )


def _largest_rank(config: Any, world_size: int) -> RankEstimate:
    estimates = with_rl_models(config, run_dry_run(config, world_size, print_fn=lambda line: None))
    return max(estimates, key=lambda e: e.total_bytes)


def _with(config: Any, section: str, **changes: Any) -> Any:
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **changes)})


def _fitting_flags(config: Any, world_size: int, budget: int) -> list[str]:
    flags = []
    batch = config.training.local_batch_size // 2
    while batch >= 1:
        smaller = _with(config, "training", local_batch_size=batch, global_batch_size=-1)
        if _largest_rank(smaller, world_size).total_bytes <= budget:
            flags.append(f"--training.local_batch_size {batch}")
            break
        batch //= 2
    if config.activation_checkpoint.mode != "full":
        full = _with(config, "activation_checkpoint", mode="full")
        if _largest_rank(full, world_size).total_bytes <= budget:
            flags.append("--activation_checkpoint.mode full")
    return flags


def _verdict(config: Any, world_size: int, budget: int | None) -> tuple[RankEstimate, list[str]]:
    estimate = _largest_rank(config, world_size)
    over = budget is not None and estimate.total_bytes > budget
    return estimate, _fitting_flags(config, world_size, budget) if over else []


def _isolated(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a forked child of this process, its result (or its error) sent back.

    The estimator parallelizes a meta model on a fake process group of its own, which leaves
    process-group state behind (measured: a later real group then resolved mesh groups to the
    destroyed fake one, and a 2-rank FSDP checkpoint was refused as half its tensors): the
    process that trains must never run it. A fork costs milliseconds and shares the imports."""
    if not hasattr(os, "fork"):
        return fn(*args)
    # The estimate's first meta-tensor initialization imports torch._dynamo (~1 s of CPU), which
    # the training process imports anyway (its optimizer and determinism settings do): imported
    # here, before the fork, it is imported once per process instead of once in the child (whose
    # work is then ~0.05 s) and again in the parent.
    import torch._dynamo  # noqa: F401

    sys.stdout.flush()
    sys.stderr.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, report, leave without running any exit handler
        os.close(read)
        try:
            try:
                payload = pickle.dumps(("ok", fn(*args)))
            except BaseException as err:  # noqa: BLE001 - every failure goes back to the parent
                payload = pickle.dumps(("error", type(err).__name__, str(err), isinstance(err, ValueError)))
            with os.fdopen(write, "wb") as out:
                out.write(payload)
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as incoming:
        data = incoming.read()
    os.waitpid(pid, 0)
    if not data:
        raise RuntimeError("the memory estimate's process died without a result (--debug.skip_memory_check skips it)")
    result = pickle.loads(data)  # noqa: S301 - our own child's
    if result[0] == "ok":
        return result[1]
    _, name, message, usage = result
    raise (ValueError if usage else RuntimeError)(message if usage else f"{name}: {message}")


def estimate_peak_bytes(config: Any, world_size: int) -> tuple[int, RankEstimate]:
    """This run's peak memory per rank by the dry run's estimator (the largest pipeline
    rank), plus on CPU what the process already holds; and that rank's estimate."""
    estimate, _ = _isolated(_verdict, config, world_size, None)
    return estimate.total_bytes + _process_bytes(), estimate


def _process_bytes() -> int:
    """What the process holds that the estimate leaves out: on CPU, its resident memory."""
    return 0 if torch.cuda.is_available() else _resident_bytes()


def fitting_flags(config: Any, world_size: int, limit: int) -> list[str]:
    """Flags that bring the estimate under ``limit``: the largest local batch that fits (halving
    it), and full activation checkpointing at the current batch."""
    return _isolated(_fitting_flags, config, world_size, limit - _process_bytes())


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """A run's estimated peak memory per rank against the device's."""

    needed: int
    """Estimated peak bytes per rank (the dry run's estimate plus what the process holds)."""
    limit: int
    """Bytes one rank may use."""
    source: str
    """Where ``limit`` comes from (e.g. "available RAM")."""
    estimate: RankEstimate
    """The dry run's estimate of the largest pipeline rank."""

    @property
    def fits(self) -> bool:
        """Whether the estimate stays within the device's memory."""
        return self.needed <= self.limit

    def components(self) -> str:
        """The estimate's parts, the process's own memory included."""
        process = self.needed - self.estimate.total_bytes
        return self.estimate.components() + (f", process {format_bytes(process)}" if process else "")

    def summary(self) -> str:
        """One line for the run's log."""
        return (f"memory estimate: {format_bytes(self.needed)} peak per rank ({self.components()}) of "
                f"{format_bytes(self.limit)} of {self.source}")


def check_memory(config: Any) -> MemoryEstimate | None:
    """This run's `MemoryEstimate` (None where the device's memory cannot be read, in a
    process whose process group is already started, or on a generator rank, which checks its
    generating copy alone); raises `MemoryCheckError` (one line, with the flags that would fit)
    when it does not fit, unless ``--debug.skip_memory_check``."""
    if dist.is_initialized():
        # The estimator parallelizes on a fake process group of its own; a process that runs
        # several trainings in one group (a test harness) checked before its first.
        return None
    device = device_memory()
    if device is None:
        return None
    limit, source = device
    process = _process_bytes()
    skip = config.debug.skip_memory_check
    generator_rank = generator_rank_of(config)
    if generator_rank is not None:
        if not skip:
            _check_generator_rank(config, generator_rank, limit, source, process)
        return None
    try:
        estimate, flags = _isolated(_verdict, config, trainer_world_size(config), None if skip else limit - process)
    except ValueError:
        # A configuration the estimator refuses: the build that follows refuses it with the same
        # one-line message (or, for a limit of the estimator's own, e.g. a quantization recipe
        # it cannot parallelize for this CPU, builds it unchecked).
        return None
    except RuntimeError as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"titan: warning: no memory estimate ({err}); the run starts unchecked", file=sys.stderr)
        return None
    result = MemoryEstimate(needed=estimate.total_bytes + process, limit=limit, source=source, estimate=estimate)
    if result.fits or skip:
        return result
    fits = f"it fits with {' or '.join(flags)}, or on more ranks; " if flags else "reduce the run or add ranks; "
    training = config.training
    raise MemoryCheckError(
        f"this run needs about {format_bytes(result.needed)} per rank ({result.components()}; local batch "
        f"{training.local_batch_size} x seq {training.seq_len}), more than the {format_bytes(limit)} of {source}: "
        f"{fits}--debug.skip_memory_check runs it anyway"
    )


def warn_beyond_context(config: Any, max_seq_len: int | None) -> None:
    """Warn (rank 0, stderr) when --training.seq_len exceeds the flavor's context length."""
    seq_len = config.training.seq_len
    if max_seq_len is None or seq_len <= max_seq_len or int(os.environ.get("RANK", "0")) != 0:
        return
    print(
        f"titan: warning: --training.seq_len {seq_len} exceeds {config.model.name} {config.model.flavor}'s context "
        f"length ({max_seq_len}): RoPE positions past {max_seq_len} are ones a pretrained checkpoint never saw "
        "(its attention degrades there unless the rope scaling is extended for the longer context)",
        file=sys.stderr,
    )


__all__ = ["MemoryCheckError", "MemoryEstimate", "check_memory", "device_memory", "estimate_peak_bytes", "fitting_flags",
           "generator_rank_of", "trainer_world_size", "warn_beyond_context"]
