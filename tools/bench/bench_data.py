"""Throughput of titan's training data loader against a naive reference, and its dp scaling.

    python tools/bench/bench_data.py                        # seq 256, batch 8, both corpora
    python tools/bench/bench_data.py --jsonl my.jsonl       # your JSONL instead of the generated one

Two corpora, each read by `titan.train.data.build_dataloader` and by `NaiveLoader` (tokenize
each document, extend one Python list, cut rows of seq_len + 1 tokens with plain list slicing):

- stdlib/byte: `--dataset.name stdlib` (Python's own .py files) with the byte tokenizer;
- jsonl/bpe: a local JSONL (by default one document per blank-line-separated paragraph of the
  stdlib files, written to a temporary folder) read through `datasets`, tokenized by a BPE
  `tokenizer.json` trained on the fly with the `tokenizers` library.

Shuffling is off for both, so titan and the reference produce the same stream; the script
checks the first batches are identical and aborts if not. Loaders then run interleaved in
alternating order, `--batches` per round, `--rounds` rounds; the report gives medians and the
ratio of medians with the range of per-round ratios.

Data-parallel scaling: every rank reads the whole global stream and keeps only its own rows,
so one rank's cost per batch grows with the data-parallel degree. The script measures rank
0's batches/s at each `--dp` degree with the same local batch and reports it relative to dp 1.

Pre-tokenized corpora (`--dataset.name tokenized`; skip with `--no-tokenized`): each corpus is
tokenized with `titan.train.data.tokenize_corpus` (the stdlib files as one JSONL document per
file, so the documents are the same), checked batch for batch against the on-the-fly loader,
then timed against it at dp 1 (tokenized/on-the-fly) and at each `--dp` degree (rank 0,
relative to dp 1). Finally `tokenize_corpus` itself on the JSONL/BPE corpus, alternating
`--num-proc` values, `--tokenize-rounds` rounds: tokens/s relative to the first value.

Streaming (`--dataset.streaming`; skip with `--no-streamed`): the JSONL/BPE corpus read as
`datasets` streams it against the same corpus loaded into Arrow first, checked batch for
batch, then timed: streamed/loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
from benchstats import ratio_line  # this folder is on sys.path when a script runs
from titan.train.data import (
    ByteTokenizer,
    DatasetConfig,
    HFTokenizer,
    TokenizerConfig,
    build_dataloader,
    stdlib_files,
    tokenize_corpus,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="local (per-rank) batch size")
    p.add_argument("--batches", type=int, default=300, help="batches per loader per round")
    p.add_argument("--rounds", type=int, default=9, help="interleaved measurement rounds")
    p.add_argument("--dp", default="1,2,8", help="data-parallel degrees for the scaling run")
    p.add_argument("--jsonl", default=None, help="a JSONL with a 'text' field (default: generated)")
    p.add_argument("--max-docs", type=int, default=20000, help="documents in the generated JSONL")
    p.add_argument("--bpe-vocab", type=int, default=4096, help="vocabulary of the trained BPE")
    p.add_argument("--check-batches", type=int, default=3, help="batches compared for equality")
    p.add_argument("--no-tokenized", action="store_true", help="skip the pre-tokenized loader")
    p.add_argument("--no-streamed", action="store_true", help="skip the streamed loader")
    p.add_argument("--num-proc", default="1,2", help="tokenize_corpus processes to compare")
    p.add_argument("--tokenize-rounds", type=int, default=5, help="rounds of each --num-proc")
    return p.parse_args(argv)


class NaiveLoader:
    """The reference: plain Python lists, no numpy, no resumable position.

    Documents (from `texts`, cycled forever) are framed `BOS ids EOS` (just `ids EOS` when
    BOS == EOS), empty ones skipped, appended to one list, and cut into [B, seq_len + 1] rows.
    """

    def __init__(
        self,
        texts: Callable[[], Iterator[str]],
        encode,
        bos: int,
        eos: int,
        batch: int,
        seq_len: int,
    ):
        self.texts, self.encode, self.bos, self.eos = texts, encode, bos, eos
        self.batch, self.seq_len = batch, seq_len
        self.buffer: list[int] = []
        self.docs = self._documents()

    def _documents(self) -> Iterator[list[int]]:
        head = [self.bos] if self.bos != self.eos else []
        while True:
            for text in self.texts():
                ids = self.encode(text)
                if ids:
                    yield head + ids + [self.eos]

    def __next__(self) -> dict[str, torch.Tensor]:
        n = self.batch * (self.seq_len + 1)
        while len(self.buffer) < n:
            self.buffer.extend(next(self.docs))
        rows = torch.tensor(self.buffer[:n]).view(self.batch, self.seq_len + 1)
        del self.buffer[:n]
        return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}


def stdlib_texts() -> Iterator[str]:
    """The stdlib corpus' documents in titan's (unshuffled) order."""
    for path in stdlib_files():
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def jsonl_texts(path: str) -> Callable[[], Iterator[str]]:
    """A function yielding the 'text' field of each line of `path`, read with `json`."""

    def texts() -> Iterator[str]:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    return texts


def write_jsonl(path: str, max_docs: int) -> None:
    """One JSON line per non-empty paragraph of the stdlib files, up to `max_docs`."""
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for text in stdlib_texts():
            for para in text.split("\n\n"):
                if para.strip():
                    out.write(json.dumps({"text": para}) + "\n")
                    count += 1
                    if count == max_docs:
                        return


def train_bpe(jsonl: str, vocab: int, out: str) -> None:
    """A byte-level BPE `tokenizer.json` with <s>, </s>, <pad>, trained on `jsonl`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(jsonl_texts(jsonl)(), trainer=trainer)
    tok.save(out)


def titan_loader(cfg: DatasetConfig, tokenizer, args, dp: int = 1):
    """titan's loader for rank 0 of `dp` ranks."""
    return build_dataloader(
        cfg,
        tokenizer,
        dp_rank=0,
        dp_world_size=dp,
        local_batch_size=args.batch_size,
        seq_len=args.seq_len,
        seed=0,
    )


def check_same_stream(titan, naive, n: int) -> None:
    """The first `n` batches of both loaders are identical, else SystemExit."""
    for i in range(n):
        a, b = next(titan), next(naive)
        for key in ("input_ids", "labels"):
            if not torch.equal(a[key], b[key]):
                raise SystemExit(
                    f"batch {i} {key}: titan and the naive reference differ; not comparable"
                )


def time_rounds(loaders: dict[str, Iterator], batches: int, rounds: int) -> dict[str, list[float]]:
    """batches/s of each loader per round, alternating the order every round (after one warm batch)."""
    rates: dict[str, list[float]] = {name: [] for name in loaders}
    for it in loaders.values():
        next(it)
    names = list(loaders)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            it = loaders[name]
            start = time.perf_counter()
            for _ in range(batches):
                next(it)
            rates[name].append(batches / (time.perf_counter() - start))
    return rates


def report(corpus: str, rates: dict[str, list[float]], tokens_per_batch: int) -> None:
    """One line per loader: median batches/s and tokens/s, with the spread."""
    for name, r in rates.items():
        med = statistics.median(r)
        print(
            f"{corpus:12s} {name:6s} batches/s median {med:9.1f} (min {min(r):.1f}, max {max(r):.1f})"
            f"  tokens/s {med * tokens_per_batch:11.0f}"
        )


def bench_corpus(corpus: str, cfg: DatasetConfig, tokenizer, naive: NaiveLoader, args) -> None:
    """titan vs naive on one corpus, then titan's rank-0 rate at each dp degree."""
    tokens_per_batch = args.batch_size * args.seq_len
    titan = iter(titan_loader(cfg, tokenizer, args))
    check_same_stream(titan, naive, args.check_batches)
    rates = time_rounds({"titan": titan, "naive": naive}, args.batches, args.rounds)
    report(corpus, rates, tokens_per_batch)
    print(ratio_line(f"{corpus} titan/naive", rates["titan"], rates["naive"], "batches/s"))

    degrees = [int(d) for d in args.dp.split(",")]
    loaders = {f"dp{d}": iter(titan_loader(cfg, tokenizer, args, dp=d)) for d in degrees}
    scaling = time_rounds(loaders, args.batches, args.rounds)
    report(corpus, scaling, tokens_per_batch)
    base = f"dp{degrees[0]}"
    for name in list(scaling)[1:]:
        print(ratio_line(f"{corpus} rank-0 {name}/{base}", scaling[name], scaling[base], "batches/s"))


def tokenized_loaders(corpus: str, cfg: DatasetConfig, tokenizer, tok_cfg, source: str,
                      tmp: str, args) -> None:
    """The pre-tokenized loader of the same documents: equal batches, then its speed against
    the on-the-fly loader at dp 1, and its rank-0 rate at each dp degree."""
    folder = os.path.join(tmp, "corpus-" + corpus.replace("/", "-"))
    tokenize_corpus(source, folder, tok_cfg, num_proc=1, progress=False,
                    cache_dir=os.path.join(tmp, "hf"))
    tokenized = DatasetConfig(name="tokenized", path=folder, shuffle=False)
    tokens_per_batch = args.batch_size * args.seq_len
    fast, slow = iter(titan_loader(tokenized, tokenizer, args)), iter(titan_loader(cfg, tokenizer, args))
    check_same_stream(fast, slow, args.check_batches)
    rates = time_rounds({"tok'd": fast, "titan": slow}, args.batches, args.rounds)
    report(corpus, rates, tokens_per_batch)
    print(ratio_line(f"{corpus} tokenized/on-the-fly", rates["tok'd"], rates["titan"], "batches/s"))

    degrees = [int(d) for d in args.dp.split(",")]
    loaders = {f"tok{d}": iter(titan_loader(tokenized, tokenizer, args, dp=d)) for d in degrees}
    scaling = time_rounds(loaders, args.batches, args.rounds)
    report(corpus, scaling, tokens_per_batch)
    base = f"tok{degrees[0]}"
    for name in list(scaling)[1:]:
        print(ratio_line(f"{corpus} tokenized rank-0 dp{name[3:]}/dp{degrees[0]}", scaling[name],
                         scaling[base], "batches/s"))


def streamed_against_loaded(corpus: str, cfg: DatasetConfig, tokenizer, args) -> None:
    """The same local corpus streamed (`--dataset.streaming`) and loaded into Arrow first:
    equal batches, then batches/s of both in interleaved rounds and their ratio."""
    streamed_cfg = dataclasses.replace(cfg, streaming=True)
    streamed, loaded = iter(titan_loader(streamed_cfg, tokenizer, args)), iter(titan_loader(cfg, tokenizer, args))
    check_same_stream(streamed, loaded, args.check_batches)
    rates = time_rounds({"stream": streamed, "loaded": loaded}, args.batches, args.rounds)
    report(corpus, rates, args.batch_size * args.seq_len)
    print(ratio_line(f"{corpus} streamed/loaded", rates["stream"], rates["loaded"], "batches/s"))


def tokenize_throughput(jsonl: str, tok_cfg, tmp: str, args) -> None:
    """tokens/s of `tokenize_corpus` at each --num-proc, interleaved rounds (the JSONL is
    converted to Arrow once, in a shared cache, before timing: only tokenizing is compared)."""
    procs = [int(n) for n in args.num_proc.split(",")]
    cache = os.path.join(tmp, "hf")
    rates: dict[int, list[float]] = {n: [] for n in procs}
    run = 0
    for r in range(args.tokenize_rounds + 1):  # round 0 warms the cache and the page cache
        for n in procs if r % 2 == 0 else reversed(procs):
            run += 1
            out = os.path.join(tmp, f"tokenize-{run}")
            start = time.perf_counter()
            manifest = tokenize_corpus(jsonl, out, tok_cfg, num_proc=n, progress=False,
                                       cache_dir=cache, rows_per_shard=1 << 30)
            if r:
                rates[n].append(manifest["num_tokens"] / (time.perf_counter() - start))
            shutil.rmtree(out)
    for n, r in rates.items():
        print(f"{'tokenize':12s} num_proc {n}: tokens/s median {statistics.median(r):11.0f}")
    for n in procs[1:]:
        print(ratio_line(f"tokenize num_proc {n}/{procs[0]}", rates[n], rates[procs[0]], "tokens/s"))
    # The control: the same process counts on CPU-bound work, i.e. how much parallelism
    # the machine has to give right now (other users' load takes it away from both).
    spin: dict[int, list[float]] = {n: [] for n in procs}
    for r in range(args.tokenize_rounds):
        for n in procs if r % 2 == 0 else reversed(procs):
            start = time.perf_counter()
            with multiprocessing.get_context().Pool(n) as pool:
                pool.map(sum, [range(2_000_000)] * (4 * max(procs)))  # a builtin: picklable
            spin[n].append(1 / (time.perf_counter() - start))
    for n in procs[1:]:
        print(ratio_line(f"control CPU-bound pool {n}/{procs[0]}", spin[n], spin[procs[0]], "runs/s"))


def write_stdlib_jsonl(path: str) -> None:
    """The stdlib corpus as JSONL, one document per file, in titan's (unshuffled) order."""
    with open(path, "w", encoding="utf-8") as out:
        for text in stdlib_texts():
            out.write(json.dumps({"text": text}) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Run both corpora and print medians, ratios and the dp scaling."""
    args = parse_args(argv)
    print(
        f"# seq {args.seq_len} local batch {args.batch_size}, {args.rounds} rounds x "
        f"{args.batches} batches, torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    byte = ByteTokenizer()
    naive = NaiveLoader(
        stdlib_texts,
        lambda t: list(t.encode("utf-8", errors="replace")),
        byte.bos_id,
        byte.eos_id,
        args.batch_size,
        args.seq_len,
    )
    stdlib_cfg = DatasetConfig(name="stdlib", shuffle=False)
    bench_corpus("stdlib/byte", stdlib_cfg, byte, naive, args)

    import datasets  # deferred: ~1 s to import

    datasets.disable_progress_bars()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_tokenized:
            stdlib_jsonl = os.path.join(tmp, "stdlib.jsonl")
            write_stdlib_jsonl(stdlib_jsonl)
            tokenized_loaders("stdlib/byte", stdlib_cfg, byte, TokenizerConfig(), stdlib_jsonl,
                              tmp, args)
        jsonl = args.jsonl or os.path.join(tmp, "corpus.jsonl")
        if args.jsonl is None:
            write_jsonl(jsonl, args.max_docs)
        tok_path = os.path.join(tmp, "tokenizer.json")
        train_bpe(jsonl, args.bpe_vocab, tok_path)
        bpe = HFTokenizer(tok_path)
        from tokenizers import Tokenizer

        raw = Tokenizer.from_file(tok_path)  # the reference calls the library directly
        naive = NaiveLoader(
            jsonl_texts(jsonl),
            lambda t: raw.encode(t, add_special_tokens=False).ids,
            bpe.bos_id,
            bpe.eos_id,
            args.batch_size,
            args.seq_len,
        )
        cfg = DatasetConfig(
            name="json", path=jsonl, shuffle=False, cache_dir=os.path.join(tmp, "hf")
        )
        bench_corpus("jsonl/bpe", cfg, bpe, naive, args)
        if not args.no_streamed:
            streamed_against_loaded("jsonl/bpe", cfg, bpe, args)
        if not args.no_tokenized:
            bpe_cfg = TokenizerConfig(kind="hf", path=tok_path)
            tokenized_loaders("jsonl/bpe", cfg, bpe, bpe_cfg, jsonl, tmp, args)
            tokenize_throughput(jsonl, bpe_cfg, tmp, args)


if __name__ == "__main__":
    main()
