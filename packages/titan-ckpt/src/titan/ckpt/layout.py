"""The on-disk layout of a checkpoint folder and its atomic publication.

    <folder>/step-<N>/            a complete step: data files + `titan_checkpoint.json`
    <folder>/step-<N>.tmp/        a step being written (or left by a crash): never loaded
    <folder>/step-<N>.old/        a step being replaced by a re-save of the same N

A step becomes visible in one `os.rename` of its temporary folder, done by rank 0 after every
rank finished writing, and only folders that also carry the manifest count as complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Any

from titan.ckpt.errors import CheckpointError

MANIFEST = "titan_checkpoint.json"
MANIFEST_VERSION = 1
_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-(\d+)\.(tmp|old)$")


def step_path(folder: str, step: int) -> str:
    """The published folder of `step`."""
    return os.path.join(folder, f"step-{step}")


def tmp_path(folder: str, step: int) -> str:
    """The folder `step` is written into before it is published."""
    return os.path.join(folder, f"step-{step}.tmp")


def is_complete(path: str) -> bool:
    """Whether `path` is a published step (its manifest is written last, before the rename)."""
    return os.path.isfile(os.path.join(path, MANIFEST))


def complete_steps(folder: str) -> list[int]:
    """Sorted steps that are complete and loadable."""
    return sorted(s for s, name in _scan(folder, _STEP_RE) if is_complete(os.path.join(folder, name)))


def partial_steps(folder: str) -> list[int]:
    """Sorted steps with only a half-written folder (a crash during their save)."""
    done = set(complete_steps(folder))
    return sorted({s for s, _ in _scan(folder, _TMP_RE)} - done)


def foreign_steps(folder: str) -> list[int]:
    """Sorted steps whose `step-<N>` folder has no manifest: titan did not write them.

    titan writes a step into `step-<N>.tmp` and renames it only once its manifest is in, so a
    published name without one is another program's: typically torchtitan, which names its
    steps the same way. Such folders are never loaded as this run's steps nor replaced."""
    return sorted(s for s, name in _scan(folder, _STEP_RE) if not is_complete(os.path.join(folder, name)))


def newest_step_folder(path: str) -> str:
    """`path` itself, or the newest step when it is a checkpoint folder: titan's complete
    steps first, else the steps (DCP or Hugging Face safetensors) another trainer (torchtitan)
    published under the same names."""
    complete = complete_steps(path)
    if complete:
        return step_path(path, complete[-1])
    marks = (".metadata", "model.safetensors.index.json", "model.safetensors")  # DCP, Hugging Face
    loadable = [s for s in foreign_steps(path)
                if any(os.path.isfile(os.path.join(step_path(path, s), mark)) for mark in marks)]
    return step_path(path, loadable[-1]) if loadable else path


def _scan(folder: str, pattern: re.Pattern) -> list[tuple[int, str]]:
    """(step, entry name) of the directories in `folder` whose name matches `pattern`."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = pattern.match(name)
        if match and os.path.isdir(os.path.join(folder, name)):
            found.append((int(match.group(1)), name))
    return found


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest of a complete step (plain JSON: reading it executes nothing)."""
    with open(os.path.join(path, MANIFEST)) as f:
        return json.load(f)


def resumable(folder: str, step: int) -> bool:
    """Whether complete step `step` holds what a run continues from (the optimizer, data
    position and counters beside the weights): not a seed checkpoint (step 0) nor a
    weights-only last save."""
    try:
        return step > 0 and not read_manifest(step_path(folder, step)).get("model_only")
    except (OSError, ValueError):
        return False


def make_manifest(step: int, *, fmt: str, states: list[str], model_only: bool,
                  world_size: int, dtype: str | None = None, run: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a step holds: its format ("dcp" or "hf"), state names, and how it was written;
    ``run``: what the writing run says about itself (plain JSON values, e.g. its batch shape,
    which a resume compares with its own), stored under "run" when given."""
    manifest = {
        "version": MANIFEST_VERSION,
        "step": step,
        "format": fmt,
        "states": states,
        "model_only": model_only,
        "world_size": world_size,
        "dtype": dtype,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if run is not None:
        manifest["run"] = dict(run)
    return manifest


def write_manifest(path: str, manifest: dict[str, Any]) -> None:
    """Write a step folder's manifest durably."""
    _write_json_durably(os.path.join(path, MANIFEST), manifest)


def prepare_tmp(folder: str, step: int) -> str:
    """Create an empty temporary folder for `step`, removing a stale one a crash left."""
    path = tmp_path(folder, step)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def publish(folder: str, step: int, manifest: dict[str, Any]) -> str:
    """Write the manifest into the finished temporary folder and rename it into place."""
    tmp = tmp_path(folder, step)
    write_manifest(tmp, manifest)
    final = step_path(folder, step)
    old = None
    if os.path.exists(final) and not is_complete(final):
        raise CheckpointError(
            f"{final} exists and titan did not write it (no {MANIFEST}); not replacing it. "
            "Give this run its own --checkpoint.folder."
        )
    if os.path.exists(final):
        # A re-save of the same step (e.g. a run resumed from an earlier step): move the old
        # one aside first, because a rename cannot replace a non-empty directory.
        old = os.path.join(folder, f"step-{step}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(folder)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def set_aside(folder: str, steps: list[int]) -> str:
    """Move the complete `steps` into a new ``<folder>/discarded-<UTC time>/`` (a name no step
    pattern matches: never listed, loaded nor purged); returns that folder."""
    target = os.path.join(folder, time.strftime("discarded-%Y%m%dT%H%M%SZ", time.gmtime()))
    suffix = 0
    while os.path.exists(target + (f"-{suffix}" if suffix else "")):
        suffix += 1
    target += f"-{suffix}" if suffix else ""
    os.makedirs(target)
    for step in steps:
        os.rename(step_path(folder, step), os.path.join(target, f"step-{step}"))
    _fsync_dir(folder)
    return target


def purge(folder: str, *, keep_latest_k: int, up_to_step: int) -> list[int]:
    """Delete complete steps beyond the newest `keep_latest_k` (0 keeps all) and leftovers of
    crashed saves at or below `up_to_step`; return the complete steps deleted.

    Leftovers above `up_to_step` are kept: one may be the save in flight. When none of the
    newest `keep_latest_k` steps can be resumed from (a run's last save holds the weights only:
    ``--checkpoint.last_save_model_only``, or Hugging Face safetensors), the newest step that
    can is kept too: without it the run could never be continued past its last step.
    """
    for step, name in _scan(folder, _TMP_RE):
        if step <= up_to_step:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    steps = complete_steps(folder)
    doomed = steps[:-keep_latest_k] if keep_latest_k > 0 else []
    if doomed and not any(resumable(folder, step) for step in steps[len(doomed):]):
        last_full = [step for step in doomed if resumable(folder, step)]
        if last_full:
            doomed.remove(last_full[-1])
    for step in doomed:
        # Rename first so a half-deleted folder never looks like a complete step.
        path = step_path(folder, step)
        trash = os.path.join(folder, f"step-{step}.old")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def _write_json_durably(path: str, obj: Any) -> None:
    """Write JSON and fsync it, so the manifest is on disk before the rename publishes it."""
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    """Persist a rename (the directory entry), where the platform allows it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
