"""Where SFT examples and RL prompts come from: local JSONL/Parquet files, a folder laid out in
splits, or a Hugging Face Hub dataset read through `datasets` by its name.

One function, :func:`load_records`, gives the rows of ``--sft_data.path`` / ``--rl_data.path``
(and their ``eval_path``) as a map-style ``datasets.Dataset``:

- **Local files** (a file, a directory or a glob of ``.jsonl``/``.json``/``.parquet``, one
  kind) are read with `datasets`' json or parquet builder; a directory laid out in splits as a
  downloaded Hub dataset is (``data/train-*.parquet``, ``data/test-*.parquet``) gives one split.
- **A Hub dataset name** (``trl-lib/Capybara``) or **a folder laid out as a Hub dataset
  repository** (a README whose YAML header declares its ``configs``) is read with
  ``datasets.load_dataset(path, subset, split=...)``, as TRL reads ``dataset_name``,
  ``dataset_config`` and its train/test splits. The configuration and the split are checked
  against the dataset's own lists first, so a wrong one is one line naming the flag.

The split read is ``--*.split`` (default ``train``) for the training rows and ``--*.eval_split``
for the held-out ones (default: ``validation``, else ``test``); a plain file has no splits, so
those flags (and ``--*.subset``) are refused for it rather than ignored.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan.train.data.sources import LOCAL_FORMATS, files_in_dir, load_local_files

HELD_OUT_SPLITS = ("validation", "test")
"""The splits held-out rows are read from, in this order, unless an eval split is named."""

RECORD_FORMATS = ("json", "parquet")
"""The file kinds SFT examples and RL prompts are read from (`datasets` builder names)."""

TRAIN_SPLIT = "train"
"""The split training rows are read from unless one is named; plain files count as it."""


@dataclass(kw_only=True)
class RecordSplitsConfig:
    """The configuration and splits of the dataset a ``path`` / ``eval_path`` pair names
    (``--sft_data.*``, ``--rl_data.*``), as TRL names them ``dataset_config``,
    ``dataset_train_split`` and ``dataset_test_split``."""

    subset: str | None = None
    """A Hub dataset (or a folder laid out as a Hub dataset repository): its configuration
    name, as `datasets.load_dataset(path, subset)` takes it; needed when it has several."""
    split: str = TRAIN_SPLIT
    """The split of the path that is trained on: a Hub dataset's split name (`train_sft`, or a
    slice such as `train[:10%]`), or in a folder laid out in splits the files of that split."""
    eval_split: str | None = None
    """The split of the eval_path that is held out; default: its "validation" split, else
    "test" (a plain file or folder without splits is read whole)."""

    def check_record_splits(self, section: str, *, reads_files: bool) -> None:
        """Refuse split flags the format does not read (``reads_files`` False: a built-in
        task) and an eval split with nothing to take it from; errors name ``section``'s flags."""
        given = [f"{section}.{name} {value!r}" for name, value, default in (
            ("subset", self.subset, None), ("split", self.split, TRAIN_SPLIT), ("eval_split", self.eval_split, None))
            if value != default]
        if given and not reads_files:
            raise ValueError(f"{', '.join(given)}: not read by {section}.format {getattr(self, 'resolved_format', getattr(self, 'format', ''))}, "
                             "which reads no file; drop it")
        if not self.split:
            raise ValueError(f"{section}.split is empty; name the split to train on (default {TRAIN_SPLIT})")
        if self.eval_split is not None and not getattr(self, "eval_path", None):
            raise ValueError(f"{section}.eval_split {self.eval_split!r} picks a split of {section}.eval_path, "
                             f"which is not set; set it (to the same dataset as {section}.path for its held-out split)")


def is_dataset_repository(source: str) -> bool:
    """Whether `source` is a folder laid out as a Hub dataset repository: a README.md whose YAML
    header declares its `configs` (the Hub's allenai/c4, downloaded, is one)."""
    readme = Path(source) / "README.md"
    if not readme.is_file():
        return False
    text = readme.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return False
    header = text[3:].split("\n---", 1)[0]
    return any(line.startswith("configs:") for line in header.splitlines())


def looks_local(source: str) -> bool:
    """Whether `source` is written as a local path (absolute, ./, ../, ~, a glob, or with a data
    file's ending) rather than as a Hub dataset name (`name` or `org/name`)."""
    endings = tuple(e for kind in LOCAL_FORMATS.values() for e in kind)
    return (os.path.isabs(source) or source.startswith(("./", "../", "~")) or source.endswith(endings)
            or any(ch in source for ch in "*?["))


def is_hub_dataset(source: str) -> bool:
    """Whether `source` is read through `datasets.load_dataset` by name: a folder laid out as a
    Hub dataset repository, or a name that is no local path (a Hub dataset)."""
    if os.path.exists(source):
        return os.path.isdir(source) and is_dataset_repository(source)
    return not looks_local(source)


def load_records(path: str, *, flag: str, split: str | None, subset: str | None = None,
                 held_out: bool = False, cache_dir: str | None = None):
    """The rows of `path` (given by `flag`, e.g. ``--sft_data.path``) as a ``datasets.Dataset``:
    its `split` (None: "train", or with `held_out` "validation" else "test") of configuration
    `subset`. Errors are one line naming the flag to fix."""
    section = flag.rsplit(".", 1)[0]
    if is_hub_dataset(path):
        return _load_hub_records(path, flag=flag, section=section, split=split, subset=subset,
                                 held_out=held_out, cache_dir=cache_dir)
    kind, files = resolve_local_records(path, flag=flag, held_out=held_out, split=split, subset=subset)
    return load_local_files(kind, files, flag=flag, split=TRAIN_SPLIT, cache_dir=cache_dir)


def resolve_local_records(path: str, *, flag: str, split: str | None, subset: str | None = None,
                          held_out: bool = False) -> tuple[str, list[str]]:
    """(`datasets` builder, files) of local records (see :func:`resolve_record_files`); a
    configuration named for them is refused, since only a Hub dataset has configurations."""
    if subset is not None:
        raise ValueError(f"{flag.rsplit('.', 1)[0]}.subset {subset!r} names a configuration of a Hub dataset (or "
                         f"a folder laid out as a Hub dataset repository); {flag} {path!r} is local files: drop it")
    return resolve_record_files(path, flag=flag, held_out=held_out, split=split)


def _split_flag(section: str, held_out: bool) -> str:
    return f"{section}.{'eval_split' if held_out else 'split'}"


def _load_hub_records(name: str, *, flag: str, section: str, split: str | None, subset: str | None,
                      held_out: bool, cache_dir: str | None):
    """``datasets.load_dataset(name, subset, split=...)``, the configuration and split checked
    against the dataset's lists first; an unreachable Hub is one line naming the flag."""
    import datasets  # deferred: importing it costs ~1 s

    try:
        subset = _checked_subset(name, subset, flag=flag, section=section)
        split = _checked_split(name, subset, split, flag=flag, section=section, held_out=held_out)
        return datasets.load_dataset(name, subset, split=split, cache_dir=cache_dir)
    except ConnectionError as err:  # offline, or no route to the Hub
        raise ValueError(
            f"{flag} {name!r} is no local file or folder, so it is read from the Hugging Face Hub, which could "
            f"not be reached ({err}); download it beforehand (`datasets` cache, {section}.cache_dir) or point "
            f"{flag} at its files"
        ) from err
    except FileNotFoundError as err:  # `datasets`' DatasetNotFoundError: no such dataset, or a private one
        raise ValueError(f"{flag} {name!r} is no local file or folder, nor a dataset the Hugging Face Hub "
                         f"serves ({err}); fix the path or the name") from err


def _checked_subset(name: str, subset: str | None, *, flag: str, section: str) -> str | None:
    """`subset`, checked against the dataset's configurations (one of several must be named)."""
    import datasets

    configs = datasets.get_dataset_config_names(name)
    if subset is None and len(configs) > 1:
        raise ValueError(f"{flag} {name!r} has the configurations {', '.join(configs)}: pick one with "
                         f"{section}.subset")
    if subset is not None and subset not in configs:
        raise ValueError(f"{section}.subset {subset!r} is not a configuration of {name!r} "
                         f"({', '.join(configs)})")
    return subset


def _checked_split(name: str, subset: str | None, split: str | None, *, flag: str, section: str,
                   held_out: bool) -> str:
    """`split` (None: the default for training or held-out rows), checked against the
    dataset's splits; a slice (``train[:10%]``) is checked by its split's name."""
    import datasets

    splits = datasets.get_dataset_split_names(name, subset)
    if split is None:
        wanted = next((s for s in HELD_OUT_SPLITS if s in splits), None) if held_out else TRAIN_SPLIT
        if wanted not in splits:
            raise ValueError(f"{flag} {name!r} has the splits {', '.join(splits)} and no "
                             f"{'validation or test' if held_out else TRAIN_SPLIT} split: pick one with "
                             f"{_split_flag(section, held_out)}")
        return wanted
    if split.split("[", 1)[0] not in splits:
        raise ValueError(f"{_split_flag(section, held_out)} {split!r} is not a split of {name!r}: it has "
                         f"{', '.join(splits)}; pick one")
    return split


def resolve_record_files(path: str, *, flag: str = "--sft_data.path", held_out: bool = False,
                         split: str | None = None) -> tuple[str, list[str]]:
    """(`datasets` builder, files) of the record files `path` (given by `flag`) names: a
    file, a directory or a glob of JSONL (.jsonl/.json, optionally .gz) or Parquet files (as
    the Hub's datasets ship them), one kind; a one-line error naming the flag otherwise. A
    directory laid out in splits as a downloaded Hub dataset is (`data/train-*.parquet`,
    `data/test-*.parquet`) gives its `split` (None: "train", or with `held_out` its
    "validation", else "test" split), as `datasets` names them: never the splits mixed.
    Files without splits are read whole, and a split named for them is refused."""
    section = flag.rsplit(".", 1)[0]
    split_files = _split_files(path, flag=flag, section=section, held_out=held_out, split=split) \
        if os.path.isdir(path) else None
    if split_files is None and split not in (None, TRAIN_SPLIT):
        raise ValueError(f"{_split_flag(section, held_out)} {split!r} picks a split, and {flag} {path!r} is not "
                         "laid out in splits (nor a Hub dataset): drop it")
    if split_files is not None:
        kinds = {kind: [f for f in split_files if f.endswith(LOCAL_FORMATS[kind])] for kind in RECORD_FORMATS}
    elif os.path.isdir(path):
        kinds = {kind: files_in_dir(path, LOCAL_FORMATS[kind]) for kind in RECORD_FORMATS}
    else:
        matched = [path] if os.path.isfile(path) else sorted(f for f in glob.glob(path, recursive=True)
                                                            if os.path.isfile(f))
        kinds = {kind: [f for f in matched if f.endswith(LOCAL_FORMATS[kind])] for kind in RECORD_FORMATS}
        if os.path.isfile(path) and not any(kinds.values()):
            kinds["json"] = [path]  # a file named otherwise: JSON lines, as before
    found = {kind: files for kind, files in kinds.items() if files}
    if len(found) > 1:
        raise ValueError(f"{flag} {path!r} holds both JSONL and Parquet files; point it at one kind")
    if not found:
        raise FileNotFoundError(
            f"{flag} {path!r} matches no JSONL or Parquet file (not a file, a directory with "
            ".jsonl/.json/.parquet files, or a glob that matches); fix the path"
        )
    (kind, files), = found.items()
    return kind, files


def _split_files(directory: str, *, flag: str, section: str, held_out: bool, split: str | None
                 ) -> list[str] | None:
    """The files of the wanted split of a directory laid out in splits (`datasets`' own rule
    for split names in file and folder names), None for a directory without splits."""
    try:
        from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns
    except ImportError:  # no `datasets`: the directory as it is
        return None
    try:
        patterns = get_data_patterns(directory)
    except EmptyDatasetError:  # no data file it recognizes: the directory as it is
        return None
    if set(patterns) == {TRAIN_SPLIT}:
        return None
    splits: dict[str, Any] = {str(name): files for name, files in
                              DataFilesDict.from_patterns(patterns, base_path=directory).items()}
    if split is not None:
        if split not in splits:
            raise ValueError(f"{_split_flag(section, held_out)} {split!r} is not a split of {directory!r}: it has "
                             f"{', '.join(sorted(splits))}; pick one")
        wanted = split
    else:
        wanted = next((s for s in HELD_OUT_SPLITS if s in splits), None) if held_out else TRAIN_SPLIT
        if wanted not in splits:
            raise ValueError(f"{flag} {directory!r} is laid out in the splits {', '.join(sorted(splits))} and has no "
                             f"{'validation or test' if held_out else TRAIN_SPLIT} split; pick one with "
                             f"{_split_flag(section, held_out)}, or point {flag} at the files to read")
    return sorted(str(f) for f in splits[wanted])


def row_name(index: int) -> str:
    """How an error names row ``index`` of a record file: its index counted from 0, as
    `datasets` indexes it, and its place counted from 1 (a JSONL file's line number when the
    file has no blank lines), so "row 6" is not looked for on line 6."""
    place = index + 1
    suffix = "th" if 10 <= place % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(place % 10, "th")
    return f"row {index} (the {place}{suffix})"

