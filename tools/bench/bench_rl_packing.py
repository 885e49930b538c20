"""RL padding-free training (`titan rl --rl.padding_free`): the policy loss's forward and
backward over a rollout packed several completions to a row (best-fit decreasing, each its own
document) against one completion per row padded to the sequence length (the default).

    python tools/bench/bench_rl_packing.py                        # debugmodel, 64 completions, rows of 256
    python tools/bench/bench_rl_packing.py --seq-len 512 --max-completion 256

Both sides run titan's RL loss (`RolloutLoss`) on the same rollout, in microbatches of
--batch-size rows, and must give the same gradients (checked first); they then run
interleaved (A B, B A, ...). Prints each side's rows and padding share, the median step of
each and the ratio. The rollout's prompt and completion lengths are drawn uniformly from the
given ranges (a real rollout's spread decides the gain: short completions pack best).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchstats import ratio_line  # this folder is on sys.path when a script runs


def _rollout(args: argparse.Namespace) -> list:
    """Scored completions of random prompt and completion lengths, fixed by a seed."""
    from titan.rl.rollouts import Row

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(args.completions):
        prompt = int(torch.randint(args.min_prompt, args.max_prompt + 1, (), generator=g))
        completion = int(torch.randint(1, args.max_completion + 1, (), generator=g))
        completion = min(completion, args.seq_len + 1 - prompt)
        ids = torch.randint(0, args.vocab_size, (prompt + completion,), generator=g).tolist()
        rows.append(Row(prompt_ids=ids[:prompt], token_ids=ids[prompt:], logprobs=[-5.0] * completion,
                        advantage=float(torch.randn((), generator=g)), train=True))
    return rows


def _batches(rows: list, args: argparse.Namespace, packed: bool) -> list[dict[str, torch.Tensor]]:
    """The rollout's microbatches of --batch-size rows, one completion per row or packed."""
    from titan.rl.rollouts import build_packed_batch, pack_rows

    layout = pack_rows(rows, seq_len=args.seq_len) if packed else [[row] for row in rows]
    return [build_packed_batch(layout[i : i + args.batch_size], seq_len=args.seq_len, pad_id=0)
            for i in range(0, len(layout), args.batch_size)]


def _step(model, batches, loss_fn, normalizer: float) -> None:
    """Forward and backward of every microbatch (no optimizer: it is the same on both)."""
    for batch in batches:
        logits = model(batch["input_ids"], positions=batch["positions"], document_ids=batch["document_ids"])
        (loss_fn(logits, batch) / normalizer).backward()


def _grads(model) -> list[torch.Tensor]:
    """The model's gradients (then cleared)."""
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Build, check, time; prints and returns each side's per-round seconds."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--completions", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=48)
    p.add_argument("--max-completion", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="rows per microbatch")
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args(argv)
    from titan.models.llama3 import build_llama3
    from titan.rl.config import RLSection
    from titan.rl.rollout_loss import RolloutLoss
    from titan.rl.rollouts import padding_fraction, rows_loss_normalizer

    torch.manual_seed(0)
    model = build_llama3(args.flavor, vocab_size=args.vocab_size, max_seq_len=args.seq_len)
    model.init_weights(seed=0)
    rows = _rollout(args)
    normalizer = rows_loss_normalizer(rows, "grpo", max_new_tokens=args.max_completion)
    loss_fn = RolloutLoss(RLSection(), temperature=1.0, chunk_tokens=0).for_microbatch({}, None, measure_mismatch=False)
    sides = {"padded": _batches(rows, args, packed=False), "packed": _batches(rows, args, packed=True)}
    grads = {}
    for name, batches in sides.items():
        _step(model, batches, loss_fn, normalizer)
        grads[name] = _grads(model)
    for a, b in zip(grads["padded"], grads["packed"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    print("gradients agree; " + "; ".join(
        f"{name}: {sum(len(b['input_ids']) for b in batches)} rows of {args.seq_len}, "
        f"{padding_fraction(batches):.0%} padding" for name, batches in sides.items()))
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.rounds):
        for name in list(sides) if round_index % 2 == 0 else list(reversed(sides)):
            start = time.perf_counter()
            _step(model, sides[name], loss_fn, normalizer)
            seconds[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    print(f"{args.completions} completions, microbatches of {args.batch_size} rows: "
          + ", ".join(f"{n} {statistics.median(s):.3f} s" for n, s in seconds.items()))
    print(ratio_line("padded/packed", seconds["padded"], seconds["packed"], "seconds (>1: packing is faster)"))
    return seconds


if __name__ == "__main__":
    main()
