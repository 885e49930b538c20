"""Reading the weights of a checkpoint torchtitan wrote.

torchtitan saves one DCP folder per step, ``<folder>/step-<N>``, whose model entries sit at
the top level under the model's own names (``tok_embeddings.weight``, ...) next to its other
states (``optimizer``, ``lr_scheduler``, ``dataloader``, ``train_state``); titan's steps keep
the weights under ``model.``. titan's model families use torchtitan's module names, except
where torchtitan renamed its own over its releases. Both generations are read:

============================================  ===================================================
titan                                         torchtitan (earlier releases; 0.3)
============================================  ===================================================
``output.weight``                             ``output.weight``; ``lm_head.weight``
``layers.<i>.attention.wq.weight`` (wk, wv)   the same; ``layers.<i>.attention.qkv_linear.wq.weight``
``layers.<i>.feed_forward.router.*``          ``layers.<i>.moe.router.*``
``layers.<i>.feed_forward.shared_experts.*``  ``layers.<i>.moe.shared_experts.*``
``layers.<i>.feed_forward.experts.w1``        ``layers.<i>.moe.experts.w1``;
                                              ``...moe.routed_experts.inner_experts.w1_EFD``
``layers.<i>.feed_forward.experts.w2`` / w3   the same, ``w2_EDF`` / ``w3_EFD``
``layers.<i>.feed_forward.expert_bias``       ``layers.<i>.moe.expert_bias``; ``...moe.expert_bias_E``
============================================  ===================================================

The grouped experts are stored ``[experts, out, in]`` by both, so no tensor is transposed.
Only the weights are read: torchtitan's optimizer keys follow its own parameters (0.3 fuses
``wq``, ``wk`` and ``wv`` into one), so the optimizer and counters start fresh.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# torchtitan's top-level states besides the model's flattened weights.
TRAINING_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
# Saved by earlier torchtitan releases as a persistent buffer: the RoPE table, which titan
# computes from the run's own RoPE settings.
DERIVED_ENTRIES = ("freqs_cis",)
# The balancing bias is saved only when torchtitan's run used one; without it routing had
# none, which is what a zero bias computes.
ZERO_WHEN_ABSENT = re.compile(r"\.feed_forward\.expert_bias$")

_EXPERT_SUFFIX = {"w1": "w1_EFD", "w2": "w2_EDF", "w3": "w3_EFD"}
_LAYER = r"^(layers\.\d+)\."


def _candidate_names(fqn: str) -> list[str]:
    """The names torchtitan may have saved titan's entry `fqn` under, most recent release last."""
    if fqn == "output.weight":
        return [fqn, "lm_head.weight"]
    match = re.match(_LAYER + r"attention\.(w[qkv])\.weight$", fqn)
    if match:
        return [fqn, f"{match[1]}.attention.qkv_linear.{match[2]}.weight"]
    match = re.match(_LAYER + r"feed_forward\.experts\.(w[123])$", fqn)
    if match:
        layer, name = match[1], match[2]
        return [f"{layer}.moe.experts.{name}",
                f"{layer}.moe.routed_experts.inner_experts.{_EXPERT_SUFFIX[name]}"]
    match = re.match(_LAYER + r"feed_forward\.expert_bias$", fqn)
    if match:
        return [f"{match[1]}.moe.expert_bias", f"{match[1]}.moe.expert_bias_E"]
    match = re.match(_LAYER + r"feed_forward\.((router|shared_experts)\..*)$", fqn)
    if match:
        return [f"{match[1]}.moe.{match[2]}"]
    return [fqn]


def is_torchtitan_layout(saved_keys: Iterable[str]) -> bool:
    """Whether a DCP checkpoint's entries are laid out as torchtitan saves them: no ``model.``
    state (titan's), and entries other than torchtitan's training states (the weights)."""
    keys = list(saved_keys)
    if any(k.startswith("model.") for k in keys):
        return False
    return any(_state_of(k) is None for k in keys)


def _state_of(key: str) -> str | None:
    """The torchtitan training state `key` belongs to, or None for a model entry."""
    head = key.split(".", 1)[0]
    return head if head in TRAINING_STATES else None


def match_model_entries(
    wanted: Iterable[str], saved_keys: Iterable[str]
) -> tuple[dict[str, str], list[str], list[str]]:
    """Pair titan's model entries `wanted` with a torchtitan checkpoint's `saved_keys`.

    Returns ``(names, missing, unused)``: ``names`` maps each titan entry found to its saved
    name; ``missing`` lists the titan entries with none (zero-when-absent ones excluded: they
    keep their initial zeros); ``unused`` lists the checkpoint's weights nothing reads (other
    than derived entries and a tied output's second name), which would be silently dropped.
    """
    saved = [k for k in saved_keys if _state_of(k) is None]
    present = set(saved)
    names: dict[str, str] = {}
    missing: list[str] = []
    for fqn in wanted:
        found = next((name for name in _candidate_names(fqn) if name in present), None)
        if found is not None:
            names[fqn] = found
        elif not ZERO_WHEN_ABSENT.search(fqn):
            missing.append(fqn)
    used = set(names.values())
    tied = "tok_embeddings.weight" in used and "output.weight" not in names
    unused = [
        k for k in sorted(present - used)
        if k not in DERIVED_ENTRIES and not (tied and k in ("output.weight", "lm_head.weight"))
    ]
    return names, sorted(missing), unused


def zero_when_absent(fqn: str) -> bool:
    """Whether titan's entry `fqn` may be missing from a torchtitan checkpoint (it then keeps
    its initial zeros)."""
    return bool(ZERO_WHEN_ABSENT.search(fqn))


__all__ = ["TRAINING_STATES", "is_torchtitan_layout", "match_model_entries", "zero_when_absent"]
