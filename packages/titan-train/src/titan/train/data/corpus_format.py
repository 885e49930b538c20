"""The pre-tokenized corpus format (``titan.train.data.tokenized`` describes it): its
names and version, and the tokenizer fingerprint a corpus records and a run checks."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from titan.train.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, TokenizerConfig

FORMAT = "titan-tokenized"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INCOMPLETE_SUFFIX = ".incomplete"


# ---- tokenizer identity ------------------------------------------------------------------


def tokenizer_fingerprint(kind: str, path: str | os.PathLike | None) -> dict[str, Any]:
    """What identifies a tokenizer's ids: its kind and the sha256 of its file (None for the
    built-in byte tokenizer, which has no file)."""
    if kind == "byte":
        return {"kind": "byte", "sha256": None}
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    return {"kind": kind, "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}


def fingerprint_of(tokenizer: Tokenizer | TokenizerConfig) -> dict[str, Any]:
    """The fingerprint of a built tokenizer or of a `--tokenizer.*` config."""
    if isinstance(tokenizer, TokenizerConfig):
        return tokenizer_fingerprint(tokenizer.kind, tokenizer.path)
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer_fingerprint("hf", tokenizer.path)
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer_fingerprint("byte", None)
    return {"kind": type(tokenizer).__name__, "sha256": None}


def same_tokenizer(corpus_fp: dict[str, Any], run_fp: dict[str, Any]) -> bool:
    return corpus_fp.get("kind") == run_fp["kind"] and corpus_fp.get("sha256") == run_fp["sha256"]


def describe_fingerprint(fp: dict[str, Any]) -> str:
    sha = fp.get("sha256")
    return f"{fp.get('kind')}" + (f" (sha256 {sha[:12]})" if sha else "")


