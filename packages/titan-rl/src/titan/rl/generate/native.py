"""The native generator: the trainer's own `titan.models` modules, run with a KV cache.

Prompts of a batch are left-padded to one length and prefilled in one forward (each prompt
once, its cache then copied for the `n` completions of its group); decoding then runs one
token per forward for the whole batch. Sampling applies temperature, then top-k and top-p, and
draws from a seeded `torch.Generator`, so a fixed seed reproduces the same completions for the
same prompts and batch size.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from titan.models.common.kv_cache import KVCache
from titan.rl.generate.base import Completion, SamplingConfig, check_prompts, copy_weights_by_name
from titan.rl.logprobs import pad_sequences, token_logprobs
from torch import nn


class NativeGenerator:
    """Generate with a single-device `titan.models` decoder (the modules the trainer trains).

    `model` must accept `kv_cache=` (every titan decoder does) and expose `args` (with
    `n_kv_heads`, `head_dim`, `max_seq_len`) and `layers`. It is moved to `device` and `dtype`
    and put in eval mode; weights arrive through `load_weights` (see `titan.rl.weight_sync`).
    `max_batch_size` bounds the rows (completions) decoded together; a batch always holds whole
    groups, so a group larger than it is decoded alone. `eos_token_id` always ends a completion.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 64,
        eos_token_id: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = dtype
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.max_batch_size = max_batch_size
        self.eos_token_id = eos_token_id
        self._version = 0

    @classmethod
    def from_model_spec(
        cls,
        model_spec: Any,
        flavor: str,
        *,
        seed: int = 0,
        overrides: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> NativeGenerator:
        """Build the generator's own model from a `ModelSpec` (as the trainer does: on the meta
        device, then materialized and initialized with `seed`); `overrides` are the family's
        build overrides (e.g. `vocab_size`, `max_seq_len`); other keyword arguments go to
        `NativeGenerator`. The weights are placeholders until the first weight sync."""
        with torch.device("meta"):
            model = model_spec.build(flavor, **(overrides or {}))
        device = torch.device(kwargs.get("device") or "cpu")
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device, seed=seed)
        return cls(model, **kwargs)

    # ---- weights ------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded (0 before the first sync)."""
        return self._version

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Copy full tensors into the model by titan name (cast to the generator's dtype and
        device) and set the policy version. Every entry of the model's ``state_dict`` must be
        given — parameters and persistent buffers such as an MoE router's ``expert_bias``
        (a tied alias counts as given with its twin); unknown names and shape mismatches
        raise, so a renamed or missing weight cannot go unnoticed."""
        copy_weights_by_name(self.model.state_dict(keep_vars=True), named_tensors)
        self._version = version

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The model's weights by titan name, tied names included (for checks after a sync)."""
        return self.model.state_dict().items()

    # ---- generation ---------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Completion]]:
        """`sampling.n` completions per prompt (prompt order), with per-token logprobs
        log_softmax(logits / T) of the sampled tokens (T = 1 when greedy)."""
        check_prompts(prompts, sampling, self.model.args.max_seq_len)
        seed = sampling.seed if sampling.seed is not None else random.randrange(2**63)
        rng = torch.Generator(device=self.device).manual_seed(seed)
        per_batch = max(1, self.max_batch_size // sampling.n)
        results: list[list[Completion]] = []
        for start in range(0, len(prompts), per_batch):
            chunk = prompts[start : start + per_batch]
            flat = self._generate_batch(chunk, sampling, rng)
            results.extend(flat[i * sampling.n : (i + 1) * sampling.n] for i in range(len(chunk)))
        return results

    def _generate_batch(
        self, prompts: list[list[int]], sampling: SamplingConfig, rng: torch.Generator
    ) -> list[Completion]:
        """Prefill `prompts` once, decode `n` completions of each, one token per forward."""
        n, max_new = sampling.n, sampling.max_new_tokens
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            valid[row, width - len(prompt) :] = True
        cache = KVCache.for_model(self.model, batch_size=len(prompts), max_len=width + max_new)
        cache.mark_valid(valid.to(self.device))
        logits = self.model(ids.to(self.device), kv_cache=cache)[:, -1].float()
        if n > 1:
            cache = cache.repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
        rows = logits.shape[0]
        stop_ids = set(sampling.stop_token_ids)
        if self.eos_token_id is not None:
            stop_ids.add(self.eos_token_id)
        stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=self.device)
        tokens = torch.zeros(rows, max_new, dtype=torch.long, device=self.device)
        logps = torch.zeros(rows, max_new, dtype=torch.float32, device=self.device)
        lengths = torch.full((rows,), max_new, dtype=torch.long, device=self.device)
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        seen = None  # [rows, V]: the tokens of each row's prompt and completion so far
        if sampling.repetition_penalty != 1.0:
            seen = torch.zeros(len(prompts), logits.shape[-1], dtype=torch.bool, device=self.device)
            seen[valid.nonzero(as_tuple=True)[0].to(self.device), ids[valid].to(self.device)] = True
            seen = seen.repeat_interleave(n, dim=0)
        for step in range(max_new):
            token, logp = sample_next(logits, sampling, rng, seen=seen)
            tokens[:, step], logps[:, step] = token, logp
            if seen is not None:
                seen[torch.arange(rows, device=self.device), token] = True
            hit = torch.isin(token, stop) & ~done
            lengths[hit] = step + 1
            done |= hit
            if step == max_new - 1 or bool(done.all()):
                break
            logits = self.model(token[:, None], kv_cache=cache)[:, -1].float()
        return self._completions(prompts, n, tokens.cpu(), logps.cpu(), lengths.cpu(), done.cpu())

    def _completions(self, prompts, n, tokens, logps, lengths, stopped) -> list[Completion]:
        """Cut each row at its length into a `Completion`."""
        out = []
        for row in range(tokens.shape[0]):
            length = int(lengths[row])
            out.append(
                Completion(
                    prompt_ids=list(prompts[row // n]),
                    token_ids=tokens[row, :length].tolist(),
                    logprobs=logps[row, :length].tolist(),
                    finish_reason="stop" if bool(stopped[row]) else "length",
                    version=self._version,
                )
            )
        return out

    # ---- rescoring ----------------------------------------------------------------------

    @torch.no_grad()
    def rescore(
        self,
        sequences: Sequence[Completion] | Sequence[tuple[list[int], list[int]]],
        *,
        temperature: float = 1.0,
    ) -> list[list[float]]:
        """Log-probs of each completion's tokens from a full forward without a cache (the
        trainer's computation: right-padded rows, `token_logprobs`), in chunks of
        `max_batch_size` rows. Accepts `Completion`s or (prompt_ids, token_ids) pairs."""
        pairs = [(s.prompt_ids, s.token_ids) if isinstance(s, Completion) else s for s in sequences]
        out: list[list[float]] = []
        for start in range(0, len(pairs), self.max_batch_size):
            chunk = pairs[start : start + self.max_batch_size]
            prompts = [list(p) for p, _ in chunk]
            completions = [list(c) for _, c in chunk]
            input_ids, targets, _ = pad_sequences(prompts, completions)
            logits = self.model(input_ids.to(self.device))
            logp = token_logprobs(logits, targets.to(self.device), temperature).cpu()
            for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
                first = len(prompt) - 1
                out.append(logp[row, first : first + len(completion)].tolist())
        return out


def sample_next(
    logits: torch.Tensor, sampling: SamplingConfig, rng: torch.Generator, *, seen: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from float32 `logits` [B, V]; returns (tokens [B], logprobs [B])
    with logprob = log_softmax(logits / T)[token] (T = 1 when greedy; the repetition penalty
    over the `seen` tokens [B, V] and top-k/top-p/min-p filtering are not folded into the
    reported logprob)."""
    drawn_from = penalize_repetitions(logits, seen, sampling.repetition_penalty)
    if sampling.temperature == 0:
        token = drawn_from.argmax(dim=-1)
        return token, token_logprobs(logits, token)
    logp = torch.log_softmax(logits / sampling.temperature, dim=-1)
    filtered = filter_top_k_top_p(drawn_from / sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    probs = torch.softmax(filtered, dim=-1)
    token = torch.multinomial(probs, 1, generator=rng).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def penalize_repetitions(logits: torch.Tensor, seen: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """`logits` with those of the `seen` tokens made less likely by `penalty` (positive ones
    divided, negative ones multiplied), as transformers' and vLLM's repetition penalty."""
    if seen is None or penalty == 1.0:
        return logits
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Set to -inf the logits outside the top `top_k` (0 = all), outside the smallest set
    whose probability reaches `top_p` (1.0 = all) and below `min_p` times the most likely
    token's probability (0 = none); the most likely token always stays."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed
        floor = logits.max(dim=-1, keepdim=True).values + math.log(min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


__all__ = ["NativeGenerator", "filter_top_k_top_p", "penalize_repetitions", "sample_next"]
