"""A synthetic corpus whose achievable loss is known in closed form.

Each document is a walk of an order-1 Markov chain over `n_symbols` symbols:
the first symbol is uniform over all symbols, and every symbol has `k`
distinct successors (fixed per corpus, drawn from the seed), each followed
with probability 1/k. Document lengths L >= 1 are geometric with mean `m`,
i.e. after every symbol the document ends with probability p = 1/m,
independently of the past. That memorylessness is what makes the best
possible predictor need only the previous token, so its loss is exact.

Why it exists: a training run on it has a known floor, so "the loss went
down to within x% of the floor" is a real end-to-end correctness check that
needs no download.

Entropy floor, per predicted token, once documents are packed as
``BOS x_1 .. x_L EOS`` back to back (every token predicts the next one):

- after BOS, x_1 is uniform over n symbols:          log n
- after x_i, the document continues with prob 1 - p
  to one of k successors, or ends (EOS) with prob p:
  each of the L - 1 continuations costs          log k - log(1 - p)
  the single ending costs                           -log p
- after EOS, the next token is BOS with certainty:   0

A document contributes L + 2 predictions. By the renewal-reward theorem the
long-run mean cost per prediction is the ratio of expectations (E[L] = m):

    floor = (log n + (m - 1) (log k - log(1 - p)) - log p) / (m + 2)

Packing into fixed windows drops one prediction per window boundary; the
boundaries fall at positions unrelated to the documents, so the mean over
the remaining predictions is unchanged. A model large enough to memorize a
finite corpus can go below this floor; it bounds generalizing models.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["SyntheticCorpus", "markov_entropy_floor_nats"]


def markov_entropy_floor_nats(
    n_symbols: int, successors: int, mean_length: float, *, bos_separator: bool = True
) -> float:
    """Best achievable mean cross-entropy per predicted token, in nats (see module doc).

    `bos_separator=False` is the packing used when the tokenizer's BOS and EOS
    are the same token: documents are then joined by a single EOS, which
    removes the free EOS -> BOS prediction (L + 1 predictions per document).
    """
    n, k, m = n_symbols, successors, float(mean_length)
    p = 1.0 / m
    # With m == 1 every document has a single symbol: no continuation is ever paid.
    continuation = 0.0 if m == 1 else (m - 1) * (math.log(k) - math.log1p(-p))
    per_document = math.log(n) + continuation - math.log(p)
    return per_document / (m + 2 if bos_separator else m + 1)


class SyntheticCorpus:
    """Map-style corpus of Markov-chain documents, generated on demand.

    Document `i` depends only on (`seed`, `i`), so random access is O(length)
    and nothing is stored. Symbols are mapped onto the tokenizer ids in
    `symbol_ids` (the caller passes ids that avoid the special tokens).
    """

    def __init__(
        self,
        *,
        n_symbols: int,
        successors: int,
        n_documents: int,
        mean_length: float,
        symbol_ids: Sequence[int],
        seed: int = 0,
    ) -> None:
        if len(symbol_ids) < n_symbols:
            raise ValueError(
                f"--dataset.synthetic_symbols {n_symbols} exceeds the {len(symbol_ids)} "
                "non-special ids of the tokenizer; lower it or use a larger vocabulary"
            )
        self.n_symbols = n_symbols
        self.successors = successors
        self.n_documents = n_documents
        self.mean_length = float(mean_length)
        self.seed = seed
        self.symbol_ids = np.asarray(symbol_ids[:n_symbols], dtype=np.int64)
        self.successor_table = self._draw_successors()

    def _draw_successors(self) -> np.ndarray:
        """[n_symbols, k] table: row s lists the k distinct successors of s."""
        rng = np.random.default_rng([self.seed, 0x5EED])
        rows = [
            rng.choice(self.n_symbols, self.successors, replace=False)
            for _ in range(self.n_symbols)
        ]
        return np.stack(rows).astype(np.int64)

    def __len__(self) -> int:
        return self.n_documents

    def symbols(self, index: int) -> np.ndarray:
        """The symbol walk of document `index` (values in [0, n_symbols))."""
        if not 0 <= index < self.n_documents:
            raise IndexError(f"document {index} out of range [0, {self.n_documents})")
        # A distinct stream per document makes access order irrelevant (cheap resume).
        rng = np.random.default_rng([self.seed, 1, index])
        length = int(rng.geometric(1.0 / self.mean_length))
        walk = np.empty(length, dtype=np.int64)
        walk[0] = rng.integers(self.n_symbols)
        picks = rng.integers(self.successors, size=length - 1)
        table = self.successor_table
        state = int(walk[0])
        for j, pick in enumerate(picks.tolist(), start=1):  # a walk is inherently sequential
            state = int(table[state, pick])
            walk[j] = state
        return walk

    def tokens(self, index: int) -> np.ndarray:
        """Token ids of document `index`, without separators."""
        return self.symbol_ids[self.symbols(index)]

    def entropy_floor_nats(self, *, bos_separator: bool = True) -> float:
        """Best achievable mean loss per predicted token after BOS/EOS packing
        (`bos_separator=False` when BOS and EOS are one token, see the packer)."""
        return markov_entropy_floor_nats(
            self.n_symbols, self.successors, self.mean_length, bos_separator=bos_separator
        )

    def next_token_logprob(self, prev: int, nxt: int, *, bos_id: int, eos_id: int) -> float:
        """Exact log P(nxt | prev) under the generator, for packed token streams.

        The oracle behind `entropy_floor_nats`; tests use it to measure the
        floor empirically on what the loader actually yields.
        """
        p_end = 1.0 / self.mean_length
        if prev == eos_id and bos_id != eos_id:
            return 0.0 if nxt == bos_id else -math.inf
        if prev == bos_id:  # also covers a shared BOS/EOS: a new document starts
            return -math.log(self.n_symbols) if self._symbol_of(nxt) is not None else -math.inf
        if nxt == eos_id:
            return math.log(p_end)
        s_prev, s_next = self._symbol_of(prev), self._symbol_of(nxt)
        if s_prev is None or s_next is None or s_next not in self.successor_table[s_prev]:
            return -math.inf
        return math.log1p(-p_end) - math.log(self.successors)

    def _symbol_of(self, token_id: int) -> int | None:
        """Inverse of `symbol_ids` (None for ids that are not symbols)."""
        if not hasattr(self, "_inverse"):
            self._inverse = {int(t): s for s, t in enumerate(self.symbol_ids)}
        return self._inverse.get(int(token_id))
