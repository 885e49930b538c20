"""The training engine: one way to build, shard, step and save a model, under every loop.

Pretraining, supervised fine-tuning and the RL policy trainer differ in their data and their
loss, never in how a model is built, parallelized, stepped or checkpointed. They all drive a
:class:`TrainingEngine`:

.. code-block:: python

    engine = TrainingEngine.from_config(cfg, model_spec=spec, vocab_size=v, states={"dataloader": loader})
    for microbatch in microbatches:                       # gradient accumulation
        engine.forward_backward(microbatch, loss_fn, global_token_count=n)
    grad_norm = engine.optimizer_step()                    # clip -> step -> LR step

``loss_fn(outputs, batch)`` returns the *summed* loss of the microbatch; the engine divides by
the global token count the loop passes (and undoes data-parallel gradient averaging), so every
token of the global batch weighs the same whatever rank or microbatch it landed in.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from titan.ckpt import (
    CheckpointConfig,
    CheckpointManager,
    OptimizerWrapper,
    TrainState,
    plain_tensor,
)
from titan.dist import (
    ActivationCheckpointConfig,
    CollectiveTimeoutError,
    CommConfig,
    CompileConfig,
    ParallelDims,
    ParallelismConfig,
    PeerLostError,
    build_pipeline,
    check_compile_options,
    check_reshard_under_zero_bubble,
    clip_grad_norm_,
    destroy_distributed,
    enable_flight_recorder,
    init_distributed,
    loss_parallel_context,
    mixed_precision_policy,
    parallelize,
    replicas_sync_later,
    set_collective_timeout,
    shard_batch_dict_for_context_parallel,
    validate_against_model,
)
from titan.dist.comm import TRACE_FOLDER
from titan.dist.dry_run import has_auxiliary_loss
from titan.train.device_copy import BatchCopier
from titan.train.fault_tolerance import FaultToleranceConfig, ReplicaGroups
from titan.train.float8_tensor_parallel import float8_tensor_parallel
from titan.train.loss import IGNORE_INDEX, NonFiniteLossError
from titan.train.lr_scheduler import (
    LRSchedulerConfig,
    build_lr_scheduler,
    warn_if_warmup_exceeds_steps,
)
from titan.train.model_spec import (
    HasAuxLoss,
    ModelSpec,
    TakesSequenceSum,
    UpdatesAfterOptimizerStep,
)
from titan.train.optimizer import OptimizerConfig, build_optimizer
from titan.train.quantize import (
    QuantizeConfig,
    apply_quantization,
    check_quantize_supported,
    precompute_float8_scales,
    warn_if_float8_uncompiled,
)
from torch import nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torch.distributed.tensor import DTensor

logger = logging.getLogger("titan")

REPLICA_STATES = ("model", "optimizer", "lr_scheduler", "train_state")
"""What a rejoining replica group (``--fault_tolerance.enable``) fetches from a live one."""

LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]
"""``loss_fn(outputs, batch) -> summed loss`` of one microbatch (outputs: the logits)."""

MODEL_INPUT_KEYS = ("positions", "document_ids")
"""Batch keys the model's forward takes besides the token ids (when document masking is on)."""


def setup_logging(rank: int, *, prefix: str = "titan") -> None:
    """INFO on rank 0, warnings only elsewhere, one compact format that opens with ``prefix``
    (a disaggregated run's generator ranks log as "titan generator", their first rank at INFO
    beside the trainer's). A record a library has already printed through its own console
    handler (``datasets`` and ``huggingface_hub`` install one) is not printed a second time."""
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[{prefix} %(asctime)s] %(message)s", datefmt="%H:%M:%S", force=True)
    for handler in logging.getLogger().handlers:
        handler.addFilter(not_printed_by_a_library)


def not_printed_by_a_library(record: logging.LogRecord) -> bool:
    """False for a record that a console handler of a logger between its own and the root
    printed already (the logger propagates after its handlers ran)."""
    logger = logging.getLogger(record.name)
    while logger is not None and logger is not logging.getLogger():
        if any(_is_console(handler) and record.levelno >= handler.level for handler in logger.handlers):
            return False
        logger = logger.parent if logger.propagate else None
    return True


def _is_console(handler: logging.Handler) -> bool:
    """A handler writing to this process's stderr or stdout."""
    stream = getattr(handler, "stream", None)
    return isinstance(handler, logging.StreamHandler) and stream in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)


def set_determinism(seed: int, deterministic: bool, device: torch.device) -> None:
    """Seed every RNG the run touches; optionally restrict to deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        if device.type == "cuda":
            # cuBLAS needs a fixed workspace to be deterministic.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def state_tensor_meta(model: nn.Module) -> dict[str, tuple[torch.Size, torch.dtype, bool]]:
    """``name -> (shape, dtype, is_buffer)`` of every tensor of ``model``'s ``state_dict``
    without aliases: its parameters (tied ones once) and its persistent buffers. Found once,
    on the meta model: weight syncs then need no ``state_dict`` call."""
    meta = {name: (p.shape, p.dtype, False) for name, p in model.named_parameters()}
    persistent = model.state_dict(keep_vars=True).keys()
    meta.update({name: (b.shape, b.dtype, True) for name, b in model.named_buffers() if name in persistent})
    return meta


def local_value(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a (replicated) DTensor, e.g. a loss under loss parallel."""
    return t.to_local() if isinstance(t, DTensor) else t


class LRSchedulers:
    """One LR scheduler per optimizer (one optimizer per pipeline part), stepped together and
    checkpointed as one: they all follow the same schedule."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LRScheduler]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        """Advance every scheduler by one optimizer step."""
        for scheduler in self.schedulers:
            scheduler.step()

    def last_lr(self) -> float:
        """The current LR of the first parameter group."""
        return self.schedulers[0].get_last_lr()[0]

    def state_dict(self) -> dict[str, Any]:
        """The shared schedule position."""
        return self.schedulers[0].state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position (the steps taken) and set every parameter group's LR to this
        run's schedule there (after the optimizer's load, which the checkpoint manager does
        first, as Critic.load_state_dict does). torch's state also holds the saving run's peaks (``base_lrs``)
        and the LR its schedule set for the next step (``_last_lr``): kept, they silently
        overrode a resumed run's ``--optimizer.lr``, and a run extended past its old
        ``--training.steps`` trained its next step at the old schedule's end (LR 0). Warns
        (once, on rank 0) where this run's LR differs from the saved one."""
        saved = state.get("_last_lr")
        for scheduler in self.schedulers:
            peaks = list(scheduler.base_lrs)
            scheduler.load_state_dict(state)
            scheduler.base_lrs = peaks
            lrs = [peak * factor(scheduler.last_epoch)
                   for factor, peak in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
            for group, lr, peak in zip(scheduler.optimizer.param_groups, lrs, scheduler.base_lrs, strict=True):
                group["lr"], group["initial_lr"] = lr, peak
            scheduler._last_lr = lrs  # what get_last_lr() reports, as step() would have set it
        step, now = self.schedulers[0].last_epoch, self.last_lr()
        if saved and step > 0 and not math.isclose(float(saved[0]), now, rel_tol=1e-9, abs_tol=0.0) \
                and not (dist.is_initialized() and dist.get_rank()):
            logger.warning("the learning rate follows this run's schedule: step %d trains at %.3g, where the run that "
                           "saved step %d had set %.3g (its --optimizer.lr, --lr_scheduler.* or --training.steps "
                           "differed)", step + 1, now, step, float(saved[0]))


@dataclass
class _StageAuxiliaryLosses:
    """One pipeline step's state for the auxiliary losses of the stages before the last: the
    rank's batch, each microbatch's rows, how many forwards each stage has run, and the
    weighted losses added (for the step's logged loss)."""

    batch: Mapping[str, torch.Tensor]
    aux_scale: Any
    rows: Sequence[torch.Tensor]
    forwards: dict[int, int] = field(default_factory=dict)
    values: list[torch.Tensor] = field(default_factory=list)


class _AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on a stage's output whose backward also gives the auxiliary loss `aux` the
    gradient `weight`: the loss joins the objective without crossing pipeline stages."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux: torch.Tensor, weight: Any) -> torch.Tensor:
        ctx.aux_like = (aux.shape, aux.dtype, aux.device)
        ctx.weight = weight
        # A new tensor, not a view of `output`: the zero-bubble schedules' input pass
        # (torch's `stage_backward_input`) detaches the stage's outputs in place, which a view
        # refuses. One copy of the stage's output per microbatch.
        return output.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device = ctx.aux_like
        weight = torch.as_tensor(ctx.weight, dtype=dtype, device=device)
        return grad, weight.expand(shape).clone(), None


def hub_token_ids(tokenizer: Any) -> dict[str, int]:
    """The `config.json` special-token ids of a tokenizer (`bos_id`, `eos_id`): what
    `generate` stops at. A tokenizer without a BOS of its own reports its EOS there, which a
    config must not claim as a BOS. `pad_token_id` too (written for score heads only: see
    `TrainingEngine._hf_config_overrides`)."""
    ids = {"eos_token_id": int(tokenizer.eos_id)}
    if tokenizer.bos_id != tokenizer.eos_id:
        ids["bos_token_id"] = int(tokenizer.bos_id)
    pad = getattr(tokenizer, "pad_id", None)
    if pad is not None:
        ids["pad_token_id"] = int(pad)
    return ids


def _debug_overrides(config: Any, model_spec: ModelSpec) -> dict[str, Any]:
    """Model fields the ``--debug.*`` flags set: ``moe_force_load_balance`` (round-robin
    routing, for benchmarks), refused by name for a family without MoE routers."""
    if not getattr(getattr(config, "debug", None), "moe_force_load_balance", False):
        return {}
    args = model_spec.flavors.get(config.model.flavor)
    if args is not None and not hasattr(args, "moe_force_load_balance"):
        raise ValueError(f"--debug.moe_force_load_balance routes the tokens of MoE layers; {config.model.name} "
                         f"{config.model.flavor} has none: drop the flag")
    return {"moe_force_load_balance": True}


class TrainingEngine:
    """Builds a model family's model, parallelizes it over the mesh, and steps and saves it.

    Owns the process group, ``parallel_dims`` and its mesh, the model parts this rank holds
    (several under pipeline parallel), one optimizer and LR scheduler per part, the train state
    (step, tokens seen) and the checkpointer, which also saves the loop's extra ``states``
    (e.g. its data loader). See the module docstring for the step API.
    """

    def __init__(
        self,
        *,
        model_spec: ModelSpec,
        flavor: str,
        vocab_size: int,
        seq_len: int,
        steps: int,
        parallelism: ParallelismConfig,
        activation_checkpoint: ActivationCheckpointConfig,
        compile: CompileConfig,
        optimizer: OptimizerConfig,
        lr_scheduler: LRSchedulerConfig,
        checkpoint: CheckpointConfig,
        dump_folder: str,
        local_batch_size: int,
        global_batch_size: int = -1,
        max_norm: float = 1.0,
        mixed_precision_param: str = "float32",
        mixed_precision_reduce: str = "float32",
        document_mask: bool = False,
        seed: int = 0,
        deterministic: bool = False,
        model_overrides: Mapping[str, Any] | None = None,
        quantize: QuantizeConfig | None = None,
        states: Mapping[str, Any] | None = None,
        comm: CommConfig | None = None,
        fault_tolerance: FaultToleranceConfig | None = None,
        hf_export_files: Sequence[str] = (),
        hf_token_ids: Mapping[str, int] | None = None,
    ) -> None:
        model_spec.check_flavor(flavor)
        self.hf_export_files = tuple(hf_export_files)
        self.hf_token_ids = dict(hf_token_ids or {})
        self.model_spec, self.flavor = model_spec, flavor
        self.parallelism, self.max_norm, self.seq_len = parallelism, max_norm, seq_len
        self.mixed_precision_param, self.document_mask = mixed_precision_param, document_mask
        self.comm = comm or CommConfig()
        self.collectives_failed = False
        """Whether a collective timed out (`close` then skips everything collective)."""
        self.trace_folder = Path(dump_folder) / TRACE_FOLDER
        enable_flight_recorder(self.comm.trace_buf_size, self.trace_folder)
        self.dist_env = init_distributed(timeout_s=self.comm.init_timeout_seconds)
        setup_logging(self.dist_env.rank)
        self.device = self.dist_env.device
        self._aux_loss_share: torch.Tensor | None = None  # this step's auxiliary losses (start_step)
        self._copy_to_device = BatchCopier(self.device)
        set_determinism(seed, deterministic, self.device)
        self.parallel_dims = ParallelDims.from_config(parallelism, world_size=self.dist_env.world_size)
        self.quantize = quantize or QuantizeConfig()
        check_quantize_supported(self.quantize, self.device, uses_fully_shard=self.parallel_dims.uses_fully_shard)
        warn_if_float8_uncompiled(self.quantize, self.device, compiled=compile.compiles_model)
        check_reshard_under_zero_bubble(parallelism, self.parallel_dims)
        check_compile_options(compile, self.parallel_dims, async_tp=parallelism.enable_async_tensor_parallel,
                              sequence_parallel=parallelism.enable_sequence_parallel,
                              pipeline_schedule=parallelism.pipeline_parallel_schedule)
        meta_model = self._build_meta_model(
            vocab_size, seq_len, dict(model_overrides or {}), global_batch_size, local_batch_size
        )
        self.mesh = self.parallel_dims.build_mesh(self.device.type)
        # Pipeline parallel (set by _parallelize under PP): the schedule, and whether this rank
        # holds the first / last stage (without PP it holds both).
        self.pp_schedule: Any | None = None
        self.pp_has_first = self.pp_has_last = True
        self._pipeline_loss_call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self._pipeline_aux_run: _StageAuxiliaryLosses | None = None
        self._stage_aux_hooked = False  # a stage before the last on this rank adds an auxiliary loss
        self._inferring_pipeline_metadata = False
        self._step_hooks: list[Callable] | None = None
        self._first_non_finite_step: torch.Tensor | None = None
        mp_policy = mixed_precision_policy(mixed_precision_param, mixed_precision_reduce)
        self.model_parts = self._parallelize(
            meta_model, activation_checkpoint, compile, mp_policy, local_batch_size, seed
        )
        self.optimizers = [build_optimizer(optimizer, [part], self.device.type) for part in self.model_parts]
        warn_if_warmup_exceeds_steps(lr_scheduler, steps)
        self.lr_schedulers = LRSchedulers([build_lr_scheduler(lr_scheduler, opt, steps) for opt in self.optimizers])
        self.train_state = TrainState()
        self.step_callbacks: list[Callable[[int], None]] = []
        """Called with the new step after every optimizer step (a loop's garbage collection)."""
        self.checkpointer = self._build_checkpointer(meta_model, checkpoint, dump_folder, states or {})
        self.replicas = self._join_replica_groups(fault_tolerance)
        """This group's torchft participant (``--fault_tolerance.enable``), else None."""

    @classmethod
    def from_config(
        cls, config: Any, *, model_spec: ModelSpec, vocab_size: int, states: Mapping[str, Any] | None = None,
        tokenizer: Any | None = None,
    ) -> TrainingEngine:
        """Build from a config tree with the usual sections (``model``, ``training``,
        ``parallelism``, ``activation_checkpoint``, ``compile``, ``optimizer``,
        ``lr_scheduler``, ``checkpoint``, ``debug``, ``job``), e.g. a ``TrainerConfig``.
        ``tokenizer``, the one the loop built from ``config.tokenizer`` (built here when not
        given), names the special tokens of Hugging Face exports."""
        training = config.training
        return cls(
            model_spec=model_spec,
            flavor=config.model.flavor,
            vocab_size=vocab_size,
            seq_len=training.seq_len,
            steps=training.steps,
            parallelism=config.parallelism,
            activation_checkpoint=config.activation_checkpoint,
            compile=config.compile,
            optimizer=config.optimizer,
            lr_scheduler=config.lr_scheduler,
            checkpoint=config.checkpoint,
            dump_folder=config.job.dump_folder,
            local_batch_size=training.local_batch_size,
            global_batch_size=training.global_batch_size,
            max_norm=training.max_norm,
            mixed_precision_param=training.mixed_precision_param,
            mixed_precision_reduce=training.mixed_precision_reduce,
            document_mask=getattr(training, "document_mask", False),
            seed=config.debug.seed,
            deterministic=config.debug.deterministic,
            model_overrides={**config.model.overrides(), **_debug_overrides(config, model_spec)},
            quantize=getattr(config, "quantize", None),
            states=states,
            comm=getattr(config, "comm", None),
            fault_tolerance=getattr(config, "fault_tolerance", None),
            hf_export_files=config.tokenizer.hub_files() if hasattr(config, "tokenizer") else (),
            hf_token_ids=(hub_token_ids(tokenizer if tokenizer is not None else config.tokenizer.build())
                          if hasattr(config, "tokenizer") else None),
        )

    def _join_replica_groups(self, config: FaultToleranceConfig | None) -> ReplicaGroups | None:
        """Start this replica group's torchft participant: what a rejoining group fetches is
        the model, the optimizer, the schedule and the step counter."""
        if config is None or not config.enable:
            return None
        # The checkpointer's own wrappers; not its RNG (per rank) nor the loop's data position.
        states = {name: self.checkpointer.states[name] for name in REPLICA_STATES}
        return ReplicaGroups(config, states=states, rank=self.dist_env.rank, world_size=self.dist_env.world_size,
                             device=self.device, timeout_s=self.comm.train_timeout_seconds)

    def start_step(self) -> None:
        """Before a step's forward: join the replica groups' quorum (with
        ``--fault_tolerance.enable``; a rejoining group loads the live state here), and start
        the step's auxiliary-loss tally (:meth:`aux_loss_share`)."""
        if self.replicas is not None:
            self.replicas.start_step()
        self._aux_loss_share = None

    def aux_loss_share(self) -> torch.Tensor | None:
        """This rank's share, since :meth:`start_step`, of the auxiliary losses (an MoE
        router's balancing loss) the returned losses of :meth:`forward_backward` include,
        scaled alike: summed over the pipeline and data-parallel ranks it is the part of the
        step's loss that is auxiliary. A device scalar (no host sync); None when this rank's
        forwards left none."""
        if self._aux_loss_share is None:
            return None
        return self._aux_loss_share / self.data_parallel_grad_scale

    def _tally_aux(self, value: torch.Tensor | float) -> None:
        """Add a detached auxiliary term (already scaled) to the step's tally."""
        if isinstance(value, torch.Tensor):
            share = local_value(value.detach()).float()
            self._aux_loss_share = share if self._aux_loss_share is None else self._aux_loss_share + share

    # ---- collectives that never return ----------------------------------------------------

    def use_training_timeout(self) -> None:
        """From now on every collective of this engine times out after
        ``--comm.train_timeout_seconds`` (the set-up and the first step ran under
        ``--comm.init_timeout_seconds``)."""
        set_collective_timeout(self.comm.train_timeout_seconds, self.parallel_dims.process_groups())

    def timeout_error(self, err: BaseException, timeout_flag: str) -> RuntimeError | None:
        """The one-line error naming the collective ``err`` timed out in, or lost a peer in
        (`PeerLostError`: another rank left the run); None when ``err`` is neither. A timeout
        writes this rank's flight-recorder trace under the run. Either makes `close` skip
        everything collective."""
        error = CollectiveTimeoutError.from_error(err, rank=self.dist_env.rank, timeout_flag=timeout_flag,
                                                  trace_folder=self.trace_folder)
        error = error or PeerLostError.from_error(err, rank=self.dist_env.rank)
        self.collectives_failed = self.collectives_failed or error is not None
        return error

    # ---- construction -------------------------------------------------------------------

    def _build_meta_model(
        self, vocab_size: int, seq_len: int, overrides: dict[str, Any], global_batch_size: int, local_batch_size: int
    ) -> nn.Module:
        """The whole model on the meta device, checked against the parallel degrees before
        any process group work."""
        with torch.device("meta"):
            model = self.model_spec.build(self.flavor, **overrides, vocab_size=vocab_size, max_seq_len=seq_len)
        validate_against_model(
            self.parallel_dims,
            model,
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            local_batch_size=local_batch_size,
        )
        self.num_params = model.num_params()
        self.num_labels = int(getattr(getattr(model, "args", None), "num_labels", 0) or 0)
        """The score head's width (a sequence-classification model, e.g. a reward model); 0 for a
        language model."""
        self.flops_per_token = model.flops_per_token(seq_len)
        self._state_meta = state_tensor_meta(model)
        return model

    def _parallelize(self, model: nn.Module, activation_checkpoint, compile, mp_policy, local_batch_size: int, seed: int):
        """Apply the configured parallelisms, then materialize and initialize this rank's
        shards. Returns the model parts this rank holds (several under pipeline parallel).

        The quantization conversion comes first, on the whole model (so every pipeline stage
        gets the same converted linears); the parallelisms then see ordinary linears."""
        self.quantization = apply_quantization(model, self.quantize)
        if self.quantization is not None:
            logger.info(self.quantization.summary(self.quantize.recipe))
        float8_tp = float8_tensor_parallel(self.quantize, tp_enabled=self.parallel_dims.tp_enabled)
        common = dict(parallelism=self.parallelism, activation_checkpoint=activation_checkpoint, compile=compile,
                      tensor_parallel_overrides=float8_tp)
        if self.parallel_dims.pp_enabled:
            self.pp_schedule, parts, self.pp_has_first, self.pp_has_last = build_pipeline(
                model,
                self.parallel_dims,
                **common,
                loss_fn=self._pipeline_loss,
                local_batch_size=local_batch_size,
                device=self.device,
                mp_policy=mp_policy,
                scale_grads=False,  # the loss is already normalized over the global batch
            )
            self._mark_pipeline_metadata_inference(self.pp_schedule)
            for part in parts:  # the last stage adds its auxiliary loss to the loss itself
                if isinstance(part, HasAuxLoss) and not (part is parts[-1] and self.pp_has_last):
                    part.register_forward_hook(self._stage_auxiliary_loss)
                    self._stage_aux_hooked = True
            if has_auxiliary_loss(model) and getattr(model, "aux_loss_pools_layers", False):  # the whole model
                logger.warning(
                    "pipeline parallel: each stage computes the model's auxiliary (router balancing) loss over the "
                    "layers it holds; this model's loss pools statistics over all its layers (the Switch loss as "
                    "transformers computes it), so each stage pools its own layers, weighted by their share, "
                    "which equals the whole model's loss only when the stages route alike")
        else:
            parts = [parallelize(model, self.parallel_dims, self.mesh, **common, mp_policy=mp_policy)]
        if float8_tp is not None:
            logger.info(float8_tp.summary() + (" (this rank's pipeline stages)" if self.parallel_dims.pp_enabled else ""))
        self._connect_sequence_sums(parts)
        for part in parts:
            part.to_empty(device=self.device)
            # Values depend on the seed and each parameter's name only: every layout starts
            # from the weights a single process would create, each rank drawing its shards.
            with torch.no_grad():
                part.init_weights(buffer_device=self.device, seed=seed)
            part.train()
        return parts

    @property
    def sequence_sum(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Under context parallel, a differentiable sum over the CP ranks, which hold the other
        positions of this rank's sequences (its backward sums the gradient back); None
        without. For statistics of whole sequences: an MoE balancing loss, an RL sequence
        ratio. Collective on the CP ranks."""
        cp_mesh = self.parallel_dims.mesh("cp")
        if cp_mesh is None or cp_mesh.size() == 1:
            return None
        return functools.partial(differentiable_all_reduce, group=cp_mesh.get_group())

    def _connect_sequence_sums(self, parts: list[nn.Module]) -> None:
        """Hand every module that takes a statistic over a whole microbatch
        (`TakesSequenceSum`, an MoE router's balancing loss) the CP ranks' `sequence_sum`."""
        sequence_sum = self.sequence_sum
        if sequence_sum is None:
            return
        for part in parts:
            for module in part.modules():
                if isinstance(module, TakesSequenceSum):
                    module.set_sequence_sum(sequence_sum)

    def _hf_config_overrides(self, meta_model: nn.Module) -> dict[str, Any]:
        """What an exported `config.json` states over the adapter's: the model's context (the
        flavor's, e.g. 131,072 for Llama 3.1; for `--model.flavor hf` the source's), not the
        sequence length this run's RoPE tables were built for; and the run's tokenizer's
        special tokens (`hf_token_ids`), not the family's usual ones. The pad id only for a
        score head (`num_labels`): transformers reads a sequence's score at its last token that
        is not padding, and refuses batches without a pad id."""
        trained = getattr(getattr(meta_model, "args", None), "max_seq_len", None)
        published = getattr(self.model_spec.flavors.get(self.flavor), "max_seq_len", None)
        contexts = [n for n in (trained, published) if isinstance(n, int)]
        context = {"max_position_embeddings": max(contexts)} if contexts else {}
        tokens = dict(self.hf_token_ids)
        if not getattr(getattr(meta_model, "args", None), "num_labels", 0):
            tokens.pop("pad_token_id", None)
        return {**context, **tokens}

    def _build_checkpointer(
        self, meta_model: nn.Module, config: CheckpointConfig, dump_folder: str, states: Mapping[str, Any]
    ) -> CheckpointManager:
        adapter = self.model_spec.adapter(meta_model) if self.model_spec.adapter else None
        self.hf_adapter = adapter
        return CheckpointManager(
            config,
            dump_folder=str(Path(dump_folder)),
            states={"lr_scheduler": self.lr_schedulers, "train_state": self.train_state, **states},
            model_parts=self.model_parts,
            optimizers=OptimizerWrapper(self.model_parts, self.optimizers),
            hf_adapter=adapter,
            hf_config_overrides=self._hf_config_overrides(meta_model),
            hf_export_files=self.hf_export_files,
            # Loop states (e.g. a loader whose position is one global record, equal on every
            # rank) are saved once; only the RNG state is per rank.
            rank_local=("rng",),
        )

    # ---- the step -----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps taken so far (restored by a checkpoint resume)."""
        return self.train_state.step

    def sum_over(self, value: torch.Tensor, axis: str) -> torch.Tensor:
        """Sum a tensor in place over the ranks of mesh ``axis`` (no-op when the axis is
        trivial); e.g. ``"dp_cp"`` for a global token count. Collective on that axis."""
        mesh = self.parallel_dims.mesh(axis)
        if mesh is not None and mesh.size() > 1:
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=mesh.get_group())
        return value

    def gather_over(self, value: Any, axis: str) -> list[Any]:
        """Every rank's picklable ``value`` on mesh ``axis``, in rank order (``[value]`` when
        the axis is trivial). Collective on that axis, and a host sync: logging steps only."""
        mesh = self.parallel_dims.mesh(axis)
        if mesh is None or mesh.size() == 1:
            return [value]
        out: list[Any] = [None] * mesh.size()
        dist.all_gather_object(out, value, group=mesh.get_group())
        return out

    @property
    def data_parallel_grad_scale(self) -> float:
        """FSDP/HSDP/DDP average gradients over the data-parallel and context-parallel ranks;
        a loss that is each rank's share of a global sum must undo that average."""
        mesh = self.parallel_dims.mesh("dp_cp")
        return float(mesh.size()) if mesh is not None else 1.0

    def forward_backward(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: LossFn,
        *,
        global_token_count: torch.Tensor | float,
        aux_token_count: torch.Tensor | float | None = None,
        last_microbatch: bool = True,
    ) -> torch.Tensor:
        """Forward and backward of one microbatch; gradients accumulate until
        :meth:`optimizer_step`.

        ``batch``: dict of [B, S] tensors with ``input_ids``; every key travels with the
        microbatch (context parallel shards each along the sequence, pipeline parallel hands
        the rows of each pipeline microbatch to the last stage's ``loss_fn``).
        ``global_token_count``: what the summed losses are divided by, e.g. the valid label
        tokens of the whole global batch (all microbatches, all data-parallel ranks).
        ``aux_token_count``: the global count of labelled tokens, which a model's auxiliary
        loss (an MoE router's balancing loss) is averaged over whatever the main loss is
        divided by (an RL loss may divide by completions); None: ``global_token_count`` (the
        loss is a token mean).
        ``last_microbatch``: False while more microbatches of this optimizer step follow: the
        data-parallel replicas (HSDP, DDP) leave their gradient all-reduce to the last one,
        which all-reduces the sum once (FSDP still reduce-scatters every microbatch).
        Returns this rank's detached share of the normalized loss (zero on pipeline stages
        without the loss); summing it over the data-parallel ranks gives the global loss.
        """
        batch = self._prepare(batch)
        scale = self.data_parallel_grad_scale / global_token_count
        aux_scale = self.data_parallel_grad_scale / (global_token_count if aux_token_count is None else aux_token_count)
        with contextlib.nullcontext() if last_microbatch else replicas_sync_later(self.model_parts):
            loss = self._forward_backward(batch, loss_fn, scale, aux_scale)
        return loss / self.data_parallel_grad_scale

    def _forward_backward(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn, scale, aux_scale) -> torch.Tensor:
        """The microbatch's scaled loss, backward run (this rank's detached share, scaled)."""
        if self.parallel_dims.pp_enabled:
            with self._autocast():
                loss = self._pipeline_run(batch, loss_fn, scale, backward=True, aux_scale=aux_scale)
        else:
            with loss_parallel_context(self.parallel_dims, self.parallelism):
                with self._autocast():
                    logits = self.model_parts[0](batch["input_ids"], **self._model_kwargs(batch))
                # The loss as a plain tensor: under loss parallel it is a replicated DTensor,
                # and autograd cannot add it to a plain auxiliary loss in backward.
                aux = self._auxiliary_loss(self.model_parts, batch) * aux_scale
                loss = local_value(loss_fn(logits, batch)) * scale + aux
                self._tally_aux(aux)
                del logits  # free the largest activation before backward
                loss.backward()
            loss = local_value(loss.detach())
        return loss

    @torch.no_grad()
    def forward_only(self, batch: Mapping[str, torch.Tensor], loss_fn: LossFn) -> torch.Tensor:
        """Evaluate one microbatch without gradients (validation, scoring): returns this
        rank's detached summed loss (zero on pipeline stages without the loss); summing it over
        the data-parallel, context-parallel and pipeline ranks gives the batch's sum."""
        batch = self._prepare(batch)
        if self.parallel_dims.pp_enabled:
            with self._autocast():
                return self._pipeline_run(batch, loss_fn, 1.0, backward=False, aux_scale=0.0)
        with loss_parallel_context(self.parallel_dims, self.parallelism):
            with self._autocast():
                logits = self.model_parts[0](batch["input_ids"], **self._model_kwargs(batch))
            return local_value(loss_fn(logits, batch).detach())

    def train(self, mode: bool = True) -> None:
        """Put every model part in training (or, with ``mode=False``, evaluation) mode."""
        for part in self.model_parts:
            part.train(mode)

    def optimizer_step(self, *, sync: bool = True) -> float | torch.Tensor:
        """Clip the global gradient norm (``max_norm <= 0``: measure only), step every
        optimizer and LR scheduler, zero the gradients; returns the norm before clipping.

        Raises ``NonFiniteLossError`` before stepping when the norm is NaN/inf, so the
        weights stay finite (a non-finite loss on any rank makes the global norm non-finite,
        so every rank stops together).

        ``sync=False`` never waits for the device: the norm comes back as a device tensor and
        its finiteness is recorded on the device, for :meth:`raise_if_non_finite` to raise at
        the loop's next synchronizing step (a logging or checkpoint step). The steps in
        between may then write non-finite weights, but no checkpoint holds them:
        :meth:`maybe_save` checks first.
        """
        params = [p for part in self.model_parts for p in part.parameters()]
        if self.replicas is not None:
            self.replicas.average_gradients(params)
        norm = clip_grad_norm_(params, self.max_norm, mesh=self.mesh)
        if not sync:
            self._record_non_finite(norm)
            self._step_optimizers()
            return norm.detach()
        grad_norm = float(norm)
        if not math.isfinite(grad_norm):
            culprit = self._first_non_finite_gradient()
            self.zero_grad()
            raise NonFiniteLossError(
                f"step {self.step + 1}: grad norm {grad_norm}"
                + (f", first non-finite gradient on this rank: {culprit}" if culprit else "")
                + " — training stopped before the optimizer step, so the weights (and the last checkpoint) are "
                "still finite. Try a lower --optimizer.lr, a longer --lr_scheduler.warmup_steps, or clipping "
                "with --training.max_norm."
            )
        self._step_optimizers()
        return grad_norm

    def _step_optimizers(self) -> None:
        if self.replicas is not None and not self.replicas.should_commit():
            logger.warning("step %d dropped: a replica group failed during it", self.step + 1)
            self.zero_grad()
            return
        for opt in self.optimizers:
            opt.step()
        self.lr_schedulers.step()
        self.zero_grad()
        self.train_state.step += 1
        self._after_optimizer_step()
        for callback in self.step_callbacks:
            callback(self.train_state.step)

    def _record_non_finite(self, grad_norm: torch.Tensor) -> None:
        """Remember, on the device, the first step whose gradient norm was NaN/inf."""
        norm = local_value(grad_norm.detach())
        if self._first_non_finite_step is None:
            self._first_non_finite_step = torch.zeros((), dtype=torch.long, device=norm.device)
        first = self._first_non_finite_step
        step = torch.full_like(first, self.step + 1)
        first.copy_(torch.where((first == 0) & ~torch.isfinite(norm), step, first))

    def raise_if_non_finite(self) -> None:
        """Raise ``NonFiniteLossError`` when a step taken with ``optimizer_step(sync=False)``
        had a non-finite gradient norm (waits for the device)."""
        first = self._first_non_finite_step
        if first is None or int(first) == 0:
            return
        raise NonFiniteLossError(
            f"step {int(first)}: non-finite grad norm (read after step {self.step}, at the first sync since) — "
            "training stopped; no checkpoint was written after it. Try a lower --optimizer.lr, a longer "
            "--lr_scheduler.warmup_steps, or clipping with --training.max_norm."
        )

    def _after_optimizer_step(self) -> None:
        """Let modules update state that is not trained by gradients (e.g. an MoE router's
        load-balancing bias): every submodule with an ``after_optimizer_step(sum_over_dp)``
        method is called, ``sum_over_dp(tensor)`` summing a tensor in place over the
        data-parallel and context-parallel ranks (duck-typed: the engine names no family)."""
        def sum_over_dp(value: torch.Tensor) -> torch.Tensor:
            return self.sum_over(value, "dp_cp")

        if self._step_hooks is None:  # found once: the module tree does not change
            self._step_hooks = [
                module.after_optimizer_step
                for part in self.model_parts
                for module in part.modules()
                if isinstance(module, UpdatesAfterOptimizerStep)
            ]
        for hook in self._step_hooks:
            hook(sum_over_dp)
        precompute_float8_scales(self.model_parts, self.quantize)

    def _first_non_finite_gradient(self) -> str | None:
        """The name of the first parameter (in model order) whose gradient shard on this rank
        holds a NaN or inf: where a divergence shows first."""
        for part in self.model_parts:
            for name, param in part.named_parameters():
                if param.grad is not None and not torch.isfinite(local_value(param.grad)).all():
                    return name
        return None

    def zero_grad(self) -> None:
        """Drop every accumulated gradient."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def to_device(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The keys of a microbatch the engine uses, on this device, without making the host
        wait for queued work (see :class:`~titan.train.device_copy.BatchCopier`); tensors
        already there pass through, so a loop may move its microbatches first (to count their
        tokens on the device) and hand them to :meth:`forward_backward` after.

        Without document masking the loader's per-document ``positions`` and ``document_ids``
        are dropped: RoPE then runs across the packed row, as attention does.
        """
        return self._copy_to_device({k: v for k, v in batch.items() if self.document_mask or k not in MODEL_INPUT_KEYS})

    def _prepare(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The microbatch on this device (:meth:`to_device`) and, under context parallel, cut
        to this rank's share of the sequence (every [B, S] key alike, ``positions`` added)."""
        batch = self.to_device(batch)
        if self.parallel_dims.cp_enabled:
            batch = shard_batch_dict_for_context_parallel(self.parallel_dims.mesh("cp"), batch)
            if batch["positions"].dim() == 1:
                # One row of shard positions for the whole batch: give it the batch dim, so a
                # pipeline schedule splitting every keyword into microbatches splits rows.
                batch["positions"] = batch["positions"].expand(batch["input_ids"].shape[0], -1)
        return batch

    @staticmethod
    def _model_kwargs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the model's forward takes besides token ids: RoPE ``positions`` (this context
        parallel shard's, or restarting per document) and ``document_ids`` when present."""
        return {k: batch[k] for k in MODEL_INPUT_KEYS if k in batch}

    @staticmethod
    def _auxiliary_loss(parts: list[nn.Module], batch: Mapping[str, torch.Tensor]) -> torch.Tensor | float:
        """Auxiliary losses a model leaves from its training forward (e.g. an MoE router's
        balancing loss): a model part with an ``aux_loss()`` method returning a scalar tensor
        (coefficient applied) or None. Weighted by the microbatch's labelled tokens, so after
        the engine's division by the global token count it is a token-weighted mean."""
        terms = [aux for part in parts if isinstance(part, HasAuxLoss) and (aux := part.aux_loss()) is not None]
        if not terms:
            return 0.0
        return torch.stack(terms).sum() * TrainingEngine._labelled_tokens(batch)

    @staticmethod
    def _labelled_tokens(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | int:
        """The batch's labelled tokens (all of its tokens without labels)."""
        labels = batch.get("labels")
        return (labels != IGNORE_INDEX).sum() if labels is not None else batch["input_ids"].numel()

    def _stage_auxiliary_loss(self, module: nn.Module, _args: Any, output: Any) -> Any:
        """Forward hook of a pipeline stage before the last whose model leaves an auxiliary
        loss (an MoE router's): the loss joins the objective on its own stage, weighted like
        the last stage's (the microbatch's labelled tokens times the step's auxiliary scale),
        through an identity on the stage's output whose backward also feeds the auxiliary
        loss its gradient. Not during metadata inference or a forward-only pass."""
        run = self._pipeline_aux_run
        if run is None or self._inferring_pipeline_metadata or not torch.is_grad_enabled():
            return None
        aux = module.aux_loss()
        if aux is None:
            return None
        # torch's schedules run each stage's forwards in microbatch order, and split the
        # batch's rows into microbatches with `tensor_split`, as `run.rows` holds them.
        index = run.forwards.get(id(module), 0)
        run.forwards[id(module)] = index + 1
        rows = run.rows[index]
        weight = run.aux_scale * self._labelled_tokens({k: run.batch[k][rows] for k in ("labels", "input_ids")
                                                        if k in run.batch})
        run.values.append(local_value(aux.detach()) * weight)
        return _AddAuxiliaryLoss.apply(output, aux, weight)

    def _mark_pipeline_metadata_inference(self, schedule: Any) -> None:
        """torch's schedules infer each stage's tensor metadata on their first run and again
        after every switch between ``eval`` and ``step``, by running the stage and the loss on
        placeholder tensors (uninitialized memory). The loop's loss must not see those calls:
        its statistics would count a microbatch that does not exist (an RL step's KL and
        entropy came out NaN after its forward-only pre-update pass). This marks that window
        so :meth:`_pipeline_loss` answers it alone. (torch versions without the method run no
        loss during inference.)"""
        initialize = getattr(schedule, "_initialize_pp_stages", None)
        if initialize is None:
            return

        def marked(*args: Any, **kwargs: Any) -> Any:
            self._inferring_pipeline_metadata = True
            try:
                return initialize(*args, **kwargs)
            finally:
                self._inferring_pipeline_metadata = False

        schedule._initialize_pp_stages = marked

    def _pipeline_loss(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The schedule's loss: ``rows`` are the batch rows of this pipeline microbatch (the
        schedule splits the row-index target like any input). During metadata inference: a
        zero of the output's graph (what inference needs: the gradients' shapes), without
        calling the loop's loss."""
        if self._inferring_pipeline_metadata:
            return output.float().sum() * 0.0
        if self._pipeline_loss_call is None:
            raise RuntimeError("the pipeline loss ran outside TrainingEngine.forward_backward")
        return self._pipeline_loss_call(output, rows)

    def _pipeline_run(
        self, batch: dict[str, torch.Tensor], loss_fn: LossFn, scale, *, backward: bool, aux_scale: float
    ) -> torch.Tensor:
        """Run the schedule over ``batch`` (forward and backward, or forward only); the last
        stage returns the sum of its microbatch losses (with its own layers' auxiliary loss,
        which the schedule runs right after the forward of the same pipeline microbatch),
        the other stages zero."""

        def microbatch_loss(output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            rows_batch = {k: v[rows] for k, v in batch.items()}
            loss = local_value(loss_fn(output, rows_batch)) * scale
            if aux_scale:
                aux = self._auxiliary_loss(self.model_parts[-1:], rows_batch) * aux_scale
                loss = loss + aux
                self._tally_aux(aux)  # aux_scale is 0 on forward-only runs
            return loss

        rows = torch.arange(batch["input_ids"].shape[0], device=self.device)
        losses: list[torch.Tensor] = []
        # The schedule splits keyword arguments into pipeline microbatches and hands them to
        # every stage, so positions and document ids reach the attention of every stage.
        kwargs: dict[str, Any] = self._model_kwargs(batch)
        if self.pp_has_last:
            kwargs.update(target=rows, losses=losses)
        self._pipeline_loss_call = microbatch_loss
        if backward and aux_scale and self._stage_aux_hooked:
            self._pipeline_aux_run = _StageAuxiliaryLosses(
                batch=batch, aux_scale=aux_scale, rows=rows.tensor_split(self.pp_schedule._n_microbatches))
        try:
            run = self.pp_schedule.step if backward else self.pp_schedule.eval
            if self.pp_has_first:
                run(batch["input_ids"], **kwargs)
            else:
                run(**kwargs)
        finally:
            self._pipeline_loss_call = None
            stage_aux, self._pipeline_aux_run = self._pipeline_aux_run, None
        # The earlier stages' auxiliary losses count where they were computed: summed over the
        # pipeline ranks, the rank losses give the whole objective, as without PP.
        total = torch.zeros((), device=self.device)
        if stage_aux is not None and stage_aux.values:
            stage_total = torch.stack(stage_aux.values).sum()
            self._tally_aux(stage_total)
            total = total + stage_total
        if self.pp_has_last:
            total = total + torch.stack([local_value(x).detach() for x in losses]).sum()
        return total

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the forward and backward compute in (``--training.mixed_precision_param``)."""
        return getattr(torch, self.mixed_precision_param)

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision where FSDP2's policy does not reach (one device, DDP, TP alone, PP
        without FSDP): autocast the forward to the compute dtype, keeping fp32 weights. Under
        FSDP2 the policy casts the parameters instead."""
        if self.compute_dtype == torch.float32 or self.parallel_dims.uses_fully_shard:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # ---- reading the weights ------------------------------------------------------------

    def full_state_dict(self, *, dtype: torch.dtype | None = None, names: str = "titan") -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, full tensor)`` for every parameter and persistent buffer of the whole
        model (its ``state_dict`` without tied aliases), one at a time.

        For weight sync (e.g. to an RL generator) and exports: each piece is gathered from its
        shards (and, under pipeline parallel, broadcast from the stage that holds it), cast to
        ``dtype`` and yielded before the next is gathered, so the model is never held twice.
        Buffers (e.g. an MoE router's load-balancing ``expert_bias``, moved after every step)
        keep their own dtype: they are state the forward reads, not weights to round.
        ``names="hf"`` maps names (and layouts) through the family's Hugging Face adapter.
        Collective: every rank must iterate it to the end, in step.
        """
        if names not in ("titan", "hf"):
            raise ValueError(f"names must be 'titan' or 'hf', got {names!r}")
        if names == "hf" and self.hf_adapter is None:
            raise ValueError(f"model family {self.model_spec.name!r} has no Hugging Face adapter")
        local = {name: t for part in self.model_parts
                 for name, t in (*part.named_parameters(), *part.named_buffers()) if name in self._state_meta}
        for name, (shape, param_dtype, is_buffer) in self._state_meta.items():
            tensor = self._gather_full(name, local.get(name), shape, param_dtype)
            tensor = tensor.detach().to(dtype) if dtype is not None and not is_buffer else tensor.detach()
            if names == "titan":
                yield name, tensor
            else:
                yield from self.hf_adapter.to_hf({name: tensor}).items()

    def _gather_full(self, name: str, param: torch.Tensor | None, shape, dtype: torch.dtype) -> torch.Tensor:
        """The full value of one parameter or buffer on every rank (all-gather of shards; broadcast
        from the owning pipeline stage under PP)."""
        with torch.no_grad():  # a copy of the weights, not part of any graph
            full = param.full_tensor() if isinstance(param, DTensor) else param
        # plain_tensor: a float8 all-gather weight leaves as the high-precision tensor it wraps.
        full = plain_tensor(full.detach()) if full is not None else None
        if not self.parallel_dims.pp_enabled:
            return full
        pp_mesh = self.parallel_dims.mesh("pp")
        group = pp_mesh.get_group()
        has = torch.tensor([1 if param is not None else 0], device=self.device)
        owners = [torch.zeros_like(has) for _ in range(pp_mesh.size())]
        dist.all_gather(owners, has, group=group)
        owner = next(i for i, o in enumerate(owners) if int(o))
        buffer = full if full is not None else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buffer, group=group, group_src=owner)
        return buffer

    # ---- checkpoints and shutdown -------------------------------------------------------

    def add_state(self, name: str, state: Any) -> None:
        """Checkpoint a loop's ``Stateful`` (e.g. its data loader) with the model, before the
        first load or save."""
        self.checkpointer.add_state(name, state)

    def load_checkpoint(self) -> int | None:
        """Resume from the newest checkpoint (or the initial load path): the step loaded (0 for
        a seed checkpoint or an initial load), None when there was nothing to load. The LR
        follows this run's schedule at the restored step (`LRSchedulers.load_state_dict`)."""
        return self.checkpointer.load()

    def maybe_save(self, *, last_step: bool = False, since: int | None = None) -> None:
        """Save a checkpoint when the interval (or ``last_step``) says so; ``since``: the step
        of the previous call, when one loop step takes several optimizer steps (a multiple of
        the interval passed over then counts). Raises first when a step taken without
        synchronizing had a non-finite gradient norm, so no checkpoint holds such weights."""
        if self.checkpointer.save_due(self.step, last_step=last_step, since=since):
            self.raise_if_non_finite()
        self.checkpointer.maybe_save(self.step, last_step=last_step, since=since)

    def close(self) -> None:
        """Drain checkpoint saves and release the process group (after a collective timed out:
        release it at once, since a save's or a barrier's collectives would wait on the same
        missing rank; a save in flight stays unpublished, the previous step loadable)."""
        if self.replicas is not None:
            self.replicas.close()
        if self.collectives_failed:
            destroy_distributed(barrier=False)
            return
        self.checkpointer.close()
        destroy_distributed()
