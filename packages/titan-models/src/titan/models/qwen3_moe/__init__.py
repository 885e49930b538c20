"""Qwen3-MoE family (30B-A3B, 235B-A22B): args, flavors, model, HF adapter."""

from titan.models.qwen3_moe.adapter import Qwen3MoeStateDictAdapter
from titan.models.qwen3_moe.args import QWEN3_MOE_FLAVORS, Qwen3MoeArgs
from titan.models.qwen3_moe.model import Qwen3MoeModel, build_qwen3_moe

__all__ = ["QWEN3_MOE_FLAVORS", "Qwen3MoeArgs", "Qwen3MoeModel", "Qwen3MoeStateDictAdapter", "build_qwen3_moe"]
