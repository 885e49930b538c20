"""Writing pre-tokenized corpora: `titan data tokenize` (``tokenize_corpus``).

Writing is atomic: everything goes to `<OUT>.incomplete/` and is renamed to `OUT` once the
manifest is written, so an interrupted run never leaves a folder that looks complete. A rerun
with the same arguments keeps the shards that were finished (a shard is finished when its
index file exists) and tokenizes the rest. The format is ``titan.train.data.tokenized``'s.

With ``streaming`` the source is read as `datasets` streams it (a hub corpus too large to
download first): each source shard (file) becomes one corpus shard, tokenized by one worker
process straight from the stream, so nothing but the corpus itself is written to disk.
"""

from __future__ import annotations

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
from titan.train.data.config import DatasetConfig
from titan.train.data.corpus_format import (
    FORMAT,
    FORMAT_VERSION,
    INCOMPLETE_SUFFIX,
    MANIFEST,
    fingerprint_of,
)
from titan.train.data.loader import build_stream, load_hf_dataset
from titan.train.data.records import is_dataset_repository, is_hub_dataset
from titan.train.data.sources import LOCAL_FORMATS, resolve_data_files
from titan.train.data.streaming import ShardedStream
from titan.train.data.tokenizer import TokenizerConfig

PLAN = "plan.json"  # in the work folder only: the arguments a resumed run must share
DEFAULT_ROWS_PER_SHARD = 1 << 18
DEFAULT_CHUNK_ROWS = 512


# ---- writing: `titan data tokenize` ------------------------------------------------------


def _infer_format(source: str) -> str | None:
    """The local format of `source` from its files' endings; None if it is a hub dataset name or
    a dataset repository (a folder laid out as on the Hub, which `datasets` reads by its name)."""
    if is_hub_dataset(source):
        return None
    # A path written as one (absolute, ./, ../, ~, a data file's ending) that is not there.
    if not os.path.exists(source) and not any(ch in source for ch in "*?["):
        raise FileNotFoundError(f"SRC {source!r} does not exist; fix the path")
    matches = []
    for name, endings in LOCAL_FORMATS.items():
        try:
            files = resolve_data_files(name, source)
        except (FileNotFoundError, ValueError):  # none of this kind, or a file of another kind
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
    return _encode_texts(_WORKER["dataset"][start:stop][_WORKER["field"]], _WORKER["tokenizer"].encode)


def _encode_texts(texts, encode) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (uint32, documents end to end) and per-document lengths of `texts`."""
    docs = [encode("" if t is None else str(t)) for t in texts]  # None: a null in parquet
    lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    # uint32 halves what travels back from a worker; ids are checked against the vocab later.
    flat = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths


def _write_shard_file(work: Path, shard: int, encoded, vocab_size: int, on_chunk=None) -> dict[str, int]:
    """Write corpus shard `shard` from `encoded` chunks ((ids, lengths) pairs, in order): the
    tokens through a temporary file, then the index, written last (its existence marks the
    shard finished). `on_chunk(documents, tokens)` follows the progress."""
    dtype = _dtype_for(vocab_size)
    tokens_name, index_name = _shard_names(shard)
    lengths = [np.zeros(1, dtype=np.int64)]
    partial = work / (tokens_name + ".tmp")
    with open(partial, "wb") as f:
        for flat, lens in encoded:
            if len(flat) and int(flat.max()) >= vocab_size:
                raise ValueError(f"token id {int(flat.max())} >= vocab size {vocab_size}")
            f.write(flat.astype(dtype).tobytes())
            lengths.append(lens)
            if on_chunk is not None:
                on_chunk(len(lens), len(flat))
        f.flush()
        os.fsync(f.fileno())
    offsets = np.cumsum(np.concatenate(lengths))
    os.replace(partial, work / tokens_name)
    _save_npy_atomic(work / index_name, offsets)
    return _ShardWriter._entry(shard, offsets)


def _init_stream_worker(stream: ShardedStream, tokenizer_cfg: TokenizerConfig, work: Path, vocab_size: int,
                        chunk_rows: int) -> None:
    """Pool initializer of a streamed source: every worker builds its own tokenizer once."""
    _WORKER.update(stream=stream, tokenizer=tokenizer_cfg.build(), work=work, vocab_size=vocab_size,
                   chunk_rows=chunk_rows)


def _write_stream_shard(shard: int) -> dict[str, int]:
    """Stream source shard `shard`, tokenize it and write corpus shard `shard` (in a worker, or
    here), `chunk_rows` documents at a time."""
    texts, chunk_rows = _WORKER["stream"].rows(shard, 0), _WORKER["chunk_rows"]
    chunks = iter(lambda: list(itertools.islice(texts, chunk_rows)), [])
    encoded = (_encode_texts(chunk, _WORKER["tokenizer"].encode) for chunk in chunks)
    return _write_shard_file(_WORKER["work"], shard, encoded, _WORKER["vocab_size"])


def _dtype_for(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type that holds every id of the vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def _shard_names(i: int) -> tuple[str, str]:
    return f"tokens-{i:05d}.bin", f"index-{i:05d}.npy"


@dataclass
class _ShardWriter:
    """Tokenizes row ranges into shard files, in order, with a progress bar."""

    work: Path
    vocab_size: int
    chunk_rows: int
    pool: Any  # multiprocessing pool, or None to tokenize in this process
    bar: Any  # tqdm bar (documents), or None
    tokens_done: int = 0
    started: float = 0.0

    def write(self, shard: int, start: int, stop: int) -> dict[str, int]:
        """Tokenize rows [start, stop) into shard `shard` (see `_write_shard_file`)."""
        chunks = [(a, min(a + self.chunk_rows, stop)) for a in range(start, stop, self.chunk_rows)]
        results = self.pool.imap(_encode_rows, chunks) if self.pool else map(_encode_rows, chunks)
        return _write_shard_file(self.work, shard, results, self.vocab_size, self._progress)

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
    streaming: bool = False,
) -> dict[str, Any]:
    """Tokenize `source` (local files or a hub dataset, read through `datasets` exactly as
    `--dataset.name <format> --dataset.path source` would) into a corpus folder `out`.

    `num_proc` worker processes tokenize chunks of `chunk_rows` documents; the chunks are
    written in order, so the corpus does not depend on `num_proc`. With `streaming`, the
    source is streamed instead of loaded: one corpus shard per source shard (file), each
    tokenized by one worker (`rows_per_shard` does not apply). Returns the manifest.
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
    fingerprint = {**fingerprint_of(tokenizer), "vocab_size": built.vocab_size}
    plan = {
        "source": str(Path(source).absolute()) if fmt or is_dataset_repository(source) else source,
        "format": fmt or "hub",
        "text_field": text_field,
        "split": split,
        "subset": subset,
        "text_sample_by": text_sample_by,
        "tokenizer": fingerprint,
        # Streamed: one corpus shard per source shard, so the rows per shard are the source's.
        "rows_per_shard": None if streaming else rows_per_shard,
        "streaming": streaming,
    }
    _source_config(plan, cache_dir)  # flags the source would not read fail before any folder is made
    work = _prepare_work_folder(out, plan)
    try:
        return _tokenize_into(work, out, plan, tokenizer, built, fingerprint, cache_dir,
                              num_proc, rows_per_shard, chunk_rows, progress)
    except Exception:
        if not any(work.glob("index-*.npy")):  # nothing worth resuming: leave no trace
            shutil.rmtree(work, ignore_errors=True)
        raise


def _source_config(plan: dict[str, Any], cache_dir: str | None) -> DatasetConfig:
    """The `DatasetConfig` that reads the plan's source; its errors name this command's flags
    (``--text_field``, ``--split``, ``--subset``, ``--text_sample_by``)."""
    fmt = None if plan["format"] == "hub" else plan["format"]
    try:
        cfg = DatasetConfig(
            name=fmt or plan["source"], path=plan["source"] if fmt else None, text_field=plan["text_field"],
            split=plan["split"], subset=plan["subset"], text_sample_by=plan["text_sample_by"], cache_dir=cache_dir,
            streaming=plan["streaming"],
        )
        cfg.check_unread_fields()  # every one of these came from the command line
        return cfg
    except ValueError as err:
        message = str(err)
        for field in ("text_field", "split", "subset", "text_sample_by"):
            message = message.replace(f"--dataset.{field}", f"--{field}")
        raise ValueError(message.replace("--dataset.name", "SRC of format")) from err


def _tokenize_into(work, out, plan, tokenizer, built, fingerprint, cache_dir, num_proc,
                   rows_per_shard, chunk_rows, progress) -> dict[str, Any]:
    """`tokenize_corpus` once the work folder is ready: load, tokenize, write, rename."""
    fmt = None if plan["format"] == "hub" else plan["format"]
    source, text_field = plan["source"], plan["text_field"]
    local_cache = cache_dir is None and fmt is not None
    # Local text is converted to Arrow once; that copy is not worth keeping afterwards.
    cfg = _source_config(plan, str(work / "datasets-cache") if local_cache else cache_dir)
    if plan["streaming"]:
        shards = _write_streamed_shards(work, cfg, tokenizer, built, num_proc, chunk_rows, progress)
        return _finish(work, out, plan, built, fingerprint, shards, local_cache)
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
    return _finish(work, out, plan, built, fingerprint, shards, local_cache)


def _finish(work, out, plan, built, fingerprint, shards, local_cache) -> dict[str, Any]:
    """Write the manifest of the finished `shards` and move the work folder to `out`."""
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


def _write_streamed_shards(work, cfg: DatasetConfig, tokenizer_cfg, built, num_proc, chunk_rows,
                           progress) -> list[dict[str, int]]:
    """Tokenize every unfinished source shard of the streamed `cfg` (one per worker at a time)
    and return every corpus shard's manifest entry, in the source's order."""
    stream = build_stream(cfg, None, flag="SRC", field_flag="--text_field")
    todo = [i for i in range(stream.num_shards) if not (work / _shard_names(i)[1]).exists()]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=stream.num_shards, initial=stream.num_shards - len(todo), unit="shard",
                   desc="tokenize (streamed)", dynamic_ncols=True)
    init_args = (stream, tokenizer_cfg, work, built.vocab_size, chunk_rows)
    pool = None
    if num_proc > 1 and len(todo) > 1:
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
        pool = ctx.Pool(min(num_proc, len(todo)), initializer=_init_stream_worker, initargs=init_args)
    else:
        _init_stream_worker(*init_args)
    tokens, started = 0, time.perf_counter()
    try:
        for entry in (pool.imap(_write_stream_shard, todo) if pool else map(_write_stream_shard, todo)):
            tokens += entry["num_tokens"]
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"{tokens:,} tokens, {tokens / max(time.perf_counter() - started, 1e-9):,.0f}"
                                    " tokens/s")
    finally:
        if pool is not None:
            pool.terminate()
        if bar is not None:
            bar.close()
    return [_ShardWriter._entry(i, np.load(work / _shard_names(i)[1])) for i in range(stream.num_shards)]


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
    writer = _ShardWriter(work, built.vocab_size, chunk_rows, pool,
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


