"""Hugging Face safetensors import and export through a model family's state-dict adapter.

An adapter is any object with `to_hf(sd) -> sd`, `from_hf(sd) -> sd` and `hf_config() -> dict`
(the `config.json` transformers needs). The adapter must convert any subset of keys on its own
(a per-key mapping): under pipeline parallelism each rank exports only the weights it holds.

Layout written (what `transformers.AutoModelForCausalLM.from_pretrained` reads):

    model-00001-of-0000K.safetensors ...   weights, split at `max_shard_bytes`
    model.safetensors.index.json           {"metadata": {"total_size": ...}, "weight_map": {...}}
    config.json                            adapter.hf_config()
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Container, Iterable, Iterator
from typing import Any, Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from titan.ckpt.errors import CheckpointError

__all__ = ["StateDictAdapter", "save_hf", "load_hf", "DTYPES", "INDEX_FILE", "SINGLE_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Keys of a source checkpoint's config.json an export keeps over the adapter's: the tokens the
# pretrained model begins, ends and pads with (an adapter knows only its family's usual ones).
SOURCE_WINS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Keys never carried from a source config: the export states its own dtype and writer, and
# its weights are not quantized (a source's fp8 scheme was dequantized on import).
NOT_CARRIED = ("dtype", "torch_dtype", "transformers_version", "_name_or_path", "quantization_config")
logger = logging.getLogger(__name__)
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class StateDictAdapter(Protocol):
    """What titan.ckpt needs from a model family to speak Hugging Face."""

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """titan names/layouts -> Hugging Face names/layouts."""

    def from_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Hugging Face names/layouts -> titan names/layouts."""

    def hf_config(self) -> dict[str, Any]:
        """The `config.json` that transformers builds the model from."""


def save_hf(
    state_dict: dict[str, torch.Tensor],
    folder: str,
    adapter: StateDictAdapter | None = None,
    dtype: torch.dtype | str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config_source: str | None = None,
) -> dict[str, str]:
    """Write a titan model state dict as a Hugging Face folder; return the weight map.

    `adapter` converts names (None keeps them); `dtype` casts floating-point tensors (None
    keeps theirs). Writes `config.json` when an adapter is given, completed from the folder
    `config_source` when given (`write_config`'s `source`).
    """
    hf_sd = to_hf_tensors(state_dict, adapter, dtype)
    os.makedirs(folder, exist_ok=True)
    groups = plan_shards(hf_sd, max_shard_bytes)
    weight_map = write_shards(hf_sd, groups, folder, first=0, total=len(groups))
    write_index(folder, weight_map, total_size=_nbytes(hf_sd.values()))
    if adapter is not None:
        # The weights' own dtype when not cast (all floating tensors share one in practice).
        floats = [t.dtype for t in hf_sd.values() if t.is_floating_point()]
        write_config(folder, adapter, dtype or (floats[0] if floats else None), source=config_source)
    return weight_map


def load_hf(folder: str, adapter: StateDictAdapter | None = None) -> dict[str, torch.Tensor]:
    """Read a Hugging Face safetensors folder (sharded with an index, or one file) into a
    titan-named state dict on CPU (`adapter.from_hf`; None keeps the names)."""
    files = hf_weight_files(folder)
    hf_sd: dict[str, torch.Tensor] = {}
    for path in files:
        # safe_open parses a JSON header and raw buffers: no code runs while loading.
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                hf_sd[key] = f.get_tensor(key)
    return adapter.from_hf(hf_sd) if adapter is not None else hf_sd


def check_hf_config(folder: str, adapter: StateDictAdapter) -> None:
    """Refuse a Hugging Face folder whose `config.json` describes another model than the one
    `adapter` converts for: matching tensor shapes do not prove the same model (a different
    `rope_theta`, `rms_norm_eps` or activation loads and silently computes another function).
    Adapters without `config_differences` and folders without `config.json` (weights
    only) are not checked; the second is logged."""
    differences = getattr(adapter, "config_differences", None)
    if differences is None:
        return
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        logger.warning("%s has no %s: only the tensor shapes are checked, not RoPE, norm or activation settings",
                       folder, CONFIG_FILE)
        return
    try:
        with open(path) as f:
            config = json.load(f)
        lines = differences(config)
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        detail = f"missing key {err}" if isinstance(err, KeyError) else str(err)
        raise CheckpointError(f"{path} cannot be read as this model family's config: {detail}") from err
    if lines:
        raise CheckpointError(
            f"{path} describes another model than this run's: " + "; ".join(lines)
            + ". Choose the family and flavor the checkpoint is (--model.name, --model.flavor) "
            "or override the differing sizes (--model.n_layers, --model.dim, --model.n_heads, "
            "--model.n_kv_heads, --model.vocab_size)"
        )


# A parameter inside transformer block i: titan's `layers.i.` and the Hub's `model.layers.i.`.
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(key: str) -> int | None:
    """The block a parameter name belongs to (`...layers.<i>.`), None outside the blocks."""
    match = _LAYER.search(key)
    return int(match.group(1)) if match else None


def read_hf_layers(folder: str, layers: Container[int | None] | None = None,
                   ) -> Iterator[tuple[int | None, dict[str, torch.Tensor]]]:
    """The tensors of a Hugging Face folder one block at a time (`(i, {name: tensor})`, the
    tensors outside the blocks first as block None), reading only the blocks in `layers` (all
    when None). Memory holds one block at a time, where `load_hf` holds the whole model: what
    lets every rank of a large job import a Hub checkpoint (a 70B model is 140 GB in bf16, per
    rank), and a pipeline stage read only its own blocks."""
    files: dict[int | None, dict[str, list[str]]] = {}
    for path in hf_weight_files(folder):
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                files.setdefault(layer_of(key), {}).setdefault(path, []).append(key)
    order = sorted(files, key=lambda layer: -1 if layer is None else layer)
    for layer in order:
        if layers is not None and layer not in layers:
            continue
        group: dict[str, torch.Tensor] = {}
        for path, keys in files[layer].items():
            with safe_open(path, framework="pt", device="cpu") as f:
                group.update((key, f.get_tensor(key)) for key in keys)
        yield layer, group


def hf_weight_files(folder: str) -> list[str]:
    """The safetensors files of a Hugging Face folder, or a clear error if it is not one."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
        if missing:
            raise CheckpointError(
                f"{index} names {missing} but they are not in {folder}: the download or copy "
                "is incomplete"
            )
        return [os.path.join(folder, name) for name in files]
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    pickles = sorted(name for name in os.listdir(folder) if name.startswith("pytorch_model") and name.endswith(".bin")) \
        if os.path.isdir(folder) else []
    if pickles:
        raise CheckpointError(
            f"{folder} holds its weights as PyTorch pickles ({pickles[0]}), which titan does not read: "
            "loading a pickle can run any code it carries. Convert it once to safetensors, e.g. "
            "`AutoModelForCausalLM.from_pretrained(folder).save_pretrained(out)` with transformers, "
            "and point --checkpoint.initial_load_path at the result."
        )
    raise CheckpointError(
        f"{folder} is not a Hugging Face checkpoint: it has neither {INDEX_FILE} nor "
        f"{SINGLE_FILE}. Point --checkpoint.initial_load_path at the folder holding the "
        "safetensors files (or drop --checkpoint.initial_load_in_hf for a DCP checkpoint)."
    )


def export_dtype(tensor: torch.Tensor, dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype `tensor` is written in: `dtype` for floating-point tensors (when given)."""
    target = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return target if target is not None and tensor.is_floating_point() else tensor.dtype


def to_hf_tensors(
    state_dict: dict[str, torch.Tensor],
    adapter: StateDictAdapter | None,
    dtype: torch.dtype | str | None,
) -> dict[str, torch.Tensor]:
    """Convert names through the adapter and cast floating-point tensors to `dtype`."""
    hf_sd = adapter.to_hf(dict(state_dict)) if adapter is not None else dict(state_dict)
    target = DTYPES[dtype] if isinstance(dtype, str) else dtype
    out = {}
    for key, tensor in hf_sd.items():
        if target is not None and tensor.is_floating_point():
            tensor = tensor.to(target)
        # safetensors needs contiguous, unaliased CPU tensors: the copy also splits a tensor
        # held under two names (tied weights exported without an adapter, which would keep
        # both names; a family adapter writes the Hub layout, e.g. no lm_head when tied).
        out[key] = tensor.detach().to("cpu").contiguous().clone()
    return out


def plan_shards(state_dict: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Group keys (in sorted order) into files of at most `max_shard_bytes` each (a tensor
    larger than the limit gets a file of its own)."""
    return plan_shards_by_size({key: _nbytes([t]) for key, t in state_dict.items()}, max_shard_bytes)


def plan_shards_by_size(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """`plan_shards` from each key's byte count alone: a plan made before any tensor exists
    (an export that writes each file as soon as its tensors are gathered)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
    groups: list[list[str]] = []
    size = 0
    for key in sorted(sizes):
        nbytes = sizes[key]
        if not groups or size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def shard_name(index: int, total: int) -> str:
    """Hugging Face's shard file name (1-based)."""
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def write_shards(
    state_dict: dict[str, torch.Tensor], groups: list[list[str]], folder: str, *,
    first: int, total: int,
) -> dict[str, str]:
    """Write `groups` as shard files numbered from `first` of `total`; return key -> file."""
    weight_map = {}
    for offset, keys in enumerate(groups):
        name = shard_name(first + offset, total)
        # "format": "pt" is the metadata transformers checks for PyTorch safetensors.
        save_file({k: state_dict[k] for k in keys}, os.path.join(folder, name),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, name))
    return weight_map


def write_index(folder: str, weight_map: dict[str, str], *, total_size: int) -> None:
    """Write `model.safetensors.index.json` (always, even for one shard: one loading path)."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)


def write_config(folder: str, adapter: StateDictAdapter, dtype: torch.dtype | str | None = None, *,
                 overrides: dict[str, Any] | None = None, source: str | None = None) -> None:
    """Write the adapter's `config.json`; `dtype` (the dtype of the written weights) replaces
    its `torch_dtype`, which transformers 5 loads the weights in by default.

    `overrides` replace the adapter's keys (e.g. `max_position_embeddings`: the model's context,
    where the adapter knows only the length this run trained at). `source`, the Hugging Face
    folder the run started from, lends the keys the adapter does not write (its special tokens,
    `initializer_range`, ...) and its `generation_config.json`, so that the export generates
    and stops like the model it came from; its `SOURCE_WINS` keys win over the adapter's."""
    config = {**adapter.hf_config(), **(overrides or {})}
    if source is not None:
        config = _with_source_keys(config, source)
        generation = os.path.join(source, GENERATION_CONFIG_FILE)
        if os.path.isfile(generation):
            shutil.copyfile(generation, os.path.join(folder, GENERATION_CONFIG_FILE))
    if dtype is not None:
        config["torch_dtype"] = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)


def _with_source_keys(config: dict[str, Any], source: str) -> dict[str, Any]:
    """`config` completed from `source`'s `config.json` (when it has one): keys `config` lacks
    and the `SOURCE_WINS` keys are taken from the source (unless null there), `NOT_CARRIED`
    ones never."""
    path = os.path.join(source, CONFIG_FILE)
    if not os.path.isfile(path):
        return config
    with open(path) as f:
        base = json.load(f)
    carried = {k: v for k, v in base.items() if k not in NOT_CARRIED}
    # a source's null id says nothing: the run's tokenizer's stands (generate stops there)
    return {**carried, **config, **{k: base[k] for k in SOURCE_WINS if base.get(k) is not None}}


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
