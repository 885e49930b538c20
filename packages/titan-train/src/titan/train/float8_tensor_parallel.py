"""Tensor parallel in float8 for torchao's tensorwise float8 linears.

With ``--quantize.linear.float8.recipe tensorwise`` and tensor parallel, the plan's column-
and row-parallel linears take torchao's float8 styles (``Float8ColwiseParallel``,
``Float8RowwiseParallel``), and under sequence parallel a block whose linears are all such
linears (Llama's attention and feed-forward) casts its sequence-sharded input to float8 with
one scale over the whole tensor *before* all-gathering it: the gather moves one byte per
element instead of two, and wq, wk and wv (w1 and w3) share the one cast. The row-parallel
outputs' gradients are all-gathered in float8 (e5m2) in the backward. Their reduce-scatters
stay in high precision (partial sums). This is what torchtitan runs for its float8 TP rows.

The scales are the ones one process would compute (the amax is reduced over the TP ranks),
so the layout trains what one process trains. Row-wise recipes scale per row, which torchao's
float8 collectives do not support: their TP gathers stay in high precision, as do the inputs
of blocks with a linear left in high precision (a filtered or router linear).

gloo has no float8 dtypes: on CPU the float8 all-gather moves the same bytes as uint8.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from titan.dist import TensorParallelOverrides
from titan.dist.plan import match_modules, sharding_plan
from titan.train.quantize import QuantizeConfig, import_torchao_float8
from torch.distributed.tensor import Replicate, Shard


class Float8TensorParallel(TensorParallelOverrides):
    """torchao's float8 TP styles for tensorwise float8 linears, and float8 SP gathers for
    the blocks whose every linear is one; counts what it replaced (for the log)."""

    def __init__(self) -> None:
        self.linears = 0
        self.float8_gathers = 0
        _gather_float8_as_bytes_on_cpu()

    def style(self, style_name: str, module: nn.Module, *, sp: bool):
        """torchao's float8 column/row-parallel style for a tensorwise float8 linear."""
        if style_name not in ("colwise", "rowwise") or not tensorwise_float8(module):
            return None
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel,
            Float8RowwiseParallel,
        )

        self.linears += 1
        if style_name == "colwise":
            return Float8ColwiseParallel()
        return Float8RowwiseParallel(output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp)

    def block_input_cast(self, module: nn.Module):
        """The float8 cast of this block's input before its gather, when every linear in it is
        a tensorwise float8 one (the input then only feeds float8 matmuls). One scale for the
        whole tensor: on the sequence-sharded DTensor, its amax is reduced over the TP ranks;
        the backward reduce-scatters the high-precision gradient."""
        if not _all_linears_float8(module):
            return None
        self.float8_gathers += 1
        return _float8_input_cast(next(_linears(module)))

    def summary(self) -> str:
        """One log line: how many linears and block inputs went float8."""
        return (f"float8 tensor parallel: {self.linears} linears with torchao's float8 styles, "
                f"{self.float8_gathers} block inputs all-gathered in float8")


def float8_tensor_parallel(config: QuantizeConfig, *, tp_enabled: bool) -> Float8TensorParallel | None:
    """The float8 TP overrides when tensorwise float8 runs under tensor parallel, else None."""
    float8 = config.linear.float8
    if not (tp_enabled and float8.enabled and float8.recipe == "tensorwise"):
        return None
    return Float8TensorParallel()


def add_float8_tp_casts(model: nn.Module) -> int:
    """Make a one-process (converted) model cast what float8 tensor parallel casts, without
    collectives: the first input of each block whose every linear is a tensorwise float8 one
    (cast once, shared by its linears), and the input of every other tensorwise float8 linear
    the plan shards. Its blocks then keep float8 inputs where a float8 TP rank keeps them, for
    measuring what a block keeps (`titan.dist.dry_run.measure_block_units`). Returns the number
    of casts added."""
    def cast_first_input(linear: nn.Module):
        cast = _float8_input_cast(linear)

        def hook(_module, args):
            return (cast(args[0]),) + tuple(args[1:])
        return hook

    plan = sharding_plan(model).tensor_parallel.items()
    styled = [(style, module) for pattern, style in plan for _, module in match_modules(model, pattern)
              if module is not None]
    cast_blocks = [module for style, module in styled if style == "block_input" and _all_linears_float8(module)]
    for block in cast_blocks:
        block.register_forward_pre_hook(cast_first_input(next(_linears(block))))
    # The column-parallel linears of those blocks find their input cast already.
    covered = {id(m) for block in cast_blocks for m in block.modules()}
    cast_linears = [module for style, module in styled if tensorwise_float8(module)
                    and (style == "rowwise" or (style == "colwise" and id(module) not in covered))]
    for linear in cast_linears:
        linear.register_forward_pre_hook(cast_first_input(linear))
    return len(cast_blocks) + len(cast_linears)


def _linears(module: nn.Module):
    return (m for m in module.modules() if isinstance(m, nn.Linear))


def _all_linears_float8(module: nn.Module) -> bool:
    """Whether `module` holds linears and every one is a tensorwise float8 linear."""
    linears = list(_linears(module))
    return bool(linears) and all(tensorwise_float8(m) for m in linears)


def tensorwise_float8(module: nn.Module) -> bool:
    """Whether `module` is a torchao Float8Linear scaling its input and output gradient
    dynamically per tensor (the scaling torchao's float8 collectives support)."""
    ao = import_torchao_float8()
    if not isinstance(module, ao.float8_linear.Float8Linear):
        return False
    casts = (module.config.cast_config_input, module.config.cast_config_grad_output)
    return all(cast.scaling_type == ao.ScalingType.DYNAMIC
               and cast.scaling_granularity == ao.ScalingGranularity.TENSORWISE for cast in casts)


def _float8_input_cast(linear: nn.Module):
    """The dynamic tensorwise cast `linear` makes of its input (torchao's), as a function: a
    plain tensor's scale is its own, a sharded DTensor's the whole tensor's."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    def cast(x: torch.Tensor) -> torch.Tensor:
        return hp_tensor_to_float8_dynamic(x, linear.config.cast_config_input.target_dtype, linear.linear_mm_config,
                                           gemm_input_role=GemmInputRole.INPUT)

    return cast


_GATHER_OPS = ("c10d_functional", "_c10d_functional")


def _gather_float8_as_bytes_on_cpu() -> None:
    """Let torchao's float8 all-gather run on gloo (no float8 dtypes): on CPU tensors it
    gathers the float8 bytes viewed as uint8 and waits for them; other devices keep torchao's
    own (asynchronous) gather. Installed once per process."""
    from torchao.float8 import float8_ops
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    for namespace in _GATHER_OPS:
        op = getattr(torch.ops, namespace).all_gather_into_tensor.default
        torchao_gather = float8_ops.FLOAT8_OPS_TABLE[op]
        if getattr(torchao_gather, "_titan_bytes_on_cpu", False):
            continue

        def gather(aten_op, args, kwargs=None, _torchao_gather=torchao_gather, _namespace=namespace):
            fp8 = args[0]
            if fp8._data.device.type != "cpu":
                return _torchao_gather(aten_op, args, kwargs)
            data = fp8._data.contiguous()
            gathered = aten_op(data.view(torch.uint8), *args[1:], **(kwargs or {}))
            gathered = getattr(torch.ops, _namespace).wait_tensor(gathered)
            return Float8TrainingTensor(gathered.view(data.dtype), fp8._scale, fp8._orig_dtype,
                                        fp8._linear_mm_config, fp8._gemm_input_role)

        gather._titan_bytes_on_cpu = True
        float8_ops.FLOAT8_OPS_TABLE[op] = gather
