"""RL prompts: the synthetic task, the warm-up's fixed set of demonstrations, JSONL rows of
text or of conversations (TRL's conversational format) rendered with the chat template."""

from __future__ import annotations

import json

import pytest
from titan.rl.data import RLDataConfig, build_prompts
from titan.train.data.chat import encode_chat_prompt, encode_prompt
from titan.train.data.sft import SyntheticSFTTask
from titan.train.data.tokenizer import ByteTokenizer, HFTokenizer


def test_warm_up_demonstrations_are_the_first_training_prompts_and_keep_the_held_out_set():
    tokenizer = ByteTokenizer()
    cfg = RLDataConfig(sft_demonstrations=16)
    train, held_out = build_prompts(cfg, tokenizer)
    demos = SyntheticSFTTask(cfg.sft_config(demonstrations_only=True), tokenizer)
    assert len(train) == cfg.synthetic_examples and len(demos) == 16
    assert demos.train_pairs == [(p.text, p.answer) for p in train[:16]]
    assert demos.eval_pairs == [(p.text, p.answer) for p in held_out]
    # 0: the warm-up sees every training prompt.
    assert len(SyntheticSFTTask(RLDataConfig().sft_config(demonstrations_only=True), tokenizer)) == len(train)
    with pytest.raises(ValueError, match="--rl_data.sft_demonstrations"):
        RLDataConfig(sft_demonstrations=cfg.synthetic_examples + 1)


# ---- JSONL prompts --------------------------------------------------------------------

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2+2?"}]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _chatml_tokenizer(folder):
    """A tiny byte-level BPE with ChatML's specials and template (as Qwen's files carry)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["What is 2+2? Answer with a number. system user assistant"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None}))
    return folder / "tokenizer.json"


def test_a_prompt_file_needs_no_format_flag():
    """--rl_data.format auto: a path (or held-out path) means prompt rows, none the synthetic task."""
    assert RLDataConfig(path="p.jsonl").resolved_format == "jsonl"
    assert RLDataConfig(eval_path="e.jsonl", path="p.jsonl").resolved_format == "jsonl"
    assert RLDataConfig().resolved_format == "synthetic"
    with pytest.raises(ValueError, match="--rl_data.path / --rl_data.eval_path are not read by --rl_data.format synthetic"):
        RLDataConfig(format="synthetic", path="p.jsonl")


def test_jsonl_text_prompts_are_encoded_as_sft_prompts(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "abc", "answer": 3}, {"prompt": "de"}])
    tokenizer = ByteTokenizer()
    train, held_out = build_prompts(RLDataConfig(format="jsonl", path=path), tokenizer)
    assert [(p.text, p.ids, p.answer) for p in train] == [
        ("abc", encode_prompt("abc", tokenizer), "3"), ("de", encode_prompt("de", tokenizer), None)]
    assert held_out == []


def test_conversational_prompts_are_transformers_apply_chat_template(tmp_path):
    """TRL's conversational format: a prompt of messages is rendered with the tokenizer's
    chat template and the assistant header, into the ids transformers gives it (what the
    instruct model was tuned on); the rewards see the rendered text."""
    transformers = pytest.importorskip("transformers")
    tokenizer_file = _chatml_tokenizer(tmp_path / "tok")
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": CONVERSATION, "answer": "4"}])
    train, _ = build_prompts(RLDataConfig(format="jsonl", path=path), HFTokenizer(tokenizer_file))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|im_end|>")
    reference.chat_template = CHATML
    expected = reference.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert train[0].ids == list(expected)
    assert train[0].text == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 2+2?"
                             "<|im_end|>\n<|im_start|>assistant\n")
    assert train[0].answer == "4"


TOOLS_CHATML = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
                "{% endif %}" + CHATML)
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_a_rows_tools_are_listed_in_its_prompt_as_transformers_lists_them(tmp_path):
    """TRL's `tools` column (here a JSON string, as datasets often store it) reaches the chat
    template as `apply_chat_template(tools=...)` gives it; a text prompt cannot list tools and
    is refused rather than prompted without them."""
    transformers = pytest.importorskip("transformers")
    tokenizer_file = _chatml_tokenizer(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_CHATML}))
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": CONVERSATION, "answer": "4", "tools": json.dumps(TOOLS)}])
    train, _ = build_prompts(RLDataConfig(format="jsonl", path=path), HFTokenizer(tokenizer_file))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|im_end|>")
    reference.chat_template = TOOLS_CHATML
    expected = reference.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                             return_dict=False)
    assert train[0].ids == list(expected) and train[0].text.startswith('<|im_start|>system\n{"type": "function"')
    text_row = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2=", "tools": TOOLS}])
    with pytest.raises(ValueError, match=r"row 0 \(the 1st\): the row lists tools, and a text prompt has no chat template"):
        build_prompts(RLDataConfig(format="jsonl", path=text_row), HFTokenizer(tokenizer_file))


THINKING_CHATML = CHATML.replace("'<|im_start|>assistant\\n' }}", "'<|im_start|>assistant\\n' }}{% if enable_thinking is "
                                 "defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}")


def test_chat_template_kwargs_reach_the_template_as_transformers_passes_them(tmp_path):
    """`--rl_data.chat_template_kwargs '{"enable_thinking": false}'` (Qwen3's switch, as TRL's
    chat_template_kwargs): the prompts end with the empty think block transformers renders;
    where no template reads them, the flag is refused."""
    transformers = pytest.importorskip("transformers")
    assert "enable_thinking" in THINKING_CHATML
    tokenizer_file = _chatml_tokenizer(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING_CHATML}))
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": CONVERSATION, "answer": "4"}])
    tokenizer = HFTokenizer(tokenizer_file)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|im_end|>")
    reference.chat_template = THINKING_CHATML
    for kwargs in ({"enable_thinking": False}, {}):
        flags = {"chat_template_kwargs": json.dumps(kwargs)} if kwargs else {}
        train, _ = build_prompts(RLDataConfig(format="jsonl", path=path, **flags), tokenizer)
        assert train[0].ids == list(reference.apply_chat_template(
            CONVERSATION, tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs))
        assert train[0].text.endswith("<think>\n\n</think>\n\n") == bool(kwargs)

    off = '{"enable_thinking": false}'
    for flags, message in [
        ({"chat_template_kwargs": off}, "not read by --rl_data.format synthetic"),
        ({"format": "jsonl", "path": path, "chat_template": "builtin", "chat_template_kwargs": off},
         "not read by the built-in chat template"),
        ({"format": "jsonl", "path": path, "chat_template_kwargs": "enable_thinking=false"}, "is not JSON"),
        ({"format": "jsonl", "path": path, "chat_template_kwargs": '{"tools": []}'}, "sets tools, which titan gives"),
    ]:
        with pytest.raises(ValueError, match=message):
            RLDataConfig(**flags)
    text = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    with pytest.raises(ValueError, match="the prompts of .* are text, rendered by no template"):
        build_prompts(RLDataConfig(format="jsonl", path=text, chat_template_kwargs=off), tokenizer)


def test_chat_template_path_renders_prompts_with_that_template(tmp_path):
    """`--rl_data.chat_template_path` (TRL's chat_template_path): the prompts are rendered with
    the named template file instead of the tokenizer's, as transformers renders them with
    `chat_template=`; text prompts and the synthetic task refuse it."""
    transformers = pytest.importorskip("transformers")
    tokenizer_file = _chatml_tokenizer(tmp_path / "tok")  # its own template: CHATML
    (tmp_path / "thinking.jinja").write_text(THINKING_CHATML)
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": CONVERSATION, "answer": "4"}])
    tokenizer = HFTokenizer(tokenizer_file)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), eos_token="<|im_end|>")
    cfg = RLDataConfig(format="jsonl", path=path, chat_template_path=str(tmp_path / "thinking.jinja"),
                       chat_template_kwargs='{"enable_thinking": false}')
    train, _ = build_prompts(cfg, tokenizer)
    assert train[0].ids == list(reference.apply_chat_template(
        CONVERSATION, chat_template=THINKING_CHATML, tokenize=True, add_generation_prompt=True, return_dict=False,
        enable_thinking=False))
    assert train[0].text.endswith("<think>\n\n</think>\n\n")  # the file's template, not the tokenizer's
    with pytest.raises(ValueError, match="not read by --rl_data.format synthetic"):
        RLDataConfig(chat_template_path="t.jinja")
    with pytest.raises(ValueError, match="drop one of the two"):
        RLDataConfig(format="jsonl", path=path, chat_template="builtin", chat_template_path="t.jinja")
    text = _write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    with pytest.raises(ValueError, match="--rl_data.chat_template_path sets a chat template, and the prompts of"):
        build_prompts(RLDataConfig(format="jsonl", path=text, chat_template_path=str(tmp_path / "thinking.jinja")),
                      tokenizer)


def test_prompt_content_as_text_parts_reads_as_its_text(tmp_path):
    """A conversational prompt whose content is a list of text parts (OpenAI's format) gives
    the ids of the same text as a string, and the rewards see that text."""
    tokenizer = HFTokenizer(_chatml_tokenizer(tmp_path / "tok"))
    parts = [{"role": "system", "content": [{"type": "text", "text": "Answer with "}, {"type": "text", "text": "a number."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    prompts = [build_prompts(RLDataConfig(format="jsonl", path=_write_jsonl(tmp_path / f"{name}.jsonl", [
        {"prompt": conversation, "answer": "4"}])), tokenizer)[0][0] for name, conversation in
        (("parts", parts), ("plain", CONVERSATION))]
    assert prompts[0].ids == prompts[1].ids and prompts[0].text == prompts[1].text
    assert prompts[0].messages[0]["content"] == "Answer with a number."


def test_conversational_prompts_with_the_builtin_template(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"q": CONVERSATION}])
    tokenizer = ByteTokenizer()
    train, _ = build_prompts(RLDataConfig(format="jsonl", path=path, prompt_field="q"), tokenizer)
    assert train[0].ids == encode_chat_prompt(CONVERSATION, tokenizer)
    assert train[0].text == "<|system|>\nAnswer with a number.\n<|user|>\nWhat is 2+2?\n<|assistant|>\n"
    with pytest.raises(ValueError, match="no chat_template"):  # asked for the tokenizer's: it has none
        build_prompts(RLDataConfig(format="jsonl", path=path, prompt_field="q", chat_template="tokenizer"), tokenizer)


@pytest.mark.parametrize("prompt,message", [
    (7, "holds int, not a string or a list"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "ends with the turn to answer"),
    ([{"role": "robot", "content": "hi"}], "role 'robot'"),
])
def test_bad_prompts_name_the_row(tmp_path, prompt, message):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"} if isinstance(prompt, int) else
                                               {"prompt": [{"role": "user", "content": "fine"}]}, {"prompt": prompt}])
    with pytest.raises(ValueError, match=message) as err:
        build_prompts(RLDataConfig(format="jsonl", path=path), ByteTokenizer())
    assert "row 1" in str(err.value)


def test_overlong_prompts_are_dropped_when_read_or_refused(tmp_path, caplog):
    """A prompt that leaves no room for --sampling.max_new_tokens within --training.seq_len is
    handled when the prompts are read, never by a rollout mid-run."""
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x" * n} for n in (3, 9, 4, 12)])
    cfg = RLDataConfig(format="jsonl", path=path, eval_path=path)
    with caplog.at_level("WARNING", logger="titan"):
        train, held_out = build_prompts(cfg, ByteTokenizer(), max_prompt_tokens=8)  # BOS + text
    assert [len(p.ids) for p in train] == [len(p.ids) for p in held_out] == [4, 5]
    assert "2 of the 4 training prompts are longer (the longest 13 tokens, the first is prompt 1)" in caplog.text
    with pytest.raises(ValueError, match="2 of the 4 training prompts are longer") as err:
        build_prompts(RLDataConfig(format="jsonl", path=path, overlong="error"), ByteTokenizer(), max_prompt_tokens=8)
    assert "--rl_data.overlong drop" in str(err.value)
    with pytest.raises(ValueError, match="4 of the 4 training prompts"):  # nothing left to train on
        build_prompts(cfg, ByteTokenizer(), max_prompt_tokens=2)
    with pytest.raises(ValueError, match="--rl_data.overlong must be"):
        RLDataConfig(overlong="truncate")


def test_parquet_prompts_with_a_nested_answer_as_verl_writes_them(tmp_path):
    """Prompt files as verl and the Hub ship them: Parquet, conversational prompts, the answer
    inside a record (`--rl_data.answer_field reward_model.ground_truth`)."""
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": [{"role": "user", "content": f"{i}+{i}?"}], "reward_model": {"ground_truth": str(2 * i)}}
            for i in range(3)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "train.parquet"))
    cfg = RLDataConfig(format="jsonl", path=str(tmp_path), answer_field="reward_model.ground_truth")
    train, _ = build_prompts(cfg, ByteTokenizer())
    assert [p.answer for p in train] == ["0", "2", "4"]
    assert train[1].messages == rows[1]["prompt"]  # for TRL-style rewards: the row as given
    assert train[1].columns == {"reward_model": {"ground_truth": "2"}}
    assert train[1].ids == encode_chat_prompt(rows[1]["prompt"], ByteTokenizer())
    with pytest.raises(ValueError, match="'reward_model.score' has no 'score'"):
        build_prompts(RLDataConfig(format="jsonl", path=str(tmp_path), answer_field="reward_model.score"),
                      ByteTokenizer())
    _write_jsonl(tmp_path / "more.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match="holds both JSONL and Parquet files"):
        build_prompts(cfg, ByteTokenizer())


def test_a_downloaded_hub_dataset_folder_gives_train_prompts_and_held_out_test_prompts(tmp_path):
    datasets = pytest.importorskip("datasets")
    (tmp_path / "data").mkdir()
    for split, n in (("train", 4), ("test", 2)):
        datasets.Dataset.from_list([{"prompt": f"{split} {i}", "answer": str(i)} for i in range(n)]).to_parquet(
            str(tmp_path / "data" / f"{split}-00000-of-00001.parquet"))
    train, held_out = build_prompts(RLDataConfig(format="jsonl", path=str(tmp_path), eval_path=str(tmp_path)),
                                    ByteTokenizer())
    assert [p.text for p in train] == [f"train {i}" for i in range(4)]
    assert [p.text for p in held_out] == ["test 0", "test 1"]


def test_a_hub_dataset_gives_the_prompts_of_its_configuration_and_named_splits(tmp_path):
    """A folder laid out as a Hub dataset repository (read by `datasets.load_dataset` exactly
    as a Hub name, e.g. gsm8k's `main` configuration, is): the configuration and the named
    splits, checked against the dataset's own lists."""
    pytest.importorskip("datasets")
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*.jsonl\n"
        "  - split: dev\n    path: main/dev-*.jsonl\n- config_name: socratic\n  data_files:\n"
        "  - split: train\n    path: socratic/train-*.jsonl\n---\n")
    for config, split, n in (("main", "train", 3), ("main", "dev", 2), ("socratic", "train", 5)):
        (tmp_path / config).mkdir(exist_ok=True)
        _write_jsonl(tmp_path / config / f"{split}-00000.jsonl",
                     [{"question": f"{config} {split} {i}", "answer": str(i)} for i in range(n)])
    cfg = RLDataConfig(format="jsonl", path=str(tmp_path), subset="main", eval_path=str(tmp_path), eval_split="dev",
                       prompt_field="question")
    train, held_out = build_prompts(cfg, ByteTokenizer())
    assert [(p.text, p.answer) for p in train] == [(f"main train {i}", str(i)) for i in range(3)]
    assert [p.text for p in held_out] == ["main dev 0", "main dev 1"]
    with pytest.raises(ValueError, match="has the configurations main, socratic: pick one with --rl_data.subset"):
        build_prompts(RLDataConfig(format="jsonl", path=str(tmp_path), prompt_field="question"), ByteTokenizer())
    with pytest.raises(ValueError, match="no validation or test split: pick one with --rl_data.eval_split"):
        build_prompts(RLDataConfig(format="jsonl", path=str(tmp_path), subset="main", eval_path=str(tmp_path),
                                   prompt_field="question"), ByteTokenizer())
    with pytest.raises(ValueError, match="--rl_data.split 'test' is not a split of"):
        build_prompts(RLDataConfig(format="jsonl", path=str(tmp_path), subset="main", split="test",
                                   prompt_field="question"), ByteTokenizer())
    with pytest.raises(ValueError, match="--rl_data.subset 'main': not read by --rl_data.format synthetic"):
        RLDataConfig(subset="main")


@pytest.mark.parametrize("flag, value", [("prompt_field", "question"), ("answer_field", "solution"),
                                         ("chat_template", "tokenizer")])
def test_jsonl_fields_are_refused_for_the_synthetic_task(flag, value):
    """The synthetic task reads its own prompts and answers: a column name or template given
    with it would be ignored, so it is refused, naming the flag."""
    with pytest.raises(ValueError, match=f"--rl_data.{flag} '{value}' is not read by --rl_data.format synthetic"):
        RLDataConfig(**{flag: value})
    RLDataConfig(format="jsonl", path="prompts.jsonl", **{flag: value})  # read there
