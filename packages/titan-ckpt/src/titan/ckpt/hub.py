"""Hugging Face Hub model repositories named where a local folder is expected.

TRL, verl and transformers take ``org/name`` wherever a model folder goes; titan reads folders
(``config.json``, ``model*.safetensors``, ``tokenizer.json``). :func:`resolve_hub_folder` bridges
the two: a path that is no local file or folder and is shaped as a Hub repository id is
downloaded with ``huggingface_hub.snapshot_download`` into the Hugging Face cache (only the files
titan reads: no ``*.bin`` or ``original/*.pth`` duplicates of the weights) and the snapshot's
folder is returned, so the rest of titan sees a local folder as before. Downloaded files are
reused from the cache, also offline (``HF_HUB_OFFLINE=1``); every rank of a launch may call it
at once (the cache locks each file while it is written).

Errors are one line (a ``ValueError``) naming the flag: an unreachable Hub with nothing cached,
a repository that does not exist or is gated, a missing ``huggingface_hub``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

__all__ = ["MODEL_FILES", "TOKENIZER_FILES", "CONFIG_FILES", "is_hub_repo_id", "resolve_hub_folder"]

MODEL_FILES = ("*.json", "model*.safetensors", "*.jinja")
"""What a model is read from: config, weights (single file or index and shards), tokenizer."""
CONFIG_FILES = ("*.json", "*.jinja")
"""The model's configuration and tokenizer without its weights (dry runs and plans)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""A Hugging Face tokenizer: ``tokenizer.json`` and the files that complete it."""

# `org/name`, as the Hub spells repository ids (letters, digits, - _ . ; no leading dot).
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
_FILE_ENDINGS = (".json", ".safetensors", ".jinja", ".model")


def is_hub_repo_id(path: str) -> bool:
    """Whether `path` is read from the Hub: no local file or folder, and shaped as ``org/name``
    (not a file name; ``./org/name`` or an absolute path stays local)."""
    return (not os.path.exists(path) and _REPO_ID.fullmatch(path) is not None
            and not path.endswith(_FILE_ENDINGS) and ".." not in path)


def resolve_hub_folder(path: str, *, flag: str, patterns: Sequence[str] = MODEL_FILES,
                       revision: str | None = None, revision_flag: str = "revision") -> str:
    """`path` itself when it is local (or not shaped as a repository id), else the local folder
    of Hub model repository `path`'s snapshot at `revision` (a branch, tag or commit; None: its
    main branch) holding the files `patterns` match, downloaded into the Hugging Face cache
    unless already there. Errors name `flag` (and `revision_flag`)."""
    if not is_hub_repo_id(path):
        if revision is not None:
            raise ValueError(f"{revision_flag} {revision!r} picks a revision of a Hub repository, and {flag} "
                             f"{path!r} is a local path: drop it")
        return path
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ValueError(f"{flag} {path!r} is no local folder, so it is read from the Hugging Face Hub, which needs "
                         "the huggingface_hub package: pip install 'titan-ckpt[hub]' (or download the folder)") from None
    try:
        return snapshot_download(path, allow_patterns=list(patterns), revision=revision)
    except GatedRepoError as err:
        raise ValueError(f"{flag} {path!r} is a gated Hub repository: accept its terms on the Hub and log in "
                         f"(`hf auth login` or HF_TOKEN), then run again ({_first_line(err)})") from err
    except RevisionNotFoundError as err:
        raise ValueError(f"{revision_flag} {revision!r} is no branch, tag or commit of {path!r} "
                         f"({_first_line(err)})") from err
    except RepositoryNotFoundError as err:
        raise ValueError(f"{flag} {path!r} is no local folder, nor a model repository the Hugging Face Hub "
                         f"serves ({_first_line(err)}); fix the path or the name") from err
    except (LocalEntryNotFoundError, ConnectionError, OSError) as err:  # offline with nothing cached
        raise ValueError(
            f"{flag} {path!r} is no local folder, so it is read from the Hugging Face Hub, which could not be "
            f"reached and has nothing of it in the cache ({_first_line(err)}); download it beforehand "
            f"(`hf download {path}`) or point {flag} at a folder") from err


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
