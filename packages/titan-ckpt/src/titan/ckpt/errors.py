"""Errors a user can cause with a checkpoint, and the checks that raise them early."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["CheckpointError", "flatten_state", "check_state_matches"]

_SHOWN = 5  # how many offending keys a message lists before "... and N more"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked; the message says why and how to fix it."""


def flatten_state(prefix: str, value: Any) -> dict[str, Any]:
    """`{dotted key: leaf}` of a nested state, keyed the way DCP keys its entries: mappings are
    walked, lists only when they hold tensors or mappings, anything else is one leaf."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(flatten_state(f"{prefix}.{key}" if prefix else str(key), sub))
        return out
    if isinstance(value, list) and not _is_leaf_list(value):
        out = {}
        for i, sub in enumerate(value):
            out.update(flatten_state(f"{prefix}.{i}" if prefix else str(i), sub))
        return out
    return {prefix: value}


def _is_leaf_list(value: list) -> bool:
    """DCP stores a list as one entry unless it holds tensors or mappings (at any depth)."""
    for entry in value:
        if isinstance(entry, torch.Tensor | Mapping):
            return False
        if isinstance(entry, list) and not _is_leaf_list(entry):
            return False
    return True


def check_state_matches(
    name: str, expected: dict[str, Any], saved: Mapping[str, Any], where: str
) -> None:
    """Raise when an entry the run needs is missing from a checkpoint, or a tensor has another
    shape there.

    `saved` maps keys to tensors or to DCP storage metadata (tensor entries carry `.size`).
    """
    # Shapes first: "'x' is [320, 64] there but [320, 256] here" names the mismatch best.
    for key in sorted(expected):
        if key not in saved or not isinstance(expected[key], torch.Tensor):
            continue
        want = tuple(expected[key].shape)
        have = _shape(saved[key])
        if have is not None and have != want:
            raise CheckpointError(
                f"{where}: '{key}' has shape {list(have)} in the checkpoint but {list(want)} in "
                "this run. The checkpoint is probably from another model family or size "
                "(compare the model family and flavor with the run that wrote it)."
            )
    missing = sorted(k for k in expected if k not in saved)
    if missing:
        fix = (
            "Load a checkpoint of the same model family and size (--model.name, --model.flavor)."
            if name == "model" else
            f"Load the matching checkpoint, or skip this state with "
            f"--checkpoint.exclude_from_loading {name}."
        )
        raise CheckpointError(
            f"{where} has no {_list(missing)} for state '{name}' "
            f"({len(missing)} of {len(expected)} entries missing). Was it written by another "
            f"model family or size, or with another optimizer? {fix}"
        )


def _shape(entry: Any) -> tuple[int, ...] | None:
    """Global shape of a saved entry, or None for a non-tensor entry."""
    size = getattr(entry, "size", None)
    if isinstance(entry, torch.Tensor):
        return tuple(entry.shape)
    if isinstance(size, tuple):
        return tuple(size)
    return None


def _list(keys: list[str]) -> str:
    shown = ", ".join(f"'{k}'" for k in keys[:_SHOWN])
    more = len(keys) - _SHOWN
    return shown + (f" ... and {more} more" if more > 0 else "")
