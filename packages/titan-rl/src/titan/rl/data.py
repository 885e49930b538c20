"""Prompt datasets for RL (``--rl_data.*``): JSONL rows or the built-in synthetic task.

A prompt is text plus an optional reference answer the rewards check against. JSONL files
(read with ``datasets``' json loader) give them in two columns (``--rl_data.prompt_field``,
``--rl_data.answer_field``). A prompt is a string (encoded as ``[BOS] text``, as SFT's
prompt/completion pairs) or, in TRL's conversational format, a list of ``{role, content}``
messages: rendered with the chat template (``--rl_data.chat_template``, as SFT's) followed by
the assistant header, the ids transformers' ``apply_chat_template(...,
add_generation_prompt=True)`` gives, so an instruct model is prompted as it was tuned. The synthetic task is SFT's (``titan.train.data.sft_sources``: sort or
reverse a short string), so an SFT warm-up and the RL run see the same prompt format and the
same held-out prompts.

:class:`PromptSampler` hands out prompts in a fresh seeded order per epoch; its position is
one counter, so a run resumes exactly (and identically on every rank).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from titan.rl.rewards import RewardContext
from titan.train.data.chat import (
    TOOLS_COLUMN,
    ChatTemplate,
    check_no_tools,
    check_prompt_messages,
    check_tools,
    encode_chat_prompt,
    encode_prompt,
    parse_template_kwargs,
    resolve_chat_template,
)
from titan.train.data.records import RecordSplitsConfig, load_records, row_name
from titan.train.data.sft_config import (
    SFTDataConfig,
    SyntheticTaskConfig,
    check_template_kwargs,
    check_template_path,
)
from titan.train.data.sft_sources import SyntheticSFTTask
from titan.train.data.tokenizer import Tokenizer

logger = logging.getLogger("titan")


@dataclass(kw_only=True)
class RLDataConfig(SyntheticTaskConfig, RecordSplitsConfig):
    """``--rl_data.*``: the prompts RL samples from (the synthetic task's flags are
    `SyntheticTaskConfig`'s, shared with ``--sft_data.*``)."""

    format: Literal["auto", "synthetic", "jsonl"] = "auto"
    """"synthetic": the built-in SFT task (--rl_data.synthetic_*), no file; "jsonl": rows of
    --rl_data.path (JSONL, Parquet or a Hub dataset) with a prompt and a reference answer;
    "auto": jsonl when --rl_data.path or --rl_data.eval_path is given, else synthetic."""
    path: str | None = None
    """jsonl: a JSONL or Parquet file, a directory of them (one kind), a glob, or a Hugging Face
    Hub dataset name (`org/name`, read with `datasets.load_dataset`; see --rl_data.subset and
    --rl_data.split)."""
    prompt_field: str = "prompt"
    """jsonl: the column holding the prompt: a string, or a list of {role, content} messages
    (TRL's conversational format) rendered with --rl_data.chat_template; a dotted path reads
    a nested record (``extra.question``)."""
    chat_template: Literal["auto", "tokenizer", "builtin"] = "auto"
    """jsonl, conversational prompts: "tokenizer" renders the Jinja chat_template shipped with
    the tokenizer files, "builtin" titan's simple template (titan.train.data.chat), "auto" the
    tokenizer's when its files carry one, else builtin; the assistant header follows."""
    chat_template_kwargs: str | None = None
    """jsonl, conversational prompts: extra variables for the tokenizer's chat template, a JSON
    object as transformers' `apply_chat_template(**kwargs)` takes them (Qwen3's
    '{"enable_thinking": false}': prompts end with an empty think block)."""
    chat_template_path: str | None = None
    """jsonl, conversational prompts: a chat template in place of the tokenizer's (TRL's
    `chat_template_path`): a Jinja file, or a tokenizer folder or Hub id that ships one."""
    answer_field: str = "answer"
    """jsonl: the column holding the reference answer (may be missing for rewards that need none);
    a dotted path reads a nested record (verl's ``reward_model.ground_truth``)."""
    overlong: Literal["drop", "error"] = "drop"
    """Prompts too long to generate --sampling.max_new_tokens after within --training.seq_len:
    "drop" leaves them out when the prompts are read (counted in the log, as verl filters
    overlong prompts); "error" stops before training, naming the first one. Either way no
    rollout meets one mid-run."""
    eval_path: str | None = None
    """jsonl: held-out prompts scored greedily every --rl.eval_freq steps (optional), in the
    layout of --rl_data.path (its --rl_data.eval_split)."""
    sft_demonstrations: int = 0
    """synthetic: the SFT warm-up (--rl.sft_warmup_steps) trains on only the first N training
    prompts with their answers — a small fixed set of demonstrations that teaches the format —
    while RL samples every training prompt; 0: the warm-up sees every training prompt too."""

    @property
    def resolved_format(self) -> str:
        """The format ``auto`` stands for: jsonl with a prompt path, else synthetic."""
        if self.format == "auto":
            return "jsonl" if self.path or self.eval_path else "synthetic"
        return self.format

    def __post_init__(self) -> None:
        if self.format not in ("auto", "synthetic", "jsonl"):
            raise ValueError(f"--rl_data.format must be auto, synthetic or jsonl, got {self.format!r}")
        if self.overlong not in ("drop", "error"):
            raise ValueError(f"--rl_data.overlong must be drop or error, got {self.overlong!r}")
        if self.chat_template not in ("auto", "tokenizer", "builtin"):
            raise ValueError(f"--rl_data.chat_template must be auto, tokenizer or builtin, got {self.chat_template!r}")
        if self.resolved_format == "jsonl" and not self.path:
            raise ValueError("--rl_data.format jsonl reads prompts from files: set --rl_data.path")
        if self.resolved_format == "synthetic" and (self.path or self.eval_path):
            raise ValueError(
                "--rl_data.path / --rl_data.eval_path are not read by --rl_data.format synthetic; "
                "drop them or set --rl_data.format jsonl"
            )
        unread = {"prompt_field": "prompt", "answer_field": "answer", "chat_template": "auto"}
        for flag, default in unread.items():
            if self.resolved_format == "synthetic" and getattr(self, flag) != default:
                raise ValueError(f"--rl_data.{flag} {getattr(self, flag)!r} is not read by --rl_data.format synthetic "
                                 "(its prompts and answers are the task's own); drop it or set --rl_data.format jsonl")
        check_template_kwargs(self.chat_template_kwargs, "--rl_data", self.chat_template,
                              renders_chats=self.resolved_format == "jsonl")
        check_template_path(self.chat_template_path, "--rl_data", self.chat_template,
                            renders_chats=self.resolved_format == "jsonl")
        if self.sft_demonstrations < 0 or self.sft_demonstrations > self.synthetic_examples:
            raise ValueError(
                f"--rl_data.sft_demonstrations must be in [0, --rl_data.synthetic_examples "
                f"{self.synthetic_examples}], got {self.sft_demonstrations}"
            )
        if self.resolved_format == "synthetic":
            self.check_synthetic_task("--rl_data")
        self.check_record_splits("--rl_data", reads_files=self.resolved_format == "jsonl")

    def sft_config(self, *, demonstrations_only: bool = False) -> SFTDataConfig:
        """The same synthetic task as an SFT data config (for the task's prompts; with
        ``demonstrations_only``, the warm-up's: the first --rl_data.sft_demonstrations
        training strings, the held-out strings unchanged)."""
        examples = self.synthetic_examples
        if demonstrations_only and self.sft_demonstrations:
            examples = self.sft_demonstrations
        return SFTDataConfig(format="synthetic", **{**self.synthetic_task_fields(), "synthetic_examples": examples})


@dataclass
class Prompt:
    """One RL prompt: its text, its token ids as generation sees them, the reference answer,
    and for TRL-style rewards its conversation (None for a text prompt) and its row's other
    columns."""

    text: str
    ids: list[int]
    answer: str | None
    messages: list[dict] | None = None
    columns: dict[str, Any] = field(default_factory=dict)

    @property
    def reward_context(self) -> RewardContext:
        """What a TRL-style reward sees of this prompt."""
        return RewardContext(messages=self.messages, columns=self.columns)


def _file_prompts(path: str, cfg: RLDataConfig, tokenizer: Tokenizer, *, flag: str, held_out: bool = False
                  ) -> list[Prompt]:
    """Prompts of the JSONL or Parquet files or Hub dataset at ``path`` (given by ``flag``):
    its --rl_data.split, or ``held_out`` its --rl_data.eval_split (default validation, else test)."""
    rows = load_records(path, flag=flag, held_out=held_out, split=cfg.eval_split if held_out else cfg.split,
                        subset=cfg.subset)
    for field_flag, dotted in (("prompt_field", cfg.prompt_field), ("answer_field", cfg.answer_field)):
        column = dotted.split(".")[0]
        if column not in rows.column_names and (field_flag == "prompt_field" or "." in dotted):
            raise ValueError(
                f"--rl_data.{field_flag} {dotted!r}: {column!r} is not a column of {path} "
                f"(columns: {', '.join(rows.column_names)})"
            )
    has_answer = cfg.answer_field.split(".")[0] in rows.column_names
    templates: list[ChatTemplate | None] = []  # resolved on the first conversational row
    out = []
    for index, row in enumerate(rows):
        where = f"{path} {row_name(index)}"
        answer = _field(row, cfg.answer_field, where=where, flag="answer_field") if has_answer else None
        value = _field(row, cfg.prompt_field, where=where, flag="prompt_field")
        messages = None
        if isinstance(value, str):
            try:
                check_no_tools(row.get(TOOLS_COLUMN))
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            text, ids = value, encode_prompt(value, tokenizer)
        elif isinstance(value, list):
            if not templates:
                templates.append(resolve_chat_template(
                    cfg.chat_template, tokenizer, section="--rl_data", template_path=cfg.chat_template_path,
                    variables=parse_template_kwargs(cfg.chat_template_kwargs, "--rl_data.chat_template_kwargs")))
            text, ids, messages = _conversation_prompt(value, tokenizer, templates[0], where=where,
                                                       tools=row.get(TOOLS_COLUMN))
        else:
            raise ValueError(f"{where}: --rl_data.prompt_field {cfg.prompt_field!r} holds "
                             f"{type(value).__name__}, not a string or a list of {{role, content}} messages")
        columns = {name: column for name, column in row.items() if name != cfg.prompt_field.split(".")[0]}
        out.append(Prompt(text, ids, None if answer is None else str(answer), messages=messages, columns=columns))
    for option, what in (("chat_template_kwargs", "sets chat template variables"),
                         ("chat_template_path", "sets a chat template")):
        if getattr(cfg, option) and out and not templates:
            raise ValueError(f"--rl_data.{option} {what}, and the prompts of {path} are text, rendered by no "
                             "template: drop it")
    return out


def _field(row: dict, dotted: str, *, where: str, flag: str):
    """``row``'s value at ``dotted`` (``reward_model.ground_truth``: a key of a nested record,
    as verl's prompt files hold the answer)."""
    value = row
    for key in dotted.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ValueError(f"{where}: --rl_data.{flag} {dotted!r} has no {key!r}")
        value = value[key]
    return value


def _conversation_prompt(messages: list, tokenizer: Tokenizer, template: ChatTemplate | None,
                         *, where: str, tools: Any = None) -> tuple[str, list[int], list[dict]]:
    """(text, ids, checked messages) of a conversational prompt: the conversation rendered
    with ``template`` (None: the built-in one; with the row's function schemas ``tools``, TRL's
    column) and the assistant header after it. The text is what the rewards' ``prompt``
    receives: the rendered conversation (the built-in template's without its BOS)."""
    try:
        messages, tools = check_prompt_messages(messages), check_tools(tools)
        ids = encode_chat_prompt(messages, tokenizer, template=template, tools=tools)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    text = (template.render(messages, add_generation_prompt=True, tools=tools) if template is not None
            else tokenizer.decode(ids))
    return text, ids, messages


def build_prompts(cfg: RLDataConfig, tokenizer: Tokenizer, *, max_prompt_tokens: int | None = None
                  ) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts) of the configured source; with
    ``max_prompt_tokens``, longer prompts are dropped or refused (``--rl_data.overlong``)."""
    if cfg.resolved_format == "jsonl":
        start = time.perf_counter()
        train = _file_prompts(cfg.path, cfg, tokenizer, flag="--rl_data.path")
        held_out = (_file_prompts(cfg.eval_path, cfg, tokenizer, flag="--rl_data.eval_path", held_out=True)
                    if cfg.eval_path else [])
        logger.info("read %d training and %d held-out prompts in %.1fs (longest %d tokens)", len(train), len(held_out),
                    time.perf_counter() - start, max(len(p.ids) for p in train + held_out) if train else 0)
    else:
        task = SyntheticSFTTask(cfg.sft_config(), tokenizer)

        def prompts(pairs):
            return [Prompt(text, encode_prompt(text, tokenizer), answer) for text, answer in pairs]

        train, held_out = prompts(task.train_pairs), prompts(task.eval_pairs)
    if max_prompt_tokens is not None:
        train = _within_budget(train, max_prompt_tokens, cfg.overlong, "training")
        held_out = _within_budget(held_out, max_prompt_tokens, cfg.overlong, "held-out") if held_out else held_out
    return train, held_out


def _within_budget(prompts: list[Prompt], max_tokens: int, overlong: str, which: str) -> list[Prompt]:
    """``prompts`` of at most ``max_tokens`` tokens: the others dropped (and counted in the
    log) or, with ``overlong`` "error", a ValueError naming the first of them."""
    kept = [p for p in prompts if len(p.ids) <= max_tokens]
    if len(kept) == len(prompts):
        return prompts
    first = next(i for i, p in enumerate(prompts) if len(p.ids) > max_tokens)
    longest = max(len(p.ids) for p in prompts)
    budget = (f"at most {max_tokens} prompt tokens fit (--training.seq_len minus --sampling.max_new_tokens); "
              f"{len(prompts) - len(kept)} of the {len(prompts)} {which} prompts are longer (the longest "
              f"{longest} tokens, the first is prompt {first})")
    if overlong == "error" or not kept:
        raise ValueError(f"{budget}; raise --training.seq_len, lower --sampling.max_new_tokens"
                         + (" or drop them with --rl_data.overlong drop" if kept else ""))
    logger.warning("%s: they are left out (--rl_data.overlong drop)", budget)
    return kept


class PromptSampler:
    """Prompts in a seeded order, reshuffled every epoch. Stateless: the prompts of rollout
    ``i`` are positions ``i * count ... (i + 1) * count - 1`` of the endless order, so a run
    resumes from its rollout index alone (and every rank agrees)."""

    def __init__(self, prompts: list[Prompt], *, seed: int) -> None:
        if not prompts:
            raise ValueError("the RL prompt dataset is empty; check --rl_data.*")
        self.prompts, self.seed = prompts, seed
        self._cached: tuple[int, np.ndarray] | None = None

    def _order(self, epoch: int) -> np.ndarray:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts)))
        return self._cached[1]

    def window(self, start: int, count: int) -> list[Prompt]:
        """Prompts at positions ``start .. start + count - 1`` of the endless seeded order."""
        out = []
        for position in range(start, start + count):
            epoch, index = divmod(position, len(self.prompts))
            out.append(self.prompts[int(self._order(epoch)[index])])
        return out

    def for_rollout(self, index: int, count: int) -> list[Prompt]:
        """The ``count`` prompts of rollout ``index``."""
        return self.window(index * count, count)
