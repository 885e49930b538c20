"""PPO's critic: a value model trained beside the policy (``--rl.advantage_estimator gae``).

The critic is the policy's architecture with a one-column score head (``num_labels=1``, the
layout of a Hugging Face ``...ForSequenceClassification``, as verl's and OpenRLHF's critics
are): its output at the position before completion token ``t`` is ``V_t``, the return it
expects from that state (the position whose logits the policy samples token ``t`` from).

It is a second :class:`~titan.train.engine.TrainingEngine` on the trainer's ranks, built from
the run's config with the score head, so it is parallelized exactly as the policy is (FSDP,
TP, CP, PP, activation checkpointing, compile) with its own AdamW (``--rl.critic_lr``,
constant; gradients clipped to ``--training.max_norm``): a critic as large as the policy
costs each rank its share, not one device the whole. It starts from the weights RL starts
from, copied shard by shard from the policy's engine (the same layout holds the same
shards), with a freshly initialized score head (verl's default); or from a reward model's
Hugging Face folder (``--rl.critic_model``; OpenRLHF starts its critic from the reward model),
whose own ``config.json`` then gives the critic's architecture: any size of the policy's
family over the policy's tokenizer.

Each rollout's values come from one no-grad pass over its completions, dealt out to the
data-parallel ranks; every rank then holds every value (gathered). After the policy's update
the critic trains on the same microbatches (which carry each token's return and the value the
rollout was scored with) with PPO's clipped value loss ``0.5 max((V - R)^2, (V_old + clip(V -
V_old, +-c) - R)^2)``, divided by the minibatch's completion tokens (``c``:
``--rl.value_clip``). With ``--rl.critic_warmup N`` it first trains so on N rollouts of the
starting policy, which does not update on them. Its weights, optimizer state, whether it was
started and its warm-up rollouts so far are checkpointed with the run
(:meth:`Critic.state_dict`). With ``--checkpoint.last_save_in_hf`` the last step exports it
beside the policy, as a Hugging Face ``...ForSequenceClassification`` folder under
``<checkpoint folder>_critic`` that ``--rl.critic_model`` reads back (OpenRLHF's
``save_value_network``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from titan.ckpt.stateful import ModelWrapper, OptimizerWrapper, copy_whole_weights
from titan.rl.reward_trainer import with_score_head
from titan.rl.rollouts import Row, build_packed_batch, split_rows
from titan.train.lr_scheduler import LRSchedulerConfig
from torch.distributed.tensor import DTensor

HEAD_PREFIX = "output."
"""The decoder's head: a language model's LM head, the critic's score head."""


CRITIC_FLAVOR = "critic"
"""The flavor name of a critic built from a reward model's ``config.json``."""


def reward_model_spec(folder: str, model_spec: Any, vocab_size: int) -> tuple[Any, int]:
    """``model_spec`` with the flavor :data:`CRITIC_FLAVOR`: the architecture of the reward
    model in ``folder`` (its ``config.json``: the policy's family, one score column, the run's
    ``vocab_size`` ids covered), and its vocabulary size."""
    from titan.rl.generate.build import folder_architecture

    spec, args = folder_architecture(folder, model_spec, flag="--rl.critic_model", role="critic",
                                     flavor=CRITIC_FLAVOR, labels=1, vocab_size=vocab_size)
    return spec, args.vocab_size


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter (the tensor itself when not distributed)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _scores(output: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` float32 values from the score head's ``[B, S, 1]`` output (replicated over
    tensor-parallel ranks: the local copy, which keeps its gradient)."""
    return _local(output)[..., 0].float()


def clipped_value_loss(predicted: torch.Tensor, old: torch.Tensor, returns: torch.Tensor,
                       clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token (``0.5 max(unclipped, clipped)``) and where the
    clipped term is the larger (where the clip binds: a rounding difference between
    ``old + (V - old)`` and ``V`` is not counted)."""
    moved = predicted - old
    clipped = old + moved.clamp(-clip, clip)
    unclipped_loss, clipped_loss = (predicted - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_loss, clipped_loss), (clipped_loss > unclipped_loss) & (moved.abs() > clip)


class Critic:
    """PPO's value model on its own engine (module docstring); every trainer rank holds one."""

    def __init__(self, engine: Any, *, value_clip: float, seq_len: int, pad_id: int, local_batch_size: int) -> None:
        self.engine, self.value_clip = engine, value_clip
        self.seq_len, self.pad_id, self.local_batch_size = seq_len, pad_id, local_batch_size
        self.taken = False
        """Whether the weights are the run's (taken from the policy or a reward model), not placeholders."""
        self.warmed_up = 0
        """Rollouts of --rl.critic_warmup trained so far (checkpointed: a resume does not repeat them)."""
        self._model = ModelWrapper(engine.model_parts)
        self._optimizer = OptimizerWrapper(engine.model_parts, engine.optimizers)

    @classmethod
    def from_config(cls, config: Any, *, model_spec: Any, vocab_size: int, tokenizer: Any,
                    reward_model: str | None = None) -> Critic:
        """The critic of an RL run's ``config``: its engine built as the policy's is (same
        layout, precision and seed) with the score head, ``--rl.critic_lr`` (after a linear
        warmup over ``--rl.critic_lr_warmup_steps`` of its optimizer steps) held constant, and
        a checkpointer only for the last step's Hugging Face export (the run's checkpoints
        hold its state). The policy's model, or with ``reward_model`` (a local folder) that
        model's architecture; load its weights with :meth:`load_reward_model`."""
        from titan.ckpt.config import CheckpointConfig
        from titan.train.engine import TrainingEngine

        rl = config.rl
        model = config.model
        if reward_model is not None:
            model_spec, vocab_size = reward_model_spec(reward_model, model_spec, vocab_size)
            # The folder's architecture whole: no --model.* field of the policy's applies to it.
            model = dataclasses.replace(model, flavor=CRITIC_FLAVOR, n_layers=None, dim=None, n_heads=None,
                                        n_kv_heads=None)
        critic_config = dataclasses.replace(
            config,
            model=model,
            optimizer=dataclasses.replace(config.optimizer, lr=rl.critic_lr),
            # Warmup, then constant (no decay) whatever the count of critic steps.
            lr_scheduler=LRSchedulerConfig(warmup_steps=rl.critic_lr_warmup_steps, decay_ratio=0.0),
            checkpoint=CheckpointConfig(
                enable=config.checkpoint.enable and config.checkpoint.last_save_in_hf,
                folder=f"{config.checkpoint.folder.rstrip('/')}_critic", interval=config.training.steps,
                last_save_in_hf=True, export_dtype=config.checkpoint.export_dtype),
            # The schedule's length only bounds its warmup (the critic's steps are counted per
            # minibatch and pass, not per policy step): never shorter than the warmup.
            training=dataclasses.replace(config.training, global_batch_size=-1,
                                         steps=max(config.training.steps, rl.critic_lr_warmup_steps)),
        )
        engine = TrainingEngine.from_config(critic_config, model_spec=with_score_head(model_spec, model.flavor),
                                            vocab_size=vocab_size, tokenizer=tokenizer)
        return cls(engine, value_clip=rl.value_clip, seq_len=config.training.seq_len, pad_id=tokenizer.pad_id,
                   local_batch_size=config.training.local_batch_size)

    # ---- weights --------------------------------------------------------------------------

    @torch.no_grad()
    def take(self, policy: Any) -> None:
        """Start from the policy engine's current weights: every parameter and buffer but the
        head, shard by shard (the two engines share the layout, so each rank copies its own
        shards; nothing is communicated). A missing or differently sharded weight raises."""
        for part, source in zip(self.engine.model_parts, policy.model_parts, strict=True):
            theirs = {**dict(source.named_parameters()), **dict(source.named_buffers())}
            for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
                if name.startswith(HEAD_PREFIX):
                    continue
                if name not in theirs or _local(theirs[name]).shape != _local(tensor).shape:
                    raise ValueError(f"the critic could not start from the policy: {name} is missing or sharded "
                                     "differently there")
                _local(tensor).copy_(_local(theirs[name]))
        self.taken = True

    @torch.no_grad()
    def load_reward_model(self, folder: str, load_hf: Any) -> None:
        """Start from a reward model's Hugging Face folder (``score.weight`` included), read
        with the family's adapter by ``load_hf`` (``titan.ckpt.hf.load_hf``), every rank
        copying its own shards."""
        def problem(name: str, found: tuple[int, ...] | None, want: tuple[int, ...]) -> str:
            if found is None:
                return (f"--rl.critic_model {folder} lacks {name}: give a reward model (a ...ForSequenceClassification "
                        "folder with one label) of the policy's architecture")
            return (f"--rl.critic_model {folder} is not shaped like the policy with one score column: {name} {found} "
                    f"(the critic's {want})")

        # The adapter of the critic's own architecture; each rank slices its shards locally.
        copy_whole_weights(self.engine.model_parts, load_hf(folder, self.engine.hf_adapter), problem=problem)
        self.taken = True

    # ---- values ---------------------------------------------------------------------------

    def _value_batches(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[dict]:
        """This data-parallel rank's microbatches of the completions, one per row, each token's
        position marked with its completion (``row_id``) and index in it (``token_index``)."""
        rows = [Row(prompt_ids=list(p), token_ids=list(c), logprobs=[0.0] * len(c), advantage=0.0, train=True)
                for p, c in zip(prompts, completions, strict=True)]
        ids = {id(r): i for i, r in enumerate(rows)}
        dims = self.engine.parallel_dims
        batches = []
        for microbatch in split_rows(rows, dp_rank=dims.dp_rank, dp_world_size=dims.dp_world_size,
                                     microbatch_size=self.local_batch_size):
            batch = build_packed_batch([[r] for r in microbatch], seq_len=self.seq_len, pad_id=self.pad_id)
            row_id = torch.full_like(batch["labels"], -1)
            token_index = torch.full_like(batch["labels"], -1)
            for b, row in enumerate(microbatch):
                if id(row) in ids and row.token_ids:
                    first = len(row.prompt_ids) - 1
                    span = slice(first, first + len(row.token_ids))
                    row_id[b, span] = ids[id(row)]
                    token_index[b, span] = torch.arange(len(row.token_ids))
            batch["row_id"], batch["token_index"] = row_id, token_index
            batches.append(batch)
        return batches

    @torch.no_grad()
    def values(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        """The value of each completion token's state, per (prompt, completion) pair, on every
        rank (collective: every trainer rank calls it with the same pairs)."""
        pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

        def capture(output: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
            mask = batch["row_id"] >= 0
            pieces.append((batch["row_id"][mask].cpu(), batch["token_index"][mask].cpu(),
                           _scores(output)[mask].double().cpu()))
            return torch.zeros((), device=output.device)

        self.engine.train(False)
        try:
            for batch in self._value_batches(prompts, completions):
                self.engine.forward_only(batch, capture)
        finally:
            self.engine.train(True)
        found = [pieces]
        if self.engine.dist_env.world_size > 1 and dist.is_initialized():
            found = [None] * self.engine.dist_env.world_size
            dist.all_gather_object(found, pieces)
        out = [[float("nan")] * len(c) for c in completions]
        for rank_pieces in found:
            for rows, tokens, values in rank_pieces:
                for r, t, v in zip(rows.tolist(), tokens.tolist(), values.tolist(), strict=True):
                    out[r][t] = v
        if any(v != v for row in out for v in row):  # a position no rank scored
            raise RuntimeError("the critic's value pass left completion tokens without a value")
        return out

    # ---- updates --------------------------------------------------------------------------

    def _loss_fn(self, totals: dict[str, torch.Tensor]):
        """The clipped value loss of a microbatch, summed over its loss tokens (the engine
        divides by the minibatch's global token count); its sum and clipped count tallied."""
        def loss_fn(output: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
            if "returns" not in batch:  # only rows of padding (a rank's filler): no loss, a backward all the same
                return _scores(output).sum() * 0.0
            mask = batch["loss_mask"] > 0
            losses, clipped = clipped_value_loss(_scores(output), batch["old_values"], batch["returns"],
                                                 self.value_clip)
            loss = (losses * mask).sum()
            totals["loss"] = totals["loss"] + loss.detach().double()
            totals["clipped"] = totals["clipped"] + (clipped & mask).sum().double()
            return loss

        return loss_fn

    def update(self, minibatches: Sequence[tuple[float, float, Sequence[dict]]], *, epochs: int,
               rows: Sequence[Row]) -> dict[str, float]:
        """Regress the values on the returns: ``epochs`` passes over the policy's
        ``minibatches`` (each ``(normalizer, completion tokens, this rank's microbatches)``,
        whose batches carry ``returns`` and ``old_values``), one optimizer step each.
        Returns the token means of the loss and clip fraction over every pass, the mean
        gradient norm, the optimizer steps taken, the learning rate of the last, and from the trained ``rows`` the mean
        value, the mean return and the explained variance of the returns by the old values
        (the same on every rank)."""
        engine = self.engine
        device = engine.device
        totals = {"loss": torch.zeros((), dtype=torch.float64, device=device),
                  "clipped": torch.zeros((), dtype=torch.float64, device=device)}
        tokens, norms, lr = 0.0, [], 0.0
        for _ in range(epochs):
            for _, completion_tokens, batches in minibatches:
                for j, batch in enumerate(batches):
                    engine.forward_backward(batch, self._loss_fn(totals), global_token_count=completion_tokens,
                                            last_microbatch=j == len(batches) - 1)
                lr = engine.lr_schedulers.last_lr()  # what this step applies
                norms.append(float(engine.optimizer_step()))
                tokens += completion_tokens
        sums = torch.stack([totals["loss"], totals["clipped"]])
        engine.sum_over(sums, "dp_cp")
        if engine.parallel_dims.pp_enabled:
            engine.sum_over(sums, "pp")
        trained = [r for r in rows if r.train and r.token_ids]
        old = torch.tensor([v for r in trained for v in r.values], dtype=torch.float64)
        returns = torch.tensor([v for r in trained for v in r.returns], dtype=torch.float64)
        variance = returns.var(unbiased=False) if len(returns) else torch.zeros(())
        explained = 1.0 - float((returns - old).var(unbiased=False) / variance) if variance > 0 else 0.0
        return {"value_loss": float(sums[0]) / max(tokens, 1.0), "value_clipfrac": float(sums[1]) / max(tokens, 1.0),
                "value_grad_norm": sum(norms) / max(len(norms), 1), "value_updates": len(norms), "value_lr": lr,
                "values_mean": float(old.mean()) if len(old) else 0.0,
                "returns_mean": float(returns.mean()) if len(returns) else 0.0, "value_explained_var": explained}

    # ---- checkpoint -----------------------------------------------------------------------

    def export_hf(self, step: int) -> bool:
        """With ``--checkpoint.last_save_in_hf``: write the critic as a Hugging Face folder
        (step ``step`` under ``<checkpoint folder>_critic``; collective). Returns whether it did."""
        return self.engine.checkpointer.maybe_save(step, last_step=True)

    def state_dict(self) -> dict[str, Any]:
        """Whether it was started, its warm-up rollouts so far, its model and its optimizer
        (sharded as they live), and its place in the LR schedule (--rl.critic_lr_warmup_steps)."""
        return {"taken": torch.tensor(int(self.taken)), "warmed_up": torch.tensor(self.warmed_up),
                "model": self._model.state_dict(), "optimizer": self._optimizer.state_dict(),
                "lr_scheduler": self.engine.lr_schedulers.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        self.taken = bool(int(state["taken"]))
        self.warmed_up = int(state["warmed_up"])
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        self.engine.lr_schedulers.load_state_dict(state["lr_scheduler"])  # this run's --rl.critic_lr schedule

__all__ = ["Critic", "clipped_value_loss"]
