"""Pre-tokenized corpora: written once by `titan data tokenize`, memory-mapped at training time.

A corpus is a folder::

    manifest.json          format, version, dtype, tokenizer (kind + sha256 of its file),
                           source, counts, and the shard list
    tokens-00000.bin       the shard's token ids, documents end to end (no BOS/EOS), as raw
                           uint16 (vocabulary <= 65536) or uint32, read with `np.memmap`
    index-00000.npy        int64 [documents + 1]: where each document starts in the shard
                           (the last entry is the shard's token count)

Documents are stored unframed and in source order, empty ones included, so a corpus holds
exactly the documents the on-the-fly loader reads from the same text. Training frames them
(`BOS ids EOS`) with the run's tokenizer and packs them into the same global stream of
windows of seq_len + 1 tokens: epoch e visits the documents in the permutation seeded by
(seed, e) (documents, not windows, are shuffled, as on the fly), empty ones skipped. The
difference is the cost: a rank finds any stream position by binary search over the
epoch's cumulative document lengths, so it skips the other ranks' rows in O(1) tokens and
copies only its own; nothing is tokenized at training time. The lengths along an epoch's
order are summed once per epoch (O(documents), 16 bytes each, like the order itself).

A mixture (`--dataset.mix a:0.7,b:0.3`) interleaves windows: the global window stream is cut
into blocks of `MIX_BLOCK` windows, each holding a fixed number of windows of every corpus
(its weight, rounded) in an order seeded by (seed, block). Window w of the mixture is window
k of its corpus' own stream, where k counts that corpus' windows before w; both follow from
w alone, so the position stays one number and resumes under any layout.

Writing is atomic: everything goes to `<OUT>.incomplete/` and is renamed to `OUT` once the
manifest is written, so an interrupted run never leaves a folder that looks complete. A rerun
with the same arguments keeps the shards that were finished (a shard is finished when its
index file exists) and tokenizes the rest.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from titan.train.data.config import DatasetConfig, mix_block_counts, parse_mix
from titan.train.data.loader import PackedBatches, PackedDataLoader, load_hf_dataset
from titan.train.data.resumable import check_loader_args
from titan.train.data.sources import LOCAL_FORMATS, resolve_data_files
from titan.train.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "CorpusStream",
    "TokenizedCorpus",
    "TokenizedPacker",
    "build_tokenized_dataloader",
    "check_corpus_tokenizer",
    "check_tokenized_dataset",
    "read_manifest",
    "tokenize_corpus",
    "tokenizer_fingerprint",
]

FORMAT = "titan-tokenized"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PLAN = "plan.json"  # in the work folder only: the arguments a resumed run must share
INCOMPLETE_SUFFIX = ".incomplete"
DEFAULT_ROWS_PER_SHARD = 1 << 18
DEFAULT_CHUNK_ROWS = 512


# ---- tokenizer identity ------------------------------------------------------------------


def tokenizer_fingerprint(kind: str, path: str | os.PathLike | None) -> dict[str, Any]:
    """What identifies a tokenizer's ids: its kind and the sha256 of its file (None for the
    built-in byte tokenizer, which has no file)."""
    if kind == "byte":
        return {"kind": "byte", "sha256": None}
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    return {"kind": kind, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}


def _fingerprint_of(tokenizer: Tokenizer | TokenizerConfig) -> dict[str, Any]:
    """The fingerprint of a built tokenizer or of a `--tokenizer.*` config."""
    if isinstance(tokenizer, TokenizerConfig):
        return tokenizer_fingerprint(tokenizer.kind, tokenizer.path)
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer_fingerprint("hf", tokenizer.path)
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer_fingerprint("byte", None)
    return {"kind": type(tokenizer).__name__, "sha256": None}


def _same_tokenizer(corpus_fp: dict[str, Any], run_fp: dict[str, Any]) -> bool:
    return corpus_fp.get("kind") == run_fp["kind"] and corpus_fp.get("sha256") == run_fp["sha256"]


def _describe(fp: dict[str, Any]) -> str:
    sha = fp.get("sha256")
    return f"{fp.get('kind')}" + (f" (sha256 {sha[:12]})" if sha else "")


# ---- writing: `titan data tokenize` ------------------------------------------------------


def _infer_format(source: str) -> str | None:
    """The local format of `source` from its files' endings; None if it is not local."""
    exists = os.path.exists(source) or any(ch in source for ch in "*?[")
    if not exists:
        if source.endswith(tuple(e for endings in LOCAL_FORMATS.values() for e in endings)):
            raise FileNotFoundError(f"SRC {source!r} does not exist; fix the path")
        return None  # a hub dataset name
    matches = []
    for name, endings in LOCAL_FORMATS.items():
        try:
            files = resolve_data_files(name, source)
        except FileNotFoundError:
            continue
        if all(f.endswith(endings) for f in files):
            matches.append(name)
    if len(matches) != 1:
        raise ValueError(
            f"cannot tell the format of {source!r} from its file endings (found "
            f"{', '.join(matches) or 'none'}); pass --format text, json or parquet"
        )
    return matches[0]


# The dataset and tokenizer of a worker process, set once by `_init_worker`.
_WORKER: dict[str, Any] = {}


def _init_worker(dataset, text_field: str, tokenizer_cfg: TokenizerConfig) -> None:
    """Pool initializer: every worker builds its own tokenizer once."""
    _WORKER.update(dataset=dataset, field=text_field, tokenizer=tokenizer_cfg.build())


def _encode_rows(rows: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (uint32, documents end to end) and per-document lengths of rows [a, b)."""
    start, stop = rows
    texts = _WORKER["dataset"][start:stop][_WORKER["field"]]
    encode = _WORKER["tokenizer"].encode
    docs = [encode("" if t is None else str(t)) for t in texts]  # None: a null in parquet
    lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    # uint32 halves what travels back from a worker; ids are checked against the vocab later.
    flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths


def _dtype_for(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id of the vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _shard_names(i: int) -> tuple[str, str]:
    return f"tokens-{i:05d}.bin", f"index-{i:05d}.npy"


@dataclass
class _ShardWriter:
    """Tokenizes row ranges into shard files, in order, with a progress bar."""

    work: Path
    dtype: np.dtype
    vocab_size: int
    chunk_rows: int
    pool: Any  # multiprocessing pool, or None to tokenize in this process
    bar: Any  # tqdm bar (documents), or None
    tokens_done: int = 0
    started: float = 0.0

    def write(self, shard: int, start: int, stop: int) -> dict[str, int]:
        """Tokenize rows [start, stop) into shard `shard`; the index file is written last
        (its existence marks the shard finished)."""
        tokens_name, index_name = _shard_names(shard)
        chunks = [(a, min(a + self.chunk_rows, stop)) for a in range(start, stop, self.chunk_rows)]
        results = self.pool.imap(_encode_rows, chunks) if self.pool else map(_encode_rows, chunks)
        lengths = []
        partial = self.work / (tokens_name + ".tmp")
        with open(partial, "wb") as f:
            for flat, lens in results:
                if len(flat) and int(flat.max()) >= self.vocab_size:
                    raise ValueError(f"token id {int(flat.max())} >= vocab size {self.vocab_size}")
                f.write(flat.astype(self.dtype).tobytes())
                lengths.append(lens)
                self._progress(len(lens), len(flat))
            f.flush()
            os.fsync(f.fileno())
        offsets = np.zeros(stop - start + 1, dtype=np.int64)
        if lengths:
            np.cumsum(np.concatenate(lengths), out=offsets[1:])
        os.replace(partial, self.work / tokens_name)
        _save_npy_atomic(self.work / index_name, offsets)
        return self._entry(shard, offsets)

    def _progress(self, documents: int, tokens: int) -> None:
        self.tokens_done += tokens
        if self.bar is not None:
            rate = self.tokens_done / max(time.perf_counter() - self.started, 1e-9)
            self.bar.update(documents)
            self.bar.set_postfix_str(f"{self.tokens_done:,} tokens, {rate:,.0f} tokens/s")

    @staticmethod
    def _entry(shard: int, offsets: np.ndarray) -> dict[str, int]:
        tokens_name, index_name = _shard_names(shard)
        return {
            "tokens": tokens_name,
            "index": index_name,
            "num_documents": len(offsets) - 1,
            "num_tokens": int(offsets[-1]),
        }


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    partial = path.with_name(path.name + ".tmp")
    with open(partial, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def _write_json_atomic(path: Path, obj: Any) -> None:
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(partial, path)


def _prepare_work_folder(out: Path, plan: dict[str, Any]) -> Path:
    """`<out>.incomplete/`, kept if an earlier run with the same plan left it, else new."""
    if (out / MANIFEST).exists():
        raise FileExistsError(
            f"{out} already holds a tokenized corpus; choose another OUT or delete it first"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; choose another OUT")
    work = out.with_name(out.name + INCOMPLETE_SUFFIX)
    if work.exists():
        try:
            same = json.loads((work / PLAN).read_text()) == plan
        except (OSError, json.JSONDecodeError):
            same = False
        if same:
            return work
        shutil.rmtree(work)  # another run's leftovers: its shards mean nothing here
    work.mkdir(parents=True)
    _write_json_atomic(work / PLAN, plan)
    return work


def tokenize_corpus(
    source: str,
    out: str | os.PathLike,
    tokenizer: TokenizerConfig,
    *,
    text_field: str = "text",
    format: str | None = None,
    split: str = "train",
    subset: str | None = None,
    text_sample_by: str = "line",
    num_proc: int = 1,
    rows_per_shard: int = DEFAULT_ROWS_PER_SHARD,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    cache_dir: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize `source` (local files or a hub dataset, read through `datasets` exactly as
    `--dataset.name <format> --dataset.path source` would) into a corpus folder `out`.

    `num_proc` worker processes tokenize chunks of `chunk_rows` documents; the chunks are
    written in order, so the corpus does not depend on `num_proc`. Returns the manifest.
    Atomic and resumable (see the module docstring). Raises ValueError/FileExistsError with
    the flag to fix.
    """
    if num_proc < 1 or rows_per_shard < 1 or chunk_rows < 1:
        raise ValueError(
            f"--num_proc ({num_proc}), --rows_per_shard ({rows_per_shard}) and --chunk_rows "
            f"({chunk_rows}) must be >= 1"
        )
    fmt = format or _infer_format(source)
    out = Path(out).absolute()
    built = tokenizer.build()
    fingerprint = {**_fingerprint_of(tokenizer), "vocab_size": built.vocab_size}
    plan = {
        "source": source if fmt is None else str(Path(source).absolute()),
        "format": fmt or "hub",
        "text_field": text_field,
        "split": split,
        "subset": subset,
        "text_sample_by": text_sample_by,
        "tokenizer": fingerprint,
        "rows_per_shard": rows_per_shard,
    }
    work = _prepare_work_folder(out, plan)
    try:
        return _tokenize_into(work, out, plan, tokenizer, built, fingerprint, cache_dir,
                              num_proc, rows_per_shard, chunk_rows, progress)
    except Exception:
        if not any(work.glob("index-*.npy")):  # nothing worth resuming: leave no trace
            shutil.rmtree(work, ignore_errors=True)
        raise


def _tokenize_into(work, out, plan, tokenizer, built, fingerprint, cache_dir, num_proc,
                   rows_per_shard, chunk_rows, progress) -> dict[str, Any]:
    """`tokenize_corpus` once the work folder is ready: load, tokenize, write, rename."""
    fmt = None if plan["format"] == "hub" else plan["format"]
    source, text_field = plan["source"], plan["text_field"]
    local_cache = cache_dir is None and fmt is not None
    cfg = DatasetConfig(
        name=fmt or source,
        path=source if fmt else None,
        text_field=text_field,
        split=plan["split"],
        subset=plan["subset"],
        text_sample_by=plan["text_sample_by"],
        # Local text is converted to Arrow once; that copy is not worth keeping afterwards.
        cache_dir=str(work / "datasets-cache") if local_cache else cache_dir,
    )
    dataset = load_hf_dataset(cfg)
    if text_field not in dataset.column_names:
        raise ValueError(
            f"--text_field {text_field!r} is not a column of {source}; available columns: "
            f"{', '.join(dataset.column_names)}"
        )
    dataset = dataset.select_columns([text_field])
    shards = _write_shards(
        work, dataset, tokenizer, built, text_field, num_proc, rows_per_shard, chunk_rows, progress
    )
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "dtype": _dtype_for(built.vocab_size).name,
        "tokenizer": fingerprint,
        "source": {k: plan[k] for k in ("source", "format", "text_field", "split", "subset",
                                        "text_sample_by")},
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
    }
    if local_cache:
        shutil.rmtree(work / "datasets-cache", ignore_errors=True)
    _write_json_atomic(work / MANIFEST, manifest)
    if out.exists():
        out.rmdir()  # checked empty above
    os.replace(work, out)
    (out / PLAN).unlink(missing_ok=True)
    return manifest


def _write_shards(
    work, dataset, tokenizer_cfg, built, text_field, num_proc, rows_per_shard, chunk_rows, progress
) -> list[dict[str, int]]:
    """Tokenize every unfinished shard (in order) and return every shard's manifest entry."""
    rows = len(dataset)
    bounds = [(a, min(a + rows_per_shard, rows)) for a in range(0, rows, rows_per_shard)]
    bounds = bounds or [(0, 0)]  # an empty source still makes a (useless, but valid) corpus
    finished = {i for i in range(len(bounds)) if (work / _shard_names(i)[1]).exists()}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        done_rows = sum(b - a for i, (a, b) in enumerate(bounds) if i in finished)
        bar = tqdm(total=rows, initial=done_rows, unit="doc", desc="tokenize", dynamic_ncols=True)
    pool = None
    if num_proc > 1 and len(finished) < len(bounds):
        # fork (where there is one) shares the memory-mapped dataset without pickling it.
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        pool = ctx.Pool(num_proc, initializer=_init_worker,
                        initargs=(dataset, text_field, tokenizer_cfg))
    else:
        _init_worker(dataset, text_field, tokenizer_cfg)
    writer = _ShardWriter(work, _dtype_for(built.vocab_size), built.vocab_size, chunk_rows, pool,
                          bar, started=time.perf_counter())
    entries = []
    try:
        for i, (start, stop) in enumerate(bounds):
            if i in finished:
                offsets = np.load(work / _shard_names(i)[1])
                entries.append(_ShardWriter._entry(i, offsets))
            else:
                entries.append(writer.write(i, start, stop))
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    return entries


# ---- reading ------------------------------------------------------------------------------


class TokenizedCorpus:
    """A corpus folder, checked and memory-mapped: `num_documents` documents, `document(i)`
    their ids (a view, no copy). Opening reads the manifest and the document index
    (O(documents)); token shards are only mapped."""

    def __init__(self, path: str | os.PathLike, *, flag: str = "--dataset.path") -> None:
        self.path = Path(path)
        self.flag = flag
        self.manifest = read_manifest(self.path, flag=flag)
        self.dtype = np.dtype(self.manifest["dtype"])
        self.corpus_id = hashlib.sha256((self.path / MANIFEST).read_bytes()).hexdigest()[:16]
        self._tokens = []
        starts, lengths, shard_of = [], [], []
        for i, shard in enumerate(self.manifest["shards"]):
            tokens, offsets = self._open_shard(shard)
            self._tokens.append(tokens)
            starts.append(offsets[:-1])
            lengths.append(np.diff(offsets))
            shard_of.append(np.full(len(offsets) - 1, i, dtype=np.int32))
        self.starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.shard_of = np.concatenate(shard_of) if shard_of else np.zeros(0, np.int32)
        self.num_documents = len(self.lengths)

    def _open_shard(self, shard: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Map one shard's tokens and load its index, checking they agree with the manifest."""
        tokens_file, index_file = self.path / shard["tokens"], self.path / shard["index"]
        n_tokens, n_docs = int(shard["num_tokens"]), int(shard["num_documents"])
        bad = self._corrupt
        if not tokens_file.is_file() or not index_file.is_file():
            raise bad(f"{tokens_file.name} or {index_file.name} is missing")
        if tokens_file.stat().st_size != n_tokens * self.dtype.itemsize:
            raise bad(f"{tokens_file.name} holds {tokens_file.stat().st_size} bytes, the manifest "
                      f"says {n_tokens} {self.dtype.name} tokens")
        try:
            offsets = np.load(index_file)
        except (OSError, ValueError) as e:
            raise bad(f"{index_file.name} is not a numpy array ({e})") from None
        if (offsets.shape != (n_docs + 1,) or offsets[0] != 0 or offsets[-1] != n_tokens
                or np.any(np.diff(offsets) < 0)):
            raise bad(f"{index_file.name} does not describe {n_docs} documents of {n_tokens} tokens")
        # A plain ndarray view of the map: slicing a np.memmap object costs several times more.
        tokens = (np.memmap(tokens_file, dtype=self.dtype, mode="r", shape=(n_tokens,))
                  .view(np.ndarray) if n_tokens else np.zeros(0, self.dtype))
        return tokens, offsets.astype(np.int64, copy=False)

    def _corrupt(self, why: str) -> ValueError:
        return ValueError(
            f"{self.flag} {self.path} is a damaged tokenized corpus ({why}); run "
            "`titan data tokenize` again into a new folder"
        )

    def ids(self, doc: int, lo: int, hi: int) -> np.ndarray:
        """Ids lo..hi-1 of document `doc` (a view into the memory map)."""
        start = self.starts[doc]
        return self._tokens[self.shard_of[doc]][start + lo : start + hi]

    def document(self, doc: int) -> np.ndarray:
        """All ids of document `doc`, unframed."""
        return self.ids(doc, 0, int(self.lengths[doc]))

    def check_tokenizer(self, tokenizer: Tokenizer | TokenizerConfig) -> None:
        """Refuse a run whose tokenizer is not the one the corpus was written with."""
        check_corpus_tokenizer(self.path, self.manifest, tokenizer, self.flag)


def read_manifest(path: Path, *, flag: str = "--dataset.path") -> dict[str, Any]:
    """The checked manifest of corpus folder `path` (ValueError/FileNotFoundError naming `flag`)."""
    file = path / MANIFEST
    if not file.is_file():
        incomplete = path.with_name(path.name + INCOMPLETE_SUFFIX).exists()
        hint = ("an interrupted `titan data tokenize` left it unfinished; rerun the same command "
                "to finish it") if incomplete else "point it at a folder written by `titan data tokenize`"
        raise FileNotFoundError(f"{flag} {path}: no tokenized corpus there ({MANIFEST} missing); {hint}")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} {path}: {MANIFEST} is not valid JSON ({e}); tokenize again") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise ValueError(
            f"{flag} {path}: not a {FORMAT} corpus of version {FORMAT_VERSION} (format "
            f"{manifest.get('format')!r}, version {manifest.get('version')!r}); tokenize it again "
            "with this titan"
        )
    if manifest.get("dtype") not in ("uint16", "uint32") or not isinstance(manifest.get("shards"), list):
        raise ValueError(f"{flag} {path}: {MANIFEST} lacks a valid dtype or shard list; tokenize again")
    return manifest


def check_corpus_tokenizer(path, manifest, tokenizer, flag: str = "--dataset.path") -> None:
    """ValueError (one line, naming the flags) when `tokenizer` differs from the corpus'."""
    theirs, ours = manifest.get("tokenizer", {}), _fingerprint_of(tokenizer)
    if not _same_tokenizer(theirs, ours):
        raise ValueError(
            f"{flag} {path} was tokenized with the {_describe(theirs)} tokenizer, but this run's "
            f"--tokenizer.kind/--tokenizer.path give {_describe(ours)}; train with the corpus' "
            "tokenizer, or run `titan data tokenize` again with this one"
        )


def _corpora(cfg: DatasetConfig) -> list[tuple[str, str, float]]:
    """(flag, path, weight) of every corpus the config names."""
    if cfg.mix:
        return [("--dataset.mix", path, weight) for path, weight in parse_mix(cfg.mix)]
    return [("--dataset.path", cfg.path, 1.0)]


def check_tokenized_dataset(cfg: DatasetConfig, tokenizer: TokenizerConfig | None) -> None:
    """The cheap up-front checks (run before any process group or model): every corpus has a
    valid manifest and, given `tokenizer`, was written with it."""
    for flag, path, _ in _corpora(cfg):
        manifest = read_manifest(Path(path), flag=flag)
        if tokenizer is not None:
            check_corpus_tokenizer(Path(path), manifest, tokenizer, flag)


# ---- the stream ---------------------------------------------------------------------------


class CorpusStream:
    """One corpus as the endless stream of framed documents the on-the-fly packer makes:
    epoch e in the order seeded by (seed, e) (index order without `shuffle`), each document
    `BOS ids EOS` (`ids EOS` when BOS == EOS), empty ones skipped. Random access: `read(pos,
    out)` costs a binary search plus the copy, whatever `pos`."""

    def __init__(
        self, corpus: TokenizedCorpus, *, bos_id: int, eos_id: int, shuffle: bool, seed: int
    ) -> None:
        self.corpus, self.bos_id, self.eos_id = corpus, bos_id, eos_id
        self.shuffle, self.seed = shuffle, seed
        self.head = 1 if bos_id != eos_id else 0
        lengths = corpus.lengths
        self.framed = np.where(lengths > 0, lengths + self.head + 1, 0)
        self.epoch_tokens = int(self.framed.sum())
        if self.epoch_tokens == 0:
            raise ValueError(
                f"{corpus.flag} {corpus.path} has no tokens (every document is empty); "
                "check the text field it was tokenized from"
            )
        self._epoch: tuple[int, np.ndarray, np.ndarray] | None = None  # (epoch, order, cum)

    def reseed(self, seed: int) -> None:
        """Use another seed (a resumed run keeps the saved one)."""
        if seed != self.seed:
            self.seed, self._epoch = seed, None

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Epoch's document order and the cumulative framed lengths along it (cached)."""
        if self._epoch is None or (self.shuffle and self._epoch[0] != epoch):
            order = np.arange(self.corpus.num_documents, dtype=np.int64)
            if self.shuffle:
                # The same permutation as DocumentPacker's, so the streams agree token for token.
                order = np.random.default_rng([self.seed, epoch]).permutation(order)
            cum = np.zeros(len(order) + 1, dtype=np.int64)
            np.cumsum(self.framed[order], out=cum[1:])
            self._epoch = (epoch, order, cum)
        return self._epoch[1], self._epoch[2]

    def read(self, pos: int, out: np.ndarray, starts: np.ndarray | None = None) -> None:
        """Write stream tokens pos .. pos+len(out)-1 into `out`; mark in `starts` (already
        False) the first token of every document that begins inside."""
        epoch, q = divmod(pos, self.epoch_tokens)
        done, n = 0, len(out)
        while done < n:
            order, cum = self._order(epoch)
            cursor = int(np.searchsorted(cum, q, side="right")) - 1  # a non-empty document
            while done < n and cursor < len(order):
                doc = int(order[cursor])
                off = q - int(cum[cursor])
                take = min(int(self.framed[doc]) - off, n - done)
                if take > 0:
                    self._copy(doc, off, off + take, out[done : done + take])
                    if starts is not None and off == 0:
                        starts[done] = True
                    done, q = done + take, q + take
                if done < n:
                    cursor += 1
            epoch, q = epoch + 1, 0

    def _copy(self, doc: int, a: int, b: int, dest: np.ndarray) -> None:
        """Framed tokens a..b-1 of document `doc` into `dest`."""
        n, i = int(self.corpus.lengths[doc]), 0
        if a < self.head:
            dest[0], i = self.bos_id, 1
        lo, hi = max(a, self.head) - self.head, min(b, self.head + n) - self.head
        if hi > lo:
            dest[i : i + hi - lo] = self.corpus.ids(doc, lo, hi)
            i += hi - lo
        if b > self.head + n:
            dest[i] = self.eos_id


class TokenizedPacker:
    """`DocumentPacker`'s interface (`fill`, `skip`, `state_dict`, `shuffle`, `seed`) over
    one or several pre-tokenized corpora, so `PackedBatches` and `PackedDataLoader` cut and
    resume its stream exactly as they do the on-the-fly one. The position is one token count
    into the global stream; `skip` is O(1) and `fill` costs the tokens it copies.

    The stream is a sequence of windows of `window` tokens; window w comes from corpus c at
    its own window k (`locate`): with one corpus, c = 0 and k = w, so the stream is the
    corpus stream itself.
    """

    def __init__(
        self, streams: list[CorpusStream], block_counts: list[int], *, window: int,
        shuffle: bool, seed: int, corpus_id: str,
    ) -> None:
        self.streams, self.window = streams, window
        self.block_counts = block_counts
        self.block = sum(block_counts)
        self.shuffle, self.seed, self.corpus_id = shuffle, seed, corpus_id
        self.position = 0
        self._pattern: tuple[int, np.ndarray, np.ndarray] | None = None

    def locate(self, w: int) -> tuple[int, int]:
        """(corpus, that corpus' window index) of global window `w`."""
        if len(self.streams) == 1:
            return 0, w
        block, j = divmod(w, self.block)
        pattern, before = self._block(block)
        c = int(pattern[j])
        return c, block * self.block_counts[c] + int(before[j, c])

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Block's corpus sequence (seeded by (seed, block)) and the per-corpus counts before
        each of its windows."""
        if self._pattern is None or self._pattern[0] != block:
            pattern = np.repeat(np.arange(len(self.block_counts)), self.block_counts)
            # A third seed word keeps this stream apart from the epochs' (seed, epoch) orders.
            pattern = np.random.default_rng([self.seed, block, 1]).permutation(pattern)
            onehot = np.eye(len(self.block_counts), dtype=np.int64)[pattern]
            before = np.zeros((len(pattern) + 1, len(self.block_counts)), dtype=np.int64)
            np.cumsum(onehot, axis=0, out=before[1:])
            self._pattern = (block, pattern, before)
        return self._pattern[1], self._pattern[2]

    def skip(self, n: int) -> None:
        """Advance past `n` tokens (other ranks' rows) without reading them."""
        self.position += n

    def fill(self, out: np.ndarray, starts: np.ndarray | None = None) -> None:
        """The next len(out) tokens into `out` (and document starts into `starts`)."""
        if starts is not None:
            starts[:] = False
        if len(self.streams) == 1:  # the corpus' own stream: one read, no window bookkeeping
            self.streams[0].read(self.position, out, starts)
            self.position += len(out)
            return
        done = 0
        while done < len(out):
            w, j = divmod(self.position, self.window)
            c, k = self.locate(w)
            take = min(self.window - j, len(out) - done)
            piece = None if starts is None else starts[done : done + take]
            self.streams[c].read(k * self.window + j, out[done : done + take], piece)
            done += take
            self.position += take

    def state_dict(self) -> dict[str, Any]:
        """The position (tokens into the global stream), the seed, and which corpora (and
        weights) it counts in."""
        return {"tokens": self.position, "seed": self.seed, "corpus": self.corpus_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Jump to a saved position of the same corpora."""
        if state.get("corpus") != self.corpus_id:
            raise ValueError(
                "cannot resume the data loader: the checkpoint's position is in "
                f"{'another data stream' if state.get('corpus') else 'an on-the-fly stream'} "
                f"(corpus {state.get('corpus')!r}, this run {self.corpus_id!r}); resume with the "
                "same --dataset.name/--dataset.path/--dataset.mix, or restart the data stream with "
                "--checkpoint.exclude_from_loading dataloader"
            )
        self.position = int(state["tokens"])
        self.seed = int(state["seed"])  # the saved seed wins, as on the fly
        for stream in self.streams:
            stream.reseed(self.seed)
        self._pattern = None


def build_tokenized_dataloader(
    cfg: DatasetConfig,
    tokenizer: Tokenizer,
    *,
    dp_rank: int,
    dp_world_size: int,
    local_batch_size: int,
    seq_len: int,
    seed: int,
) -> PackedDataLoader:
    """`build_dataloader` for `--dataset.name tokenized`: the same batches, state format and
    resume guarantees, read from memory-mapped corpora (see the module docstring)."""
    check_loader_args(dp_rank, dp_world_size, local_batch_size, seq_len)
    corpora = _corpora(cfg)
    streams, ids = [], []
    for flag, path, _ in corpora:
        corpus = TokenizedCorpus(path, flag=flag)
        corpus.check_tokenizer(tokenizer)
        streams.append(CorpusStream(corpus, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id,
                                    shuffle=cfg.shuffle, seed=seed))
        ids.append(corpus.corpus_id)
    counts = mix_block_counts([w for _, _, w in corpora])
    corpus_id = ",".join(f"{i}*{n}" for i, n in zip(ids, counts, strict=True))
    packer = TokenizedPacker(streams, counts, window=seq_len + 1, shuffle=cfg.shuffle, seed=seed,
                             corpus_id=corpus_id)
    batches = PackedBatches(
        packer, local_batch_size, seq_len, dp_rank=dp_rank, dp_world_size=dp_world_size
    )
    return PackedDataLoader(
        batches, dp_rank=dp_rank, dp_world_size=dp_world_size,
        num_documents=sum(s.corpus.num_documents for s in streams),
    )
