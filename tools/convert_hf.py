"""Convert model weights between a titan DCP checkpoint and a Hugging Face folder.

    python tools/convert_hf.py to-hf   CKPT   OUT --model llama3
    python tools/convert_hf.py from-hf HF_DIR OUT --model llama3

CKPT is a DCP step folder or a checkpoint folder (its latest complete step is used), titan's or
torchtitan's (its names and, for Qwen3, its q/k layout are converted on reading). HF_DIR may
be a Hub model id (`Qwen/Qwen3-0.6B`): its config, safetensors and tokenizer files are read
through the Hugging Face cache (downloaded once). OUT of `from-hf` is a model-only DCP step
folder usable as `--checkpoint.initial_load_path`.

`--model` names a family (llama3, qwen3, qwen3_moe, deepseek_v3); `--adapter module:Class` names any adapter instead. The
adapter is built as `Adapter(args)`, where args come from `Adapter.args_from_hf_config(...)`
of a `config.json` (`--hf-config`; by default the one next to the weights: titan writes it into
every step it saves when it knows the family) or from a flavor (`--flavor NAME`, with
`--flavors module:TABLE` for an `--adapter`). A class that takes no argument is built as
`Adapter()`. Runs in one process on CPU.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
from typing import Any

from titan.ckpt import hf, load_dcp_model, load_hf, save_dcp_model, save_hf
from titan.ckpt.convert import resolve_step_folder
from titan.ckpt.hub import resolve_hub_folder

# Families by short name: (adapter class, flavor table).
FAMILIES = {
    "llama3": ("titan.models.llama3:Llama3StateDictAdapter", "titan.models.llama3:LLAMA3_FLAVORS"),
    "qwen3": ("titan.models.qwen3:Qwen3StateDictAdapter", "titan.models.qwen3:QWEN3_FLAVORS"),
    "qwen3_moe": ("titan.models.qwen3_moe:Qwen3MoeStateDictAdapter", "titan.models.qwen3_moe:QWEN3_MOE_FLAVORS"),
    "deepseek_v3": ("titan.models.deepseek_v3:DeepseekV3StateDictAdapter",
                    "titan.models.deepseek_v3:DEEPSEEK_V3_FLAVORS"),
}


def import_object(spec: str) -> Any:
    """`package.module:attribute` -> the attribute."""
    module, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"expected 'package.module:Name', got {spec!r}")
    return getattr(importlib.import_module(module), attr)


def build_adapter(spec: str, *, hf_config: str | None, flavors: str | None,
                  flavor: str | None) -> Any:
    """Instantiate the family adapter named by `spec` from a config.json or a flavor."""
    cls = import_object(spec)
    if flavor is not None:
        if flavors is None:
            raise SystemExit("--flavor needs --flavors module:TABLE (e.g. a *_FLAVORS dict)")
        return cls(import_object(flavors)[flavor])
    if hf_config is not None and hasattr(cls, "args_from_hf_config"):
        with open(hf_config) as f:
            return cls(cls.args_from_hf_config(json.load(f)))
    if _takes_no_arguments(cls):
        return cls()
    raise SystemExit(f"{spec} needs model arguments: pass --hf-config or --flavors/--flavor")


def _takes_no_arguments(cls: Any) -> bool:
    params = inspect.signature(cls).parameters.values()
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in params)


def resolve_family(args: argparse.Namespace) -> None:
    """Fill `--adapter` / `--flavors` from `--model`."""
    if args.model is None:
        if args.adapter is None:
            raise SystemExit(f"name the model family: --model {{{','.join(FAMILIES)}}} or --adapter module:Class")
        return
    if args.model not in FAMILIES:
        raise SystemExit(f"--model {args.model!r} is not a known family; choose one of: {', '.join(FAMILIES)}")
    adapter, flavors = FAMILIES[args.model]
    args.adapter = args.adapter or adapter
    args.flavors = args.flavors or flavors


def to_hf(args: argparse.Namespace) -> None:
    """DCP checkpoint -> Hugging Face safetensors + index + config.json."""
    step = resolve_step_folder(args.src)
    config = args.hf_config
    if config is None and args.flavor is None and os.path.isfile(os.path.join(step, "config.json")):
        config = os.path.join(step, "config.json")  # written by titan next to the weights
    adapter = build_adapter(args.adapter, hf_config=config, flavors=args.flavors,
                            flavor=args.flavor)
    state = load_dcp_model(step, adapter)  # the adapter puts a torchtitan checkpoint's layout right
    # The step's config.json (titan's, or one from-hf kept) lends the keys the adapter does not
    # write: special tokens, generation settings.
    save_hf(state, args.out, adapter, args.dtype, max_shard_bytes=args.max_shard_bytes, config_source=step)
    print(f"wrote {len(state)} tensors to {args.out}")


def from_hf(args: argparse.Namespace) -> None:
    """Hugging Face safetensors (a folder, or a Hub model id read through the Hugging Face
    cache) -> a model-only DCP step folder."""
    try:
        args.src = resolve_hub_folder(args.src, flag="SRC")
    except ValueError as err:
        raise SystemExit(f"convert_hf.py: error: {err}") from None
    config = args.hf_config
    if config is None and args.flavor is None:
        config = os.path.join(args.src, "config.json")
    adapter = build_adapter(args.adapter, hf_config=config, flavors=args.flavors,
                            flavor=args.flavor)
    state = load_hf(args.src, adapter)
    if args.dtype is not None:
        state = {k: v.to(hf.DTYPES[args.dtype]) if v.is_floating_point() else v
                 for k, v in state.items()}
    save_dcp_model(state, args.out)
    # Keep the model's description with the weights, as titan's own steps do (to-hf reads it).
    floats = [v.dtype for v in state.values() if v.is_floating_point()]
    hf.write_config(args.out, adapter, args.dtype or (floats[0] if floats else None), source=args.src)
    print(f"wrote {len(state)} tensors to {args.out}")


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["to-hf", "from-hf"])
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--model", help=f"model family: {', '.join(FAMILIES)}")
    parser.add_argument("--adapter", help="module:Class of the family adapter (instead of --model)")
    parser.add_argument("--hf-config", help="config.json giving the model arguments")
    parser.add_argument("--flavors", help="module:TABLE of model arguments by flavor name")
    parser.add_argument("--flavor", help="the flavor to take from --flavors")
    parser.add_argument("--dtype", choices=sorted(hf.DTYPES), help="cast floating weights")
    parser.add_argument("--max-shard-bytes", type=int, default=hf.DEFAULT_MAX_SHARD_BYTES)
    args = parser.parse_args(argv)
    resolve_family(args)
    (to_hf if args.direction == "to-hf" else from_hf)(args)


if __name__ == "__main__":
    main()
