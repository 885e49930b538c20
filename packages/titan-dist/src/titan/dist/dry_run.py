"""Dry run: validate, build the mesh and parallelize for any world size on one CPU.

A fake process group (torch's testing "fake" backend: every collective returns at once)
stands in for the cluster, and the model lives on the meta device, so a 512-rank 405B
configuration is checked in seconds without a GPU or any memory for weights. Ranks that
differ only along data/tensor/context axes hold same-sized shards, so one representative
rank per pipeline rank is parallelized and reported. That holds with expert parallel too:
every EP rank owns n_experts / ep experts, FSDP-sharded over the expert mesh, and the local
parameter count is read off the DTensor shards, so experts are counted sharded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from titan.dist.config import ZERO_BUBBLE_SCHEDULES  # their order comes from torch's builder (`pipeline_actions`)
from titan.dist.dims import EXPERT_VIEWS, FLATTENED, ParallelDims
from titan.dist.fsdp import DTYPES, check_cpu_offload_has_fsdp, check_reshard_under_zero_bubble, reshard_after_forward
from titan.dist.pipeline import num_stages_for, stage_ids_of_rank, stage_layer_keys
from titan.dist.plan import blocks_of, match_modules, sharding_plan

_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
# Activation elements kept per token per block, in units of the model dim, when a model's
# blocks cannot be measured (`measure_block_units`): everything, or only the block input (a
# checkpointed block: full, or layer-selective's every k-th block). "none" is what autograd
# saves for titan's pre-norm attention + SwiGLU block in eager mode in fp32 (measured with
# saved-tensor hooks, tests/test_dry_run.py: 21-22); compiled blocks save less.
ACT_UNITS_PER_TOKEN = {"none": 22, "full": 1}
"""Activation elements kept per token per block, in model-dim units, with no AC and with the
whole block checkpointed; per-op selective AC depends on the block's linears
(`selective_op_units`). The layout planner (`titan.dist.planner`) uses the same figures."""


def selective_op_units(block: nn.Module, dim: int) -> float:
    """Model-width units per token `block` keeps under per-op selective AC
    (`titan.dist.activation_checkpoint` saves every matmul's output and recomputes the rest):
    its input, the attention's output and each linear's output; routed experts' grouped
    matmuls are recomputed. Measured with torch's `MemTracker` (tests/test_plan.py): 12.0 for
    the Llama debug block (12 predicted), 5.1 for the Qwen3-MoE one (5.0); Llama 3 8B: 12.5."""
    outputs = sum(m.out_features for m in block.modules() if isinstance(m, nn.Linear))
    return 2 + outputs / dim


def measure_block_units(model_fn: Callable[[], nn.Module], *, seq_len: int = 64,
                        dtype: torch.dtype = torch.float32, selective: bool = True,
                        compiled: bool = False, converted: bool = False,
                        model_key: Hashable | None = None) -> dict[str, float] | None:
    """Model-width units per token of the model's blocks, in `dtype` (fp32 intermediates such
    as RoPE's and RMSNorm's count twice a bf16 unit): what a block keeps for backward with no
    AC ("none") and, if `selective`, with per-op selective AC ("selective"), what its backward allocates on
    top, parameter gradients aside ("backward": the activation gradients in flight), and what
    it keeps without AC when `compiled` ("none_compiled": the forward outputs AOTAutograd's
    min-cut partitioner, which inductor uses, saves for the backward, plus the block input;
    otherwise equal to "none"), and with per-op selective AC when `compiled` and `selective`
    ("selective_compiled", the same partition under the policy's tags; otherwise equal to
    "selective").

    Measured by running the forward up to a block, and that block's backward, on fake tensors
    (no memory, no compute, the real shapes) under torch's `MemTracker`, in about a second:
    the first block and, in an MoE model, the first block with routed experts, averaged over
    the model's blocks of each kind. None when an op has no fake kernel (CPU's grouped matmul
    takes bf16 only, so an fp32 MoE model); callers then use `ACT_UNITS_PER_TOKEN` and
    `selective_op_units`.

    `converted`: `model_fn` converts the linears (torchao float8), whose casts of the weights
    are sized by the weights, not by the tokens: measured at 64 tokens they would read as
    hundreds of units. The block is then measured at half `seq_len` and all of it, and each figure
    split into its part per token (the units returned) and its part per block
    ("<key>_fixed_bytes"). Measured for float8, tensorwise and rowwise: what a block keeps has
    no fixed part (eager float8 saves the linears' high-precision inputs, as bf16 does;
    compiled, the float8 casts of the inputs and not of the weights, as inductor treats
    parameters as free to save); its backward casts the weights and their gradients
    ("backward_fixed_bytes", a transient of one block).

    `model_key`: a value that identifies what `model_fn` builds (the recipe's model and
    conversion flags); the figures of one key and these arguments are then measured once per
    process (`titan plan`, the dry run and the pre-run memory check of one process ask for the
    same model's; each measurement traces the model, ~1 s)."""
    measure = functools.partial(_measure_block_units, model_fn, seq_len=seq_len, dtype=dtype, selective=selective,
                                compiled=compiled, converted=converted)
    if model_key is None:
        return measure()
    key = (model_key, seq_len, dtype, selective, compiled, converted)
    if key not in _MEASURED_UNITS:
        _MEASURED_UNITS[key] = measure()
    measured = _MEASURED_UNITS[key]
    return None if measured is None else dict(measured)


_MEASURED_UNITS: dict[tuple, dict[str, float] | None] = {}
"""`measure_block_units`' figures by model key and arguments."""


def _measure_block_units(model_fn: Callable[[], nn.Module], *, seq_len: int, dtype: torch.dtype, selective: bool,
                         compiled: bool, converted: bool) -> dict[str, float] | None:
    """`measure_block_units`, measured."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)  # an op without a fake kernel is expected: the rules apply
    try:
        with _default_dtype(dtype):
            per_kind = [(_units_of_block(model_fn, seq_len, index, selective=selective, compiled=compiled,
                                         converted=converted), count)
                        for index, count in _block_kinds(model_fn)]
    except Exception:  # noqa: BLE001 - any op without a fake kernel: fall back to the rules
        return None
    finally:
        fake_log.setLevel(level)
    total = sum(count for _, count in per_kind)
    return {key: sum(units[key] * count for units, count in per_kind) / total for key in per_kind[0][0]}


def _units_of_block(model_fn: Callable[[], nn.Module], seq_len: int, index: int, *, selective: bool,
                    compiled: bool, converted: bool = False) -> dict[str, float]:
    """`measure_block_units`' figures for block `index` alone."""
    if converted:
        # Half the tokens and all of them: the model's positions may end at `seq_len`.
        short = _units_of_block(model_fn, seq_len // 2, index, selective=selective, compiled=compiled)
        long = _units_of_block(model_fn, seq_len // 2 * 2, index, selective=selective, compiled=compiled)
        return split_fixed_bytes(short, long, seq_len // 2, _unit_bytes(model_fn))
    kept, backward = _measure_block(model_fn, seq_len, index, per_op=False)
    units = {"none": kept, "backward": backward, "none_compiled": kept}
    if selective:
        units["selective"], _ = _measure_block(model_fn, seq_len, index, per_op=True)
        units["selective_compiled"] = units["selective"]
    if compiled:
        try:
            units["none_compiled"] = _measure_compiled_block(model_fn, seq_len, index)
            if selective:
                units["selective_compiled"] = _measure_compiled_block(model_fn, seq_len, index, per_op=True)
        except Exception:  # noqa: BLE001 - a block AOTAutograd cannot trace: as eager
            pass
    return units


def split_fixed_bytes(short: dict[str, float], long: dict[str, float], seq_len: int,
                      unit_bytes: int) -> dict[str, float]:
    """Units per token measured at `seq_len` (`short`) and twice it (`long`) -> each key's
    part per token and, as "<key>_fixed_bytes", its part per block: bytes = a x tokens + F
    makes the units a / u + F / (u x tokens), with u = `unit_bytes` per token."""
    split = {}
    for key, at_short in short.items():
        split[key] = 2 * long[key] - at_short
        split[f"{key}_fixed_bytes"] = 2 * seq_len * (at_short - long[key]) * unit_bytes
    return split


def _unit_bytes(model_fn: Callable[[], nn.Module]) -> int:
    """Bytes of one model-width activation per token in the default (compute) dtype."""
    with torch.device("meta"):
        dim, _ = _model_shape(model_fn())
    return dim * torch.get_default_dtype().itemsize


def _block_kinds(model_fn: Callable[[], nn.Module]) -> list[tuple[int, int]]:
    """(index of the first block of a kind, blocks of that kind) for the model's dense blocks
    and its blocks with routed experts (the plan's `expert_modules`)."""
    with torch.device("meta"):
        model = model_fn()
    plan = sharding_plan(model)
    experts = getattr(plan, "expert_modules", None)
    expert_names = {name for name, _ in match_modules(model, experts)} if experts else set()
    container = plan.layer_container
    kinds: dict[bool, list[int]] = {}
    for index, (key, _) in enumerate(blocks_of(model)):
        routed = any(name.startswith(f"{container}.{key}.") for name in expert_names)
        kinds.setdefault(routed, []).append(index)
    return [(indices[0], len(indices)) for indices in kinds.values()]


class _BlockDone(Exception):
    """Stops a measuring forward once the measured block has run."""


_TOTAL = "Total"
_NOT_ACTIVATIONS = ("_MemRefType.PARAM", "_MemRefType.BUFFER", "_MemRefType.GRAD")
"""`MemTracker` snapshot categories that are not activations or their gradients."""


def _nth_block(model: nn.Module, index: int) -> nn.Module:
    return [block for _, block in blocks_of(model)][index]


def _measure_block(model_fn: Callable[[], nn.Module], seq_len: int, index: int, *,
                   per_op: bool) -> tuple[float, float]:
    """(units block `index` keeps after its forward, units its backward allocates beyond
    its parameters' gradients), with per-op selective AC when `per_op`."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from titan.dist.activation_checkpoint import checkpoint_block

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model_fn()
        block = _nth_block(model, index)
        if per_op:
            checkpoint_block(block, per_op=True)
        dim, vocab = _model_shape(model)
        forward, marks, outputs = MemTracker(), [], []
        forward.track_external(model)

        def live(tracker) -> int:
            return sum(v[_TOTAL] for v in tracker.get_tracker_snapshot("current").values())

        def enter(_module, args):
            marks.append(live(forward))
            # The block's input as a leaf: its backward stops there, as the block's own part.
            outputs.append(args[0].detach().requires_grad_())
            return (outputs[-1], *args[1:])

        def leave(_module, _args, output):
            marks.append(live(forward) - marks.pop())
            outputs.append(output)
            raise _BlockDone

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
        try:
            with forward:
                model(torch.randint(0, vocab, (1, seq_len)))
        except _BlockDone:
            pass
        backward = MemTracker()  # counts only what the backward allocates
        backward.track_external(model)
        block_input, output = outputs
        with backward:
            # The activations' gradients only: the weights' gradients are FSDP's (fsdp_buffer_bytes).
            output.backward(torch.ones_like(output), inputs=[block_input])
        allocated = sum(snap[_TOTAL] - sum(v for k, v in snap.items() if str(k) in _NOT_ACTIVATIONS)
                        for snap in backward.get_tracker_snapshot("peak").values())
        unit = seq_len * dim * torch.get_default_dtype().itemsize
        return marks[0] / unit, allocated / unit


def measure_compiled_block_units(model_fn: Callable[[], nn.Module], *, seq_len: int = 64,
                                 dtype: torch.dtype = torch.float32, context_fn: Callable | None = None) -> float:
    """Model-width units per token the model's first block keeps when compiled, under the
    selective-checkpoint contexts `context_fn` returns (another framework's per-op policy, say;
    None: no AC), as `measure_block_units` measures titan's own."""
    with _default_dtype(dtype):
        return _measure_compiled_block(model_fn, seq_len, 0, context_fn=context_fn)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build (fake) models in `dtype`, as the compute dtype runs them; restored after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _measure_compiled_block(model_fn: Callable[[], nn.Module], seq_len: int, index: int, *,
                            per_op: bool = False, context_fn: Callable | None = None) -> float:
    """Units block `index` keeps when compiled, without AC or (`per_op`) with titan's per-op
    selective AC (`context_fn`: another policy's): its forward traced by AOTAutograd on fake
    tensors and split by the min-cut partitioner, which honours the policy's save /
    recompute tags; the saved tensors are the forward graph's outputs beyond the block's own,
    each storage once, the inputs' (parameters, the block input) aside; the block input then
    counts as one unit, as in eager."""
    from functorch.compile import aot_function, make_boxed_func, min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call
    from torch.multiprocessing.reductions import StorageWeakRef

    from titan.dist.activation_checkpoint import checkpoint_block

    def partition(joint, inputs, **kwargs):
        # Outside torch.compile no graph id is given to the policy's tagged nodes; one
        # checkpointed region: give them all the same.
        for node in joint.graph.nodes:
            if "recompute" in node.meta and node.meta.get("ac_graph_id") is None:
                node.meta["ac_graph_id"] = 1
        # As torch.compile lifts them: the parameters live for the whole step, and the
        # partitioner saves them for free rather than what is computed from them (a float8
        # linear otherwise keeps its weight's cast, per block and microbatch).
        kwargs["static_lifetime_input_indices"] = list(range(len(names)))
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    saved: list[int] = []

    def count_saved(graph_module, _inputs):
        nodes = list(graph_module.graph.nodes)
        given = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in nodes
                 if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
        output = next(n for n in nodes if n.op == "output")
        storages = {}
        for node in output.args[0][1:]:
            value = getattr(node, "meta", {}).get("val")
            if isinstance(value, torch.Tensor) and StorageWeakRef(value.untyped_storage()) not in given:
                storages[StorageWeakRef(value.untyped_storage())] = value.untyped_storage().nbytes()
        saved.append(sum(storages.values()))
        return make_boxed_func(graph_module)

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model_fn()
        block = _nth_block(model, index)
        if per_op or context_fn:
            checkpoint_block(block, per_op=per_op, context_fn=context_fn)
        names = [name for name, _ in block.named_parameters()]
        eager = block.forward
        traced = aot_function(lambda params, args, kwargs: functional_call(block, dict(zip(names, params)), args, kwargs),
                              fw_compiler=count_saved, bw_compiler=make_boxed_func, partition_fn=partition)

        def forward(*args, **kwargs):
            block.forward = eager  # functional_call runs the block's own forward
            hidden = args[0].detach().requires_grad_()
            traced(list(block.parameters()), (hidden, *args[1:]), kwargs)
            raise _BlockDone

        block.forward = forward
        dim, vocab = _model_shape(model)
        try:
            model(torch.randint(0, vocab, (1, seq_len)))
        except _BlockDone:
            pass
    return 1 + saved[0] / (seq_len * dim * torch.get_default_dtype().itemsize)


_LOSS_FP32_COPIES = 3
_LOSS_PARALLEL_FP32_COPIES = 4
"""fp32 [tokens, vocab] tensors alive at the loss's peak (see `loss_peak_bytes`); measured 12.0
and 16.0 bytes per logit element (tests/test_plan.py)."""


def loss_peak_bytes(tokens: float, vocab: int, *, tp: int, loss_parallel: bool, chunk_tokens: int,
                    compute_dtype_bytes: int, compiled: bool = False) -> float:
    """Bytes of the loss over `tokens` positions at its peak, in its backward (titan frees the
    compute-dtype logits before it): the saved fp32 log-softmax and the gradients with
    respect to it and to the fp32 logits, one fp32 copy more under loss parallel (its
    vocab-parallel log-softmax, each TP rank holding vocab / tp; without loss parallel every
    TP rank holds the whole vocabulary). Chunked (`chunk_tokens` < `tokens`), those exist for
    one chunk, while the chunks' checkpoints keep the whole microbatch's compute-dtype logits
    and their gradient is assembled whole.

    ``compiled`` (``--compile.components loss``; titan compiles the loss unless it is
    vocab-parallel): the compiled backward recomputes the softmax from the logits it saved, so
    the peak is those compute-dtype logits and their gradient, chunked or not (measured: 3.98
    bytes per element in bf16, 7.96 in fp32, tests/test_plan.py)."""
    parallel = tp > 1 and loss_parallel
    width = vocab / tp if parallel else vocab
    if compiled and not parallel:
        return tokens * width * 2 * compute_dtype_bytes
    copies = _LOSS_PARALLEL_FP32_COPIES if parallel else _LOSS_FP32_COPIES
    if not chunk_tokens or chunk_tokens >= tokens:
        return tokens * width * copies * 4
    return (chunk_tokens * copies * 4 + tokens * 2 * compute_dtype_bytes) * width


def fsdp_buffer_bytes(block_unsharded: float, n_blocks: int, *, sharded: bool, pipelined: bool,
                      keeps_gathered: bool, compute_dtype_bytes: float, reduce_dtype_bytes: int = 4) -> float:
    """Bytes of FSDP's unsharded copies on one rank at its peak, for blocks of
    `block_unsharded` parameters each (TP-local, gathered over FSDP).

    Parameters, gathered in the compute dtype (`compute_dtype_bytes` per parameter: less where
    float8 weights are gathered in float8, `gathered_bytes_per_param`): the block computed and
    the one prefetched, or with `keeps_gathered` (`reshard_after_forward` off, as the engine's
    default is under PP, where every microbatch would gather them again) every block, as the
    backward starts. Gradients, in `reduce_dtype_bytes` (`--training.mixed_precision_reduce`): one
    block's before its reduce-scatter; under PP the schedule turns gradient sync off until
    the last microbatch, so FSDP accumulates the stage's unsharded gradients too.
    """
    if not sharded:
        return 0.0
    params = block_unsharded * (n_blocks if keeps_gathered else 2) * compute_dtype_bytes
    grads = block_unsharded * (n_blocks + 1 if pipelined else 1) * reduce_dtype_bytes
    return params + grads


def gathered_bytes_per_param(compute_dtype_bytes: float, float8_share: float) -> float:
    """Bytes per block parameter FSDP gathers: the compute dtype's, and 1 for the
    `float8_share` of them that float8's FSDP all-gather
    (`--quantize.linear.float8.enable_fsdp_float8_all_gather`) gathers in float8."""
    return compute_dtype_bytes - float8_share * (compute_dtype_bytes - 1)


def forwards_in_flight(schedule: str, pp: int, microbatches: int, stages_per_rank: int, pp_rank: int) -> int:
    """Forwards (microbatch x local stage) pipeline rank `pp_rank` holds at its peak, as
    `torch.distributed.pipelining` orders them: `held_block_microbatches` with one block per
    stage (under a split backward, until the weight gradients)."""
    return held_block_microbatches(schedule, pp, microbatches, stages_per_rank, pp_rank, [1] * stages_per_rank)


ORDERED_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
"""Schedules whose action order the planner builds itself (`schedule_order`)."""

TIMED_SCHEDULES = ORDERED_SCHEDULES + ZERO_BUBBLE_SCHEDULES
"""Every schedule `titan plan` times and the dry run sizes by its order."""

Action = tuple[str, int, int]
"""(kind, stage, microbatch): kind "F" (forward), "B" (whole backward), "I" (its input
gradients) or "W" (its weight gradients, after the I of the same stage and microbatch)."""


@functools.lru_cache(maxsize=256)
def pipeline_actions(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> tuple[tuple[Action, ...], ...]:
    """Each pipeline rank's computations in the order `torch.distributed.pipelining` runs
    them: `schedule_order` for the schedules the planner orders itself, torch's own builder
    (the private ``get_schedule_ops`` of its schedule visualizer, which lists the actions its
    runtime executes) for the zero-bubble ones; DualPipeV's overlapped forward-and-backward
    pairs count as the forward, then the backward."""
    if schedule in ORDERED_SCHEDULES:
        return tuple(tuple(("F" if forward else "B", stage, micro) for forward, stage, micro
                           in schedule_order(schedule, pp, microbatches, stages_per_rank, rank)) for rank in range(pp))
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        raise ValueError(f"the planner times the schedules {', '.join(TIMED_SCHEDULES)}, not {schedule}")
    try:
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
        from torch.distributed.pipelining.schedules import _ComputationType as Op
        from torch.distributed.pipelining.schedules import get_schedule_class
    except ImportError as err:  # a torch without the builder: these schedules cannot be timed
        raise ValueError(f"timing {schedule} needs torch's schedule builder, which this torch lacks ({err})") from None
    # The compute order is all the planner reads: skip the communication plan the schedule
    # derives from it on construction (quadratic in the actions: ~1.7 s per schedule at pp 63).
    base = get_schedule_class(schedule)
    order_only = type(base.__name__, (base,), {"_prepare_schedule_with_comms": lambda self, *args, **kwargs: None})
    kinds = {Op.FORWARD: "F", Op.FULL_BACKWARD: "B", Op.BACKWARD_INPUT: "I", Op.BACKWARD_WEIGHT: "W"}
    ranks = []
    for actions in get_schedule_ops(order_only, pp, microbatches, num_stages_per_rank=stages_per_rank):
        ranks.append(tuple((kinds[sub.computation_type], sub.stage_index, sub.microbatch_index)
                           for action in actions if action is not None
                           for sub in (getattr(action, "sub_actions", None) or (action,))))
    return tuple(ranks)


@functools.cache
def zero_bubble_timeable() -> bool:
    """Whether this torch's schedule builder lists the zero-bubble schedules' actions (a
    private module of `torch.distributed.pipelining`; without it the planner leaves those
    schedules out)."""
    try:
        pipeline_actions("ZBVZeroBubble", 2, 4, 2)
    except (ValueError, ImportError, AttributeError, KeyError, TypeError):
        return False
    return True


def schedule_order(schedule: str, pp: int, microbatches: int, stages_per_rank: int,
                   rank: int) -> Iterator[tuple[bool, int, int]]:
    """(is_forward, stage, microbatch) of pipeline rank `rank`'s computations, in the order
    `torch.distributed.pipelining` runs them (checked against torch's own action lists in
    tests/test_plan.py): GPipe every forward, then every backward (LoopedBFS the same, stage
    by local stage, backwards from the last stage and microbatch); 1F1B ``pp - rank``
    forwards, then a backward before each further forward; interleaved schedules (stages
    ``rank, rank + pp, ...``) warm up with ``(v - 1)`` rounds of microbatches plus 2 per hop
    from the last rank, then alternate forward and backward, each local stage taking a round
    of microbatches in turn (backwards from the last local stage)."""
    m, v = microbatches, stages_per_rank
    if schedule not in ORDERED_SCHEDULES:
        raise ValueError(f"the planner times the schedules {', '.join(ORDERED_SCHEDULES)}, not {schedule}")
    if schedule in ("GPipe", "LoopedBFS"):
        for local in range(v):
            yield from ((True, local * pp + rank, i) for i in range(m))
        backwards = range(m) if schedule == "GPipe" else range(m - 1, -1, -1)
        for local in reversed(range(v)):
            yield from ((False, local * pp + rank, i) for i in backwards)
        return
    if v == 1:
        warmup = min(m, pp - rank)
        yield from ((True, rank, i) for i in range(warmup - 1))
        for i in range(m):
            if i + warmup - 1 < m:
                yield True, rank, i + warmup - 1
            yield False, rank, i
        return
    per_round = m // max(1, m // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    forwards = {s: 0 for s in range(v)}
    backwards = {s: 0 for s in range(v)}

    def forward(op: int) -> tuple[bool, int, int]:
        local = (op // per_round) % v
        forwards[local] += 1
        return True, local * pp + rank, forwards[local] - 1

    def backward(op: int) -> tuple[bool, int, int]:
        local = v - 1 - ((op - warmup) // per_round) % v
        backwards[local] += 1
        return False, local * pp + rank, backwards[local] - 1

    for op in range(m * v + warmup):
        if op < m * v:
            yield forward(op)
        if op >= warmup:
            yield backward(op)


def held_block_microbatches(schedule: str, pp: int, microbatches: int, stages_per_rank: int, pp_rank: int,
                            local_stage_blocks: Sequence[int]) -> int:
    """Blocks x microbatches whose activations pipeline rank `pp_rank` holds at its peak, its
    ``v``-th local stage (`stage_ids_of_rank` order) having ``local_stage_blocks[v]`` blocks:
    the most its schedule order (`pipeline_actions`) leaves outstanding, each forward holding
    one microbatch in each block of its stage until its backward, or under a split backward
    until its weight gradients (the inputs of the linears wait for them; an upper bound, since
    the input-gradient half frees the rest).

    The peak is affine in the microbatches once they reach 4 x pp (constant for the 1F1B-like
    schedules, all of them for GPipe): for a multiple of pp above 12 x pp, when the orders at
    4, 8 and 12 x pp give collinear peaks, it is read off their line (tested equal to walking
    the whole order); otherwise the whole order is walked."""
    local = tuple(local_stage_blocks)
    points = (4 * pp, 8 * pp, 12 * pp)
    if microbatches > points[-1] and microbatches % pp == 0:
        p1, p2, p3 = (_held_peak(schedule, pp, m, stages_per_rank, pp_rank, local) for m in points)
        growth = (p3 - p2) * (microbatches - points[2])
        if p3 - p2 == p2 - p1 and growth % (4 * pp) == 0:
            return p3 + growth // (4 * pp)
    return _held_peak(schedule, pp, microbatches, stages_per_rank, pp_rank, local)


@functools.lru_cache(maxsize=4096)
def _held_peak(schedule: str, pp: int, microbatches: int, stages_per_rank: int, pp_rank: int,
               local_stage_blocks: tuple[int, ...]) -> int:
    """`held_block_microbatches` by walking the whole order (cached: the extrapolation of every
    larger microbatch count walks the same three)."""
    stages = stage_ids_of_rank(pp_rank, pp, pp * stages_per_rank, schedule)
    local = {stage: local_stage_blocks[v] for v, stage in enumerate(stages)}
    held = peak = 0
    for kind, stage, _ in pipeline_actions(schedule, pp, microbatches, stages_per_rank)[pp_rank]:
        if kind == "F":
            held += local[stage]
        elif kind in ("B", "W"):
            held -= local[stage]
        peak = max(peak, held)
    return peak


@dataclass
class RankEstimate:
    """Per-rank parameter count and memory estimate (bytes) for one pipeline rank."""

    ranks: str
    pp_rank: int
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    recompute_bytes: int = 0
    """The one block whose backward is running: the activations its recomputation rebuilds
    (with activation checkpointing) and its activations' gradients, freed after it (a
    transient the peak includes)."""
    loss_bytes: int = 0
    """The loss's peak over one microbatch's logits (`loss_peak_bytes`), on the rank holding
    the output projection."""
    fsdp_buffer_bytes: int = 0
    """FSDP's unsharded copies (`fsdp_buffer_bytes`): the gathered block and its prefetch, or
    under PP the whole stage and its fp32 gradients."""
    offloaded: bool = False
    """The sharded params, grads and optimizer states live in host memory
    (`--parallelism.fsdp_cpu_offload`): reported, but not in the device's `total_bytes`."""
    blocks: str = ""
    """Under pipeline parallel, the blocks of this rank's stages (e.g. ``0-2`` or ``0-1, 4-5``)."""
    copy_bytes: int = 0
    """Models the rank holds beside its share of the trained one (RL: whole copies for the
    generator and the KL reference; PPO's critic, a second model sharded as the policy with
    its gradients and optimizer states)."""
    copies: str = ""
    """What ``copy_bytes`` holds, e.g. ``generator 1.2 GiB, critic 4.8 GiB``."""

    @property
    def state_bytes(self) -> int:
        """The sharded params, gradients and optimizer states."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        """The device's peak: params + grads + optimizer states (unless offloaded to the host)
        + activations (+ one block's recomputation, the loss's peak, FSDP's unsharded copies,
        whole model copies)."""
        return ((0 if self.offloaded else self.state_bytes) + self.activation_bytes
                + self.recompute_bytes + self.loss_bytes + self.fsdp_buffer_bytes + self.copy_bytes)

    def components(self) -> str:
        """The estimate's parts, e.g. ``params 18.64 MiB, grads ..., activations 1.61 GiB``."""
        states = (f"params {format_bytes(self.param_bytes)}, grads {format_bytes(self.grad_bytes)}, "
                  f"optimizer {format_bytes(self.optimizer_bytes)}")
        parts = [f"on the host: {states}" if self.offloaded else states,
                 f"activations {format_bytes(self.activation_bytes)}"]
        if self.recompute_bytes:
            parts.append(f"one block's backward {format_bytes(self.recompute_bytes)}")
        if self.loss_bytes:
            parts.append(f"loss {format_bytes(self.loss_bytes)}")
        if self.fsdp_buffer_bytes:
            parts.append(f"FSDP buffers {format_bytes(self.fsdp_buffer_bytes)}")
        if self.copy_bytes:
            parts.append(f"model copies {format_bytes(self.copy_bytes)} ({self.copies})")
        return ", ".join(parts)

    def line(self) -> str:
        """One human-readable report line."""
        blocks = f" | blocks {self.blocks}" if self.blocks else ""
        return (f"ranks {self.ranks:>12} (pp {self.pp_rank}): {self.params:,} params | "
                f"{self.components()}, total {format_bytes(self.total_bytes)}{blocks}")


def format_bytes(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1."""
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _local_numel(module: nn.Module) -> int:
    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel()
               for p in module.parameters())


HEAD_STYLES = ("output", "score")
"""The tensor-parallel styles of a model's final projection: a language model's vocabulary
("output", vocab-parallel) or a reward model's score head ("score", replicated)."""


def _output_modules(model: nn.Module, styles: tuple[str, ...] = HEAD_STYLES) -> list[nn.Module]:
    """The modules the plan marks as the final projection (``styles``) that this part holds."""
    plan = sharding_plan(model)
    globs = [g for g, style in getattr(plan, "tensor_parallel", {}).items() if style in styles]
    return [m for g in globs for _, m in match_modules(model, g) if m is not None]


def _model_shape(model: nn.Module) -> tuple[int, int]:
    """(model dim, vocab size) from the shape of the output projection's [vocab, dim] weight,
    which the model's sharding plan names: no family attribute is read."""
    outputs = _output_modules(model)
    if not outputs:
        raise ValueError("the dry run needs the model's sharding plan to name its output projection "
                         "(tensor_parallel style \"output\" or \"score\")")
    vocab, dim = outputs[0].weight.shape
    return int(dim), int(vocab)


GATHERED_INPUT_UNITS = 2.0
"""Of a block's units, those TP cannot shard: attention's and the feed-forward's inputs, which
sequence parallel gathers whole before the sharded matmuls save them."""
REPLICATED_UNITS_WITHOUT_SP = 4.0
"""The units TP without sequence parallel leaves whole (no AC): each of a block's two RMSNorms
keeps its input and its output (the sharded matmuls' input); its hand-written backward keeps
one number per row beside them (6 units while autograd's chain also kept the normalized
input). Checked against autograd's saved tensors in a real TP 2 step (tests/test_plan.py)."""


def float8_gathered_units(float8_input_gathers: float, compute_dtype_bytes: int) -> float:
    """The units of a block's two gathered inputs when float8 tensor parallel gathers
    `float8_input_gathers` of them (per block) in float8: one byte an element instead of the
    compute dtype's."""
    return GATHERED_INPUT_UNITS - float8_input_gathers * (1 - 1 / compute_dtype_bytes)


def rank_block_units(units: float, mode: str, *, tp: int = 1, cp: int = 1, sequence_parallel: bool = True,
                     kv_fraction: float = 0.0, gathered_units: float = GATHERED_INPUT_UNITS) -> float:
    """Model-width units per token of its sequence shard that one block keeps on one rank, of
    the `units` it keeps whole under `mode` ("none"; "selective", per op; "full": its input).
    TP shards all but what its matmuls gather whole (`GATHERED_INPUT_UNITS`, or
    `REPLICATED_UNITS_WITHOUT_SP` without SP and AC); a fully checkpointed block keeps its
    input, the residual stream, which only SP shards. Under CP a block also keeps the K and V
    it gathered from the other CP ranks (`kv_fraction` of the width per rank, TP-sharded).
    `gathered_units`: what the gathered inputs weigh under SP (less than
    `GATHERED_INPUT_UNITS` where float8 tensor parallel gathers them in float8,
    `float8_gathered_units`)."""
    if mode == "full":
        return units / tp if sequence_parallel else units
    whole = 0.0
    if tp > 1:
        whole = gathered_units if sequence_parallel or mode != "none" else REPLICATED_UNITS_WITHOUT_SP
    kept = (units - whole) / tp + whole
    if cp > 1:
        kept += kv_fraction * (cp - 1) / tp
    return kept


def kv_width(model: nn.Module, plan, dim: int) -> int:
    """Elements per token of K and V the first attention module hands its inner attention
    (its `kv_width`; else a Llama-style 2 x n_kv_heads / n_heads of the width `dim`, or 2 x `dim`)."""
    attention = getattr(plan, "attention_modules", None)  # a plan may name neither (no CP, no TP check)
    found = match_modules(model, attention) if attention else []
    if found:
        parent = model.get_submodule(found[0][0].rpartition(".")[0])
        if isinstance(getattr(parent, "kv_width", None), int):
            return parent.kv_width
    divisible = getattr(plan, "tensor_parallel_divisible", None) or {}
    if {"n_kv_heads", "n_heads"} <= divisible.keys():
        return 2 * divisible["n_kv_heads"] * dim // divisible["n_heads"]
    return 2 * dim


def checkpointed_blocks(ac, stage_blocks: Sequence[int]) -> int:
    """Blocks the engine checkpoints on a rank whose stages hold `stage_blocks` blocks each:
    every block under "full"; under "selective" blocks 0, k, 2k, ... of each stage (k =
    `ac.checkpoint_every()`; the engine numbers each stage's blocks from 0); none without AC."""
    if ac.mode == "none":
        return 0
    every = ac.checkpoint_every()
    return sum(-(-n // every) for n in stage_blocks)


def kept_units(ac, stage_blocks: Sequence[int], selective_units: float,
               none_units: float = ACT_UNITS_PER_TOKEN["none"], *, tp: int = 1, cp: int = 1,
               sequence_parallel: bool = True, kv_fraction: float = 0.0,
               gathered_units: float = GATHERED_INPUT_UNITS) -> tuple[float, float]:
    """(activation units kept per token over the blocks of one rank, whose stages hold
    `stage_blocks` blocks each; units one checkpointed block rebuilds in its backward on one TP
    rank) under the activation-checkpointing config `ac`: a block keeps `none_units` without
    AC; a checkpointed one (`checkpointed_blocks`: every block under "full", every k-th under
    "selective") keeps `selective_units` with `selective_op`, its input only without. Sharded
    over TP and CP as `rank_block_units` says."""
    def on_rank(units: float, mode: str) -> float:
        return rank_block_units(units, mode, tp=tp, cp=cp, sequence_parallel=sequence_parallel,
                                kv_fraction=kv_fraction, gathered_units=gathered_units)

    n_layers, none = sum(stage_blocks), none_units
    checkpointed = checkpointed_blocks(ac, stage_blocks)
    if not checkpointed:
        return on_rank(none, "none") * n_layers, 0.0
    per_op = ac.mode == "selective" and ac.selective_op
    mode, units = ("selective", selective_units) if per_op else ("full", ACT_UNITS_PER_TOKEN["full"])
    return checkpointed * on_rank(units, mode) + (n_layers - checkpointed) * on_rank(none, "none"), (none - units) / tp


def _activation_bytes(parts: list[nn.Module], dims: ParallelDims, cfg, ac,
                      dim: int, vocab: int, tokens: float, logit_tokens: int,
                      activation_dtype: str, loss_chunk_tokens: int,
                      measured: dict[str, float] | None, compiled_loss: bool = False,
                      kv_fraction: float = 0.0, gathered_units: float = GATHERED_INPUT_UNITS) -> tuple[int, int, int]:
    """(bytes of the blocks' activations kept for backward, of one block's recomputation, of
    the loss's peak)."""
    act_bytes = _BYTES[activation_dtype]
    blocks = [block for p in parts for _, block in blocks_of(p)]
    layers = len(blocks)
    selective = sum(selective_op_units(b, dim) for b in blocks) / max(layers, 1)
    none = backward = ACT_UNITS_PER_TOKEN["none"]
    backward_fixed = 0.0
    if measured:
        # Compiled blocks keep less without AC (the compile config asked for the measurement).
        none, backward = measured["none_compiled"], measured["backward"]
        selective = measured.get("selective_compiled", selective)
        # A converted block's backward also casts its (TP-sharded) weights: bytes per block.
        backward_fixed = measured.get("backward_fixed_bytes", 0.0) / dims.tp
    per_dim = dim * tokens * act_bytes  # one model-dim-wide tensor of the rank's tokens
    kept, rebuilt = kept_units(ac, [len(list(blocks_of(p))) for p in parts], selective, none, tp=dims.tp, cp=dims.cp,
                               sequence_parallel=cfg.enable_sequence_parallel, kv_fraction=kv_fraction,
                               gathered_units=gathered_units)
    # The loss lives for one microbatch only: the last stage runs its backward right after
    # its forward, so it is not multiplied by the microbatches in flight.
    # A score head is replicated: its few columns are never split over tensor-parallel ranks.
    vocab_parallel = cfg.enable_loss_parallel and any(_output_modules(p, ("output",)) for p in parts)
    logits = loss_peak_bytes(logit_tokens, vocab, tp=dims.tp, loss_parallel=vocab_parallel,
                             chunk_tokens=loss_chunk_tokens, compute_dtype_bytes=act_bytes,
                             compiled=compiled_loss) \
        if any(_output_modules(p) for p in parts) else 0
    # A checkpointed block's backward first recomputes everything its forward saved, and every
    # block's backward holds its activations' gradients, for one microbatch (logit_tokens: a
    # microbatch's tokens, also under pipeline parallel).
    recompute = (rebuilt + backward / dims.tp) * per_dim * logit_tokens / tokens + backward_fixed
    return int(kept * per_dim), int(recompute), int(logits)


_FSDP_AXES = ("dp_shard_cp", *FLATTENED["dp_shard_cp"], *(view for view in EXPERT_VIEWS if view != "ep"))
"""Mesh axes FSDP shards parameters over (`titan.dist.dims`); TP and EP shards stay split."""


def _fsdp_gathered_numel(module: nn.Module) -> int:
    """Elements of `module`'s parameters once FSDP has gathered them on this rank (its TP and
    EP shards, whole over the FSDP axes)."""
    total = 0
    for p in module.parameters():
        if not isinstance(p, DTensor):
            total += p.numel()
            continue
        numel, names = p.numel(), p.device_mesh.mesh_dim_names or ()  # the global size
        for axis, placement in enumerate(p.placements):
            if placement.is_shard() and (axis >= len(names) or names[axis] not in _FSDP_AXES):
                numel //= p.device_mesh.size(axis)  # TP and EP shards stay split (they divide evenly)
        total += numel
    return total


def _fsdp_bytes(parts: list[nn.Module], dims: ParallelDims, activation_dtype: str, parallelism,
                reduce_dtype: str, gathered_param_bytes: float | None = None) -> int:
    """FSDP's unsharded copies on this rank (`fsdp_buffer_bytes`) for its blocks."""
    blocks = [block for p in parts for _, block in blocks_of(p)]
    if not blocks or not dims.uses_fully_shard:
        return 0
    per_block = sum(_fsdp_gathered_numel(b) for b in blocks) / len(blocks)
    keeps = not reshard_after_forward(parallelism, pp_enabled=dims.pp_enabled)
    return int(fsdp_buffer_bytes(per_block, len(blocks), sharded=dims.dp_shard * dims.cp > 1,
                                 pipelined=dims.pp_enabled, keeps_gathered=keeps,
                                 compute_dtype_bytes=gathered_param_bytes or _BYTES[activation_dtype],
                                 reduce_dtype_bytes=_BYTES[reduce_dtype]))


def _estimate_rank(model_fn, dims: ParallelDims, rank: int, *, parallelism, activation_checkpoint,
                   compile, local_batch_size: int, seq_len: int, optimizer_states: int,
                   activation_dtype: str, loss_chunk_tokens: int = 0, measured: dict[str, float] | None = None,
                   reduce_dtype: str = "float32", gathered_param_bytes: float | None = None,
                   gathered_input_units: float = GATHERED_INPUT_UNITS, tensor_parallel_overrides=None):
    from titan.dist.parallelize import parallelize
    from titan.dist.pipeline import build_pipeline
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        dims.rank = rank
        root = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = model_fn()
        dim, vocab = _model_shape(model)
        kv_fraction = kv_width(model, sharding_plan(model), dim) / dim
        if dims.pp_enabled:
            _, parts, _, _ = build_pipeline(
                model, dims, parallelism=parallelism, activation_checkpoint=activation_checkpoint,
                compile=compile, loss_fn=lambda out, tgt: out.sum(),
                local_batch_size=local_batch_size, device=torch.device("cpu"),
                tensor_parallel_overrides=tensor_parallel_overrides)
            # The activations this pipeline rank holds at its peak, as torch's schedule orders
            # its stages' forwards and backwards, as tokens held by every one of its blocks.
            micro = parallelism.pipeline_parallel_microbatch_size
            stage_blocks = [sum(1 for _ in blocks_of(part)) for part in parts]
            held = held_block_microbatches(parallelism.pipeline_parallel_schedule, dims.pp, local_batch_size // micro,
                                           len(parts), rank // (dims.world_size // dims.pp), stage_blocks)
            tokens = micro * held / max(sum(stage_blocks), 1) * seq_len / dims.cp  # not rounded: x blocks below
            logit_tokens = micro * seq_len // dims.cp
        else:
            parts = [parallelize(model, dims, root, parallelism=parallelism,
                                 activation_checkpoint=activation_checkpoint, compile=compile,
                                 tensor_parallel_overrides=tensor_parallel_overrides)]
            tokens = logit_tokens = local_batch_size * seq_len // dims.cp
        params = sum(_local_numel(p) for p in parts)
        acts = _activation_bytes(parts, dims, parallelism, activation_checkpoint, dim, vocab,
                                 tokens, logit_tokens, activation_dtype, loss_chunk_tokens, measured,
                                 compiled_loss=bool(getattr(compile, "compiles_loss", False)), kv_fraction=kv_fraction,
                                 gathered_units=gathered_input_units)
        return params, *acts, _fsdp_bytes(parts, dims, activation_dtype, parallelism, reduce_dtype, gathered_param_bytes)
    finally:
        dist.destroy_process_group()


def dry_run(model_fn: Callable[[], nn.Module], parallelism, *, world_size: int,
            activation_checkpoint, compile, local_batch_size: int, seq_len: int,
            global_batch_size: int = -1, optimizer_states: int = 2,
            activation_dtype: str = "float32", loss_chunk_tokens: int = 0, reduce_dtype: str = "float32",
            gathered_param_bytes: float | None = None,
            print_fn: Callable[[str], None] | None = print,
            measure_fn: Callable[[], nn.Module] | None = None,
            measure_converted: bool = False, model_key: Hashable | None = None,
            gathered_input_units: float = GATHERED_INPUT_UNITS,
            tensor_parallel_overrides=None) -> list[RankEstimate]:
    """Validate and parallelize a configuration for `world_size` ranks on this one CPU.

    `model_fn()` builds the model (it is called under the meta device). Prints, and returns,
    one `RankEstimate` per pipeline rank: the local parameter count and a memory estimate of
    fp32 params, fp32 grads, `optimizer_states` fp32 states per param (AdamW: 2) and
    activations (in `activation_dtype`, the FSDP compute dtype) with the loss's peak
    (`loss_peak_bytes`, chunked by `loss_chunk_tokens`) and FSDP's unsharded copies
    (`fsdp_buffer_bytes`, gradients in `reduce_dtype`, parameters kept gathered as
    `parallelism.fsdp_reshard_after_forward` says, `gathered_param_bytes` per parameter when
    not the compute dtype's): the rules `titan plan` uses. With
    `parallelism.fsdp_cpu_offload` the sharded states are reported on the host and left out
    of each rank's device total. Must run in a process without a
    process group. `measure_fn` builds the model whose blocks' activations are measured
    (`measure_block_units`; default `model_fn`), `measure_converted` when it converts its
    linears (float8: their weight-sized casts are measured apart from the per-token
    activations), `model_key` what identifies that model (`measure_block_units`). A
    conversion the fake tensors cannot trace (MXFP8) is measured on the unconverted model.
    `gathered_input_units`: what a block's SP-gathered inputs weigh (`rank_block_units`; float8
    tensor parallel gathers them in float8, and `measure_fn` then casts as it does);
    `tensor_parallel_overrides` parallelizes as the engine's (`TensorParallelOverrides`).
    """
    if dist.is_initialized():
        raise RuntimeError("dry_run needs a process without a process group")
    offloaded = bool(getattr(parallelism, "fsdp_cpu_offload", False))
    dims = ParallelDims.from_config(parallelism, world_size)
    check_reshard_under_zero_bubble(parallelism, dims)
    if offloaded:
        check_cpu_offload_has_fsdp(parallelism, dims)
        # The estimate stands for an accelerator's run: parallelized here on the CPU without the
        # offload (FSDP2 offloads only from an accelerator), the states then counted on the host.
        parallelism = dataclasses.replace(parallelism, fsdp_cpu_offload=False)
    if getattr(parallelism, "enable_async_tensor_parallel", False):
        # Async TP changes no placement and no memory, only how inductor schedules TP's
        # collectives on CUDA (whose compile requirement `check_compile_options` checks): the
        # layout is parallelized here, on the CPU, without it.
        parallelism = dataclasses.replace(parallelism, enable_async_tensor_parallel=False)
    with torch.device("meta"):
        probe = model_fn()
    validate_against_model(dims, probe, seq_len=seq_len, global_batch_size=global_batch_size,
                           local_batch_size=local_batch_size)
    per_pp = world_size // dims.pp
    # What one block keeps, measured at the real shapes on fake tensors (None: the rules).
    measured = measure_block_units(measure_fn or model_fn, seq_len=min(seq_len, 64), dtype=DTYPES[activation_dtype],
                                   selective=activation_checkpoint.mode == "selective" and activation_checkpoint.selective_op,
                                   compiled=bool(getattr(compile, "compiles_model", False)),
                                   converted=measure_converted, model_key=model_key)
    estimates = []
    for pp_rank in range(dims.pp):
        params, acts, recompute, loss, fsdp = _estimate_rank(
            model_fn, dims, pp_rank * per_pp, parallelism=parallelism,
            activation_checkpoint=activation_checkpoint, compile=compile,
            local_batch_size=local_batch_size, seq_len=seq_len,
            optimizer_states=optimizer_states, activation_dtype=activation_dtype,
            loss_chunk_tokens=loss_chunk_tokens, measured=measured, reduce_dtype=reduce_dtype,
            gathered_param_bytes=gathered_param_bytes, gathered_input_units=gathered_input_units,
            tensor_parallel_overrides=tensor_parallel_overrides)
        est = RankEstimate(ranks=f"{pp_rank * per_pp}-{(pp_rank + 1) * per_pp - 1}",
                           pp_rank=pp_rank, params=params, param_bytes=4 * params,
                           grad_bytes=4 * params, optimizer_bytes=4 * optimizer_states * params,
                           activation_bytes=acts, recompute_bytes=recompute, loss_bytes=loss,
                           fsdp_buffer_bytes=fsdp, offloaded=offloaded,
                           blocks=_rank_blocks(probe, dims, parallelism, pp_rank))
        estimates.append(est)
        if print_fn is not None:
            print_fn(est.line())
    return estimates


def _rank_blocks(model: nn.Module, dims: ParallelDims, parallelism, pp_rank: int) -> str:
    """The blocks of pipeline rank `pp_rank`'s stages as the engine splits them (e.g. ``0-2``,
    ``0-1, 4-5``); empty without pipeline parallel."""
    if dims.pp == 1:
        return ""
    keys = [name for name, _ in blocks_of(model)]
    total = num_stages_for(len(keys), dims.pp, parallelism)
    stages = stage_layer_keys(keys, total, parallelism)
    spans = [stage[0] if len(stage) == 1 else f"{stage[0]}-{stage[-1]}"
             for stage in (stages[s] for s in stage_ids_of_rank(pp_rank, dims.pp, total,
                                                                parallelism.pipeline_parallel_schedule))]
    return ", ".join(spans)


def has_auxiliary_loss(model: nn.Module) -> bool:
    """Whether the model's plan names modules whose training forward leaves an auxiliary
    loss (`auxiliary_loss_modules`, e.g. the routers of an MoE trained with a balancing loss)."""
    glob = getattr(sharding_plan(model), "auxiliary_loss_modules", None)
    return bool(glob) and next(iter(match_modules(model, glob)), None) is not None


def validate_against_model(dims: ParallelDims, model: nn.Module, *, seq_len: int,
                           global_batch_size: int, local_batch_size: int) -> None:
    """ParallelDims.validate_model with what the (meta) model's sharding plan declares (sizes
    the TP / EP degrees must divide, the blocks PP splits, tied parameters, expert modules
    for EP), before any parallelization: raises ValueError naming the values and the fix."""
    from titan.dist.pipeline import check_pipeline_ties

    plan = sharding_plan(model)
    if dims.ep_enabled and not getattr(plan, "expert_modules", None):
        raise ValueError(
            f"expert_parallel_degree={dims.ep} needs an MoE model whose sharding plan names "
            f"its expert_modules; {type(model).__name__} declares none. Set "
            f"--parallelism.expert_parallel_degree 1")
    dims.validate_model(
        n_layers=len(list(blocks_of(model))), seq_len=seq_len, global_batch_size=global_batch_size,
        local_batch_size=local_batch_size,
        tensor_parallel_divisible=getattr(plan, "tensor_parallel_divisible", None),
        expert_parallel_divisible=getattr(plan, "expert_parallel_divisible", None))
    check_pipeline_ties(model, dims.pp)
