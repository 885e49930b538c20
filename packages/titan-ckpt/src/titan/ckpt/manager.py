"""`CheckpointManager`: periodic, atomic, optionally asynchronous DCP checkpoints of a run."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from titan.ckpt import hf, layout, torchtitan
from titan.ckpt.config import CheckpointConfig
from titan.ckpt.errors import CheckpointError, check_state_matches, flatten_state
from titan.ckpt.stateful import ModelWrapper, RankLocal, RNGState, shard_like
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import DTensor

__all__ = ["CheckpointManager"]

logger = logging.getLogger("titan.ckpt")

RESERVED = ("model", "optimizer")
DCP_METADATA = ".metadata"


class CheckpointManager:
    """Saves and restores a run's named `Stateful` objects as DCP checkpoints.

    Args:
        config: the `--checkpoint.*` section.
        dump_folder: the job's output folder; `config.folder` is relative to it unless absolute.
        states: the trainer's other states by name (`lr_scheduler`, `dataloader`,
            `train_state`, ...), each with `state_dict()` / `load_state_dict()`.
        model_parts: the model parts this rank holds (one module, or the pipeline stages);
            saved as state "model" through `ModelWrapper`.
        optimizers: a `Stateful` over the optimizers (usually `OptimizerWrapper`), saved as
            state "optimizer"; None for runs that do not train.
        hf_adapter: the model family's state-dict adapter (`to_hf`, `from_hf`, `hf_config`);
            needed for `initial_load_in_hf` and `last_save_in_hf`.
        rank_local: names of states that differ per rank and are stored per rank.
            An `RNGState` is added as "rng" unless `states` has one.
        hf_max_shard_bytes: the size at which Hugging Face exports start a new file.
        hf_config_overrides: `config.json` keys the export states over the adapter's (the
            trainer: `max_position_embeddings`, the model's context rather than the length
            this run trains at).
        hf_export_files: files copied into every Hugging Face export (the trainer: its
            tokenizer's, so that transformers and vLLM load the folder as it is).
        collective_timeout: timeout of the checkpoint group's collectives (None: torch's
            default); a rank that died mid-save makes the others fail after it.

    All ranks must construct it (it creates a gloo group for checkpoint traffic) and call
    `load`, `maybe_save`, `wait` and `close` in the same order.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        dump_folder: str,
        states: dict[str, Any],
        model_parts: nn.Module | Sequence[nn.Module],
        optimizers: Any | None = None,
        hf_adapter: Any | None = None,
        rank_local: Iterable[str] = ("dataloader", "rng"),
        hf_max_shard_bytes: int = hf.DEFAULT_MAX_SHARD_BYTES,
        collective_timeout: timedelta | None = None,
        hf_config_overrides: dict[str, Any] | None = None,
        hf_export_files: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.folder = config.folder_in(dump_folder)
        self.hf_adapter = hf_adapter
        self.hf_max_shard_bytes = hf_max_shard_bytes
        self.hf_config_overrides = dict(hf_config_overrides or {})
        self.hf_export_files = tuple(hf_export_files)
        self.model = ModelWrapper(model_parts)
        self._rank, self._world_size = _rank_and_world()
        self._abandoned_after: int | None = None  # the step a run was sent back to (load_step)
        self._rank_local = set(rank_local)
        self.states = self._collect_states(states, optimizers)
        self._pg = _checkpoint_group(collective_timeout)
        self._stager = self._make_stager()
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="titan-ckpt-save")
        self._purger = ThreadPoolExecutor(1, thread_name_prefix="titan-ckpt-purge")
        self._pending: tuple[int, Future] | None = None
        self._purges: list[Future] = []
        self._last_saved: int | None = None
        self.run_facts: dict[str, Any] | None = None
        """What the run says about itself in every step's manifest (plain JSON values, e.g. its
        batch shape; set by the trainer before its first save; None: nothing)."""
        self.loaded_run_facts: dict[str, Any] | None = None
        """The ``run_facts`` of the step :meth:`load` resumed from (None: nothing loaded, or a
        step written without them)."""

    # ----------------------------------------------------------------------------- setup

    def _collect_states(self, states: dict[str, Any], optimizers: Any | None) -> dict[str, Any]:
        """'model', 'optimizer', the trainer's states, and 'rng'; rank-local ones wrapped."""
        clash = [name for name in RESERVED if name in states]
        if clash:
            raise ValueError(
                f"states {clash} are reserved: pass the model as model_parts= and the "
                "optimizers as optimizers="
            )
        collected: dict[str, Any] = {"model": self.model}
        if optimizers is not None:
            collected["optimizer"] = optimizers
        collected.update(states)
        collected.setdefault("rng", RNGState())
        for name in self._rank_local & collected.keys():
            collected[name] = RankLocal(collected[name], self._rank)
        return collected

    def add_state(self, name: str, state: Any) -> None:
        """Checkpoint one more ``Stateful`` under ``name`` (before the first load or save),
        e.g. a data loader built after the model because it needs the mesh."""
        if name in RESERVED or name in self.states:
            raise ValueError(f"checkpoint state {name!r} is reserved or already registered")
        self.states[name] = RankLocal(state, self._rank) if name in self._rank_local else state

    def _make_stager(self) -> DefaultStager | None:
        """A stager kept across saves for "async_with_pinned_mem" (it reuses its buffers)."""
        if self.config.async_mode != "async_with_pinned_mem":
            return None
        accel = torch.accelerator.is_available()
        if not accel:
            logger.warning(
                "--checkpoint.async_mode async_with_pinned_mem: no accelerator, staging into "
                "reused (unpinned) CPU memory instead"
            )
        # Pinned memory, background staging and non-blocking copies all need an accelerator.
        return DefaultStager(StagingOptions(accel, False, accel, accel))

    # ----------------------------------------------------------------------------- queries

    def steps(self) -> list[int]:
        """Complete (loadable) steps in the checkpoint folder, oldest first."""
        return layout.complete_steps(self.folder)

    # ----------------------------------------------------------------------------- load

    def load(self, step: int = -1) -> int | None:
        """Restore the run before training starts; return the step loaded, or None.

        Resumes from `step` (-1: `--checkpoint.load_step`, whose -1 means the latest complete
        step) when checkpointing is enabled and the folder has steps. Otherwise warm-starts
        from `--checkpoint.initial_load_path` (DCP, or HF with `initial_load_in_hf`) and
        returns 0. Returns None when there is nothing to load.
        """
        self.wait()
        requested = step if step != -1 else self.config.load_step
        if self.config.enable:
            chosen = self._resolve_step(requested)
            if chosen is not None:
                if self.config.initial_load_path:  # torchtitan's rule: the initial load starts a run
                    logger.info("--checkpoint.initial_load_path %s is not read: the run resumes from its own step %d "
                                "in %s (an initial load only starts a run)", self.config.initial_load_path, chosen,
                                self.folder)
                self._load_step(chosen)
                self._last_saved = chosen  # already on disk: no need to save it again
                if requested != -1:  # sent back: later steps belong to the abandoned continuation
                    self._abandoned_after = chosen
                return chosen
        if self.config.initial_load_path:
            self._initial_load(self.config.initial_load_path)
            return 0
        return None

    def load_finished_run(self, last_step: int) -> int | None:
        """Load and return ``last_step`` when the folder already holds it as a finished run's
        last save (the weights only: ``--checkpoint.last_save_model_only`` or Hugging Face
        safetensors), so the same run launched again has nothing left to train; None otherwise
        (resume as usual). Resuming would go back to the newest full step and run the steps
        after it again, only to save the same last step (hours on a cluster, for a requeued job
        that had finished). Loading the weights checks that they are this run's model (a
        checkpoint of another size fails as on any load)."""
        if not (self.config.enable and self.config.load_step == -1 and last_step > 0 and os.path.isdir(self.folder)):
            return None
        self.wait()
        self._refuse_foreign_steps()  # as a resume would
        complete = layout.complete_steps(self.folder)
        if not (complete and complete[-1] == last_step and self._weights_only(last_step)):
            return None
        self._load_step(last_step)
        self._last_saved = last_step
        return last_step

    def _resolve_step(self, requested: int) -> int | None:
        """The complete step to resume from, None if there is none, or a clear error."""
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise CheckpointError(
                f"--checkpoint.folder {self.folder} is a file, not a checkpoint folder"
            )
        self._refuse_foreign_steps()
        complete, partial = layout.complete_steps(self.folder), layout.partial_steps(self.folder)
        if partial:
            logger.warning("ignoring half-written steps %s in %s", partial, self.folder)
        if requested == -1:
            return self._newest_resumable(complete)
        if requested in complete:
            if requested and self._weights_only(requested):
                raise CheckpointError(self._weights_only_message(requested))
            return requested
        if requested in partial:
            raise CheckpointError(
                f"step {requested} in {self.folder} is half-written (its save never finished: "
                f"the job stopped while writing it). Complete steps: {complete or 'none'}; "
                "pick one with --checkpoint.load_step, or -1 for the latest."
            )
        raise CheckpointError(
            f"--checkpoint.load_step {requested}: no such step in {self.folder}. Complete "
            f"steps: {complete or 'none'}."
        )

    def _set_aside_abandoned_steps(self) -> None:
        """On rank 0, at the first save of a run sent back to an earlier step
        (``--checkpoint.load_step``): the steps after that one belong to the continuation it
        abandoned. Left in place, a later resume would pick the newest of them rather than this
        run's, and retention would count them; they move into ``<folder>/discarded-<time>/``
        (kept, never loaded nor purged). Loading alone moves nothing (a step may be loaded to
        inspect it)."""
        step, self._abandoned_after = self._abandoned_after, None
        newer = [s for s in layout.complete_steps(self.folder) if s > step] if step is not None else []
        if newer and self._rank == 0:
            where = layout.set_aside(self.folder, newer)
            logger.warning("this run continues from step %d: the later steps %s belong to the continuation it "
                           "replaces; moved to %s (not resumed from, not purged)", step, newer, where)

    def _newest_resumable(self, complete: list[int]) -> int | None:
        """The newest step a run can continue from. A run's last save may hold the weights only
        (``--checkpoint.last_save_model_only``, or Hugging Face safetensors): a run extended
        past it (more ``--training.steps``) continues from the newest full step before it and
        runs the steps between again (deterministic data, the same results), instead of
        restarting at step 1 with a fresh optimizer, the data from its start, and saves that
        replace the earlier steps. A seed checkpoint (step 0) is weights by design."""
        if not complete:
            return None
        newest = complete[-1]
        if newest == 0 or not self._weights_only(newest):
            return newest
        full = [step for step in complete if layout.resumable(self.folder, step)]
        if not full:
            raise CheckpointError(self._weights_only_message(newest))
        logger.warning(
            "step %d holds only model weights (the run's last save); resuming from step %d, the newest step "
            "with the optimizer, data position and counters: steps %d-%d run again", newest, full[-1],
            full[-1] + 1, newest,
        )
        return full[-1]

    def _weights_only(self, step: int) -> bool:
        """Whether complete step `step` holds the model weights only (no optimizer, data
        position or counters)."""
        return bool(layout.read_manifest(layout.step_path(self.folder, step)).get("model_only"))

    def _weights_only_message(self, step: int) -> str:
        path = layout.step_path(self.folder, step)
        return (
            f"step {step} in {self.folder} holds only model weights (a run's last save, "
            "--checkpoint.last_save_model_only): its optimizer, data position and step count are "
            "not there, so training cannot continue from it in this folder (it would start again "
            "at step 1, over the data's start, and replace the folder's steps). Train on from its "
            f"weights as a new run: --checkpoint.initial_load_path {path} with another "
            "--checkpoint.folder (or --job.dump_folder); keep full last saves with "
            "--checkpoint.no_last_save_model_only to continue a run later."
        )

    def _refuse_foreign_steps(self) -> None:
        """Stop before training when the checkpoint folder holds steps titan did not write.

        Resuming would skip them and the first save of the same step would replace them: a
        torchtitan run's checkpoints lost without a word. Their weights load through
        `--checkpoint.initial_load_path` instead."""
        foreign = layout.foreign_steps(self.folder)
        if not foreign:
            return
        newest = layout.step_path(self.folder, foreign[-1])
        made_by = (
            "DCP checkpoints of another trainer (torchtitan names its steps the same way)"
            if os.path.isfile(os.path.join(newest, DCP_METADATA)) else "not titan's checkpoints"
        )
        raise CheckpointError(
            f"--checkpoint.folder {self.folder} holds step folders titan did not write "
            f"({', '.join(f'step-{s}' for s in foreign)}: no {layout.MANIFEST}); they are "
            f"{made_by}. titan neither resumes from nor overwrites them: give this run its "
            f"own --checkpoint.folder, and start from their weights with "
            f"--checkpoint.initial_load_path {newest}."
        )

    def _load_step(self, step: int) -> None:
        """Load a complete step of this run's folder."""
        path = layout.step_path(self.folder, step)
        manifest = layout.read_manifest(path)
        self._refuse_another_trainers_step(path, manifest)
        start = time.monotonic()
        if manifest["format"] == "hf":
            self._load_hf_model(path)
        elif manifest["model_only"]:
            logger.warning(
                "step %d holds only model weights: optimizer, data loader and counters start "
                "fresh", step,
            )
            self._dcp_load(path, ["model"])
        else:
            self._dcp_load(path, self._names_to_load())
        self.loaded_run_facts = manifest.get("run")
        saved_by = manifest.get("world_size")
        resharded = (f" (written by {saved_by} ranks, resharded onto {self._world_size})"
                     if isinstance(saved_by, int) and saved_by != self._world_size else "")
        logger.info("loaded step %d from %s in %.2fs%s", step, path, time.monotonic() - start, resharded)

    def _refuse_another_trainers_step(self, path: str, manifest: dict[str, Any]) -> None:
        """Stop before loading a step another kind of run wrote (its manifest's and this run's
        ``run_facts["trainer"]`` differ: e.g. a `titan sft` folder resumed by `titan train`):
        its states are not this run's, and the mismatch would surface as entries of another
        layout or format. Steps written without the fact load as before."""
        saved = (manifest.get("run") or {}).get("trainer")
        mine = (self.run_facts or {}).get("trainer")
        if saved and mine and saved != mine:
            raise CheckpointError(
                f"{path} was written by another kind of run ({saved}) than this one ({mine}): its optimizer, data "
                f"position and counters are not this run's to continue. Give this run its own --job.dump_folder "
                f"(or --checkpoint.folder), and start from those weights with --checkpoint.initial_load_path {path}."
            )

    def _initial_load(self, path: str) -> None:
        """Warm start from `--checkpoint.initial_load_path`."""
        if not os.path.exists(path):
            raise CheckpointError(f"--checkpoint.initial_load_path {path} does not exist")
        path = layout.newest_step_folder(path)
        if self.config.initial_load_in_hf:
            self._load_hf_model(path)
            return
        if os.path.isfile(os.path.join(path, DCP_METADATA)):
            reader = FileSystemReader(path)
            saved = reader.read_metadata().state_dict_metadata
            if torchtitan.is_torchtitan_layout(saved):
                self._load_torchtitan_model(path, reader, saved)
                return
        names = ["model"] if self.config.initial_load_model_only else self._names_to_load()
        self._dcp_load(path, names, warm_start=True)
        logger.info("initial load of %s from %s", names, path)

    def _load_torchtitan_model(self, path: str, reader: FileSystemReader, saved: Any) -> None:
        """Warm start from the weights of a torchtitan step folder (`titan.ckpt.torchtitan`).

        Every weight of this model must be there and every weight there must have a place
        in this model: an entry dropped or left at its initialization in silence would train
        another model than the one the user brought."""
        if not self.config.initial_load_model_only:
            raise CheckpointError(
                f"{path} is a torchtitan checkpoint: titan reads its model weights, not its "
                "optimizer, scheduler or data-loader states (torchtitan keys them its own way). "
                "Drop --checkpoint.initial_load_model_only false; the optimizer and counters "
                "start fresh."
            )
        value = self.states["model"].state_dict()
        # Under pipeline parallel a rank holds some stages only: a weight is unused when no
        # rank's stages read it (and a missing one is reported by every rank alike).
        everyone = sorted({k for keys in self._all_gather(sorted(value)) for k in keys})
        names, missing, unused = torchtitan.match_model_entries(everyone, saved)
        # A new head (a score head on a language model's body: torchtitan trains language
        # models only) keeps its initialization, and the checkpoint's own head is not read.
        fresh = self._kept_at_init(everyone)
        for key in fresh:
            names.pop(key, None)
        missing = [k for k in missing if k not in fresh]
        unused = [k for k in unused if torchtitan.titan_name(k) not in fresh]
        self._log_fresh_head(path, fresh, [k for k in torchtitan.model_entries(saved)
                                           if torchtitan.titan_name(k) in fresh])
        renamed = {names[k]: v for k, v in value.items() if k in names}
        problem = None
        try:  # shapes first: "[320, 64] there but [2048, 64] here" names another size best
            check_state_matches("model", renamed, saved, where=path)
        except CheckpointError as err:
            problem = str(err)
        if problem is None and missing:
            problem = (
                f"{path} (a torchtitan checkpoint) has no weights for {_shown(missing)}: it was "
                "written for another model family or size (compare --model.name and "
                "--model.flavor with the torchtitan run's)"
            )
        if problem is None and unused:
            problem = (
                f"{path} (a torchtitan checkpoint) holds weights this model has no place for: "
                f"{_shown(unused)}. It was written for another model family or size, or with "
                "a part titan's model lacks; titan does not drop weights in silence."
            )
        self._raise_if_any(problem)
        with _quiet_single_process(), _load_errors(path):
            dcp.load(renamed, storage_reader=reader, planner=_SafeLoadPlanner(),
                     process_group=self._pg, no_dist=self._pg is None)
        loaded = {k: renamed[names[k]] for k in value if k in names}
        self._relayout_torchtitan(loaded)
        self.states["model"].load_state_dict(loaded)
        zeros = [k for k in value if k not in names and torchtitan.zero_when_absent(k)]
        if zeros:
            logger.info("%s has no balancing bias for %s (torchtitan's run used none): they stay "
                        "zero", path, _shown(zeros))
        logger.info("loaded the weights of torchtitan checkpoint %s (%d tensors); optimizer, "
                    "scheduler and counters start fresh", path, len(renamed))

    def _names_to_load(self) -> list[str]:
        """Every state but the ones `--checkpoint.exclude_from_loading` names."""
        unknown = sorted(set(self.config.exclude_from_loading) - self.states.keys())
        if unknown:
            raise CheckpointError(
                f"--checkpoint.exclude_from_loading names unknown states {unknown}; this run "
                f"has {sorted(self.states)}"
            )
        return [n for n in self.states if n not in self.config.exclude_from_loading]

    def _dcp_load(self, path: str, names: list[str], *, warm_start: bool = False) -> None:
        """Load the named states from a DCP step folder, checking them against its metadata.
        A ``warm_start`` (``--checkpoint.initial_load_path``) leaves the model entries the family
        lets keep their initialization (a new score head) when the checkpoint's differ."""
        if not os.path.isfile(os.path.join(path, DCP_METADATA)):
            raise CheckpointError(
                f"{path} is not a DCP checkpoint (no {DCP_METADATA} file). Point at a step "
                "folder (step-<N>) or a checkpoint folder; for Hugging Face safetensors set "
                "--checkpoint.initial_load_in_hf."
            )
        reader = FileSystemReader(path)
        saved = reader.read_metadata().state_dict_metadata
        to_load, problem = {}, None
        for name in names:
            value = self.states[name].state_dict()
            if warm_start and name == "model":
                self._drop_fresh_entries(path, value, saved)
            expected = flatten_state(name, value)
            if name in self._rank_local and not expected.keys() <= saved.keys():
                # Another world size wrote this checkpoint: this rank has no state of its own.
                logger.warning("%s has no '%s' for this rank; it starts fresh", path, name)
                continue
            try:
                _check_entries(name, expected, saved, path)
            except CheckpointError as err:
                problem = str(err)
                break
            to_load[name] = value
        # Every rank decides together: a rank that raised alone would leave the others
        # waiting in DCP's collectives until the timeout.
        self._raise_if_any(problem)
        with _quiet_single_process(), _load_errors(path):
            dcp.load(to_load, storage_reader=reader, planner=_SafeLoadPlanner(),
                     process_group=self._pg, no_dist=self._pg is None)
        for name, value in to_load.items():
            try:
                self.states[name].load_state_dict(value)
            except Exception as err:  # e.g. a saved value the state itself refuses
                problem = (
                    f"cannot restore '{name}' from {path}: {err}. To start '{name}' fresh "
                    f"instead, pass --checkpoint.exclude_from_loading {name}"
                )
                break
        self._raise_if_any(problem)

    def _relayout_torchtitan(self, values: dict[str, Any]) -> None:
        """Put the entries a torchtitan checkpoint holds in another layout than titan's into
        titan's, through the family's adapter (``torchtitan_layout_keys`` / ``from_torchtitan``;
        e.g. Qwen3's q/k rows: torchtitan's Qwen3 rotates the halves of each head). A sharded
        entry is gathered whole for its permutation and sharded again: a collective among the
        ranks that hold it, all of which call this with the same keys."""
        for key in torchtitan.relayout_keys(self.hf_adapter, values):
            value = values[key]
            whole = value.full_tensor() if isinstance(value, DTensor) else value
            values[key] = shard_like(self.hf_adapter.from_torchtitan({key: whole})[key], value)

    def _raise_if_any(self, problem: str | None) -> None:
        """Raise `CheckpointError` on every rank when any rank found a problem (the lowest
        rank's message wins); a collective, so all ranks must call it."""
        problems = [(rank, p) for rank, p in enumerate(self._all_gather(problem)) if p]
        if problems:
            rank, message = problems[0]
            where = f" (rank {rank})" if self._world_size > 1 else ""
            raise CheckpointError(message + where)

    def _load_hf_model(self, path: str) -> None:
        """Load Hugging Face safetensors into the model through the adapter, one block at a
        time and only the blocks this rank holds (`hf.read_hf_layers`): the memory it takes
        beyond the model is one block's full tensors, not the whole checkpoint per rank."""
        if self.hf_adapter is None:
            raise CheckpointError(
                f"loading Hugging Face weights from {path} needs the model family's state-dict "
                "adapter (hf_adapter=); the trainer passes it from the model spec"
            )
        template = self.model.state_dict()
        wanted = {hf.layer_of(key) for key in template}
        loaded: set[str] = set()
        skipped: list[str] = []
        problem, nbytes = None, 0
        progress = _Progress(f"loading Hugging Face weights from {path}", total=len(wanted))
        try:
            hf.check_hf_config(path, self.hf_adapter)
            for _, hf_block in hf.read_hf_layers(path, wanted):
                block = {k: v for k, v in self.hf_adapter.from_hf(hf_block).items() if k in template}
                skipped += getattr(self.hf_adapter, "skipped", [])
                check_state_matches("model", {k: template[k] for k in block}, block, where=path)  # shapes
                # Loading has no collectives (the values become this rank's shards locally), so
                # a rank that stops on a problem leaves no other waiting.
                self.model.load_state_dict({k: shard_like(v, template[k]) for k, v in block.items()})
                loaded.update(block)
                nbytes += hf._nbytes(hf_block.values())
                progress.advance(nbytes)
            fresh = self._kept_at_init(k for k in template if k not in loaded)
            needed = {k: v for k, v in template.items() if k not in fresh}
            check_state_matches("model", needed, dict.fromkeys(loaded), where=path)  # completeness
            self._log_fresh_head(path, fresh, skipped)
        except (CheckpointError, ValueError) as err:  # ValueError: the adapter's unknown key
            problem = str(err)
        self._raise_if_any(problem)
        logger.info("loaded Hugging Face weights from %s: %d tensors, %.2f GiB read, in %.1fs", path,
                    len(loaded), nbytes / 2**30, time.monotonic() - progress.start)

    def _drop_fresh_entries(self, path: str, value: dict[str, Any], saved: Any) -> None:
        """Remove from the model's state ``value`` (titan names) the entries a warm start
        leaves at their initialization: the ones the family allows whose saved entry is absent
        or of another shape (a language model's ``[vocab, dim]`` output under a score head)."""
        def differs(key: str) -> bool:
            entry = saved.get(f"model.{key}")
            size = getattr(entry, "size", None)
            return entry is None or (size is not None and tuple(size) != tuple(value[key].shape))

        fresh = self._kept_at_init(k for k in value if differs(k))
        for key in fresh:
            del value[key]
        self._log_fresh_head(path, fresh, [f"model.{k}" for k in fresh if f"model.{k}" in saved])

    def _kept_at_init(self, keys: Iterable[str]) -> set[str]:
        """Those of ``keys`` (model entries a warm start's source lacks, or holds in another
        shape) the model family lets keep their initialization: a new score head on a
        language model's body (the adapter's ``keeps_init_when_absent``)."""
        keeps = getattr(self.hf_adapter, "keeps_init_when_absent", None)
        return {k for k in keys if keeps is not None and keeps(k)}

    def _log_fresh_head(self, path: str, fresh: set[str], skipped: Iterable[str]) -> None:
        """Say which entries start from their initialization, and which of the source's were
        not read (a language model's head under a score head): nothing is dropped in silence."""
        if fresh:
            unread = sorted(set(skipped))
            logger.info("%s: this model's head %s starts from its initialization, a new head on the checkpoint's "
                        "body%s", path, _shown(sorted(fresh)),
                        f" (the checkpoint's own head, {_shown(unread)}, is not read)" if unread else "")

    # ----------------------------------------------------------------------------- save

    def maybe_save(self, step: int, *, last_step: bool = False, since: int | None = None) -> bool:
        """Save when checkpointing is on and `step` is a multiple of `--checkpoint.interval`,
        or `last_step`. With `since` (the step of the previous call, for a loop that advances
        several optimizer steps at once) a multiple of the interval anywhere in
        `(since, step]` counts. Returns whether a save started. The last step's save is
        synchronous (model-only / Hugging Face when configured)."""
        if not self.save_due(step, last_step=last_step, since=since):
            return False
        if last_step and self.config.last_save_in_hf:
            self._save_hf(step)
        elif last_step and self.config.last_save_model_only:
            self._save_model_only(step, self.config.export_dtype)
        elif self.config.async_mode != "disabled" and not last_step:
            self._save_async(step)
        else:
            self._save_sync(step, self._snapshot(), states=list(self.states), model_only=False)
        self._last_saved = step
        return True

    def save_due(self, step: int, *, last_step: bool = False, since: int | None = None) -> bool:
        """Whether `maybe_save` with the same arguments would save (a loop checks what must
        hold first, e.g. that the weights are finite)."""
        if not self.config.enable or step == self._last_saved:
            return False
        interval = self.config.interval
        due = step % interval == 0 if since is None else step // interval > since // interval
        return last_step or (step > 0 and due)

    def save_now(self, step: int, *, resave: bool = False) -> bool:
        """A full, resumable, synchronous save of `step` whatever the interval (e.g. when the
        job is being preempted); waits for a save in flight first. A step this run saved
        already is kept as it is, unless `resave` (its state moved on without a step: an RL
        critic's warm-up), which replaces it. Returns False when checkpointing is off."""
        if not self.config.enable:
            return False
        self.wait()
        if step != self._last_saved or resave:
            self._save_sync(step, self._snapshot(), states=list(self.states), model_only=False)
            self._last_saved = step
        return True

    def save_seed_checkpoint(self) -> str:
        """Write the model's current (freshly initialized) weights as step 0, model only.

        Any layout may write it (each rank saves its shards): a later run of any layout loads
        the same weights. Returns the step folder.
        """
        if self.steps():
            raise CheckpointError(
                f"{self.folder} already holds steps {self.steps()}; a seed checkpoint goes into "
                "an empty --checkpoint.folder"
            )
        self._save_model_only(0, dtype=None)
        return layout.step_path(self.folder, 0)

    def _snapshot(self) -> dict[str, Any]:
        """The state dicts of every state (tensors still alias the live ones)."""
        return {name: state.state_dict() for name, state in self.states.items()}

    def _save_model_only(self, step: int, dtype: str | None) -> None:
        """Synchronously save the model weights only, cast to `dtype` (None keeps theirs)."""
        model_sd = self.model.state_dict()
        if dtype is not None:
            target = hf.DTYPES[dtype]
            model_sd = {k: _cast(v, target) for k, v in model_sd.items()}
        self._save_sync(step, {"model": model_sd}, states=["model"], model_only=True, dtype=dtype)

    def _save_sync(self, step: int, state: dict[str, Any], *, states: list[str],
                   model_only: bool, dtype: str | None = None) -> None:
        """Write `state` as step `step` and publish it before returning."""
        self.wait()
        start = time.monotonic()
        tmp = self._begin(step)
        with _quiet_single_process(), _save_errors(step, tmp):
            dcp.save(state, storage_writer=_make_writer(tmp), process_group=self._pg,
                     no_dist=self._pg is None)
        self._finish(step, self._manifest(step, "dcp", states, model_only, dtype))
        logger.info("saved step %d in %.2fs", step, time.monotonic() - start)

    def _save_async(self, step: int) -> None:
        """Stage the state in CPU memory now; write and publish it in the background."""
        self.wait()  # saves never overlap: the previous one must be published first
        start = time.monotonic()
        tmp = self._begin(step)
        with _save_errors(step, tmp):
            self._start_async(step, tmp)
        logger.info("step %d staged in %.2fs; writing in the background", step,
                    time.monotonic() - start)

    def _start_async(self, step: int, tmp: str) -> None:
        """Hand the staged state to DCP's writer thread and queue the publication."""
        response = dcp.async_save(
            self._snapshot(), storage_writer=_make_writer(tmp), process_group=self._pg,
            async_checkpointer_type=AsyncCheckpointerType.THREAD, async_stager=self._stager,
            no_dist=self._pg is None,
        )
        upload = getattr(response, "upload_completion", response)
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            # Training must not change the weights before their copy is taken.
            staging.result()
        manifest = self._manifest(step, "dcp", list(self.states), False, None)
        self._pending = (step, self._saver.submit(self._finish_after, upload, step, tmp, manifest))

    def _finish_after(self, upload: Future, step: int, tmp: str, manifest: dict[str, Any]) -> None:
        """Background: wait for the write on every rank, then publish the step."""
        with _save_errors(step, tmp):
            upload.result()
        self._finish(step, manifest)

    def _save_hf(self, step: int) -> None:
        """Export the model as a Hugging Face folder (safetensors + index + config) step."""
        if self.hf_adapter is None:
            raise CheckpointError(
                "--checkpoint.last_save_in_hf needs the model family's state-dict adapter "
                "(hf_adapter=)"
            )
        self.wait()
        tmp = self._begin(step)
        weight_map, nbytes = self._write_owned_shards(tmp)
        gathered = self._all_gather((weight_map, nbytes))
        if self._rank == 0:
            merged = {k: v for wm, _ in gathered for k, v in wm.items()}
            hf.write_index(tmp, merged, total_size=sum(n for _, n in gathered))
            self._write_hf_config(tmp, self.config.export_dtype)
            for path in self.hf_export_files:
                shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))
        self._finish(step, self._manifest(step, "hf", ["model"], True, self.config.export_dtype))
        logger.info("exported step %d as Hugging Face safetensors to %s", step,
                    layout.step_path(self.folder, step))

    def _write_hf_config(self, folder: str, dtype: Any) -> None:
        """The model's `config.json` in `folder`: the adapter's, the trainer's overrides, and
        the keys of the Hugging Face folder the run started from (`hf.write_config`)."""
        source = self.config.initial_load_path if self.config.initial_load_in_hf else None
        hf.write_config(folder, self.hf_adapter, dtype, overrides=self.hf_config_overrides,
                        source=source if source and os.path.isdir(source) else None)

    def _write_owned_shards(self, folder: str) -> tuple[dict[str, str], int]:
        """Write the safetensors files of the weights this rank owns in an HF export; return
        their weight map and byte count.

        Each weight is written once, by the lowest rank holding it. Sharded weights are
        gathered one at a time, in the same sorted order on every rank of their mesh (the
        gathers are collectives), and each file is written as soon as its last weight is
        gathered: the memory an export takes is one file's tensors, in the export dtype, not
        the whole model on the writing rank. The files are planned from the weights' sizes
        first, so every rank knows the total count that the file names carry.
        """
        dtype = self.config.export_dtype
        sd = _without_aliases(self.model.state_dict())
        keys = sorted(sd)
        owner: dict[str, int] = {}
        for rank, rank_keys in enumerate(self._all_gather(keys)):
            for key in rank_keys:
                owner.setdefault(key, rank)
        sizes = {key: sd[key].numel() * hf.export_dtype(sd[key], dtype).itemsize
                 for key in keys if owner[key] == self._rank}
        files = hf.plan_shards_by_size(sizes, self.hf_max_shard_bytes) if sizes else []
        counts = self._all_gather(len(files))
        first, total = sum(counts[: self._rank]), sum(counts)
        last_of = {file[-1]: index for index, file in enumerate(files)}
        pending: dict[str, torch.Tensor] = {}
        weight_map: dict[str, str] = {}
        nbytes = 0
        for key in keys:
            value = sd[key]
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if owner[key] != self._rank:
                continue
            pending[key] = value.detach().to(device="cpu", dtype=hf.export_dtype(value, dtype))
            if key in last_of:
                hf_sd = hf.to_hf_tensors(pending, self.hf_adapter, dtype)
                weight_map.update(hf.write_shards(hf_sd, [sorted(hf_sd)], folder, first=first + last_of[key], total=total))
                nbytes += hf._nbytes(hf_sd.values())
                pending.clear()
        return weight_map, nbytes

    # ----------------------------------------------------------------------------- publish

    def _begin(self, step: int) -> str:
        """Rank 0 clears the step's temporary folder (and, on a run sent back to an earlier
        step, sets the abandoned steps aside); everyone waits for it."""
        self._set_aside_abandoned_steps()
        if self._rank == 0:
            layout.prepare_tmp(self.folder, step)
        self._barrier()
        return layout.tmp_path(self.folder, step)

    def _finish(self, step: int, manifest: dict[str, Any]) -> None:
        """Every rank has written: rank 0 publishes the step and schedules the purge."""
        self._barrier()
        if self._rank == 0:
            if manifest["format"] == "dcp" and self.hf_adapter is not None:
                # The model's HF config travels with its weights: tools/convert_hf.py to-hf
                # needs no flags to describe the model (plain JSON, like the manifest).
                self._write_hf_config(layout.tmp_path(self.folder, step), manifest["dtype"] or "float32")
            layout.publish(self.folder, step, manifest)
            self._purges.append(self._purger.submit(self._purge, step))
        self._barrier()  # nobody goes on before the step is visible

    def _purge(self, step: int) -> None:
        """Background on rank 0: retention and crash leftovers (never fails the run)."""
        try:
            removed = layout.purge(self.folder, keep_latest_k=self.config.keep_latest_k,
                                   up_to_step=step)
            if removed:
                logger.info("purged old steps %s", removed)
        except OSError as err:
            logger.warning("could not purge old checkpoints in %s: %s", self.folder, err)

    def _manifest(self, step: int, fmt: str, states: list[str], model_only: bool,
                  dtype: str | None) -> dict[str, Any]:
        return layout.make_manifest(step, fmt=fmt, states=states, model_only=model_only,
                                    world_size=self._world_size, dtype=dtype, run=self.run_facts)

    def _barrier(self) -> None:
        if self._pg is not None:
            dist.barrier(group=self._pg)

    def _all_gather(self, obj: Any) -> list[Any]:
        """`obj` from every rank over the checkpoint group (small metadata only)."""
        if self._pg is None:
            return [obj]
        out: list[Any] = [None] * self._world_size
        dist.all_gather_object(out, obj, group=self._pg)
        return out

    # ----------------------------------------------------------------------------- drain

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and published; re-raise its
        failure here, in the training thread."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        future.result()  # a failure is already a CheckpointError naming the step

    def close(self) -> None:
        """Drain the save in flight and the purges, then release threads and buffers."""
        try:
            self.wait()
        finally:
            for future in self._purges:
                future.result()
            self._purges.clear()
            self._saver.shutdown(wait=True)
            self._purger.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._pg is not None:
                dist.destroy_process_group(self._pg)
                self._pg = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor entries are read with `weights_only=True`.

    DCP stores non-tensor values (ints, lists, ...) with `torch.save`; its default planner reads
    them back with full unpickling, which could run code from a crafted checkpoint.
    """

    def load_bytes(self, read_item: Any, value: Any) -> None:
        """Read one non-tensor entry without executing code."""
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except Exception as err:
            raise CheckpointError(
                f"checkpoint entry '{read_item.dest_index.fqn}' is not plain data (tensors, "
                f"numbers, strings, lists, dicts); titan does not unpickle objects: {err}"
            ) from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _check_entries(name: str, expected: dict[str, Any], saved: Any, path: str) -> None:
    """Every entry state `name` needs is in the checkpoint with the right shape."""
    if name not in RESERVED:
        if any(k not in saved for k in expected):
            held, wanted = _differing_keys(name, expected, saved)
            if not held:  # the writing run kept nothing there: not a layout or format question
                raise CheckpointError(
                    f"{path} holds nothing of state '{name}': the run that wrote it did not use it (a feature "
                    f"this run turns on, e.g. RL's KL reference with --rl.kl_coef), or an older titan did not save "
                    f"it. Resume with the flags that wrote it, or pass --checkpoint.exclude_from_loading {name} to "
                    f"start '{name}' fresh in this run."
                )
            raise CheckpointError(
                f"{path}: the saved entries of state '{name}' do not match what this run's "
                f"'{name}' expects: saved keys {_shown(held)}, expected {_shown(wanted)}. It was "
                "probably written under a different parallel layout, or in an older format of "
                f"'{name}'; pass --checkpoint.exclude_from_loading {name} to start it fresh, or resume "
                "with the layout and version that wrote it."
            )
    check_state_matches(name, expected, saved, where=path)


def _differing_keys(
    name: str, expected: dict[str, Any], saved: Any
) -> tuple[list[str], list[str]]:
    """(saved, expected) keys of state `name`, relative to it, cut at the shallowest depth
    where the two differ: the top-level keys when the structure changed, deeper ones when
    only a nested part did."""
    prefix = f"{name}."
    want = [k.removeprefix(prefix).split(".") for k in expected]
    have = [k.removeprefix(prefix).split(".") for k in saved if k.startswith(prefix)]
    deepest = max(len(parts) for parts in want + have)
    for depth in range(1, deepest + 1):
        held = sorted({".".join(parts[:depth]) for parts in have})
        wanted = sorted({".".join(parts[:depth]) for parts in want})
        if held != wanted:
            break
    return held, wanted


def _shown(keys: list[str], limit: int = 8) -> str:
    """`keys` as a list literal, cut after `limit` entries."""
    if len(keys) <= limit:
        return str(keys)
    return f"{str(keys[:limit])[:-1]}, ... and {len(keys) - limit} more]"


def _make_writer(path: str) -> FileSystemWriter:
    """The DCP writer of a step folder (a seam tests use to inject failures)."""
    return FileSystemWriter(path, single_file_per_rank=True, sync_files=True)


@contextlib.contextmanager
def _save_errors(step: int, tmp: str) -> Iterator[None]:
    """Turn a failed write (DCP raises a BaseException subclass) into a CheckpointError."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:
        raise CheckpointError(
            f"saving step {step} failed: {_failure_summary(err)}. Nothing was published: the "
            f"previous complete step is still loadable and the partial {tmp} is ignored."
        ) from err


def _failure_summary(err: BaseException) -> str:
    """One line per failed rank instead of DCP's stacked tracebacks."""
    if isinstance(err, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in err.failures.items()
        )
    return f"{type(err).__name__}: {err}"


@contextlib.contextmanager
def _load_errors(path: str) -> Iterator[None]:
    """Turn DCP's load failure (a BaseException subclass) into a CheckpointError."""
    try:
        yield
    except CheckpointException as err:
        causes = [exc for exc, _ in err.failures.values()]
        mine = next((c for c in causes if isinstance(c, CheckpointError)), None)
        if mine is not None:  # already a clear message (e.g. a refused pickled entry)
            raise CheckpointError(str(mine)) from err
        raise CheckpointError(f"loading {path} failed: {_failure_summary(err)}") from err


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """Silence DCP's "assuming single process" warning, which is the intent without a group."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _checkpoint_group(timeout: timedelta | None) -> dist.ProcessGroup | None:
    """A gloo group of all ranks for checkpoint traffic.

    Its own group keeps background-save collectives off the training group (collectives on
    one group from two threads could interleave), and gloo works on every device type.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=timeout)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    """Cast floating-point tensors (DTensors included); leave everything else."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(dtype)
    return value


class _Progress:
    """A log line on long work (a large model's Hugging Face import): at most one per
    `every_s` seconds, saying how far it got."""

    def __init__(self, what: str, *, total: int, every_s: float = 30.0) -> None:
        self.what, self.total, self.every_s = what, total, every_s
        self.done, self.start = 0, time.monotonic()
        self.last = self.start

    def advance(self, nbytes: int) -> None:
        """One more unit done, `nbytes` in all so far."""
        self.done += 1
        now = time.monotonic()
        if now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            logger.info("%s: %d of %d blocks, %.2f GiB, %.0fs", self.what, self.done, self.total,
                        nbytes / 2**30, now - self.start)


def _without_aliases(state_dict: dict[str, Any]) -> dict[str, Any]:
    """`state_dict` with each tensor under one name: a tied weight (the output sharing the
    embedding) is kept under its first name in sorted order, which the family's adapter
    writes as the shared matrix. An export planned per name would otherwise write it twice."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    unique = {}
    for key in sorted(state_dict):
        value = state_dict[key]
        local = value.to_local() if isinstance(value, DTensor) else value
        if isinstance(local, torch.Tensor) and local.numel():
            identity = (local.data_ptr(), tuple(value.shape))
            if identity in seen:
                continue
            seen.add(identity)
        unique[key] = value
    return unique
