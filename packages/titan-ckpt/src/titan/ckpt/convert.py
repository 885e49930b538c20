"""Single-process conversions between a DCP model checkpoint and plain state dicts, the other
half of DCP <-> Hugging Face conversion (see `tools/convert_hf.py`)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from titan.ckpt import layout, torchtitan
from titan.ckpt.errors import CheckpointError
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["load_dcp_model", "save_dcp_model", "resolve_step_folder"]

MODEL_PREFIX = "model."


def resolve_step_folder(path: str) -> str:
    """A DCP step folder itself, or the latest step of a checkpoint folder (titan's complete
    steps, else torchtitan's)."""
    folder = layout.newest_step_folder(path)
    if os.path.isfile(os.path.join(folder, ".metadata")):
        return folder
    raise CheckpointError(
        f"{path} is neither a DCP step folder (no .metadata) nor a checkpoint folder with "
        "complete step-<N> folders"
    )


def load_dcp_model(path: str, adapter: Any | None = None) -> dict[str, torch.Tensor]:
    """The full model weights (`{fqn: tensor}` on CPU, titan's names and layout) of a DCP
    checkpoint, titan's or torchtitan's (`titan.ckpt.torchtitan`), without a model: the tensors
    are allocated from the checkpoint's metadata. A torchtitan checkpoint's entries in another
    layout than titan's (Qwen3's q/k rows) are converted by the family `adapter`
    (``torchtitan_layout_keys`` / ``from_torchtitan``); pass it for those families."""
    folder = resolve_step_folder(path)
    reader = FileSystemReader(folder)
    metadata = reader.read_metadata().state_dict_metadata
    flat = torchtitan.is_torchtitan_layout(metadata)
    if flat:
        names = {torchtitan.titan_name(k): k for k in torchtitan.model_entries(metadata)}
    else:
        names = {k[len(MODEL_PREFIX):]: k for k in metadata if k.startswith(MODEL_PREFIX)}
    names = {name: key for name, key in names.items() if isinstance(metadata[key], TensorStorageMetadata)}
    if not names:
        raise CheckpointError(f"{folder} holds no model weights (no 'model.*' entries)")
    # DCP keys the request by the saved names: flat for torchtitan, under "model" for titan.
    template = {key: torch.empty(tuple(metadata[key].size), dtype=metadata[key].properties.dtype)
                for key in names.values()}
    request = template if flat else {
        "model": {key[len(MODEL_PREFIX):]: value for key, value in template.items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(request, storage_reader=reader, no_dist=True)
    weights = {name: template[key] for name, key in names.items()}
    relayout = torchtitan.relayout_keys(adapter, weights) if flat else []
    if relayout:
        weights.update(adapter.from_torchtitan({k: weights[k] for k in relayout}))
    return weights


def save_dcp_model(state_dict: dict[str, torch.Tensor], folder: str, *, step: int = 0) -> str:
    """Write model weights as a model-only DCP step folder (loadable by `CheckpointManager`,
    e.g. as `--checkpoint.initial_load_path`); returns the folder."""
    if os.path.exists(folder) and os.listdir(folder):
        raise CheckpointError(f"{folder} is not empty; convert into a new folder")
    os.makedirs(folder, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": state_dict}, storage_writer=FileSystemWriter(folder), no_dist=True)
    manifest = layout.make_manifest(step, fmt="dcp", states=["model"], model_only=True,
                                    world_size=1)
    layout.write_manifest(folder, manifest)
    return folder
