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
from typing import Any

# torchtitan's top-level states besides the model's flattened weights.
TRAINING_STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
# Saved by earlier torchtitan releases as a persistent buffer: the RoPE table, which titan
# computes from the run's own RoPE settings.
DERIVED_ENTRIES = ("freqs_cis",)
# The balancing bias is saved only when torchtitan's run used one; without it routing had
# none, which is what a zero bias computes.
_ZERO_WHEN_ABSENT = re.compile(r"\.feed_forward\.expert_bias$")

# torchtitan's names -> titan's, applied in order to one saved key.
_RENAMES = (
    (re.compile(r"^lm_head\.weight$"), "output.weight"),
    (re.compile(r"^(layers\.\d+)\.attention\.qkv_linear\.(w[qkv])\.weight$"), r"\1.attention.\2.weight"),
    (re.compile(r"^(layers\.\d+)\.moe\.routed_experts\.inner_experts\.(w[123])_E[DF]{2}$"),
     r"\1.feed_forward.experts.\2"),
    (re.compile(r"^(layers\.\d+)\.moe\.expert_bias(_E)?$"), r"\1.feed_forward.expert_bias"),
    (re.compile(r"^(layers\.\d+)\.moe\.((experts|router|shared_experts)\..*)$"), r"\1.feed_forward.\2"),
)


def titan_name(key: str) -> str:
    """titan's name for the weight torchtitan saved as `key` (unchanged where both agree)."""
    for pattern, replacement in _RENAMES:
        key = pattern.sub(replacement, key)
    return key


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


def model_entries(saved_keys: Iterable[str]) -> list[str]:
    """The checkpoint's model weights: its entries outside torchtitan's training states and
    its derived ones."""
    return [k for k in saved_keys if _state_of(k) is None and k not in DERIVED_ENTRIES]


def match_model_entries(
    wanted: Iterable[str], saved_keys: Iterable[str]
) -> tuple[dict[str, str], list[str], list[str]]:
    """Pair titan's model entries `wanted` with a torchtitan checkpoint's `saved_keys`.

    Returns ``(names, missing, unused)``: ``names`` maps each titan entry found to its saved
    name; ``missing`` lists the titan entries with none (zero-when-absent ones excluded: they
    keep their initial zeros); ``unused`` lists the checkpoint's weights nothing reads (other
    than a tied output's second name), which would otherwise be dropped in silence.
    """
    wanted = list(wanted)
    by_titan_name = {titan_name(k): k for k in model_entries(saved_keys)}
    names = {fqn: by_titan_name[fqn] for fqn in wanted if fqn in by_titan_name}
    missing = sorted(f for f in wanted if f not in names and not zero_when_absent(f))
    # A tied model has one matrix: titan names it once, torchtitan saved both names.
    tied = "tok_embeddings.weight" in names and "output.weight" not in wanted
    unused = sorted(
        saved for name, saved in by_titan_name.items()
        if name not in names and not (tied and name == "output.weight")
    )
    return names, missing, unused


def relayout_keys(adapter: Any, keys: Iterable[str]) -> list[str]:
    """The entries of `keys` (titan names) a torchtitan checkpoint holds in another layout than
    titan's, as the family `adapter` says (``torchtitan_layout_keys``; its ``from_torchtitan``
    converts them); none for an adapter without the method, or no adapter."""
    ask = getattr(adapter, "torchtitan_layout_keys", None)
    return sorted(ask(list(keys))) if ask is not None else []


def zero_when_absent(fqn: str) -> bool:
    """Whether titan's entry `fqn` may be missing from a torchtitan checkpoint (it then keeps
    its initial zeros)."""
    return bool(_ZERO_WHEN_ABSENT.search(fqn))


__all__ = ["TRAINING_STATES", "is_torchtitan_layout", "match_model_entries", "model_entries", "relayout_keys",
           "titan_name", "zero_when_absent"]
