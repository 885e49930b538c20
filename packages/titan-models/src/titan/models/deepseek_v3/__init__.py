"""DeepSeek-V3 family (16B-class, 671B): args, flavors, model, HF adapter."""

from titan.models.deepseek_v3.adapter import DeepseekV3StateDictAdapter
from titan.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS, DeepseekV3Args
from titan.models.deepseek_v3.model import DeepseekV3Model, build_deepseek_v3

__all__ = [
    "DEEPSEEK_V3_FLAVORS",
    "DeepseekV3Args",
    "DeepseekV3Model",
    "DeepseekV3StateDictAdapter",
    "build_deepseek_v3",
]
