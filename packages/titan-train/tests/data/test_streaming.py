"""`--dataset.streaming`: a dataset in the Hub's layout (a folder of gzipped JSON Lines shards
with a README naming its configs and splits, as allenai/c4) read through the real `datasets`
streaming, against the map-style loader that downloads it first."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch
from titan.train.data import ByteTokenizer, DatasetConfig, build_dataloader
from titan.train.data.loader import StreamingDataLoader

SHARDS = 4
ROWS = [7, 3, 0, 5]  # rows per shard; the third shard is empty


def _doc(shard: int, row: int) -> str:
    return f"shard {shard} row {row}: " + "word " * ((shard * 3 + row) % 6)


@pytest.fixture
def hub_folder(tmp_path):
    """A local dataset repository in the Hub's layout: config "en", splits train/validation."""
    root = tmp_path / "c4like"
    (root / "en").mkdir(parents=True)
    for shard, rows in enumerate(ROWS):
        with gzip.open(root / "en" / f"c4-train.{shard:05d}-of-{SHARDS:05d}.json.gz", "wt") as f:
            for row in range(rows):
                f.write(json.dumps({"text": _doc(shard, row), "url": "https://example.com", "n": row}) + "\n")
    with gzip.open(root / "en" / "c4-validation.00000-of-00001.json.gz", "wt") as f:
        f.write(json.dumps({"text": "held out", "url": "u", "n": 0}) + "\n")
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n"
        "  - split: train\n    path: en/c4-train.*.json.gz\n"
        "  - split: validation\n    path: en/c4-validation.*.json.gz\n---\n"
    )
    return root


def _config(root, tmp_path, **kw):
    kw = {"shuffle": False, **kw}
    return DatasetConfig(name=str(root), subset="en", cache_dir=str(tmp_path / "cache"), **kw)


def _loader(cfg, *, rank=0, world=1, batch=2, seq_len=16, seed=0):
    return build_dataloader(cfg, ByteTokenizer(), dp_rank=rank, dp_world_size=world,
                            local_batch_size=batch, seq_len=seq_len, seed=seed)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def _framed(texts):
    tok = ByteTokenizer()
    return [t for text in texts for t in tok.encode(text, bos=True, eos=True)]


def _stream_tokens(loader, n_batches):
    """The tokens of the global stream the batches cut (one rank, so rows are consecutive)."""
    rows = []
    for batch in _take(loader, n_batches):
        for inputs, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            rows.extend(inputs.tolist() + labels[-1:].tolist())
    return rows


def test_streams_the_hub_layout_in_order_like_the_downloaded_dataset(hub_folder, tmp_path):
    streamed = _loader(_config(hub_folder, tmp_path / "s", streaming=True))
    assert isinstance(streamed, StreamingDataLoader) and streamed.packer.num_shards == SHARDS
    expected = _framed(_doc(s, r) for s in range(SHARDS) for r in range(ROWS[s]))
    got = _stream_tokens(streamed, 8)
    assert got == (expected * 2)[: len(got)]  # in file order, into the next epoch
    # Nothing was downloaded or converted: the map-style path writes Arrow files to the cache.
    assert not list((tmp_path / "s" / "cache").rglob("*.arrow"))
    downloaded = _loader(_config(hub_folder, tmp_path / "d"))
    _assert_same(_take(_loader(_config(hub_folder, tmp_path / "s", streaming=True)), 8), _take(downloaded, 8))
    assert list((tmp_path / "d" / "cache").rglob("*.arrow"))


def test_shuffle_permutes_shards_per_epoch_and_reads_every_document_once(hub_folder, tmp_path):
    cfg = _config(hub_folder, tmp_path, streaming=True, shuffle=True)
    loader = _loader(cfg, seed=5)
    epoch_tokens = len(_framed(_doc(s, r) for s in range(SHARDS) for r in range(ROWS[s])))
    n_batches = -(-3 * epoch_tokens // (2 * 17))
    got = _stream_tokens(loader, n_batches)
    for epoch in range(2):
        order = np.random.default_rng([5, epoch]).permutation(SHARDS)
        expected = _framed(_doc(int(s), r) for s in order for r in range(ROWS[s]))
        assert got[epoch * epoch_tokens:(epoch + 1) * epoch_tokens] == expected
    orders = {tuple(np.random.default_rng([5, e]).permutation(SHARDS)) for e in range(2)}
    assert len(orders) == 2  # the two epochs above really were read in different orders


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("n_before", [1, 3, 4, 9])
def test_resume_yields_exactly_the_next_batches(hub_folder, tmp_path, shuffle, n_before):
    cfg = _config(hub_folder, tmp_path, streaming=True, shuffle=shuffle)
    first = _loader(cfg, seed=2)
    _take(first, n_before)
    state = first.state_dict()
    assert set(state) >= {"epoch", "shard", "row", "offset", "num_shards"}
    expected = _take(first, 6)
    resumed = _loader(cfg, seed=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # plain, JSON-able
    _assert_same(_take(resumed, 6), expected)


def test_resume_reopens_one_shard_and_skips_only_its_rows(hub_folder, tmp_path, monkeypatch):
    cfg = _config(hub_folder, tmp_path, streaming=True)
    first = _loader(cfg)
    state = first.state_dict()
    while not (state["shard"] == 1 and state["row"] > 0):  # stop inside the second shard
        assert state["epoch"] == 0
        next(first)
        state = first.state_dict()
    opened = []
    resumed = _loader(cfg)
    rows = resumed.packer.source.rows
    monkeypatch.setattr(resumed.packer.source, "rows",
                        lambda shard, start: opened.append((shard, start)) or rows(shard, start))
    resumed.load_state_dict(state)
    _assert_same(_take(resumed, 1), _take(first, 1))
    assert opened[0] == (1, state["row"])


def test_resume_under_another_data_parallel_degree(hub_folder, tmp_path):
    cfg = _config(hub_folder, tmp_path, streaming=True, shuffle=True)
    single = _loader(cfg, batch=4)
    _take(single, 2)
    state = single.state_dict()
    expected = _take(single, 3)
    ranks = [_loader(cfg, rank=r, world=2, batch=2) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    for want in expected:
        got = [next(loader) for loader in ranks]
        assert torch.equal(torch.cat([g["input_ids"] for g in got]), want["input_ids"])
    assert ranks[0].state_dict() == ranks[1].state_dict() == single.state_dict()


def test_a_map_style_position_is_refused_by_the_stream_and_back(hub_folder, tmp_path):
    mapped = _loader(_config(hub_folder, tmp_path))
    streamed = _loader(_config(hub_folder, tmp_path, streaming=True))
    next(mapped), next(streamed)
    with pytest.raises(ValueError, match="num_shards=None.*--dataset.streaming"):
        _loader(_config(hub_folder, tmp_path, streaming=True)).load_state_dict(mapped.state_dict())
    with pytest.raises(ValueError, match="num_documents=None"):
        _loader(_config(hub_folder, tmp_path)).load_state_dict(streamed.state_dict())


@pytest.mark.parametrize("name", ["json", "parquet", "text"])
def test_local_files_stream_like_they_load(name, tmp_path):
    import datasets

    texts = [_doc(0, r) for r in range(9)]
    folder = tmp_path / "files"
    folder.mkdir()
    for part in range(3):
        table = datasets.Dataset.from_dict({"text": texts[part::3]})
        if name == "json":
            table.to_json(str(folder / f"part{part}.jsonl"))
        elif name == "parquet":
            table.to_parquet(str(folder / f"part{part}.parquet"))
        else:
            (folder / f"part{part}.txt").write_text("\n".join(texts[part::3]) + "\n")

    def config(streaming):
        return DatasetConfig(name=name, path=str(folder), shuffle=False, streaming=streaming,
                             cache_dir=str(tmp_path / f"cache-{streaming}"))

    streamed = _loader(config(True))
    assert streamed.packer.num_shards == 3
    _assert_same(_take(streamed, 6), _take(_loader(config(False)), 6))


def test_an_unparsable_local_file_is_named_with_its_line(tmp_path):
    folder = tmp_path / "files"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": "fine"}) + "\n")
    (folder / "b.jsonl").write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    cfg = DatasetConfig(name="json", path=str(folder), shuffle=False, streaming=True,
                        cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"--dataset.path: .*b.jsonl line 2 is not valid JSON"):
        _take(_loader(cfg), 4)


def test_bad_columns_and_empty_streams_are_refused(hub_folder, tmp_path):
    with pytest.raises(ValueError, match="'body' is not a column.*text, url, n"):
        _loader(_config(hub_folder, tmp_path, streaming=True, text_field="body"))
    with pytest.raises(ValueError, match="'n' holds int64 values, not text"):
        _loader(_config(hub_folder, tmp_path, streaming=True, text_field="n"))
    folder = tmp_path / "blank"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": None}) + "\n")
    blank = DatasetConfig(name="json", path=str(folder), streaming=True, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="every document is empty"):
        next(_loader(blank))


def test_built_in_corpora_read_as_they_always_do_under_streaming(tmp_path):
    """A recipe that streams its hub corpus (the GPU recipes) keeps working when the corpus is
    switched to a built-in one, which downloads nothing and is read lazily anyway."""
    for name in ("synthetic", "stdlib"):
        plain, streamed = (_loader(DatasetConfig(name=name, streaming=s, shuffle=False)) for s in (False, True))
        assert type(streamed) is type(plain) and not isinstance(streamed, StreamingDataLoader)
        _assert_same(_take(streamed, 2), _take(plain, 2))
