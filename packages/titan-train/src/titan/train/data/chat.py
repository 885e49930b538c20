"""SFT encoding: text -> (token ids, per-token target flags), for prompt/completion pairs
and chat conversations (see `titan.train.data.sft` for how the examples are packed).

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
prefix of its continuation (most do; one that rewrites earlier turns is refused), unless
the template marks them itself with transformers' `{% generation %}` tags. The
rendered conversation is tokenized in one piece, so its ids are those of transformers'
`apply_chat_template` (whitespace a template puts between turns joins the next word as
it does there); a token is trained when it holds a character of an assistant turn between
the turn's first and last non-space characters. A template that writes the date
(Llama 3.1's and later ones call transformers' `strftime_now` for "Today Date: ...") gets
the time this process first rendered one (`template_clock`), as transformers renders the
current time: every example of a run shows the same date.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from titan.train.data.tokenizer import Tokenizer

logger = logging.getLogger("titan")

ROLES = ("system", "user", "assistant")
TOOLS_COLUMN = "tools"
"""The column of a row's function schemas (TRL's name), given to the chat template as `tools`."""
TOOL_ROLES = ("tool", "ipython")
"""Roles of a tool's result (Llama 3.1's templates call it ipython): context a tokenizer's chat
template renders, never trained; the built-in template has no form for them."""


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
    """Tokenize each piece on its own (so a mask boundary is a token boundary) and join. A
    text that already starts with the BOS token (a prompt rendered with its template's
    `bos_token`) keeps its own: the framing BOS before it is not added twice."""
    ids: list[int] = []
    targets: list[bool] = []
    for piece, trained in segments:
        piece_ids = [piece] if isinstance(piece, int) else tokenizer.encode(piece)
        if ids == [tokenizer.bos_id] and piece_ids[:1] == [tokenizer.bos_id]:
            ids, targets = [], []
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


def encode_text(text: str, tokenizer: Tokenizer) -> SFTExample:
    """`[BOS] text EOS`, every token after BOS a target: a language-modeling example (TRL's
    `text` datasets), framed as pretraining frames a document."""
    return _encode_segments(tokenizer, _bos(tokenizer) + [(text, True), (tokenizer.eos_id, True)], "completion")


def encode_prompt(prompt: str, tokenizer: Tokenizer) -> list[int]:
    """Ids to generate a completion from: `[BOS] prompt`, as in `encode_prompt_completion`."""
    return [
        int(i)
        for i in _encode_segments(tokenizer, _bos(tokenizer) + [(prompt, False)], "completion").ids
    ]


def _builtin_chat_segments(
    messages: Sequence[dict], tokenizer: Tokenizer, add_generation_prompt: bool = False,
    trained_from: int = 0, tools: list | None = None,
) -> list[Segment]:
    """The built-in template (module docstring): headers and non-assistant turns are
    context; each assistant turn's content and its closing EOS are targets (those from
    message `trained_from` on). It has no form for `tools` (refused)."""
    _check_builtin_renders(messages, tools)
    segments = _bos(tokenizer)
    for i, message in enumerate(messages):
        role, content = message["role"], message["content"]
        segments.append((f"<|{role}|>\n", False))
        if role == "assistant":
            trained = i >= trained_from
            segments += [(content, trained), (tokenizer.eos_id, trained)]
        else:
            segments.append((content + "\n", False))
    if add_generation_prompt:
        segments.append(("<|assistant|>\n", False))
    return segments


def _generation_tag_extension():
    """A jinja2 extension for `{% generation %}...{% endgeneration %}`, the tags transformers'
    templates put around what the assistant generates (its `return_assistant_tokens_mask`):
    the body renders as it is, and while a `spans` list is set on the environment, each
    block's character range in the output is appended to it (the output so far is the
    `chunks` list the renderer fills)."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationSpans(jinja2.ext.Extension):
        tags = {"generation"}

        def __init__(self, environment) -> None:  # noqa: ANN001 (jinja2's signature)
            super().__init__(environment)
            environment.extend(generation_chunks=None, generation_spans=None)

        def parse(self, parser):  # noqa: ANN001, ANN201 (jinja2's signature)
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:  # noqa: ANN001 (jinja2's signature)
            text = caller()
            env = self.environment
            if env.generation_spans is not None:
                start = sum(len(chunk) for chunk in env.generation_chunks)
                env.generation_spans.append((start, start + len(text)))
            return text

    return GenerationSpans


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` filter for chat templates (jinja2's own escapes <, > and & as
    HTML): the same text a template renders there."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _has_generation_tag(env: Any, source: str) -> bool:
    """Whether `source` has a `{% generation %}` block."""
    tokens = [(kind, value) for _, kind, value in env.lex(source) if kind != "whitespace"]
    return any(kind == "block_begin" and nxt == ("name", "generation")
               for (kind, _), nxt in zip(tokens, tokens[1:], strict=False))


_TEMPLATE_CLOCK: datetime | None = None


def template_clock() -> datetime:
    """The time chat templates render with `strftime_now`: this process's first call, then
    the same for the rest of the run (transformers calls `datetime.now()` on every render; a
    run spanning midnight would render its examples with two dates)."""
    global _TEMPLATE_CLOCK
    if _TEMPLATE_CLOCK is None:
        _TEMPLATE_CLOCK = datetime.now()
    return _TEMPLATE_CLOCK


def share_template_clock(device: Any = None) -> datetime:
    """Give every rank rank 0's `template_clock` (collective: every rank calls it), so that
    ranks that started on either side of midnight render the same examples alike; returns it.
    A no-op without an initialized process group. `device`: where NCCL stages the object."""
    import torch.distributed as dist

    global _TEMPLATE_CLOCK
    clock = template_clock()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [clock]
        dist.broadcast_object_list(box, src=0, device=device)
        _TEMPLATE_CLOCK = clock = box[0]
    return clock


def _strftime_now(fmt: str) -> str:
    """transformers' `strftime_now` template global, on the run's clock (`template_clock`)."""
    return template_clock().strftime(fmt)


class ChatTemplate:
    """A Jinja chat template as shipped with Hugging Face tokenizer files, rendered with
    jinja2 in a sandbox as transformers renders it: `bos_token`/`eos_token`,
    `raise_exception`, `strftime_now`, its `tojson` and its `{% generation %}` tags."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 special_tokens: dict[str, str] | None = None, variables: dict[str, Any] | None = None) -> None:
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
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _generation_tag_extension()]
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        self.env = env
        self.template = env.from_string(source)
        self.marks_generation = _has_generation_tag(env, source)
        self.bos_token, self.eos_token = bos_token, eos_token
        self.special_tokens = dict(special_tokens or {})  # unk_token / pad_token, as the tokenizer files set them
        self.variables = dict(variables or {})  # --*.chat_template_kwargs (Qwen3's enable_thinking)

    def _variables(self, messages: Sequence[dict], add_generation_prompt: bool,
                   tools: list | None = None) -> dict[str, Any]:
        # transformers passes `tools` and `documents` always (None when not given): a template
        # may test them with `is defined` or `is not none`.
        return dict(self.special_tokens, **self.variables, messages=list(messages), tools=tools, documents=None,
                    add_generation_prompt=add_generation_prompt, bos_token=self.bos_token, eos_token=self.eos_token)

    def render(self, messages: Sequence[dict], *, add_generation_prompt: bool = False,
               tools: list | None = None) -> str:
        """The conversation as text (with the function schemas `tools` the template lists),
        optionally followed by the assistant header."""
        return self.template.render(**self._variables(messages, add_generation_prompt, tools))

    def _generation_segments(self, messages: Sequence[dict], trained_from: int,
                             tools: list | None = None) -> list[Segment]:
        """`segments` of a template with `{% generation %}` blocks."""
        text, spans = self.render_with_generation_spans(messages, tools=tools)
        return _generation_segments_of(text, spans, messages, trained_from)

    def render_with_generation_spans(self, messages: Sequence[dict], *, tools: list | None = None
                                     ) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as text and the character ranges of its `{% generation %}`
        blocks, in order."""
        chunks: list[str] = []
        spans: list[tuple[int, int]] = []
        self.env.generation_chunks, self.env.generation_spans = chunks, spans
        try:
            for chunk in self.template.generate(**self._variables(messages, False, tools)):
                chunks.append(chunk)
        finally:
            self.env.generation_chunks = self.env.generation_spans = None
        return "".join(chunks), spans

    @classmethod
    def from_tokenizer_files(cls, directory: str, *, variables: dict[str, Any] | None = None,
                             source: str | None = None) -> ChatTemplate | None:
        """The template next to a tokenizer.json (`template_source`), or ``source`` in its
        place, with that tokenizer's special tokens. None when there is none."""
        source = template_source(directory) if source is None else source
        if not source:
            return None
        config = _read_json(os.path.join(directory, "tokenizer_config.json"))
        # transformers gives a template every special token the tokenizer sets, not only BOS/EOS.
        special_tokens = {f"{role}_token": _token_text(config, role) for role in ("unk", "pad")
                          if _token_text(config, role)}
        return cls(source, bos_token=_token_text(config, "bos"), eos_token=_token_text(config, "eos"),
                   special_tokens=special_tokens, variables=variables)

    def segments(
        self, messages: Sequence[dict], add_generation_prompt: bool = False, trained_from: int = 0,
        tools: list | None = None,
    ) -> list[Segment]:
        """Split the rendered conversation into context and assistant-turn text (trained
        from message `trained_from` on).

        Assistant turn i is the text `render(messages[:i+1])` adds to
        `render(messages[:i], add_generation_prompt=True)`: its content and the
        template's end-of-turn marker, never the assistant header. A template with
        `{% generation %}` blocks says itself what the assistant generates: the blocks are
        the trained text (transformers' assistant mask), one per assistant turn, and the
        conversation is rendered once (no prefix rule: a template that rewrites earlier turns,
        as Qwen3's drops their reasoning, works).
        """
        if self.marks_generation and not add_generation_prompt:
            return self._generation_segments(messages, trained_from, tools)
        segments: list[Segment] = []
        done = ""
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True, tools=tools)
            after = self.render(messages[: i + 1], tools=tools)
            if not before.startswith(done) or not after.startswith(before):
                raise ValueError(
                    "the tokenizer's chat template does not render a conversation as a prefix of "
                    "its continuation, so assistant turns cannot be located; use "
                    "--sft_data.chat_template builtin"
                )
            segments += [(before[len(done) :], False), (after[len(before) :], i >= trained_from)]
            done = after
        full = self.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        if not full.startswith(done):
            raise ValueError(
                "the tokenizer's chat template renders the whole conversation differently from "
                "its turns; use --sft_data.chat_template builtin"
            )
        segments.append((full[len(done) :], False))
        return [(text, trained) for text, trained in segments if text]


def _generation_segments_of(text: str, spans: list[tuple[int, int]], messages: Sequence[dict],
                            trained_from: int) -> list[Segment]:
    """`text` cut at its `{% generation %}` `spans` (one per assistant turn, in order): the
    spans of assistant turns from message `trained_from` on are trained."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if len(spans) != len(assistants):
        raise ValueError(
            f"the tokenizer's chat template marks {len(spans)} {{% generation %}} blocks for {len(assistants)} "
            "assistant turns, so the trained text is ambiguous; use --sft_data.chat_template builtin"
        )
    segments: list[Segment] = []
    done = 0
    for (start, end), index in zip(spans, assistants, strict=True):
        segments += [(text[done:start], False), (text[start:end], index >= trained_from)]
        done = end
    segments.append((text[done:], False))
    return [(piece, trained) for piece, trained in segments if piece]


def template_source(directory: str) -> str | None:
    """The chat template of the tokenizer files in ``directory``: `chat_template.jinja`, else the
    `chat_template` of `tokenizer_config.json` (a string, or a list of named ones of which
    "default" is taken). None when there is none."""
    jinja_file = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read() or None
    source = _read_json(os.path.join(directory, "tokenizer_config.json")).get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source if isinstance(source, str) and source else None


def read_template_path(path: str, flag: str) -> str:
    """The Jinja source ``--*.chat_template_path`` names (TRL's ``chat_template_path``): a
    template file, or a folder of tokenizer files that carries one (a Hub id was replaced by
    its snapshot folder before this)."""
    if os.path.isdir(path):
        source = template_source(path)
        if source is None:
            raise ValueError(f"{flag} {path}: the folder has no chat template (looked for chat_template.jinja and "
                             "the chat_template of tokenizer_config.json); name a template file or a tokenizer "
                             "folder that ships one")
        return source
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: no such file or folder; name a Jinja template file (chat_template.jinja) "
                         "or a tokenizer folder or Hub id that ships one")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{flag} {path} cannot be read as a Jinja template: {err}") from None
    if not source.strip():
        raise ValueError(f"{flag} {path} is empty; name a Jinja chat template")
    return source


# Spellings of special tokens in chat templates: <|im_start|>, <|eot_id|>, <start_of_turn>, </think>.
_SPECIAL_SPELLING = re.compile(r"<\|[^|<>\s]{1,64}\|>|</?[A-Za-z_][\w-]{0,63}>")


def unknown_template_tokens(source: str, tokenizer: Tokenizer) -> list[str]:
    """The special-token spellings written in a template's text that ``tokenizer`` does not
    encode as one token: rendered, they become several ordinary tokens, not the marker the
    template means (TRL asks that such tokens be added to the tokenizer first)."""
    found = dict.fromkeys(_SPECIAL_SPELLING.findall(source))
    return [token for token in found if len(tokenizer.encode(token)) != 1]


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


def resolve_chat_template(choice: str, tokenizer: Tokenizer, *, variables: dict[str, Any] | None = None,
                          section: str = "--sft_data", template_path: str | None = None) -> ChatTemplate | None:
    """The template `--sft_data.chat_template` (or ``section``'s) selects for `tokenizer`,
    rendering with the extra `variables` (``--*.chat_template_kwargs``); None = builtin, which
    takes no variables (refused when some are given). ``template_path``
    (``--*.chat_template_path``) replaces the tokenizer's template with that file's or
    folder's, rendered with this tokenizer's special tokens."""
    path = getattr(tokenizer, "path", None)  # HFTokenizer: its tokenizer.json
    if template_path is not None:
        return _template_from_path(template_path, tokenizer, choice=choice, variables=variables, section=section)
    template = None
    if choice != "builtin":
        template = ChatTemplate.from_tokenizer_files(os.path.dirname(path), variables=variables) if path else None
    if template is None and choice == "tokenizer":
        where = f"next to {path}" if path else "for the byte tokenizer"
        raise ValueError(
            f"{section}.chat_template tokenizer: no chat_template {where} (looked for "
            f"chat_template.jinja and tokenizer_config.json); use {section}.chat_template "
            "builtin or a tokenizer that ships one"
        )
    if template is None and variables:
        raise ValueError(f"{section}.chat_template_kwargs sets {', '.join(sorted(variables))} for a tokenizer's chat "
                         "template, and this run renders with the built-in one (which has no variables); drop it "
                         "or use a tokenizer that ships a template")
    return template


def _template_from_path(template_path: str, tokenizer: Tokenizer, *, choice: str, variables: dict[str, Any] | None,
                        section: str) -> ChatTemplate:
    """``--*.chat_template_path``'s template for ``tokenizer`` (see `resolve_chat_template`)."""
    flag = f"{section}.chat_template_path"
    if choice == "builtin":
        raise ValueError(f"{flag} sets a Jinja template and {section}.chat_template builtin renders titan's own: "
                         "drop one of the two")
    path = getattr(tokenizer, "path", None)
    if not path:
        raise ValueError(f"{flag} needs a Hugging Face tokenizer (--tokenizer.kind hf --tokenizer.path ...): the "
                         "byte tokenizer has no special tokens for a template to write")
    source = read_template_path(template_path, flag)
    missing = unknown_template_tokens(source, tokenizer)
    if missing:
        logger.warning("%s %s writes %s, which the tokenizer does not have as one token each: rendered, each "
                       "becomes several ordinary tokens (add them to the tokenizer, as TRL requires, or use a "
                       "template written for it)", flag, template_path, ", ".join(missing))
    return ChatTemplate.from_tokenizer_files(os.path.dirname(path), variables=variables, source=source)


TEMPLATE_RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")
"""The variables titan gives every chat template itself (not settable by chat_template_kwargs)."""


def parse_template_kwargs(text: str | None, flag: str) -> dict[str, Any]:
    """``--*.chat_template_kwargs``: a JSON object of extra template variables, as transformers'
    ``apply_chat_template(**kwargs)`` takes them (``{"enable_thinking": false}``); {} for None."""
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{flag} {text!r} is not JSON ({err}); give an object, e.g. "
                         "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"{flag} {text!r} must be a non-empty JSON object of template variables")
    reserved = sorted(set(value) & set(TEMPLATE_RESERVED))
    if reserved:
        raise ValueError(f"{flag} sets {', '.join(reserved)}, which titan gives the template itself; drop it")
    return value


def check_prompt_messages(messages: Any) -> list[dict]:
    """`messages` is a conversation to answer (an RL prompt in TRL's conversational format):
    a list of {role, content} with known roles that does not end with an assistant turn;
    returns it as plain dicts. Raises ValueError saying what is wrong."""
    checked = _checked_roles_and_contents(messages)
    if checked[-1]["role"] == "assistant":
        raise ValueError("the prompt's last message is the assistant's: a prompt ends with the turn to answer")
    return checked


def check_messages(messages: Any) -> list[dict]:
    """`messages` is a list of {role, content} with known roles and one assistant turn;
    returns it as plain dicts. Raises ValueError saying what is wrong."""
    checked = _checked_roles_and_contents(messages)
    if not any(m["role"] == "assistant" for m in checked):
        raise ValueError("no assistant message, so nothing to train on")
    return checked


def _checked_roles_and_contents(messages: Any) -> list[dict]:
    """`messages` as plain dicts with every key they hold (a template renders `tool_calls`,
    `reasoning_content` or a tool's `name` as transformers passes them on), or a ValueError
    naming the first bad one: a role that is not a non-empty string (which roles a template
    takes is the template's to say, as in transformers; the built-in one takes `ROLES`),
    content that is not a string (an assistant turn made only of tool calls may have none).
    Content given as a list of text parts (OpenAI's ``[{"type": "text", "text": ...}]``) is
    their concatenation (`text_of_parts`)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content}")
    checked = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"message {j} is not a {{role, content}} object")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {j} has role {role!r}, not a name such as {', '.join(ROLES + TOOL_ROLES)}")
        if isinstance(content, (list, tuple)):
            content = text_of_parts(content, f"message {j}")
        calls_only = content is None and role == "assistant" and bool(message.get("tool_calls"))
        if not isinstance(content, str) and not calls_only:
            raise ValueError(f"message {j} has non-string content {content!r}")
        checked.append({**message, "content": content})
    return checked


def text_of_parts(parts: Sequence[Any], where: str) -> str:
    """The text of content given as a list of parts (OpenAI's chat format, and datasets built
    for vision-language models): the ``text`` of its ``{"type": "text"}`` parts, concatenated,
    as the OpenAI API reads them. Every template then renders it as it renders string content
    (some render list content with its text, Qwen3's drops it, Llama 3.1's prints the list);
    a part of another type (an image) is refused: titan trains text models."""
    if not parts:
        raise ValueError(f"{where} has an empty list of content parts")
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            shown = f"a {kind!r} part" if kind else f"{part!r}"
            raise ValueError(f"{where}'s content part {k} is {shown}, not {{\"type\": \"text\", \"text\": ...}}: "
                             "titan trains text models, so only text parts are read")
        texts.append(part["text"])
    return "".join(texts)


def check_tools(tools: Any) -> list | None:
    """A row's function schemas (TRL's `tools` column) as the template takes them: a list of
    JSON-schema objects, or the same as a JSON string (as datasets often store it); None or
    empty: none. Raises ValueError naming what is wrong."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise ValueError(f"tools is a string that is not JSON ({err})") from None
    if tools is None or (isinstance(tools, (list, tuple)) and not tools):
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
        raise ValueError(f"tools must be a list of function schemas (objects), got {type(tools).__name__}")
    return list(tools)


def check_no_tools(tools: Any) -> None:
    """A text prompt (no chat template renders it) whose row lists function schemas is refused
    rather than trained or prompted without them."""
    if check_tools(tools):
        raise ValueError("the row lists tools, and a text prompt has no chat template to list them in; give the "
                         "prompt as a list of messages")


def _check_builtin_renders(messages: Sequence[dict], tools: list | None = None) -> None:
    """The built-in template writes roles and contents only: a message holding more (a tool
    result, tool calls, reasoning; keys left None, as Arrow fills a column a row lacks, hold
    nothing) or function schemas are refused rather than trained without them."""
    if tools:
        raise ValueError(
            f"the row lists {len(tools)} tools, which the built-in chat template does not render; use the "
            "tokenizer's chat template (--sft_data.chat_template / --rl_data.chat_template tokenizer) with one that "
            "renders them")
    for j, message in enumerate(messages):
        extra = sorted(key for key, value in message.items() if key not in ("role", "content") and value is not None)
        if message["role"] not in ROLES or extra:
            what = (f"the keys {', '.join(extra)}" if extra else f"a {message['role']} result"
                    if message["role"] in TOOL_ROLES else f"the role {message['role']!r}")
            raise ValueError(
                f"message {j} holds {what}, which the built-in chat template does not render; use the "
                "tokenizer's chat template (--sft_data.chat_template / --rl_data.chat_template tokenizer) "
                "with one that renders it"
            )


def encode_chat(
    messages: Sequence[dict],
    tokenizer: Tokenizer,
    *,
    template: ChatTemplate | None = None,
    train_on: str = "completion",
    trained_from: int = 0,
    tools: Any = None,
) -> SFTExample:
    """A conversation as ids; targets: every assistant turn (and its end marker) from message
    `trained_from` on (a conversational prompt-completion pair: the completion's), other
    turns and all role headers masked. `template` None is the built-in template. `tools`: the
    function schemas the template lists (a row's `tools` column, as TRL passes it)."""
    messages, tools = check_messages(messages), check_tools(tools)
    if not any(m["role"] == "assistant" for m in messages[trained_from:]):
        raise ValueError("the completion holds no assistant message, so nothing to train on")
    if template is None:
        segments = _builtin_chat_segments(messages, tokenizer, trained_from=trained_from, tools=tools)
        return _encode_segments(tokenizer, segments, train_on)
    return _encode_rendered(tokenizer, template.segments(messages, trained_from=trained_from, tools=tools),
                            train_on, exact_spans=template.marks_generation)


def _encode_rendered(tokenizer: Tokenizer, segments: Sequence[tuple[str, bool]], train_on: str,
                     *, exact_spans: bool = False) -> SFTExample:
    """Tokenize the rendered text of `segments` in one piece (a tokenizer's words can span
    two segments: " " closing a turn + "USER" is " USER") and train on each token that holds
    a character of a trained segment, between its first and last non-space characters (the
    separator closing a turn belongs to the next word's token, which is not trained);
    `exact_spans`: every character of a trained segment counts (a template's own
    `{% generation %}` blocks, as transformers' assistant mask counts them)."""
    if not hasattr(tokenizer, "encode_with_offsets"):  # no character ranges: piece by piece
        return _encode_segments(tokenizer, segments, train_on)
    text = "".join(piece for piece, _ in segments)
    ids, offsets = tokenizer.encode_with_offsets(text)
    trained_chars = np.zeros(len(text), dtype=bool)
    start = 0
    for piece, trained in segments:
        core = piece if exact_spans else piece.strip()
        if trained and core:
            first = start + (0 if exact_spans else len(piece) - len(piece.lstrip()))
            trained_chars[first : first + len(core)] = True
        start += len(piece)
    before = np.concatenate([[0], np.cumsum(trained_chars)])  # trained characters before each position
    ranges = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    targets = (before[ranges[:, 1]] > before[ranges[:, 0]]) | (train_on == "all")
    return SFTExample(np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=bool))


def encode_chat_prompt(
    messages: Sequence[dict], tokenizer: Tokenizer, *, template: ChatTemplate | None = None, tools: Any = None,
) -> list[int]:
    """Ids to generate the next assistant turn from: the conversation (with the function
    schemas `tools`) and the assistant header, tokenized as in `encode_chat`."""
    tools = check_tools(tools)
    if template is None:
        segments = _builtin_chat_segments(messages, tokenizer, add_generation_prompt=True, tools=tools)
        return [int(i) for i in _encode_segments(tokenizer, segments, "completion").ids]
    # the rendered prompt in one piece: nothing in it is trained, so no turn needs locating
    prompt = template.render(messages, add_generation_prompt=True, tools=tools)
    return [int(i) for i in _encode_rendered(tokenizer, [(prompt, False)], "completion").ids]
