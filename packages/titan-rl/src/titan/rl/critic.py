"""PPO's critic: a value model trained beside the policy (``--rl.advantage_estimator gae``).

The critic is the policy's architecture with a one-column score head (``num_labels=1``, the
layout of a Hugging Face ``...ForSequenceClassification``, as verl's and OpenRLHF's critics
are): its output at the position before completion token ``t`` is ``V_t``, the return it
expects from that state (the position whose logits the policy samples token ``t`` from).
It starts from the weights RL starts from, the language-model head replaced by a freshly
initialized score head (verl's default), or from a reward model's Hugging Face folder
(``--rl.critic_model``; OpenRLHF starts its critic from the reward model).

Like the KL reference it is one single-device model copy, on rank 0, so the rollout's values
and the critic's updates do not depend on the trainer's layout: rank 0 scores every rollout's
completions (the values broadcast with it), and after the policy's update it regresses the
critic on the returns, ``--rl.ppo_epochs`` passes of ``--rl.minibatches_per_rollout``
AdamW steps (``--rl.critic_lr``, gradients clipped to ``--training.max_norm``), with PPO's
clipped value loss ``0.5 max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2)`` averaged over
the minibatch's tokens (``c``: ``--rl.value_clip``). Its weights, optimizer state and whether
it was initialized are checkpointed with the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from titan.rl.logprobs import pad_sequences
from titan.rl.reward_trainer import with_score_head
from torch import nn

HEAD_PREFIX = "output."
"""The decoder's head: a language model's LM head, the critic's score head."""


def _rows_in_chunks(count: int, size: int) -> Iterable[range]:
    """Row ranges of at most ``size`` rows covering ``count`` rows."""
    return (range(start, min(start + size, count)) for start in range(0, count, size))


class Critic:
    """A trainable single-device value model (module docstring). ``model``: a titan decoder
    with a one-column score head; ``batch_size``: rows per forward pass."""

    def __init__(self, model: nn.Module, *, lr: float, value_clip: float, max_norm: float, batch_size: int) -> None:
        if getattr(model, "num_labels", 0) != 1:
            raise ValueError("the critic needs a model with a one-column score head (num_labels=1)")
        if value_clip < 0 or lr <= 0 or batch_size < 1:
            raise ValueError(f"critic settings out of range: lr {lr}, value_clip {value_clip}, batch_size {batch_size}")
        self.model = model.eval()  # no dropout in titan's decoders; eval keeps MoE routing as in rescoring
        self.device = next(model.parameters()).device
        self.value_clip, self.max_norm, self.batch_size = value_clip, max_norm, batch_size
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self._init_optimizer_state()
        self.taken = False
        """Whether the weights are the run's (taken from the policy or a reward model), not placeholders."""

    @classmethod
    def from_model_spec(cls, model_spec: Any, flavor: str, *, overrides: Mapping[str, Any], device: torch.device,
                        seed: int = 0, **kwargs: Any) -> Critic:
        """A critic of ``model_spec``'s ``flavor`` (with the family's build ``overrides``) on
        ``device``, in float32, initialized with ``seed`` (placeholders until :meth:`take`)."""
        spec = with_score_head(model_spec, flavor)
        with torch.device("meta"):
            model = spec.build(flavor, **overrides)
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=device, seed=seed)
        return cls(model.float(), **kwargs)

    def _init_optimizer_state(self) -> None:
        """AdamW's state as its first step would create it (zero moments, step 0), made up
        front so a checkpoint of any step has the same entries to load into."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                self.optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                           "exp_avg_sq": torch.zeros_like(p)}

    # ---- weights --------------------------------------------------------------------------

    @torch.no_grad()
    def take(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Start from the policy's ``weights`` (named full tensors): every entry but the head,
        which keeps its fresh initialization. A missing body weight raises."""
        live = self.model.state_dict()
        body = {name for name in live if not name.startswith(HEAD_PREFIX)}
        for name, tensor in weights:
            if name in body:
                live[name].copy_(tensor.to(device=live[name].device, dtype=live[name].dtype))
                body.discard(name)
        if body:
            raise ValueError(f"the critic could not start from the policy: no weights for {sorted(body)[:4]}")
        self.taken = True

    def load_reward_model(self, folder: str, adapter: Any, load_hf: Any) -> None:
        """Start from a reward model's Hugging Face folder (``score.weight`` included), read
        with the family's ``adapter`` by ``load_hf`` (``titan.ckpt.hf.load_hf``)."""
        state = load_hf(folder, adapter)
        missing = set(self.model.state_dict()) - set(state)
        if missing:
            raise ValueError(f"--rl.critic_model {folder} lacks {sorted(missing)[:4]}: give a reward model "
                             "(a ...ForSequenceClassification folder with one label) of the policy's architecture")
        live = self.model.state_dict()
        wrong = [f"{name} {tuple(state[name].shape)} (the critic's {tuple(t.shape)})" for name, t in live.items()
                 if tuple(state[name].shape) != tuple(t.shape)]
        if wrong:
            raise ValueError(f"--rl.critic_model {folder} is not shaped like the policy with one score column: "
                             f"{', '.join(wrong[:3])}")
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(state[name].to(device=tensor.device, dtype=tensor.dtype))
        self.taken = True

    # ---- values and updates ---------------------------------------------------------------

    def _forward(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[torch.Tensor]:
        """Per completion, the model's value at each position that predicts a completion token."""
        input_ids, _, mask = pad_sequences(list(prompts), list(completions))
        values = self.model(input_ids.to(self.device))[..., 0].float()
        mask = mask.to(self.device)
        return [values[row][mask[row]] for row in range(len(prompts))]

    @torch.no_grad()
    def values(self, prompts: Sequence[list[int]], completions: Sequence[list[int]]) -> list[list[float]]:
        """The value of each completion token's state, per (prompt, completion) pair, in
        batches of ``batch_size`` rows."""
        out: list[list[float]] = []
        for rows in _rows_in_chunks(len(prompts), self.batch_size):
            out += [v.double().tolist() for v in self._forward([prompts[i] for i in rows],
                                                                [completions[i] for i in rows])]
        return out

    def value_loss(self, predicted: torch.Tensor, old: torch.Tensor, returns: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
        """PPO's clipped value loss summed over the tokens (``0.5 max(unclipped, clipped)``)
        and how many tokens the clipped term won."""
        clipped = old + (predicted - old).clamp(-self.value_clip, self.value_clip)
        unclipped_loss, clipped_loss = (predicted - returns) ** 2, (clipped - returns) ** 2
        return 0.5 * torch.maximum(unclipped_loss, clipped_loss).sum(), (clipped_loss > unclipped_loss).sum()

    def update(self, prompts: Sequence[list[int]], completions: Sequence[list[int]], old_values: Sequence[list[float]],
               returns: Sequence[list[float]], *, epochs: int = 1, minibatches: int = 1) -> dict[str, float]:
        """Regress the values on ``returns`` (module docstring): ``epochs`` passes over the
        rows, each in ``minibatches`` contiguous minibatches of one optimizer step. Returns
        the token means of the loss and clip fraction over every pass, the mean gradient norm,
        and the explained variance of the returns by the old values."""
        count = len(prompts)
        if not count:
            return {}
        old = [torch.tensor(v, dtype=torch.float32, device=self.device) for v in old_values]
        targets = [torch.tensor(r, dtype=torch.float32, device=self.device) for r in returns]
        size = -(-count // max(1, min(minibatches, count)))
        loss_sum = clipped_sum = tokens_seen = 0.0
        norms = []
        for _ in range(epochs):
            for minibatch in _rows_in_chunks(count, size):
                tokens = sum(len(completions[i]) for i in minibatch)
                if not tokens:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                for rows in _rows_in_chunks(len(minibatch), self.batch_size):
                    index = [minibatch[k] for k in rows]
                    predicted = torch.cat(self._forward([prompts[i] for i in index], [completions[i] for i in index]))
                    loss, clipped = self.value_loss(predicted, torch.cat([old[i] for i in index]),
                                                    torch.cat([targets[i] for i in index]))
                    (loss / tokens).backward()
                    loss_sum, clipped_sum = loss_sum + float(loss.detach()), clipped_sum + float(clipped)
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm if self.max_norm > 0
                                                      else float("inf"))
                norms.append(float(norm))
                self.optimizer.step()
                tokens_seen += tokens
        flat_old, flat_returns = torch.cat(old).double(), torch.cat(targets).double()
        variance = flat_returns.var(unbiased=False)
        explained = 1.0 - float((flat_returns - flat_old).var(unbiased=False) / variance) if variance > 0 else 0.0
        return {"value_loss": loss_sum / max(tokens_seen, 1), "value_clipfrac": clipped_sum / max(tokens_seen, 1),
                "value_grad_norm": sum(norms) / max(len(norms), 1), "values_mean": float(flat_old.mean()),
                "returns_mean": float(flat_returns.mean()), "value_explained_var": explained}

    # ---- checkpoint -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The live tensors: ``taken``, the weights, and AdamW's step and moments by
        parameter name (DCP loads into them in place)."""
        names = {p: name for name, p in self.model.named_parameters()}
        optimizer = {key: {names[p]: state[key] for p, state in self.optimizer.state.items()}
                     for key in ("step", "exp_avg", "exp_avg_sq")}
        return {"taken": torch.tensor(int(self.taken)), "weights": self.model.state_dict(), "optimizer": optimizer}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` (copied again for a loader that does not load in place)."""
        self.taken = bool(int(state["taken"]))
        live = self.state_dict()
        with torch.no_grad():
            for name, tensor in state["weights"].items():
                if live["weights"][name] is not tensor:
                    live["weights"][name].copy_(tensor)
            for key, tensors in state["optimizer"].items():
                for name, tensor in tensors.items():
                    if live["optimizer"][key][name] is not tensor:
                        live["optimizer"][key][name].copy_(tensor)


class CriticState:
    """The critic as a checkpointed state of the run: rank 0 holds it, the other ranks save
    and load nothing."""

    def __init__(self, critic: Critic | None) -> None:
        self.critic = critic

    def state_dict(self) -> dict[str, Any]:
        """The critic's entries on rank 0, empty elsewhere."""
        return {} if self.critic is None else self.critic.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the critic on rank 0."""
        if self.critic is not None:
            self.critic.load_state_dict(state)


__all__ = ["Critic", "CriticState"]
