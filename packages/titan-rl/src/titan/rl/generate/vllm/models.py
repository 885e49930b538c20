"""titan's model families as vLLM models: the `titan.models` decoder itself, with only its inner
attention swapped for vLLM's paged-KV-cache `Attention`.

vLLM hands a model one packed 1-D stream of tokens (every running sequence's new tokens side by
side) with each token's position. A titan decoder runs it as a batch of one row: RoPE rows are
gathered at the given positions, and each block's `inner_attention` (the module context
parallelism also replaces) becomes `PagedAttention`, which reshapes q/k/v to vLLM's
[tokens, heads x head_dim] layout and lets vLLM's kernel attend over the paged cache, where the
sequence boundaries live. Projections, norms, RoPE, the MoE and the weights' names are
titan's: `load_weights` takes titan names (the trainer's `full_state_dict`, buffers included)
or, when vLLM loads a Hub checkpoint from disk, Hugging Face names through the family's adapter.

Under vLLM's tensor parallel (``tensor_parallel_size`` N > 1, ranks run by the
``external_launcher`` executor) the decoder is sharded over vLLM's TP group by the family's
own sharding plan, as titan's trainer shards it (`titan.dist.tensor_parallel`, without
sequence or loss parallel): each rank holds 1/N of the attention and MLP projections and of
the vocabulary, runs N-th of the heads through the paged kernel (so each caches 1/N of the
keys and values), and the output's logits are gathered whole, identical on every rank, so each
rank's sampler draws the same tokens. Full weights are cut to each rank's shard as they load.

Each class is registered with vLLM under its own name (`titan.rl.generate.vllm.plugin`) and
chosen by the `architectures` entry of the model folder's `config.json`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from titan.dist.plan import sharding_plan
from titan.dist.tensor_parallel import apply_tensor_parallel
from titan.models.common.decoder import Decoder
from titan.models.deepseek_v3 import DeepseekV3Model, DeepseekV3StateDictAdapter
from titan.models.llama3 import Llama3Model, Llama3StateDictAdapter
from titan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter
from titan.models.qwen3_moe import Qwen3MoeModel, Qwen3MoeStateDictAdapter
from titan.rl.generate.base import copy_weights_by_name
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from vllm.model_executor.layers.attention import Attention


def kernel_head_dim(head_dim: int, device_type: str) -> int:
    """The head size vLLM's attention kernel runs for a model's `head_dim`: on CPU the
    smallest size its kernels support that holds it (they take 32, 64, 80, ... only), else
    `head_dim` itself."""
    if device_type != "cpu":
        return head_dim
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    fitting = [size for size in CPUAttentionBackend.get_supported_head_sizes() if size >= head_dim]
    if not fitting:
        raise ValueError(f"vLLM's CPU attention has no kernel for head_dim {head_dim}")
    return min(fitting)


class PagedAttention(nn.Module):
    """titan's inner-attention contract (q [1, H, T, Dh], k/v [1, Hkv, T, Dh] -> [1, H, T, Dh])
    served by vLLM's paged `Attention` over the packed stream of tokens (causal within each
    sequence, over everything cached for it).

    When the kernel's head size exceeds the model's (`kernel_head_dim`), q, k and v are
    zero-padded to it and the output cut back: zero channels add nothing to q.k, and the
    softmax scale is the model's own, so the result is the unpadded attention. Values may be
    narrower than queries and keys (multi-head latent attention: v_head_dim < nope + rope):
    each is padded to the kernel's size, and the output cut back to the values' width."""

    def __init__(self, attn: Attention, head_dim: int) -> None:
        super().__init__()
        self.attn = attn
        self.pad = attn.head_size - head_dim
        """Zero channels added to each query/key head."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the one packed row; shapes as titan's `ScaledDotProductAttention`."""
        _, n_heads, tokens, _ = q.shape
        size = self.attn.head_size

        def packed(t: torch.Tensor) -> torch.Tensor:  # [1, H, T, Dh] -> [T, H * size]
            t = t[0].transpose(0, 1)
            pad = size - t.shape[-1]
            return (F.pad(t, (0, pad)) if pad else t).reshape(tokens, -1)

        out = self.attn(packed(q), packed(k), packed(v)).view(tokens, n_heads, size)
        return out[..., : v.shape[-1]].transpose(0, 1).unsqueeze(0)


class TitanForCausalLM(nn.Module):
    """A titan decoder run by vLLM (the vLLM model-class contract: `embed_input_ids`,
    `forward` on packed tokens returning hidden states [T, D], `compute_logits`,
    `load_weights`). Subclasses name the family: its model class and HF adapter."""

    MODEL_CLASS: ClassVar[type[Decoder]]
    ADAPTER: ClassVar[type[Llama3StateDictAdapter]]

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config.to_dict()
        args = self.ADAPTER.args_from_hf_config(hf_config)
        self._check_supported(vllm_config)
        self.model = self.MODEL_CLASS(args).eval()
        self.adapter = self.ADAPTER(args)
        # The titan names, taken before vLLM's attention (which has scale buffers) moves in.
        self._titan_names = tuple(self.model.state_dict())
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.tp_mesh = shard_over_vllm_tensor_parallel(self.model, tp, vllm_config.device_config.device.type)
        # Multi-head latent attention runs here as the per-head attention it expands to (the
        # cache holds per-head keys and values): values may be narrower than queries/keys.
        widest = max(args.head_dim, getattr(args, "v_head_dim", args.head_dim))
        head_size = kernel_head_dim(widest, vllm_config.device_config.device.type)
        for index, block in self.model.layers.items():
            name = f"{prefix}model.layers.{index}.attention.inner_attention.attn"
            block.attention.inner_attention = PagedAttention(
                Attention(
                    args.n_heads // tp,  # this rank's heads (all of them without TP)
                    head_size,
                    scale=args.head_dim**-0.5,  # the model's head_dim, even when padded
                    num_kv_heads=args.n_kv_heads // tp,
                    cache_config=vllm_config.cache_config,
                    prefix=name,
                ),
                args.head_dim,
            )

    @staticmethod
    def _check_supported(vllm_config: Any) -> None:
        """Refuse, by name, what this wrapper does not implement (rather than run it wrong)."""
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1:
            raise ValueError(
                "titan's vLLM models run without vLLM's pipeline parallel: pipeline_parallel_size must be 1 "
                f"(got {parallel.pipeline_parallel_size})"
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, D] of the packed token ids [T]."""
        return self.model.tok_embeddings(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, D] of the packed tokens at `positions` [T]."""
        if intermediate_tensors is not None:
            raise ValueError("titan's vLLM models do not run pipeline-parallel in vLLM")
        h = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        rope = self.model.rope_cache[positions].unsqueeze(0)  # one row: [1, T, Dh]
        h = h.unsqueeze(0)
        for block in self.model.layers.values():
            h = block(h, rope)
        return self.model.norm(h)[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of the hidden states vLLM samples from."""
        return self.model.output(hidden_states)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy every weight in, by titan name (streamed: the trainer's full tensors are never
        all held at once) or, when vLLM reads a Hub checkpoint from disk, by Hugging Face name
        (collected, then converted by the family's adapter). Every state_dict entry must be
        given (see `copy_weights_by_name`). Returns the parameter names set, as vLLM's loader
        expects."""
        weights = iter(weights)
        first = next(weights, None)
        if first is None:
            raise ValueError("load_weights got no weights")
        stream = itertools.chain([first], weights)
        if first[0] not in self._titan_names:
            stream = self.adapter.from_hf(dict(stream)).items()
        copy_weights_by_name(self.titan_state_dict(keep_vars=True), stream)
        return {name for name, _ in self.named_parameters()}

    def titan_state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The titan model's state dict by titan name (without vLLM's attention buffers);
        under tensor parallel each entry is a DTensor holding this rank's shard."""
        state = self.model.state_dict(keep_vars=keep_vars)
        return {name: state[name] for name in self._titan_names}

    def weight_elements(self) -> tuple[int, int]:
        """(elements this rank holds, elements of the whole model) over the titan weights:
        equal without tensor parallel, about 1/N of them held under N ranks."""
        tensors = self.titan_state_dict().values()
        held = sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors)
        return held, sum(t.numel() for t in tensors)

    def full_titan_state_dict(self) -> dict[str, torch.Tensor]:
        """The titan model's whole tensors by titan name (under tensor parallel gathered from
        the TP group's shards: every rank of the group must call it)."""
        return {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in self.titan_state_dict().items()}


_INFERENCE_TP = SimpleNamespace(enable_sequence_parallel=False, enable_loss_parallel=False,
                                enable_async_tensor_parallel=False)
"""Tensor parallel as vLLM runs it: replicated activations between blocks (vLLM's packed
token stream is one row whose length no rank count divides) and whole logits."""


def shard_over_vllm_tensor_parallel(model: Decoder, tp: int, device_type: str) -> DeviceMesh | None:
    """Shard ``model`` over vLLM's tensor-parallel group of ``tp`` ranks by its sharding plan
    (module docstring) and return that group's mesh; None (the model untouched) when ``tp`` is
    1. Refused, naming the sizes, when ``tp`` does not divide the heads or hidden units the
    plan splits."""
    if tp == 1:
        return None
    plan = sharding_plan(model)
    uneven = {name: size for name, size in plan.tensor_parallel_divisible.items() if size % tp}
    if uneven:
        raise ValueError(f"vLLM's tensor_parallel_size {tp} must divide the sizes tensor parallel splits evenly; "
                         f"it does not divide {uneven}")
    from vllm.distributed.parallel_state import get_tp_group

    group = get_tp_group().device_group
    # Named after its group: DTensor caches collectives by mesh, and meshes of the same ranks
    # and names compare equal, so a later engine's (the same process's next run) would
    # otherwise reuse an earlier engine's destroyed group.
    mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"vllm_tp_{group.group_name}",))
    apply_tensor_parallel(model, mesh, _INFERENCE_TP)
    return mesh


class TitanLlama3ForCausalLM(TitanForCausalLM):
    """`titan.models.llama3` run by vLLM."""

    MODEL_CLASS = Llama3Model
    ADAPTER = Llama3StateDictAdapter


class TitanQwen3ForCausalLM(TitanForCausalLM):
    """`titan.models.qwen3` run by vLLM."""

    MODEL_CLASS = Qwen3Model
    ADAPTER = Qwen3StateDictAdapter


class TitanQwen3MoeForCausalLM(TitanForCausalLM):
    """`titan.models.qwen3_moe` run by vLLM."""

    MODEL_CLASS = Qwen3MoeModel
    ADAPTER = Qwen3MoeStateDictAdapter


class TitanDeepseekV3ForCausalLM(TitanForCausalLM):
    """`titan.models.deepseek_v3` run by vLLM: MLA's queries, latents and RoPE are titan's;
    its inner attention over the expanded per-head keys and values is vLLM's paged kernel
    (the generator turns vLLM's own MLA path off, see `VLLMGenerator`)."""

    MODEL_CLASS = DeepseekV3Model
    ADAPTER = DeepseekV3StateDictAdapter
