"""The SFT data flags (`--sft_data.*`) and the synthetic task's flags they share with RL
(`--rl_data.*`), with the checks that run before any work starts."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from titan.train.data.chat import parse_template_kwargs
from titan.train.data.records import RecordSplitsConfig, is_hub_dataset, resolve_local_records


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
class SFTDataConfig(SyntheticTaskConfig, RecordSplitsConfig):
    """`--sft_data.*`: the supervised fine-tuning examples and how they become batches."""

    format: Literal["auto", "prompt_completion", "chat", "text", "synthetic"] = "auto"
    """"prompt_completion": rows with `prompt` and `completion` (strings concatenated as they
    are, or both lists of messages). "chat": rows with `messages`, a list of {role, content}.
    "text": rows with `text`, trained on every token (TRL's language-modeling datasets).
    "synthetic": a built-in small task (see --sft_data.synthetic_*), no file needed. "auto":
    synthetic without --sft_data.path, else told by the columns as TRL tells a dataset's type
    (messages: chat; prompt and completion: prompt_completion; text: text)."""
    path: str | None = None
    """JSONL or Parquet file, directory of .jsonl/.json or .parquet files (one kind), or glob
    (read with `datasets`' json or parquet loader), or a Hugging Face Hub dataset name
    (`org/name`, read with `datasets.load_dataset`; see --sft_data.subset and --sft_data.split).
    Required for prompt_completion and chat."""
    eval_path: str | None = None
    """Held-out examples in the same layout as --sft_data.path (JSONL or Parquet file,
    directory, glob or Hub dataset; its --sft_data.eval_split), scored by `titan sft
    --validation.enable`: the loss over their completion tokens. The synthetic format holds
    out its own strings (--sft_data.synthetic_eval_examples)."""
    prompt_field: str = "prompt"
    """prompt_completion: the column holding the prompt."""
    completion_field: str = "completion"
    """prompt_completion: the column holding the completion."""
    messages_field: str = "messages"
    """chat: the column holding the list of messages."""
    text_field: str = "text"
    """text: the column holding each example's text (TRL's `dataset_text_field`)."""
    chat_template: Literal["auto", "tokenizer", "builtin"] = "auto"
    """chat, and prompt_completion rows whose prompt and completion are lists of messages
    (TRL's conversational prompt-completion: the completion's assistant turns are trained):
    "tokenizer" renders the Jinja chat_template shipped with the tokenizer files;
    "builtin" the simple documented template of titan.train.data.chat; "auto" the
    tokenizer's when its files carry one, else builtin."""
    chat_template_kwargs: str | None = None
    """Extra variables for the tokenizer's chat template, a JSON object, as transformers'
    `apply_chat_template(**kwargs)` (TRL's `chat_template_kwargs`) takes them: Qwen3's
    '{"enable_thinking": false}'."""
    chat_template_path: str | None = None
    """A chat template in place of the tokenizer's (TRL's `chat_template_path`): a Jinja file,
    or a tokenizer folder or Hub id that ships one; rendered with the run's tokenizer's special
    tokens (a warning names the ones the template writes that the tokenizer does not have)."""
    train_on: Literal["completion", "all"] = "completion"
    """"completion": loss only on completion / assistant tokens and the EOS ending them.
    "all": loss on every token of the example (after the first)."""
    packing: bool = True
    """Pack several whole examples per row (with document boundaries); off: one per row."""
    packing_strategy: Literal["greedy", "bfd"] = "greedy"
    """How --sft_data.packing fills rows. greedy: examples in order, a row closed at the first
    one that does not fit; bfd (best-fit decreasing, TRL's default packing_strategy): each
    window of --sft_data.packing_window examples packed longest first, each into the row it
    fills best, so short examples fill the gaps (much less padding; an example keeps its own
    attention and positions either way)."""
    packing_window: int = 1000
    """Examples --sft_data.packing_strategy bfd packs together (in the epoch's order): larger
    packs tighter; their tokens are held in memory."""
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

    @property
    def resolved_format(self) -> str:
        """The format as far as the flags tell it: ``synthetic`` for ``auto`` without a path;
        ``auto`` with one stays auto until the rows' columns tell it (`detect_format`)."""
        if self.format == "auto" and not self.path and not self.eval_path:
            return "synthetic"
        return self.format

    def _check_format(self) -> None:
        """format/path combination makes sense."""
        if self.format not in ("auto", "prompt_completion", "chat", "text", "synthetic"):
            raise ValueError(
                f"--sft_data.format must be auto, prompt_completion, chat, text or synthetic, got {self.format!r}"
            )
        if self.resolved_format != "synthetic" and not self.path:
            raise ValueError(
                f"--sft_data.format {self.resolved_format} reads JSONL files: set --sft_data.path to a "
                "file, directory or glob"
            )
        if self.resolved_format == "synthetic" and self.eval_path:
            raise ValueError(
                f"--sft_data.eval_path {self.eval_path!r} is not read by --sft_data.format synthetic (its "
                "held-out strings are scored); drop it or set --sft_data.format auto, prompt_completion, chat or text"
            )
        if self.resolved_format == "synthetic" and self.path:
            raise ValueError(
                f"--sft_data.path {self.path!r} is not read by --sft_data.format synthetic; "
                "drop the path or set --sft_data.format auto, prompt_completion, chat or text"
            )
        for flag in ("prompt_field", "completion_field", "messages_field", "text_field"):
            if not getattr(self, flag):
                raise ValueError(f"--sft_data.{flag} is empty; name the JSONL column to read")
        self._check_unread_fields()
        self.check_record_splits("--sft_data", reads_files=self.resolved_format != "synthetic")

    def _check_unread_fields(self) -> None:
        """Column names and the template the format does not read are refused, not ignored
        (with format auto, once the columns tell the format)."""
        reads = {"prompt_completion": ("prompt_field", "completion_field"), "chat": ("messages_field",),
                 "text": ("text_field",), "synthetic": (), "auto": tuple(FIELD_DEFAULTS)}[self.resolved_format]
        for flag, default in FIELD_DEFAULTS.items():
            if flag not in reads and getattr(self, flag) != default:
                raise ValueError(f"--sft_data.{flag} {getattr(self, flag)!r} is not read by --sft_data.format "
                                 f"{self.resolved_format}" + (f" (it reads {', '.join('--sft_data.' + r for r in reads)})"
                                                     if reads else "") + ": drop it")
        renders_chats = self.resolved_format not in ("synthetic", "text")
        if not renders_chats and self.chat_template != "auto":
            raise ValueError(f"--sft_data.chat_template {self.chat_template} is not read by --sft_data.format "
                             f"{self.resolved_format} (its examples are plain text): drop it")
        check_template_kwargs(self.chat_template_kwargs, "--sft_data", self.chat_template,
                              renders_chats=renders_chats, fmt=self.resolved_format)
        check_template_path(self.chat_template_path, "--sft_data", self.chat_template,
                            renders_chats=renders_chats, fmt=self.resolved_format)

    def _check_choices(self) -> None:
        """Literal-typed flags hold one of their values (tyro checks the CLI, not code)."""
        if self.packing_strategy == "bfd" and not self.packing:
            raise ValueError("--sft_data.packing_strategy bfd packs several examples per row, and this run puts one per "
                             "row (--sft_data.no_packing): drop one of the two flags")
        if self.packing_strategy != "bfd" and self.packing_window != SFTDataConfig.packing_window:
            raise ValueError(f"--sft_data.packing_window {self.packing_window} is read by --sft_data.packing_strategy "
                             "bfd only: set it, or drop the flag")
        if self.packing_window < 1:
            raise ValueError(f"--sft_data.packing_window must be >= 1, got {self.packing_window}")
        for flag, allowed in (
            ("chat_template", ("auto", "tokenizer", "builtin")),
            ("train_on", ("completion", "all")),
            ("overlong", ("drop", "truncate")),
            ("packing_strategy", ("greedy", "bfd")),
        ):
            value = getattr(self, flag)
            if value not in allowed:
                raise ValueError(
                    f"--sft_data.{flag} must be one of {', '.join(allowed)}, got {value!r}"
                )


FIELD_DEFAULTS = {"prompt_field": "prompt", "completion_field": "completion", "messages_field": "messages",
                  "text_field": "text"}
"""The column flags of --sft_data.* and their defaults."""


def check_template_kwargs(text: str | None, section: str, chat_template: str, *, renders_chats: bool,
                          fmt: str = "synthetic") -> None:
    """``{section}.chat_template_kwargs`` is a JSON object, for a format that renders chats with
    a tokenizer's template (not the built-in one, which has no variables); ``fmt``: the format
    named when it renders none."""
    if text is None:
        return
    parse_template_kwargs(text, f"{section}.chat_template_kwargs")
    if not renders_chats or chat_template == "builtin":
        what = "the built-in chat template" if renders_chats else f"{section}.format {fmt}"
        raise ValueError(f"{section}.chat_template_kwargs {text!r} is not read by {what}, which has no template "
                         "variables: drop it")


def check_template_path(path: str | None, section: str, chat_template: str, *, renders_chats: bool,
                        fmt: str = "synthetic") -> None:
    """``{section}.chat_template_path`` names a template for a format that renders chats, and
    not beside ``chat_template builtin`` (titan's own template); ``fmt`` as in
    `check_template_kwargs`."""
    if path is None:
        return
    if not path:
        raise ValueError(f"{section}.chat_template_path is empty; name a Jinja template file, or drop the flag")
    if not renders_chats:
        raise ValueError(f"{section}.chat_template_path {path!r} is not read by {section}.format {fmt} (its "
                         "examples are plain text): drop it")
    if chat_template == "builtin":
        raise ValueError(f"{section}.chat_template_path sets a Jinja template and {section}.chat_template builtin "
                         "renders titan's own: drop one of the two")


def validate_sft_data_config(cfg: SFTDataConfig) -> None:
    """Filesystem checks, run before any work starts (like `validate_data_config`):
    the local record files exist and hold the named split (a Hub dataset is checked when it
    is read). Raises FileNotFoundError or ValueError naming the flag."""
    for path, flag, split, held_out in ((cfg.path, "--sft_data.path", cfg.split, False),
                                        (cfg.eval_path, "--sft_data.eval_path", cfg.eval_split, True)):
        if path and cfg.resolved_format != "synthetic" and not is_hub_dataset(path):
            resolve_local_records(path, flag=flag, held_out=held_out, split=split, subset=cfg.subset)
