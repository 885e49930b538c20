"""The Llama 3 decoder, as plain single-device PyTorch: the shared dense decoder of
`titan.models.common.decoder` with Llama's args (no QK norm, head_dim = dim / n_heads)."""

from __future__ import annotations

from titan.models.common.decoder import Decoder, TransformerBlock
from titan.models.common.flavors import build_flavor
from titan.models.llama3.args import LLAMA3_FLAVORS, Llama3Args

__all__ = ["Llama3Model", "TransformerBlock", "build_llama3"]


class Llama3Model(Decoder):
    """Llama 3 decoder: embedding, a ModuleDict of Llama blocks, final norm, output projection.

    All behaviour (pipeline stages, tied embeddings, init, accounting, sharding plan) is the
    shared `Decoder`'s; see its docstring.
    """

    args: Llama3Args

    def __init__(self, args: Llama3Args) -> None:
        super().__init__(args)


def build_llama3(flavor: str, **overrides: object) -> Llama3Model:
    """Build the `flavor` model (a key of `LLAMA3_FLAVORS`), with fields of `Llama3Args`
    replaced by `overrides` (e.g. `vocab_size=`, `max_seq_len=`, `n_layers=`).

    Modules are created under the active device context; use `with torch.device("meta"):`
    and then `to_empty` + `init_weights` to avoid allocating twice.
    """
    return build_flavor("llama3", LLAMA3_FLAVORS, Llama3Model, flavor, overrides)
