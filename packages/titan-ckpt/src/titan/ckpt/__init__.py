"""titan.ckpt: DCP checkpoints (sync/async, atomic, resharding, retention) and Hugging Face
safetensors import/export through a model family's state-dict adapter."""

from titan.ckpt.config import CheckpointConfig
from titan.ckpt.convert import load_dcp_model, save_dcp_model
from titan.ckpt.errors import CheckpointError
from titan.ckpt.hf import StateDictAdapter, load_hf, save_hf
from titan.ckpt.manager import CheckpointManager
from titan.ckpt.stateful import (
    ModelWrapper,
    OptimizerWrapper,
    RankLocal,
    RNGState,
    TrainState,
    copy_whole_weights,
    plain_tensor,
    shard_like,
)

__all__ = [
    "CheckpointConfig",
    "CheckpointError",
    "CheckpointManager",
    "ModelWrapper",
    "OptimizerWrapper",
    "RNGState",
    "RankLocal",
    "StateDictAdapter",
    "TrainState",
    "load_dcp_model",
    "plain_tensor",
    "copy_whole_weights",
    "load_hf",
    "save_dcp_model",
    "save_hf",
    "shard_like",
]
