"""Layout planner: rank every valid parallel layout of a model for a cluster you do not have,
with a predicted memory per rank and step time.

The model is described by `ModelFacts` (read once from the meta model and its sharding plan:
which parameters tensor parallelism shards, which it replicates, which are routed experts),
the cluster by a `Hardware` profile. For each `Layout` (pp x dp_replicate x dp_shard x cp x
tp, EP, activation checkpointing, batch and pipeline microbatching, FSDP's reshard policy) the
planner predicts:

memory per rank (worst pipeline stage)
    fp32 parameters, gradients and AdamW's two states of the rank's shard (16 bytes per
    parameter, as `titan.dist.dry_run` counts them); FSDP's unsharded compute-dtype copies of
    the block being computed and the one prefetched, and the fp32 reduce-scatter buffer of
    one block (under PP: the whole stage gathered for the step and its unsharded gradients
    accumulated in fp32 until the last microbatch, as the engine and torch's schedules run
    it; every block gathered under `reshard_after_forward` "never", two blocks under "always"
    even with PP); activations per block by AC mode (the dry run's per-token coefficients;
    "selective" is per-op selective AC, which the printed flags select: the block's input,
    attention output and every linear's output), divided by TP except
    the inputs the sharded matmuls gather (2 units with sequence parallel; without it also the
    RMSNorms' 6) and by CP, for the forwards each pipeline rank has outstanding at its peak
    in the order `torch.distributed.pipelining` runs the schedule; on the last stage the
    loss's peak in its backward: 3 fp32 copies of one microbatch's logits (4 under loss
    parallel, vocab-sharded over TP; whole on every TP rank without it), per chunk when the
    loss is chunked, plus then the whole microbatch's compute-dtype logits the chunks save
    and their gradient (measured with `MemTracker`, tests/test_plan.py); a compiled loss
    keeps the compute-dtype logits and their gradient instead, chunked or not (the backward
    recomputes the softmax; measured as the resident set on CPU); the recomputation
    transient of one checkpointed block and the activation gradients of the block being
    differentiated (measured with its kept units, `measure_block_units`; under CP, plus the
    K/V gathered from the other ranks); then `memory_headroom` (allocator fragmentation,
    workspaces) on top.

step time (worst pipeline stage; without PP, a local batch accumulated over microbatches runs
FSDP's gathers and reduce-scatter once per microbatch, the replicas' all-reduce once per step)
    compute = training FLOPs of the rank's tokens (plus the recomputed forward under AC) over
    the device's bf16 peak x `matmul_efficiency` (x `compile_speedup` for all but attention's
    scores when compiled; less for microbatches of few tokens, by the weights' roofline:
    `Hardware.half_efficiency_tokens`); with float8 the converted linears' FLOPs at the fp8
    peak instead, plus `float8_cast_bytes` of memory traffic per cast element; under async TP
    the block matmuls at the roofline of 1/tp of the microbatch's tokens, the shard its fused
    collectives multiply at a time; communication volumes per step: FSDP all-gathers (forward
    and backward) and reduce-scatter, overlapped with compute (the `comm_overlap` part of
    them) except the first block's gather (under PP one gather per step, and the
    reduce-scatter after the last microbatch exposed); a reduce-scatter takes
    `reduce_scatter_cost` times an all-gather of the same bytes; TP/SP all-gathers and
    reduce-scatters of the residual stream, read off each block's plan styles
    (`TPCollectives`: a Llama block's 4 forward, 4 backward; an MoE block computed whole 2
    gathers; MLA's attention no input reduce-scatter but an all-reduce per up-projection's
    low-rank input), the forward's again in the recomputed forward under full AC, one pair more
    around the embedding and one around the output projection; without loss parallel the
    logits gathered whole; not overlapped; under async TP overlapped with the compute but for
    the backward reduce-scatters no single matmul produces, the all-reduces, the gathers
    around blocks computed whole and the collectives outside the blocks); CP all-gathers of K/V
    (again in the recomputed forward; not overlapped); EP all-to-alls (dispatch + combine,
    forward + backward, not overlapped); HSDP's and DDP's gradient all-reduce across replicas
    (overlapped with the backward like FSDP's reduce-scatter, in the compute FSDP's traffic
    leaves; under PP after the last microbatch, exposed); PP's bubble: each rank runs its
    forwards and backwards in the order `torch.distributed.pipelining` builds for the
    schedule, each waiting for the neighbouring stage's result, with every stage's cost from
    its blocks (the engine's split of the layers over pp x v stages) and the output
    projection on the last (`pipeline_idle_fraction`); with equal stages that is
    (pp - 1) / (v m) of the busy time. Unoverlapped collectives also pay
    `collective_latency_us` per call. A group inside one node uses the intra-node link,
    otherwise the network; the mesh is laid out with tp innermost, then cp, dp_shard,
    dp_replicate, pp (`titan.dist.ParallelDims`).

The constants are stated in `Hardware` and overridable; the defaults are fitted to one
published measurement (torchtitan, Llama 3.1 8B on 8 H100, FSDP eager) and every other
comparison is a prediction (see the README's parallelism section).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch.nn as nn
from titan.dist.dims import ParallelDims
from titan.dist.config import AC_MODES, RESHARD_POLICIES, ActivationCheckpointConfig
from titan.dist.fsdp import reshards_after_forward
from titan.dist.dry_run import (
    ACT_UNITS_PER_TOKEN,
    GATHERED_INPUT_UNITS,
    ZERO_BUBBLE_SCHEDULES,
    checkpointed_blocks,
    float8_gathered_units,
    fsdp_buffer_bytes,
    gathered_bytes_per_param,
    held_block_microbatches,
    kept_units,
    kv_width,
    loss_peak_bytes,
    pipeline_actions,
    rank_block_units,
    selective_op_units,
    zero_bubble_timeable,
)
from titan.dist.pipeline import (
    SINGLE_STAGE,
    even_stage_sizes,
    microbatch_count_problem,
    stage_count_problem,
    stage_ids_of_rank,
)
from titan.dist.plan import blocks_of, glob_matches, match_modules, sharding_plan

GiB = 1024**3
FITTED_FLOAT8_CAST_BYTES = 17.0
"""`Hardware.float8_cast_bytes` as fitted (see there)."""
_STATE_BYTES = 16
"""fp32 parameter, gradient and AdamW's two moments, per parameter of the rank's shard."""


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator type and how it is wired; every field can be overridden."""

    name: str
    """What the tables call the device."""
    peak_bf16_tflops: float
    """Dense bf16 tensor-core peak per device (datasheet)."""
    peak_fp8_tflops: float
    """Dense fp8 peak (0: no fp8 tensor cores)."""
    memory_gib: float
    """Device memory."""
    memory_tbps: float
    """Device memory bandwidth, TB/s (datasheet)."""
    intra_node_gbps: float
    """Per-device unidirectional bandwidth to the other devices of its node, GB/s."""
    inter_node_gbps: float
    """Per-device network bandwidth between nodes, GB/s."""
    devices_per_node: int = 8
    """Devices sharing the intra-node link (`--nodes` sets it to gpus / nodes)."""
    matmul_efficiency: float = 0.35
    """Fraction of the bf16 peak a training step's kernels reach in eager mode (fitted: Llama
    3.1 8B on 8 H100 with FSDP and per-op selective AC, torchtitan's 5,762 tokens/s/GPU)."""
    compile_speedup: float = 1.20
    """Speedup torch.compile gives the matmuls' share of the compute (what it fuses is the
    elementwise work around them; attention's scores run the same fused kernel compiled or
    not). Fitted on the same table's compiled row (6,667 against 5,762 eager)."""
    float8_cast_bytes: float = FITTED_FLOAT8_CAST_BYTES
    """Memory traffic per element float8 scales and casts (inputs forward, output gradients
    backward, with amax), at the device's memory bandwidth; the float8 matmuls themselves
    run at the fp8 peak times the same kernel efficiency. Fitted on the same table's float8
    row (8,532 vs 6,667 compiled), so the float8 gain grows with the width of the linears
    (more FLOPs per cast element) and shrinks with the attention's share."""
    link_efficiency: float = 0.7
    """Fraction of a link's bandwidth a collective reaches."""
    collective_latency_us: float = 20.0
    """Cost of one collective call however small its message (NCCL within a node: 10-30 us),
    paid by the collectives that are not overlapped (TP, CP, EP, PP)."""
    reduce_scatter_cost: float = 1.0
    """Time of a reduce-scatter relative to an all-gather moving the same bytes. 1 where the
    reduction is free beside the link (NCCL: the sums run on the GPU's SMs far faster than
    the link delivers bytes); gloo on CPU sums on the cores the training uses, and measured
    1.3-1.6 for 2 ranks (`tools/plan_calibrate_cpu.py` measures it)."""
    comm_overlap: float = 1.0
    """Fraction of a collective's time that can run while the device computes (FSDP's
    prefetched gathers and reduce-scatters, async TP). 1 on GPUs, whose copy engines and spare
    SMs move data beside the kernels; a CPU whose every core runs a rank's compute has no core
    left for gloo, and measured 0.1-0.4 (`tools/plan_calibrate_cpu.py` measures it)."""
    half_efficiency_tokens: float | None = None
    """Tokens per microbatch and rank at which kernels reach half their large-batch
    efficiency: efficiency scales with M / (M + this), normalized to the fitted run's 16,384
    (small microbatches, deep CP and PP splits make small, slow GEMMs). None: the weights'
    roofline, `weight_roofline_tokens` (H100: 103 tokens); the CPU calibration measures it."""

    def __post_init__(self) -> None:
        for name, low, high in (("comm_overlap", 0.0, 1.0), ("link_efficiency", 1e-9, 1.0)):
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"--hardware.{name} {getattr(self, name)} must be in [{low:g}, {high:g}]")
        if self.half_efficiency_tokens is not None and self.half_efficiency_tokens < 0:
            raise ValueError(f"--hardware.half_efficiency_tokens {self.half_efficiency_tokens} must be >= 0 (tokens "
                             "per microbatch at which matmuls run at half their large-batch rate; unset: the "
                             "weights' roofline)")
        if self.reduce_scatter_cost <= 0:
            raise ValueError(f"--hardware.reduce_scatter_cost {self.reduce_scatter_cost} must be > 0 (a reduce-scatter's "
                             "time over an all-gather's of the same bytes)")

    @property
    def memory_bytes(self) -> float:
        """Device memory in bytes."""
        return self.memory_gib * GiB

    @property
    def weight_roofline_tokens(self) -> float:
        """Tokens M at which a matmul spends as long reading its bf16 weight matrix [K, N] from
        memory (2 N K bytes) as multiplying it (2 M N K FLOPs at the peak times
        `matmul_efficiency`): its time is 2 N K (M / rate + 1 / bandwidth), so its rate is
        M / (M + rate / bandwidth) of the large-M one, whatever N and K are."""
        rate = self.peak_bf16_tflops * 1e12 * self.matmul_efficiency
        return rate / (self.memory_tbps * 1e12)

    @property
    def half_tokens(self) -> float:
        """`half_efficiency_tokens` as given, or the weights' roofline."""
        return self.weight_roofline_tokens if self.half_efficiency_tokens is None else self.half_efficiency_tokens


HARDWARE: dict[str, Hardware] = {
    # NVIDIA datasheets (dense, no sparsity); NVLink 4 = 450 GB/s per direction; 400 Gb/s
    # InfiniBand NDR per GPU = 50 GB/s.
    "H100": Hardware(name="H100 SXM 80GB", peak_bf16_tflops=989, peak_fp8_tflops=1979, memory_gib=80,
                     memory_tbps=3.35, intra_node_gbps=450, inter_node_gbps=50),
    "H200": Hardware(name="H200 SXM 141GB", peak_bf16_tflops=989, peak_fp8_tflops=1979, memory_gib=141,
                     memory_tbps=4.8, intra_node_gbps=450, inter_node_gbps=50),
    "B200": Hardware(name="B200 180GB", peak_bf16_tflops=2250, peak_fp8_tflops=4500, memory_gib=180,
                     memory_tbps=8.0, intra_node_gbps=900, inter_node_gbps=50),
    "A100": Hardware(name="A100 SXM 80GB", peak_bf16_tflops=312, peak_fp8_tflops=0, memory_gib=80,
                     memory_tbps=2.04, intra_node_gbps=300, inter_node_gbps=25),
    # AMD datasheet: 1,307 TFLOPs dense bf16, 192 GB HBM3 at 5.3 TB/s, 7 xGMI links x 64 GB/s.
    "MI300X": Hardware(name="MI300X 192GB", peak_bf16_tflops=1307, peak_fp8_tflops=2615, memory_gib=192,
                       memory_tbps=5.3, intra_node_gbps=448, inter_node_gbps=50),
}
"""Hardware profiles by name (`--gpus 256xH100`)."""


def parse_gpus(spec: str, overrides: dict[str, float] | None = None) -> tuple[int, Hardware]:
    """`"256xH100"` -> (256, the H100 profile with `overrides` applied)."""
    count, sep, kind = spec.partition("x")
    if not sep or not count.isdigit() or int(count) < 1:
        raise ValueError(f"--gpus {spec!r}: expected <count>x<type>, e.g. 256xH100")
    matches = [k for k in HARDWARE if k.lower() == kind.lower()]
    if not matches:
        raise ValueError(f"--gpus {spec!r}: unknown device {kind!r}; known: {', '.join(HARDWARE)}")
    hw = HARDWARE[matches[0]]
    if overrides:
        fields = {f.name for f in dataclasses.fields(Hardware)}
        bad = sorted(set(overrides) - fields)
        if bad:
            raise ValueError(f"unknown hardware fields {bad}; valid: {', '.join(sorted(fields))}")
        hw = dataclasses.replace(hw, **overrides)
    return int(count), hw


@dataclass(frozen=True, kw_only=True)
class TPCollectives:
    """A block's tensor-parallel collectives per token, the mean over the blocks, as the
    engine's TP styles issue them (counted in a real step by `tests/test_gradient_parity.py`).

    With sequence parallel the residual stream is sequence-sharded between sublayers: a
    sublayer whose input feeds a column-parallel linear gathers it (forward) and
    reduce-scatters its gradient (backward), a row-parallel linear reduce-scatters its output
    and gathers its gradient: a "pair" each, of `dim`-wide rows. Without SP each pair is one
    all-reduce (of the row-parallel output, of the column-parallel input's gradient), which
    costs as much. A sublayer whose input feeds only replicated linears (MLA's low-rank
    projections) gathers it but needs no reduce-scatter: every rank's input gradient is
    whole. A block every rank computes whole (an MoE layer) gathers its input and, in the
    backward, its output's gradient. A column-parallel linear fed by a replicated one (MLA's
    up-projections) all-reduces its input's gradient, and so does a "shared_by_heads" module
    (MLA's rotated key part): `all_reduces` of `all_reduce_width` elements per token in all
    (the shared parts' few dozen left out of the width: a parameter-free module has no size
    the plan can read)."""

    pairs: float = 4.0
    """Gather + reduce-scatter pairs (or all-reduces without SP) of `dim`-wide rows."""
    sp_gathers: float = 0.0
    """Gathers without a reduce-scatter, under SP only: inputs of replicated-only sublayers,
    and 2 per block computed whole."""
    forward: float = 4.0
    """Of all of these under SP, the collectives of the forward (a full-AC rerun repeats them);
    without SP a rerun repeats the row-parallel all-reduces, `forward_pairs`."""
    forward_pairs: float = 2.0
    """Row-parallel outputs: the forward's all-reduces without SP."""
    unfused: float = 2.0
    """Under SP, the collectives async TP cannot fuse with one matmul: the reduce-scatters of
    column-parallel inputs' gradients (each a sum over several matmuls) and the gathers of
    blocks computed whole (they feed routing, not one matmul)."""
    all_reduces: float = 0.0
    """Backward all-reduces of replicated low-rank inputs' gradients (both modes)."""
    all_reduce_width: float = 0.0
    """Their elements per token, summed."""


def tp_block_collectives(model: nn.Module, plan, dim: int) -> TPCollectives:
    """The mean block's tensor-parallel collectives (`TPCollectives`), read off the plan's
    styles: "block_input" sublayers (with or without a column-parallel linear on the
    residual), "rowwise" linears, "replicated_block" blocks, and the column-parallel linears
    inside a sublayer whose input is not the residual stream, and "shared_by_heads" modules."""
    styles = list(plan.tensor_parallel.items())

    def style_of(fqn: str) -> str | None:
        return next((s for g, s in styles if glob_matches(g, fqn)), None)

    totals = dict(pairs=0.0, sp_gathers=0.0, forward=0.0, forward_pairs=0.0, unfused=0.0, all_reduces=0.0,
                  all_reduce_width=0.0)
    blocks = list(blocks_of(model))
    for key, block in blocks:
        prefix = f"{plan.layer_container}.{key}"
        for name, module in block.named_modules():
            fqn = f"{prefix}.{name}" if name else prefix
            style = style_of(fqn)
            if style == "rowwise":
                totals["pairs"] += 1
                totals["forward"] += 1
                totals["forward_pairs"] += 1
            elif style == "shared_by_heads":
                totals["all_reduces"] += 1
            elif style == "replicated_block":
                totals["sp_gathers"] += 2
                totals["forward"] += 1
                totals["unfused"] += 2
            elif style == "block_input":
                totals["forward"] += 1
                colwise = [m for n, m in module.named_modules()
                           if isinstance(m, nn.Linear) and style_of(f"{fqn}.{n}") == "colwise"]
                if any(m.in_features == dim for m in colwise):
                    totals["pairs"] += 1
                    totals["unfused"] += 1
                else:
                    totals["sp_gathers"] += 1
                low_rank = [m.in_features for m in colwise if m.in_features != dim]
                totals["all_reduces"] += len(low_rank)
                totals["all_reduce_width"] += sum(low_rank)
    n = max(len(blocks), 1)
    return TPCollectives(**{k: v / n for k, v in totals.items()})


@dataclass(frozen=True, kw_only=True)
class BlockParams:
    """One block's parameters by how the layouts split them."""

    tp_sharded: int
    """Split over TP ranks (column/row-parallel projections)."""
    tp_replicated: int
    """Whole on every TP rank (norms, routers, low-rank projections, shared experts)."""
    experts: int
    """Routed experts: split over EP x expert-FSDP ranks, whole per TP rank."""

    @property
    def total(self) -> int:
        """All of the block's parameters."""
        return self.tp_sharded + self.tp_replicated + self.experts


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What the planner needs of a model, read once from its meta instance (`from_model`)."""

    blocks: tuple[BlockParams, ...]
    """Each block's parameters, in order."""
    embedding: int
    """Parameters on the first pipeline stage outside the blocks (vocab-sharded by TP)."""
    output: int
    """Parameters on the last stage outside the blocks (the output projection; 0 when tied)."""
    final_norm: int
    """The final norm's parameters (last stage, replicated over TP)."""
    dim: int
    """Width of the residual stream (read off the output projection)."""
    vocab: int
    """Rows of the output projection."""
    flops_per_token: float
    """Training FLOPs per token (forward + backward), as the trainer's MFU counts them."""
    kv_fraction: float = 1.0
    """K+V width per token over `dim`: what CP gathers (2 x n_kv_heads x head_dim / dim for GQA;
    MLA's per-head keys and values, several times `dim`)."""
    experts_per_token: int = 0
    """Routed experts each token visits (top-k; 0: dense)."""
    matmul_flops_per_token: float | None = None
    """Of `flops_per_token`, the matmuls against weights (6 x the active parameters, the output
    projection's included); the rest is attention's scores and weighted sums. None: all."""
    float8_params: int = 0
    """Parameters of the block linears a float8 conversion converts (their matmuls, 6 FLOPs
    per parameter and token, run in float8; the output layer, attention and experts do not)."""
    float8_cast_width: int = 0
    """Elements per token float8 casts: in + out features summed over those linears."""
    float8_tp_input_gathers: float = 0.0
    """Of a block's two sequence-parallel input gathers (attention, feed-forward), those float8
    tensor parallel moves in float8: the inputs whose every linear is converted (mean over
    the blocks; titan.train's float8 TP, tensorwise)."""
    float8_tp_grad_gathers: float = 0.0
    """Of a block's two backward gathers of its row-parallel outputs' gradients, those of
    converted linears (in float8 under float8 tensor parallel; mean over the blocks)."""
    tp_collectives: TPCollectives = dataclasses.field(default_factory=lambda: TPCollectives())
    """A block's tensor-parallel collectives by kind (`tp_block_collectives`; the default is a
    Llama block's)."""
    selective_units: float = 12.0
    """Model-width units per token a block keeps under per-op selective AC, averaged over the
    blocks (`titan.dist.dry_run.selective_op_units`, or measured)."""
    none_units: float = ACT_UNITS_PER_TOKEN["none"]
    """Model-width units per token a block keeps without AC, in the compute dtype (measured
    with `titan.dist.dry_run.measure_block_units`, else a Llama block's fp32 count)."""
    none_units_compiled: float | None = None
    """What a compiled block keeps without AC (measured with AOTAutograd's partitioner; None:
    as `none_units`)."""
    selective_units_compiled: float | None = None
    """What a compiled block keeps under titan's per-op selective AC (measured the same way;
    None: as `selective_units`)."""
    backward_units: float = ACT_UNITS_PER_TOKEN["none"]
    """Model-width units per token a block's backward allocates for the activations' gradients
    (measured, else bounded by what the block keeps without AC)."""
    backward_fixed_bytes: float = 0.0
    """Bytes a block's backward allocates whatever the tokens, before TP: a float8 block's
    casts of its weights and their gradients (measured with the conversion, else 0)."""
    float8_tp_block_units: Mapping[str, float] | None = None
    """What a block keeps and its backward holds when float8 tensor parallel casts its inputs
    (`measure_block_units` of the model with `add_float8_tp_casts`, as `from_model`'s
    `block_units`): the units of TP layouts under float8 TP. None: not measured (the
    high-precision units then bound them)."""

    @property
    def weight_grad_share(self) -> float:
        """A block's weight gradients in units of its forward: the forward FLOPs of its matmuls
        against weights (each weight gradient is one more such matmul) over all of its forward
        FLOPs."""
        output = 6 * self.vocab * self.dim
        if self.matmul_flops_per_token is None or self.flops_per_token <= output:
            return 1.0
        return (self.matmul_flops_per_token - output) / (self.flops_per_token - output)

    @classmethod
    def from_model(cls, model: nn.Module, *, flops_per_token: float, experts_per_token: int = 0,
                   float8_linears: Iterable[str] = (), block_units: dict[str, float] | None = None,
                   matmul_flops_per_token: float | None = None,
                   float8_tp_block_units: dict[str, float] | None = None) -> ModelFacts:
        """Classify every parameter of a (meta) model by its module's style in the model's
        sharding plan; `block_units` ("none", "selective"): what a block keeps, measured
        (`titan.dist.dry_run.measure_block_units`), instead of the rules; `float8_tp_block_units`
        the same under float8 tensor parallel's casts."""
        plan = sharding_plan(model)
        container = plan.layer_container
        sharded_styles = {"colwise", "rowwise"}
        tp_globs = [(g, s) for g, s in plan.tensor_parallel.items() if s in sharded_styles]
        blocks, selective = [], []
        for key, block in blocks_of(model):
            counts = {"tp_sharded": 0, "tp_replicated": 0, "experts": 0}
            for name, module in block.named_modules():
                fqn = f"{container}.{key}.{name}" if name else f"{container}.{key}"
                own = sum(p.numel() for p in module.parameters(recurse=False))
                if not own:
                    continue
                if plan.expert_modules and glob_matches(plan.expert_modules, fqn):
                    counts["experts"] += own
                elif any(glob_matches(g, fqn) for g, _ in tp_globs):
                    counts["tp_sharded"] += own
                else:
                    counts["tp_replicated"] += own
            blocks.append(BlockParams(**counts))
            selective.append(block)
        first = sum(p.numel() for name in plan.pipeline_first if (m := getattr(model, name, None)) is not None
                    for p in m.parameters())
        tied = bool(plan.tied_parameters)
        last_modules = [getattr(model, name, None) for name in plan.pipeline_last]
        last = [sum(p.numel() for p in m.parameters()) if m is not None else 0 for m in last_modules]
        output_weight = [m for g, s in plan.tensor_parallel.items() if s == "output"
                         for _, m in match_modules(model, g) if hasattr(m, "weight")]
        vocab, dim = output_weight[0].weight.shape if output_weight else (0, 0)
        norm = sum(last) - (0 if tied else vocab * dim)
        kv = kv_width(model, plan, int(dim)) / dim if dim else 2.0
        float8_linears = list(float8_linears)
        linears = [model.get_submodule(name) for name in float8_linears]
        input_gathers, grad_gathers = float8_tp_gathers(model, plan, frozenset(float8_linears))
        return cls(blocks=tuple(blocks), embedding=first, output=0 if tied else vocab * dim, final_norm=norm,
                   dim=int(dim), vocab=int(vocab), flops_per_token=flops_per_token,
                   matmul_flops_per_token=matmul_flops_per_token, kv_fraction=kv,
                   experts_per_token=experts_per_token, float8_params=sum(m.weight.numel() for m in linears),
                   float8_cast_width=sum(m.in_features + m.out_features for m in linears),
                   float8_tp_input_gathers=input_gathers, float8_tp_grad_gathers=grad_gathers,
                   tp_collectives=tp_block_collectives(model, plan, int(dim)) if dim else TPCollectives(),
                   float8_tp_block_units=float8_tp_block_units,
                   **(block_units and _unit_fields(block_units)
                      or {"selective_units": sum(selective_op_units(b, int(dim)) for b in selective)
                          / max(len(selective), 1)}))

    @functools.cached_property
    def under_float8_tp(self) -> ModelFacts:
        """These facts with the block units float8 tensor parallel's casts leave (unchanged
        when those were not measured); built once, every float8 TP layout's memory reads it."""
        if not self.float8_tp_block_units:
            return self
        return dataclasses.replace(self, **_unit_fields(self.float8_tp_block_units))

    @property
    def n_layers(self) -> int:
        """Number of blocks."""
        return len(self.blocks)

    @property
    def num_params(self) -> int:
        """Every parameter (a tied matrix once)."""
        return sum(b.total for b in self.blocks) + self.embedding + self.output + self.final_norm

    def block_param_sums(self, blocks: Sequence[int]) -> tuple[int, int, int, int]:
        """(TP-sharded, TP-replicated, expert) parameters of `blocks` summed, and how many of
        them hold experts: all a stage's memory and time read of its blocks. Remembered per
        set of blocks: every layout asks it of each of its pipeline ranks."""
        key = len(blocks) if self.uniform_blocks else tuple(blocks)
        sums = self._block_sums.get(key)
        if sums is None:
            chosen = [self.blocks[i] for i in blocks]
            sums = (sum(b.tp_sharded for b in chosen), sum(b.tp_replicated for b in chosen),
                    sum(b.experts for b in chosen), sum(1 for b in chosen if b.experts))
            self._block_sums[key] = sums
        return sums

    @functools.cached_property
    def _block_sums(self) -> dict:
        return {}

    @functools.cached_property
    def uniform_blocks(self) -> bool:
        """Whether every block has the same parameters (a dense model)."""
        return len(set(self.blocks)) <= 1

    @property
    def float8_block_share(self) -> float:
        """The share of the blocks' parameters a float8 conversion converts."""
        total = sum(b.total for b in self.blocks)
        return self.float8_params / total if total else 0.0


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One candidate: the mesh degrees, EP, AC, and the batch split: `local_batch_size`
    sequences per data-parallel rank and step, run `microbatch_size` at a time (pipeline
    microbatches under PP; without PP, gradient accumulation when it is smaller)."""

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    ac: str
    local_batch_size: int
    microbatch_size: int
    schedule: str
    stages_per_rank: int = 1
    reshard_after_forward: str = "default"
    """`--parallelism.fsdp_reshard_after_forward`: "never" keeps each block's gathered
    parameters from its forward to its backward (all of them at once, one gather per
    microbatch), "always" frees them after the forward even under PP (two gathers per
    microbatch and stage), "default" keeps them exactly under PP."""
    stage_sizes: tuple[int, ...] | None = None
    """Blocks of each pipeline stage, in order (pp x `stages_per_rank` of them), where the run
    splits the layers itself (`--parallelism.pipeline_parallel_split_points` /
    `layers_per_stage`); None: the engine's even split."""
    stage_weights: tuple[int, int] = (0, 0)
    """The even split's blocks fewer on the first and last stage
    (`--parallelism.pipeline_parallel_first/last_stage_less_layers`)."""
    ac_every: int = 1
    """Layer-wise AC (`--activation_checkpoint.selective_layer_every`): `ac` applies to blocks
    0, k, 2k, ... of each stage (k = this), the others keep everything; "full" every k
    checkpoints those blocks whole, "selective" every k per op."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage_weights", tuple(self.stage_weights))  # JSON gives a list
        if not 1 <= self.microbatch_size <= self.local_batch_size or self.local_batch_size % self.microbatch_size:
            raise ValueError(f"microbatch_size {self.microbatch_size} must divide local_batch_size "
                             f"{self.local_batch_size}")
        if self.reshard_after_forward not in RESHARD_POLICIES:
            raise ValueError(f"reshard_after_forward {self.reshard_after_forward!r} must be one of "
                             f"{', '.join(RESHARD_POLICIES)}")
        if self.stage_sizes is not None and len(self.stage_sizes) != self.pp * self.stages_per_rank:
            raise ValueError(f"stage_sizes {self.stage_sizes} must list pp x stages_per_rank = "
                             f"{self.pp * self.stages_per_rank} stages")
        if self.ac not in AC_MODES or self.ac_every < 1 or (self.ac == "none" and self.ac_every != 1):
            raise ValueError(f"ac {self.ac!r} every {self.ac_every}: ac is one of {', '.join(AC_MODES)}, "
                             "and every >= 1 (1 without AC)")

    @functools.cached_property
    def ac_config(self) -> ActivationCheckpointConfig:
        """The engine's `ActivationCheckpointConfig` of `ac` and `ac_every`: "selective" is per
        op; "full" every k > 1 is the engine's layer-wise mode (whole blocks)."""
        if self.ac == "none" or (self.ac == "full" and self.ac_every == 1):
            return ActivationCheckpointConfig(mode=self.ac)
        return ActivationCheckpointConfig(mode="selective", selective_op=self.ac == "selective",
                                          selective_layer_every=self.ac_every)

    @property
    def ac_label(self) -> str:
        """`ac`, with the layer interval when it is not every block (e.g. "full every 2")."""
        return self.ac if self.ac_every == 1 else f"{self.ac} every {self.ac_every}"

    @property
    def fsdp_sharded(self) -> bool:
        """Whether FSDP shards the blocks' parameters (over dp_shard x cp)."""
        return self.dp_shard * self.cp > 1

    @property
    def keeps_gathered(self) -> bool:
        """Whether FSDP keeps each block's gathered parameters past its forward."""
        return not reshards_after_forward(self.reshard_after_forward, pp_enabled=self.pp > 1)

    @property
    def world_size(self) -> int:
        """Ranks the layout uses."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def microbatches(self) -> int:
        """Microbatches per step: the pipeline's under PP, else the gradient-accumulation steps."""
        return self.local_batch_size // self.microbatch_size

    @property
    def accumulation_steps(self) -> int:
        """Forward + backward passes per optimizer step without PP (1 under PP: the pipeline
        runs the microbatches in one schedule step)."""
        return self.microbatches if self.pp == 1 else 1

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all data-parallel ranks."""
        return self.local_batch_size * self.dp_replicate * self.dp_shard

    @property
    def engine_local_batch_size(self) -> int:
        """`--training.local_batch_size`: the sequences of one forward without PP, the
        pipeline's whole step under PP."""
        return self.microbatch_size if self.pp == 1 else self.local_batch_size

    def flags(self) -> list[str]:
        """The `titan train` flags that select this layout."""
        out = [
            "--parallelism.data_parallel_replicate_degree", str(self.dp_replicate),
            "--parallelism.data_parallel_shard_degree", str(self.dp_shard),
            "--parallelism.tensor_parallel_degree", str(self.tp),
            "--parallelism.context_parallel_degree", str(self.cp),
            "--parallelism.pipeline_parallel_degree", str(self.pp),
            "--parallelism.expert_parallel_degree", str(self.ep),
            "--activation_checkpoint.mode", self.ac_config.mode,
            "--training.local_batch_size", str(self.engine_local_batch_size),
            # Always: a recipe's own global batch would otherwise set the accumulation.
            "--training.global_batch_size", str(self.global_batch_size),
        ]
        if self.ac_config.mode == "selective":
            # Both set either way: a recipe's own selective_op or layer interval would otherwise
            # change what the row runs (Llama 3 8B's recipe turns per-op AC on).
            op = self.ac_config.selective_op  # keep matmul outputs, rerun the rest
            out += ["--activation_checkpoint.selective_op" if op else "--activation_checkpoint.no_selective_op",
                    "--activation_checkpoint.selective_layer_every", str(self.ac_every)]
        if self.pp > 1:
            out += ["--parallelism.pipeline_parallel_schedule", self.schedule,
                    "--parallelism.pipeline_parallel_microbatch_size", str(self.microbatch_size)]
        if self.reshard_after_forward != "default":
            out += ["--parallelism.fsdp_reshard_after_forward", self.reshard_after_forward]
        return out

    def describe(self) -> str:
        """A short human-readable name, e.g. `pp 8 x dp 8 (shard 8) x tp 8, ep 1`."""
        if self.world_size == 1:
            return "1 device"
        parts = [f"pp {self.pp}"] if self.pp > 1 else []
        dp = f"dp {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"fsdp {self.dp_shard}"
        parts.append(dp)
        parts += [f"cp {self.cp}"] if self.cp > 1 else []
        parts += [f"tp {self.tp}"] if self.tp > 1 else []
        parts += [f"ep {self.ep}"] if self.ep > 1 else []
        described = " x ".join(parts)
        if self.reshard_after_forward != "default":
            described += f", reshard {self.reshard_after_forward}"
        return described


@dataclass(kw_only=True)
class Prediction:
    """What the planner predicts for one layout on one cluster."""

    layout: Layout
    memory: dict[str, float]
    """Bytes per rank of the worst pipeline stage, by component, `total` with the headroom."""
    times: dict[str, float]
    """Seconds per step by component (exposed part), `step` the sum through the bubble."""
    tokens_per_s_per_device: float
    mfu: float
    fits: bool
    loads: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds per step by component before overlap (a collective's whole time; the rest as
    in `times`). Empty: as `times`."""

    @property
    def dominant(self) -> str:
        """The component that bounds the step (a key of `loads`, "fsdp" for FSDP's traffic): the
        largest whole time, so a collective hidden behind compute only up to the compute's time
        reads as dominant once it outlasts it."""
        parts = {k: v for k, v in (self.loads or self.times).items() if k != "step"}
        return max(parts, key=parts.get).removesuffix("_exposed")

    def as_dict(self) -> dict:
        """JSON-ready view (flags included)."""
        return {"layout": dataclasses.asdict(self.layout), "describe": self.layout.describe(),
                "accumulation_steps": self.layout.accumulation_steps,
                "flags": self.layout.flags(), "memory_bytes": self.memory, "time_s": self.times,
                "load_s": self.loads, "tokens_per_s_per_device": self.tokens_per_s_per_device,
                "mfu": self.mfu, "fits": self.fits, "dominant": self.dominant}


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What a step computes: batch, sequence, dtypes and the step's options."""

    global_batch_size: int
    """Sequences per optimizer step."""
    seq_len: int
    compute_dtype_bytes: int = 2
    """Bytes of an activation / FSDP-gathered parameter (bf16: 2)."""
    compile: bool = False
    compile_loss: bool = False
    """The loss is compiled too (`--compile.components loss`): its backward recomputes the
    softmax from the saved logits (`loss_peak_bytes`). torchtitan's published runs compiled
    the blocks only."""
    float8: bool = False
    sequence_parallel: bool = True
    loss_parallel: bool = True
    """Vocab-parallel loss under TP (`--parallelism.enable_loss_parallel`): each TP rank keeps
    its vocabulary shard of the logits instead of all of them."""
    async_tp: bool = False
    """Async TP (`--parallelism.enable_async_tensor_parallel`): the blocks' TP collectives
    that torch fuses with a matmul overlap the compute, so of them only what exceeds it is
    exposed (the others: `_tp_seconds`); the block matmuls run on one TP shard of the tokens
    at a time."""
    memory_headroom: float = 0.10
    """Fraction added on top of the estimate (allocator fragmentation, workspaces)."""
    loss_chunk_tokens: int = 0
    """`--training.loss_chunk_tokens`: positions whose fp32 loss intermediates exist at once
    (0: the whole microbatch)."""
    overlap_grad_allreduce: bool = True
    """The data-parallel replicas' gradient all-reduce runs during the backward, as titan's
    DDP (bucketed) and FSDP2's HSDP (per block, after its reduce-scatter) run it: hidden
    behind the backward like FSDP's reduce-scatter, except the last block's. False: after the
    backward, all of it exposed (how Megatron-LM's data parallelism ran in 2021, for the
    published comparison)."""
    reduce_dtype_bytes: int = 4
    """`--training.mixed_precision_reduce`: bytes per gradient element FSDP reduce-scatters
    (and the replicas all-reduce)."""
    float8_all_gather: bool = False
    """`--quantize.linear.float8.enable_fsdp_float8_all_gather`: FSDP gathers the converted
    linears' weights in float8 (1 byte each), and keeps them gathered so."""
    float8_tensor_parallel: bool = False
    """float8 moves TP's sequence-parallel gathers in float8 (the tensorwise recipe:
    titan.train's float8 tensor parallel, torchao's float8 TP styles)."""

    def gathered_bytes(self, facts: ModelFacts) -> float:
        """Bytes per parameter of a block FSDP gathers: the compute dtype's, 1 for the weights
        gathered in float8."""
        share = facts.float8_block_share if self.float8 and self.float8_all_gather else 0.0
        return gathered_bytes_per_param(self.compute_dtype_bytes, share)


def _unit_fields(block_units: Mapping[str, float]) -> dict[str, float | None]:
    """`ModelFacts`' block-unit fields from `measure_block_units`' figures."""
    return {"none_units": block_units["none"], "selective_units": block_units["selective"],
            "backward_units": block_units["backward"],
            "backward_fixed_bytes": block_units.get("backward_fixed_bytes", 0.0),
            "none_units_compiled": block_units.get("none_compiled"),
            "selective_units_compiled": block_units.get("selective_compiled")}


def float8_tp_gathers(model: nn.Module, plan, converted: frozenset[str]) -> tuple[float, float]:
    """(input gathers, gradient gathers) per block that float8 tensor parallel moves in float8,
    the mean over the blocks: a "block_input" module whose every linear is in `converted`,
    and each converted "rowwise" linear."""
    styles = list(plan.tensor_parallel.items())
    inputs = grads = 0
    blocks = list(blocks_of(model))
    for key, block in blocks:
        prefix = f"{plan.layer_container}.{key}"
        for name, module in block.named_modules():
            fqn = f"{prefix}.{name}" if name else prefix
            style = next((s for g, s in styles if glob_matches(g, fqn)), None)
            if style == "block_input":
                linears = [f"{fqn}.{n}" for n, m in module.named_modules() if isinstance(m, nn.Linear)]
                inputs += bool(linears) and all(linear in converted for linear in linears)
            elif style == "rowwise" and fqn in converted:
                grads += 1
    return inputs / max(len(blocks), 1), grads / max(len(blocks), 1)


def stage_params(facts: ModelFacts, layout: Layout, blocks: Sequence[int], first: bool, last: bool) -> tuple[float, float]:
    """(parameters this rank holds, the mean parameters of one of its blocks as a rank
    computes it: FSDP-gathered, TP- and EP-local)."""
    fsdp = layout.dp_shard * layout.cp
    sharded, replicated, experts, _ = facts.block_param_sums(blocks)
    dense = sharded / layout.tp + replicated
    outer = (facts.embedding if first else 0) / layout.tp + ((facts.output / layout.tp + facts.final_norm) if last else 0)
    # Dense parameters: TP-sharded, then FSDP over dp_shard x cp. Experts: split over EP, and
    # each EP rank's experts FSDP-sharded over the remaining dp_shard x cp / ep ranks.
    held = (dense + outer + experts) / fsdp
    return held, (dense + experts / layout.ep) / max(len(blocks), 1)


def rank_stages(n_layers: int, layout: Layout) -> list[tuple[list[int], bool, bool]]:
    """Each pipeline rank's blocks, and whether it holds the first stage (the embedding) and
    the last (the output projection): the layers split over pp x v stages
    (`layout_stage_sizes`), rank r running stages r, r + pp, ... (V-shaped schedules: r and
    2 pp - 1 - r)."""
    if layout.pp == 1:
        return [(list(range(n_layers)), True, True)]
    total = layout.pp * layout.stages_per_rank
    sizes = layout_stage_sizes(layout, n_layers)
    starts = [sum(sizes[:s]) for s in range(total)]
    out = []
    for rank in range(layout.pp):
        stages = stage_ids_of_rank(rank, layout.pp, total, layout.schedule)
        blocks = [b for s in stages for b in range(starts[s], starts[s] + sizes[s])]
        out.append((blocks, 0 in stages, total - 1 in stages))
    return out


def rank_stage_sizes(n_layers: int, layout: Layout, pp_rank: int) -> list[int]:
    """Blocks of each stage pipeline rank `pp_rank` runs (the engine's split, as `rank_stages`)."""
    if layout.pp == 1:
        return [n_layers]
    total = layout.pp * layout.stages_per_rank
    sizes = layout_stage_sizes(layout, n_layers)
    return [sizes[s] for s in stage_ids_of_rank(pp_rank, layout.pp, total, layout.schedule)]


def layout_stage_sizes(layout: Layout, n_layers: int) -> tuple[int, ...]:
    """Blocks of each pipeline stage: the layout's own split, else the engine's even one."""
    return layout.stage_sizes or _stage_sizes(n_layers, layout.pp * layout.stages_per_rank, layout.stage_weights)


@functools.lru_cache(maxsize=1024)
def _stage_sizes(n_layers: int, num_stages: int, weights: tuple[int, int] = (0, 0)) -> tuple[int, ...]:
    """`even_stage_sizes` (the engine's split, the first and last stages lighter by
    `weights`), cached: every pipeline rank of every layout asks for it."""
    return tuple(even_stage_sizes(n_layers, num_stages, *weights))


def predict(facts: ModelFacts, layout: Layout, work: Workload, hw: Hardware) -> Prediction:
    """Memory and step time of `layout` (see the module docstring for the rules)."""
    worst_mem, worst_time, worst_loads = None, None, {}
    timed: dict[tuple, tuple[dict, dict]] = {}
    sized: dict[tuple, dict] = {}
    for rank, (blocks, first, last) in enumerate(rank_stages(facts.n_layers, layout)):
        stages = rank_stage_sizes(facts.n_layers, layout, rank)
        held = _held_block_tokens(layout, work, facts.n_layers, blocks, rank)
        # A stage's memory and time read its blocks only through their parameter sums: pipeline
        # ranks whose sums, stages, ends and peak activations match are sized once (a layout of
        # PP 32 asks 32 times), and timed once whatever rank runs them.
        params = (len(blocks), facts.block_param_sums(blocks))
        shape = (params, first, last, tuple(stages), held)
        if shape not in sized:
            sized[shape] = _memory(facts, layout, work, blocks, first=first, last=last, held_tokens=held,
                                   stages=stages)
        mem = sized[shape]
        checkpointed = checkpointed_blocks(layout.ac_config, stages)
        key = (params, first, last, checkpointed)
        if key not in timed:
            timed[key] = _times(facts, layout, work, hw, blocks, first=first, last=last, checkpointed=checkpointed)
        times, loads = timed[key]
        if worst_mem is None or mem["total"] > worst_mem["total"]:
            worst_mem = mem
        if worst_time is None or times["step"] > worst_time["step"]:
            worst_time, worst_loads = times, loads
    tokens = work.global_batch_size * work.seq_len
    tps = tokens / worst_time["step"] / layout.world_size
    mfu = facts.flops_per_token * tps / (hw.peak_bf16_tflops * 1e12)
    return Prediction(layout=layout, memory=worst_mem, times=worst_time, tokens_per_s_per_device=tps, mfu=mfu,
                      fits=worst_mem["total"] <= hw.memory_bytes, loads=worst_loads)


def _micro_tokens(layout: Layout, work: Workload) -> float:
    """Tokens of one microbatch (pipeline or gradient-accumulation), per CP shard."""
    samples = layout.microbatch_size
    return samples * work.seq_len / layout.cp


def _held_block_tokens(layout: Layout, work: Workload, n_layers: int, blocks: Sequence[int], pp_rank: int) -> float:
    """Blocks x tokens whose activations pipeline rank `pp_rank` keeps at its peak: without PP
    each of its blocks holds the local batch; under PP the most its schedule order
    (`pipeline_actions`) leaves outstanding, a stage's forward holding one microbatch in each of
    that stage's blocks (the engine's split of the layers over the stages)."""
    micro = _micro_tokens(layout, work)
    if layout.pp == 1:
        return len(blocks) * micro
    return micro * _peak_outstanding_blocks(layout.schedule, layout.pp, layout.microbatches, layout.stages_per_rank,
                                            pp_rank, layout_stage_sizes(layout, n_layers))


@functools.lru_cache(maxsize=4096)
def _peak_outstanding_blocks(schedule: str, pp: int, microbatches: int, stages_per_rank: int, pp_rank: int,
                             sizes: tuple[int, ...]) -> int:
    """Block-microbatches pipeline rank `pp_rank` holds at its peak; `sizes`: each stage's
    blocks (`layout_stage_sizes`)."""
    local = [sizes[s] for s in stage_ids_of_rank(pp_rank, pp, pp * stages_per_rank, schedule)]
    return held_block_microbatches(schedule, pp, microbatches, stages_per_rank, pp_rank, local)


def _memory(facts: ModelFacts, layout: Layout, work: Workload, blocks: Sequence[int], *, first: bool, last: bool,
            held_tokens: float, stages: Sequence[int]) -> dict:
    """Bytes per rank by component (module docstring) of a pipeline rank whose stages hold
    `stages` blocks each and whose activations peak at `held_tokens` block-tokens
    (`_held_block_tokens`)."""
    params, block_unsharded = stage_params(facts, layout, blocks, first, last)
    micro = _micro_tokens(layout, work)
    gathered = GATHERED_INPUT_UNITS
    if _float8_tp(layout, work) and facts.float8_tp_block_units:
        # float8 TP keeps the converted linears' inputs in float8, gathered ones included.
        facts = facts.under_float8_tp
        gathered = float8_gathered_units(facts.float8_tp_input_gathers, work.compute_dtype_bytes)
    width = facts.dim * work.compute_dtype_bytes  # bytes of one model-dim-wide activation per token
    none = facts.none_units_compiled if work.compile and facts.none_units_compiled else facts.none_units
    selective = (facts.selective_units_compiled if work.compile and facts.selective_units_compiled
                 else facts.selective_units)
    # TP shards what a block keeps but the inputs its matmuls gather whole; CP adds the K and
    # V gathered from the other CP ranks; under layer-wise AC the blocks AC skips keep
    # everything (the dry run's rule, `kept_units`): per block, the rank's mean.
    kept, rebuilt = kept_units(layout.ac_config, stages, selective, none, tp=layout.tp, cp=layout.cp,
                               sequence_parallel=work.sequence_parallel, kv_fraction=facts.kv_fraction,
                               gathered_units=gathered)
    per_block_token = kept / max(sum(stages), 1) * width
    activations = per_block_token * held_tokens
    recompute = rebuilt * width * micro if blocks else 0.0
    # The backward of one block holds its activations' gradients (measured; at most as large
    # as what the block saved).
    backward = (facts.backward_units * width * micro + facts.backward_fixed_bytes) / layout.tp if blocks else 0.0
    logits = loss_peak_bytes(micro, facts.vocab, tp=layout.tp, loss_parallel=work.loss_parallel,
                             chunk_tokens=work.loss_chunk_tokens, compute_dtype_bytes=work.compute_dtype_bytes,
                             compiled=work.compile_loss) \
        if last else 0.0
    fsdp_buffers = fsdp_buffer_bytes(block_unsharded, len(blocks), sharded=layout.fsdp_sharded,
                                     pipelined=layout.pp > 1, keeps_gathered=layout.keeps_gathered,
                                     compute_dtype_bytes=work.gathered_bytes(facts),
                                     reduce_dtype_bytes=work.reduce_dtype_bytes)
    out = {"params_grads_optimizer": params * _STATE_BYTES, "fsdp_buffers": fsdp_buffers,
           "activations": activations, "recompute": recompute, "backward": backward, "logits": logits}
    subtotal = sum(out.values())
    out["headroom"] = subtotal * work.memory_headroom
    out["total"] = subtotal + out["headroom"]
    return out


def _float8_saving(facts: ModelFacts, hw: Hardware, tokens: float, rate: float) -> float:
    """Seconds float8 saves on the matmuls of `tokens`: the converted linears' FLOPs at the
    fp8 instead of the bf16 peak."""
    if hw.peak_fp8_tflops <= 0:
        raise ValueError(f"--quantize.linear.float8.recipe needs fp8 tensor cores; {hw.name} has none "
                         "(--hardware.peak_fp8_tflops is 0): plan without float8")
    linear_flops = 6 * facts.float8_params * tokens
    return linear_flops / rate * (1 - hw.peak_bf16_tflops / hw.peak_fp8_tflops)


def _float8_cast_seconds(facts: ModelFacts, hw: Hardware, tokens: float) -> float:
    """Seconds float8's casts of `tokens` cost: their memory traffic (`float8_cast_bytes` per
    cast element)."""
    return facts.float8_cast_width * tokens * hw.float8_cast_bytes / (hw.memory_tbps * 1e12)


DEFAULT_AC_EVERY = {"full": (1, 2)}
"""Layer intervals `enumerate_layouts` ranks per AC mode: whole blocks every block and every
second one (torchtitan's layer-wise selective AC); every block for the others."""


_FITTED_MICRO_TOKENS = 16384
"""Tokens per microbatch of the run `matmul_efficiency` is fitted on (local batch 2 x 8192)."""


def _size_factor(tokens: float, hw: Hardware) -> float:
    """Kernel efficiency at `tokens` per microbatch relative to the fitted run's."""
    def saturation(m: float) -> float:
        return m / (m + hw.half_tokens)
    return saturation(tokens) / saturation(_FITTED_MICRO_TOKENS)


def _bandwidth(hw: Hardware, span: int) -> float:
    """Bytes/s of a collective over groups spanning `span` consecutive ranks."""
    gbps = hw.intra_node_gbps if span <= hw.devices_per_node else hw.inter_node_gbps
    return gbps * 1e9 * hw.link_efficiency


def _ring(volume: float, group: int) -> float:
    """Bytes each rank sends in a ring all-gather / reduce-scatter of `volume` total bytes."""
    return volume * (group - 1) / group if group > 1 else 0.0


def _exposed(comm: float, compute: float, hw: Hardware) -> float:
    """Seconds of `comm` left on the critical path when it may overlap `compute`: the part
    the device can run beside its kernels (`comm_overlap`) hides, up to the compute's time."""
    return comm - min(hw.comm_overlap * comm, compute)


def _tp_seconds(facts: ModelFacts, layout: Layout, work: Workload, hw: Hardware, n_blocks: int, *,
                first: bool, last: bool, tokens_rank: float, calls: float,
                rerun_blocks: int = 0) -> tuple[float, float]:
    """TP + SP's collectives of a stage: each block's (`ModelFacts.tp_collectives`: for a
    Llama block the residual stream all-gathered before and reduce-scattered after its
    attention and feed-forward, the reverse in backward, 4 pairs), again in the forward of the
    `rerun_blocks` AC checkpoints whole (per-op AC saves their outputs); one more pair on the
    first stage (the vocab-sharded embedding's output reduce-scattered) and on the last (the
    final norm's output gathered for the output projection). The last stage's loss: without loss parallel
    the logits are all-gathered whole on every TP rank; with it, a few all-reduces of
    per-token statistics (max, sum of exponentials, the label's logit; forward and backward).
    Under float8 tensor parallel the blocks' gathers of float8 inputs and gradients move one
    byte an element (`ModelFacts.float8_tp_input_gathers`, `float8_tp_grad_gathers`).

    Returns (all of it, the part async TP cannot fuse with a matmul). torch's micro-pipeline
    TP pass fuses an all-gather with the matmuls it feeds and a reduce-scatter with the one
    matmul that produces its input. A block's backward reduce-scatters of SP's gathered inputs'
    gradients, each the sum of several matmuls' (wq, wk, wv; w1, w3), stay exposed, as do
    all-reduces and the gathers around a block computed whole; so do the pairs around the
    embedding and the output projection, outside the compiled blocks (whole-model compile
    could fuse the output projection's gather: not counted), and the loss's collectives."""
    tpc = facts.tp_collectives
    bandwidth = _bandwidth(hw, layout.tp)
    residual = _ring(tokens_rank * facts.dim * work.compute_dtype_bytes, layout.tp) / bandwidth
    gather, scatter = residual + calls, hw.reduce_scatter_cost * residual + calls
    pair = gather + scatter
    all_reduce = ((1 + hw.reduce_scatter_cost)
                  * _ring(tokens_rank * tpc.all_reduce_width * work.compute_dtype_bytes, layout.tp) / bandwidth
                  + 2 * calls * tpc.all_reduces)
    if work.sequence_parallel:
        # The forward's gathers, and its reduce-scatters (the row-parallel outputs').
        rerun = (tpc.forward - tpc.forward_pairs) * gather + tpc.forward_pairs * scatter
        block = tpc.pairs * pair + tpc.sp_gathers * gather + all_reduce
        unfused = n_blocks * (tpc.unfused * scatter + all_reduce) + (first + last) * pair
    else:
        rerun = tpc.forward_pairs * pair
        block = tpc.pairs * pair + all_reduce
        unfused = n_blocks * block + (first + last) * pair
    seconds = n_blocks * block + rerun_blocks * rerun + (first + last) * pair
    if _float8_tp(layout, work):
        # float8 TP gathers the converted blocks' inputs (again in a rerun) and their row-
        # parallel gradients in float8: 1 byte an element; the reduce-scatters stay.
        float8_gathers = (n_blocks * (facts.float8_tp_input_gathers + facts.float8_tp_grad_gathers)
                          + rerun_blocks * facts.float8_tp_input_gathers)
        seconds -= float8_gathers * residual * (1 - 1 / work.compute_dtype_bytes)
    if last and not work.loss_parallel:
        logits = tokens_rank * facts.vocab * work.compute_dtype_bytes
        loss = _ring(logits, layout.tp) / _bandwidth(hw, layout.tp) + calls
    else:
        loss = 4 * calls if last else 0.0
    return seconds + loss, unfused + loss


def _async_tp(layout: Layout, work: Workload) -> bool:
    """Whether async TP fuses this layout's TP collectives with its matmuls: it fuses SP's
    all-gathers and reduce-scatters (without SP, TP all-reduces: nothing to fuse)."""
    return work.async_tp and layout.tp > 1 and work.sequence_parallel


def _float8_tp(layout: Layout, work: Workload) -> bool:
    """Whether float8 tensor parallel moves this layout's SP gathers in float8."""
    return layout.tp > 1 and work.float8 and work.float8_tensor_parallel and work.sequence_parallel


def _times(facts: ModelFacts, layout: Layout, work: Workload, hw: Hardware, blocks: Sequence[int], *,
           first: bool, last: bool, checkpointed: int) -> tuple[dict, dict]:
    """Seconds per step of one pipeline stage by component: the exposed parts (summed into
    "step") and each component's whole time before overlap (`Prediction.loads`);
    `checkpointed`: of `blocks`, those AC applies to (`checkpointed_blocks`)."""
    L = max(len(blocks), 1)
    share = len(blocks) / facts.n_layers
    dp = layout.dp_replicate * layout.dp_shard
    tokens_rank = work.global_batch_size * work.seq_len / dp / layout.cp  # this rank's TP group's tokens
    rerun_blocks = checkpointed if layout.ac == "full" else 0  # recomputed whole, collectives included
    # Full AC reruns each checkpointed block's forward (2 of its 6 FLOPs per parameter);
    # selective (per op) reruns only the cheap ops between the matmuls, a few percent.
    rerun = {"none": 0.0, "selective": 0.03, "full": 1 / 3}[layout.ac]
    recompute = 1.0 + rerun * checkpointed / L
    block_tokens = tokens_rank / layout.tp * share * recompute  # tokens x the stage's share, reruns counted
    # The output projection runs on the last stage only, on top of its blocks, never rerun.
    output_flops = 6 * facts.vocab * facts.dim * tokens_rank / layout.tp if last else 0.0
    micro_tokens = _micro_tokens(layout, work)
    rate = hw.peak_bf16_tflops * 1e12 * hw.matmul_efficiency * _size_factor(micro_tokens, hw)
    # Compile fuses the elementwise work around the matmuls; attention's scores run the same
    # fused attention kernel compiled or not, so they keep the eager rate.
    attention_rate = rate
    rate *= hw.compile_speedup if work.compile else 1.0
    block_flops = (facts.flops_per_token - 6 * facts.vocab * facts.dim) * block_tokens
    # The blocks' matmuls against weights (float8's converted ones at the fp8 peak, below).
    block_matmuls = facts.weight_grad_share * block_flops / rate
    compute = block_matmuls + (1 - facts.weight_grad_share) * block_flops / attention_rate + output_flops / rate
    if work.float8:
        saved = _float8_saving(facts, hw, block_tokens, rate)
        compute += _float8_cast_seconds(facts, hw, block_tokens) - saved
        block_matmuls -= saved
    if _async_tp(layout, work):
        # Async TP's fused all-gather + matmul and matmul + reduce-scatter multiply each shard
        # of the tokens as it arrives (or before it leaves): tp matmuls of 1/tp of the tokens,
        # each reading the whole weight, so at the weights' roofline of that many tokens.
        compute += block_matmuls * (_size_factor(micro_tokens, hw) / _size_factor(micro_tokens / layout.tp, hw) - 1)
    b = work.compute_dtype_bytes
    # FSDP: two all-gathers (forward, backward) and a fp32 reduce-scatter of the stage, all
    # overlapped with compute except the first block's gather. Under PP the stage is gathered
    # once per step and kept, and its gradients reduce-scattered after the last microbatch's
    # backward, with nothing left to overlap.
    fsdp_group = layout.dp_shard * layout.cp
    _, block_unsharded = stage_params(facts, layout, blocks, first, last)
    stage_unsharded = block_unsharded * len(blocks)
    fsdp_link = _bandwidth(hw, layout.tp * layout.cp * layout.dp_shard)
    # Gradient accumulation runs the whole exchange once per microbatch (FSDP2 reshards after
    # each forward and reduce-scatters after each backward, as the engine runs it); kept
    # gathered, a microbatch's backward reuses its forward's gather (under PP: the step's).
    microbatches = layout.accumulation_steps if layout.pp == 1 else layout.microbatches
    if layout.keeps_gathered:
        gathers = microbatches if layout.pp == 1 else 1
    else:
        gathers = 2 * microbatches
    gather = _ring(stage_unsharded * gathers * work.gathered_bytes(facts), fsdp_group) / fsdp_link
    reduce = (_ring(stage_unsharded * work.reduce_dtype_bytes, fsdp_group) / fsdp_link * hw.reduce_scatter_cost
              * layout.accumulation_steps)
    if layout.pp == 1:
        fsdp = _exposed(gather + reduce, compute, hw) + (gather + reduce) / L
    else:
        fsdp = _exposed(gather, compute, hw) + gather / L + reduce
    loads = {"fsdp_exposed": gather + reduce}
    # HSDP / DDP: the gradient shards all-reduced across replicas (a ring reduce-scatter, then
    # an all-gather, fp32), during the backward in what compute FSDP's traffic left (under PP
    # after the last microbatch, exposed). Under gradient accumulation it runs once, in the last
    # microbatch's backward, so only that microbatch's share of the step can hide it.
    replicate = (1 + hw.reduce_scatter_cost) * _ring(stage_unsharded / max(fsdp_group, 1) * work.reduce_dtype_bytes,
                                                     layout.dp_replicate)
    replicate /= _bandwidth(hw, layout.world_size // layout.pp)
    loads["hsdp_allreduce"] = replicate
    if layout.pp == 1 and work.overlap_grad_allreduce:
        left = max(compute - hw.comm_overlap * (gather + reduce), 0.0) / layout.accumulation_steps
        replicate = _exposed(replicate, left, hw) + replicate / L
    # Unoverlapped collectives also pay a fixed cost per call, once per microbatch.
    calls = layout.microbatches * hw.collective_latency_us * 1e-6
    tp = 0.0
    if layout.tp > 1:
        tp, unfused = _tp_seconds(facts, layout, work, hw, len(blocks), first=first, last=last,
                                  tokens_rank=tokens_rank, calls=calls, rerun_blocks=rerun_blocks)
        loads["tp"] = tp
        if _async_tp(layout, work):
            tp = unfused + _exposed(tp - unfused, compute, hw)
    # CP: K and V gathered per block forward (again in the recomputed forward under full AC),
    # their gradients reduce-scattered backward.
    kv = tokens_rank * layout.cp * facts.dim * facts.kv_fraction * b / layout.tp
    cp_pass = _ring(kv, layout.cp) / _bandwidth(hw, layout.cp * layout.tp)
    gathers = len(blocks) + rerun_blocks
    cp = ((gathers + len(blocks) * hw.reduce_scatter_cost) * cp_pass + (gathers + len(blocks)) * calls
          if layout.cp > 1 else 0.0)
    # EP: dispatch + combine all-to-alls, forward and backward, per MoE block.
    moe_blocks = facts.block_param_sums(blocks)[3]
    routed = tokens_rank * facts.experts_per_token * facts.dim * b
    ep = 4 * moe_blocks * (_ring(routed, layout.ep) / _bandwidth(hw, layout.ep * layout.tp) + calls) if layout.ep > 1 else 0.0
    # PP: activations to the next stage and gradients back, per microbatch and local stage.
    pp = 0.0
    if layout.pp > 1:
        hop = tokens_rank * facts.dim * b / layout.tp / _bandwidth(hw, layout.world_size) + calls
        pp = 2 * layout.stages_per_rank * hop
    busy = compute + fsdp + tp + cp + ep + pp
    bubble = busy * _pipeline_idle(facts, layout) if layout.pp > 1 else 0.0
    out = {"compute": compute, "fsdp_exposed": fsdp, "hsdp_allreduce": replicate, "tp": tp, "cp": cp,
           "ep": ep, "pp_p2p": pp, "pp_bubble": bubble}
    out["step"] = sum(out.values())
    return out, {**out, **loads}


def _pipeline_idle(facts: ModelFacts, layout: Layout) -> float:
    """Idle over busy time of the slowest pipeline rank for this model's stages: a block's
    forward costs 1, the output projection its FLOPs' share of a block's; backward twice
    the forward, plus the forward again for blocks AC checkpoints whole; of that backward, the weight
    gradients (a zero-bubble schedule's W) cost the forward of the block's matmuls against
    weights (`ModelFacts.weight_grad_share`; attention's scores have no weights), the rest
    (with any recomputation) is the input gradients (I)."""
    block_flops = (facts.flops_per_token - 6 * facts.vocab * facts.dim) / facts.n_layers
    output = 6 * facts.vocab * facts.dim / block_flops
    rerun_every = layout.ac_every if layout.ac == "full" else 0
    return _stages_idle(layout.schedule, layout.pp, layout.microbatches, layout.stages_per_rank,
                        layout_stage_sizes(layout, facts.n_layers), output, rerun_every, facts.weight_grad_share)


@functools.lru_cache(maxsize=4096)
def _stages_idle(schedule: str, pp: int, microbatches: int, stages_per_rank: int, sizes: tuple[int, ...],
                 output: float, rerun_every: int, weight_share: float) -> float:
    """`_pipeline_idle` for stages of `sizes` blocks (cached: many layouts share it); each
    stage reruns the forward of its blocks 0, k, 2k, ... (k = `rerun_every`; 0: none)."""
    last = len(sizes) - 1
    reruns = [-(-n // rerun_every) if rerun_every else 0 for n in sizes]
    forward = tuple(n + (output / 3 if s == last else 0.0) for s, n in enumerate(sizes))
    backward = tuple(2 * n + reruns[s] + (2 * output / 3 if s == last else 0.0) for s, n in enumerate(sizes))
    weight = tuple(n * weight_share + (output / 3 if s == last else 0.0) for s, n in enumerate(sizes))
    return pipeline_idle_fraction(schedule, pp, microbatches, stages_per_rank,
                                  _rounded(forward), _rounded(backward), _rounded(weight))


def _rounded(costs: tuple[float, ...]) -> tuple[float, ...]:
    return tuple(round(c, 3) for c in costs)  # a few distinct keys for the cache


_SIMULATED_ROUNDS = (4, 8, 12)
"""Beyond ``12 x pp`` microbatches (a multiple of pp), the idle time may be extrapolated from
simulations at these multiples of pp (see `pipeline_idle_fraction`)."""


@functools.lru_cache(maxsize=4096)
def pipeline_idle_fraction(schedule: str, pp: int, microbatches: int, stages_per_rank: int,
                           forward: tuple[float, ...], backward: tuple[float, ...],
                           weight: tuple[float, ...] = ()) -> float:
    """Idle time over busy time of the busiest pipeline rank, when every rank runs its
    actions in the order torch runs `schedule` (`pipeline_actions`) and each waits for the
    result it needs from the neighbouring stage (the forward of the stage before, the input
    gradients of the stage after; communication counted elsewhere). ``forward[s]`` /
    ``backward[s]``: stage ``s``'s cost per microbatch; under a split backward its weight
    gradients (W) cost ``weight[s]`` (default: half the backward) after its input gradients
    (I), which cost the rest.

    In the steady state the idle time is constant in the microbatches (1F1B, GPipe,
    Interleaved 1F1B) or grows by a fixed amount per microbatch (LoopedBFS and
    InterleavedZeroBubble, whose orders let the first ranks run ahead); the V-shaped schedules'
    shrinks until their weight gradients fill it. So for a multiple of pp above 12 x pp, when
    the simulations at 4, 8 and 12 x pp lie on one line that does not fall, the idle time is
    read off that line (tested equal to the full simulation): a schedule of thousands of
    microbatches then costs what one of 12 x pp does; otherwise every microbatch is simulated."""
    points = [rounds * pp for rounds in _SIMULATED_ROUNDS]
    if microbatches > points[-1] and microbatches % pp == 0:
        (i1, _), (i2, _), (i3, busy3) = (_idle_and_busy(schedule, pp, m, stages_per_rank, forward, backward, weight)
                                         for m in points)
        tolerance = 1e-9 * max(1.0, busy3)  # the sums' rounding: a constant idle reads +-1e-13
        step = (i2 - i1) / (points[1] - points[0])
        if abs(i2 - i1) <= tolerance:
            step = 0.0
        if step >= 0 and abs(i3 - i2 - step * (points[2] - points[1])) <= tolerance:
            idle = i3 + step * (microbatches - points[2])
            return idle / (busy3 * microbatches / points[2])
    idle, busy = _idle_and_busy(schedule, pp, microbatches, stages_per_rank, forward, backward, weight)
    return idle / busy


@functools.lru_cache(maxsize=1024)
def _idle_and_busy(schedule: str, pp: int, microbatches: int, stages_per_rank: int, forward: tuple[float, ...],
                   backward: tuple[float, ...], weight: tuple[float, ...]) -> tuple[float, float]:
    """(idle time, busy time) of the busiest pipeline rank (`pipeline_idle_fraction`); cached:
    the extrapolation of every larger microbatch count simulates the same three."""
    weight = weight or tuple(b / 2 for b in backward)
    # Each action's cost, indexed as `_rank_programs` numbers kinds and stages.
    cost = [*forward, *backward, *weight, *(b - w for b, w in zip(backward, weight))]
    programs = [[(cost[what], needs, makes) for what, needs, makes in program]
                for program in _rank_programs(schedule, pp, microbatches, stages_per_rank)]
    # Each rank runs its actions in order until one waits for an event not yet made; it
    # resumes when that event is made, so each action is visited once (finish times depend
    # only on the dependencies, not on the order the ranks are resumed in).
    done: dict[int, float] = {}  # event (`_rank_programs`) -> when it was made
    waiting: dict[int, list[int]] = {}  # event -> the ranks blocked on it
    clock, position = [0.0] * pp, [0] * pp
    runnable = list(range(pp))
    while runnable:
        rank = runnable.pop()
        program, at, now = programs[rank], position[rank], clock[rank]
        while at < len(program):
            seconds, needs, makes = program[at]
            if needs >= 0:
                ready = done.get(needs)
                if ready is None:
                    waiting.setdefault(needs, []).append(rank)
                    break
                if ready > now:
                    now = ready
            now += seconds
            done[makes] = now
            if makes in waiting:
                runnable += waiting.pop(makes)
            at += 1
        position[rank], clock[rank] = at, now
    if any(at < len(program) for at, program in zip(position, programs)):
        raise ValueError(f"{schedule} with pp {pp}, {microbatches} microbatches deadlocks in this model")
    busy = max(sum(seconds for seconds, _, _ in program) for program in programs)
    return max(clock) - busy, busy


@functools.lru_cache(maxsize=256)
def _rank_programs(schedule: str, pp: int, microbatches: int,
                   stages_per_rank: int) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Each rank's actions (`pipeline_actions`) as (what it costs: kind x stages + stage, kinds
    F, B, W, I; the event it waits for, -1: none; the event it makes), events numbered
    (kind, stage, microbatch): a forward done ("F"), a stage's input gradients ready ("G":
    after its B or I) or its weight gradients done ("W"). A forward waits for the previous
    stage's forward of its microbatch, a backward (B or I) for the next stage's input
    gradients (on the last stage for its own forward), W for its own I. Cached: the layouts of
    one schedule and shape differ only in the costs."""
    stages = pp * stages_per_rank
    last = stages - 1

    def event(kind: int, stage: int, micro: int) -> int:
        return (kind * stages + stage) * microbatches + micro

    F, G, W = 0, 1, 2
    cost_kind = {"F": 0, "B": 1, "W": 2, "I": 3}
    programs = []
    for actions in pipeline_actions(schedule, pp, microbatches, stages_per_rank):
        program = []
        for kind, stage, micro in actions:
            if kind == "F":
                needs = event(F, stage - 1, micro) if stage else -1
            elif kind == "W":
                needs = event(G, stage, micro)
            else:
                needs = event(G, stage + 1, micro) if stage < last else event(F, stage, micro)
            makes = event(G if kind in "BI" else W if kind == "W" else F, stage, micro)
            program.append((cost_kind[kind] * stages + stage, needs, makes))
        programs.append(tuple(program))
    return tuple(programs)


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256) if d <= limit and n % d == 0]


def enumerate_layouts(facts: ModelFacts, world_size: int, work: Workload, *, n_experts: int = 0,
                      ac_modes: Iterable[str] = ("none", "selective", "full"),
                      schedules: Iterable[str] = ("1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble",
                                                  "ZBVZeroBubble"),
                      max_tp: int = 8, max_cp: int = 8, microbatch_sizes: Iterable[int] = (1, 2, 4),
                      replicas_across_nodes_only: bool = True,
                      reshard_policies: Sequence[str] | None = None,
                      ac_every: Mapping[str, Sequence[int]] = DEFAULT_AC_EVERY,
                      stage_sizes: Sequence[int] | None = None,
                      stage_weights: tuple[int, int] = (0, 0)) -> Iterator[Layout]:
    """Every layout of `world_size` ranks whose degrees divide what they split: TP and CP
    powers of two up to `max_tp` / `max_cp` (a TP group beyond one node is never faster),
    CP dividing the sequence into 2 cp chunks, PP at most one block per stage, the global
    batch split evenly over the data-parallel ranks, EP dividing dp_shard x cp and the
    experts, pipeline microbatches of `microbatch_sizes` sequences with at least pp of them (and
    for the interleaved schedules a count torch splits into equal rounds; without PP the whole
    local batch at once or accumulated in microbatches of those sizes), data-parallel
    replicas only beside a shard group of a node's ranks (`replicas_across_nodes_only`),
    FSDP's `reshard_policies` (default: `reshard_choices`), and for each AC mode the layer
    intervals `ac_every` lists (default: whole blocks every block or every second one; 1 for
    modes it leaves out). With `stage_sizes` (the run's own split: blocks per stage, from
    `--parallelism.pipeline_parallel_split_points` or `layers_per_stage`) every layout
    pipelines those stages, len(stage_sizes) / pp per rank, as the schedules allow; else the
    even split makes the first and last stages lighter by `stage_weights` blocks. The
    bounds are pruning for speed: a flag the user pins widens them. The model's own
    constraints (heads, hidden sizes, ties) are checked by `ParallelDims.validate_model`
    through `valid`. A compiled model leaves out the zero-bubble schedules, which the engine
    refuses for it (`check_compile_options`)."""
    if work.compile:
        schedules = [s for s in schedules if s not in ZERO_BUBBLE_SCHEDULES]
    for pp in divisors(world_size):
        if pp > facts.n_layers or (stage_sizes and pp == 1):
            continue
        for tp in _powers_of_two_dividing(world_size // pp, max_tp):
            for cp in _powers_of_two_dividing(world_size // (pp * tp), max_cp):
                if work.seq_len % (2 * cp):
                    continue
                dp = world_size // (pp * tp * cp)
                if work.global_batch_size % dp:
                    continue
                local = work.global_batch_size // dp
                for dp_replicate in divisors(dp):
                    dp_shard = dp // dp_replicate
                    if replicas_across_nodes_only and dp_replicate > 1 and dp_shard * cp * tp < min(8, world_size // pp):
                        continue  # replicas across nodes only: shard within a node at least
                    eps = [1] if not n_experts else [e for e in divisors(dp_shard * cp) if n_experts % e == 0]
                    policies = reshard_choices(pp, dp_shard * cp > 1, reshard_policies)
                    for ep in eps:
                        for ac in ac_modes:
                            for every in ac_every.get(ac, (1,)):
                                for policy in policies:
                                    yield from _pipeline_variants(pp, dp_replicate, dp_shard, cp, tp, ep, ac, local,
                                                                  facts.n_layers, schedules, microbatch_sizes, policy,
                                                                  every, stage_sizes, stage_weights)


def reshard_choices(pp: int, sharded: bool, pinned: Sequence[str] | None = None) -> tuple[str, ...]:
    """FSDP reshard policies worth ranking for a mesh: `pinned` when given; else "default"
    and, where FSDP shards, the policy that differs from it there: "never" without PP (the
    backward reuses the forward's gather: one gather per microbatch instead of two, every
    block's parameters held at once), "always" under PP (the stage's parameters freed after
    each forward: less memory, two gathers per microbatch instead of one per step)."""
    if pinned is not None:
        return tuple(pinned)
    if not sharded:
        return ("default",)
    return ("default", "always" if pp > 1 else "never")


def _pipeline_variants(pp, dp_replicate, dp_shard, cp, tp, ep, ac, local, n_layers, schedules,
                       microbatch_sizes, reshard, every=1, stage_sizes=None, weights=(0, 0)) -> Iterator[Layout]:
    base = dict(pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, ep=ep, ac=ac,
                local_batch_size=local, reshard_after_forward=reshard, ac_every=every)
    if pp == 1:  # the whole local batch at once, or accumulated over microbatches of `microbatch_sizes`
        for micro in sorted({local, *(m for m in microbatch_sizes if m < local and local % m == 0)}, reverse=True):
            yield Layout(**base, microbatch_size=micro, schedule="1F1B")
        return
    for micro in microbatch_sizes:
        if local % micro or local // micro < pp:
            continue
        for schedule in schedules:
            if schedule in ZERO_BUBBLE_SCHEDULES and not zero_bubble_timeable():
                continue  # this torch cannot list their order
            if schedule in ZERO_BUBBLE_SCHEDULES and reshard == "always":
                continue  # refused by the engine: the split backward's weight gradients would be lost
            stages = 1 if schedule in SINGLE_STAGE else 2  # the engine's default stages per rank
            if stage_sizes:  # the run's own split: the stages per rank follow
                if stage_count_problem(len(stage_sizes), pp, schedule):
                    continue
                stages = len(stage_sizes) // pp
                if schedule not in SINGLE_STAGE and stages < 2:
                    continue  # a multi-stage schedule (torch's order needs two stages per rank at least)
            if n_layers < pp * stages or microbatch_count_problem(schedule, pp, local // micro):
                continue
            sizes = tuple(stage_sizes) if stage_sizes else _stage_sizes(n_layers, pp * stages, weights)
            if min(sizes) < 1:
                continue  # the lighter first / last stage comes out empty: refused by the engine
            if every > 1 and max(sizes) < 2:
                continue  # stages of one block: every k-th block is every block
            yield Layout(**base, microbatch_size=micro, schedule=schedule, stages_per_rank=stages,
                         stage_sizes=tuple(stage_sizes) if stage_sizes else None,
                         stage_weights=(0, 0) if stage_sizes else tuple(weights))


def rank_layouts(facts: ModelFacts, layouts: Iterable[Layout], work: Workload, hw: Hardware,
                 valid: Callable[[Layout], bool] = lambda layout: True) -> list[Prediction]:
    """Predictions of the valid layouts, fitting ones first, fastest first; a non-default
    FSDP reshard policy only where it earns its place (`RESHARD_MIN_GAIN`)."""
    preds = [predict(facts, lay, work, hw) for lay in layouts if valid(lay)]
    defaults = {p.layout: p for p in preds if p.layout.reshard_after_forward == "default"}
    preds = [p for p in preds if _earns_its_place(p, defaults.get(dataclasses.replace(p.layout,
                                                                                    reshard_after_forward="default")))]
    return sorted(preds, key=lambda p: (not p.fits, -p.tokens_per_s_per_device, p.memory["total"]))


RESHARD_MIN_GAIN = 0.01
"""How much faster than the same layout under the default policy a non-default FSDP reshard
policy must be predicted to be ranked: "never" always costs memory (every block gathered at
once), and a gain below 1% is no reason to pay it; nor is a row that differs from its twin
only there worth a place in the table."""


def _earns_its_place(pred: Prediction, twin: Prediction | None) -> bool:
    """Whether `pred` (any policy) is worth ranking beside `twin`, the same layout under the
    default policy (None: not enumerated, e.g. the policy was pinned): it fits where the twin
    does not, or is `RESHARD_MIN_GAIN` faster."""
    if pred.layout.reshard_after_forward == "default" or twin is None:
        return True
    if pred.fits != twin.fits:
        return pred.fits
    return pred.tokens_per_s_per_device >= (1 + RESHARD_MIN_GAIN) * twin.tokens_per_s_per_device


def layout_dims(layout: Layout) -> ParallelDims:
    """The `ParallelDims` of a layout (for `titan.dist.dry_run.validate_against_model`)."""
    return ParallelDims(dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=layout.cp, tp=layout.tp,
                        pp=layout.pp, ep=layout.ep, world_size=layout.world_size)


__all__ = ["HARDWARE", "BlockParams", "Hardware", "Layout", "ModelFacts", "Prediction", "Workload",
           "divisors", "enumerate_layouts", "layout_dims", "parse_gpus", "predict", "rank_layouts",
           "rank_stages", "reshard_choices", "stage_params"]
