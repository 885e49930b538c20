"""Reading a model's declarative sharding plan (duck-typed; titan.dist never imports a model)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator

import torch.nn as nn


def sharding_plan(model: nn.Module):
    """The model's `ShardingPlan`, or None when the model does not declare one."""
    get = getattr(model, "sharding_plan", None)
    return get() if callable(get) else None


def layer_container_name(model: nn.Module) -> str:
    """Name of the ModuleDict of blocks ("layers" unless the plan says otherwise)."""
    plan = sharding_plan(model)
    return getattr(plan, "layer_container", "layers") if plan is not None else "layers"


def blocks_of(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(key, block) for each block left in the layer container (PP may have removed some)."""
    container = getattr(model, layer_container_name(model), None)
    if container is None:
        return iter(())
    return iter(list(container.items()))


def match_modules(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Submodules whose fully-qualified name matches the glob `pattern` ("*" = one name part).

    A "*" never crosses a "." so `layers.*.attention` does not match deeper modules.
    """
    return [(name, module) for name, module in model.named_modules() if name and glob_matches(pattern, name)]


def glob_matches(pattern: str, fqn: str) -> bool:
    """Whether module name `fqn` matches the plan glob `pattern` ("*" = exactly one name part)."""
    parts, names = pattern.split("."), fqn.split(".")
    return len(parts) == len(names) and all(map(fnmatch.fnmatchcase, names, parts))


def tied_parameter_groups(model: nn.Module) -> tuple[tuple[str, ...], ...]:
    """The plan's `tied_parameters`: groups of full-model parameter names that are one
    shared Parameter (empty when the model declares no plan or no ties)."""
    plan = sharding_plan(model)
    return tuple(tuple(group) for group in getattr(plan, "tied_parameters", ()) or ())
