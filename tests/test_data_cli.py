"""`titan data tokenize` end to end (a subprocess, as users run it), a run killed mid-way, and
`titan train --dataset.name tokenized`."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from forked_cli import run_titan as run_forked
from titan.train.data import HFTokenizer, TokenizedCorpus

from titan.recipes.cli import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def titan(*args, **kw) -> subprocess.CompletedProcess:
    """`titan ARGS`, forked with titan imported (tests/forked_cli.py)."""
    return run_forked(args, env=ENV, timeout=600, **kw)


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    return path


@pytest.fixture
def bpe(tmp_path):
    """A small byte-level BPE tokenizer.json trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([f"line {i} of some text, words words" for i in range(200)], trainer)
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return path


def test_tokenize_command_writes_a_corpus(tmp_path, bpe):
    docs = [f"document {i}: " + "some words " * (i % 6) for i in range(50)]
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    out = tmp_path / "corpus"
    result = titan("data", "tokenize", str(src), str(out), "--tokenizer.kind", "hf",
                   "--tokenizer.path", str(bpe), "--text-field", "body", "--num-proc", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{out}: 50 documents" in result.stdout
    assert "tokens/s" in result.stderr  # the progress bar
    corpus = TokenizedCorpus(out)
    tok = HFTokenizer(bpe)
    assert [corpus.document(i).tolist() for i in range(50)] == [tok.encode(d) for d in docs]
    assert corpus.manifest["tokenizer"]["kind"] == "hf"



@pytest.mark.parametrize("extra, message", [
    (["--text_field", "nope"], "--text_field 'nope' is not a column"),
    (["--tokenizer.kind", "hf"], "--tokenizer.kind hf needs --tokenizer.path"),
    (["--num_proc", "0"], "--num_proc (0)"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--subset", "en"], "--subset 'en' names a configuration of a hub dataset"),  # local files have none
    (["--split", "validation"], "--split 'validation' is not read for SRC of format json: local files form one"),
    (["--text_sample_by", "paragraph"], "--text_sample_by paragraph splits plain text files"),
])
def test_tokenize_errors_are_one_line(tmp_path, capsys, extra, message):
    src = write_jsonl(tmp_path / "docs.jsonl", ["a", "b"])
    code = main(["data", "tokenize", str(src), str(tmp_path / "out"), "--no_progress", *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("titan data: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.incomplete").exists()


@pytest.mark.parametrize("source", ["missing.jsonl", "/no/such/folder", "./no_such_folder"])
def test_a_missing_local_source_names_src(tmp_path, capsys, source):
    """A source written as a path (absolute, ./, or with a data file's ending) that does not
    exist is named as SRC, not handed to `datasets` as a hub name."""
    source = str(tmp_path / source) if source == "missing.jsonl" else source
    code = main(["data", "tokenize", source, str(tmp_path / "out"), "--no_progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"titan data: error: SRC {source!r} does not exist"), err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_an_existing_corpus_is_kept(tmp_path, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl", ["a", "b"])
    args = ["data", "tokenize", str(src), str(tmp_path / "out"), "--no_progress", "--num_proc", "1",
            "--text_field", "body"]
    assert main(args) == 0
    before = (tmp_path / "out" / "manifest.json").read_bytes()
    assert main(args) == 2
    assert "already holds a tokenized corpus" in capsys.readouterr().err
    assert (tmp_path / "out" / "manifest.json").read_bytes() == before


HOLD_AFTER_SHARD_1 = '''
import sys, threading
from titan.train.data import corpus_writer
from titan.recipes.cli import main

real_write = corpus_writer._ShardWriter.write

def write_then_hold(self, shard, start, stop):
    entry = real_write(self, shard, start, stop)
    if shard == 1:
        threading.Event().wait()  # until killed
    return entry

corpus_writer._ShardWriter.write = write_then_hold
sys.exit(main())
'''


@pytest.mark.slow
def test_a_killed_tokenize_leaves_no_corpus_and_a_rerun_finishes_it(tmp_path, bpe):
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu ".split()
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(words, 300)) for _ in range(3000)]
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    out, work = tmp_path / "corpus", tmp_path / "corpus.incomplete"
    args = ["data", "tokenize", str(src), str(out), "--tokenizer.kind", "hf", "--tokenizer.path",
            str(bpe), "--text_field", "body", "--num_proc", "1", "--rows_per_shard", "50",
            "--no_progress"]
    # `titan data tokenize`, held after shard 1 until killed: the kill lands mid-corpus on
    # any machine (a poll racing the tokenizer to its end could lose on a loaded one).
    entry = tmp_path / "hold_after_shard_1.py"
    entry.write_text(HOLD_AFTER_SHARD_1)
    proc = subprocess.Popen([sys.executable, str(entry), *args], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300  # a guard against a hang, not part of the verdict
    while not (work / "index-00001.npy").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, "tokenize ended before it could be killed"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not out.exists()  # nothing that looks like a corpus
    stamp = (work / "index-00000.npy").stat().st_mtime_ns
    rerun = titan("data", "tokenize", *args[2:])
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert (out / "index-00000.npy").stat().st_mtime_ns == stamp  # a finished shard was kept
    assert not work.exists()
    corpus = TokenizedCorpus(out)
    tok = HFTokenizer(bpe)
    assert corpus.num_documents == len(docs)
    for i in (0, 49, 50, 1234, len(docs) - 1):
        assert corpus.document(i).tolist() == tok.encode(docs[i])


def _train(tmp_path, name, *data_flags):
    folder = tmp_path / name
    result = titan("train", "--config", "llama3_debug", "--training.steps", "4",
                   "--training.seq_len", "32", "--training.local_batch_size", "2",
                   "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
                   "--model.n_kv_heads", "4", "--metrics.log_freq", "1",
                   "--job.dump_folder", str(folder), *data_flags)
    return result, folder


@pytest.mark.slow
def test_train_on_a_tokenized_corpus_matches_on_the_fly(tmp_path):
    docs = [f"def f{i}(x):\n    return x * {i}  # " + "note " * (i % 7) for i in range(300)]
    src = write_jsonl(tmp_path / "docs.jsonl", docs)
    made = titan("data", "tokenize", str(src), str(tmp_path / "corpus"), "--text_field", "body",
                 "--num_proc", "1", "--no_progress")
    assert made.returncode == 0, made.stderr[-2000:]
    tokenized, t_folder = _train(tmp_path, "tokenized", "--dataset.name", "tokenized",
                                 "--dataset.path", str(tmp_path / "corpus"))
    assert tokenized.returncode == 0, tokenized.stderr[-3000:]
    fly, f_folder = _train(tmp_path, "fly", "--dataset.name", "json", "--dataset.path", str(src),
                           "--dataset.text_field", "body", "--dataset.cache_dir", str(tmp_path / "hf"))
    assert fly.returncode == 0, fly.stderr[-3000:]

    def losses(folder):
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows]

    assert len(losses(t_folder)) == 4
    assert losses(t_folder) == pytest.approx(losses(f_folder), rel=1e-6)  # the same batches

    mismatch, _ = _train(tmp_path, "mismatch", "--dataset.name", "tokenized", "--dataset.path",
                         str(tmp_path / "corpus"), "--tokenizer.kind", "hf", "--tokenizer.path",
                         str(_a_bpe_file(tmp_path)))
    assert mismatch.returncode == 2
    assert mismatch.stderr.strip().count("\n") == 0, mismatch.stderr
    assert "--tokenizer.kind/--tokenizer.path" in mismatch.stderr and "byte" in mismatch.stderr


def _a_bpe_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["a b c"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = tmp_path / "bpe.json"
    tok.save(str(path))
    return path


def _hub_folder(root, shards):
    """A local dataset repository in the Hub's layout (gzipped JSON Lines shards, config "en")."""
    import gzip

    (root / "en").mkdir(parents=True)
    for i, docs in enumerate(shards):
        with gzip.open(root / "en" / f"train-{i:05d}-of-{len(shards):05d}.json.gz", "wt") as f:
            f.writelines(json.dumps({"body": d, "n": 1}) + "\n" for d in docs)
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files:\n  - split: train\n    path: en/train-*.json.gz\n---\n")
    return root


def test_streamed_tokenize_writes_one_shard_per_source_file_like_the_loaded_one(tmp_path, bpe):
    shards = [[f"shard {s} document {i}: " + "words " * (i % 5) for i in range(n)] for s, n in
              enumerate([40, 0, 25, 31])]
    src = _hub_folder(tmp_path / "hub", shards)
    common = ["--subset", "en", "--tokenizer.kind", "hf", "--tokenizer.path", str(bpe), "--text_field", "body"]
    streamed = titan("data", "tokenize", str(src), str(tmp_path / "streamed"), *common, "--streaming",
                     "--num_proc", "2", "--cache_dir", str(tmp_path / "cache-s"))
    assert streamed.returncode == 0, streamed.stderr[-2000:]
    assert "4 shards" in streamed.stdout and "tokens/s" in streamed.stderr
    loaded = titan("data", "tokenize", str(src), str(tmp_path / "loaded"), *common, "--num_proc", "1",
                   "--cache_dir", str(tmp_path / "cache-l"), "--no_progress")
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    a, b = TokenizedCorpus(tmp_path / "streamed"), TokenizedCorpus(tmp_path / "loaded")
    docs = [d for shard in shards for d in shard]
    assert a.num_documents == b.num_documents == len(docs)
    tok = HFTokenizer(bpe)
    assert [a.document(i).tolist() for i in range(len(docs))] == [tok.encode(d) for d in docs]
    assert [s["num_documents"] for s in a.manifest["shards"]] == [40, 0, 25, 31]
    assert a.manifest["source"] == {**b.manifest["source"]}
    assert not list((tmp_path / "cache-s").rglob("*.arrow"))  # streamed: nothing converted


def test_a_failed_streamed_tokenize_keeps_its_finished_shards(tmp_path, bpe, monkeypatch):
    from titan.train.data import TokenizerConfig, corpus_writer, tokenize_corpus

    src = _hub_folder(tmp_path / "hub", [[f"doc {s}.{i}" for i in range(5)] for s in range(3)])
    out, work = tmp_path / "corpus", tmp_path / "corpus.incomplete"
    real = corpus_writer._write_stream_shard

    def fail_on_the_last(shard):
        if shard == 2:
            raise OSError("network gone")
        return real(shard)

    kwargs = dict(text_field="body", subset="en", streaming=True, num_proc=1, progress=False,
                  cache_dir=str(tmp_path / "cache"))
    monkeypatch.setattr(corpus_writer, "_write_stream_shard", fail_on_the_last)
    with pytest.raises(OSError, match="network gone"):
        tokenize_corpus(str(src), out, TokenizerConfig(kind="hf", path=str(bpe)), **kwargs)
    assert not out.exists() and (work / "index-00001.npy").exists() and not (work / "index-00002.npy").exists()
    stamp = (work / "index-00000.npy").stat().st_mtime_ns
    monkeypatch.setattr(corpus_writer, "_write_stream_shard", real)
    manifest = tokenize_corpus(str(src), out, TokenizerConfig(kind="hf", path=str(bpe)), **kwargs)
    assert manifest["num_documents"] == 15 and (out / "index-00000.npy").stat().st_mtime_ns == stamp


def test_streaming_takes_no_rows_per_shard(tmp_path, capsys):
    assert main(["data", "tokenize", "src.jsonl", str(tmp_path / "out"), "--streaming", "--rows_per_shard", "9"]) == 2
    assert "--rows_per_shard is not read with --streaming" in capsys.readouterr().err
