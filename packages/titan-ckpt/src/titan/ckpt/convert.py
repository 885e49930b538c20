"""Single-process conversions between a DCP model checkpoint and plain state dicts, the other
half of DCP <-> Hugging Face conversion (see `tools/convert_hf.py`)."""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed.checkpoint as dcp
from titan.ckpt import layout
from titan.ckpt.errors import CheckpointError
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["load_dcp_model", "save_dcp_model", "resolve_step_folder"]

MODEL_PREFIX = "model."


def resolve_step_folder(path: str) -> str:
    """A DCP step folder itself, or the latest complete step of a checkpoint folder."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return path
    steps = layout.complete_steps(path)
    if steps:
        return layout.step_path(path, steps[-1])
    raise CheckpointError(
        f"{path} is neither a DCP step folder (no .metadata) nor a checkpoint folder with "
        "complete step-<N> folders"
    )


def load_dcp_model(path: str) -> dict[str, torch.Tensor]:
    """The full model weights (`{fqn: tensor}` on CPU) of a DCP checkpoint, without a model:
    the tensors are allocated from the checkpoint's metadata."""
    folder = resolve_step_folder(path)
    reader = FileSystemReader(folder)
    metadata = reader.read_metadata().state_dict_metadata
    template = {
        key[len(MODEL_PREFIX):]: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
    }
    if not template:
        raise CheckpointError(f"{folder} holds no model weights (no 'model.*' entries)")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": template}, storage_reader=reader, no_dist=True)
    return template


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
