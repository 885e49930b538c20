"""Rollout generators: the interface and the native torch generator over titan.models."""

from titan.rl.generate.base import Completion, FinishReason, Generator, SamplingConfig
from titan.rl.generate.native import NativeGenerator

__all__ = ["Completion", "FinishReason", "Generator", "NativeGenerator", "SamplingConfig"]
