"""`Stateful` helpers the trainer hands to `CheckpointManager`.

They are generic over modules and optimizers: nothing here knows a model family. Model and
optimizer states use fully qualified parameter names (FQNs) and plain/DTensor values, so a
checkpoint written under one parallel layout (FSDP, TP, PP) loads under another.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, distribute_tensor

logger = logging.getLogger("titan")

__all__ = ["ModelWrapper", "OptimizerWrapper", "RNGState", "RankLocal", "TrainState", "copy_whole_weights", "plain_tensor",
           "shard_like"]


def shard_like(full: torch.Tensor, template: Any) -> Any:
    """``full`` (a whole tensor every rank holds) in the dtype, device and sharding of
    ``template`` (a tensor or DTensor): each rank slices its own shard, nothing is
    communicated."""
    if isinstance(template, DTensor):
        full = full.to(device=template.device, dtype=template.dtype)
        # src_data_rank=None: every rank already holds the full tensor, so slice locally
        # instead of broadcasting from rank 0.
        return distribute_tensor(full, template.device_mesh, template.placements, src_data_rank=None)
    return full.to(device=template.device, dtype=template.dtype)


@torch.no_grad()
def copy_whole_weights(parts: nn.Module | Sequence[nn.Module], whole: Mapping[str, torch.Tensor], *,
                       problem: Callable[[str, tuple[int, ...] | None, tuple[int, ...]], str]) -> None:
    """Copy ``whole`` tensors (every rank holds them, e.g. read from a Hugging Face folder) by
    name into every state-dict entry of ``parts``, each rank slicing its own shard
    (:func:`shard_like`); nothing is communicated. A missing or differently shaped tensor
    raises ValueError with ``problem(name, its shape or None, the model's shape)``."""
    for part in _as_list(parts):
        for name, tensor in part.state_dict().items():
            full = whole.get(name)
            if full is None or tuple(full.shape) != tuple(tensor.shape):
                raise ValueError(problem(name, None if full is None else tuple(full.shape), tuple(tensor.shape)))
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            shard = shard_like(full, tensor)
            local.copy_(shard.to_local() if isinstance(shard, DTensor) else shard)


def plain_tensor(value: Any) -> Any:
    """``value`` without a tensor subclass that only wraps one plain tensor of its own shape
    and dtype (e.g. torchao's float8 all-gather weights), as a DTensor when it was one; any
    other value unchanged.

    A checkpoint must hold plain tensors: DCP writes a subclass's local tensor with its class
    pickled, which a ``weights_only`` load refuses and which could not load without the
    library that defined it. The plain tensor shares the wrapper's storage, so DCP's in-place
    load still writes into the model.
    """
    if isinstance(value, DTensor):
        local = value._local_tensor
        inner = _wrapped_tensor(local)
        if inner is local:
            return value
        return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    return _wrapped_tensor(value) if isinstance(value, torch.Tensor) else value


def _wrapped_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The first inner tensor of a traceable wrapper subclass when it stands for the whole
    wrapper (same shape and dtype); ``tensor`` itself otherwise."""
    flatten = getattr(type(tensor), "__tensor_flatten__", None)
    if type(tensor) in (torch.Tensor, nn.Parameter) or flatten is None:
        return tensor
    names, _ = tensor.__tensor_flatten__()
    inner = getattr(tensor, names[0], None) if names else None
    if isinstance(inner, torch.Tensor) and inner.shape == tensor.shape and inner.dtype == tensor.dtype:
        return inner
    return tensor


def _plain_state(state: dict[str, Any]) -> dict[str, Any]:
    """A flat state dict with every wrapped tensor unwrapped (see `plain_tensor`)."""
    return {key: plain_tensor(value) for key, value in state.items()}


def _unstepped(state: dict[str, Any]) -> dict[str, Any]:
    """A flattened optimizer state with every step counter (``state.<fqn>.step``) at 0: what
    an optimizer that never stepped holds (its other entries, moments and buffers, are zeros)."""
    return {key: torch.zeros_like(value) if key.startswith("state.") and key.endswith(".step")
            and isinstance(value, torch.Tensor) else value for key, value in state.items()}


def _as_list(parts: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """Accept one module or a sequence of them (pipeline stages on this rank)."""
    return [parts] if isinstance(parts, nn.Module) else list(parts)


class ModelWrapper:
    """The weights of every model part on this rank as one `{fqn: tensor}` state dict.

    Under pipeline parallelism each rank holds different parts; FQNs stay those of the full
    model (the parts keep their original module names), so the union over ranks is the
    whole model and DCP can reshard it onto any other split.
    """

    def __init__(self, model_parts: nn.Module | Sequence[nn.Module]) -> None:
        self.model_parts = _as_list(model_parts)

    def state_dict(self) -> dict[str, Any]:
        """Merged state of all parts (DTensors stay sharded: each rank writes its shards)."""
        merged: dict[str, Any] = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part))
        return _plain_state(merged)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the entries each part owns; keys of parts held by other ranks are ignored."""
        # strict=False because the dict holds every part's keys; completeness is checked
        # against the checkpoint metadata before loading (CheckpointManager).
        options = StateDictOptions(strict=False)
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=options)


class OptimizerWrapper:
    """The state of one optimizer per model part, flattened to `state.<fqn>.<name>` keys.

    Flattened keys name parameters by FQN instead of by position inside an optimizer, which
    is what lets optimizer state follow its parameter across pipeline splits and shardings.
    """

    def __init__(
        self,
        model_parts: nn.Module | Sequence[nn.Module],
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    ) -> None:
        self.model_parts = _as_list(model_parts)
        opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        if len(opts) != len(self.model_parts):
            raise ValueError(
                f"OptimizerWrapper needs one optimizer per model part: got {len(opts)} "
                f"optimizers for {len(self.model_parts)} parts"
            )
        self.optimizers = opts

    def _options(self) -> StateDictOptions:
        return StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        """Merged flattened state of every (part, optimizer) pair. An optimizer that has not
        stepped yet is saved as its fresh state (step 0, zero moments) and left unstepped."""
        merged: dict[str, Any] = {}
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            fresh = not opt.state
            state = get_optimizer_state_dict(part, opt, options=self._options())
            if fresh:
                state = _unstepped(state)
                # torch fills an empty optimizer's state by stepping it once on zero gradients
                # (lr 0): its step counters then read 1, and Adam's first real update would be
                # bias-corrected as its second. Drop that state: the optimizer stays fresh.
                opt.state.clear()
            merged.update(state)
        return _plain_state(merged)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Give each optimizer the entries of its own parameters: the moments and step
        counts. The hyperparameters stay this run's (weight decay, betas, eps, the kernel
        choice: torch's load would take the saving run's and silently override the flags of
        a run resumed with others), a changed one logged; the LR entries (`SCHEDULE_KEYS`) are
        the checkpoint's, as a plain torch scheduler resumes from them (titan's scheduler,
        loaded after the optimizer, then sets its own run's LR)."""
        changed: dict[str, tuple[Any, Any]] = {}
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            own = [{k: v for k, v in group.items() if k not in ("params", *SCHEDULE_KEYS)} for group in opt.param_groups]
            set_optimizer_state_dict(part, opt, state_dict, options=self._options())
            for group, mine in zip(opt.param_groups, own, strict=True):
                changed.update({k: (group[k], v) for k, v in mine.items() if k in group and group[k] != v})
                group.update(mine)
        if changed and not (dist.is_initialized() and dist.get_rank()):  # once: every rank has the same
            logger.warning("the optimizer's hyperparameters are this run's, not the checkpoint's: %s",
                           ", ".join(f"{k} {saved} -> {mine}" for k, (saved, mine) in sorted(changed.items())))


SCHEDULE_KEYS = ("lr", "initial_lr")
"""The parameter-group entries an LR scheduler owns (restored with the scheduler's position)."""


class RankLocal:
    """Store a rank-local state (data loader position, RNG) under `rank_<r>`.

    DCP treats equal keys on different ranks as replicated and writes only one copy; keying
    by rank keeps every rank's own state.
    """

    def __init__(self, inner: Any, rank: int) -> None:
        self.inner = inner
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        """`{"rank_<r>": inner.state_dict()}`."""
        return {self.key: self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's entry."""
        self.inner.load_state_dict(state_dict[self.key])


class RNGState:
    """Random generators of this process: torch (CPU), the accelerator's, Python, numpy.

    Everything is stored as tensors, so nothing is pickled into the checkpoint.
    """

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Snapshot of every generator present in this process."""
        state = {"torch": torch.get_rng_state()}
        state.update(_python_rng_state())
        state.update(_numpy_rng_state())
        accel = _accelerator_module()
        if accel is not None:
            state["accelerator"] = accel.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the generators the snapshot holds."""
        torch.set_rng_state(state["torch"])
        if "python_state" in state:
            _set_python_rng_state(state)
        if "numpy_keys" in state:
            _set_numpy_rng_state(state)
        accel = _accelerator_module()
        if accel is not None and "accelerator" in state:
            accel.set_rng_state(state["accelerator"])


def _accelerator_module() -> Any | None:
    """`torch.cuda` (or the current accelerator's module), or None on a CPU-only machine."""
    if not torch.accelerator.is_available():
        return None
    return torch.get_device_module(torch.accelerator.current_accelerator().type)


def _python_rng_state() -> dict[str, torch.Tensor]:
    version, internal, gauss = random.getstate()
    return {
        "python_version": torch.tensor(version, dtype=torch.int64),
        "python_state": torch.tensor(internal, dtype=torch.int64),
        # NaN stands for "no cached gaussian" (None), which a tensor cannot hold.
        "python_gauss": torch.tensor(math.nan if gauss is None else gauss, dtype=torch.float64),
    }


def _set_python_rng_state(state: dict[str, torch.Tensor]) -> None:
    gauss = state["python_gauss"].item()
    random.setstate(
        (
            int(state["python_version"].item()),
            tuple(int(x) for x in state["python_state"].tolist()),
            None if math.isnan(gauss) else gauss,
        )
    )


def _numpy_rng_state() -> dict[str, torch.Tensor]:
    try:
        import numpy as np
    except ImportError:  # numpy is optional: nothing to save without it
        return {}
    _, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "numpy_keys": torch.from_numpy(keys.astype(np.int64)),
        "numpy_pos": torch.tensor([pos, has_gauss], dtype=torch.int64),
        "numpy_gauss": torch.tensor(gauss, dtype=torch.float64),
    }


def _set_numpy_rng_state(state: dict[str, torch.Tensor]) -> None:
    import numpy as np

    pos, has_gauss = (int(x) for x in state["numpy_pos"].tolist())
    keys = state["numpy_keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, pos, has_gauss, float(state["numpy_gauss"].item())))


@dataclass
class TrainState:
    """The trainer's counters: optimizer steps taken and tokens consumed."""

    step: int = 0
    tokens_seen: int = 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Counters as int64 tensors (no pickled Python objects in the checkpoint)."""
        return {
            "step": torch.tensor(self.step, dtype=torch.int64),
            "tokens_seen": torch.tensor(self.tokens_seen, dtype=torch.int64),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the counters."""
        self.step = int(state["step"].item())
        self.tokens_seen = int(state["tokens_seen"].item())
