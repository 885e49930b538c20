"""Qwen3 dense family (0.6B ... 32B): args, flavors, model, HF adapter."""

from titan.models.qwen3.adapter import Qwen3StateDictAdapter
from titan.models.qwen3.args import QWEN3_FLAVORS, Qwen3Args
from titan.models.qwen3.model import Qwen3Model, build_qwen3

__all__ = ["QWEN3_FLAVORS", "Qwen3Args", "Qwen3Model", "Qwen3StateDictAdapter", "build_qwen3"]
