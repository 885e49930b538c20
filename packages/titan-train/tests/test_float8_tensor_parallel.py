"""Which modules float8 tensor parallel takes over: torchao's float8 styles for tensorwise
float8 linears, float8 input gathers for blocks made only of them, nothing otherwise. What
crosses the wire in a real TP 2 run is checked in tests/test_techniques_ran.py, the loss
against one process in tests/test_float8_e2e.py."""

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from titan.train.float8_tensor_parallel import (
    add_float8_tp_casts,
    float8_tensor_parallel,
    tensorwise_float8,
)
from titan.train.quantize import (
    Float8LinearConfig,
    QuantizeConfig,
    QuantizeLinearConfig,
    apply_quantization,
)

pytest.importorskip("torchao.float8")
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel  # noqa: E402


def _config(**float8) -> QuantizeConfig:
    return QuantizeConfig(linear=QuantizeLinearConfig(float8=Float8LinearConfig(**float8)))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(64, 64, bias=False)
        self.wo = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.wo(self.wq(x))


class _Model(nn.Module):
    """Two attention blocks; block 1's `wq` can be filtered out of the conversion."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Attention(), "1": _Attention()})

    def sharding_plan(self):
        return _Plan({"layers.*": "block_input", "layers.*.wq": "colwise", "layers.*.wo": "rowwise"})


@dataclass
class _Plan:
    tensor_parallel: dict[str, str]


def _converted(recipe: str, filter_fqns: tuple[str, ...] = ()) -> _Model:
    model = _Model()
    apply_quantization(model, _config(recipe=recipe, filter_fqns=list(filter_fqns)))
    return model


@pytest.mark.parametrize("recipe, tp, expected", [("tensorwise", True, True), ("tensorwise", False, False),
                                                  ("rowwise", True, False), (None, True, False)])
def test_only_tensorwise_float8_under_tensor_parallel_takes_float8_styles(recipe, tp, expected):
    overrides = float8_tensor_parallel(_config(recipe=recipe), tp_enabled=tp)
    assert (overrides is not None) is expected


def test_tensorwise_linears_get_torchao_styles_and_the_rest_keep_the_plans():
    model = _converted("tensorwise", filter_fqns=("layers.1.wq",))
    overrides = float8_tensor_parallel(_config(recipe="tensorwise"), tp_enabled=True)
    block0, block1 = model.layers["0"], model.layers["1"]
    assert isinstance(overrides.style("colwise", block0.wq, sp=True), Float8ColwiseParallel)
    rowwise = overrides.style("rowwise", block0.wo, sp=True)
    assert isinstance(rowwise, Float8RowwiseParallel) and not rowwise.use_local_output
    assert overrides.style("colwise", block1.wq, sp=True) is None  # filtered: high precision
    assert overrides.style("norm", block0.wq, sp=True) is None  # not a linear's style
    # A block gathers its input in float8 only when every linear in it takes float8 inputs.
    cast = overrides.block_input_cast(block0)
    assert cast is not None
    assert overrides.block_input_cast(block1) is None
    # What block 0's gather then moves: float8 bytes of the input, scaled by torchao.
    cast_input = cast(torch.randn(2, 16, 64))
    assert type(cast_input).__name__ == "Float8TrainingTensor" and cast_input._data.dtype == torch.float8_e4m3fn
    assert overrides.summary() == ("float8 tensor parallel: 2 linears with torchao's float8 styles, "
                                   "1 block inputs all-gathered in float8")


def test_rowwise_scaled_linears_are_not_tensorwise():
    assert tensorwise_float8(_converted("tensorwise").layers["0"].wq)
    assert not tensorwise_float8(_converted("rowwise").layers["0"].wq)
    assert not tensorwise_float8(nn.Linear(64, 64))


def test_one_process_casts_are_the_ones_float8_tp_makes():
    """For measuring what a float8 TP block keeps: block 0 casts its input once (its `wq`
    then receives float8), each row-parallel float8 linear casts its own; block 1, whose `wq`
    stays in high precision, casts nothing but its `wo`."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    model = _converted("tensorwise", filter_fqns=("layers.1.wq",))
    assert add_float8_tp_casts(model) == 3  # block 0's input, both wo
    seen = {}

    def record(key):
        def hook(_module, args):
            seen[key] = type(args[0]).__name__
        return hook

    for name in ("0", "1"):
        for leaf in ("wq", "wo"):
            getattr(model.layers[name], leaf).register_forward_pre_hook(record(f"{name}.{leaf}"))
    for block in model.layers.values():
        block(torch.randn(2, 16, 64))
    assert seen == {"0.wq": Float8TrainingTensor.__name__, "0.wo": Float8TrainingTensor.__name__,
                    "1.wq": "Tensor", "1.wo": Float8TrainingTensor.__name__}
