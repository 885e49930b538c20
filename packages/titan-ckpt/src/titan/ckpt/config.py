"""`--checkpoint.*`: what the checkpoint layer saves, where, how often and how it loads."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Checkpointing of a training run (`--checkpoint.*`); `build()` is `CheckpointManager`."""

    enable: bool = False
    """Save checkpoints every `interval` steps and resume from the latest one in `folder`."""

    folder: str = "checkpoint"
    """Where step folders (`step-<N>`) go; relative to the job's dump folder unless absolute.
    Must be on a filesystem every rank sees (the step is renamed into place by rank 0)."""

    interval: int = 500
    """Save every this many training steps (and always at the last step)."""

    async_mode: str = "disabled"
    """"disabled": the step blocks until the save is on disk. "async": the state is copied to
    CPU memory and written by a background thread while training continues.
    "async_with_pinned_mem": as "async", copying into reused pinned memory (needs an
    accelerator; falls back to "async" on CPU)."""

    keep_latest_k: int = 10
    """Keep only this many most recent complete steps, purging older ones in the background
    (0 keeps all). Older steps are purged only after the newer one is complete, so a crash
    during a save always leaves a loadable step; and while the kept steps are weights only (a
    last save under --checkpoint.last_save_model_only), the newest full step stays too, so the
    run can still be continued past its end."""

    load_step: int = -1
    """Step to resume from; -1 means the latest complete step in `folder`."""

    exclude_from_loading: list[str] = field(default_factory=list)
    """State names not restored on resume (e.g. `dataloader`, `lr_scheduler`, `optimizer`)."""

    last_save_model_only: bool = True
    """At the last step save only model weights (cast to `export_dtype`), not the optimizer
    and the other training state."""

    export_dtype: str = "float32"
    """Dtype of floating-point weights in model-only saves (last step, HF export)."""

    initial_load_path: str | None = None
    """A checkpoint to start from when `folder` holds no step yet (a warm start): a DCP step
    folder, or a Hugging Face folder when `initial_load_in_hf` (or a Hub model id, `org/name`,
    read through the Hugging Face cache by the `titan` commands)."""

    initial_load_revision: str | None = None
    """With a Hub model id as `initial_load_path`: the branch, tag or commit to read (default:
    the repository's main branch), as transformers' and vLLM's `revision`."""

    initial_load_model_only: bool = True
    """Load only the model weights from `initial_load_path` (optimizer and counters start
    fresh)."""

    initial_load_in_hf: bool = False
    """`initial_load_path` is a Hugging Face safetensors folder, converted through the model
    family's state-dict adapter."""

    last_save_in_hf: bool = False
    """Save the last step as Hugging Face safetensors + `config.json` (needs the family's
    adapter); implies a model-only last save."""

    create_seed_checkpoint: bool = False
    """Write the freshly initialized weights as step 0 and exit (world size 1), so multi-rank
    runs start from identical weights."""

    def folder_in(self, dump_folder: str) -> str:
        """Where the step folders go: `folder` under the job's `dump_folder`, or `folder`
        itself when it is absolute."""
        return os.path.join(dump_folder, self.folder)

    def __post_init__(self) -> None:
        _check_choice("async_mode", self.async_mode, ASYNC_MODES)
        _check_choice("export_dtype", self.export_dtype, EXPORT_DTYPES)
        if self.interval < 1:
            raise ValueError(
                f"--checkpoint.interval must be >= 1 (steps between saves), got {self.interval}"
            )
        if self.keep_latest_k < 0:
            raise ValueError(
                f"--checkpoint.keep_latest_k must be >= 0 (0 keeps every step), "
                f"got {self.keep_latest_k}"
            )
        if self.load_step < -1:
            raise ValueError(
                f"--checkpoint.load_step must be -1 (latest) or a step >= 0, got {self.load_step}"
            )
        if self.initial_load_in_hf and not self.initial_load_path:
            raise ValueError(
                "--checkpoint.initial_load_in_hf needs --checkpoint.initial_load_path "
                "(the Hugging Face folder to load)"
            )
        if self.initial_load_revision is not None and not self.initial_load_in_hf:
            raise ValueError(
                f"--checkpoint.initial_load_revision {self.initial_load_revision!r} picks a revision of a Hub model "
                "read with --checkpoint.initial_load_in_hf; add it (and a Hub id as --checkpoint.initial_load_path) "
                "or drop the revision"
            )
        if self.initial_load_in_hf and not self.initial_load_model_only:
            raise ValueError(
                "--checkpoint.initial_load_in_hf loads weights only; keep "
                "--checkpoint.initial_load_model_only true"
            )
        if not isinstance(self.exclude_from_loading, list):
            raise ValueError(
                "--checkpoint.exclude_from_loading must be a list of state names, got "
                f"{self.exclude_from_loading!r}"
            )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise naming the flag when `value` is not one of `choices`."""
    if value not in choices:
        raise ValueError(
            f"--checkpoint.{name} must be one of {', '.join(choices)}; got {value!r}"
        )
