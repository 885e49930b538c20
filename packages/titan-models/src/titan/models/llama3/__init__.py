"""Llama 3 family (3.1 and 3.2 sizes): args, flavors, model, HF adapter."""

from titan.models.llama3.adapter import Llama3StateDictAdapter
from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args
from titan.models.llama3.model import Llama3Model, TransformerBlock, build_llama3

__all__ = [
    "LLAMA3_FLAVORS",
    "Llama3Args",
    "Llama3Model",
    "Llama3StateDictAdapter",
    "TransformerBlock",
    "build_llama3",
]
