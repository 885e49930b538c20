"""The teacher of ``titan gkd``, two ways (``--gkd.teacher_layout``):

- ``sharded`` (the default): a second :class:`~titan.train.engine.TrainingEngine` on the
  trainer's ranks, built from the run's config with the teacher's own architecture (its
  folder's ``config.json``), so it is laid out as the student is (FSDP, TP, CP, compile) and a
  teacher as large as the student costs each rank its share, as PPO's critic does. Its weights
  are read from the folder, each rank slicing its own shards. It never trains: its logits come
  from a no-grad forward of the student's microbatch through the engine (under CP each rank
  gets its share of the sequence; under TP's loss parallel a teacher of the student's
  vocabulary keeps this rank's columns, :func:`keeps_vocab_shards`, for the vocab-parallel
  divergence, and another one's are gathered);
- ``whole``: a native float32 (or ``--gkd.teacher_dtype``) copy on every rank, which can also
  sample (``--gkd.seq_kd`` with the native generator) and runs under pipeline parallel (on the
  last stage).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from titan.train.engine import MODEL_INPUT_KEYS
from torch.distributed.tensor import DTensor

TEACHER_FLAVOR = "teacher"
"""The flavor name of the teacher's architecture, read from its folder."""


def keeps_vocab_shards(parallelism: Any, teacher_vocab: int, student_vocab: int) -> bool:
    """Whether a sharded teacher hands over this rank's vocabulary columns of its logits rather
    than gathering them: under tensor parallel with loss parallel, when its (padded)
    vocabulary is the student's and splits evenly, so that each rank's columns are the
    student's (the trainer and the dry run both ask)."""
    tp = parallelism.tensor_parallel_degree
    return (tp > 1 and parallelism.enable_loss_parallel and teacher_vocab == student_vocab
            and student_vocab % tp == 0)


class WholeTeacher:
    """A whole copy of the teacher on this rank (a native generator's model)."""

    vocab_shards = False
    """Its logits are whole over the vocabulary (the vocab-parallel loss takes this rank's columns)."""

    def __init__(self, generator: Any) -> None:
        self.generator = generator

    @property
    def num_params(self) -> int:
        """The teacher's parameter count."""
        return sum(p.numel() for p in self.generator.model.parameters())

    @torch.no_grad()
    def logits(self, engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, S, V]`` logits of ``batch``'s rows (on the device), with the document masking
        and positions the student's forward sees; context parallel then shards them with the
        batch."""
        kwargs = {key: batch[key] for key in MODEL_INPUT_KEYS if key in batch}
        return self.generator.model(batch["input_ids"], **kwargs)


class ShardedTeacher:
    """The teacher on an engine of its own, laid out as the student's (module docstring)."""

    def __init__(self, engine: Any, *, vocab_shards: bool = False) -> None:
        """``vocab_shards``: hand over this rank's vocabulary columns of vocab-sharded logits
        instead of gathering them (:func:`keeps_vocab_shards`)."""
        self.engine = engine
        self.vocab_shards = vocab_shards
        self.generator = None  # no native sampler: --gkd.seq_kd samples it with vLLM or takes a whole teacher
        engine.train(False)

    @property
    def num_params(self) -> int:
        """The teacher's parameter count."""
        return self.engine.num_params

    @classmethod
    def from_config(cls, config: Any, folder: str, *, model_spec: Any, tokenizer: Any,
                    student_vocab: int) -> ShardedTeacher:
        """The teacher in ``folder`` (a local Hugging Face folder of ``model_spec``'s family) on
        an engine built from the run's ``config`` (its layout, precision and compile; no
        checkpoints, no float8 conversion), its weights loaded shard by shard; whether it keeps
        its vocabulary shards is decided against ``student_vocab``, the student's padded one."""
        from titan.ckpt.config import CheckpointConfig
        from titan.ckpt.hf import load_hf
        from titan.rl.generate.build import folder_architecture
        from titan.train.engine import TrainingEngine
        from titan.train.quantize import QuantizeConfig

        spec, args = folder_architecture(folder, model_spec, flag="--gkd.teacher_model", role="teacher",
                                         flavor=TEACHER_FLAVOR, labels=0, vocab_size=tokenizer.vocab_size)
        # The folder's architecture whole: no --model.* field of the student's applies to it.
        model = dataclasses.replace(config.model, name=model_spec.name, flavor=TEACHER_FLAVOR, n_layers=None, dim=None,
                                    n_heads=None, n_kv_heads=None, vocab_size=None, router_aux_loss_coef=None)
        teacher_config = dataclasses.replace(config, model=model, checkpoint=CheckpointConfig(),
                                             quantize=QuantizeConfig(),
                                             training=dataclasses.replace(config.training, global_batch_size=-1))
        engine = TrainingEngine.from_config(teacher_config, model_spec=spec, vocab_size=args.vocab_size,
                                            tokenizer=tokenizer)
        teacher = cls(engine, vocab_shards=keeps_vocab_shards(config.parallelism, args.vocab_size, student_vocab))
        teacher.load(folder, load_hf)
        return teacher

    @torch.no_grad()
    def load(self, folder: str, load_hf: Any) -> None:
        """Every weight from ``folder`` (read with the family's adapter by ``load_hf``), each
        rank copying its own shards; a missing or misshaped weight raises."""
        from titan.ckpt.stateful import copy_whole_weights

        copy_whole_weights(self.engine.model_parts, load_hf(folder, self.engine.hf_adapter),
                           problem=lambda name, found, want: f"--gkd.teacher_model {folder}: {name} is "
                           f"{'missing' if found is None else f'shaped {found}'}, its config.json says {want}")

    def logits(self, engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``batch``'s logits by the teacher's engine: this rank's share of the sequence under
        CP (``[B, S / cp, V]``, which the student's engine passes through unsharded: its own
        split cuts only ``[B, S, ...]`` keys), whole over the vocabulary; with
        :attr:`vocab_shards` this rank's columns of vocab-sharded logits (loss parallel:
        ``[..., V / tp]``, for the vocab-parallel loss) instead of gathering them."""
        captured: list[torch.Tensor] = []

        def capture(logits: torch.Tensor, _batch: dict[str, torch.Tensor]) -> torch.Tensor:
            if isinstance(logits, DTensor):
                logits = logits.to_local() if self.vocab_shards else logits.full_tensor()
            captured.append(logits)
            return torch.zeros((), device=captured[-1].device)

        self.engine.forward_only(batch, capture)
        return captured[0]


__all__ = ["ShardedTeacher", "TEACHER_FLAVOR", "WholeTeacher", "keeps_vocab_shards"]
