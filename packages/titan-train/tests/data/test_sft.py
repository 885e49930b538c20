"""SFT data: loss masks, chat rendering, packing with boundaries, resume, dp split, JSONL, errors."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest
import torch
from titan.train.data import (
    ByteTokenizer,
    ChatTemplate,
    HFTokenizer,
    SFTDataConfig,
    SFTExample,
    build_sft_dataloader,
    encode_chat,
    encode_chat_prompt,
    encode_prompt,
    encode_prompt_completion,
    synthetic_eval_pairs,
    validate_sft_data_config,
)
from titan.train.data.sft import SFTPacker, SFTSource, SyntheticSFTTask

BOS, EOS, PAD = 256, 257, 258  # ByteTokenizer specials
SMALL_SYNTHETIC = dict(synthetic_examples=40, synthetic_eval_examples=8)


def _loader(cfg, *, rank=0, world=1, batch=2, seq_len=48, seed=0, tokenizer=None):
    return build_sft_dataloader(
        cfg,
        tokenizer or ByteTokenizer(),
        dp_rank=rank,
        dp_world_size=world,
        local_batch_size=batch,
        seq_len=seq_len,
        seed=seed,
    )


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b, strict=True):
        assert a.keys() == b.keys() == {"input_ids", "labels", "positions", "document_ids"}
        for key in a:
            assert torch.equal(a[key], b[key]), key


def _checkpoint_round_trip(state):
    """What a checkpoint does to the state: serialize, then load safely."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class ExampleList(SFTSource):
    """Hand-built examples with known ids and targets."""

    def __init__(self, examples):
        self.examples = examples

    def __len__(self):
        return len(self.examples)

    def example(self, index):
        return self.examples[index]


def _ex(ids, n_prompt):
    """An example whose first `n_prompt` ids are context and the rest targets."""
    ids = np.asarray(ids, dtype=np.int64)
    return SFTExample(ids, np.arange(len(ids)) >= n_prompt)


def _packer(examples, seq_len, **kw):
    opts = dict(pad_id=0, packing=True, overlong="drop", shuffle=False, seed=0)
    opts.update(kw)
    return SFTPacker(ExampleList(examples), seq_len=seq_len, **opts)


# --- loss mask ---------------------------------------------------------------------------


def test_prompt_completion_mask_counts_only_completion_tokens():
    tok = ByteTokenizer()
    ex = encode_prompt_completion("ab", "cd", tok)
    # BOS a b | c d EOS: "a"=97 ... hand-written, not derived from the code under test.
    assert ex.ids.tolist() == [BOS, 97, 98, 99, 100, EOS]
    assert ex.targets.tolist() == [False, False, False, True, True, True]

    row = _packer([ex], seq_len=8, pad_id=PAD).next_row()
    assert row["input_ids"].tolist() == [BOS, 97, 98, 99, 100, PAD, PAD, PAD]
    # Position t predicts token t+1; only c, d and EOS are targets.
    assert row["labels"].tolist() == [-100, -100, 99, 100, EOS, -100, -100, -100]
    assert int((row["labels"] != -100).sum()) == len("cd") + 1
    assert encode_prompt("ab", tok) == [BOS, 97, 98]  # what generation starts from


def test_a_prompt_that_starts_with_its_bos_token_keeps_one(hf_tokenizer_file):
    """A prompt rendered with its template's BOS ("<s>[INST] ...", as a chat template or vLLM
    user writes it) gets no second BOS: the model would see "<s><s>" it never met."""
    tok = HFTokenizer(hf_tokenizer_file)
    plain = encode_prompt("hello world", tok)
    assert plain[0] == tok.bos_id and plain[1] != tok.bos_id
    rendered = encode_prompt("<s>hello world", tok)
    assert rendered == plain
    example = encode_prompt_completion("<s>hello", " world", tok)
    assert example.ids.tolist()[:2] != [tok.bos_id, tok.bos_id]
    assert example.ids.tolist() == encode_prompt_completion("hello", " world", tok).ids.tolist()


def test_train_on_all_trains_every_next_token():
    ex = encode_prompt_completion("ab", "cd", ByteTokenizer(), train_on="all")
    row = _packer([ex], seq_len=5).next_row()
    assert row["labels"].tolist() == [97, 98, 99, 100, EOS]


def test_hf_tokenizer_without_bos_frames_like_pretraining(hf_tokenizer_file):
    tok = HFTokenizer(hf_tokenizer_file, bos_token="</s>")  # BOS == EOS: no leading BOS
    ex = encode_prompt_completion("the quick", " fox", tok)
    assert ex.ids.tolist() == tok.encode("the quick") + tok.encode(" fox") + [tok.eos_id]
    assert int(ex.targets.sum()) == len(tok.encode(" fox")) + 1


# --- chat rendering ----------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "2+2"},
    {"role": "assistant", "content": "4"},
]


def test_builtin_chat_template_and_multi_turn_mask():
    tok = ByteTokenizer()
    ex = encode_chat(CHAT, tok)
    expected_text = (
        "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nyo<|user|>\n2+2\n<|assistant|>\n4"
    )
    assert tok.decode(ex.ids) == expected_text
    ids = ex.ids.tolist()
    assert ids[0] == BOS and ids.count(EOS) == 2
    # Targets are exactly both assistant turns, each with its EOS; nothing else.
    targets = [i for i, t in zip(ids, ex.targets.tolist(), strict=True) if t]
    assert targets == list(b"yo") + [EOS] + list(b"4") + [EOS]
    # Position by position: hand-written pieces, each context then its trained answer.
    pieces = [
        ("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n", "yo"),
        ("<|user|>\n2+2\n<|assistant|>\n", "4"),
    ]
    mask = [False]  # BOS
    for context, answer in pieces:
        mask += [False] * len(context) + [True] * (len(answer) + 1)  # + EOS
    assert ex.targets.tolist() == mask
    prompt = encode_chat_prompt(CHAT[:4], tok)
    assert tok.decode(prompt).endswith("<|user|>\n2+2\n<|assistant|>\n")
    assert prompt == ids[: len(prompt)]  # generation sees what training saw


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tokenizer_chat_template_marks_assistant_turns(hf_tokenizer_file):
    (hf_tokenizer_file.parent / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "eos_token": "</s>", "bos_token": "<s>"})
    )
    template = ChatTemplate.from_tokenizer_files(str(hf_tokenizer_file.parent))
    assert template.segments(CHAT) == [
        ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
         "<|im_start|>assistant\n", False),
        ("yo<|im_end|>\n", True),
        ("<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n", False),
        ("4<|im_end|>\n", True),
    ]  # fmt: skip
    tok = HFTokenizer(hf_tokenizer_file)
    ex = encode_chat(CHAT, tok, template=template)
    trained = [i for i, t in zip(ex.ids.tolist(), ex.targets.tolist(), strict=True) if t]
    # the turn's text up to its end marker; the newline after it is the template's, not the answer's
    assert trained == tok.encode("yo<|im_end|>") + tok.encode("4<|im_end|>")


# The templates' shapes of common releases (Llama 3, ChatML as Qwen's, Mistral's [INST], a
# Vicuna-style one), shortened: where each turn's header ends and its content starts.
RELEASE_TEMPLATES = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>",
               "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
               " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    # Llama 3.1 and later: a system header with the date transformers' `strftime_now` gives.
    "llama3_1": ("<|begin_of_text|>", "<|eot_id|>",
                 "{{ bos_token }}{% if not date_string is defined %}{% if strftime_now is defined %}"
                 "{% set date_string = strftime_now('%d %b %Y') %}{% else %}{% set date_string = '26 Jul 2024' %}"
                 "{% endif %}{% endif %}{{ '<|start_header_id|>system<|end_header_id|>\n\nToday Date: ' + date_string"
                 " + '<|eot_id|>' }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
                 "'<|end_header_id|>\n\n' + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
    "chatml": ("<s>", "</s>", CHATML),
    "mistral": ("<s>", "</s>",
                "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
                "' [/INST]' }}{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% endif %}"
                "{% endfor %}"),
    "vicuna": ("<s>", "</s>",
               "{% for m in messages %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
               "{% elif m['role'] == 'assistant' %}{{ 'ASSISTANT: ' + m['content'] + eos_token + ' ' }}{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"),
}


def _gpt4_style_tokenizer(folder):
    """A byte-level BPE with Llama 3's / Qwen's pre-tokenizer split (words with their leading
    space, digits in threes, newlines apart), trained here, with the templates' specials."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    split = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(["Hello, how are you? I am fine: the answer is 42.\n\nSure! USER ASSISTANT INST"] * 20,
                            trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def _templated_tokenizer(folder, template: str, **special_tokens: str):
    """`_gpt4_style_tokenizer` in ``folder`` with ``template`` and the ``special_tokens``
    (bos_token=..., eos_token=...) in its tokenizer_config.json, and transformers' tokenizer
    of the same files with that template: (tokenizer.json path, reference)."""
    transformers = pytest.importorskip("transformers")
    path = _gpt4_style_tokenizer(folder)
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **special_tokens}))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), **special_tokens)
    reference.chat_template = template
    return path, reference


@pytest.mark.parametrize("release", list(RELEASE_TEMPLATES))
def test_chat_ids_are_transformers_apply_chat_template(tmp_path, monkeypatch, release):
    """A conversation encodes to the ids transformers' `apply_chat_template` gives it, and a
    prompt to its `add_generation_prompt=True` ids (what vLLM and `generate` are fed): the
    per-turn tokenization that locates the trained spans does not change the tokens. Both
    clocks read one fixed time, so the date a template writes is the same (and not 26 Jul
    2024, its fallback when `strftime_now` is missing)."""
    transformers = pytest.importorskip("transformers")
    from datetime import datetime

    import titan.train.data.chat as chat_module
    from transformers.utils import chat_template_utils

    fixed = datetime(2026, 12, 6, 10, 30)

    class FixedClock(datetime):
        @classmethod
        def now(cls, tz=None):
            return fixed

    monkeypatch.setattr(chat_template_utils, "datetime", FixedClock)
    monkeypatch.setattr(chat_module, "_TEMPLATE_CLOCK", fixed)
    bos, eos, source = RELEASE_TEMPLATES[release]
    path = _gpt4_style_tokenizer(tmp_path / "tok")
    (path.parent / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": source, "bos_token": bos, "eos_token": eos}))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token=bos, eos_token=eos)
    # non-ASCII text before a trained turn: token ranges count characters, not bytes
    chat = [{"role": "user", "content": "Hello, ¿cómo estás? 🤖"}, {"role": "assistant", "content": "I am fine: 42."},
            {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Sure! Hello ✓."}]
    tok, template = HFTokenizer(path), ChatTemplate.from_tokenizer_files(str(path.parent))

    ex = encode_chat(chat, tok, template=template)
    reference.chat_template = source
    expected = reference.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert ex.ids.tolist() == list(expected)
    if "strftime_now" in source:
        assert "Today Date: 06 Dec 2026" in tok.decode(ex.ids.tolist())
    prompt = encode_chat_prompt(chat[:3], tok, template=template)
    assert prompt == list(reference.apply_chat_template(chat[:3], tokenize=True, add_generation_prompt=True,
                                                        return_dict=False))
    trained = tok.decode([i for i, t in zip(ex.ids.tolist(), ex.targets.tolist(), strict=True) if t])
    assert trained.lstrip().startswith("I am fine: 42.") and "Sure! Hello ✓." in trained and "Hello" not in trained[:20]
    assert "USER" not in trained and "?" not in trained


# Qwen's shape for agents: reasoning in <think>, tool calls as JSON, tool results as user turns.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content }}\n</think>\n{% endif %}"
    "{% if m.content %}{{ m.content }}{% endif %}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}\n<tool_call>\n{{ c.function | tojson }}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
AGENT_CHAT = [
    {"role": "user", "content": "What is 42 in hex?"},
    {"role": "assistant", "content": None, "reasoning_content": "I should ask the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "hex", "arguments": {"n": 42}}}]},
    {"role": "tool", "name": "hex", "content": "0x2a"},
    {"role": "assistant", "content": "It is 0x2a.", "reasoning_content": "The tool answered."},
]
TOOLS = [{"type": "function", "function": {"name": "hex", "description": "n in hexadecimal",
                                           "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}}]


def test_tool_calls_reasoning_and_tool_results_render_as_transformers_renders_them(tmp_path):
    """Every key of a message reaches the template, as transformers passes it: reasoning,
    tool calls (an assistant turn of calls only has no content) and tool results. Their ids
    equal `apply_chat_template`'s (before, only role and content were kept: the reasoning and
    the calls were dropped without a word); the assistant's reasoning and calls are trained,
    the tool's result is not; the built-in template, which cannot write them, refuses."""
    pytest.importorskip("transformers")
    path, reference = _templated_tokenizer(tmp_path / "tok", TOOL_TEMPLATE, bos_token="<s>", eos_token="<|im_end|>")
    tok, template = HFTokenizer(path), ChatTemplate.from_tokenizer_files(str(path.parent))

    ex = encode_chat(AGENT_CHAT, tok, template=template)
    assert ex.ids.tolist() == list(reference.apply_chat_template(AGENT_CHAT, tokenize=True, return_dict=False))
    trained = tok.decode([i for i, t in zip(ex.ids.tolist(), ex.targets.tolist(), strict=True) if t])
    assert "I should ask the tool." in trained and '{"name": "hex", "arguments": {"n": 42}}' in trained
    assert "It is 0x2a." in trained and "<tool_response>" not in trained and "42 in hex" not in trained
    prompt = AGENT_CHAT[:3]
    assert encode_chat_prompt(prompt, tok, template=template) == list(
        reference.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False))

    # The row's function schemas (TRL's `tools` column, a list or its JSON string) are listed
    # by the template as `apply_chat_template(tools=...)` lists them; they are not trained.
    with_tools = reference.apply_chat_template(AGENT_CHAT, tools=TOOLS, tokenize=True, return_dict=False)
    for given in (TOOLS, json.dumps(TOOLS)):
        ex_tools = encode_chat(AGENT_CHAT, tok, template=template, tools=given)
        assert ex_tools.ids.tolist() == list(with_tools) and len(with_tools) > len(ex.ids)
        assert ex_tools.targets.sum() == ex.targets.sum()
    assert encode_chat_prompt(prompt, tok, template=template, tools=TOOLS) == list(
        reference.apply_chat_template(prompt, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                      return_dict=False))
    (tmp_path / "agent.jsonl").write_text(json.dumps({"messages": AGENT_CHAT, "tools": json.dumps(TOOLS)}) + "\n")
    cfg = SFTDataConfig(format="chat", path=str(tmp_path / "agent.jsonl"), chat_template="tokenizer",
                        cache_dir=str(tmp_path / "cache"))
    from titan.train.data.sft import build_sft_source

    assert build_sft_source(cfg, tok).example(0).ids.tolist() == list(with_tools)
    with pytest.raises(ValueError, match="the row lists 1 tools, which the built-in chat template does not render"):
        encode_chat(AGENT_CHAT[:1] + [{"role": "assistant", "content": "hi"}], tok, tools=TOOLS)
    with pytest.raises(ValueError, match="tools is a string that is not JSON"):
        encode_chat(AGENT_CHAT, tok, template=template, tools="[{")

    with pytest.raises(ValueError, match="message 1 holds the keys reasoning_content, tool_calls, which the built-in "
                                         "chat template does not render"):
        encode_chat(AGENT_CHAT, tok)
    with pytest.raises(ValueError, match="message 2 holds a tool result, which the built-in"):
        encode_chat_prompt([AGENT_CHAT[0], {**AGENT_CHAT[1], "reasoning_content": None, "tool_calls": None,
                                            "content": "call"}, {"role": "tool", "content": "0x2a"}], tok)
    # A role the template knows (OpenAI's `developer`) is the template's to render; the
    # built-in template has system, user and assistant only.
    developer = [{"role": "developer", "content": "Be brief."}, *AGENT_CHAT]
    assert encode_chat(developer, tok, template=template).ids.tolist() == list(
        reference.apply_chat_template(developer, tokenize=True, return_dict=False))
    with pytest.raises(ValueError, match="message 0 holds the role 'developer', which the built-in chat template"):
        encode_chat([{"role": "developer", "content": "x"}, {"role": "assistant", "content": "y"}], tok)
    with pytest.raises(ValueError, match="message 0 has role 7, not a name such as system"):
        encode_chat([{"role": 7, "content": "x"}, {"role": "assistant", "content": "y"}], tok, template=template)
    # Keys Arrow fills with None for rows that lack them hold nothing: the built-in template takes the row.
    plain = [{"role": "user", "content": "hi", "tool_calls": None}, {"role": "assistant", "content": "yo", "name": None}]
    assert encode_chat(plain, tok).ids.tolist() == encode_chat([{"role": "user", "content": "hi"},
                                                                {"role": "assistant", "content": "yo"}], tok).ids.tolist()


def test_chat_template_kwargs_are_template_variables_as_transformers_takes_them(tmp_path):
    """`--sft_data.chat_template_kwargs` (TRL's chat_template_kwargs): a JSON object of extra
    variables; the ids equal `apply_chat_template(**kwargs)`'s, and text rows (no template)
    refuse it."""
    pytest.importorskip("transformers")
    # The tokenizer's other special tokens are variables too, as transformers passes them.
    source = "{% if persona is defined %}{{ persona }}\n{% endif %}{{ pad_token }}" + CHATML
    path, reference = _templated_tokenizer(tmp_path / "tok", source, bos_token="<s>", eos_token="</s>",
                                           pad_token="<|eot_id|>")
    chat = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "I am fine."}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    from titan.train.data.sft import build_sft_source

    cfg = SFTDataConfig(format="chat", path=str(tmp_path / "chat.jsonl"), cache_dir=str(tmp_path / "cache"),
                        chat_template_kwargs='{"persona": "Sure!"}')
    ids = build_sft_source(cfg, HFTokenizer(path)).example(0).ids.tolist()
    assert ids == list(reference.apply_chat_template(chat, tokenize=True, return_dict=False, persona="Sure!"))
    from tokenizers import Tokenizer

    assert Tokenizer.from_file(str(path)).token_to_id("<|eot_id|>") in ids  # the pad token was rendered
    assert ids != list(reference.apply_chat_template(chat, tokenize=True, return_dict=False))

    (tmp_path / "pc.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    text_rows = SFTDataConfig(format="prompt_completion", path=str(tmp_path / "pc.jsonl"),
                              cache_dir=str(tmp_path / "cache"), chat_template_kwargs='{"persona": "x"}')
    with pytest.raises(ValueError, match="are text prompts and completions, rendered by no template"):
        build_sft_source(text_rows, HFTokenizer(path))
    with pytest.raises(ValueError, match="is not read by the built-in chat template"):
        SFTDataConfig(format="chat", path="x.jsonl", chat_template="builtin", chat_template_kwargs='{"persona": "x"}')
    with pytest.raises(ValueError, match="renders with the built-in one"):  # auto, and the byte tokenizer has none
        build_sft_source(dataclasses.replace(cfg), ByteTokenizer())


def test_chat_template_path_replaces_the_tokenizers_template_as_trl_sets_it(tmp_path, caplog):
    """`--sft_data.chat_template_path` (TRL's chat_template_path) renders with a template file,
    or the template of a tokenizer folder, in place of the tokenizer's own, with the run's
    tokenizer's special tokens: the ids equal transformers' `apply_chat_template` with that
    template (and differ from the tokenizer's own template's). Special-token spellings the
    tokenizer lacks are named in a warning; what cannot work is refused with the flag named."""
    pytest.importorskip("transformers")
    own = "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    path, reference = _templated_tokenizer(tmp_path / "tok", own, bos_token="<s>", eos_token="</s>")
    chatml = "{{ bos_token }}" + CHATML  # the run's tokenizer's BOS, as transformers gives it
    (tmp_path / "chatml.jinja").write_text(chatml)
    (tmp_path / "other_tok").mkdir()
    (tmp_path / "other_tok" / "chat_template.jinja").write_text(chatml)
    chat = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "I am fine."}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    from titan.train.data.sft import build_sft_source

    expected = list(reference.apply_chat_template(chat, chat_template=chatml, tokenize=True, return_dict=False))
    assert expected != list(reference.apply_chat_template(chat, tokenize=True, return_dict=False))
    for template_path in (tmp_path / "chatml.jinja", tmp_path / "other_tok"):
        cfg = SFTDataConfig(format="chat", path=str(tmp_path / "chat.jsonl"), cache_dir=str(tmp_path / "cache"),
                            chat_template_path=str(template_path))
        assert build_sft_source(cfg, HFTokenizer(path)).example(0).ids.tolist() == expected, template_path
    assert "does not have as one token" not in caplog.text

    (tmp_path / "odd.jinja").write_text("<|user|>{% for m in messages %}{{ m['content'] }}{% endfor %}<|im_end|>")
    odd = dataclasses.replace(cfg, chat_template_path=str(tmp_path / "odd.jinja"))
    with caplog.at_level("WARNING", logger="titan"):
        build_sft_source(odd, HFTokenizer(path))
    assert "writes <|user|>, which the tokenizer does not have as one token each" in caplog.text

    def refused(message, **kwargs):
        with pytest.raises(ValueError, match=message) as err:
            build_sft_source(dataclasses.replace(cfg, **kwargs), HFTokenizer(path))
        assert "\n" not in str(err.value)

    refused("chat_template_path .*missing.jinja: no such file or folder",
            chat_template_path=str(tmp_path / "missing.jinja"))
    (tmp_path / "empty_folder").mkdir()
    refused("the folder has no chat template", chat_template_path=str(tmp_path / "empty_folder"))
    with pytest.raises(ValueError, match="needs a Hugging Face tokenizer"):
        build_sft_source(cfg, ByteTokenizer())
    with pytest.raises(ValueError, match="drop one of the two"):
        dataclasses.replace(cfg, chat_template="builtin")
    with pytest.raises(ValueError, match="not read by --sft_data.format synthetic"):
        SFTDataConfig(chat_template_path=str(tmp_path / "chatml.jinja"))
    (tmp_path / "pc.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    text_rows = SFTDataConfig(format="prompt_completion", path=str(tmp_path / "pc.jsonl"),
                              cache_dir=str(tmp_path / "cache"), chat_template_path=str(tmp_path / "chatml.jinja"))
    with pytest.raises(ValueError, match="--sft_data.chat_template_path sets a chat template, and the rows"):
        build_sft_source(text_rows, HFTokenizer(path))


PARTS_CHATML = (  # renders content given as a list of parts with its text, as vision-language templates do
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_content_as_a_list_of_text_parts_reads_as_its_text(tmp_path):
    """OpenAI-style content (`[{"type": "text", "text": ...}]`, as many chat datasets hold it)
    encodes to the ids transformers' `apply_chat_template` gives with a template that renders
    such parts, and to the ids of the same text as a string under the built-in template; a
    part that is not text (an image) or an empty list is refused naming the row."""
    pytest.importorskip("transformers")
    path, reference = _templated_tokenizer(tmp_path / "tok", PARTS_CHATML, bos_token="<s>", eos_token="</s>")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "how are you?"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "I am fine."}]}]
    plain = [{"role": "user", "content": "Hello, how are you?"}, {"role": "assistant", "content": "I am fine."}]
    from titan.train.data.sft import build_sft_source

    def example(rows, **flags):
        (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
        cfg = SFTDataConfig(format="chat", path=str(tmp_path / "chat.jsonl"), **flags)
        return build_sft_source(cfg, HFTokenizer(path)).example(0)

    ex = example([parts])
    assert ex.ids.tolist() == list(reference.apply_chat_template(parts, tokenize=True, return_dict=False))
    assert ex.ids.tolist() == list(reference.apply_chat_template(plain, tokenize=True, return_dict=False))
    builtin = example([parts], chat_template="builtin")
    want = example([plain], chat_template="builtin")
    assert builtin.ids.tolist() == want.ids.tolist() and builtin.targets.tolist() == want.targets.tolist()
    image = [{"role": "user", "content": [{"type": "image", "text": None}, {"type": "text", "text": "what?"}]}, plain[1]]
    with pytest.raises(ValueError, match=r"row 0 \(the 1st\): message 0's content part 0 is a 'image' part, not"):
        example([image])
    with pytest.raises(ValueError, match="message 1 has an empty list of content parts"):
        example([[plain[0], {"role": "assistant", "content": []}]])


def test_chat_template_choice_errors_for_byte_tokenizer(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n")
    cfg = SFTDataConfig(
        format="chat", path=str(path), chat_template="tokenizer", cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(ValueError, match="--sft_data.chat_template builtin") as e:
        _loader(cfg)
    assert "\n" not in str(e.value)
    # auto falls back to the built-in template
    cfg = SFTDataConfig(format="chat", path=str(path), cache_dir=str(tmp_path / "c"))
    row = next(_loader(cfg, batch=1, seq_len=80))
    labels = row["labels"][0]
    assert labels[labels != -100].tolist() == list(b"yo") + [EOS] + list(b"4") + [EOS]


# --- packing -----------------------------------------------------------------------------


def test_packing_positions_document_ids_and_padding():
    examples = [_ex([1, 2, 3, 4], 2), _ex([5, 6, 7], 1), _ex([8, 9, 10, 11, 12], 3)]
    packer = _packer(examples, seq_len=8)
    row = packer.next_row()  # 3 + 2 positions fit; the third (4 positions) does not
    assert row["input_ids"].tolist() == [1, 2, 3, 5, 6, 0, 0, 0]
    assert row["labels"].tolist() == [-100, 3, 4, 6, 7, -100, -100, -100]
    assert row["positions"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    # The padding tail is id -1: negative ids are padding to an MoE's balancing statistics.
    assert row["document_ids"].tolist() == [0, 0, 0, 1, 1, -1, -1, -1]
    row = packer.next_row()  # the example that did not fit starts the next row
    assert row["input_ids"].tolist() == [8, 9, 10, 11, 1, 2, 3, 0]
    assert row["labels"].tolist() == [-100, -100, 11, 12, -100, 3, 4, -100]
    assert row["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert row["document_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, -1]
    assert packer.epoch == 1


def test_no_packing_puts_one_example_per_row():
    examples = [_ex([1, 2, 3], 1), _ex([4, 5, 6], 1)]
    packer = _packer(examples, seq_len=6, packing=False)
    rows = [packer.next_row() for _ in range(2)]
    assert [r["input_ids"].tolist() for r in rows] == [[1, 2, 0, 0, 0, 0], [4, 5, 0, 0, 0, 0]]
    assert all(r["document_ids"].tolist() == [0, 0, -1, -1, -1, -1] for r in rows)


def test_overlong_examples_are_dropped_and_counted_or_truncated():
    examples = [_ex([1, 2, 3], 1), _ex(list(range(10, 20)), 2), _ex([4, 5, 6], 1)]
    packer = _packer(examples, seq_len=4)
    assert packer.next_row()["input_ids"].tolist() == [1, 2, 4, 5]  # 10 tokens skipped
    assert packer.dropped == 1

    packer = _packer(examples, seq_len=4, overlong="truncate")
    packer.next_row()
    row = packer.next_row()
    assert row["input_ids"].tolist() == [10, 11, 12, 13]
    assert row["labels"].tolist() == [-100, 12, 13, 14] and packer.dropped == 0
    # Truncated down to prompt only: nothing to train on, so dropped after all.
    packer = _packer([examples[0], _ex(list(range(10, 20)), 8)], seq_len=4, overlong="truncate")
    assert packer.next_row()["input_ids"].tolist() == [1, 2, 1, 2]  # epochs 0 and 1
    assert packer.dropped == 2  # counted on each visit


def test_nothing_fits_is_one_clear_error():
    packer = _packer([_ex(list(range(10)), 2)], seq_len=4)
    with pytest.raises(ValueError, match="none of the 1 SFT examples fits in seq_len 4 .*raise --training.seq_len") as e:
        packer.next_row()
    assert "\n" not in str(e.value)


# --- the loader: epochs, resume, data parallel ---------------------------------------------


def test_batches_cover_every_example_once_per_epoch():
    cfg = SFTDataConfig(**SMALL_SYNTHETIC)
    task = SyntheticSFTTask(cfg, ByteTokenizer())
    expected = sorted(p + a for p, a in task.train_pairs)
    loader = _loader(cfg, batch=1, seq_len=40)
    seen = []
    while loader.epoch == 0:
        batch = next(loader)
        ids, docs = batch["input_ids"][0], batch["document_ids"][0]
        for d in docs.unique().tolist():
            text = ByteTokenizer().decode(ids[docs == d].tolist())
            if text:
                seen.append(text)
    assert sorted(seen) == expected  # each once (the pending one moved to epoch 1 at most)


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("n_before", [0, 3, 25])  # 25 crosses epochs
def test_resume_yields_exactly_the_next_batches(packing, n_before):
    cfg = SFTDataConfig(**SMALL_SYNTHETIC, packing=packing)
    original = _loader(cfg, rank=1, world=2, seed=3)
    _take(original, n_before)
    state = _checkpoint_round_trip(original.state_dict())
    expected = _take(original, 4)

    resumed = _loader(cfg, rank=1, world=2, seed=3)
    resumed.load_state_dict(state)
    _assert_same(_take(resumed, 4), expected)
    if n_before == 25:
        assert state["epoch"] >= 1


def test_resume_under_another_data_parallel_degree():
    cfg = SFTDataConfig(**SMALL_SYNTHETIC)
    ranks = [_loader(cfg, rank=r, world=2, batch=2) for r in range(2)]
    for loader in ranks:
        _take(loader, 5)
    states = [loader.state_dict() for loader in ranks]
    assert states[0] == states[1]  # one global record
    expected = [torch.cat([next(r)[k] for r in ranks]) for k in ("input_ids",)]
    single = _loader(cfg, rank=0, world=1, batch=4)
    single.load_state_dict(_checkpoint_round_trip(states[0]))
    assert torch.equal(next(single)["input_ids"], expected[0])


def test_dp_ranks_see_disjoint_rows_whose_union_is_the_single_rank_batch():
    cfg = SFTDataConfig(**SMALL_SYNTHETIC)
    single = _loader(cfg, world=1, batch=4)
    ranks = [_loader(cfg, rank=r, world=2, batch=2) for r in range(2)]
    for _ in range(3):
        whole = next(single)
        parts = [next(r) for r in ranks]
        for key in whole:
            assert torch.equal(torch.cat([p[key] for p in parts]), whole[key])
        assert not torch.equal(parts[0]["input_ids"], parts[1]["input_ids"])


def test_resume_refuses_another_seq_len():
    cfg = SFTDataConfig(**SMALL_SYNTHETIC)
    state = _loader(cfg, seq_len=48).state_dict()
    with pytest.raises(ValueError, match="--training.seq_len"):
        _loader(cfg, seq_len=64).load_state_dict(state)


# --- the synthetic task ------------------------------------------------------------------


def test_synthetic_task_is_deterministic_short_and_held_out():
    cfg = SFTDataConfig(
        synthetic_task="reverse", synthetic_examples=500, synthetic_eval_examples=50
    )
    task = SyntheticSFTTask(cfg, ByteTokenizer())
    held_out = synthetic_eval_pairs(cfg)
    assert held_out == task.eval_pairs == SyntheticSFTTask(cfg, ByteTokenizer()).eval_pairs
    assert len(held_out) == 50 and len(task.train_pairs) == 500
    assert not {p for p, _ in held_out} & {p for p, _ in task.train_pairs}
    for prompt, answer in held_out + task.train_pairs:
        letters = prompt.removeprefix("reverse: ").removesuffix("\n")
        assert answer == letters[::-1] and len((prompt + answer).encode()) < 32
    # More training examples leave the held-out set unchanged.
    bigger = SFTDataConfig(
        synthetic_task="reverse", synthetic_examples=900, synthetic_eval_examples=50
    )
    assert synthetic_eval_pairs(bigger) == held_out
    sort = synthetic_eval_pairs(SFTDataConfig(synthetic_task="sort"))
    assert all(a == "".join(sorted(p[len("sort: ") : -1])) for p, a in sort)


# --- JSONL files through datasets --------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_prompt_completion_jsonl_through_datasets(tmp_path):
    rows = [{"prompt": f"q{i}?", "completion": f"a{i}", "id": i} for i in range(6)]
    path = _write_jsonl(tmp_path / "pc.jsonl", rows)
    cfg = SFTDataConfig(
        format="prompt_completion", path=str(path), shuffle=False, cache_dir=str(tmp_path / "c")
    )
    validate_sft_data_config(cfg)
    batch = next(_loader(cfg, batch=1, seq_len=64))
    tok = ByteTokenizer()
    expected_ids = []
    for r in rows:
        expected_ids += tok.encode(r["prompt"] + r["completion"], bos=True, eos=True)[:-1]
    n = len(expected_ids)
    assert batch["input_ids"][0, :n].tolist() == expected_ids
    labels = batch["labels"][0, :n]  # the rest of the row is the next epoch's start
    targets = labels[labels != -100].tolist()
    assert targets == [t for r in rows for t in tok.encode(r["completion"], eos=True)]


def test_text_rows_train_every_token_as_pretraining_frames_a_document(tmp_path):
    """`--sft_data.format text` (TRL's language-modeling datasets, `dataset_text_field`): each
    row is `[BOS] text EOS` with every token after BOS a target; templates are refused, and a
    row whose text is not a string is named."""
    from titan.train.data.sft import build_sft_source

    path = _write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}, {"text": "bye"}])
    cfg = SFTDataConfig(format="text", path=str(path), cache_dir=str(tmp_path / "c"))
    ex = build_sft_source(cfg, ByteTokenizer()).example(0)
    assert ex.ids.tolist() == [BOS, *b"hello world", EOS]
    assert ex.targets.tolist() == [False] + [True] * (len("hello world") + 1)
    for flags, message in [({"chat_template": "builtin"}, "not read by --sft_data.format text"),
                           ({"chat_template_kwargs": '{"a": 1}'}, "not read by --sft_data.format text"),
                           ({"chat_template_path": "t.jinja"}, "not read by --sft_data.format text"),
                           ({"messages_field": "conv"}, "--sft_data.messages_field 'conv' is not read")]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(cfg, **flags)
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine"}, {"text": 3}])
    with pytest.raises(ValueError, match=r"row 1 \(the 2nd\): 'text' holds int, not a string"):
        build_sft_source(dataclasses.replace(cfg, path=str(bad)), ByteTokenizer()).example(1)


def test_format_auto_reads_the_layout_from_the_columns_as_trl_does(tmp_path, caplog):
    """Without --sft_data.format, a path's columns name its format (messages: chat; prompt and
    completion: prompt_completion; text: text), and the examples equal those of the format
    given by hand; renamed columns count; no known column is one error listing the columns; a
    flag the told format does not read is refused as if the format were given; no path is the
    synthetic task."""
    from titan.train.data.sft import build_sft_source

    layouts = {
        "chat": ({"messages": CHAT}, {}),
        "prompt_completion": ({"prompt": "2+2=", "completion": "4"}, {}),
        "text": ({"text": "plain words"}, {}),
    }
    tok = ByteTokenizer()
    for fmt, (row, flags) in layouts.items():
        path = _write_jsonl(tmp_path / f"{fmt}.jsonl", [row])
        auto = SFTDataConfig(path=str(path), cache_dir=str(tmp_path / "c"), **flags)
        assert auto.format == "auto" and auto.resolved_format == "auto"
        given = SFTDataConfig(format=fmt, path=str(path), cache_dir=str(tmp_path / "c"), **flags)
        with caplog.at_level("INFO", logger="titan"):
            got, want = build_sft_source(auto, tok).example(0), build_sft_source(given, tok).example(0)
        assert got.ids.tolist() == want.ids.tolist() and got.targets.tolist() == want.targets.tolist(), fmt
        assert f"--sft_data.format auto reads it as {fmt}" in caplog.text
    renamed = _write_jsonl(tmp_path / "qa.jsonl", [{"question": "2+2=", "answer": "4"}])
    qa = SFTDataConfig(path=str(renamed), prompt_field="question", completion_field="answer",
                       cache_dir=str(tmp_path / "c"))
    assert build_sft_source(qa, tok).example(0).ids.tolist() == [BOS, *b"2+2=4", EOS]
    unknown = _write_jsonl(tmp_path / "u.jsonl", [{"question": "q", "response": "r"}])
    with pytest.raises(ValueError, match="finds no column it knows \\(columns: question, response\\)"):
        build_sft_source(SFTDataConfig(path=str(unknown), cache_dir=str(tmp_path / "c")), tok)
    text = _write_jsonl(tmp_path / "t2.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match="chat_template_kwargs .* is not read by --sft_data.format text"):
        build_sft_source(SFTDataConfig(path=str(text), cache_dir=str(tmp_path / "c"),
                                       chat_template_kwargs='{"a": 1}'), tok)
    assert SFTDataConfig().resolved_format == "synthetic"
    with pytest.raises(ValueError, match="--sft_data.format auto reads JSONL files: set --sft_data.path"):
        SFTDataConfig(eval_path="held_out.jsonl")


def test_conversational_prompt_completion_trains_only_the_completion(tmp_path):
    """TRL's conversational prompt-completion rows (both columns lists of messages): the
    conversation is rendered whole, and only the completion's assistant turn is trained, not
    the few-shot answer inside the prompt."""
    prompt = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
              {"role": "user", "content": "3+3?"}]
    path = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": [{"role": "assistant", "content": "6"}]}])
    cfg = SFTDataConfig(format="prompt_completion", path=str(path), shuffle=False, cache_dir=str(tmp_path / "c"))
    batch = next(_loader(cfg, batch=1, seq_len=64))
    tok = ByteTokenizer()
    whole = [*prompt, {"role": "assistant", "content": "6"}]
    expected = encode_chat(whole, tok)
    n = len(expected) - 1
    assert batch["input_ids"][0, :n].tolist() == expected.ids[:-1].tolist()  # the same tokens as the chat format
    labels = batch["labels"][0, :n]
    assert labels[labels != -100].tolist() == list(b"6") + [EOS]  # the few-shot "4" is context
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": prompt, "completion": "6"}])
    with pytest.raises(ValueError, match=r"row 0 \(the 1st\): prompt and completion must both be strings, or both lists"):
        next(_loader(SFTDataConfig(format="prompt_completion", path=str(bad), cache_dir=str(tmp_path / "c2")), batch=1))


def test_chat_jsonl_glob_through_datasets(tmp_path):
    folder = tmp_path / "chats"
    folder.mkdir()
    _write_jsonl(folder / "a.jsonl", [{"messages": CHAT}])
    _write_jsonl(folder / "b.jsonl", [{"messages": CHAT[1:3]}])
    cfg = SFTDataConfig(
        format="chat", path=str(folder / "*.jsonl"), shuffle=False, cache_dir=str(tmp_path / "c")
    )
    batch = next(_loader(cfg, batch=1, seq_len=128))
    labels = batch["labels"][0]
    turns = ["yo", "4", "yo"]  # a.jsonl's two assistant turns, then b.jsonl's one
    assert labels[labels != -100].tolist() == [t for a in turns for t in list(a.encode()) + [EOS]]
    assert batch["document_ids"][0].unique().tolist() == [-1, 0, 1]  # two examples, then padding


# --- errors: one line naming the flag and the fix ----------------------------------------


def _one_line(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_missing_file_names_the_flag(tmp_path):
    cfg = SFTDataConfig(format="prompt_completion", path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError) as e:
        validate_sft_data_config(cfg)
    _one_line(e, "--sft_data.path", "fix the path")
    with pytest.raises(FileNotFoundError) as e:
        _loader(cfg)
    _one_line(e, "--sft_data.path")


def test_rows_without_the_needed_keys(tmp_path):
    path = _write_jsonl(tmp_path / "x.jsonl", [{"question": "q", "answer": "a"}])
    cfg = SFTDataConfig(format="prompt_completion", path=str(path), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError) as e:
        _loader(cfg)
    _one_line(e, "--sft_data.path", "'prompt'", "question", "--sft_data.prompt_field")
    cfg = SFTDataConfig(format="chat", path=str(path), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError) as e:
        _loader(cfg)
    _one_line(e, "'messages'", "--sft_data.format")


def test_bad_chat_row_names_the_row(tmp_path):
    rows = [{"messages": CHAT}, {"messages": [{"role": "user", "content": "only a question"}]}]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = SFTDataConfig(format="chat", path=str(path), shuffle=False, cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError) as e:
        _take(_loader(cfg, batch=1, seq_len=128), 2)
    _one_line(e, "row 1", "no assistant message", "--sft_data.format chat")


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(format="chat"), "--sft_data.path"),
        (dict(format="synthetic", path="x.jsonl"), "--sft_data.path"),
        (dict(format="csv"), "--sft_data.format"),
        (dict(train_on="prompt"), "--sft_data.train_on"),
        (dict(synthetic_min_len=5, synthetic_max_len=3), "--sft_data.synthetic_max_len"),
        (dict(synthetic_alphabet=2, synthetic_max_len=3), "--sft_data.synthetic_examples"),
        # Columns and templates the format does not read: refused, not ignored.
        (dict(format="chat", path="x.jsonl", prompt_field="question"), "--sft_data.prompt_field 'question' is not read"),
        (dict(format="prompt_completion", path="x.jsonl", messages_field="conversation"), "--sft_data.messages_field"),
        (dict(format="synthetic", completion_field="answer"), "--sft_data.completion_field"),
        (dict(format="synthetic", chat_template="tokenizer"), "--sft_data.chat_template tokenizer is not read"),
        (dict(packing_strategy="bfd", packing=False), "--sft_data.packing_strategy bfd packs several examples"),
        (dict(packing_window=64), "--sft_data.packing_window 64 is read by --sft_data.packing_strategy bfd only"),
        (dict(packing_strategy="bfd", packing_window=0), "--sft_data.packing_window must be >= 1"),
    ],
)
def test_config_errors_name_the_flag(kwargs, needle):
    with pytest.raises(ValueError) as e:
        SFTDataConfig(**kwargs)
    _one_line(e, needle)


def test_held_out_batches_score_every_example_once_on_any_data_parallel_degree():
    """Validation's pass over the held-out examples: each once (no wrap into a second epoch),
    the last global microbatch padded, and every data-parallel rank yields as many batches."""
    from titan.train.data.sft import held_out_sft_batches

    cfg = SFTDataConfig(format="synthetic", synthetic_eval_examples=13, **{
        k: v for k, v in SMALL_SYNTHETIC.items() if k != "synthetic_eval_examples"})
    tok = ByteTokenizer()
    task = SyntheticSFTTask(cfg, tok)
    expected = sum(int(encode_prompt_completion(p, a, tok).targets[1:].sum()) for p, a in task.eval_pairs)
    for world in (1, 2):
        per_rank = [list(held_out_sft_batches(cfg, tok, dp_rank=r, dp_world_size=world, local_batch_size=2,
                                              seq_len=24, seed=0)) for r in range(world)]
        assert len({len(batches) for batches in per_rank}) == 1
        labelled = sum(int((b["labels"] != -100).sum()) for batches in per_rank for b in batches)
        assert labelled == expected, (world, labelled, expected)


def test_parquet_examples_read_like_jsonl(tmp_path):
    """SFT rows from Parquet (the Hub's datasets ship it) read like the same rows in JSONL."""
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"q{i}?", "completion": f"a{i}"} for i in range(5)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pc.parquet"))
    jsonl = _write_jsonl(tmp_path / "pc.jsonl", rows)

    def first_batch(path):
        cfg = SFTDataConfig(format="prompt_completion", path=str(path), shuffle=False,
                            cache_dir=str(tmp_path / f"c_{path.suffix[1:]}"))
        validate_sft_data_config(cfg)
        return next(_loader(cfg, batch=1, seq_len=64))

    from_parquet, from_jsonl = first_batch(tmp_path / "pc.parquet"), first_batch(jsonl)
    assert all(torch.equal(from_parquet[k], from_jsonl[k]) for k in from_jsonl)


# ChatML with transformers' {% generation %} tags (as TRL-ready templates carry them), and
# Qwen3-style: the reasoning of earlier assistant turns is dropped when a later turn follows,
# so a conversation does not render as a prefix of its continuation.
GENERATION_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% if loop.last %}{% set content = m['content'] %}{% else %}{% set content = m['content'].split('</think>')[-1] %}"
    "{% endif %}{% generation %}{{ content + '<|im_end|>\\n' }}{% endgeneration %}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_generation_tags_mark_the_trained_tokens_as_transformers_assistant_mask(tmp_path):
    """A template with `{% generation %}` blocks says what is trained: titan's targets are
    transformers' `return_assistant_tokens_mask` and its ids transformers' ids, also for a
    template that rewrites earlier turns (refused by the prefix rule before)."""
    transformers = pytest.importorskip("transformers")
    path = _gpt4_style_tokenizer(tmp_path / "tok")
    (path.parent / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": GENERATION_TEMPLATE, "bos_token": "<s>", "eos_token": "<|im_end|>"}))
    chat = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "<think>hm</think>I am fine."},
            {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "<think>yes</think>Sure!"}]
    tok, template = HFTokenizer(path), ChatTemplate.from_tokenizer_files(str(path.parent))
    assert template.marks_generation
    example = encode_chat(chat, tok, template=template)

    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")
    reference.chat_template = GENERATION_TEMPLATE
    expected = reference.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert example.ids.tolist() == expected["input_ids"]
    assert example.targets.astype(int).tolist() == expected["assistant_masks"]
    trained = tok.decode([i for i, t in zip(example.ids.tolist(), example.targets.tolist(), strict=True) if t])
    assert trained == "I am fine.\n<think>yes</think>Sure!\n"  # the first turn's reasoning was dropped by the template

    # conversational prompt-completion: only the completion's block is trained
    completion_only = encode_chat(chat, tok, template=template, trained_from=3)
    only = tok.decode([i for i, t in zip(completion_only.ids.tolist(), completion_only.targets.tolist(), strict=True)
                       if t])
    assert only == "<think>yes</think>Sure!\n"  # the block's newline too, as in transformers' mask
    assert encode_chat_prompt(chat[:3], tok, template=template) == reference.apply_chat_template(
        chat[:3], tokenize=True, add_generation_prompt=True, return_dict=False)


def test_held_out_examples_too_long_to_score_are_reported(caplog):
    from titan.train.data.sft import held_out_sft_batches

    cfg = SFTDataConfig(format="synthetic", synthetic_eval_examples=6, synthetic_min_len=3, synthetic_max_len=12,
                        **{k: v for k, v in SMALL_SYNTHETIC.items() if k != "synthetic_eval_examples"})
    with caplog.at_level("WARNING", logger="titan"):
        list(held_out_sft_batches(cfg, ByteTokenizer(), dp_rank=0, dp_world_size=1, local_batch_size=2, seq_len=16,
                                  seed=0))
    task = SyntheticSFTTask(cfg, ByteTokenizer())
    too_long = sum(len(encode_prompt_completion(p, a, ByteTokenizer())) - 1 > 16 for p, a in task.eval_pairs)
    assert too_long > 0  # the test shows something
    assert f"{too_long} of the 6 held-out SFT examples do not fit --training.seq_len 16" in caplog.text


def test_a_downloaded_hub_dataset_folder_gives_its_train_split_and_holds_out_its_test_split(tmp_path):
    """A folder as `huggingface-cli download` leaves a Hub dataset (data/train-*.parquet,
    data/test-*.parquet): training reads the train split only, the held-out path the test
    split (every file of the folder, both splits mixed, was read before)."""
    datasets = pytest.importorskip("datasets")
    from titan.train.data.records import resolve_record_files

    (tmp_path / "hub" / "data").mkdir(parents=True)
    for split, n in (("train", 5), ("test", 2)):
        datasets.Dataset.from_list([{"prompt": f"{split}{i}", "completion": "x"} for i in range(n)]).to_parquet(
            str(tmp_path / "hub" / "data" / f"{split}-00000-of-00001.parquet"))
    folder = str(tmp_path / "hub")
    kind, files = resolve_record_files(folder)
    assert kind == "parquet" and [f.rsplit("/", 1)[1] for f in files] == ["train-00000-of-00001.parquet"]
    _, held = resolve_record_files(folder, flag="--sft_data.eval_path", held_out=True)
    assert [f.rsplit("/", 1)[1] for f in held] == ["test-00000-of-00001.parquet"]

    cfg = SFTDataConfig(format="prompt_completion", path=folder, eval_path=folder, shuffle=False,
                        cache_dir=str(tmp_path / "c"))
    validate_sft_data_config(cfg)
    from titan.train.data.sft import build_sft_source

    assert len(build_sft_source(cfg, ByteTokenizer())) == 5
    assert len(build_sft_source(cfg, ByteTokenizer(), held_out=True)) == 2

    plain = tmp_path / "plain"  # no split names: every file, as before
    plain.mkdir()
    _write_jsonl(plain / "a.jsonl", [{"prompt": "p", "completion": "c"}])
    _write_jsonl(plain / "b.jsonl", [{"prompt": "p", "completion": "c"}])
    assert len(resolve_record_files(str(plain))[1]) == 2
    no_train = tmp_path / "no_train"
    no_train.mkdir()
    _write_jsonl(no_train / "validation.jsonl", [{"prompt": "p", "completion": "c"}])
    _write_jsonl(no_train / "test.jsonl", [{"prompt": "p", "completion": "c"}])
    assert resolve_record_files(str(no_train), held_out=True)[1] == [str(no_train / "validation.jsonl")]
    with pytest.raises(ValueError, match="splits test, validation and has no train split"):
        resolve_record_files(str(no_train))


# --- best-fit decreasing packing ------------------------------------------------------------


def test_best_fit_decreasing_by_hand():
    """Longest first, each into the bin it fills best: [5, 5, 3, 3] in rows of 8 take 2 rows
    (in order, greedily: [5], [5, 3], [3]); [5, 4, 3, 3, 2, 2, 1]: 5 opens row 0, 4 row 1, the
    first 3 fills row 0 (room 3), the second goes to row 1 (room 4), the 2s open row 2, the 1
    fills row 1's last cell."""
    from titan.train.data.packing import best_fit_decreasing

    assert best_fit_decreasing([5, 5, 3, 3], 8) == [[0, 2], [1, 3]]
    assert best_fit_decreasing([5, 4, 3, 3, 2, 2, 1], 8) == [[0, 2], [1, 3, 6], [4, 5]]
    assert best_fit_decreasing([], 8) == []
    with pytest.raises(ValueError, match="does not fit"):
        best_fit_decreasing([9], 8)


def _row_examples(row) -> list[list[int]]:
    """The examples of a packed row, as their input ids (one list per document id)."""
    ids, docs = row["input_ids"], row["document_ids"]
    return [ids[docs == d].tolist() for d in sorted(set(docs.tolist()) - {-1})]


def _mixed_examples(n=23, seed=0):
    """Examples of 3 to 12 tokens (each id list unique: its first id is its index)."""
    rng = np.random.default_rng(seed)
    return [_ex([i + 1, *rng.integers(1, 50, int(rng.integers(2, 12))).tolist()], 1) for i in range(n)]


def test_bfd_rows_hold_every_example_once_per_epoch_with_less_padding():
    """Windows of 7 examples: every example of an epoch lands in exactly one row, whole; the
    rows are fewer than greedy packing's (measured here: 13 vs 14 rows of 16 for 23 examples)."""
    examples = _mixed_examples()
    rows_of = {}
    for strategy in ("greedy", "bfd"):
        packer = _packer(examples, 16, strategy=strategy, window=7)
        rows = []
        while packer.epoch == 0:
            rows.append(packer.next_row())
        placed = sorted(tuple(e) for row in rows for e in _row_examples(row))
        assert placed == sorted(tuple(e.ids[:-1].tolist()) for e in examples), strategy
        rows_of[strategy] = len(rows)
    assert rows_of["bfd"] < rows_of["greedy"], rows_of


@pytest.mark.parametrize("window", [1, 5, 23, 100])
def test_bfd_resumes_at_every_row_with_the_next_rows(window):
    """The position after any row (inside a window, at its end, across the epoch's end)
    gives a fresh packer the same next rows, shuffled by a seed."""
    examples = _mixed_examples()
    reference = _packer(examples, 16, strategy="bfd", window=window, shuffle=True, seed=5)
    states, rows = [], []
    for _ in range(30):  # past the first epoch
        states.append(reference.state_dict())
        rows.append(reference.next_row())
    for k in range(0, 30, 3):
        resumed = _packer(examples, 16, strategy="bfd", window=window, shuffle=True, seed=5)
        resumed.load_state_dict(_checkpoint_round_trip(states[k]))
        for row in rows[k : k + 3]:
            got = resumed.next_row()
            assert all(np.array_equal(got[key], row[key]) for key in row), (window, k)


def test_bfd_counts_dropped_examples_and_scores_a_single_pass_once():
    """An overlong example is dropped and counted once per epoch; a single pass (held-out
    scoring) yields each usable example once, then padding rows."""
    examples = [*_mixed_examples(9), _ex(list(range(1, 30)), 1)]
    packer = _packer(examples, 16, strategy="bfd", window=4)
    packer.single_pass = True
    placed = []
    while not packer.exhausted:
        placed += _row_examples(packer.next_row())
    assert len(placed) == 9 and packer.dropped == 1
    assert _row_examples(packer.next_row()) == []


@pytest.mark.parametrize("strategy,packing", [("greedy", True), ("bfd", True)])
def test_loader_resumes_either_strategy_and_refuses_the_other(strategy, packing):
    window = {"packing_window": 5} if strategy == "bfd" else {}
    cfg = SFTDataConfig(**SMALL_SYNTHETIC, packing=packing, packing_strategy=strategy, **window)
    original = _loader(cfg, rank=1, world=2, seed=3)
    _take(original, 7)
    state = _checkpoint_round_trip(original.state_dict())
    expected = _take(original, 3)
    resumed = _loader(cfg, rank=1, world=2, seed=3)
    resumed.load_state_dict(state)
    _assert_same(_take(resumed, 3), expected)
    other = "greedy" if strategy == "bfd" else "bfd"
    with pytest.raises(ValueError, match="--sft_data.packing_strategy"):
        _loader(SFTDataConfig(**SMALL_SYNTHETIC, packing_strategy=other), rank=1, world=2, seed=3).load_state_dict(state)
    if strategy == "greedy":  # a state saved before strategies existed was greedy
        old = {k: v for k, v in state.items() if k not in ("packing_strategy", "packing_window", "emitted")}
        _loader(cfg, rank=1, world=2, seed=3).load_state_dict(old)


def test_a_bad_row_is_named_by_its_index_and_its_place():
    """Errors named "row 6" (an index from 0), which a user looked for on line 6 of the JSONL
    file; the place from 1 is said too."""
    from titan.train.data.records import row_name

    assert [row_name(i) for i in (0, 1, 2, 3, 6, 10, 11, 12, 20, 101, 110)] == [
        "row 0 (the 1st)", "row 1 (the 2nd)", "row 2 (the 3rd)", "row 3 (the 4th)", "row 6 (the 7th)",
        "row 10 (the 11th)", "row 11 (the 12th)", "row 12 (the 13th)", "row 20 (the 21st)", "row 101 (the 102nd)",
        "row 110 (the 111th)"]
