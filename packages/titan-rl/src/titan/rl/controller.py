"""The RL controller: generate, score, train, sync — on the :class:`TrainingEngine`.

One RL step (policy version ``v`` = optimizer steps taken so far):

1. **sync** the engine's weights to the generator when its version is too old
   (``engine.full_state_dict()``: every rank iterates it, it is collective; rank 0 copies the
   tensors into its generator);
2. **generate** ``--rl.group_size`` completions for each of ``--rl.prompts_per_step`` prompts
   and **score** them (rank 0), then broadcast the rollout to every rank;
3. **advantages** per group, zero-variance groups dropped, rows dealt to the data-parallel
   ranks (each trains on its contiguous share, padded so every rank runs the same number of
   microbatches of ``--training.local_batch_size`` rows);
4. ``engine.forward_backward`` with the policy loss (``titan.rl.losses``) over each
   microbatch, normalized by the global count of the loss type, then ``optimizer_step``:
   ``--rl.ppo_epochs`` passes over the rollout, each in ``--rl.minibatches_per_rollout``
   minibatches of one optimizer step, the PPO ratio against the trainer's pre-update
   log-probs (one no-grad forward first when several updates use the rollout) and truncated
   importance weights for the trainer/generator mismatch (``--rl.old_logprobs``).

Why rank 0 generates for everyone (colocated, the default): the rollout is then independent
of the layout (the same completions train a 1-rank and an FSDP run, and a resume regenerates
exactly), one single-device model copy suffices, and rewards run once. With
``--rl.generator_ranks N`` the launch's last N ranks generate instead (disaggregated,
``titan.rl.disaggregated``): rank 0 commands them, broadcasts the weights to them and merges
their parts of each rollout; with one generator rank the rollouts equal the colocated ones.
With ``--rl.colocated_generation every_rank`` each trainer rank generates and scores its share
of every rollout itself (its own model copy, synced from the same full state dict) and the
shares are gathered on every rank: the rollouts then equal those of as many generator ranks.

**Staleness.** ``--rl.max_policy_staleness 0`` is on-policy: the weights are synced before
every rollout. With ``k >= 1`` the next rollout is generated in the background while the
current one trains, never more than ``k`` rollouts behind (``titan.rl.schedule.RolloutSchedule``
decides when to sync and launch). A resumed run regenerates the pending rollout from the
resumed weights. The per-microbatch policy loss is ``titan.rl.rollout_loss.RolloutLoss``.

An error while rank 0 generates or scores is broadcast in place of the rollout, so every rank
stops with it (:class:`RolloutError`).

The controller's position (the next rollout index) is checkpointed with the model; the prompts
and sampling seed of rollout ``i`` are functions of ``i``, so a resumed on-policy run continues
the same trajectory. ``--rl.sft_warmup_steps`` first trains that many steps of supervised
fine-tuning on the synthetic task (the SFT loader, checkpointed too); alternatively start from
an SFT checkpoint with ``--checkpoint.initial_load_path``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from titan.dist import current_split, reduce_max
from titan.rl.completion_log import append_completions, completion_records, format_completion
from titan.rl.config import RLConfig
from titan.rl.critic import Critic
from titan.rl.data import build_prompts
from titan.rl.disaggregated import TRAINER, GeneratorServer, RemoteGenerators, split_for_generators
from titan.rl.generate.build import (
    build_generator,
    build_teacher,
    check_generator_kind,
    check_generator_tensor_parallel,
)
from titan.rl.losses import adapted_entropy_coef, entropy_threshold, stat_means
from titan.rl.producer import RolloutProducer, held_out_means, merge_rollouts, share
from titan.rl.rollout_loss import MAX_STATS, SUMMED_STATS, RolloutLoss, combine_stats
from titan.rl.rollouts import (
    Rollout,
    adapted_kl_coef,
    build_batch,
    build_packed_batch,
    kl_in_reward_penalties,
    mean_token_kl,
    pack_rows,
    padding_fraction,
    rollout_rows,
    rollout_stats,
    rows_loss_normalizer,
    split_rows,
)
from titan.rl.schedule import RolloutSchedule
from titan.rl.weight_sync import sync_colocated
from titan.train.data.sft import build_sft_dataloader
from titan.train.loop import TrainingLoop
from titan.train.model_spec import ModelSpec
from titan.train.preemption import PreemptionGuard, save_for_preemption
from titan.train.profiling import StepProfiler

logger = logging.getLogger("titan")

MAX_CONSECUTIVE_SKIPS = 16
"""Stop when this many rollouts in a row have no group with reward variance (nothing to learn)."""


def _assemble_rows(pieces: list[tuple[torch.Tensor, torch.Tensor]], rows: int) -> torch.Tensor | None:
    """One ``[rows, S]`` tensor from (row indices, values) pieces (None without pieces)."""
    if not pieces:
        return None
    first = pieces[0][1]
    out = torch.zeros((rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
    for index, values in pieces:
        out[index] = values
    return out


def _crossed(before: int, after: int, every: int) -> bool:
    """Whether a multiple of ``every`` lies in ``(before, after]`` (``every`` <= 0: never)."""
    return every > 0 and after // every > before // every


class RolloutError(RuntimeError):
    """Rank 0 could not generate or score a rollout (raised on every rank)."""


def _raise_rollout_error(ranks: list[int], failure: str) -> None:
    """Raise :class:`RolloutError` for ``failure`` on ``ranks``, logged first: a launcher may
    stop this process before its traceback prints."""
    message = f"generating or scoring a rollout failed on rank {', '.join(map(str, ranks))}: {failure}"
    logger.error("%s", message)
    raise RolloutError(message)


class StalenessError(RuntimeError):
    """A rollout was about to train on weights older than --rl.max_policy_staleness allows."""


class ControllerState:
    """The controller's checkpointed position: the next rollout to train on."""

    def __init__(self, *, prompts_per_step: int, num_prompts: int, entropy_coef: float = 0.0,
                 adaptive_entropy: bool = False, kl_in_reward_coef: float = 0.0, adaptive_kl: bool = False) -> None:
        self.rollout_index = 0
        self.skipped = 0
        self.prompts_per_step, self.num_prompts = prompts_per_step, num_prompts
        self.entropy_coef, self.adaptive_entropy = entropy_coef, adaptive_entropy
        self.kl_in_reward_coef, self.adaptive_kl = kl_in_reward_coef, adaptive_kl

    def state_dict(self) -> dict[str, Any]:
        """Next rollout index, rollouts skipped so far, the sizes they are relative to, the
        entropy bonus's coefficient (moved by --rl.adaptive_entropy) and the KL-in-reward
        coefficient (moved by --rl.kl_in_reward_target)."""
        return {"rollout_index": self.rollout_index, "skipped": self.skipped,
                "prompts_per_step": self.prompts_per_step, "num_prompts": self.num_prompts,
                "entropy_coef": self.entropy_coef, "kl_in_reward_coef": self.kl_in_reward_coef}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position (with the same prompts and prompts per step)."""
        for key, flag in (("prompts_per_step", "--rl.prompts_per_step"), ("num_prompts", "--rl_data.*")):
            if int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"cannot resume the RL run: the checkpoint has {key}={state[key]}, this run "
                    f"{getattr(self, key)}; resume with the same {flag}"
                )
        self.rollout_index, self.skipped = int(state["rollout_index"]), int(state["skipped"])
        if self.adaptive_entropy and "entropy_coef" in state:  # else the flag's value holds
            self.entropy_coef = float(state["entropy_coef"])
        if self.adaptive_kl and "kl_in_reward_coef" in state:
            self.kl_in_reward_coef = float(state["kl_in_reward_coef"])


class ReferencePolicy:
    """The frozen KL reference, checkpointed: the policy RL started from (after the warm-up or
    the initial load), so a resumed run measures KL against the same weights.

    Rank 0 holds the model (a generator copy, built up front so a checkpoint of any step
    has the same entries) and a ``taken`` flag; the other ranks hold nothing and save
    nothing, unless every rank generates (``--rl.colocated_generation every_rank``): then
    every rank holds an equal copy and rescores its own part of each rollout (the checkpoint
    stores the replicated entries once). Before RL starts the weights are placeholders
    (``taken`` 0)."""

    def __init__(self, model_holder: Any | None) -> None:
        self.holder = model_holder
        self.taken = False

    def take(self, weights) -> None:
        """Freeze ``weights`` (named full tensors) as the reference, unless a resumed
        checkpoint already restored it."""
        if self.holder is not None and not self.taken:
            self.holder.load_weights(weights, version=0)
            self.taken = True

    def mix(self, weights, alpha: float) -> None:
        """Move the reference toward ``weights`` (named full tensors of the policy, collective
        to produce: every rank iterates them): ``alpha x policy + (1 - alpha) x reference``.
        Ranks without the reference only take part in producing the weights."""
        if self.holder is None:
            for _ in weights:
                pass
            return
        live = self.holder.model.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                target = live[name]
                if target.is_floating_point():
                    target.lerp_(tensor.to(device=target.device, dtype=target.dtype), alpha)
                else:
                    target.copy_(tensor)

    def state_dict(self) -> dict[str, Any]:
        """``taken`` and the weights (a tied alias once) on rank 0; empty elsewhere."""
        if self.holder is None:
            return {}
        weights, seen = {}, set()
        for name, tensor in self.holder.model.state_dict().items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                weights[name] = tensor
        return {"taken": torch.tensor(int(self.taken)), "weights": weights}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the flag and the weights (DCP loads into the live tensors; copied again
        for a loader that does not)."""
        if self.holder is None:
            return
        self.taken = bool(int(state["taken"]))
        live = self.holder.model.state_dict()
        with torch.no_grad():
            for name, tensor in state["weights"].items():
                if live[name] is not tensor:
                    live[name].copy_(tensor)


class RLTrainer(TrainingLoop):
    """GRPO-family RL post-training on :class:`~titan.train.loop.TrainingLoop` (see the module
    docstring): the shared loop's model, metrics, checkpoints, preemption and profiler, with
    rollouts for data and the policy loss; the SFT warm-up is the shared supervised step.

    ``train()`` runs to ``--training.steps`` (warm-up steps included) and returns the logged
    records; ``close()`` drains checkpoints and releases the process group.
    """

    uses_training_timeout = False
    """RL keeps ``--comm.init_timeout_seconds``: its trainer ranks wait in a collective while
    rank 0 generates and scores a rollout."""

    Config = RLConfig
    remote: RemoteGenerators | None = None
    """The generator ranks of a disaggregated run (--rl.generator_ranks); None: colocated."""
    critic: Critic | None = None
    """PPO's critic (--rl.advantage_estimator gae); None for the other estimators."""
    _kl_in_reward_used = 0.0
    """The KL-in-reward coefficient the last rollout's rewards were penalized with."""
    _kl_in_reward_kl = 0.0
    """The KL to the reference the last rollout measured (--rl.kl_in_reward_target steers it)."""

    def batch_facts(self) -> None:
        """None: an RL step's batch is its rollout (--rl.prompts_per_step x --rl.group_size,
        whatever the ranks), not the data-parallel batch a resume compares."""
        return None

    def __init__(self, config: RLConfig, *, model_spec: ModelSpec, teacher_spec: ModelSpec | None = None) -> None:
        """``teacher_spec``: the family of ``--rl.teacher_model`` (its folder's ``model_type``,
        which the command line reads); None: the policy's."""
        self.teacher_spec = teacher_spec or model_spec
        super().__init__(config, model_spec=model_spec)
        cfg = config
        self._check_sequence_budget()
        every_rank_engines = not cfg.rl.generator_ranks and cfg.rl.colocated_generation == "every_rank"
        if not cfg.rl.generator_ranks:  # disaggregated: vLLM runs on the generator ranks (GeneratorServer)
            check_generator_kind(cfg.generator.kind, world_size=self.engine.dist_env.world_size,
                                 every_rank=every_rank_engines)
        check_generator_tensor_parallel(cfg.generator, self.engine.dist_env.world_size, every_rank=every_rank_engines,
                                        generator_ranks=cfg.rl.generator_ranks)
        train_prompts, self.eval_prompts = build_prompts(cfg.rl_data, self.tokenizer,
                                                         max_prompt_tokens=cfg.max_prompt_tokens)
        if cfg.rl.eval_freq > 0 and not self.eval_prompts:
            logger.info("no held-out prompts (--rl_data.eval_path): the run is not evaluated")
        self.state = ControllerState(prompts_per_step=cfg.rl.prompts_per_step, num_prompts=len(train_prompts),
                                     entropy_coef=cfg.rl.entropy_coef, adaptive_entropy=cfg.rl.adaptive_entropy,
                                     kl_in_reward_coef=cfg.rl.kl_in_reward_coef,
                                     adaptive_kl=cfg.rl.kl_in_reward_target is not None)
        self.engine.add_state("rl_controller", self.state)
        self.warmup_loader = self._build_warmup_loader()
        self.sampling = dataclasses.replace(cfg.sampling, n=cfg.rl.group_size)
        self.loss = RolloutLoss.on_engine(self.engine, cfg.rl, temperature=self.sampling.temperature,
                                          chunk_tokens=cfg.training.loss_chunk_tokens)
        if cfg.rl.generator_ranks:
            self.remote = RemoteGenerators(current_split())
        # Colocated: rank 0 generates and scores every rollout for all ranks, or every rank its share.
        dist_env = self.engine.dist_env
        self.every_rank = cfg.rl.colocated_generation == "every_rank" and dist_env.world_size > 1
        generates = self.remote is None and (self.is_rank0 or self.every_rank)
        self.generator = self._build_generator(cfg.generator.kind) if generates else None
        self.producer = None if self.generator is None else RolloutProducer(
            cfg, generator=self.generator, tokenizer=self.tokenizer, train_prompts=train_prompts,
            eval_prompts=self.eval_prompts, shard=dist_env.rank if self.every_rank else 0,
            shards=dist_env.world_size if self.every_rank else 1, device=self.engine.device, model_spec=self.model_spec,
        )
        if self.every_rank and self.is_rank0:
            logger.info("every rank generates: each of the %d ranks generates and scores its share of the %d "
                        "prompts of a rollout (--rl.colocated_generation every_rank)",
                        dist_env.world_size, cfg.rl.prompts_per_step)
        # The frozen KL reference (rank 0, or every generating rank), taken when RL starts and
        # checkpointed with the run; it only rescores, so it is a native model copy whatever generates.
        holds_reference = (self.is_rank0 or self.generator is not None) and cfg.rl.uses_reference
        self.reference = ReferencePolicy(self._build_reference() if holds_reference else None)
        if cfg.rl.teacher_model:
            self.reference.taken = holds_reference  # a fixed teacher, read again by a resumed run
        elif cfg.rl.uses_reference:
            self.engine.add_state("rl_reference", self.reference)
        # PPO's critic (--rl.advantage_estimator gae): an engine of its own, laid out as the
        # policy's on the same ranks, checkpointed with the run.
        self.critic = self._build_critic() if self.uses_critic else None
        if self.critic is not None:
            self.engine.add_state("rl_critic", self.critic)
        driver = self.remote is not None and self.remote.is_driver
        self.schedule = RolloutSchedule(
            max_staleness=cfg.rl.max_policy_staleness, updates_per_rollout=cfg.rl.updates_per_rollout,
            total_steps=cfg.training.steps, sync=self.sync_weights, produce=self._produce, broadcast=self._broadcast,
            request=self._request if driver else None, background=self.producer is not None,
        )
        self.timings = {"generation_s": 0.0, "train_s": 0.0, "sync_s": 0.0}
        self._printed_completions: list[dict[str, Any]] = []
        self.log_start()

    # ---- construction -------------------------------------------------------------------

    def check_config(self) -> None:
        """Refuse what cannot run before the engine is built: an unknown generator, generator
        ranks without the launch split, a global batch without a warm-up to apply it to."""
        cfg = self.config
        check_generator_kind(cfg.generator.kind)
        if cfg.fault_tolerance.enable:
            raise ValueError("--fault_tolerance.enable is for titan train and titan sft; titan rl does not run "
                             "elastic replica groups")
        split = current_split()
        if cfg.rl.generator_ranks and (split is None or split.part != 0):
            raise ValueError(
                "--rl.generator_ranks needs every rank of the launch started through "
                "titan.rl.controller.build_rl_loop (the titan rl command does): it splits the launch into "
                "trainer and generator ranks before the engine is built"
            )
        if cfg.rl.padding_free and not cfg.training.document_mask:
            raise ValueError("--rl.padding_free packs several completions into a row, which must not see each other: "
                             "drop --training.no_document_mask")
        # RL steps train on the rollout, so a global batch without a warm-up is refused, not ignored.
        if cfg.training.global_batch_size != -1 and not cfg.rl.sft_warmup_steps:
            raise ValueError(
                f"--training.global_batch_size {cfg.training.global_batch_size} sets the SFT warm-up's batch, and "
                "this run has no warm-up (--rl.sft_warmup_steps 0); an RL step trains on its rollout "
                "(--rl.prompts_per_step x --rl.group_size completions): leave it at -1"
            )

    def _check_sequence_budget(self) -> None:
        """Refuse a generation budget that does not fit a training sequence, before any work."""
        cfg = self.config
        if cfg.sampling.max_new_tokens >= cfg.training.seq_len:
            raise ValueError(
                f"--sampling.max_new_tokens {cfg.sampling.max_new_tokens} does not fit --training.seq_len "
                f"{cfg.training.seq_len}; raise the sequence length or lower the budget"
            )

    def _build_warmup_loader(self):
        """The SFT loader of the warm-up steps (None without warm-up), checkpointed."""
        cfg = self.config
        if not cfg.rl.sft_warmup_steps:
            return None
        dims = self.engine.parallel_dims
        loader = build_sft_dataloader(
            cfg.rl_data.sft_config(demonstrations_only=True), self.tokenizer, dp_rank=dims.dp_rank, dp_world_size=dims.dp_world_size,
            local_batch_size=cfg.training.local_batch_size, seq_len=cfg.training.seq_len, seed=cfg.debug.seed,
        )
        self.engine.add_state("sft_warmup", loader)
        return loader

    def _build_generator(self, kind: str = "native"):
        """A generator on this rank (``--generator.kind``): rank 0's in a colocated run (every
        rank's with every_rank), and the KL reference's native model copy."""
        return build_generator(self.config, self.model_spec, vocab_size=self.vocab_size,
                               eos_token_id=self.tokenizer.eos_id, device=self.engine.device, kind=kind,
                               every_rank=self.every_rank)

    def _build_reference(self):
        """The KL reference's model copy: the policy's architecture (its weights taken when RL
        starts), or ``--rl.teacher_model`` with its own architecture and weights."""
        path = self.config.rl.teacher_model
        if not path:
            return self._build_generator()
        start = time.perf_counter()
        teacher = build_teacher(path, self.teacher_spec, vocab_size=self.tokenizer.vocab_size,
                                seq_len=self.config.training.seq_len, eos_token_id=self.tokenizer.eos_id,
                                device=self.engine.device)
        logger.info("teacher %s (%s parameters) loaded as the KL reference in %.1fs", path,
                    f"{sum(p.numel() for p in teacher.model.parameters()) / 1e6:.2f}M", time.perf_counter() - start)
        return teacher

    @property
    def uses_critic(self) -> bool:
        """Whether the run trains PPO's critic (--rl.advantage_estimator gae)."""
        return self.config.rl.advantage_estimator == "gae"

    def _build_critic(self) -> Critic:
        """The critic (``titan.rl.critic``) on an engine laid out as the policy's (collective:
        every trainer rank builds it): the policy's architecture with a score head, placeholders
        until RL starts (:meth:`_start_critic`), or --rl.critic_model's architecture and weights."""
        cfg = self.config
        start = time.perf_counter()
        folder = None
        if cfg.rl.critic_model:
            from titan.ckpt.hub import resolve_hub_folder

            folder = resolve_hub_folder(cfg.rl.critic_model, flag="--rl.critic_model")
        critic = Critic.from_config(cfg, model_spec=self.model_spec, vocab_size=self.vocab_size,
                                    tokenizer=self.tokenizer, reward_model=folder)
        if folder is not None:
            from titan.ckpt.hf import load_hf

            critic.load_reward_model(folder, load_hf)
            logger.info("critic started from the reward model %s", cfg.rl.critic_model)
        logger.info("critic built in %.1fs (the policy's layout, a one-column score head)", time.perf_counter() - start)
        return critic

    # ---- weight sync and generation -----------------------------------------------------

    def sync_weights(self) -> None:
        """Copy the engine's current weights into the generator(s) and check them (collective:
        every trainer rank iterates the full state dict; rank 0 loads it, or broadcasts it to
        the generator ranks)."""
        version = self.engine.step
        if self.remote is not None:  # broadcast to the generator ranks
            stats = self.remote.sync(self.engine, version=version)
        else:
            stats = sync_colocated(self.engine, self.generator, version=version, dtype=torch.float32)
        self.timings["sync_s"] += stats.seconds

    def _produce(self, index: int) -> Rollout:
        """Generate and score rollout ``index`` now (rank 0; may run in the background thread):
        with the colocated producer, or by asking the generator ranks and waiting for them."""
        if self.remote is not None:
            return self._request(index)()
        return self._with_reference(self.producer.produce(index))

    def _request(self, index: int):
        """Ask the generator ranks for rollout ``index`` (rank 0); returns the function that
        collects it (with the KL reference's log-probs)."""
        self.remote.request(index)
        return lambda: self._with_reference(self.remote.collect())

    def _with_reference(self, rollout: Rollout) -> Rollout:
        """``rollout`` with the frozen KL reference's log-probs of its completions (rank 0),
        once the reference is taken; the rescoring time counts as generation."""
        if self.reference.taken:
            start = time.perf_counter()
            rollout.ref_logprobs = [self.reference.holder.rescore(g, temperature=self.sampling.temperature)
                                    for g in rollout.groups]
            rollout.generation_s += time.perf_counter() - start
        return rollout

    def _broadcast(self, result: Any) -> Any:
        """Rank 0's ``result`` (a rollout, an evaluation) on every rank; with every rank
        generating, every rank's part of the rollout, merged (:meth:`_gather_parts`). ``result`` may be a
        zero-argument callable, run on rank 0 only: when it raises, every rank raises
        :class:`RolloutError` with its message instead of waiting in the broadcast for a
        rollout that never comes (until the collective timeout)."""
        if self.every_rank:
            return merge_rollouts(self._gather_parts(result))
        failure, result = self._produced(result) if self.is_rank0 else (None, result)
        if self.engine.dist_env.world_size > 1 and dist.is_initialized():
            box = [(failure, result)]
            device = self.engine.device if self.engine.device.type == "cuda" else None
            dist.broadcast_object_list(box, src=0, device=device)
            failure, result = box[0]
        if failure is not None:
            _raise_rollout_error([0], failure)
        return result

    def _produced(self, result: Any) -> tuple[str | None, Any]:
        """``(None, value)``: ``result``, or the result of calling it when callable; ``(error,
        None)`` when that call raised (logged here, reported on every rank by the caller)."""
        if not callable(result):
            return None, result
        try:
            return None, result()
        except Exception as err:  # reported on every rank by the caller
            logger.error("rank %d failed to produce the rollout", self.engine.dist_env.rank, exc_info=True)
            return f"{type(err).__name__}: {err}", None

    def _gather_parts(self, part: Any) -> list[Any]:
        """Every rank's ``part`` (or the result of calling it, when callable), in rank order, on
        every rank. A part that raised is reported on every rank as :class:`RolloutError`
        naming the ranks that failed, instead of leaving the others in the gather."""
        gathered: list[Any] = [None] * self.engine.dist_env.world_size
        dist.all_gather_object(gathered, self._produced(part))
        failed = [(rank, error) for rank, (error, _) in enumerate(gathered) if error is not None]
        if failed:
            _raise_rollout_error([rank for rank, _ in failed], failed[0][1])
        return [value for _, value in gathered]

    def next_rollout(self) -> Rollout:
        """The rollout for this step, generated under the staleness bound (``titan.rl.schedule``)."""
        return self.schedule.next_rollout(self.state.rollout_index, self.engine.step)

    def _wait_pending(self) -> None:
        """Let the background generation finish (before using the generator otherwise)."""
        self.schedule.wait()

    # ---- the RL step ---------------------------------------------------------------------

    @torch.no_grad()
    def _pre_update_pass(self, minibatches: list[tuple[float, float, list[dict]]], *, logprobs: bool,
                         entropy: bool) -> tuple[list[list[torch.Tensor | None]] | None, list[list[torch.Tensor | None]] | None,
                                                 list[torch.Tensor]]:
        """The trainer's log-probs (``logprobs``) and token entropies (``entropy``) of every
        microbatch of the rollout before its first update: one no-grad forward each, in
        evaluation mode (so an MoE router does not count these tokens for its load balancing
        twice). Each is ``[rows, sequence share]`` by ``row_index``; None on pipeline stages
        that never run the loss, and for what was not asked. Third: the entropies of this
        rank's loss tokens, flat."""
        old: list[list[torch.Tensor | None]] = []
        entropies: list[list[torch.Tensor | None]] = []
        loss_token_entropies: list[torch.Tensor] = []
        self.engine.train(False)
        try:
            for *_, batches in minibatches:
                old.append([])
                entropies.append([])
                for batch in batches:
                    logp_pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
                    entropy_pieces: list[tuple[torch.Tensor, torch.Tensor]] = []

                    def capture(logits, b, logp_pieces=logp_pieces, entropy_pieces=entropy_pieces):
                        rows = b["row_index"][:, 0]
                        if logprobs:
                            logp_pieces.append((rows, self.loss.label_logprobs(logits, b)[0]))
                        if entropy:
                            values = self.loss.token_entropy(logits)
                            entropy_pieces.append((rows, values))
                            loss_token_entropies.append(values[b["loss_mask"] > 0])  # this rank's share
                        return torch.zeros((), device=logits.device)

                    self.engine.forward_only(batch, capture)
                    old[-1].append(_assemble_rows(logp_pieces, len(batch["input_ids"])))
                    entropies[-1].append(_assemble_rows(entropy_pieces, len(batch["input_ids"])))
        finally:
            self.engine.train(True)
        return (old if logprobs else None), (entropies if entropy else None), loss_token_entropies

    def _high_entropy_masks(self, entropies: list[list[torch.Tensor | None]],
                            loss_token_entropies: list[torch.Tensor]) -> tuple[list[list[torch.Tensor | None]], float]:
        """--rl.top_entropy_quantile: per microbatch, 1 on the tokens whose pre-update entropy
        is at or above the rollout's cut, and the cut. The cut is the quantile of every loss
        token's entropy over all ranks: each token is counted once (by the tensor-parallel
        rank 0 of its data/context-parallel share, on the last pipeline stage)."""
        values = loss_token_entropies if self.engine.parallel_dims.coords["tp"] == 0 else []
        local = torch.cat(values).double().cpu() if values else torch.zeros(0, dtype=torch.float64)
        if self.engine.dist_env.world_size > 1 and dist.is_initialized():
            shares: list[Any] = [None] * self.engine.dist_env.world_size
            dist.all_gather_object(shares, local)
            local = torch.cat(shares)
        cut = entropy_threshold(local, 1 - self.config.rl.top_entropy_quantile) if local.numel() else torch.zeros(())
        masks = [[None if e is None else (e >= cut.to(e.device, e.dtype)).float() for e in row] for row in entropies]
        return masks, float(cut)

    def _minibatches(self, rows, *, row_index: bool) -> list[tuple[float, float, list[dict[str, torch.Tensor]]]]:
        """The rollout's rows in --rl.minibatches_per_rollout contiguous minibatches, each as
        (its global loss normalizer, its global count of completion tokens — what a model's
        auxiliary loss is averaged over —, this rank's microbatches). ``row_index``: give each
        microbatch a ``row_index`` key, for per-row state kept across passes."""
        cfg, dims = self.config, self.engine.parallel_dims
        count = cfg.rl.minibatches_per_rollout
        size, extra = divmod(len(rows), count)
        out, start = [], 0
        for m in range(count):
            chunk = rows[start : start + size + (m < extra)]
            start += len(chunk)
            if cfg.rl.padding_free:
                batches = self._packed_batches(chunk)
            else:
                batches = [
                    build_batch(microbatch, seq_len=cfg.training.seq_len, pad_id=self.tokenizer.pad_id)
                    for microbatch in split_rows(chunk, dp_rank=dims.dp_rank, dp_world_size=dims.dp_world_size,
                                                 microbatch_size=cfg.training.local_batch_size)
                ]
            completion_tokens = max(float(sum(len(r.token_ids) for r in chunk)), 1.0)
            for batch in batches if row_index else ():
                batch_rows, seq = batch["input_ids"].shape
                batch["row_index"] = torch.arange(batch_rows)[:, None].expand(batch_rows, seq).contiguous()
            normalizer = rows_loss_normalizer(chunk, cfg.rl.loss_type, max_new_tokens=self.sampling.max_new_tokens)
            out.append((normalizer, completion_tokens, batches))
        return out

    def _packed_batches(self, rows: list) -> list[dict[str, torch.Tensor]]:
        """--rl.padding_free: this data-parallel rank's contiguous share of ``rows``, packed
        several completions to a row (``pack_rows``), in microbatches of
        --training.local_batch_size packed rows (the last one as many as are left); every rank
        runs as many microbatches as the rank with the most (the others add one row of padding
        each), so all run the same collectives. Under pipeline parallel every microbatch has
        exactly --training.local_batch_size rows (the stages' shapes are fixed), padding rows
        filling the short ones."""
        cfg, dims = self.config, self.engine.parallel_dims
        first, count = share(len(rows), dims.dp_rank, dims.dp_world_size)
        packed = pack_rows(rows[first : first + count], seq_len=cfg.training.seq_len)
        size = cfg.training.local_batch_size
        microbatches = -(-len(packed) // size)
        if self.engine.dist_env.world_size > 1 and dist.is_initialized():
            most = torch.tensor([microbatches], device=self.engine.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            microbatches = int(most.item())
        groups = [packed[i : i + size] for i in range(0, len(packed), size)]  # the last one may be short
        groups += [[[]]] * (max(microbatches, 1) - len(groups))  # a row of padding only, for the collectives
        if dims.pp_enabled:
            groups = [group + [[]] * (size - len(group)) for group in groups]
        return [build_packed_batch(group, seq_len=cfg.training.seq_len, pad_id=self.tokenizer.pad_id)
                for group in groups]

    def rl_step(self) -> dict[str, Any] | None:
        """One RL step: one rollout, trained for --rl.ppo_epochs passes of
        --rl.minibatches_per_rollout optimizer steps; returns its metrics, or None when the
        rollout had nothing to learn."""
        cfg, engine = self.config, self.engine
        sync_before = self.timings["sync_s"]
        self.loss.entropy_coef = self.state.entropy_coef  # restored by a resume when adaptive
        updates = cfg.rl.updates_per_rollout
        rollout, rows, behind = self._next_rows()
        stats = rollout_stats(rollout)
        if not any(r.train and r.token_ids for r in rows):
            self.state.skipped += 1
            self._record_completions(rollout, engine.step)
            return None
        start = time.perf_counter()
        needs_old = cfg.rl.old_logprobs == "trainer" and updates > 1
        high_entropy_only = cfg.rl.top_entropy_quantile < 1
        minibatches = self._minibatches(rows, row_index=needs_old or high_entropy_only)
        trainer_old, entropies, loss_token_entropies = (
            self._pre_update_pass(minibatches, logprobs=needs_old, entropy=high_entropy_only)
            if needs_old or high_entropy_only else (None, None, []))
        policy_masks, entropy_cut = (self._high_entropy_masks(entropies, loss_token_entropies) if entropies
                                     else (None, None))
        lr = engine.lr_schedulers.last_lr()
        totals: dict[str, float] = {}
        losses, norms = [], []
        for epoch in range(cfg.rl.ppo_epochs):
            for m, (normalizer, completion_tokens, batches) in enumerate(minibatches):
                accumulator: dict[str, torch.Tensor] = {}
                rank_loss = torch.zeros((), device=engine.device)
                for j, batch in enumerate(batches):
                    # The mismatch is measured on pre-update log-probs: every row of the first
                    # pass with the pre-update pass, else the first minibatch (before any step).
                    loss_fn = self.loss.for_microbatch(
                        accumulator, trainer_old[m][j] if trainer_old is not None else None,
                        measure_mismatch=epoch == 0 and (trainer_old is not None or m == 0),
                        policy_mask=policy_masks[m][j] if policy_masks is not None else None,
                    )
                    # The router's aux loss is a mean over completion tokens for every loss type.
                    rank_loss += engine.forward_backward(batch, loss_fn, global_token_count=normalizer,
                                                         aux_token_count=completion_tokens,
                                                         last_microbatch=j == len(batches) - 1)
                norms.append(engine.optimizer_step())
                self.metrics.record_tokens(sum(b["input_ids"].numel() for b in batches)
                                           // engine.parallel_dims.non_data_parallel_size)
                reduced = self._reduce(accumulator, rank_loss)
                self._adapt_entropy_coef(reduced)
                losses.append(reduced.pop("loss"))
                combine_stats(totals, reduced)
        critic_stats = self.critic.update(minibatches, epochs=cfg.rl.critic_passes, rows=rows) if self.critic else {}
        self.timings["train_s"] += time.perf_counter() - start
        self.timings["generation_s"] += rollout.generation_s
        self._record_completions(rollout, engine.step)
        record = {
            **stats,
            **self._token_means(totals),
            "loss": sum(losses) / len(losses),
            "grad_norm": sum(norms) / len(norms),
            "lr": lr,
            "updates": len(norms),
            "policy_version": rollout.version,
            "staleness": behind // updates,
            "rows": len(rows),
            "generation_s": rollout.generation_s,
            "sync_s": self.timings["sync_s"] - sync_before,
            "train_s": time.perf_counter() - start,
        }
        record["padding_fraction"] = padding_fraction([b for *_, batches in minibatches for b in batches])
        record.update(critic_stats)
        if cfg.rl.kl_in_reward_coef:  # what the KL in the reward took from a completion's reward, on average
            record.update(self._kl_in_reward_stats(rollout))
        if entropy_cut is not None:
            record["entropy_cut"] = entropy_cut
        if cfg.rl.adaptive_entropy:
            record["entropy_coef"] = self.state.entropy_coef  # what the next update uses
        self._check_logprob_agreement(record)
        return record

    def _next_rows(self, *, every_group: bool = False) -> tuple[Rollout, list, int]:
        """The next rollout (checked against the staleness bound), valued by the critic when
        there is one; its training rows (``every_group``: groups of equal rewards too, whatever
        --rl.drop_zero_variance says); and how many optimizer steps behind the policy it was
        generated."""
        cfg, engine = self.config, self.engine
        rollout = self.next_rollout()
        self.state.rollout_index += 1
        updates = cfg.rl.updates_per_rollout
        behind = engine.step - rollout.version  # in optimizer steps
        if behind > cfg.rl.max_policy_staleness * updates or behind < 0 or behind % updates:
            raise StalenessError(
                f"rollout {rollout.index} was generated by policy version {rollout.version} and would train at "
                f"version {engine.step}: {behind} optimizer steps behind, outside [0, --rl.max_policy_staleness "
                f"{cfg.rl.max_policy_staleness} rollouts x {updates} steps]"
            )
        if self.critic is not None:
            rollout.values = self._critic_values(rollout)
        options = {**cfg.rl.advantage_options(), "kl_in_reward_coef": self.state.kl_in_reward_coef}
        if every_group:
            options["drop_zero_variance"] = False
        rows = rollout_rows(rollout, mask_truncated=cfg.rl.mask_truncated, **options)
        self._kl_in_reward_used = self.state.kl_in_reward_coef
        self._adapt_kl_in_reward_coef(rollout)
        return rollout, rows, behind

    def _adapt_kl_in_reward_coef(self, rollout: Rollout) -> None:
        """--rl.kl_in_reward_target: move the KL-in-reward coefficient by the KL this rollout
        measured (its rewards were penalized with the coefficient as it stood, as verl does),
        on every rank alike (the same rollout). Logged with the rollout's record."""
        rl = self.config.rl
        if not rl.kl_in_reward_coef:
            return
        current, completions = mean_token_kl(rollout, rl.kl_in_reward_estimator)
        self._kl_in_reward_kl = current
        if rl.kl_in_reward_target is not None and completions:  # nothing is measured before the reference is taken
            self.state.kl_in_reward_coef = adapted_kl_coef(
                self.state.kl_in_reward_coef, current, target=rl.kl_in_reward_target, horizon=rl.kl_in_reward_horizon,
                completions=completions)

    def _kl_in_reward_stats(self, rollout: Rollout) -> dict[str, float]:
        """What the KL in the reward took from a completion's reward on average
        (``kl_in_reward``), the coefficient it was taken with and the KL measured (the
        per-token mean per completion, averaged: what --rl.kl_in_reward_target steers)."""
        coef = self._kl_in_reward_used
        penalties = [float(p.sum()) for group in kl_in_reward_penalties(
            rollout, coef, self.config.rl.kl_in_reward_estimator) for p in group]
        return {"kl_in_reward": sum(penalties) / max(len(penalties), 1), "kl_in_reward_coef": coef,
                "kl_in_reward_kl": self._kl_in_reward_kl}

    def critic_warmup_step(self) -> dict[str, Any]:
        """One rollout of --rl.critic_warmup: the critic trains on it as after a policy update
        (--rl.critic_epochs passes over --rl.minibatches_per_rollout minibatches), the policy does
        not; returns its record (phase ``critic_warmup``, at the step the policy stands at).
        Groups of equal rewards train too: their returns are targets all the same (what they
        lack is a policy-gradient signal against their group)."""
        cfg, engine = self.config, self.engine
        rollout, rows, _ = self._next_rows(every_group=True)
        start = time.perf_counter()
        self.critic.warmed_up += 1
        record = {"step": engine.step, "phase": "critic_warmup", "warmup_rollout": self.critic.warmed_up,
                  "rollout_index": self.state.rollout_index, **rollout_stats(rollout)}
        if cfg.rl.kl_in_reward_coef:
            record.update(self._kl_in_reward_stats(rollout))
        if any(r.train and r.token_ids for r in rows):  # else nothing to regress on: the rollout still counts
            record.update(self.critic.update(self._minibatches(rows, row_index=False), epochs=cfg.rl.critic_passes,
                                             rows=rows))
        self.timings["train_s"] += time.perf_counter() - start
        self.timings["generation_s"] += rollout.generation_s
        self._record_completions(rollout, engine.step)
        return record

    def _warm_up_critic(self, guard: PreemptionGuard, records: list[dict[str, Any]]) -> bool:
        """--rl.critic_warmup: train the critic on the rollouts it still owes (a resume
        continues the count), logging each; returns whether a preemption request stopped it
        (the warm-up so far is then saved with the step the policy stands at, replacing that
        step's checkpoint when the run saved it before the warm-up)."""
        total = self.config.rl.critic_warmup
        while self.critic is not None and self.critic.warmed_up < total:
            record = self.critic_warmup_step()
            if self.is_rank0 and "value_loss" in record:
                logger.info("critic warm-up %d/%d (policy at step %d): value loss %.4g, explained variance %.3f",
                            self.critic.warmed_up, total, self.engine.step, record["value_loss"],
                            record["value_explained_var"])
            elif self.is_rank0:  # e.g. dynamic sampling dropped every group
                logger.info("critic warm-up %d/%d (policy at step %d): no completion to train on",
                            self.critic.warmed_up, total, self.engine.step)
            records.append(self.log_record(record))
            if self.critic.warmed_up < total and guard.requested():
                # The step may be saved already (the SFT warm-up's last): the warm-up since is not.
                save_for_preemption(self.engine.checkpointer, self.step, resave=True)
                return True
        return False

    def _critic_values(self, rollout: Rollout) -> list[list[list[float]]]:
        """The critic's per-token values of every completion of ``rollout`` (N x G), as it
        stands now (collective: every trainer rank scores its share, and all get all)."""
        completions = [c for group in rollout.groups for c in group]
        flat = iter(self.critic.values([c.prompt_ids for c in completions], [c.token_ids for c in completions]))
        return [[next(flat) for _ in group] for group in rollout.groups]

    def _adapt_entropy_coef(self, reduced: Mapping[str, float]) -> None:
        """--rl.adaptive_entropy: after each optimizer step, move the entropy bonus's
        coefficient toward keeping the mean token entropy at --rl.entropy_target
        (:func:`titan.rl.losses.adapted_entropy_coef`; every rank sees the same reduced stats)."""
        rl = self.config.rl
        if not rl.adaptive_entropy:
            return
        entropy = reduced["entropy"] / max(reduced["tokens"], 1.0)
        self.state.entropy_coef = adapted_entropy_coef(
            self.state.entropy_coef, entropy, target=rl.entropy_target, delta=rl.entropy_coef_delta,
            low=rl.entropy_coef_min, high=rl.entropy_coef_max)
        self.loss.entropy_coef = self.state.entropy_coef

    def _record_completions(self, rollout: Rollout, step: int) -> None:
        """Rank 0: append the rollout's completions to completions.jsonl (--rl.log_completions)
        and keep them for the next log line (--rl.num_completions_to_print)."""
        rl = self.config.rl
        if not self.is_rank0 or not (rl.log_completions or rl.num_completions_to_print):
            return
        records = completion_records(rollout, step=step, rl=rl)
        if rl.log_completions:
            append_completions(self.config.job.dump_folder, records)
        self._printed_completions = records[: rl.num_completions_to_print]

    def _print_completions(self, step: int) -> None:
        """Rank 0: the kept completions of the rollout just trained, in the log."""
        records, self._printed_completions = self._printed_completions, []
        if records:
            logger.info("step %d: %d of rollout %d's completions\n%s", step, len(records), records[0]["rollout"],
                        "\n".join(format_completion(r) for r in records))

    def _token_means(self, totals: Mapping[str, float]) -> dict[str, float]:
        """Per-token means (and maxima) of a rollout's summed stats."""
        out = stat_means(totals)
        completion_tokens = max(totals.get("completion_tokens", 0.0), 1.0)
        out["logprob_diff_max"] = totals.get("logprob_diff_max", 0.0)
        out["logprob_diff_mean"] = totals.get("logprob_diff_sum", 0.0) / completion_tokens
        if self.config.rl.old_logprobs == "trainer" and self.config.rl.is_level != "off":
            tokens = max(totals["tokens"], 1.0)
            out.update(is_weight_mean=totals["is_weight"] / tokens, is_weight_max=totals["is_weight_max"],
                       is_capped_fraction=totals["is_capped"] / tokens, is_masked_fraction=totals["is_masked"] / tokens)
        if self.config.rl.top_entropy_quantile < 1 or self.config.rl.off_policy_mask_threshold is not None:
            out["policy_token_fraction"] = totals["policy_tokens"] / max(totals["tokens"], 1.0)
        if self.config.rl.off_policy_mask_threshold is not None:
            out["off_policy_masked_fraction"] = totals["off_policy_masked"] / max(totals["tokens"], 1.0)
        return out

    def _check_logprob_agreement(self, record: Mapping[str, Any]) -> None:
        """Warn when trainer and generator disagree on an on-policy rollout's log-probs by more
        than --rl.max_logprob_diff (a stale rollout differs by its policy drift as well)."""
        limit = self.config.rl.max_logprob_diff
        if limit > 0 and record["staleness"] == 0 and record["logprob_diff_max"] > limit and self.is_rank0:
            logger.warning(
                "step %d: trainer and generator log-probs of the same on-policy tokens differ by up to %.3g "
                "(mean %.3g), above --rl.max_logprob_diff %g: the generator does not compute the trainer's "
                "model (a weight or buffer missing from the sync, or mismatched precision or kernels)",
                self.engine.step, record["logprob_diff_max"], record["logprob_diff_mean"], limit,
            )

    def _reduce(self, accumulator: dict[str, torch.Tensor], rank_loss: torch.Tensor) -> dict[str, float]:
        """Sums (maxima for the ``*_max`` keys) over the data-parallel, context-parallel and
        pipeline ranks. Every rank reduces the same keys (:data:`SUMMED_STATS`,
        :data:`MAX_STATS`), zero where it computed none: pipeline stages before the last
        never run the loss."""
        engine, dims = self.engine, self.engine.parallel_dims
        unknown = set(accumulator) - set(SUMMED_STATS) - set(MAX_STATS)
        if unknown:
            raise KeyError(f"RL stats {sorted(unknown)} are not in SUMMED_STATS or MAX_STATS")
        keys, max_keys = list(SUMMED_STATS), list(MAX_STATS)
        device = engine.device
        zero = torch.zeros((), dtype=torch.float64, device=device)

        def stacked(names: list[str], extra: torch.Tensor) -> torch.Tensor:
            return torch.stack([torch.as_tensor(accumulator.get(k, zero), dtype=torch.float64, device=device)
                                for k in names] + [extra])

        sums = stacked(keys, rank_loss.double())
        largest = stacked(max_keys, zero)
        engine.sum_over(sums, "dp_cp")
        largest = reduce_max(largest, dims.mesh("dp_cp"))
        if dims.pp_enabled:
            engine.sum_over(sums, "pp")
            largest = reduce_max(largest, dims.mesh("pp"))
        out = {k: float(v) for k, v in zip(keys, sums[:-1].tolist(), strict=True)}
        out.update({k: float(v) for k, v in zip(max_keys, largest[:-1].tolist(), strict=True)})
        out["loss"] = float(sums[-1])
        return out

    # ---- warm-up and evaluation ---------------------------------------------------------

    def sft_step(self, data_iter) -> dict[str, Any]:
        """One supervised step on the synthetic task's answers (the warm-up): the shared
        :meth:`~titan.train.loop.TrainingLoop.train_step`, over ``--training.global_batch_size``
        sequences (gradient accumulation, as in pretraining)."""
        microbatches = self.next_microbatches(data_iter)
        result = self.train_step(microbatches)
        self.metrics.record_tokens(self.device_tokens(microbatches))
        self.train_state.tokens_seen += int(result.tokens)
        loss, loss_max = self.global_loss(result)
        return {"loss": loss, "loss_max": loss_max, "grad_norm": float(result.grad_norm), "lr": result.lr,
                "phase": "sft_warmup", "tokens_seen": self.train_state.tokens_seen}

    def evaluate(self) -> dict[str, float]:
        """Mean reward and exact-match rate of greedy completions of the held-out prompts, with
        the current weights (collective: syncs the generator)."""
        if not self.eval_prompts:
            return {}
        self._wait_pending()
        self.schedule.sync_to(self.engine.step)

        def score_held_out() -> dict[str, float]:  # rank 0
            if self.remote is not None:
                return self.remote.evaluate()
            return held_out_means([self.producer.held_out_totals()])

        if self.every_rank:  # each rank scores its share of the held-out prompts
            return held_out_means(self._gather_parts(self.producer.held_out_totals))
        return self._broadcast(score_held_out)

    def _should_eval(self, before: int, step: int, first_rl_step: bool) -> bool:
        """Whether to evaluate after moving from step ``before`` to ``step`` (a multiple of
        --rl.eval_freq passed, the first RL step, or the last step)."""
        freq = self.config.rl.eval_freq
        return (freq > 0 and bool(self.eval_prompts)
                and (first_rl_step or _crossed(before, step, freq) or step == self.config.training.steps))

    def _start_reference(self) -> None:
        """Freeze the weights RL starts from as the KL reference (rank 0), when KL is on; a
        resumed run keeps the reference its checkpoint restored."""
        if not self.config.rl.uses_reference or self.config.rl.teacher_model:
            return  # no KL, or a teacher loaded up front
        if self.remote is not None:  # no generator on rank 0: the weights come from the engine
            weights = self.engine.full_state_dict(dtype=torch.float32)  # collective: every rank iterates it
            if self.is_rank0 and not self.reference.taken:
                self.reference.take(weights)
            else:
                for _ in weights:
                    pass
            return
        self.schedule.sync_to(self.engine.step)
        if self.generator is not None:
            self.reference.take(self.generator.named_weights())

    def _start_critic(self) -> None:
        """Start the critic from the weights RL starts from (each rank its shards; the score
        head stays fresh), unless --rl.critic_model gave it a reward model's or a resumed
        checkpoint restored it."""
        if self.critic is not None and not self.critic.taken:
            self.critic.take(self.engine)

    def _sync_reference(self, step: int) -> None:
        """--rl.ref_sync_steps: move the KL reference toward the current policy (collective).
        A rollout being generated in the background is rescored with the reference first, so
        the reference never changes under it (that rollout keeps the previous reference)."""
        self._wait_pending()
        start = time.perf_counter()
        alpha = self.config.rl.ref_mixup_alpha
        self.reference.mix(self.engine.full_state_dict(dtype=torch.float32), alpha)
        if self.is_rank0:
            logger.info("step %d: KL reference moved toward the policy (alpha %g) in %.2fs", step, alpha,
                        time.perf_counter() - start)

    # ---- the loop -----------------------------------------------------------------------

    def resume_position(self) -> str:
        """The next rollout of a resumed run, for the log."""
        return f"rollout {self.state.rollout_index}"

    def progressed_before_step_1(self) -> bool:
        """A step-0 checkpoint saved during --rl.critic_warmup has rollouts behind it."""
        return self.state.rollout_index > 0

    def after_steps(self) -> None:
        """Let a background generation finish before the summary."""
        self._wait_pending()

    def log_summary(self, records: list[dict[str, Any]], preempted: bool) -> None:
        """Where the time went (generation, training, weight sync), and the held-out results
        where RL started and at the end."""
        logger.info(
            "RL %s: %d steps | time: generation %.1fs, training %.1fs, weight sync %.1fs",
            "preempted" if preempted else "done", self.step, self.timings["generation_s"],
            self.timings["train_s"], self.timings["sync_s"],
        )
        self._summarize_held_out(records)

    def run_steps(self, guard: PreemptionGuard, profiler: StepProfiler, records: list[dict[str, Any]]) -> bool:
        """Warm-up and RL steps until --training.steps, an early stop, or an agreed preemption
        request (then the step just finished is saved); returns whether a signal stopped it.
        The profiler counts optimizer steps (an RL step may take several: its window then
        holds the whole rollout, generation included)."""
        engine, cfg = self.engine, self.config
        total, warmup = cfg.training.steps, cfg.rl.sft_warmup_steps
        data_iter = iter(self.warmup_loader) if self.warmup_loader is not None and engine.step < warmup else None
        first_rl = True
        consecutive_skips = 0
        while engine.step < total:
            before = engine.step
            if engine.step < warmup:
                record = self.sft_step(data_iter)
            else:
                if first_rl:
                    self._start_reference()
                    self._start_critic()
                    if self._should_eval(engine.step, engine.step, True):
                        records.append(self._log_eval(engine.step))
                    first_rl = False
                    if self._warm_up_critic(guard, records):
                        return True
                record = self.rl_step()
                if record is None:
                    consecutive_skips += 1
                    if consecutive_skips >= MAX_CONSECUTIVE_SKIPS:
                        logger.warning("%d rollouts in a row had no reward variance in any group: stopping early "
                                       "at step %d", consecutive_skips, engine.step)
                        engine.maybe_save(last_step=True)  # the run ends here: keep its final state
                        break
                    continue
                consecutive_skips = 0
            step = engine.step  # an RL step may take several optimizer steps
            for _ in range(step - before):
                profiler.step()
            if self.metrics.should_log(step) or _crossed(before, step, cfg.metrics.log_freq):
                records.append(self._log(step, record))
            if step > warmup and _crossed(before, step, cfg.rl.ref_sync_steps):
                self._sync_reference(step)
            if step > warmup and self._should_eval(before, step, False):
                records.append(self._log_eval(step))
            engine.maybe_save(last_step=step == total, since=before)
            if step == total and self.critic is not None:
                self.critic.export_hf(step)
            if step < total and guard.requested():
                self.stop_for_preemption()  # what maybe_save would save here
                return True
        return False

    def _summarize_held_out(self, records: list[dict[str, Any]]) -> None:
        """The final summary: held-out exact match and reward where RL started and at the end."""
        evals = [r for r in records if r.get("phase") == "eval" and "eval_exact_match" in r]
        if self.is_rank0 and evals:
            first, last = evals[0], evals[-1]
            logger.info(
                "held-out (%d prompts, greedy): exact match %.3f at step %d -> %.3f at step %d; reward %.3f -> %.3f",
                min(len(self.eval_prompts), self.config.rl.eval_prompts), first["eval_exact_match"], first["step"],
                last["eval_exact_match"], last["step"], first["eval_reward"], last["eval_reward"],
            )

    def _log(self, step: int, record: dict[str, Any]) -> dict[str, Any]:
        if record.get("phase", "rl") == "rl":
            self._print_completions(step)
        extra = {k: v for k, v in record.items() if k not in ("loss", "grad_norm", "lr")}
        extra.setdefault("phase", "rl")
        extra["rollout_index"] = self.state.rollout_index
        extra.update({f"total_{k}": v for k, v in self.timings.items()})
        return self.log_step(step, loss=record["loss"], grad_norm=record["grad_norm"], lr=record["lr"], extra=extra)

    def _log_eval(self, step: int) -> dict[str, Any]:
        """Score the held-out prompts and log the result as its own record (JSONL, TensorBoard
        and W&B alike)."""
        result = {"step": step, "phase": "eval", **self.evaluate()}
        if self.is_rank0:
            logger.info("eval at step %d: reward %.3f, exact match %.3f", step, result.get("eval_reward", float("nan")),
                        result.get("eval_exact_match", float("nan")))
        return self.log_record(result)

    def close(self) -> None:
        """Stop the background generation, drain checkpoint saves, release the process group."""
        self.schedule.close()
        close_generator = getattr(self.generator, "close", None)
        if close_generator is not None:  # vLLM's groups inside the trainer's go first
            close_generator()
        super().close()  # the engine's close waits for every trainer rank: the generators may stop
        self._stop_generators()

    def _stop_generators(self) -> None:
        """Tell the generator ranks to stop, also after a failure here (they would otherwise
        wait for a command until --rl.generator_timeout_s): a rollout still being generated is
        collected first, so the stop command is the one they wait for."""
        if self.remote is None or not self.remote.is_driver or self.remote.stopped:
            return
        try:
            self._wait_pending()
            self.remote.stop()
        except Exception:  # the generator ranks may be gone already: the launcher stops them
            logger.warning("could not tell the generator ranks to stop", exc_info=True)


def build_rl_loop(config: Any, *, model_spec: ModelSpec, teacher_spec: ModelSpec | None = None) -> Any:
    """The loop this process runs for ``config``: the trainer (:class:`RLTrainer`, with the
    teacher's family ``teacher_spec``) or, with --rl.generator_ranks N, on the launch's last N
    ranks a :class:`GeneratorServer`."""
    if config.rl.generator_ranks:
        split = split_for_generators(config.rl.generator_ranks, timeout_s=config.rl.generator_timeout_s,
                                     generator_group=config.generator.tensor_parallel_size > 1)
        if split.part != TRAINER:
            return GeneratorServer(config, model_spec=model_spec, split=split)
    return RLTrainer(config, model_spec=model_spec, teacher_spec=teacher_spec)
