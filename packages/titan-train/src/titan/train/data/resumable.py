"""The base of every resumable training loader: pretraining (on the fly or pre-tokenized) and SFT.

A loader's checkpointed state is one global record, the same on every data-parallel rank
after every fetch: a ``version`` (bumped when the meaning of the position changes), the
position itself, and what the position is measured against (sequence length, corpus size,
shuffling...). Loading checks the version and every such field before touching the
position, and names the flag to fix; an empty state is a fresh start (nothing was saved).
A subclass says what its position is (:meth:`ResumableLoader.position`,
:meth:`ResumableLoader.restore`) and what it is measured against
(:meth:`ResumableLoader.measured_against`); the checks and the format are shared.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import torch
from torch.utils.data import DataLoader, IterableDataset

RESTART_HINT = "restart the data stream with --checkpoint.exclude_from_loading dataloader"
"""How to start a run's data from the beginning when its saved position cannot be used."""


def check_loader_args(dp_rank: int, dp_world_size: int, local_batch_size: int, seq_len: int) -> None:
    """Reject impossible shapes and ranks before touching any data."""
    if dp_world_size < 1 or not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_world_size={dp_world_size})")
    if local_batch_size < 1:
        raise ValueError(f"local batch size must be >= 1, got {local_batch_size}")
    if seq_len < 1:
        raise ValueError(f"--training.seq_len must be >= 1, got {seq_len}")


class ResumableLoader(DataLoader):
    """An endless ``DataLoader`` of one data-parallel rank's batches whose position is saved
    and restored exactly (see the module docstring). Batches are built in the calling
    process (``num_workers=0``): packing is cheap, and it keeps the saved position exact.
    Iterate it, or call ``next(loader)``: every iterator draws from the same position."""

    STATE_VERSION: ClassVar[int] = 1
    """The version of the saved position's meaning."""
    KIND: ClassVar[str] = "data loader"
    """What the errors call this loader."""

    def __init__(self, dataset: IterableDataset, *, dp_rank: int, dp_world_size: int) -> None:
        super().__init__(dataset, batch_size=None, num_workers=0)
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self._own_iterator: Iterator | None = None

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._own_iterator is None:
            self._own_iterator = iter(self)
        return next(self._own_iterator)

    # ---- what a loader defines ----------------------------------------------------------

    def position(self) -> dict[str, Any]:
        """The global position after the last fetch (plain ints/bools/strings)."""
        raise NotImplementedError

    def restore(self, state: dict[str, Any]) -> None:
        """Jump to a saved (and checked) position."""
        raise NotImplementedError

    def measured_against(self) -> dict[str, tuple[Any, str]]:
        """What the position is only valid for: field -> (this run's value, the flag that sets it)."""
        return {}

    def version_error(self, version: Any) -> str:
        """The message for a saved state of another version."""
        return (f"{self.KIND} state version {version} is not {self.STATE_VERSION}; {RESTART_HINT}, or resume "
                "with the titan-train that wrote it")

    def saved_version(self, state: dict[str, Any]) -> Any:
        """The version a saved state declares (a loader may recognise older layouts)."""
        return state.get("version")

    # ---- the shared format and checks ---------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The global position, its version and what it is measured against: identical on
        every rank."""
        state = dict(self.position())
        state["version"] = self.STATE_VERSION
        state.update({key: value for key, (value, _) in self.measured_against().items()})
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue exactly where the saved loader stopped, whatever this run's data-parallel
        degree or batch split. An empty dict is a fresh start (nothing was saved)."""
        if not state_dict:
            return
        self.check_compatible(state_dict)
        self.restore(state_dict)

    def check_compatible(self, state: dict[str, Any]) -> None:
        """Raise ValueError (naming the flag) unless ``state`` is a position of this stream."""
        version = self.saved_version(state)
        if version != self.STATE_VERSION:
            raise ValueError(self.version_error(version))
        for key, (here, flag) in self.measured_against().items():
            if state.get(key) != here:
                raise ValueError(
                    f"cannot resume the {self.KIND}: the checkpoint has {key}={state.get(key)}, this run has "
                    f"{key}={here}; resume with the same {flag}"
                )
