"""Document sources: map-style collections of documents, indexed 0..len-1.

Being indexable (rather than streams) is what makes resuming cheap: the
loader's position is a document index plus a token offset. Sources hand out
token ids (`tokens(i)`), tokenizing lazily so the first batch never waits
for a whole corpus.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sysconfig
from collections.abc import Sequence
from typing import Any

import numpy as np
from titan.train.data.tokenizer import Tokenizer

__all__ = [
    "DocumentSource",
    "TextSource",
    "StdlibSource",
    "HFDatasetSource",
    "SyntheticSource",
    "LOCAL_FORMATS",
    "resolve_data_files",
    "stdlib_files",
]

# Local file formats `datasets` reads, and the file endings we collect when
# --dataset.path names a directory.
LOCAL_FORMATS: dict[str, tuple[str, ...]] = {
    "text": (".txt", ".text", ".md"),
    "json": (".json", ".jsonl", ".json.gz", ".jsonl.gz"),
    "parquet": (".parquet",),
}


class DocumentSource:
    """Base class: `len(source)` documents, `tokens(i)` their ids (no separators)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def tokens(self, index: int) -> np.ndarray:
        """Token ids (int64) of document `index`, without BOS/EOS."""
        raise NotImplementedError

    def prefetch(self, indices: np.ndarray) -> None:
        """Hint: documents `indices` will be asked for next, in this order.

        A source that reads documents cheaper in blocks may read them now; the
        default ignores it. Only a hint: `tokens(i)` is the same either way.
        """


class TextSource(DocumentSource):
    """A source of text documents, tokenized on access."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, index: int) -> str:
        """The raw text of document `index`."""
        raise NotImplementedError

    def tokens(self, index: int) -> np.ndarray:
        """Tokenize document `index` now (never cached: memory stays flat)."""
        return np.asarray(self.tokenizer.encode(self.text(index)), dtype=np.int64)


class StdlibSource(TextSource):
    """Python's own standard library `.py` files, one document per file.

    Real, varied text present on every machine with Python, so tests and
    smoke runs need neither a download nor committed third-party text.
    """

    def __init__(self, tokenizer: Tokenizer, files: Sequence[str] | None = None) -> None:
        super().__init__(tokenizer)
        self.files = list(stdlib_files() if files is None else files)

    def __len__(self) -> int:
        return len(self.files)

    def text(self, index: int) -> str:
        """Read file `index` (undecodable bytes replaced, never an error)."""
        with open(self.files[index], encoding="utf-8", errors="replace") as f:
            return f.read()


# Directories under the stdlib that are not the standard library proper
# (third-party installs) or are huge and repetitive (test suites, fixtures).
_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3"}
)


def stdlib_files(root: str | None = None) -> list[str]:
    """Sorted paths of the stdlib's `.py` files (deterministic for one Python)."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending; sorting is done at the end.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    if not found:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")
    return sorted(found)


class HFDatasetSource(TextSource):
    """A map-style `datasets.Dataset`, one row per document, text in `text_field`."""

    def __init__(self, dataset, tokenizer: Tokenizer, text_field: str) -> None:
        super().__init__(tokenizer)
        if text_field not in dataset.column_names:
            raise ValueError(
                f"--dataset.text_field {text_field!r} is not a column of the dataset; "
                f"available columns: {', '.join(dataset.column_names)}"
            )
        text_columns = _text_columns(dataset)
        if text_field not in text_columns:
            feature = dataset.features[text_field]
            kind = getattr(feature, "dtype", None) or type(feature).__name__
            raise ValueError(
                f"--dataset.text_field {text_field!r} holds {kind} values, not text: pretraining reads one "
                f"string per row (its text would be the Python form of each value). Pick a text column "
                f"({', '.join(text_columns) or 'the dataset has none'}); conversations train with "
                "`titan sft`"
            )
        # Selecting the column once avoids decoding every other column per access.
        self.dataset = dataset.select_columns([text_field])
        self.text_field = text_field
        # The texts of the last prefetched block, by row index: one Arrow read per block
        # instead of one `__getitem__` (~10-40 us) per row. Never part of the position.
        self._block: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def prefetch(self, indices: np.ndarray) -> None:
        """Read the rows `indices` in one go (a slice when they are consecutive)."""
        rows = np.asarray(indices, dtype=np.int64).tolist()
        if not rows:
            return
        start, stop = rows[0], rows[-1] + 1
        if stop - start == len(rows) and rows == list(range(start, stop)):
            values = self.dataset[start:stop][self.text_field]
        else:
            values = self.dataset[rows][self.text_field]
        self._block = dict(zip(rows, values, strict=True))

    def text(self, index: int) -> str:
        """Row `index`'s text (None, e.g. a null in parquet, reads as empty)."""
        index = int(index)
        if index in self._block:
            value = self._block[index]
        else:
            value = self.dataset[index][self.text_field]
        return "" if value is None else value


class SyntheticSource(DocumentSource):
    """Adapter exposing a `SyntheticCorpus` as a `DocumentSource`."""

    def __init__(self, corpus) -> None:
        self.corpus = corpus

    def __len__(self) -> int:
        return len(self.corpus)

    def tokens(self, index: int) -> np.ndarray:
        """The corpus already produces tokenizer ids."""
        return self.corpus.tokens(index)


def _text_columns(dataset) -> list[str]:
    """The dataset's columns that hold strings."""
    return [name for name, feature in dataset.features.items()
            if getattr(feature, "dtype", None) in ("string", "large_string")]


def resolve_data_files(name: str, path: str) -> list[str]:
    """The local files `--dataset.path` names: a file, a directory or a glob.

    Raises FileNotFoundError naming the flag when nothing matches, so a typo
    fails before any process group, model or dataset is built.
    """
    if os.path.isfile(path):
        other = next((kind for kind, endings in LOCAL_FORMATS.items() if kind != name and path.endswith(endings)
                      and not path.endswith(LOCAL_FORMATS.get(name, ()))), None)
        if other is not None:  # a file of another kind would fail inside `datasets` with a parse error
            raise ValueError(f"--dataset.path {path!r} is a {other} file, not {name}: use --dataset.name {other}")
        return [path]
    if os.path.isdir(path):
        files = files_in_dir(path, LOCAL_FORMATS[name])
        if not files:
            raise FileNotFoundError(
                f"--dataset.path {path!r} is a directory with no {'/'.join(LOCAL_FORMATS[name])} "
                f"files for --dataset.name {name}; point it at the files or a glob"
            )
        return files
    files = sorted(f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise FileNotFoundError(
            f"--dataset.path {path!r} does not exist (no file, directory or glob match); "
            "fix the path"
        )
    return files


def files_in_dir(directory: str, endings: tuple[str, ...]) -> list[str]:
    """Files below `directory` with one of `endings`, sorted for determinism."""
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(endings))
    return sorted(found)


def load_local_files(kind: str, files: list[str], *, flag: str, **kwargs: Any):
    """``datasets.load_dataset(kind, data_files=files, **kwargs)``, except that a file it cannot
    parse is a one-line ValueError naming ``flag``, the file and (JSON Lines) the line, instead
    of `datasets`' DatasetGenerationError three tracebacks deep."""
    import datasets  # deferred: importing it costs ~1 s

    try:
        return datasets.load_dataset(kind, data_files=files, **kwargs)
    except Exception as err:  # DatasetGenerationError, or pyarrow's own while inferring the schema
        problem = why_unreadable(kind, files, err)
        if problem is None:
            raise
        raise ValueError(f"{flag}: {problem}") from err


def why_unreadable(kind: str, files: list[str], err: BaseException) -> str | None:
    """Which of `files` `datasets` failed on and why (looked for only after it failed); for a
    generation error with no file to blame, its innermost cause; None for any other error."""
    import datasets

    finder = {"json": _bad_json_line, "parquet": _bad_parquet_file, "text": _bad_text_file}.get(kind)
    for path in files:
        # `datasets` infers the schema from the first file and stops with a bare StopIteration
        # when that one has nothing in it.
        problem = _empty_text_file(path) if kind in ("json", "text") else None
        problem = problem or (finder(path) if finder else None)
        if problem:
            return problem
    if not isinstance(err, datasets.exceptions.DatasetGenerationError):
        return None
    cause = err
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    return f"`datasets` could not read the {kind} files ({type(cause).__name__}: {cause})"


def _open_text(path: str):
    return gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")


def _empty_text_file(path: str) -> str | None:
    """`path`'s problem when it holds nothing but whitespace (read up to its first other
    character), else None."""
    try:
        with _open_text(path) as f:
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    return None
    except (OSError, UnicodeDecodeError):
        return None  # the format's own check names what is wrong
    return f"{path} is empty (no records); remove it or leave it out of the path"


def _bad_json_line(path: str) -> str | None:
    """The first line of a JSON Lines file that is not one JSON object; None when every line
    is one, or the whole file is one JSON document (`datasets` reads those too)."""
    try:
        with _open_text(path) as f:
            json.load(f)
        return None
    except (ValueError, UnicodeDecodeError):
        pass
    try:
        with _open_text(path) as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    return f"{path} line {number} is not valid JSON ({exc}); each line must be one JSON object"
                if not isinstance(record, dict):
                    return (f"{path} line {number} is a JSON {type(record).__name__}, not an object; each "
                            "line must be one JSON object")
    except UnicodeDecodeError as exc:
        return f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
    return None


def _bad_parquet_file(path: str) -> str | None:
    """`path`'s problem when it is not a readable Parquet file, else None."""
    import pyarrow.parquet as pq

    try:
        pq.ParquetFile(path).schema_arrow  # noqa: B018 - reading the footer is the check
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ...
        return f"{path} is not a readable Parquet file ({exc})"
    return None


def _bad_text_file(path: str) -> str | None:
    """`path`'s problem when it is not UTF-8 text, else None."""
    try:
        with _open_text(path) as f:
            for _ in f:
                pass
    except UnicodeDecodeError as exc:
        return f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
    return None
