"""Building a family's model from a named flavor: one function for every family."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

Model = TypeVar("Model")


def build_flavor(family: str, flavors: Mapping[str, Any], model: Callable[[Any], Model], flavor: str,
                 overrides: Mapping[str, object]) -> Model:
    """``model(args)`` for the ``flavor`` args of ``flavors`` (a family's dataclass table)
    with the fields ``overrides`` names replaced. Unknown flavors and fields are refused with
    the valid ones listed. Modules are created under the active device context."""
    if flavor not in flavors:
        raise ValueError(f"unknown {family} flavor {flavor!r}; choose one of: {', '.join(flavors)}")
    args = flavors[flavor]
    fields = {f.name for f in dataclasses.fields(args)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown {type(args).__name__} fields {unknown}; valid fields: {', '.join(sorted(fields))}")
    return model(dataclasses.replace(args, **overrides))


__all__ = ["build_flavor"]
