"""One vLLM engine sharded over the 2 ranks of this launch (`--generator.tensor_parallel_size
2`) per family named, one after the other, checked against the native
generator on each rank (run by test_vllm_generator.py): writes ``<out>/<family>-rank<r>.json``
with each rank's greedy completions, the shape of the attention output projection it
holds and whether the weights gathered back equal the ones loaded."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from titan.rl.generate import NativeGenerator, SamplingConfig
from titan.rl.generate.vllm import VLLMGenerator

from titan.recipes.families import model_spec

# Per family: its tiny flavor, at 4 query heads (2 a rank) where the flavor has fewer; Qwen3's
# per-head norms, the MoE's replicated experts and DeepSeek-V3's latent attention are sharded
# as the trainer shards them.
FAMILIES = {
    "llama3": ("debugmodel_tiny", {"dim": 128, "n_heads": 4, "n_kv_heads": 2, "n_layers": 2}),
    "qwen3_moe": ("debugmodel", {"n_heads": 4, "n_kv_heads": 2}),
    "deepseek_v3": ("debugmodel_tiny", {}),
}
# Each rank its own prompts: the engine runs both ranks' at once and hands each its own.
PROMPTS = [[[5, 17, 33, 2, 9], [100, 101, 102]], [[7, 8, 9, 10], [1, 2, 3]]]


def main(out: str, tensor_parallel_size: int, families: list[str]) -> None:
    dist.init_process_group("gloo")
    for family in families:  # engines built and closed in turn (each run's groups are new)
        check_family(out, tensor_parallel_size, family, dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


def check_family(out: str, tensor_parallel_size: int, family: str, rank: int) -> None:
    """Build ``family``'s engine, load, generate, gather back; write this rank's results."""
    spec = model_spec(family)
    flavor, overrides = FAMILIES[family]
    overrides = {"vocab_size": 320, "max_seq_len": 64, **overrides}
    torch.manual_seed(0)
    model = spec.build(flavor, **overrides)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    engine = VLLMGenerator.from_model_spec(
        spec, flavor, overrides=overrides, kv_cache_memory_bytes=16 << 20, max_num_seqs=8,
        tensor_parallel_size=tensor_parallel_size, engine_args={"distributed_executor_backend": "external_launcher"})
    engine.load_weights(model.state_dict().items(), version=1)
    held = engine.llm.apply_model(lambda m: m.model.layers["0"].attention.wo.weight)[0]
    native = NativeGenerator.from_model_spec(spec, flavor, overrides=overrides, device=torch.device("cpu"))
    native.load_weights(model.state_dict().items(), version=1)
    greedy = SamplingConfig(n=1, temperature=0.0, max_new_tokens=8)
    prompts = PROMPTS[rank]
    mine, reference = engine.generate(prompts, greedy), native.generate(prompts, greedy)
    gathered = dict(engine.named_weights())
    result = {
        "collective": engine.collective,
        "wo_held": list((held.to_local() if hasattr(held, "to_local") else held).shape),
        "wo_whole": list(held.shape),
        "greedy": [g[0].token_ids for g in mine], "native": [g[0].token_ids for g in reference],
        "logprob_diff": max(abs(a - b) for g, r in zip(mine, reference, strict=True)
                            for a, b in zip(g[0].logprobs, r[0].logprobs, strict=True)),
        "gathered_equal": all(torch.equal(gathered[k], v) for k, v in model.state_dict().items()),
        "nothing": engine.generate([], greedy),
    }
    with open(f"{out}/{family}-rank{rank}.json", "w") as f:
        json.dump(result, f)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","))
