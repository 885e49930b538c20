"""SFT examples and RL prompts from Hub datasets (`titan.train.data.records`): a folder laid out
as a Hub dataset repository is read through `datasets.load_dataset` by its path exactly as a Hub
name is (the same call; no Hub is reachable here), with its configuration (`--*.subset`) and
splits (`--*.split`, `--*.eval_split`) checked against the dataset's own lists."""

import json
from pathlib import Path

import pytest
from titan.train.data import ByteTokenizer, SFTDataConfig
from titan.train.data.records import is_hub_dataset, load_records, resolve_record_files
from titan.train.data.sft import build_sft_source, validate_sft_data_config

datasets = pytest.importorskip("datasets")

README = """---
configs:
- config_name: chat
  data_files:
  - split: train_sft
    path: chat/train_sft-*.jsonl
  - split: test_sft
    path: chat/test_sft-*.jsonl
- config_name: math
  data_files:
  - split: train
    path: math/train-*.jsonl
  - split: test
    path: math/test-*.jsonl
---
# A dataset repository as the Hub lays one out (two configurations, named splits).
"""


def _conversation(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def repository(tmp_path) -> str:
    """A Hub dataset repository folder: `chat` (train_sft 5 rows, test_sft 2), `math` (train 4, test 3)."""
    root = tmp_path / "ultrachat_like"
    (root / "README.md").parent.mkdir(parents=True)
    (root / "README.md").write_text(README)
    _write(root / "chat" / "train_sft-00000.jsonl", [_conversation(f"train question {i}", f"a{i}") for i in range(5)])
    _write(root / "chat" / "test_sft-00000.jsonl", [_conversation(f"held question {i}", f"b{i}") for i in range(2)])
    _write(root / "math" / "train-00000.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)])
    _write(root / "math" / "test-00000.jsonl", [{"prompt": f"{i}+2=", "answer": str(i + 2)} for i in range(3)])
    return str(root)


def _chat(repository: str, tmp_path, **flags) -> SFTDataConfig:
    return SFTDataConfig(format="chat", path=repository, shuffle=False, cache_dir=str(tmp_path / "cache"),
                         chat_template="builtin", **flags)


def _decoded(source, index: int) -> str:
    return bytes(t for t in source.example(index).ids if t < 256).decode()


def test_a_repository_folder_gives_the_named_configuration_and_splits(repository, tmp_path):
    cfg = _chat(repository, tmp_path, subset="chat", split="train_sft", eval_path=repository, eval_split="test_sft")
    validate_sft_data_config(cfg)
    train, held = build_sft_source(cfg, ByteTokenizer()), build_sft_source(cfg, ByteTokenizer(), held_out=True)
    assert len(train) == 5 and len(held) == 2
    assert [f"train question {i}" in _decoded(train, i) for i in range(5)] == [True] * 5
    assert "held question 1" in _decoded(held, 1) and "train" not in _decoded(held, 1)
    # A slice of a split, as `datasets` takes it.
    assert len(build_sft_source(_chat(repository, tmp_path, subset="chat", split="train_sft[:2]"),
                                ByteTokenizer())) == 2


def test_held_out_rows_default_to_the_test_split(repository, tmp_path):
    rows = load_records(repository, flag="--rl_data.eval_path", split=None, subset="math", held_out=True,
                        cache_dir=str(tmp_path / "cache"))
    assert [r["prompt"] for r in rows] == ["0+2=", "1+2=", "2+2="]


@pytest.mark.parametrize("flags, message", [
    ({"split": "train_sft"}, "has the configurations chat, math: pick one with --sft_data.subset"),
    ({"subset": "code", "split": "train_sft"}, "--sft_data.subset 'code' is not a configuration of"),
    ({"subset": "chat"}, "--sft_data.split 'train' is not a split of .*ultrachat_like': it has train_sft, test_sft"),
    ({"subset": "chat", "split": "train_gen"}, "--sft_data.split 'train_gen' is not a split of .*: it has train_sft, "),
    ({"subset": "chat", "split": "train_sft", "eval_path": "SAME"},
     "and no validation or test split: pick one with --sft_data.eval_split"),
])
def test_a_wrong_configuration_or_split_is_one_line_naming_the_flag(repository, tmp_path, flags, message):
    if flags.get("eval_path") == "SAME":
        flags["eval_path"] = repository
    cfg = _chat(repository, tmp_path, **flags)
    with pytest.raises(ValueError, match=message):
        held_out = "eval_path" in flags
        build_sft_source(cfg, ByteTokenizer(), held_out=held_out)


def test_a_hub_name_is_read_through_datasets_and_an_unreachable_hub_names_the_flag(monkeypatch):
    import huggingface_hub.constants

    # Offline mode, so that no machine reaches the network: `datasets` raises as it does unplugged.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = SFTDataConfig(format="chat", path="trl-lib/Capybara")
    validate_sft_data_config(cfg)  # a Hub dataset is checked when it is read, not as files
    with pytest.raises(ValueError, match=r"--sft_data.path 'trl-lib/Capybara' is no local file or folder, so it is "
                                         r"read from the Hugging Face Hub, which could not be reached"):
        build_sft_source(cfg, ByteTokenizer())


def test_a_dataset_the_hub_does_not_serve_names_the_flag(monkeypatch):
    from datasets.exceptions import DatasetNotFoundError

    def not_found(name, *args, **kwargs):  # what `datasets` raises online for a missing or private repository
        raise DatasetNotFoundError(f"Dataset '{name}' doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(datasets, "get_dataset_config_names", not_found)
    with pytest.raises(ValueError, match=r"--rl_data.path 'no-one/nothing' is no local file or folder, nor a dataset "
                                         r"the Hugging Face Hub serves \(Dataset 'no-one/nothing' doesn't exist"):
        load_records("no-one/nothing", flag="--rl_data.path", split="train")


def test_what_is_a_hub_dataset(repository, tmp_path):
    plain = tmp_path / "plain"
    _write(plain / "a.jsonl", [{"prompt": "p", "completion": "c"}])
    assert is_hub_dataset("trl-lib/Capybara") and is_hub_dataset("gsm8k") and is_hub_dataset(repository)
    assert not any(is_hub_dataset(p) for p in (str(plain), str(plain / "a.jsonl"), "./missing", "missing.jsonl",
                                               "/abs/missing", "data/*.parquet"))


def test_split_flags_local_files_do_not_read_are_refused(tmp_path):
    plain = tmp_path / "plain.jsonl"
    _write(plain, [{"prompt": "p", "completion": "c"}])
    base = {"format": "prompt_completion", "path": str(plain)}
    with pytest.raises(ValueError, match="--sft_data.subset 'main' names a configuration of a Hub dataset"):
        validate_sft_data_config(SFTDataConfig(**base, subset="main"))
    with pytest.raises(ValueError, match="--sft_data.split 'train_sft' picks a split, and --sft_data.path .* is not "
                                         "laid out in splits"):
        validate_sft_data_config(SFTDataConfig(**base, split="train_sft"))
    with pytest.raises(ValueError, match="--sft_data.eval_split 'test' picks a split of --sft_data.eval_path, which "
                                         "is not set"):
        SFTDataConfig(**base, eval_split="test")
    with pytest.raises(ValueError, match="--sft_data.split 'train_sft': not read by --sft_data.format synthetic"):
        SFTDataConfig(split="train_sft")


def test_a_folder_in_named_splits_gives_the_named_split(tmp_path):
    """A downloaded dataset whose splits are not train/test (ultrachat's train_sft/test_sft):
    refused before; the named split's files now."""
    folder = tmp_path / "downloaded"  # the Hub's default layout: data/<split>-<shard>-of-<shards>.<ext>
    _write(folder / "data" / "train_sft-00000-of-00001.jsonl", [_conversation("q", "a")] * 3)
    _write(folder / "data" / "test_sft-00000-of-00001.jsonl", [_conversation("q", "a")])
    with pytest.raises(ValueError, match="no train split; pick one with --sft_data.split"):
        resolve_record_files(str(folder))
    _, files = resolve_record_files(str(folder), split="train_sft")
    assert [Path(f).name for f in files] == ["train_sft-00000-of-00001.jsonl"]
    _, held = resolve_record_files(str(folder), flag="--sft_data.eval_path", held_out=True, split="test_sft")
    assert [Path(f).name for f in held] == ["test_sft-00000-of-00001.jsonl"]
    with pytest.raises(ValueError, match="--sft_data.split 'dev' is not a split of"):
        resolve_record_files(str(folder), split="dev")
