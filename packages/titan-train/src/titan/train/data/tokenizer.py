"""Tokenizers: the interface the data pipeline and the trainer code against.

Two implementations: `ByteTokenizer` (needs no file, used by tests and the
synthetic/stdlib corpora) and `HFTokenizer` (a `tokenizer.json` read with the
`tokenizers` library, i.e. what a real model ships with).
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "TokenizerConfig"]


class Tokenizer(ABC):
    """Text <-> token ids, plus the special ids the packer needs.

    Implementations expose `vocab_size`, `bos_id`, `eos_id` and `pad_id` as
    plain ints (attributes or properties).
    """

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    @abstractmethod
    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of `text`, optionally framed by BOS and/or EOS."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; special tokens are dropped."""

    @property
    def special_ids(self) -> frozenset[int]:
        """The ids of BOS, EOS and PAD (some may coincide)."""
        return frozenset((self.bos_id, self.eos_id, self.pad_id))

    def _frame(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        """Add the requested separators around already-encoded ids."""
        if bos:
            ids.insert(0, self.bos_id)
        if eos:
            ids.append(self.eos_id)
        return ids


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255, then BOS=256, EOS=257, PAD=258.

    Needs no file and round-trips any text exactly, so it is the default for
    tests and for the built-in corpora.
    """

    vocab_size = 259
    bos_id = 256
    eos_id = 257
    pad_id = 258

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """UTF-8 bytes of `text` (lone surrogates become '?')."""
        return self._frame(list(text.encode("utf-8", errors="replace")), bos, eos)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` (as `encode`) and each byte's character range: a character's bytes
        all point at it."""
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        for index, char in enumerate(text):
            encoded = char.encode("utf-8", errors="replace")
            ids.extend(encoded)
            offsets.extend([(index, index + 1)] * len(encoded))
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; specials dropped, invalid UTF-8 replaced."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


BYTE_SPECIAL_TOKENS = {"bos": "<|titan_bos|>", "eos": "<|titan_eos|>", "pad": "<|titan_pad|>"}
"""The byte tokenizer's special tokens as its Hub form names them (ids 256, 257, 258)."""
BYTE_TOKENIZER_FOLDER = os.path.join(os.path.dirname(__file__), "byte_tokenizer")
"""The byte tokenizer's Hub form, shipped with the package (:func:`write_byte_tokenizer_files`)."""


def write_byte_tokenizer_files(folder: str | os.PathLike) -> list[str]:
    """Write the byte tokenizer's Hub form into ``folder``: a byte-level BPE ``tokenizer.json``
    without merges whose ids are the UTF-8 bytes (0..255) and the three specials (256..258), and
    the ``tokenizer_config.json`` naming them, so transformers' ``AutoTokenizer`` (and titan's
    ``--tokenizer.kind hf``) give the ids :class:`ByteTokenizer` gives. Returns the paths."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HubTokenizer

    vocab = {char: byte for byte, char in enumerate(_gpt2_byte_chars())}
    if set(vocab) != set(pre_tokenizers.ByteLevel.alphabet()):  # the library's own byte characters
        raise RuntimeError("the tokenizers library's byte-level alphabet is not GPT-2's byte map")
    tok = HubTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(BYTE_SPECIAL_TOKENS[role], special=True, normalized=False)
                            for role in ("bos", "eos", "pad")])
    os.makedirs(folder, exist_ok=True)
    main = os.path.join(folder, "tokenizer.json")
    tok.save(main)
    # split_special_tokens: a text spelling a special token is bytes, as ByteTokenizer reads it.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
              "split_special_tokens": True,
              "model_max_length": 1_000_000_000, "clean_up_tokenization_spaces": False,
              **{f"{role}_token": token for role, token in BYTE_SPECIAL_TOKENS.items()}}
    side = os.path.join(folder, "tokenizer_config.json")
    with open(side, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return [main, side]


def _gpt2_byte_chars() -> list[str]:
    """The printable character byte-level BPE writes for each byte 0..255 (GPT-2's map:
    printable Latin-1 bytes stand for themselves, the others are shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, shift = [], 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shift))
            shift += 1
    return chars


# Spellings of the special tokens used by common model families, tried in
# order when neither the caller nor a tokenizer_config.json names them.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>", "[CLS]")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|endoftext|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>")


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, loaded with the `tokenizers` library.

    `path` is the file itself or a directory holding it. BOS/EOS/PAD are taken
    from the explicit arguments, else from a `tokenizer_config.json` next to
    the file, else from well-known spellings among the file's special tokens.
    Without a BOS token, EOS doubles as the document separator; without a PAD
    token, EOS is used (padding positions carry label -100 anyway).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        self.path = _resolve_tokenizer_file(path)
        self._tok = _load_tokenizer_file(self.path)
        named = _tokens_from_tokenizer_config(os.path.dirname(self.path))
        # transformers' split_special_tokens: a text spelling a special token is not that token.
        self._tok.encode_special_tokens = bool(named.pop("split_special_tokens", False))
        self.eos_id = self._find_special("eos", eos_token or named.get("eos"), _EOS_CANDIDATES)
        bos = self._find_special(
            "bos", bos_token or named.get("bos"), _BOS_CANDIDATES, required=False
        )
        self.bos_id = self.eos_id if bos is None else bos
        pad = self._find_special(
            "pad", pad_token or named.get("pad"), _PAD_CANDIDATES, required=False
        )
        self.pad_id = self.eos_id if pad is None else pad
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        """Ids of `text`; the file's own post-processor is bypassed so that
        separators are added exactly once, here."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return self._frame(list(ids), bos, eos)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of `text` (as `encode`, no separators) and each token's (start, end) character
        range in `text`: which characters it was made from."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(offset) for offset in encoding.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, skipping special tokens."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def _find_special(
        self, role: str, explicit: str | None, candidates: tuple[str, ...], required: bool = True
    ) -> int | None:
        """Id of the `role` token: the named one, else the first known spelling."""
        if explicit is not None:
            tid = self._tok.token_to_id(explicit)
            if tid is None:
                raise ValueError(
                    f"{role} token {explicit!r} is not in the vocabulary of {self.path}; "
                    f"fix --tokenizer.{role}_token"
                )
            return tid
        for spelling in candidates:
            tid = self._tok.token_to_id(spelling)
            if tid is not None:
                return tid
        if required:
            raise ValueError(
                f"could not find a {role} token in {self.path} (tried {', '.join(candidates)}); "
                f"name it with --tokenizer.{role}_token"
            )
        return None


# The files beside a tokenizer.json that complete a Hub tokenizer (special tokens, chat template).
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _resolve_tokenizer_file(path: str | os.PathLike) -> str:
    """`path` itself, or `path/tokenizer.json` when `path` is a directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"tokenizer file not found: {path}; set --tokenizer.path to a tokenizer.json "
            "or to the directory holding it"
        )
    return path


def _load_tokenizer_file(path: str):
    """Parse `path` with the `tokenizers` library, naming the file on failure."""
    from tokenizers import Tokenizer as _RustTokenizer  # deferred: byte-only runs skip it

    try:
        return _RustTokenizer.from_file(path)
    except Exception as e:  # the library raises bare Exceptions for malformed JSON
        kind = _other_tokenizer_format(path)
        if kind:
            raise ValueError(
                f"{path} is {kind}, not a Hugging Face tokenizer.json, which is what titan reads: "
                "point --tokenizer.path at the tokenizer.json of the same Hub repository (Llama 3 "
                "and 3.1 repositories hold one beside original/tokenizer.model)"
            ) from e
        raise ValueError(f"{path} is not a valid tokenizer.json: {e}") from e


def _other_tokenizer_format(path: str) -> str | None:
    """What `path` is when it is another library's tokenizer file (torchtitan's earlier
    configs point at these), else None."""
    with open(path, "rb") as f:
        head = f.read(4096)
    first = head.split(b"\n", 1)[0].split(b" ")
    if len(first) == 2 and first[1].isdigit() and first[0] and all(
            chr(c).isalnum() or chr(c) in "+/=" for c in first[0]):
        return "a tiktoken BPE ranks file (base64 token, rank per line: Llama 3's original/tokenizer.model)"
    if head[:1] == b"\x0a":  # field 1 (the pieces) of a ModelProto
        return "a SentencePiece model (a protobuf: Llama 2's and Mistral's tokenizer.model)"
    return None


def _tokens_from_tokenizer_config(directory: str) -> dict[str, Any]:
    """bos/eos/pad spellings from an optional `tokenizer_config.json`, and its
    `split_special_tokens` (when true)."""
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
        return {}
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from e
    found = {}
    for role in ("bos", "eos", "pad"):
        value = cfg.get(f"{role}_token")
        # Older files store AddedToken dicts instead of plain strings.
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[role] = value
    if cfg.get("split_special_tokens") is True:
        found["split_special_tokens"] = True
    return found


@dataclass(kw_only=True)
class TokenizerConfig:
    """`--tokenizer.*`: which tokenizer turns text into ids."""

    kind: Literal["byte", "hf"] = "byte"
    """"byte": built-in UTF-8 byte tokenizer (no file). "hf": a tokenizer.json at --tokenizer.path."""
    path: str | None = None
    """For kind "hf": a tokenizer.json file or a directory containing one (or a Hub model id,
    `org/name`, read through the Hugging Face cache by the `titan` commands)."""
    revision: str | None = None
    """For kind "hf" with a Hub model id as --tokenizer.path: the branch, tag or commit to read
    (default: the repository's main branch)."""
    bos_token: str | None = None
    """For kind "hf": spelling of the BOS token, when it cannot be discovered."""
    eos_token: str | None = None
    """For kind "hf": spelling of the EOS token, when it cannot be discovered."""
    pad_token: str | None = None
    """For kind "hf": spelling of the PAD token (defaults to EOS when absent)."""

    def __post_init__(self) -> None:
        if self.kind not in ("byte", "hf"):
            raise ValueError(f"--tokenizer.kind must be 'byte' or 'hf', got {self.kind!r}")
        if self.kind == "hf" and not self.path:
            raise ValueError(
                "--tokenizer.kind hf needs --tokenizer.path (a tokenizer.json or its directory)"
            )
        if self.kind == "byte" and self.revision is not None:
            raise ValueError(f"--tokenizer.revision {self.revision!r} is only read with --tokenizer.kind hf and a "
                             "Hub id as --tokenizer.path; drop it")
        if self.kind == "byte" and self.path:
            raise ValueError(
                f"--tokenizer.path {self.path!r} is only read with --tokenizer.kind hf; "
                "drop the path or set --tokenizer.kind hf"
            )

    def hub_files(self) -> list[str]:
        """The files a Hugging Face folder needs to hold this tokenizer (`tokenizer.json` and
        the `tokenizer_config.json`, `special_tokens_map.json` and `chat_template.jinja` beside
        it, those that exist); for the byte tokenizer, its Hub form shipped with the package
        (ids equal to the bytes, :func:`write_byte_tokenizer_files`)."""
        if self.kind == "byte":
            return [os.path.join(BYTE_TOKENIZER_FOLDER, name) for name in ("tokenizer.json", "tokenizer_config.json")]
        if self.kind != "hf":
            return []
        main = _resolve_tokenizer_file(self.path)
        siblings = [os.path.join(os.path.dirname(main), name) for name in TOKENIZER_SIDE_FILES]
        return [main, *(path for path in siblings if os.path.isfile(path))]

    def build(self) -> Tokenizer:
        """Construct the configured tokenizer (reads the file for kind "hf")."""
        if self.kind == "byte":
            return ByteTokenizer()
        return HFTokenizer(
            self.path, bos_token=self.bos_token, eos_token=self.eos_token, pad_token=self.pad_token
        )
