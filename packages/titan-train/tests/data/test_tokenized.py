"""Pre-tokenized corpora: the files `tokenize_corpus` writes, and the tokenized loader giving
exactly the on-the-fly loader's global stream, each rank reading only its own rows."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import pytest
import torch
from titan.train.data import (
    ByteTokenizer,
    DatasetConfig,
    HFTokenizer,
    TokenizedCorpus,
    build_dataloader,
    corpus_writer,
    tokenize_corpus,
    validate_data_config,
)
from titan.train.data import tokenized as tokenized_module
from titan.train.data.tokenizer import TokenizerConfig

# Varied lengths, some empty (kept in the index, skipped by the stream), some non-ASCII.
DOCS = [f"doc {i} " + "héllo wörld " * (i % 5) for i in range(37)]
DOCS[4] = DOCS[20] = ""


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "src" / "docs.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(DOCS)))
    return path


def _tokenize(src, out, tok_cfg=None, **kw):
    kw.setdefault("progress", False)
    return tokenize_corpus(str(src), out, tok_cfg or TokenizerConfig(), **kw)


def _loader(cfg, tokenizer, *, rank=0, world=1, batch=2, seq_len=15, seed=5):
    return build_dataloader(cfg, tokenizer, dp_rank=rank, dp_world_size=world,
                            local_batch_size=batch, seq_len=seq_len, seed=seed)


def _on_the_fly(jsonl, tmp_path, shuffle=True):
    return DatasetConfig(name="json", path=str(jsonl), shuffle=shuffle,
                         cache_dir=str(tmp_path / "hf-cache"))


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def _round_trip(state):
    """What a checkpoint does to the state."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- the files -----------------------------------------------------------------------------


def test_shards_index_and_manifest_hold_the_documents(jsonl, tmp_path):
    out = tmp_path / "corpus"
    manifest = _tokenize(jsonl, out, rows_per_shard=10, chunk_rows=3)
    expected = [list(d.encode("utf-8")) for d in DOCS]  # the byte tokenizer, by hand
    assert manifest == json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "titan-tokenized" and manifest["version"] == 1
    assert manifest["dtype"] == "uint16"
    assert manifest["tokenizer"] == {"kind": "byte", "sha256": None, "vocab_size": 259}
    assert manifest["source"]["text_field"] == "text" and manifest["source"]["format"] == "json"
    assert manifest["num_documents"] == len(DOCS)
    assert manifest["num_tokens"] == sum(map(len, expected))
    assert [s["num_documents"] for s in manifest["shards"]] == [10, 10, 10, 7]
    for i, shard in enumerate(manifest["shards"]):
        docs = expected[10 * i : 10 * i + 10]
        tokens = np.fromfile(out / shard["tokens"], dtype=np.uint16)
        assert tokens.tolist() == [t for d in docs for t in d]
        offsets = np.load(out / shard["index"])
        assert offsets.tolist() == np.concatenate([[0], np.cumsum([len(d) for d in docs])]).tolist()
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["manifest.json"] + [s[k] for s in manifest["shards"] for k in ("tokens", "index")]
    )
    assert not (tmp_path / "corpus.incomplete").exists()
    corpus = TokenizedCorpus(out)
    assert [corpus.document(i).tolist() for i in range(len(DOCS))] == expected


def test_hf_tokenizer_hash_and_ids(jsonl, tmp_path, hf_tokenizer_file):
    manifest = _tokenize(jsonl, tmp_path / "c", TokenizerConfig(kind="hf", path=str(hf_tokenizer_file)))
    assert manifest["tokenizer"]["kind"] == "hf"
    assert manifest["tokenizer"]["sha256"] == hashlib.sha256(hf_tokenizer_file.read_bytes()).hexdigest()
    tok = HFTokenizer(hf_tokenizer_file)
    corpus = TokenizedCorpus(tmp_path / "c")
    assert [corpus.document(i).tolist() for i in range(len(DOCS))] == [tok.encode(d) for d in DOCS]


def test_a_vocabulary_over_65536_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "big.txt"
    src.write_text("w1 w69999 w65536\nw65535 w2\n")
    manifest = _tokenize(src, tmp_path / "c", TokenizerConfig(kind="hf", path=str(tmp_path)),
                         cache_dir=str(tmp_path / "hf"))
    assert manifest["dtype"] == "uint32"
    tokens = np.fromfile(tmp_path / "c" / manifest["shards"][0]["tokens"], dtype=np.uint32)
    assert tokens.tolist() == [1, 69999, 65536, 65535, 2]


def test_the_corpus_does_not_depend_on_num_proc(jsonl, tmp_path):
    one = _tokenize(jsonl, tmp_path / "one", num_proc=1, rows_per_shard=16, chunk_rows=4)
    two = _tokenize(jsonl, tmp_path / "two", num_proc=2, rows_per_shard=16, chunk_rows=4)
    assert one["shards"] == two["shards"]
    for shard in one["shards"]:
        for key in ("tokens", "index"):
            assert (tmp_path / "one" / shard[key]).read_bytes() == (tmp_path / "two" / shard[key]).read_bytes()


def test_an_interrupted_run_leaves_no_corpus_and_a_rerun_finishes_it(jsonl, tmp_path, monkeypatch):
    out = tmp_path / "corpus"
    real_write, written = corpus_writer._ShardWriter.write, []

    def write_then_die(self, shard, start, stop):
        if len(written) == 2:
            raise KeyboardInterrupt  # as if the process were stopped mid-run
        written.append(shard)
        return real_write(self, shard, start, stop)

    monkeypatch.setattr(corpus_writer._ShardWriter, "write", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        _tokenize(jsonl, out, rows_per_shard=10)
    assert not out.exists()
    with pytest.raises(FileNotFoundError, match="interrupted.*rerun"):
        TokenizedCorpus(out)
    assert (tmp_path / "corpus.incomplete" / "index-00001.npy").exists()

    written.clear()
    monkeypatch.setattr(corpus_writer._ShardWriter, "write", lambda self, *a: (
        written.append(a[0]), real_write(self, *a))[1])
    resumed = _tokenize(jsonl, out, rows_per_shard=10)
    assert written == [2, 3]  # only the unfinished shards
    fresh = _tokenize(jsonl, tmp_path / "fresh", rows_per_shard=10)
    assert resumed == json.loads((out / "manifest.json").read_text())
    assert resumed["shards"] == fresh["shards"]
    for shard in fresh["shards"]:
        assert (out / shard["tokens"]).read_bytes() == (tmp_path / "fresh" / shard["tokens"]).read_bytes()
    assert not (tmp_path / "corpus.incomplete").exists()


def test_leftovers_of_another_run_are_discarded(jsonl, tmp_path):
    work = tmp_path / "corpus.incomplete"
    work.mkdir()
    (work / "index-00000.npy").write_bytes(b"junk from an older, different run")
    _tokenize(jsonl, tmp_path / "corpus")
    assert TokenizedCorpus(tmp_path / "corpus").num_documents == len(DOCS)


def test_an_existing_corpus_is_not_overwritten(jsonl, tmp_path):
    _tokenize(jsonl, tmp_path / "c")
    with pytest.raises(FileExistsError, match="already holds"):
        _tokenize(jsonl, tmp_path / "c")


# ---- the loader ----------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_the_tokenized_loader_yields_the_on_the_fly_batches(jsonl, tmp_path, hf_tokenizer_file,
                                                            shuffle, kind):
    tok_cfg = TokenizerConfig(kind=kind, path=str(hf_tokenizer_file) if kind == "hf" else None)
    tokenizer = tok_cfg.build()
    _tokenize(jsonl, tmp_path / "c", tok_cfg, rows_per_shard=8)
    tokenized = DatasetConfig(name="tokenized", path=str(tmp_path / "c"), shuffle=shuffle)
    # 60 batches of 2 x 16 tokens cross several epochs of this small corpus.
    expected = _take(_loader(_on_the_fly(jsonl, tmp_path, shuffle), tokenizer), 60)
    _assert_same(_take(_loader(tokenized, tokenizer), 60), expected)
    # dp 2: rank r's rows are rows r*B.. of the global batch the single process sees.
    ranks = [_take(_loader(tokenized, tokenizer, rank=r, world=2, batch=1), 60) for r in range(2)]
    union = [{k: torch.cat([a[k], b[k]]) for k in a} for a, b in zip(*ranks, strict=True)]
    _assert_same(union, expected)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_rows_of_every_dp_degree_assemble_the_same_global_batches(jsonl, tmp_path, world):
    _tokenize(jsonl, tmp_path / "c")
    cfg = DatasetConfig(name="tokenized", path=str(tmp_path / "c"))
    tok = ByteTokenizer()
    glob = _take(_loader(cfg, tok, batch=4), 25)
    ranks = [_take(_loader(cfg, tok, rank=r, world=world, batch=4 // world), 25) for r in range(world)]
    _assert_same([{k: torch.cat([b[k] for b in rows]) for k in rows[0]} for rows in zip(*ranks, strict=True)], glob)


def test_a_rank_copies_only_its_own_rows(jsonl, tmp_path, monkeypatch):
    _tokenize(jsonl, tmp_path / "c")
    copied = []
    real_copy = tokenized_module.CorpusStream._copy

    def counting_copy(self, doc, a, b, dest):
        copied.append(b - a)
        return real_copy(self, doc, a, b, dest)

    monkeypatch.setattr(tokenized_module.CorpusStream, "_copy", counting_copy)
    loader = _loader(DatasetConfig(name="tokenized", path=str(tmp_path / "c")), ByteTokenizer(),
                     rank=3, world=8, batch=2, seq_len=15)
    _take(loader, 10)
    assert sum(copied) == 10 * 2 * 16  # its own rows; the other 7 ranks' are never touched
    assert loader.state_dict()["windows"] == 10 * 8 * 2


@pytest.mark.parametrize("n_before", [1, 9])
@pytest.mark.parametrize("new_world", [1, 4])
def test_resume_from_two_ranks_onto_one_and_four(jsonl, tmp_path, n_before, new_world):
    _tokenize(jsonl, tmp_path / "c")
    cfg = DatasetConfig(name="tokenized", path=str(tmp_path / "c"))
    tok = ByteTokenizer()
    uninterrupted = _take(_loader(cfg, tok, batch=4, seed=11), n_before + 6)
    two = [_loader(cfg, tok, rank=r, world=2, batch=2, seed=11) for r in range(2)]
    for loader in two:
        _take(loader, n_before)
    states = [_round_trip(loader.state_dict()) for loader in two]
    assert states[0] == states[1]  # one global record
    # The new run's own seed is ignored: the saved order wins.
    resumed = [_loader(cfg, tok, rank=r, world=new_world, batch=4 // new_world, seed=99)
               for r in range(new_world)]
    for loader in resumed:
        loader.load_state_dict(states[0])
    rows = [_take(loader, 6) for loader in resumed]
    _assert_same([{k: torch.cat([b[k] for b in r]) for k in r[0]} for r in zip(*rows, strict=True)],
                 uninterrupted[n_before:])


def test_resume_needs_the_same_corpus(jsonl, tmp_path):
    _tokenize(jsonl, tmp_path / "c")
    _tokenize(jsonl, tmp_path / "d", rows_per_shard=5)  # same documents, another corpus
    tok = ByteTokenizer()
    state = _loader(DatasetConfig(name="tokenized", path=str(tmp_path / "c")), tok).state_dict()
    other = _loader(DatasetConfig(name="tokenized", path=str(tmp_path / "d")), tok)
    with pytest.raises(ValueError, match="--dataset.path"):
        other.load_state_dict(state)
    on_the_fly = _loader(_on_the_fly(jsonl, tmp_path), tok).state_dict()
    with pytest.raises(ValueError, match="on-the-fly"):
        _loader(DatasetConfig(name="tokenized", path=str(tmp_path / "c")), tok).load_state_dict(on_the_fly)
    with pytest.raises(ValueError, match="--training.seq_len"):
        _loader(DatasetConfig(name="tokenized", path=str(tmp_path / "c")), tok, seq_len=7).load_state_dict(state)


def test_a_corpus_of_another_tokenizer_is_refused(jsonl, tmp_path, hf_tokenizer_file):
    _tokenize(jsonl, tmp_path / "c")  # byte
    cfg = DatasetConfig(name="tokenized", path=str(tmp_path / "c"))
    hf = TokenizerConfig(kind="hf", path=str(hf_tokenizer_file))
    with pytest.raises(ValueError, match="--tokenizer.kind/--tokenizer.path") as err:
        validate_data_config(cfg, hf)
    assert "\n" not in str(err.value) and "byte" in str(err.value)
    with pytest.raises(ValueError, match="--tokenizer.kind"):
        _loader(cfg, hf.build())
    validate_data_config(cfg, TokenizerConfig())  # the right one passes


def test_a_damaged_corpus_is_refused(jsonl, tmp_path):
    manifest = _tokenize(jsonl, tmp_path / "c", rows_per_shard=10)
    shard = tmp_path / "c" / manifest["shards"][1]["tokens"]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="damaged.*tokens-00001.bin") as err:
        TokenizedCorpus(tmp_path / "c")
    assert "\n" not in str(err.value)
    (tmp_path / "c" / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        validate_data_config(DatasetConfig(name="tokenized", path=str(tmp_path / "c")), None)
    with pytest.raises(FileNotFoundError, match="--dataset.path"):
        validate_data_config(DatasetConfig(name="tokenized", path=str(tmp_path / "nope")), None)


# ---- mixtures ------------------------------------------------------------------------------


def _letters_corpus(tmp_path, letter, n_docs=50):
    src = tmp_path / f"{letter}.txt"
    src.write_text("".join(f"{letter * (3 + i % 9)}\n" for i in range(n_docs)))
    _tokenize(src, tmp_path / letter, cache_dir=str(tmp_path / "hf"))
    return str(tmp_path / letter)


def _mix_loader(mix, **kw):
    return _loader(DatasetConfig(name="tokenized", mix=mix), ByteTokenizer(), **kw)


def test_mixture_proportions_order_and_resume(tmp_path):
    a, b = _letters_corpus(tmp_path, "a"), _letters_corpus(tmp_path, "b")
    mix = f"{a}:0.7,{b}:0.3"
    batches = _take(_mix_loader(mix, batch=8, seq_len=7), 250)  # 2000 windows: two blocks
    rows = torch.cat([x["input_ids"] for x in batches])
    kinds = [("a" if (r == ord("a")).any() else "b") for r in rows]
    assert all(not ((r == ord("a")).any() and (r == ord("b")).any()) for r in rows)
    assert kinds[:1000].count("a") == 700 and kinds[1000:].count("a") == 700  # exact per block
    assert kinds[:1000] != kinds[1000:]  # a fresh seeded order per block
    # Window k of corpus a in the mixture is window k of corpus a read alone.
    alone = torch.cat([x["input_ids"] for x in _take(_loader(
        DatasetConfig(name="tokenized", path=a), ByteTokenizer(), batch=8, seq_len=7), 200)])
    mixed_a = rows[[i for i, k in enumerate(kinds) if k == "a"]]
    assert torch.equal(mixed_a, alone[: len(mixed_a)])
    # Deterministic given the seed; another seed orders the windows differently.
    _assert_same(_take(_mix_loader(mix, batch=8, seq_len=7), 30), batches[:30])
    other = torch.cat([x["input_ids"] for x in _take(_mix_loader(mix, batch=8, seq_len=7, seed=6), 30)])
    assert not torch.equal(other, rows[:240])
    # Resume onto another layout continues the same sequence.
    first = _mix_loader(mix, batch=8, seq_len=7)
    _take(first, 97)
    state = _round_trip(first.state_dict())
    resumed = [_mix_loader(mix, rank=r, world=2, batch=4, seq_len=7) for r in range(2)]
    for loader in resumed:
        loader.load_state_dict(state)
    got = [_take(loader, 40) for loader in resumed]
    _assert_same([{k: torch.cat([x[k], y[k]]) for k in x} for x, y in zip(*got, strict=True)], batches[97:137])
    with pytest.raises(ValueError, match="--dataset.mix"):
        _mix_loader(f"{a}:0.5,{b}:0.5", batch=8, seq_len=7).load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="tokenized"), "either --dataset.path"),
        (dict(name="tokenized", path="x", mix="x:1"), "not both"),
        (dict(name="json", path="x.jsonl", mix="x:1"), "--dataset.mix is only read"),
        (dict(name="tokenized", mix="a:0.5,b"), "PATH:WEIGHT"),
        (dict(name="tokenized", mix="a:0.5,b:-1"), "PATH:WEIGHT"),
        (dict(name="tokenized", mix="a:1,b:0.0001"), "rounds to none"),
    ],
)
def test_config_rejects_bad_tokenized_flags(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DatasetConfig(**kwargs)


def test_the_source_format_comes_from_the_file_endings(tmp_path):
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("one line\n")
    assert _tokenize(folder, tmp_path / "c", cache_dir=str(tmp_path / "hf"))["source"]["format"] == "text"
    (folder / "b.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="found text, json.*--format"):
        _tokenize(folder, tmp_path / "d")
    assert _tokenize(folder, tmp_path / "e", format="json", cache_dir=str(tmp_path / "hf"))[
        "num_documents"] == 1
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _tokenize(tmp_path / "missing.jsonl", tmp_path / "f")
