"""GKD (``titan gkd``): knowledge distillation from a teacher's whole next-token distribution,
on the SFT data and on the student's own completions.

Generalized Knowledge Distillation (Agarwal et al. 2024; TRL's ``GKDTrainer``) is
:class:`~titan.train.sft.SFTTrainer`'s loop with another loss: at every completion token the
generalized Jensen-Shannon divergence between the student's and the teacher's distributions
over the vocabulary (:mod:`titan.rl.distill_loss`; ``--gkd.beta`` 0 is the forward KL, 1 the
reverse KL), divided by the global batch's completion tokens as the SFT loss is.

What each microbatch trains on:

- the SFT data's completions (supervised distillation);
- with probability ``--gkd.lmbda`` (drawn per microbatch, TRL's per-``training_step`` draw),
  the student's own completions of the same prompts, sampled with ``--sampling.*`` by a
  model copy holding the student's current weights (synced from the engine on every step
  that needs it, checked tensor by tensor): on-policy distillation, where the teacher grades
  the mistakes the student actually makes. The copy is native (``--generator.kind native``)
  or a vLLM engine running the family's titan model code (``--generator.kind vllm``, TRL's
  ``use_vllm`` in colocate mode): in the trainer's process, on several ranks one engine per
  rank under the trainer's process group (vLLM's ``external_launcher`` executor);
- with ``--gkd.seq_kd``, the teacher's sampled completions in place of the data's
  (sequence-level KD), before the on-policy draw: sampled by the whole teacher's native copy,
  or with ``--generator.kind vllm`` by a vLLM engine reading the teacher's folder (one per
  rank; the teacher's logits then come from either layout).

Completions stop at the tokenizer's EOS, ``--sampling.stop_token_ids`` and the end-of-sequence
ids of the writer's Hugging Face folder (its ``generation_config.json``: an instruct model's end
of turn), as ``titan rl``'s rollouts and transformers' ``generate`` do.

A microbatch's rows are packed SFT examples: each example's prompt is its tokens before its
last completion span (a chat example's earlier assistant turns stay as context), and the
regenerated examples are packed back into rows of the same length in the same order (a
completion that would overflow the row is cut at its end; an example left without room for
one completion token is dropped and counted in ``gkd_dropped``; with one example a row,
``--sft_data.no_packing``, none is: the new tokens are capped by the room the microbatch's
longest prompt leaves).

The teacher (``--gkd.teacher_model``, TRL's ``teacher_model_name_or_path``) is a Hugging Face
folder or Hub id of any family titan builds (``teacher_spec``: a Qwen3-MoE teacher of a
dense Qwen3 student), of any size, sharing the student's tokenizer: on an engine of
its own laid out as the student, or a whole copy on every rank (``--gkd.teacher_layout``,
:mod:`titan.rl.distill_teacher`), run without gradients just before the student's forward.
Its logits travel with the microbatch: a whole teacher's are sharded along the sequence under
context parallel like any ``[B, S, ...]`` key (a sharded teacher's come as this rank's share),
pipeline parallel hands each pipeline microbatch's rows to the last stage (which alone runs
the teacher), and under TP's loss parallel the divergence is taken vocab-parallel
(:func:`~titan.rl.distill_loss.vocab_parallel_gkd_loss_sum`: each rank reads its columns of
the student's logits and of the teacher's, a sharded teacher of the student's vocabulary
keeping its own shard; only per-token sums cross ranks, the vocabulary is never gathered;
eager, as SFT's vocab-parallel loss). The TP, CP and PP
ranks of one replica hold the same rows: their first rank generates (it alone holds a native
student copy; with vLLM every rank generates, its engine joining the trainer's group as all
must) and hands its rows to the others. The draws are keyed by (``--debug.seed``, step, global microbatch)
and the sampling seeds by (``--sampling.seed``, step, global microbatch), so every layout of
one global batch and a resumed run regenerate what the uninterrupted one-process run did.

Logged with every record: ``on_policy`` (the share of the microbatches since the last record
the student generated), ``gkd_generated_tokens`` (their mean completion length),
``gkd_dropped`` (examples dropped from regenerated rows), ``generation_s`` and ``teacher_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
from titan.rl.config import GeneratorConfig
from titan.rl.distill_loss import (
    check_beta,
    gkd_loss_sum,
    vocab_parallel_gkd_loss_sum,
    vocab_parallel_logits,
)
from titan.rl.distill_teacher import ShardedTeacher, WholeTeacher
from titan.rl.generate.base import SamplingConfig, is_collective, take_part
from titan.train.data.chat import SFTExample
from titan.train.data.sft import pack_row
from titan.train.loop import StepResult
from titan.train.loss import IGNORE_INDEX
from titan.train.sft import SFTConfig, SFTTrainer
from torch.distributed.tensor import DTensor

logger = logging.getLogger("titan")

REPLICA_AXES = ("tp", "cp", "pp")
"""The mesh axes whose ranks hold the same rows (one replica of the data)."""


@dataclass(kw_only=True)
class GKDSection:
    """``--gkd.*``: the distillation (TRL's ``GKDConfig`` names)."""

    teacher_model: str = ""
    """The teacher: a Hugging Face folder or Hub id of a family titan builds (its
    ``model_type``; any size, the student's tokenizer). Required."""
    beta: float = 0.5
    """The generalized JSD's interpolation: 0 the forward KL (teacher || student), 1 the
    reverse KL (student || teacher), between them the divergence to the mixture."""
    lmbda: float = 0.5
    """The share of microbatches the student regenerates (on-policy); 0: the data's completions
    only (supervised distillation)."""
    seq_kd: bool = False
    """Train on the teacher's sampled completions in place of the data's (sequence-level KD)."""
    teacher_layout: Literal["sharded", "whole"] = "sharded"
    """sharded: the teacher on an engine of its own laid out as the student (FSDP, TP, CP: each
    rank holds its shards, computing in the run's precision); whole: a copy on every rank,
    which pipeline parallel and --gkd.seq_kd with the native generator take."""
    teacher_dtype: Literal["float32", "bfloat16"] = "float32"
    """A whole teacher's weights and logits (TRL's ``teacher_model_init_kwargs`` dtype):
    bfloat16 halves its memory on every rank; the divergence is still computed in float32."""

    def check(self, generator_kind: str = "native") -> None:
        """Refuse out-of-range values, naming the flag (``generator_kind``: --generator.kind,
        vllm samples a sharded teacher's completions with an engine of its own)."""
        if not self.teacher_model:
            raise ValueError("titan gkd distills a teacher: set --gkd.teacher_model (a Hugging Face folder or Hub id "
                             "of a family titan builds)")
        check_beta(self.beta)
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"--gkd.lmbda is the share of on-policy microbatches, in [0, 1]; got {self.lmbda}")
        if self.teacher_layout != "sharded":
            return
        if self.seq_kd and generator_kind == "native":
            raise ValueError("--gkd.seq_kd (the teacher samples) takes a whole teacher on every rank with the native "
                             "generator: add --gkd.teacher_layout whole, or --generator.kind vllm (whose own engine "
                             "samples the teacher)")
        if self.teacher_dtype != "float32":
            raise ValueError(f"--gkd.teacher_dtype {self.teacher_dtype} takes a whole teacher on every rank: add "
                             "--gkd.teacher_layout whole (a sharded teacher computes in the run's precision)")

    @property
    def generates(self) -> bool:
        """Whether any microbatch is regenerated (by the student or the teacher)."""
        return self.lmbda > 0 or self.seq_kd


def _gkd_sampling() -> SamplingConfig:
    """TRL's GKD defaults: temperature 0.9, 128 new tokens."""
    return SamplingConfig(temperature=0.9, max_new_tokens=128)


@dataclass(kw_only=True)
class GKDConfig(SFTConfig):
    """A GKD run: the SFT run's sections and data (``--sft_data.*``), the distillation
    (``--gkd.*``) and how completions are sampled (``--sampling.*``)."""

    gkd: GKDSection = field(default_factory=GKDSection)
    sampling: SamplingConfig = field(default_factory=_gkd_sampling)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    """What samples the student's on-policy completions (--gkd.lmbda) and --gkd.seq_kd's
    teacher completions: native (a model copy on the first rank of each replica) or vLLM (an
    engine on every rank; module docstring)."""


def row_prompts(input_ids: np.ndarray, labels: np.ndarray, document_ids: np.ndarray) -> list[list[int]]:
    """The prompt of each example packed in one row, in row order: its tokens up to the start
    of its last completion span (the position whose label is the span's first token,
    included). An example without a labelled token has none and is left out."""
    prompts = []
    for doc in np.unique(document_ids[document_ids >= 0]):
        where = np.flatnonzero(document_ids == doc)
        labelled = labels[where] != IGNORE_INDEX
        if not labelled.any():
            continue
        span_starts = np.flatnonzero(labelled & ~np.concatenate(([False], labelled[:-1])))
        last_start = int(span_starts[-1])
        prompts.append(input_ids[where[: last_start + 1]].tolist())
    return prompts


def repack_row(prompts: list[list[int]], completions: list[list[int]], *, seq_len: int,
               pad_id: int) -> tuple[dict[str, np.ndarray], int]:
    """One row of ``prompt + completion`` examples (the completion the target), in order,
    cut to ``seq_len`` positions: the completion that would overflow is cut at the row's end,
    and examples left without room for one completion token are dropped. Returns the row and
    the count dropped."""
    examples, used, dropped = [], 0, 0
    for prompt, completion in zip(prompts, completions, strict=True):
        room = seq_len - used - len(prompt) + 1  # an example takes one position less than its tokens
        if room < 1 or not completion:
            dropped += 1
            continue
        completion = completion[:room]
        ids = np.asarray(prompt + completion, dtype=np.int64)
        targets = np.zeros(len(ids), dtype=bool)
        targets[len(prompt):] = True
        examples.append(SFTExample(ids=ids, targets=targets))
        used += len(ids) - 1
    return pack_row(examples, seq_len=seq_len, pad_id=pad_id), dropped


class GKDTrainer(SFTTrainer):
    """GKD: :class:`~titan.train.sft.SFTTrainer`'s loop with the teacher's distribution as the
    target (module docstring)."""

    Config = GKDConfig

    def __init__(self, config: GKDConfig, *, model_spec, teacher_spec=None) -> None:
        """``teacher_spec``: the teacher's family (its folder's ``model_type``, e.g. a Qwen3-MoE
        teacher of a Qwen3 student; the command line reads it); None: the student's."""
        self.teacher_spec = teacher_spec or model_spec  # the config check reads it
        super().__init__(config, model_spec=model_spec)
        from titan.rl.generate.build import (
            build_generator,
            check_generator_tensor_parallel,
            check_vllm_device,
        )

        start = time.perf_counter()
        self.teacher = self._build_teacher()
        logger.info("teacher %s (%s parameters, %s) loaded in %.1fs", config.gkd.teacher_model,
                    f"{self.teacher.num_params / 1e6:.2f}M", config.gkd.teacher_layout, time.perf_counter() - start)
        # The first rank of each replica (its TP, CP and PP ranks hold the same rows) generates
        # them with its own copy of the student, and hands them to the others. vLLM's engines
        # join the trainer's group on every rank or on none: with vLLM every rank holds one and
        # generates its replica's rows alike, and the first rank's are the ones kept.
        self.leads_replica = all(self._axis_rank(axis) == 0 for axis in REPLICA_AXES)
        self.student_copy = None
        kind = config.generator.kind
        every_rank = self.engine.dist_env.world_size > 1
        check_generator_tensor_parallel(config.generator, self.engine.dist_env.world_size, every_rank=every_rank)
        if not every_rank:
            # One process: vLLM's own engine takes the first device. On several ranks its
            # engines run under the trainer's group, each on its rank's LOCAL_RANK device.
            check_vllm_device(kind, self.engine.device)
        if config.gkd.lmbda > 0 and (self.leads_replica or kind == "vllm"):
            self.student_copy = build_generator(config, model_spec, vocab_size=self.vocab_size,
                                                eos_token_id=self.tokenizer.eos_id, device=self.engine.device,
                                                kind=kind, every_rank=every_rank)
            logger.info("the student's completions: %s generator%s", kind, " on every rank" if every_rank else "")
        self.teacher_sampler = self._build_teacher_sampler() if config.gkd.seq_kd else None
        comp = config.compile
        self._supervised_loss = self._distill_loss
        self._compiled_loss = comp.enable and comp.compiles_loss
        self._stats = _GKDStats()
        self._stops = {writer: self._stop_token_ids(writer) for writer in ("student", "teacher")}
        # Held-out examples: the divergence to the teacher beside the NLL (the perplexity).
        self.validator.also_report("distill_loss", self._distill_loss, self.before_forward)

    def _build_teacher(self) -> WholeTeacher | ShardedTeacher:
        """The teacher, ``--gkd.teacher_layout`` (:mod:`titan.rl.distill_teacher`)."""
        from titan.ckpt.hub import resolve_hub_folder
        from titan.rl.generate.build import build_teacher

        gkd = self.config.gkd
        if gkd.teacher_layout == "sharded":
            folder = resolve_hub_folder(gkd.teacher_model, flag="--gkd.teacher_model")
            return ShardedTeacher.from_config(self.config, folder, model_spec=self.teacher_spec, tokenizer=self.tokenizer,
                                              student_vocab=self.vocab_size)
        return WholeTeacher(build_teacher(gkd.teacher_model, self.teacher_spec, vocab_size=self.tokenizer.vocab_size,
                                          seq_len=self.config.training.seq_len, eos_token_id=self.tokenizer.eos_id,
                                          device=self.engine.device, flag="--gkd.teacher_model",
                                          dtype=getattr(torch, gkd.teacher_dtype)))

    def _build_teacher_sampler(self) -> Any:
        """What samples --gkd.seq_kd's teacher completions on this rank: the whole teacher's
        native copy on the first rank of each replica, or with --generator.kind vllm an engine
        of its own reading the teacher's folder on every rank (then any teacher layout);
        None where this rank does not generate."""
        cfg = self.config
        if cfg.generator.kind != "vllm":
            return self.teacher.generator if self.leads_replica else None
        from titan.ckpt.hub import resolve_hub_folder
        from titan.rl.generate.build import build_vllm_teacher

        folder = resolve_hub_folder(cfg.gkd.teacher_model, flag="--gkd.teacher_model")
        logger.info("the teacher's completions: vllm generator%s",
                    " on every rank" if self.engine.dist_env.world_size > 1 else "")
        return build_vllm_teacher(folder, self.teacher_spec, cfg.generator, seq_len=cfg.training.seq_len,
                                  eos_token_id=self.tokenizer.eos_id, seed=cfg.debug.seed,
                                  every_rank=self.engine.dist_env.world_size > 1)

    def check_config(self) -> None:
        """The SFT checks, the ``--gkd.*`` values and the teacher's folder, and the flags GKD cannot honour."""
        super().check_config()
        cfg = self.config
        cfg.gkd.check(cfg.generator.kind)
        teacher = cfg.gkd.teacher_model
        if os.path.isdir(teacher) or teacher.startswith(("/", ".", "~")):  # a local folder: read before any work
            from titan.rl.generate.build import folder_architecture

            folder_architecture(teacher, self.teacher_spec, flag="--gkd.teacher_model", role="teacher",
                                flavor="teacher", labels=0)
        if cfg.training.loss_type != "nll":
            raise ValueError(f"--training.loss_type {cfg.training.loss_type} weighs titan sft's NLL; titan gkd's loss "
                             "is the divergence to the teacher (--gkd.beta): drop the flag")
        if cfg.gkd.teacher_layout == "sharded" and cfg.parallelism.pipeline_parallel_degree > 1:
            raise ValueError("a sharded teacher is laid out as the student, and under pipeline parallel its logits would "
                             "stay on its last stage's ranks: add --gkd.teacher_layout whole (a copy on every rank; "
                             "the last stage runs it)")
        if cfg.sampling.n != 1:
            raise ValueError(f"--sampling.n {cfg.sampling.n}: titan gkd regenerates one completion per example; "
                             "leave it at 1")
        self._check_generator()

    def _check_generator(self) -> None:
        """Refuse a ``--generator.kind vllm`` run that would not use it (--gkd.lmbda 0 without
        --gkd.seq_kd: nothing is generated) or where vLLM is missing."""
        cfg = self.config
        if cfg.generator.kind != "vllm":
            return
        from titan.rl.generate.build import check_generator_kind

        if not cfg.gkd.generates:
            raise ValueError("--generator.kind vllm samples the student's on-policy completions (--gkd.lmbda) and the "
                             "teacher's (--gkd.seq_kd), and this run generates none: set --gkd.lmbda above 0 or "
                             "--gkd.seq_kd, or drop --generator.kind")
        check_generator_kind("vllm")

    # ---- the step -------------------------------------------------------------------------

    def _distill_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The generalized JSD to the teacher's logits the microbatch carries, summed over its
        completion tokens. Vocab-sharded logits (TP's loss parallel) stay sharded: each rank
        reads its columns of both models (a sharded teacher's own shard, a whole teacher's
        slice) and only per-token sums cross ranks (``vocab_parallel_gkd_loss_sum``)."""
        if vocab_parallel_logits(logits):
            return vocab_parallel_gkd_loss_sum(logits, batch["teacher_logits"], batch["labels"], beta=self.config.gkd.beta,
                                               vocab_size=self.tokenizer.vocab_size, teacher_sharded=self.teacher.vocab_shards,
                                               chunk_tokens=self.config.training.loss_chunk_tokens)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return gkd_loss_sum(logits, batch["teacher_logits"], batch["labels"], beta=self.config.gkd.beta,
                            vocab_size=self.tokenizer.vocab_size, chunk_tokens=self.config.training.loss_chunk_tokens,
                            compiled=self._compiled_loss)

    def _train_step(self, microbatches: list[dict[str, torch.Tensor]], *, sync: bool) -> StepResult:
        step = self.step + 1
        started = time.perf_counter()
        chunks = [self._global_chunk(i) for i in range(len(microbatches))]
        if self.teacher_sampler is not None:  # --gkd.seq_kd, where this rank generates
            microbatches = [self._regenerate(mb, self.teacher_sampler, step, c)
                            for mb, c in zip(microbatches, chunks, strict=True)]
        # Every rank draws for every microbatch of the global batch: they agree on the sync.
        draws = [self._draws_on_policy(step, c) for c in range(len(microbatches) * self.data_shard[1])]
        if any(draws):
            self._sync_student_copy(step)
            if self.student_copy is not None:  # the replica's first rank (with vLLM: every rank)
                microbatches = [self._regenerate(mb, self.student_copy, step, c) if draws[c]
                                else self._take_part(self.student_copy, mb)
                                for mb, c in zip(microbatches, chunks, strict=True)]
        if self.config.gkd.seq_kd or any(draws):
            microbatches = self._share_within_replica(microbatches)
        self._stats.generation_s += time.perf_counter() - started
        self._stats.microbatches += len(draws)
        self._stats.on_policy += sum(draws)
        return super()._train_step(microbatches, sync=sync)

    def close(self) -> None:
        """Release vLLM's process groups inside the trainer's (before the engine destroys the
        trainer's), then close as SFT does."""
        for sampler in (getattr(self, "student_copy", None), getattr(self, "teacher_sampler", None)):
            close_generator = getattr(sampler, "close", None)
            if close_generator is not None:
                close_generator()
        super().close()

    def _axis_rank(self, axis: str) -> int:
        """This rank's place on mesh ``axis`` (0 without one)."""
        mesh = self.parallel_dims.mesh(axis)
        return mesh.get_local_rank() if mesh is not None and mesh.size() > 1 else 0

    def _share_within_replica(self, microbatches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
        """The replica's first rank's ``microbatches`` on each of its ranks: broadcast from the
        first rank of each axis in turn (after all three, every rank holds what TP, CP and PP
        rank 0 generated). Collective over each axis."""
        for axis in REPLICA_AXES:
            mesh = self.parallel_dims.mesh(axis)
            if mesh is not None and mesh.size() > 1:
                box = [microbatches]
                dist.broadcast_object_list(box, group=mesh.get_group(), group_src=0)
                microbatches = box[0]
        return microbatches

    def before_forward(self, microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The microbatch with the teacher's logits, computed just before the student's forward
        (one microbatch's at a time)."""
        if self.parallel_dims.pp_enabled and not self.engine.pp_has_last:
            return microbatch  # only the last stage computes the loss
        started = time.perf_counter()
        batch = self._with_teacher_logits(microbatch)
        self._stats.teacher_s += time.perf_counter() - started
        return batch

    def _global_chunk(self, microbatch: int) -> int:
        """The index of this rank's ``microbatch`` among the global batch's, in row order: the
        loader deals each fetch's rows out to the data-parallel ranks in rank order, so index
        ``k`` holds the same rows in every layout of one global batch (one process: its
        microbatch ``k``). The draws and sampling seeds are keyed by it."""
        rank, world = self.data_shard
        return microbatch * world + rank

    def _draws_on_policy(self, step: int, chunk: int) -> bool:
        """Whether global microbatch ``chunk`` of optimizer step ``step`` is the student's own:
        the same draw on every rank, in every layout and in a resumed run."""
        lmbda = self.config.gkd.lmbda
        return lmbda > 0 and random.Random(f"gkd-{self.config.debug.seed}-{step}-{chunk}").random() < lmbda

    def _sync_student_copy(self, step: int) -> None:
        """Load the engine's current weights into this rank's student copy (collective: every
        rank gathers the full tensors; a rank without a copy only takes part), checked by
        checksum."""
        from titan.rl.weight_sync import sync_colocated

        sync_colocated(self.engine, self.student_copy, version=step, dtype=torch.float32)

    def _stop_token_ids(self, writer: str) -> tuple[int, ...]:
        """``--sampling.stop_token_ids`` and the end-of-sequence ids of the Hugging Face folder
        of ``writer`` (``student``: the one the run starts from; ``teacher``), as RL's rollouts
        and transformers' ``generate`` stop at them (an instruct model's end of turn)."""
        from types import SimpleNamespace

        from titan.rl.producer import hub_stop_token_ids

        folder = (self.config.checkpoint if writer == "student" else
                  SimpleNamespace(initial_load_in_hf=True, initial_load_path=self.config.gkd.teacher_model))
        stops = self.config.sampling.stop_token_ids
        extra = tuple(t for t in hub_stop_token_ids(folder, self.tokenizer.vocab_size)
                      if t not in stops and t != self.tokenizer.eos_id)
        return (*stops, *extra)

    def _regenerate(self, microbatch: dict[str, torch.Tensor], generator: Any, step: int,
                    chunk: int) -> dict[str, torch.Tensor]:
        """``microbatch`` with every example's completion replaced by one ``generator``
        samples from its prompt (module docstring)."""
        seq_len = microbatch["input_ids"].shape[1]
        rows = [row_prompts(*(microbatch[key][r].numpy() for key in ("input_ids", "labels", "document_ids")))
                for r in range(microbatch["input_ids"].shape[0])]
        # (row, prompt) of every example with room to generate (a prompt fills no whole row).
        slots = [(r, p) for r, row in enumerate(rows) for p in row if len(p) < seq_len]
        dropped = sum(len(row) for row in rows) - len(slots)
        prompts = [p for _, p in slots]
        completions: list[list[int]] = []
        if prompts or is_collective(generator):  # a collective call needs every rank
            sampling = dataclasses.replace(
                self.config.sampling, seed=self._sampling_seed(step, chunk),
                stop_token_ids=self._stops["student" if generator is self.student_copy else "teacher"],
                max_new_tokens=min(self.config.sampling.max_new_tokens, seq_len - max(map(len, prompts), default=0)))
            completions = [group[0].token_ids for group in generator.generate(prompts, sampling)]
            self._stats.generated_tokens += sum(len(c) for c in completions)
            self._stats.completions += len(completions)
        packed = []
        for r in range(len(rows)):
            mine = [i for i, (row, _) in enumerate(slots) if row == r]
            new_row, cut = repack_row([prompts[i] for i in mine], [completions[i] for i in mine], seq_len=seq_len,
                                      pad_id=self.tokenizer.pad_id)
            dropped += cut
            packed.append(new_row)
        self._stats.dropped += dropped
        return {key: torch.from_numpy(np.stack([row[key] for row in packed])) for key in packed[0]}

    def _take_part(self, generator: Any, microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``microbatch`` unchanged, after joining ``generator``'s call with no prompts when it is
        collective (ranks sharing it drew other microbatches: each calls it once per microbatch)."""
        take_part(generator, self.config.sampling)
        return microbatch

    def _sampling_seed(self, step: int, chunk: int) -> int | None:
        """The sampling seed of global microbatch ``chunk`` of step ``step``, from
        ``--sampling.seed``: the same in every layout and in a resumed run (None: a fresh seed
        every time, as the flag means)."""
        seed = self.config.sampling.seed
        return None if seed is None else random.Random(f"gkd-sample-{seed}-{step}-{chunk}").getrandbits(62)

    @torch.no_grad()
    def _with_teacher_logits(self, microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``microbatch`` on this device with the teacher's logits of its rows
        (``teacher_logits``), under the same document masking and positions as the student's
        forward."""
        batch = self.engine.to_device(microbatch)
        batch["teacher_logits"] = self.teacher.logits(self.engine, batch)
        return batch

    # ---- metrics --------------------------------------------------------------------------

    def _log(self, result: StepResult, validation: dict[str, float] | None = None) -> dict[str, Any]:
        """The step's record, and on the console a line of what was regenerated and the
        held-out figures (the progress line shows the loss only)."""
        record = super()._log(result, validation)
        if self.is_rank0:
            logger.info("step %d: %s", record["step"], self.summary_line(record))
        return record

    def validation_line(self, validation: dict[str, float]) -> str | None:
        """None: the held-out figures are in :meth:`summary_line`'s line."""
        return None

    @staticmethod
    def summary_line(record: dict[str, Any]) -> str:
        """The console line of a logged record's GKD fields."""
        held_out = ("" if "validation_distill_loss" not in record else
                    f" | held-out: divergence {record['validation_distill_loss']:.4f}  nll {record['validation_loss']:.4f}")
        return (f"on-policy {record['on_policy']:.2f}  generated {record['gkd_generated_tokens']:.1f} tokens a "
                f"completion  dropped {record['gkd_dropped']}  generation {record['generation_s']:.1f}s  teacher "
                f"{record['teacher_s']:.1f}s{held_out}")

    def log_extras(self) -> dict[str, Any]:
        """The SFT fields, and what the steps since the last record generated (module
        docstring)."""
        stats, self._stats = self._stats, _GKDStats()
        # What the data-parallel ranks generated, summed (collective: every rank logs alike).
        counts = torch.tensor([stats.completions, stats.generated_tokens, stats.dropped], dtype=torch.float64,
                              device=self.engine.device)
        stats.completions, stats.generated_tokens, stats.dropped = (int(v) for v in self.engine.sum_over(counts, "dp"))
        return {**super().log_extras(), **stats.record()}


@dataclass
class _GKDStats:
    """What the steps since the last logged record generated."""

    microbatches: int = 0
    on_policy: int = 0
    completions: int = 0
    generated_tokens: int = 0
    dropped: int = 0
    generation_s: float = 0.0
    teacher_s: float = 0.0

    def record(self) -> dict[str, float]:
        """The logged fields."""
        return {"on_policy": self.on_policy / max(self.microbatches, 1),
                "gkd_generated_tokens": self.generated_tokens / max(self.completions, 1),
                "gkd_dropped": self.dropped, "generation_s": self.generation_s, "teacher_s": self.teacher_s}


__all__ = ["GKDConfig", "GKDSection", "GKDTrainer", "repack_row", "row_prompts"]
