"""`ModelSpec.with_flavor`: one more flavor (a checkpoint's own architecture) built by a family
build that knows only its own table."""

from __future__ import annotations

import dataclasses

import pytest
from titan.train.model_spec import ModelSpec
from torch import nn


@dataclasses.dataclass
class Args:
    width: int = 4
    depth: int = 1
    label: str = "base"


class Model(nn.Module):
    def __init__(self, args: Args) -> None:
        super().__init__()
        self.args = args


TABLE = {"small": Args(), "large": Args(width=16, depth=4, label="large")}


def build(flavor: str, **overrides) -> Model:
    return Model(dataclasses.replace(TABLE[flavor], **overrides))


def test_the_new_flavor_builds_its_args_and_overrides_win():
    spec = ModelSpec(name="toy", flavors=TABLE, build=build)
    own = Args(width=12, depth=3, label="checkpoint")
    extended = spec.with_flavor("hf", own)
    assert extended.build("hf").args == own
    assert extended.build("hf", depth=5).args == Args(width=12, depth=5, label="checkpoint")
    assert extended.build("large").args == TABLE["large"]  # the table's flavors unchanged
    extended.check_flavor("hf")
    assert extended.flavors["hf"] is own and "hf" not in spec.flavors  # the original spec untouched
    with pytest.raises(ValueError, match="'hf' is not a toy size"):
        spec.check_flavor("hf")
