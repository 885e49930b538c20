"""The generator interface every rollout backend implements (native torch, vLLM).

A generator turns prompts (token ids) into ``n`` completions each, with the log-probability of
every generated token, and accepts new policy weights by name with a version number.

Log-probability convention: ``Completion.logprobs[i]`` is ``log_softmax(logits / T)`` of the
sampled token, with ``T`` the sampling temperature (``T = 1`` when ``temperature == 0``, i.e.
greedy decoding reports the model's plain log-probabilities). top-k / top-p / min-p filtering
and the repetition penalty are *not* folded in: the logprob is under the temperature-scaled full distribution, which is what the
trainer recomputes with its own forward, so the two are comparable token for token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

FinishReason = Literal["stop", "length"]


@dataclass(kw_only=True)
class SamplingConfig:
    """How completions are sampled (``--sampling.*``)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to at least
    this (1.0 keeps all)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 keeps all)."""
    min_p: float = 0.0
    """Keep only the tokens at least this many times as likely as the most likely one (0
    keeps all), as transformers' and vLLM's min_p."""
    repetition_penalty: float = 1.0
    """Make the tokens already in the prompt or the completion less likely before sampling:
    a positive logit divided by it, a negative one multiplied (transformers' and vLLM's
    repetition_penalty; 1.0 off)."""
    max_new_tokens: int = 128
    """Most tokens generated per completion; a completion that reaches it ends with
    finish_reason "length"."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (finish_reason "stop"); the stop token is kept as the
    last generated token. The generator's eos token is always a stop token."""
    n: int = 1
    """Completions per prompt (the GRPO group size)."""
    seed: int | None = 0
    """Seed of the sampling random generator, so a fixed seed reproduces the same completions
    (None draws a fresh seed)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(
                f"--sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--sampling.top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable")
        if self.top_k < 0:
            raise ValueError(f"--sampling.top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"--sampling.min_p must be in [0, 1], got {self.min_p}; use 0 to disable")
        if self.repetition_penalty <= 0:
            raise ValueError(f"--sampling.repetition_penalty must be > 0 (1.0 disables), got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.n < 1:
            raise ValueError(f"--sampling.n must be >= 1, got {self.n}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass(kw_only=True)
class Completion:
    """One generated completion of one prompt."""

    prompt_ids: list[int]
    """The prompt's token ids, as given."""
    token_ids: list[int]
    """The generated token ids (the stop token included when finish_reason is "stop")."""
    logprobs: list[float]
    """Per generated token: log_softmax(logits / T)[token] under the temperature actually used
    (T = 1 for greedy); top-k/top-p are not folded in. Same length as token_ids."""
    finish_reason: FinishReason
    """"stop" when a stop/eos token was generated, "length" when max_new_tokens was reached."""
    version: int = 0
    """Policy version of the weights that generated this completion."""


@runtime_checkable
class Generator(Protocol):
    """A rollout backend: generates completions and accepts new policy weights."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Return ``sampling.n`` completions for each prompt, in prompt order."""
        ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Copy full (unsharded) tensors into the generator's model by titan name and set the
        policy version."""
        ...

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...


def check_prompts(prompts: list[list[int]], sampling: SamplingConfig, max_seq_len: int) -> None:
    """Reject empty prompts and ones that would outgrow the model's `max_seq_len` (its RoPE
    table) once `sampling.max_new_tokens` are added."""
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if len(prompt) + sampling.max_new_tokens > max_seq_len:
            raise ValueError(
                f"prompt {i} ({len(prompt)} tokens) + --sampling.max_new_tokens "
                f"({sampling.max_new_tokens}) exceeds the model's max_seq_len ({max_seq_len}); "
                "shorten the prompt or lower --sampling.max_new_tokens"
            )


@torch.no_grad()
def copy_weights_by_name(
    targets: Mapping[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Copy full tensors by titan name into `targets` (a model's ``state_dict(keep_vars=True)``),
    each cast to its target's dtype and device.

    Every entry of `targets` must be given — parameters and persistent buffers
    such as an MoE router's ``expert_bias`` (a tied alias counts as given with its twin);
    unknown names and shape mismatches raise, so a renamed or missing weight cannot go
    unnoticed. Tensors are copied as they stream in (no second full copy is held), so a refused
    update has changed some weights: callers advance the policy version only after it returns.
    """
    loaded: set[int] = set()
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            raise KeyError(f"weight {name!r} is not a parameter of the generator's model")
        if target.shape != tensor.shape:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the generator's model "
                f"expects {tuple(target.shape)}"
            )
        _copy_whole_into(target, tensor)
        loaded.add(id(target))
    missing = [name for name, t in targets.items() if id(t) not in loaded]
    if missing:
        raise ValueError(f"weight sync left {len(missing)} state_dict entries unset: {missing[:5]}")


def is_collective(generator: Any) -> bool:
    """Whether ``generator``'s calls are collective over ranks sharing it (a vLLM engine under
    tensor parallel): each of them must call it alike, with no prompts where it has none."""
    return bool(getattr(generator, "collective", False))


def take_part(generator: Any, sampling: SamplingConfig) -> None:
    """Join a collective ``generator``'s call with no prompts (this rank has none to generate
    while the ranks sharing it do); nothing for a generator of this rank's own."""
    if is_collective(generator):
        generator.generate([], sampling)


def _copy_whole_into(target: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy the whole ``tensor`` into ``target``; a DTensor target (a tensor-parallel model)
    takes only its own shard, cut on this rank without communication."""
    if isinstance(target, DTensor):
        shard = distribute_tensor(tensor.to(device=target.device, dtype=target.dtype), target.device_mesh,
                                  target.placements, src_data_rank=None)
        target.data.to_local().copy_(shard.to_local())
    else:
        target.data.copy_(tensor)


__all__ = ["Completion", "FinishReason", "Generator", "SamplingConfig", "check_prompts", "copy_weights_by_name",
           "is_collective", "take_part"]
