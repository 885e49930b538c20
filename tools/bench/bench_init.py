"""Initialization cost of titan's layout-independent init against plain `nn.init`, and the
scaled time to initialize a whole model (the meta -> CPU path every run takes).

    python tools/bench/bench_init.py                      # Llama 3 8B: one block + embedding + output
    python tools/bench/bench_init.py --world-size 8       # also each rank's share under FSDP 8

Building all of 8B on one CPU needs 32 GB, so the script materializes one block plus the
embedding and output (the largest tensors), times `init_weights` (per-parameter generator
blocks, `SeededInit`) against the same tensors filled by `nn.init` from one global generator
(the reference: what init cost before), interleaved in rounds, and scales the measured time per
element to the whole model: n_layers x block + embedding + output. Under FSDP each rank draws
only the blocks of rows overlapping its shard, so a rank's time is the total / world size (plus
at most one generator block per tensor).
"""

from __future__ import annotations

import argparse
import time

import torch
from benchstats import ratio_line  # this folder is on sys.path when a script runs
from titan.models.llama3 import LLAMA3_FLAVORS, build_llama3
from torch import nn


def _one_block_model(flavor: str) -> nn.Module:
    with torch.device("meta"):
        model = build_llama3(flavor, n_layers=1)
    model.to_empty(device="cpu")
    return model


def _plain_init(model: nn.Module) -> None:
    """The reference: every tensor filled from the global generator with `nn.init`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif "tok_embeddings" in name:
                nn.init.normal_(param, std=1.0)
            else:
                nn.init.trunc_normal_(param, std=0.02, a=-0.06, b=0.06)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Run the benchmark; returns the per-round seconds of each variant."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavor", default="8B", choices=list(LLAMA3_FLAVORS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=8, help="FSDP ranks for the per-rank estimate")
    args = parser.parse_args(argv)

    model = _one_block_model(args.flavor)
    n_layers = LLAMA3_FLAVORS[args.flavor].n_layers
    numel = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in model.layers["0"].parameters())
    full_numel = numel + (n_layers - 1) * block
    seconds: dict[str, list[float]] = {"titan": [], "nn.init": []}
    for round_index in range(args.rounds):
        order = ("titan", "nn.init") if round_index % 2 == 0 else ("nn.init", "titan")
        for variant in order:
            fn = (lambda: model.init_weights(seed=0)) if variant == "titan" else (lambda: _plain_init(model))
            seconds[variant].append(_time(fn))
    per_element = min(seconds["titan"]) / numel
    total = per_element * full_numel
    print(f"{args.flavor}: measured {numel / 1e6:.0f}M elements (1 of {n_layers} blocks + embedding + output)")
    for variant, times in seconds.items():
        print(f"  {variant:>8}: best {min(times):.2f} s ({numel / min(times) / 1e6:.0f}M elements/s)")
    print(ratio_line("nn.init/titan", seconds["nn.init"], seconds["titan"], "seconds (>1: titan faster)"))
    print(
        f"scaled to the whole model ({full_numel / 1e9:.2f}B params): {total:.0f} s on one process; "
        f"{total / args.world_size:.1f} s per rank under FSDP {args.world_size}"
    )
    return seconds


if __name__ == "__main__":
    main()
