"""torch.compile per transformer block."""

from __future__ import annotations

import torch.nn as nn

from titan.dist.plan import blocks_of


def apply_compile(model: nn.Module, mesh, config) -> nn.Module:
    """Compile each block of the model's layer container in place (`CompileConfig`).

    Blocks are compiled one by one rather than the whole model: every block has the same
    code, so one compiled graph is reused for all, and FSDP's per-block hooks stay outside
    the graphs. Module names are unchanged (`nn.Module.compile` works in place).
    `mesh` is unused but kept for the `apply_*` signature.
    """
    if not config.enable:
        return model
    for _, block in blocks_of(model):
        block.compile(backend=config.backend, fullgraph=config.fullgraph)
    return model
