"""Local text / JSONL / parquet files through the real `datasets` library."""

from __future__ import annotations

import pytest
import torch
from titan.train.data import ByteTokenizer, DatasetConfig, HFTokenizer, build_dataloader

DOCS = [f"document number {i}: " + "word " * (i % 7) for i in range(12)]


@pytest.fixture
def data_files(tmp_path):
    """The same documents as .txt (one per line), .jsonl and .parquet."""
    import datasets

    table = datasets.Dataset.from_dict({"body": DOCS, "id": list(range(len(DOCS)))})
    folder = tmp_path / "data"  # apart from the datasets cache, which holds .json files too
    folder.mkdir()
    paths = {
        "text": folder / "docs.txt",
        "json": folder / "docs.jsonl",
        "parquet": folder / "docs.parquet",
    }
    paths["text"].write_text("\n".join(DOCS) + "\n")
    table.to_json(str(paths["json"]))  # JSON lines
    table.to_parquet(str(paths["parquet"]))
    return paths


def _config(name, path, tmp_path, **kw):
    field = "text" if name == "text" else "body"
    return DatasetConfig(
        name=name,
        path=str(path),
        text_field=field,
        shuffle=False,
        cache_dir=str(tmp_path / "cache"),
        **kw,
    )


def _first_stream(cfg, tokenizer, n_tokens):
    loader = build_dataloader(
        cfg, tokenizer, dp_rank=0, dp_world_size=1, local_batch_size=1, seq_len=n_tokens - 1, seed=0
    )
    batch = next(loader)
    return batch["input_ids"][0].tolist() + batch["labels"][0, -1:].tolist()


@pytest.mark.parametrize("name", ["text", "json", "parquet"])
def test_local_formats_yield_the_documents_in_order(name, data_files, tmp_path):
    tok = ByteTokenizer()
    expected = [t for d in DOCS for t in tok.encode(d, bos=True, eos=True)]
    got = _first_stream(_config(name, data_files[name], tmp_path), tok, len(expected))
    assert got == expected


def test_directory_and_glob_paths(data_files, tmp_path):
    tok = ByteTokenizer()
    by_file = _first_stream(_config("json", data_files["json"], tmp_path), tok, 64)
    folder = data_files["json"].parent
    by_dir = _first_stream(_config("json", folder, tmp_path), tok, 64)
    by_glob = _first_stream(_config("json", folder / "*.jsonl", tmp_path), tok, 64)
    assert by_file == by_dir == by_glob


def test_missing_text_field_lists_columns(data_files, tmp_path):
    cfg = DatasetConfig(
        name="parquet", path=str(data_files["parquet"]), cache_dir=str(tmp_path / "c")
    )
    with pytest.raises(ValueError, match="--dataset.text_field 'text'.*body, id"):
        _first_stream(cfg, ByteTokenizer(), 8)


def test_a_column_that_does_not_hold_text_is_refused(data_files, tmp_path):
    """Its rows would be trained as their Python form ("7", "[{'role': ...}]")."""
    cfg = _config("parquet", data_files["parquet"], tmp_path)
    cfg.text_field = "id"
    with pytest.raises(ValueError, match=r"text_field 'id' holds int64 values, not text.*text column \(body\)"):
        _first_stream(cfg, ByteTokenizer(), 8)
    chats = tmp_path / "chats.jsonl"
    chats.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * 3)
    cfg = _config("json", chats, tmp_path)
    cfg.text_field = "messages"
    with pytest.raises(ValueError, match=r"holds List values.*the dataset has none\); conversations train with `titan sft`"):
        _first_stream(cfg, ByteTokenizer(), 8)


@pytest.mark.parametrize("name, content, message", [
    ("json", '{"body": "fine"}\n{"body": "also fine"}\n{"body": broken}\n',
     r"--dataset.path: \S+bad.jsonl line 3 is not valid JSON \(Expecting value"),
    ("json", '{"body": "fine"}\n["a", "list"]\n', r"bad.jsonl line 2 is a JSON list, not an object"),
    ("parquet", "not parquet at all", r"--dataset.path: \S+bad.parquet is not a readable Parquet file"),
])
def test_a_file_datasets_cannot_parse_is_named_with_its_line(name, content, message, data_files, tmp_path):
    bad = tmp_path / f"bad.{'jsonl' if name == 'json' else name}"
    bad.write_text(content)
    folder = tmp_path / "mixed"
    folder.mkdir()
    good = folder / data_files[name].name
    good.write_bytes(data_files[name].read_bytes())
    (folder / bad.name).write_bytes(bad.read_bytes())
    with pytest.raises(ValueError, match=message):
        _first_stream(_config(name, folder, tmp_path), ByteTokenizer(), 8)


@pytest.mark.parametrize("name, content", [("json", ""), ("json", "\n  \n"), ("text", "")])
def test_an_empty_file_is_named(name, content, tmp_path):
    """`datasets` stops with a bare StopIteration on an empty JSON Lines or text file."""
    empty = tmp_path / f"empty.{'jsonl' if name == 'json' else 'txt'}"
    empty.write_text(content)
    with pytest.raises(ValueError, match=rf"--dataset.path: \S+{empty.name} is empty \(no records\)"):
        _first_stream(_config(name, empty, tmp_path), ByteTokenizer(), 8)


def test_json_with_hf_tokenizer_resumes(data_files, tmp_path, hf_tokenizer_file):
    tok = HFTokenizer(hf_tokenizer_file)
    cfg = _config("json", data_files["json"], tmp_path, text_sample_by="line")
    cfg.shuffle = True

    def build():
        return build_dataloader(
            cfg, tok, dp_rank=0, dp_world_size=1, local_batch_size=2, seq_len=16, seed=1
        )

    a = build()
    for _ in range(5):
        next(a)
    state = a.state_dict()
    expected = [next(a) for _ in range(4)]
    b = build()
    b.load_state_dict(state)
    for want in expected:
        got = next(b)
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(
            got["labels"], want["labels"]
        )
    assert tok.decode(expected[0]["input_ids"][0].tolist())  # real, decodable text


def test_text_sample_by_document(data_files, tmp_path):
    tok = ByteTokenizer()
    cfg = _config("text", data_files["text"], tmp_path, text_sample_by="document")
    got = _first_stream(cfg, tok, 30)
    assert got[0] == tok.bos_id and tok.eos_id not in got  # the whole file is one document


@pytest.mark.parametrize("shuffle", [False, True])
def test_block_reads_keep_documents_order_and_resume(shuffle, monkeypatch):
    """Rows read in prefetched blocks (slices, or lists under shuffle; blocks of 5 here, so
    blocks and epochs cross) give the per-row stream, also when resumed mid-block."""
    import datasets
    import numpy as np
    from titan.train.data import packing
    from titan.train.data.packing import DocumentPacker
    from titan.train.data.sources import HFDatasetSource

    monkeypatch.setattr(packing, "PREFETCH_DOCUMENTS", 5)
    tok = ByteTokenizer()
    table = datasets.Dataset.from_dict({"body": DOCS[:11] + [None]})

    def packer(prefetch):
        source = HFDatasetSource(table, tok, "body")
        if not prefetch:
            source.prefetch = lambda indices: None
        return DocumentPacker(source, bos_id=tok.bos_id, eos_id=tok.eos_id, shuffle=shuffle, seed=3)

    def stream(p, n):
        out = np.empty(n, dtype=np.int64)
        p.fill(out)
        return out.tolist()

    n = 3 * sum(len(d) + 2 for d in DOCS)  # about three epochs
    per_row = stream(packer(False), n)
    blocked = packer(True)
    assert stream(blocked, n // 2 + 7) == per_row[: n // 2 + 7]
    assert blocked.source._block  # the blocks were used, not the per-row fallback
    resumed = packer(True)
    resumed.load_state_dict(blocked.state_dict())
    assert stream(resumed, n - n // 2 - 7) == per_row[n // 2 + 7 :]
