"""`titan dpo`'s packed rows (several pairs per row, the default) against one pair per row
(`--dpo_data.no_packing`, the layout of a padded batch): the DPO loss's forward and backward
over the same preference pairs.

    python tools/bench/bench_dpo_packing.py                       # debugmodel, 48 pairs, rows of 256
    python tools/bench/bench_dpo_packing.py --max-len 20 --pairs 96

Both sides run titan's DPO loss (`DPOTrainer._pair_loss`, reference-free so no reference pass
is needed) on the synthetic task's first --pairs pairs (strings of --min-len to --max-len
letters), in microbatches of --batch-size rows, and must give the same gradients (checked
first); they then run interleaved (A B, B A, ...). Prints each side's rows and padding share,
the median step of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from benchstats import ratio_line  # this folder is on sys.path when a script runs


class _FirstPairs:
    """The first ``count`` pairs of a preference source."""

    def __init__(self, source, count: int) -> None:
        self.source, self.count = source, min(count, len(source))

    def __len__(self) -> int:
        return self.count

    def example(self, index: int):
        return self.source.example(index)


def _batches(trainer, source, args: argparse.Namespace, packing: bool) -> list[dict[str, torch.Tensor]]:
    """One pass over ``source``'s pairs in order, in microbatches of --batch-size rows."""
    from titan.rl.preference_data import PreferencePacker
    from titan.train.data.sft import SFTBatches

    packer = PreferencePacker(source, seq_len=args.seq_len, pad_id=0, packing=packing, overlong="drop", shuffle=False,
                              seed=0)
    packer.single_pass = True
    batches = SFTBatches(packer, args.batch_size)
    out = []
    while not packer.exhausted:
        out.append(trainer._with_reference(trainer._with_rows(batches.next_batch()), trainer.reference))
    return out


def _step(trainer, batches, pairs: torch.Tensor) -> None:
    """Forward and backward of every microbatch (no optimizer: it is the same on both)."""
    model = trainer.model_parts[0]
    for batch in batches:
        logits = model(batch["input_ids"], positions=batch["positions"], document_ids=batch["document_ids"])
        (trainer._pair_loss(logits, batch, global_pairs=pairs, global_chosen_tokens=pairs) / pairs).backward()


def _grads(model) -> list[torch.Tensor]:
    """The model's gradients (then cleared)."""
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def _padding(batches) -> float:
    """The share of the batches' positions outside every pair."""
    total = sum(b["document_ids"].numel() for b in batches)
    return sum(int((b["document_ids"] < 0).sum()) for b in batches) / max(total, 1)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Build, check, time; prints and returns each side's per-round seconds."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--pairs", type=int, default=48)
    p.add_argument("--min-len", type=int, default=3)
    p.add_argument("--max-len", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8, help="rows per microbatch")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    from titan.rl.dpo import DPOConfig, DPOTrainer
    from titan.rl.preference_data import build_preference_source

    from titan.recipes.families import model_spec

    cfg = DPOConfig()
    cfg.model.name, cfg.model.flavor, cfg.tokenizer.kind = "llama3", args.flavor, "byte"
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = args.seq_len, args.batch_size, 1
    cfg.dpo.reference_free = True
    cfg.dpo_data.synthetic_min_len, cfg.dpo_data.synthetic_max_len = args.min_len, args.max_len
    cfg.dpo_data.synthetic_examples = max(args.pairs, 64)
    cfg.metrics.enable_progress_bar = False
    with tempfile.TemporaryDirectory() as dump:
        cfg.job.dump_folder = dump
        trainer = DPOTrainer(cfg, model_spec=model_spec("llama3"))
        try:
            source = _FirstPairs(build_preference_source(cfg.dpo_data, trainer.tokenizer), args.pairs)
            pairs = torch.tensor(float(len(source)))
            sides = {"one pair per row": _batches(trainer, source, args, packing=False),
                     "packed": _batches(trainer, source, args, packing=True)}
            model = trainer.model_parts[0]
            grads = {}
            for name, batches in sides.items():
                _step(trainer, batches, pairs)
                grads[name] = _grads(model)
            for a, b in zip(*grads.values(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
            print("gradients agree; " + "; ".join(
                f"{name}: {sum(len(b['input_ids']) for b in batches)} rows of {args.seq_len}, "
                f"{_padding(batches):.0%} padding" for name, batches in sides.items()))
            seconds: dict[str, list[float]] = {name: [] for name in sides}
            for round_index in range(args.rounds):
                for name in list(sides) if round_index % 2 == 0 else list(reversed(sides)):
                    start = time.perf_counter()
                    _step(trainer, sides[name], pairs)
                    seconds[name].append(time.perf_counter() - start)
                    model.zero_grad(set_to_none=True)
        finally:
            trainer.close()
    print(f"{len(source)} pairs, microbatches of {args.batch_size} rows: "
          + ", ".join(f"{n} {statistics.median(s):.3f} s" for n, s in seconds.items()))
    print(ratio_line("unpacked/packed", seconds["one pair per row"], seconds["packed"],
                     "seconds (>1: packing is faster)"))
    return seconds


if __name__ == "__main__":
    main()
