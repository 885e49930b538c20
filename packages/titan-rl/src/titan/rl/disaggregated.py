"""Disaggregated RL: generator ranks and trainer ranks in one launch (``--rl.generator_ranks N``).

The launch is split (:func:`titan.dist.split_job`): its first ``world - N`` ranks are the
trainer, a :class:`~titan.train.engine.TrainingEngine` over their own default process group
(any layout: FSDP, TP, PP...); its last ``N`` ranks each run a generator
(:class:`GeneratorServer`) with its own model copy. The first trainer rank drives the
generator ranks over the split's bridge with commands, in order:

- ``sync``: the trainer's weights follow, broadcast in buckets with the policy version and a
  checksum of every tensor (:class:`~titan.rl.weight_sync.WeightBroadcaster`); a generator
  whose weights then differ from the trainer's stops the run on both sides;
- ``rollout i``: each generator rank generates and scores its share of rollout ``i``'s
  prompts and sends its part back; the trainer merges the parts (in rank order);
- ``eval``: greedy completions of each rank's share of the held-out prompts, scored;
- ``stop``: the run is over.

Generation overlaps training by the order of these commands: with
``--rl.max_policy_staleness k >= 1`` the trainer asks for rollout ``i + 1`` before it trains on
rollout ``i`` (after a sync when the generators' weights would be too old), so the generator
ranks generate while the trainer ranks train. An error on a generator rank is sent back in
place of its part: every trainer rank raises it, and so does the generator rank.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from titan.dist import JobSplit, current_split, destroy_distributed, split_job
from titan.rl.data import build_prompts
from titan.rl.generate.build import (
    build_generator,
    check_generator_kind,
    check_generator_tensor_parallel,
    check_vllm_device,
)
from titan.rl.producer import RolloutProducer, held_out_means, merge_rollouts
from titan.rl.rollouts import Rollout
from titan.rl.weight_sync import SyncStats, WeightBroadcaster
from titan.train.model_spec import ModelSpec
from titan.train.preemption import PreemptionGuard

logger = logging.getLogger("titan")

TRAINER = 0
"""The split part of the trainer ranks (the launch's first ranks)."""


class GeneratorError(RuntimeError):
    """A generator rank failed to produce its part of a rollout or an evaluation."""


def split_for_generators(generator_ranks: int, *, timeout_s: float, generator_group: bool = False) -> JobSplit:
    """Split this launch into its trainer ranks and its last ``generator_ranks`` ranks (every
    process of the launch calls this once), with a clear error for a launch too small.
    ``generator_group``: the generator ranks get a default process group of their own, for
    vLLM engines sharded over them (``--generator.tensor_parallel_size``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if generator_ranks >= world:
        raise ValueError(
            f"--rl.generator_ranks {generator_ranks} leaves no trainer rank in a launch of {world} "
            f"{'rank' if world == 1 else 'ranks'}; start {generator_ranks + 1} or more ranks with torchrun "
            "(NGPU=... ./tools/run_train.sh), or use --rl.generator_ranks 0 (rank 0 generates)"
        )
    split = current_split()
    if split is not None:  # e.g. a test harness split the job already
        if split.part_sizes[1] != generator_ranks:
            raise ValueError(f"this launch was split for {split.part_sizes[1]} generator ranks, not {generator_ranks}")
        return split
    # Without sharded engines the generator ranks get no group of their own: nothing of theirs
    # is collective, and an in-process vLLM engine starts its own default group on each of them.
    return split_job(world - generator_ranks, timeout_s=timeout_s, part_groups=(True, generator_group))


class RemoteGenerators:
    """The trainer's side of the bridge (every trainer rank builds one; only the first drives
    the generator ranks, the others take part in gathering the weights it sends)."""

    def __init__(self, split: JobSplit, *, bucket_mb: float = 64.0) -> None:
        self.bridge = split.bridge  # the first trainer rank's; None on the other trainer ranks
        self.generator_ranks = split.part_sizes[1]
        self.broadcaster = WeightBroadcaster.over_bridge(split.bridge, is_trainer=True, bucket_mb=bucket_mb)
        self.stopped = False

    @property
    def is_driver(self) -> bool:
        """Whether this is the trainer rank that commands the generator ranks (the first)."""
        return self.bridge is not None

    def _command(self, op: str, **fields: Any) -> None:
        self.bridge.broadcast_object({"op": op, **fields}, src=0)

    def sync(self, engine: Any, *, version: int) -> SyncStats:
        """Send the engine's weights as policy ``version`` (every trainer rank: collective)."""
        if self.bridge is not None:
            self._command("sync")
        return self.broadcaster.send(engine, version=version, dtype=torch.float32)

    def request(self, index: int) -> None:
        """Ask the generator ranks for rollout ``index`` (first trainer rank; returns at once)."""
        self._command("rollout", index=index)

    def collect(self) -> Rollout:
        """The rollout last requested, merged from every generator rank's part (first trainer
        rank; waits for it). Raises :class:`GeneratorError` with a generator rank's error."""
        return merge_rollouts(self._replies())

    def evaluate(self) -> dict[str, float]:
        """Held-out reward and exact match of greedy completions, every generator rank scoring
        its share of the prompts (first trainer rank)."""
        self._command("eval")
        return held_out_means(self._replies())

    def _replies(self) -> list[Any]:
        replies = [self.bridge.recv_object(src) for src in range(1, self.generator_ranks + 1)]
        for rank, reply in enumerate(replies):
            if isinstance(reply, dict) and "error" in reply:
                raise GeneratorError(f"generator rank {rank}: {reply['error']}")
        return replies

    def stop(self) -> None:
        """Tell the generator ranks the run is over (first trainer rank; once)."""
        if self.bridge is not None and not self.stopped:
            self._command("stop")
        self.stopped = True


class GeneratorServer:
    """A generator rank of a disaggregated run: serves the first trainer rank's commands (see
    the module docstring) until ``stop``. Runs under the ``titan rl`` command like the trainer
    (``train()`` serves, ``close()`` releases the process group)."""

    def __init__(self, config: Any, *, model_spec: ModelSpec, split: JobSplit) -> None:
        from titan.train.engine import setup_logging

        self.config, self.split = config, split
        setup_logging(split.rank, prefix="titan generator")  # the first generator rank at INFO
        check_generator_kind(config.generator.kind)
        check_generator_tensor_parallel(config.generator, split.size, every_rank=False, generator_ranks=split.size)
        # Sharded engines run under the generator ranks' own group (vLLM's external_launcher);
        # otherwise each generator rank runs an engine alone.
        sharded = config.generator.tensor_parallel_size > 1
        check_vllm_device(config.generator.kind, split.device, in_group=sharded)
        model_spec.check_flavor(config.model.flavor)
        tokenizer = config.tokenizer.build()
        vocab_size = config.model.resolve_vocab_size(tokenizer.vocab_size)
        self.generator = build_generator(config, model_spec, vocab_size=vocab_size, eos_token_id=tokenizer.eos_id,
                                         device=split.device, kind=config.generator.kind, every_rank=sharded)
        train_prompts, eval_prompts = build_prompts(config.rl_data, tokenizer,
                                                    max_prompt_tokens=config.max_prompt_tokens)
        self.producer = RolloutProducer(config, generator=self.generator, tokenizer=tokenizer,
                                        train_prompts=train_prompts, eval_prompts=eval_prompts,
                                        shard=split.rank, shards=split.size, model_spec=model_spec)
        self.bridge = split.bridge
        self.receiver = WeightBroadcaster.over_bridge(split.bridge, is_trainer=False)
        self.served = {"sync": 0, "rollout": 0, "eval": 0}
        self.failure: str | None = None

    def train(self) -> dict[str, int]:
        """Serve commands until ``stop``; returns how many of each were served."""
        logger.info("generator rank %d of %d: serving the trainer", self.split.rank, self.split.size)
        # A launcher's SIGTERM reaches every rank: the trainer finishes its step, saves and
        # sends stop; until then this rank keeps serving (a second signal exits at once).
        guard = PreemptionGuard(self.split.device)
        try:
            return self._serve()
        finally:
            guard.close()

    def _serve(self) -> dict[str, int]:
        while True:
            command = self.bridge.broadcast_object(src=0)
            op = command["op"]
            if op == "stop":
                if self.failure is not None:  # the trainer stopped after hearing of it
                    raise GeneratorError(f"generator rank {self.split.rank}: {self.failure}")
                logger.info("generator rank %d: done (%s)", self.split.rank, self.served)
                return dict(self.served)
            if op == "sync":
                self.receiver.receive(self.generator)
            elif op == "rollout":
                self._reply(lambda index=command["index"]: self.producer.produce(index))
            elif op == "eval":
                self._reply(self.producer.held_out_totals)
            else:
                raise GeneratorError(f"unknown command {op!r} from the trainer")
            self.served[op] += 1

    def _reply(self, work) -> None:
        """Send ``work()``'s result to the first trainer rank, or its error. After an error
        the server keeps serving until the trainer, which raises it on every trainer rank,
        sends ``stop``; ``train()`` then raises it here too."""
        try:
            result = work()
        except Exception as err:
            logger.error("generator rank %d failed", self.split.rank, exc_info=True)
            self.failure = self.failure or f"{type(err).__name__}: {err}"
            result = {"error": f"{type(err).__name__}: {err}"}
        self.bridge.send_object(result, 0)

    def close(self) -> None:
        """Release the generator ranks' process group when they have one (engines sharded over
        them): vLLM's groups inside it first. Without one there is nothing to release (an
        in-process vLLM engine alone on its rank owns its own group)."""
        if not self.split.has_group:
            return
        close = getattr(self.generator, "close", None)
        if close is not None:
            close()
        destroy_distributed()


__all__ = [
    "GeneratorError",
    "GeneratorServer",
    "RemoteGenerators",
    "split_for_generators",
]
