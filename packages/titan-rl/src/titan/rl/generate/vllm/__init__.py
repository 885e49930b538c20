"""vLLM as titan's rollout generator, running titan's own model code (``--generator.kind vllm``).

Importing this package imports vLLM (install the ``titan-rl[vllm]`` extra; on a CPU machine,
vLLM's CPU build). `VLLMGenerator` implements the `Generator` protocol; `models` holds the vLLM
model classes of titan's families and `plugin` registers them with vLLM.
"""

from titan.rl.generate.vllm.generator import VLLMGenerator

__all__ = ["VLLMGenerator"]
