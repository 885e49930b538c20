"""DatasetConfig / validate_data_config: bad values fail early, naming the flag."""

from __future__ import annotations

import pytest
from titan.train.data import DatasetConfig, TokenizerConfig, build_dataloader, validate_data_config
from titan.train.data.tokenizer import ByteTokenizer


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="json"), "--dataset.name json reads local files: set --dataset.path"),
        (dict(name="parquet"), "--dataset.path"),
        (dict(name="synthetic", path="x.txt"), "--dataset.path is only read for local files"),
        (dict(name="allenai/c4", path="x.txt"), "--dataset.path is only read for local files"),
        (dict(name=""), "--dataset.name is empty"),
        (dict(text_field=""), "--dataset.text_field"),
        (dict(split=""), "--dataset.split"),
        (dict(text_sample_by="word"), "--dataset.text_sample_by"),
        (dict(synthetic_symbols=0), "--dataset.synthetic_symbols must be >= 1"),
        (dict(synthetic_documents=0), "--dataset.synthetic_documents must be >= 1"),
        (dict(synthetic_mean_length=0), "--dataset.synthetic_mean_length"),
        (
            dict(synthetic_successors=9, synthetic_symbols=8),
            "--dataset.synthetic_successors 9 exceeds",
        ),
    ],
)
def test_post_init_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DatasetConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="synthetic", split="validation"), "--dataset.split 'validation' is not read for --dataset.name "
         "synthetic: it has no splits"),
        (dict(name="json", path="x.jsonl", split="validation"), "local files form one split, train"),
        (dict(name="stdlib", subset="en"), "--dataset.subset 'en' names a configuration of a hub dataset"),
        (dict(name="parquet", path="x.parquet", subset="en"), "--dataset.name parquet has none"),
        (dict(name="text", path="x.txt", text_field="body"), "--dataset.text_field 'body' names a column"),
        (dict(name="tokenized", path="corpus", text_field="body"), "--dataset.name tokenized has none"),
        (dict(name="json", path="x.jsonl", text_sample_by="paragraph"), "splits plain text files"),
    ],
)
def test_fields_the_source_does_not_read_are_named(kwargs, match):
    """Fields the named source would not read: named by `check_unread_fields` (which the
    command line applies to the flags it is given, and `titan data tokenize` to its own), not
    at construction, where they may be a recipe's or a job file's defaults."""
    config = DatasetConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        config.check_unread_fields()


def test_the_fields_each_source_reads_are_accepted():
    DatasetConfig(name="allenai/c4", subset="en", split="validation", text_field="body").check_unread_fields()
    DatasetConfig(name="text", path="x.txt", text_sample_by="paragraph").check_unread_fields()
    DatasetConfig(name="json", path="x.jsonl", text_field="body").check_unread_fields()


def test_defaults_are_valid_and_kinds():
    cfg = DatasetConfig()
    assert cfg.name == "synthetic" and cfg.text_field == "text" and not cfg.is_hub
    assert DatasetConfig(name="allenai/c4", subset="en").is_hub
    assert DatasetConfig(name="text", path="a.txt").is_local
    validate_data_config(cfg, TokenizerConfig())


def test_missing_local_file_raises_before_any_work(tmp_path):
    cfg = DatasetConfig(name="json", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="--dataset.path .*missing.jsonl"):
        validate_data_config(cfg)
    # build_dataloader resolves files before `datasets` is asked to do anything.
    with pytest.raises(FileNotFoundError, match="--dataset.path"):
        build_dataloader(
            cfg, ByteTokenizer(), dp_rank=0, dp_world_size=1, local_batch_size=1, seq_len=8, seed=0
        )


def test_empty_directory_and_glob(tmp_path):
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"\.parquet files"):
        validate_data_config(DatasetConfig(name="parquet", path=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="no file, directory or glob match"):
        validate_data_config(DatasetConfig(name="text", path=str(tmp_path / "*.txt")))


def test_missing_tokenizer_file(tmp_path):
    tok = TokenizerConfig(kind="hf", path=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--tokenizer.path"):
        validate_data_config(DatasetConfig(), tok)


def test_synthetic_symbols_must_fit_byte_vocab():
    with pytest.raises(ValueError, match="--dataset.synthetic_symbols 257 exceeds the 256"):
        validate_data_config(DatasetConfig(synthetic_symbols=257), TokenizerConfig())


def test_flags_as_the_trainer_spells_them():
    import dataclasses

    import tyro

    @dataclasses.dataclass
    class Sections:
        dataset: DatasetConfig = dataclasses.field(default_factory=DatasetConfig)
        tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)

    args = [
        "--dataset.name",
        "json",
        "--dataset.path",
        "d.jsonl",
        "--dataset.synthetic_successors",
        "3",
        "--dataset.no_shuffle",
        "--tokenizer.kind",
        "byte",
    ]
    cfg = tyro.cli(Sections, args=args, use_underscores=True)
    assert (cfg.dataset.name, cfg.dataset.path, cfg.dataset.synthetic_successors) == (
        "json",
        "d.jsonl",
        3,
    )
    assert cfg.dataset.shuffle is False and cfg.tokenizer.kind == "byte"


def test_a_local_file_of_another_kind_names_the_right_dataset_name(tmp_path):
    """A Parquet file given as --dataset.name json failed inside `datasets` with a JSON parse
    error; it is named before any work."""
    from titan.train.data.sources import resolve_data_files

    parquet = tmp_path / "docs.parquet"
    parquet.write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="is a parquet file, not json: use --dataset.name parquet"):
        resolve_data_files("json", str(parquet))
    assert resolve_data_files("parquet", str(parquet)) == [str(parquet)]
    odd = tmp_path / "docs.dat"  # an ending of no kind: read as asked
    odd.write_text("{}")
    assert resolve_data_files("json", str(odd)) == [str(odd)]
