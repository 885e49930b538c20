"""Supervised fine-tuning data: examples, loss masks, packing with boundaries, the loader.

An SFT example is a token sequence plus a per-token *target* flag: which tokens the
model is trained to produce. With `--sft_data.train_on completion` (the default) those
are the completion (or every assistant turn) and the EOS that ends it; prompt, system
and user tokens are context only. Labels are shifted inside each example: its input is
`ids[:-1]`, its labels `ids[1:]` with -100 where the token is not a target, so no
prediction ever crosses from one example into the next.

Rows of `seq_len` positions are filled greedily with whole examples in a seeded order
(one example per row with `--sft_data.no_packing`); the rest of a row is padding
(`pad_id`, label -100). Every batch is a dict of LongTensors [B, S]:

- `input_ids`, `labels` (-100 = ignored: prompt tokens and padding);
- `positions`: 0, 1, ... restarting at every example (what RoPE should see);
- `document_ids`: 0, 1, 2, ... one id per example in the row, in order; the padding at
  the end of a row is one more segment with id -1 (positions again from 0), so an
  equality-plus-causal attention mask never lets a real token see padding and every
  padding token still sees itself (no empty softmax row), and an MoE layer, which reads a
  negative id as padding, leaves it out of its balancing counts and aux loss.

An example longer than `seq_len + 1` tokens (seq_len positions after the shift) is
dropped (`--sft_data.overlong drop`, the default: a cut-off completion would teach the
model to stop without EOS) or cut to its first seq_len + 1 tokens (`truncate`); either
way, and for examples left without any target, the loader counts them in
`dropped_examples`.

The loader mirrors the pretraining `PackedDataLoader`: one global stream of rows read
identically by every data-parallel rank, each fetch consuming dp_world_size x B rows of
which rank r keeps rows r*B .. (r+1)*B - 1, and one global position (epoch, next
example, rows, dropped) that resumes exactly under any data-parallel degree or batch
split.

Chat rendering: `--sft_data.chat_template builtin` is the format below (role headers are
plain text, so any tokenizer handles it; EOS closes each assistant turn):

    <BOS><|system|>\\n{system}\\n<|user|>\\n{user}\\n<|assistant|>\\n{answer}<EOS><|user|>\\n...

(`<BOS>` only when the tokenizer has a BOS distinct from EOS, as in pretraining
framing). `tokenizer` renders the Jinja `chat_template` shipped with the tokenizer
files (`chat_template.jinja` or `tokenizer_config.json` next to tokenizer.json) with
jinja2; there the template's own end-of-turn marker closes each assistant turn and is
trained on, and no extra BOS/EOS is added (templates emit their own). The trained span
of assistant turn i is found by rendering the conversation up to turn i with and
without the generation prompt, so a template must render each conversation as a
prefix of its continuation (most do; one that rewrites earlier turns is refused).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from titan.train.data.loader import document_layout
from titan.train.data.resumable import ResumableLoader, check_loader_args
from titan.train.data.sources import resolve_data_files
from titan.train.data.tokenizer import Tokenizer
from titan.train.loss import IGNORE_INDEX
from torch.utils.data import IterableDataset

__all__ = [
    "SFTDataConfig",
    "SyntheticTaskConfig",
    "SFTDataLoader",
    "SFTExample",
    "ChatTemplate",
    "SyntheticSFTTask",
    "build_sft_dataloader",
    "build_sft_source",
    "encode_chat",
    "encode_chat_prompt",
    "encode_prompt",
    "encode_prompt_completion",
    "synthetic_eval_pairs",
    "validate_sft_data_config",
]

ROLES = ("system", "user", "assistant")

@dataclass(kw_only=True)
class SyntheticTaskConfig:
    """The built-in synthetic task's flags, shared by ``--sft_data.*`` and ``--rl_data.*``:
    string sorting or reversal over a small alphabet, with held-out strings."""

    synthetic_task: Literal["sort", "reverse"] = "sort"
    """Synthetic: "sort" ("sort: cab\\n" -> "abc") or "reverse" ("reverse: abc\\n" -> "cba").
    Sort is learned faster: the debug model (dim 256, 4 layers, 16 x 64 tokens per step)
    answers about half the held-out prompts exactly after 300 steps, reverse about 40%."""
    synthetic_examples: int = 4096
    """Synthetic: number of distinct training prompts."""
    synthetic_eval_examples: int = 64
    """Synthetic: number of held-out prompts (never in the training set)."""
    synthetic_alphabet: int = 8
    """Synthetic: letters used, the first N of a..z."""
    synthetic_min_len: int = 3
    """Synthetic: shortest string, in letters."""
    synthetic_max_len: int = 6
    """Synthetic: longest string, in letters."""
    synthetic_seed: int = 0
    """Synthetic: seed of the task itself (which strings are training and held out)."""

    def check_synthetic_task(self, section: str) -> None:
        """The task is known, its sizes are in range and its strings can be distinct; errors
        name the flags under ``section`` (``--sft_data``, ``--rl_data``)."""
        if self.synthetic_task not in ("reverse", "sort"):
            raise ValueError(f"{section}.synthetic_task must be one of reverse, sort, got {self.synthetic_task!r}")
        for flag, value, low in (
            ("synthetic_examples", self.synthetic_examples, 1),
            ("synthetic_eval_examples", self.synthetic_eval_examples, 0),
            ("synthetic_min_len", self.synthetic_min_len, 1),
        ):
            if value < low:
                raise ValueError(f"{section}.{flag} must be >= {low}, got {value}")
        if not 2 <= self.synthetic_alphabet <= 26:
            raise ValueError(
                f"{section}.synthetic_alphabet must be in [2, 26], got {self.synthetic_alphabet}"
            )
        if self.synthetic_max_len < self.synthetic_min_len:
            raise ValueError(
                f"{section}.synthetic_max_len {self.synthetic_max_len} is below "
                f"{section}.synthetic_min_len {self.synthetic_min_len}; raise it"
            )
        if self.synthetic_max_len > 20:
            raise ValueError(
                f"{section}.synthetic_max_len {self.synthetic_max_len} is over 20; the task is "
                "meant to be short (prompt + answer under 64 bytes), lower it"
            )
        pool = sum(
            self.synthetic_alphabet**n
            for n in range(self.synthetic_min_len, self.synthetic_max_len + 1)
        )
        wanted = self.synthetic_examples + self.synthetic_eval_examples
        if 2 * wanted > pool:
            raise ValueError(
                f"{section}.synthetic_examples + {section}.synthetic_eval_examples = {wanted} "
                f"distinct strings is over half of the {pool} possible ones; lower them or raise "
                f"{section}.synthetic_alphabet / {section}.synthetic_max_len"
            )

    def synthetic_task_fields(self) -> dict[str, object]:
        """These fields by name (to build another config of the same task)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SyntheticTaskConfig)}


@dataclass(kw_only=True)
class SFTDataConfig(SyntheticTaskConfig):
    """`--sft_data.*`: the supervised fine-tuning examples and how they become batches."""

    format: Literal["prompt_completion", "chat", "synthetic"] = "synthetic"
    """"prompt_completion": JSONL rows with string `prompt` and `completion` (concatenated
    as they are, no template). "chat": JSONL rows with `messages`, a list of
    {role, content} with roles system/user/assistant. "synthetic": a built-in small task
    (see --sft_data.synthetic_*), no file needed."""
    path: str | None = None
    """JSONL file, directory of .jsonl/.json files, or glob (read with `datasets`' json
    loader). Required for prompt_completion and chat."""
    prompt_field: str = "prompt"
    """prompt_completion: the column holding the prompt."""
    completion_field: str = "completion"
    """prompt_completion: the column holding the completion."""
    messages_field: str = "messages"
    """chat: the column holding the list of messages."""
    chat_template: Literal["auto", "tokenizer", "builtin"] = "auto"
    """chat: "tokenizer" renders the Jinja chat_template shipped with the tokenizer files;
    "builtin" the simple documented template of titan.train.data.sft; "auto" the
    tokenizer's when its files carry one, else builtin."""
    train_on: Literal["completion", "all"] = "completion"
    """"completion": loss only on completion / assistant tokens and the EOS ending them.
    "all": loss on every token of the example (after the first)."""
    packing: bool = True
    """Pack several whole examples per row (with document boundaries); off: one per row."""
    overlong: Literal["drop", "truncate"] = "drop"
    """An example longer than seq_len + 1 tokens: "drop" it (counted), or "truncate" it
    to its first seq_len + 1 tokens (dropped anyway if no target token is left)."""
    shuffle: bool = True
    """Visit examples in a fresh seeded order every epoch."""
    cache_dir: str | None = None
    """Where `datasets` caches the parsed JSONL (default: its own cache)."""
    def __post_init__(self) -> None:
        self._check_format()
        self._check_choices()
        self.check_synthetic_task("--sft_data")

    def _check_format(self) -> None:
        """format/path combination makes sense."""
        if self.format not in ("prompt_completion", "chat", "synthetic"):
            raise ValueError(
                f"--sft_data.format must be prompt_completion, chat or synthetic, got {self.format!r}"
            )
        if self.format != "synthetic" and not self.path:
            raise ValueError(
                f"--sft_data.format {self.format} reads JSONL files: set --sft_data.path to a "
                "file, directory or glob"
            )
        if self.format == "synthetic" and self.path:
            raise ValueError(
                f"--sft_data.path {self.path!r} is not read by --sft_data.format synthetic; "
                "drop the path or set --sft_data.format prompt_completion or chat"
            )
        for flag in ("prompt_field", "completion_field", "messages_field"):
            if not getattr(self, flag):
                raise ValueError(f"--sft_data.{flag} is empty; name the JSONL column to read")

    def _check_choices(self) -> None:
        """Literal-typed flags hold one of their values (tyro checks the CLI, not code)."""
        for flag, allowed in (
            ("chat_template", ("auto", "tokenizer", "builtin")),
            ("train_on", ("completion", "all")),
            ("overlong", ("drop", "truncate")),
        ):
            value = getattr(self, flag)
            if value not in allowed:
                raise ValueError(
                    f"--sft_data.{flag} must be one of {', '.join(allowed)}, got {value!r}"
                )

def validate_sft_data_config(cfg: SFTDataConfig) -> None:
    """Filesystem checks, run before any work starts (like `validate_data_config`):
    the JSONL files exist. Raises FileNotFoundError naming the flag."""
    if cfg.format != "synthetic":
        _resolve_jsonl_files(cfg.path)


def _resolve_jsonl_files(path: str) -> list[str]:
    """The files `--sft_data.path` names, or a one-line error naming that flag."""
    try:
        return resolve_data_files("json", path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"--sft_data.path {path!r} matches no JSONL file (not a file, a directory with "
            ".jsonl/.json files, or a glob that matches); fix the path"
        ) from None


# ---------------------------------------------------------------------------------------
# Encoding: text -> (ids, targets)
# ---------------------------------------------------------------------------------------


@dataclass
class SFTExample:
    """One tokenized example: `ids` (int64) and `targets` (bool, same length): which
    tokens are trained on (predicted from the tokens before them)."""

    ids: np.ndarray
    targets: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


# A rendered piece: text to tokenize, or a token id placed as is; and whether it is a target.
Segment = tuple[str | int, bool]


def _encode_segments(
    tokenizer: Tokenizer, segments: Sequence[Segment], train_on: str
) -> SFTExample:
    """Tokenize each piece on its own (so a mask boundary is a token boundary) and join."""
    ids: list[int] = []
    targets: list[bool] = []
    for piece, trained in segments:
        piece_ids = [piece] if isinstance(piece, int) else tokenizer.encode(piece)
        ids.extend(piece_ids)
        targets.extend([trained or train_on == "all"] * len(piece_ids))
    return SFTExample(np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=bool))


def _bos(tokenizer: Tokenizer) -> list[Segment]:
    """A leading BOS, as pretraining frames documents (none when BOS doubles as EOS)."""
    return [(tokenizer.bos_id, False)] if tokenizer.bos_id != tokenizer.eos_id else []


def encode_prompt_completion(
    prompt: str, completion: str, tokenizer: Tokenizer, *, train_on: str = "completion"
) -> SFTExample:
    """`[BOS] prompt completion EOS`; targets: the completion and EOS (all with train_on="all").

    Prompt and completion are tokenized separately, exactly as `encode_prompt` encodes a
    prompt for generation, so what the model conditions on at inference is what it saw.
    """
    segments = _bos(tokenizer) + [(prompt, False), (completion, True), (tokenizer.eos_id, True)]
    return _encode_segments(tokenizer, segments, train_on)


def encode_prompt(prompt: str, tokenizer: Tokenizer) -> list[int]:
    """Ids to generate a completion from: `[BOS] prompt`, as in `encode_prompt_completion`."""
    return [
        int(i)
        for i in _encode_segments(tokenizer, _bos(tokenizer) + [(prompt, False)], "completion").ids
    ]


def _builtin_chat_segments(
    messages: Sequence[dict], tokenizer: Tokenizer, add_generation_prompt: bool = False
) -> list[Segment]:
    """The built-in template (module docstring): headers and non-assistant turns are
    context; each assistant turn's content and its closing EOS are targets."""
    segments = _bos(tokenizer)
    for message in messages:
        role, content = message["role"], message["content"]
        segments.append((f"<|{role}|>\n", False))
        if role == "assistant":
            segments += [(content, True), (tokenizer.eos_id, True)]
        else:
            segments.append((content + "\n", False))
    if add_generation_prompt:
        segments.append(("<|assistant|>\n", False))
    return segments


class ChatTemplate:
    """A Jinja chat template as shipped with Hugging Face tokenizer files, rendered with
    jinja2 in a sandbox, with `bos_token`/`eos_token` and `raise_exception` available."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        try:
            import jinja2.ext
            import jinja2.sandbox
        except ImportError:  # torch depends on jinja2, so this is a broken environment
            raise ValueError(
                "--sft_data.chat_template tokenizer needs the jinja2 package; install it "
                "(pip install jinja2) or use --sft_data.chat_template builtin"
            ) from None

        def raise_exception(message: str):
            raise ValueError(f"the tokenizer's chat template refused a conversation: {message}")

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.globals["raise_exception"] = raise_exception
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text, optionally followed by the assistant header."""
        return self.template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    @classmethod
    def from_tokenizer_files(cls, directory: str) -> ChatTemplate | None:
        """The template next to a tokenizer.json: `chat_template.jinja`, else the
        `chat_template` of `tokenizer_config.json` (a string, or a list of named ones of
        which "default" is taken). None when there is none."""
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        source = None
        jinja_file = os.path.join(directory, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                source = f.read()
        else:
            source = config.get("chat_template")
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                source = named.get("default")
        if not isinstance(source, str) or not source:
            return None
        return cls(
            source, bos_token=_token_text(config, "bos"), eos_token=_token_text(config, "eos")
        )

    def segments(
        self, messages: Sequence[dict], add_generation_prompt: bool = False
    ) -> list[Segment]:
        """Split the rendered conversation into context and assistant-turn text.

        Assistant turn i is the text `render(messages[:i+1])` adds to
        `render(messages[:i], add_generation_prompt=True)`: its content and the
        template's end-of-turn marker, never the assistant header.
        """
        segments: list[Segment] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            after = self.render(messages[: i + 1])
            if not before.startswith(done) or not after.startswith(before):
                raise ValueError(
                    "the tokenizer's chat template does not render a conversation as a prefix of "
                    "its continuation, so assistant turns cannot be located; use "
                    "--sft_data.chat_template builtin"
                )
            segments += [(before[len(done) :], False), (after[len(before) :], True)]
            done = after
        full = self.render(messages, add_generation_prompt=add_generation_prompt)
        if not full.startswith(done):
            raise ValueError(
                "the tokenizer's chat template renders the whole conversation differently from "
                "its turns; use --sft_data.chat_template builtin"
            )
        segments.append((full[len(done) :], False))
        return [(text, trained) for text, trained in segments if text]


def _read_json(path: str) -> dict:
    """A JSON object from `path`, {} when the file is absent."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return value if isinstance(value, dict) else {}


def _token_text(config: dict, role: str) -> str:
    """bos/eos spelling from a tokenizer_config (string or AddedToken dict), "" if absent."""
    value = config.get(f"{role}_token")
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def resolve_chat_template(choice: str, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The template `--sft_data.chat_template` selects for `tokenizer`; None = builtin."""
    if choice == "builtin":
        return None
    path = getattr(tokenizer, "path", None)  # HFTokenizer: its tokenizer.json
    template = ChatTemplate.from_tokenizer_files(os.path.dirname(path)) if path else None
    if template is None and choice == "tokenizer":
        where = f"next to {path}" if path else "for the byte tokenizer"
        raise ValueError(
            f"--sft_data.chat_template tokenizer: no chat_template {where} (looked for "
            "chat_template.jinja and tokenizer_config.json); use --sft_data.chat_template "
            "builtin or a tokenizer that ships one"
        )
    return template


def check_messages(messages: Any) -> list[dict]:
    """`messages` is a list of {role, content} with known roles and one assistant turn;
    returns it as plain dicts. Raises ValueError saying what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content}")
    checked = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"message {j} is not a {{role, content}} object")
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise ValueError(f"message {j} has role {role!r}, not one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"message {j} has non-string content {content!r}")
        checked.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in checked):
        raise ValueError("no assistant message, so nothing to train on")
    return checked


def encode_chat(
    messages: Sequence[dict],
    tokenizer: Tokenizer,
    *,
    template: ChatTemplate | None = None,
    train_on: str = "completion",
) -> SFTExample:
    """A conversation as ids; targets: every assistant turn (and its end marker), other
    turns and all role headers masked. `template` None is the built-in template."""
    messages = check_messages(messages)
    if template is None:
        segments = _builtin_chat_segments(messages, tokenizer)
    else:
        segments = template.segments(messages)
    return _encode_segments(tokenizer, segments, train_on)


def encode_chat_prompt(
    messages: Sequence[dict], tokenizer: Tokenizer, *, template: ChatTemplate | None = None
) -> list[int]:
    """Ids to generate the next assistant turn from: the conversation and the assistant
    header, tokenized as in `encode_chat`."""
    if template is None:
        segments = _builtin_chat_segments(messages, tokenizer, add_generation_prompt=True)
    else:
        segments = template.segments(messages, add_generation_prompt=True)
    return [int(i) for i in _encode_segments(tokenizer, segments, "completion").ids]


# ---------------------------------------------------------------------------------------
# Sources: index -> SFTExample
# ---------------------------------------------------------------------------------------


class SFTSource:
    """Map-style examples: `len(source)`, `example(i)` tokenized on access."""

    def __len__(self) -> int:
        raise NotImplementedError

    def example(self, index: int) -> SFTExample:
        """Example `index`, tokenized with its targets."""
        raise NotImplementedError


class SyntheticSFTTask(SFTSource):
    """A small exactly-checkable task: "sort: cab\\n" -> "abc" or "reverse: abc\\n" -> "cba".

    Strings are drawn from the first `alphabet` letters, lengths uniform in
    [min_len, max_len], all distinct, from `seed` alone. The first `eval_examples`
    strings drawn are held out (`eval_pairs`), the next `examples` are the training set,
    so the held-out set does not change with the training size.
    """

    def __init__(self, cfg: SFTDataConfig, tokenizer: Tokenizer) -> None:
        self.task, self.tokenizer, self.train_on = cfg.synthetic_task, tokenizer, cfg.train_on
        strings = _distinct_strings(cfg)
        self.eval_pairs = [self.pair(s) for s in strings[: cfg.synthetic_eval_examples]]
        self.train_pairs = [self.pair(s) for s in strings[cfg.synthetic_eval_examples :]]

    def pair(self, letters: str) -> tuple[str, str]:
        """(prompt, answer) for one string."""
        answer = letters[::-1] if self.task == "reverse" else "".join(sorted(letters))
        return f"{self.task}: {letters}\n", answer

    def __len__(self) -> int:
        return len(self.train_pairs)

    def example(self, index: int) -> SFTExample:
        """Training pair `index`, encoded as prompt/completion."""
        prompt, answer = self.train_pairs[index]
        return encode_prompt_completion(prompt, answer, self.tokenizer, train_on=self.train_on)


def _distinct_strings(cfg: SFTDataConfig) -> list[str]:
    """eval + train distinct strings in draw order (config checks they fit twice over)."""
    rng = np.random.default_rng(cfg.synthetic_seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"[: cfg.synthetic_alphabet]))
    wanted = cfg.synthetic_eval_examples + cfg.synthetic_examples
    seen: set[str] = set()
    out: list[str] = []
    while len(out) < wanted:
        length = int(rng.integers(cfg.synthetic_min_len, cfg.synthetic_max_len + 1))
        s = "".join(rng.choice(letters, size=length))
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def synthetic_eval_pairs(cfg: SFTDataConfig) -> list[tuple[str, str]]:
    """Held-out (prompt, answer) pairs of the synthetic task, never trained on: generate
    from `encode_prompt(prompt, tokenizer)` and compare the decoded text before EOS."""
    if cfg.format != "synthetic":
        raise ValueError("held-out pairs exist only for --sft_data.format synthetic")
    strings = _distinct_strings(cfg)[: cfg.synthetic_eval_examples]
    task = cfg.synthetic_task
    return [
        (f"{task}: {s}\n", s[::-1] if task == "reverse" else "".join(sorted(s))) for s in strings
    ]


class JSONLSFTSource(SFTSource):
    """Rows of a `datasets.Dataset` read from JSONL: prompt/completion or chat."""

    def __init__(
        self, dataset, cfg: SFTDataConfig, tokenizer: Tokenizer, template: ChatTemplate | None
    ) -> None:
        self.cfg, self.tokenizer, self.template = cfg, tokenizer, template
        if cfg.format == "prompt_completion":
            self.fields = {
                "prompt_field": cfg.prompt_field,
                "completion_field": cfg.completion_field,
            }
        else:
            self.fields = {"messages_field": cfg.messages_field}
        for flag, column in self.fields.items():
            if column not in dataset.column_names:
                raise ValueError(
                    f"--sft_data.path {cfg.path!r}: rows have no {column!r} key (columns: "
                    f"{', '.join(dataset.column_names) or 'none'}); --sft_data.format {cfg.format} "
                    f"reads {_format_needs(cfg)}: fix the file, --sft_data.{flag} or --sft_data.format"
                )
        self.dataset = dataset.select_columns(list(self.fields.values()))

    def __len__(self) -> int:
        return len(self.dataset)

    def example(self, index: int) -> SFTExample:
        """Row `index` rendered and tokenized; a malformed row fails naming its index."""
        row = self.dataset[int(index)]
        try:
            if self.cfg.format == "prompt_completion":
                prompt, completion = row[self.cfg.prompt_field], row[self.cfg.completion_field]
                if not isinstance(prompt, str) or not isinstance(completion, str):
                    raise ValueError("prompt and completion must both be strings")
                return encode_prompt_completion(
                    prompt, completion, self.tokenizer, train_on=self.cfg.train_on
                )
            return encode_chat(
                row[self.cfg.messages_field],
                self.tokenizer,
                template=self.template,
                train_on=self.cfg.train_on,
            )
        except ValueError as e:
            raise ValueError(
                f"--sft_data.path {self.cfg.path!r}: row {index}: {e}; --sft_data.format "
                f"{self.cfg.format} reads {_format_needs(self.cfg)}: fix the row"
            ) from None


def _format_needs(cfg: SFTDataConfig) -> str:
    """What a row of `cfg.format` must hold, for error messages."""
    if cfg.format == "prompt_completion":
        return f"string {cfg.prompt_field!r} and {cfg.completion_field!r} per row"
    return (
        f"{cfg.messages_field!r}: a list of {{role, content}} (roles system/user/assistant, "
        "at least one assistant)"
    )


def build_sft_source(cfg: SFTDataConfig, tokenizer: Tokenizer) -> SFTSource:
    """The example source `cfg` describes."""
    if cfg.format == "synthetic":
        return SyntheticSFTTask(cfg, tokenizer)
    import datasets  # deferred: importing it costs ~1 s, synthetic runs never need it

    files = _resolve_jsonl_files(cfg.path)
    dataset = datasets.load_dataset(
        "json", data_files=files, split="train", cache_dir=cfg.cache_dir
    )
    template = resolve_chat_template(cfg.chat_template, tokenizer) if cfg.format == "chat" else None
    return JSONLSFTSource(dataset, cfg, tokenizer, template)


# ---------------------------------------------------------------------------------------
# Packing rows and the loader
# ---------------------------------------------------------------------------------------


class SFTPacker:
    """Fills rows of `seq_len` positions with whole examples, greedily, in a seeded order.

    Epoch e visits the examples in a permutation seeded by (seed, e) (the same seeding as
    the pretraining `DocumentPacker`), else in index order. A row takes examples while
    they fit (one with packing off); the example that does not fit starts the next row.
    So the position between rows is (epoch, cursor of the next unplaced example) plus a
    count of dropped examples: plain ints.
    """

    def __init__(
        self,
        source: SFTSource,
        *,
        seq_len: int,
        pad_id: int,
        packing: bool,
        overlong: str,
        shuffle: bool,
        seed: int,
    ) -> None:
        self.source, self.num_examples = source, len(source)
        if self.num_examples == 0:
            raise ValueError("the SFT dataset has no examples; check --sft_data.path")
        self.seq_len, self.pad_id = seq_len, pad_id
        self.packing, self.overlong, self.shuffle, self.seed = packing, overlong, shuffle, seed
        self.epoch = self.cursor = self.dropped = 0
        self._order: tuple[int, np.ndarray] | None = None
        self._pending: tuple[tuple[int, int], SFTExample | None] | None = None

    def next_row(self) -> dict[str, np.ndarray]:
        """The next row: `input_ids`, `labels`, `positions`, `document_ids`, each [seq_len].

        Positions and ids come from the pretraining loader's `document_layout`, given where
        each example (and the padding tail, a segment of its own) starts.
        """
        input_ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        starts = np.zeros(self.seq_len, dtype=bool)
        used = placed = 0
        while True:
            example = self._current_example()
            n = len(example) - 1  # positions after the in-example shift
            if used + n > self.seq_len or (placed > 0 and not self.packing):
                break
            ids, targets = example.ids, example.targets
            input_ids[used : used + n] = ids[:-1]
            labels[used : used + n] = np.where(targets[1:], ids[1:], IGNORE_INDEX)
            starts[used] = True
            used, placed = used + n, placed + 1
            self._advance()
        if used < self.seq_len:
            starts[used] = True  # the padding tail: its own segment, positions from 0
        positions, document_ids = document_layout(starts[None])
        document_ids[0, used:] = -1  # padding (see the module docstring)
        return {
            "input_ids": input_ids,
            "labels": labels,
            "positions": positions[0],
            "document_ids": document_ids[0],
        }

    def _current_example(self) -> SFTExample:
        """The next example that can be placed, skipping (and counting) unusable ones."""
        skipped_run = 0
        while True:
            key = (self.epoch, self.cursor)
            if self._pending is None or self._pending[0] != key:
                self._pending = (key, self._prepare(self.source.example(self._example_index())))
            example = self._pending[1]
            if example is not None:
                return example
            self.dropped += 1
            skipped_run += 1
            if skipped_run > self.num_examples:
                raise ValueError(
                    f"no SFT example fits in seq_len {self.seq_len} with a token to train on "
                    f"({self.dropped} dropped); raise --training.seq_len or use "
                    "--sft_data.overlong truncate"
                )
            self._advance()

    def _prepare(self, example: SFTExample) -> SFTExample | None:
        """Apply the overlong policy; None if the example cannot be used."""
        if len(example) - 1 > self.seq_len:
            if self.overlong == "drop":
                return None
            keep = self.seq_len + 1
            example = SFTExample(example.ids[:keep], example.targets[:keep])
        if len(example) < 2 or not example.targets[1:].any():
            return None
        return example

    def _example_index(self) -> int:
        """Index in the source of the example under the cursor, this epoch."""
        if self._order is None or self._order[0] != self.epoch:
            order = np.arange(self.num_examples, dtype=np.int64)
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(order)
            self._order = (self.epoch, order)
        return int(self._order[1][self.cursor])

    def _advance(self) -> None:
        """Move past the example under the cursor, wrapping into the next epoch."""
        self.cursor += 1
        if self.cursor == self.num_examples:
            self.cursor = 0
            self.epoch += 1

    def state_dict(self) -> dict[str, int]:
        """The position between rows: plain ints."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "dropped": self.dropped,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Jump to a saved position; the next row is the one the saved packer would build."""
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.dropped, self.seed = int(state["dropped"]), int(state["seed"])
        self._order = self._pending = None


class SFTBatches(IterableDataset):
    """One data-parallel rank's SFT batches: each fetch builds the global microbatch
    (dp_world_size x B rows, in the one global order) and keeps rows r*B .. (r+1)*B - 1,
    as the pretraining `PackedBatches` does with windows."""

    def __init__(
        self, packer: SFTPacker, batch_size: int, *, dp_rank: int = 0, dp_world_size: int = 1
    ) -> None:
        self.packer, self.batch_size = packer, batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.rows = 0  # rows consumed globally (all ranks)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def next_batch(self) -> dict[str, torch.Tensor]:
        """Build the global microbatch, hand out this rank's rows."""
        rows = [self.packer.next_row() for _ in range(self.dp_world_size * self.batch_size)]
        self.rows += len(rows)
        mine = rows[self.dp_rank * self.batch_size : (self.dp_rank + 1) * self.batch_size]
        return {key: torch.from_numpy(np.stack([r[key] for r in mine])) for key in mine[0]}


class SFTDataLoader(ResumableLoader):
    """An endless, resumable `DataLoader` of SFT batches for one data-parallel rank.

    Iterate it or call `next(loader)`. `state_dict()` is one global record, the same on
    every rank after every fetch: (epoch, cursor, dropped, seed) of the packer and the
    global `rows` consumed, with what they are measured against (seq_len, num_examples,
    shuffle, packing; `ResumableLoader` checks them). It resumes under any data-parallel
    degree, local batch size or accumulation count. `epoch` counts completed passes over
    the data.
    """

    STATE_VERSION = 1
    KIND = "SFT data loader"

    def __init__(
        self, dataset: SFTBatches, *, dp_rank: int, dp_world_size: int, num_examples: int
    ) -> None:
        super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size)
        self.num_examples = num_examples

    @property
    def packer(self) -> SFTPacker:
        """The row builder behind this loader (its position is the loader's state)."""
        return self.dataset.packer

    @property
    def epoch(self) -> int:
        """Completed passes over the examples (the example under the cursor is in this one)."""
        return self.packer.epoch

    @property
    def dropped_examples(self) -> int:
        """Examples skipped so far: longer than seq_len + 1 (with overlong=drop) or without
        any target token. Counted each time an epoch visits them."""
        return self.packer.dropped

    def position(self) -> dict[str, Any]:
        """The packer's position between rows and the `rows` consumed globally."""
        return {**self.packer.state_dict(), "rows": self.dataset.rows}

    def restore(self, state: dict[str, Any]) -> None:
        """Put the packer and the row count where the saved loader stood."""
        self.packer.load_state_dict(state)
        self.dataset.rows = int(state["rows"])

    def measured_against(self) -> dict[str, tuple[Any, str]]:
        """The rows' length, the examples, their order and packing."""
        return {
            "seq_len": (self.packer.seq_len, "--training.seq_len"),
            "num_examples": (self.num_examples, "data (--sft_data.path, --sft_data.format, --sft_data.synthetic_*)"),
            "shuffle": (self.packer.shuffle, "--sft_data.shuffle / --sft_data.no_shuffle"),
            "packing": (self.packer.packing, "--sft_data.packing / --sft_data.no_packing"),
        }


def build_sft_dataloader(
    cfg: SFTDataConfig,
    tokenizer: Tokenizer,
    *,
    dp_rank: int,
    dp_world_size: int,
    local_batch_size: int,
    seq_len: int,
    seed: int,
) -> SFTDataLoader:
    """An endless loader of `{"input_ids", "labels", "positions", "document_ids"}`
    LongTensors [B, seq_len] for one data-parallel rank (see the module docstring)."""
    check_loader_args(dp_rank, dp_world_size, local_batch_size, seq_len)
    source = build_sft_source(cfg, tokenizer)
    packer = SFTPacker(
        source,
        seq_len=seq_len,
        pad_id=tokenizer.pad_id,
        packing=cfg.packing,
        overlong=cfg.overlong,
        shuffle=cfg.shuffle,
        seed=seed,
    )
    batches = SFTBatches(packer, local_batch_size, dp_rank=dp_rank, dp_world_size=dp_world_size)
    return SFTDataLoader(
        batches, dp_rank=dp_rank, dp_world_size=dp_world_size, num_examples=len(source)
    )
