"""Statistics shared by the benchmarks in this folder."""

from __future__ import annotations

import statistics


def ratio_line(label: str, num: list[float], den: list[float], unit: str) -> str:
    """`ratio <label> <unit>: <ratio of medians> (per-round ratios: median, quartiles, n)`.

    Each round's pair ran back to back, so a per-round ratio is the least noisy sample; their
    quartiles are the spread (min..max would only report the other users' load spikes).
    """
    per_round = [a / b for a, b in zip(num, den, strict=True)]
    med = statistics.median(num) / statistics.median(den)
    q1, _, q3 = statistics.quantiles(per_round, n=4) if len(per_round) > 1 else per_round * 3
    return (
        f"ratio {label} {unit}: {med:.3f} (per-round median {statistics.median(per_round):.3f}, "
        f"quartiles {q1:.3f}..{q3:.3f}, {len(per_round)} rounds)"
    )
