"""SFT example sources: index -> `SFTExample` (the synthetic task, JSONL files)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
from titan.train.data.chat import (
    TOOLS_COLUMN,
    ChatTemplate,
    SFTExample,
    check_no_tools,
    encode_chat,
    encode_prompt_completion,
    encode_text,
    parse_template_kwargs,
    resolve_chat_template,
)
from titan.train.data.records import load_records, row_name
from titan.train.data.sft_config import SFTDataConfig
from titan.train.data.tokenizer import Tokenizer

logger = logging.getLogger("titan")


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

    def __init__(self, cfg: SFTDataConfig, tokenizer: Tokenizer, *, held_out: bool = False) -> None:
        self.task, self.tokenizer, self.train_on = cfg.synthetic_task, tokenizer, cfg.train_on
        strings = _distinct_strings(cfg)
        self.eval_pairs = [self.pair(s) for s in strings[: cfg.synthetic_eval_examples]]
        self.train_pairs = [self.pair(s) for s in strings[cfg.synthetic_eval_examples :]]
        # held out: the examples this source yields are the held-out pairs (validation)
        self._examples = self.eval_pairs if held_out else self.train_pairs

    def pair(self, letters: str) -> tuple[str, str]:
        """(prompt, answer) for one string."""
        answer = letters[::-1] if self.task == "reverse" else "".join(sorted(letters))
        return f"{self.task}: {letters}\n", answer

    def __len__(self) -> int:
        return len(self._examples)

    def example(self, index: int) -> SFTExample:
        """Pair `index` (a training pair, or a held-out one), encoded as prompt/completion."""
        prompt, answer = self._examples[index]
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
    if cfg.resolved_format != "synthetic":
        raise ValueError("held-out pairs exist only for --sft_data.format synthetic")
    strings = _distinct_strings(cfg)[: cfg.synthetic_eval_examples]
    task = cfg.synthetic_task
    return [
        (f"{task}: {s}\n", s[::-1] if task == "reverse" else "".join(sorted(s))) for s in strings
    ]


class JSONLSFTSource(SFTSource):
    """Rows of a `datasets.Dataset` read from JSONL: prompt/completion or chat."""

    def __init__(
        self, dataset, cfg: SFTDataConfig, tokenizer: Tokenizer, template: ChatTemplate | None,
        *, flag: str = "--sft_data.path",
    ) -> None:
        self.cfg, self.tokenizer, self.template = cfg, tokenizer, template
        # which flag named the files, for messages (--sft_data.path or --sft_data.eval_path)
        self.where = f"{flag} {(cfg.eval_path if flag.endswith('eval_path') else cfg.path)!r}"
        if cfg.format == "prompt_completion":
            self.fields = {
                "prompt_field": cfg.prompt_field,
                "completion_field": cfg.completion_field,
            }
        elif cfg.format == "text":
            self.fields = {"text_field": cfg.text_field}
        else:
            self.fields = {"messages_field": cfg.messages_field}
        for flag, column in self.fields.items():
            if column not in dataset.column_names:
                raise ValueError(
                    f"{self.where}: rows have no {column!r} key (columns: "
                    f"{', '.join(dataset.column_names) or 'none'}); --sft_data.format {cfg.format} "
                    f"reads {_format_needs(cfg)}: fix the file, --sft_data.{flag} or --sft_data.format"
                )
        # TRL's `tools` column: the function schemas a row's conversation may call, which the
        # chat template lists (transformers' `apply_chat_template(tools=...)`).
        self.tools_column = TOOLS_COLUMN if TOOLS_COLUMN in dataset.column_names else None
        self.dataset = dataset.select_columns([*self.fields.values(), *([self.tools_column] if self.tools_column else [])])

    def __len__(self) -> int:
        return len(self.dataset)

    def example(self, index: int) -> SFTExample:
        """Row `index` rendered and tokenized; a malformed row fails naming its index."""
        row = self.dataset[int(index)]
        tools = row[self.tools_column] if self.tools_column else None
        try:
            if self.cfg.format == "prompt_completion":
                prompt, completion = row[self.cfg.prompt_field], row[self.cfg.completion_field]
                if isinstance(prompt, list) and isinstance(completion, list):  # TRL's conversational pairs
                    return encode_chat([*prompt, *completion], self.tokenizer, template=self.template,
                                       train_on=self.cfg.train_on, trained_from=len(prompt), tools=tools)
                if not isinstance(prompt, str) or not isinstance(completion, str):
                    raise ValueError("prompt and completion must both be strings, or both lists of messages")
                check_no_tools(tools)
                return encode_prompt_completion(
                    prompt, completion, self.tokenizer, train_on=self.cfg.train_on
                )
            if self.cfg.format == "text":
                text = row[self.cfg.text_field]
                if not isinstance(text, str):
                    raise ValueError(f"{self.cfg.text_field!r} holds {type(text).__name__}, not a string")
                check_no_tools(tools)
                return encode_text(text, self.tokenizer)
            return encode_chat(
                row[self.cfg.messages_field],
                self.tokenizer,
                template=self.template,
                train_on=self.cfg.train_on,
                tools=tools,
            )
        except ValueError as e:
            raise ValueError(
                f"{self.where}: {row_name(index)}: {e}; --sft_data.format "
                f"{self.cfg.format} reads {_format_needs(self.cfg)}: fix the row"
            ) from None


def _format_needs(cfg: SFTDataConfig) -> str:
    """What a row of `cfg.format` must hold, for error messages."""
    if cfg.format == "prompt_completion":
        return (f"{cfg.prompt_field!r} and {cfg.completion_field!r} per row, both strings or both lists of "
                "{role, content} messages")
    if cfg.format == "text":
        return f"{cfg.text_field!r}: a string per row"
    return (
        f"{cfg.messages_field!r}: a list of {{role, content}} (roles system/user/assistant, "
        "at least one assistant)"
    )


def detect_format(cfg: SFTDataConfig, columns: list[str], *, where: str) -> SFTDataConfig:
    """``cfg`` with ``--sft_data.format auto`` told by the rows' ``columns`` as TRL tells a
    dataset's type: the messages column makes a chat, prompt and completion columns a
    prompt-completion pair, a text column a text (checked again as if given: a flag that
    format does not read is refused). Any other format is returned as it is."""
    if cfg.format != "auto":
        return cfg
    if cfg.messages_field in columns:
        detected = "chat"
    elif cfg.prompt_field in columns and cfg.completion_field in columns:
        detected = "prompt_completion"
    elif cfg.text_field in columns:
        detected = "text"
    else:
        raise ValueError(
            f"{where}: --sft_data.format auto finds no column it knows (columns: {', '.join(columns) or 'none'}): "
            f"{cfg.messages_field!r} (chat), {cfg.prompt_field!r} and {cfg.completion_field!r} (prompt_completion) "
            f"or {cfg.text_field!r} (text); name the columns with --sft_data.messages_field, .prompt_field and "
            ".completion_field, or .text_field"
        )
    logger.info("%s: --sft_data.format auto reads it as %s (its columns: %s)", where, detected, ", ".join(columns))
    return dataclasses.replace(cfg, format=detected)


def build_sft_source(cfg: SFTDataConfig, tokenizer: Tokenizer, *, held_out: bool = False) -> SFTSource:
    """The example source `cfg` describes; `held_out`: its held-out examples (the synthetic
    task's held-out strings, or the rows of --sft_data.eval_path)."""
    if cfg.resolved_format == "synthetic":
        return SyntheticSFTTask(cfg, tokenizer, held_out=held_out)
    if held_out and not cfg.eval_path:
        raise ValueError("held-out SFT examples need --sft_data.eval_path (JSONL in the --sft_data.format layout)")
    flag = "--sft_data.eval_path" if held_out else "--sft_data.path"
    dataset = load_records(cfg.eval_path if held_out else cfg.path, flag=flag, held_out=held_out,
                           split=cfg.eval_split if held_out else cfg.split, subset=cfg.subset, cache_dir=cfg.cache_dir)
    cfg = detect_format(cfg, dataset.column_names, where=f"{flag} {cfg.eval_path if held_out else cfg.path}")
    # prompt_completion rows may be conversations too (TRL's conversational prompt-completion)
    template = resolve_chat_template(
        cfg.chat_template, tokenizer, template_path=cfg.chat_template_path,
        variables=parse_template_kwargs(cfg.chat_template_kwargs, "--sft_data.chat_template_kwargs"))
    source = JSONLSFTSource(dataset, cfg, tokenizer, template, flag=flag)
    if cfg.format == "prompt_completion" and len(dataset) and isinstance(dataset[0][cfg.prompt_field], str):
        for option, what in (("chat_template_kwargs", "sets chat template variables"),
                             ("chat_template_path", "sets a chat template")):
            if getattr(cfg, option):
                raise ValueError(f"--sft_data.{option} {what}, and the rows of {flag} are text prompts and "
                                 "completions, rendered by no template: drop it")
    return source
