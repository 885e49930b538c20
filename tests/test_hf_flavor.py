"""`--model.flavor hf`: train a Hugging Face checkpoint of whatever size its `config.json` says
(no titan flavor of that shape needed), checked against transformers' own loss on the first
batch, one process and FSDP 2; and the inputs it needs, refused up front when missing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from forked_cli import run_titan, run_torchrun

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 32, 4
FLAGS = [
    "--config", "llama3_debug_synthetic", "--model.flavor", "hf", "--checkpoint.initial_load_in_hf",
    "--training.seq_len", str(SEQ), "--training.local_batch_size", str(BATCH), "--training.steps", "2",
    "--debug.seed", "0", "--debug.deterministic", "--metrics.log_freq", "1",
    "--metrics.no_enable_progress_bar", "--dataset.synthetic_documents", "200",
]
ENV_ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def llama_checkpoint(folder: Path, heads: int = 6) -> Path:
    """A Llama no titan flavor describes: width 96 in 6 heads of 16 (``heads``: 3 of 32, the
    smallest vLLM's CPU attention takes), an FFN of 200 (no rounding rule gives it), RoPE base
    10,000 and norm epsilon 1e-6 (titan's Llama defaults differ)."""
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads // 3, rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def qwen3_checkpoint(folder: Path) -> Path:
    """A tied Qwen3 whose head_dim (32) is not hidden_size / heads (16)."""
    config = transformers.Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    transformers.Qwen3ForCausalLM(config).save_pretrained(str(folder))
    return folder


def first_batch() -> dict[str, torch.Tensor]:
    """The batch step 1 of FLAGS' run trains on (the synthetic corpus, byte tokenizer)."""
    from titan.train.data import DatasetConfig, TokenizerConfig, build_dataloader

    loader = build_dataloader(DatasetConfig(name="synthetic", synthetic_documents=200), TokenizerConfig().build(),
                              dp_rank=0, dp_world_size=1, local_batch_size=BATCH, seq_len=SEQ, seed=0)
    return next(iter(loader))


def transformers_loss(folder: Path, *, router_aux_loss: bool = False) -> float:
    """transformers' loss on the first batch; with `router_aux_loss`, plus its router
    balancing loss (`output_router_logits`, weighted by the config's `router_aux_loss_coef`)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    batch = first_batch()
    with torch.no_grad():
        out = model(batch["input_ids"], **({"output_router_logits": True} if router_aux_loss else {}))
    loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), batch["labels"].flatten())
    if router_aux_loss:
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return float(loss)


def transformers_router_loss(folder: Path) -> float:
    """transformers' router balancing loss on the first batch, weighted by the config's
    `router_aux_loss_coef`: the part of its loss that is auxiliary."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(first_batch()["input_ids"], output_router_logits=True)
    return float(model.config.router_aux_loss_coef * out.aux_loss)


def step_records(dump: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())}


def step_losses(dump: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def test_a_llama_of_no_titan_flavor_trains_from_its_config(tmp_path):
    src = llama_checkpoint(tmp_path / "hf")
    dump = tmp_path / "run"
    result = run_titan(["train", *FLAGS, "--checkpoint.initial_load_path", src, "--job.dump_folder", dump,
                        "--checkpoint.enable", "--checkpoint.last_save_in_hf"],
                       env={**os.environ, **ENV_ONE_THREAD}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "llama3 hf: " in result.stderr  # the run names the flavor it built
    losses = step_losses(dump)
    expected = transformers_loss(src)
    assert abs(losses[1] - expected) <= 1e-5 * expected, (losses[1], expected)
    assert losses[2] < losses[1]  # and it trains

    # The export is the source model, trained: its context, special tokens and generation
    # settings, not the run's sequence length or Llama 3's token ids.
    export = dump / "checkpoint" / "step-2"
    source_config = json.loads((src / "config.json").read_text())
    config = json.loads((export / "config.json").read_text())
    for key in ("max_position_embeddings", "bos_token_id", "eos_token_id", "rms_norm_eps", "intermediate_size"):
        assert config[key] == source_config[key], key
    assert (export / "generation_config.json").read_text() == (src / "generation_config.json").read_text()
    trained = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32)
    assert trained.generation_config.eos_token_id == source_config["eos_token_id"]
    assert transformers_loss(export) < expected


def hub_cache_snapshot(cache: Path, repo_id: str) -> Path:
    """The snapshot folder of model repository `repo_id` in a Hugging Face cache at `cache`,
    laid out as huggingface_hub writes one (``refs/main`` names the snapshot's commit)."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


def test_a_chat_template_path_hub_id_reads_its_snapshot(tmp_path, monkeypatch):
    """`--sft_data.chat_template_path org/name` and `--rl_data.chat_template_path org/name`
    (TRL takes a tokenizer's repository there) become the snapshot folder of its tokenizer
    files, and `--rl.reward_model org/name` the snapshot of the reward model, read offline here; a local template file is left as it is; a repository neither
    cached nor reachable is refused naming the flag."""
    hub_constants = pytest.importorskip("huggingface_hub.constants")
    from titan.rl.config import RLConfig, RLSection
    from titan.rl.data import RLDataConfig
    from titan.train.data import SFTDataConfig
    from titan.train.sft import SFTConfig

    from titan.recipes.cli import UsageError, resolve_hub_sources

    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    snapshot = hub_cache_snapshot(cache, "tiny-org/chat")
    snapshot.mkdir(parents=True)
    (snapshot / "chat_template.jinja").write_text("{{ messages }}")
    sft = SFTConfig(sft_data=SFTDataConfig(format="chat", path="c.jsonl", chat_template_path="tiny-org/chat"))
    rl = RLConfig(rl_data=RLDataConfig(format="jsonl", path="p.jsonl", chat_template_path="tiny-org/chat"))
    assert resolve_hub_sources(sft).sft_data.chat_template_path == str(snapshot)
    assert resolve_hub_sources(rl).rl_data.chat_template_path == str(snapshot)
    local = tmp_path / "t.jinja"
    local.write_text("{{ messages }}")
    sft.sft_data.chat_template_path = str(local)
    assert resolve_hub_sources(sft).sft_data.chat_template_path == str(local)
    rm = hub_cache_snapshot(cache, "tiny-org/reward")
    rm.mkdir(parents=True)
    (rm / "config.json").write_text("{}")
    scored = RLConfig(rl=RLSection(rewards=("model",), reward_model="tiny-org/reward"))
    assert resolve_hub_sources(scored).rl.reward_model == str(rm)  # --rl.reward_model too
    distilled = RLConfig(rl=RLSection(teacher_model="tiny-org/reward", kl_in_reward_coef=1.0))
    assert resolve_hub_sources(distilled).rl.teacher_model == str(rm)  # and --rl.teacher_model
    from titan.rl.reward_data import RewardDataConfig
    from titan.rl.reward_trainer import RewardConfig

    rows = RewardConfig(reward_data=RewardDataConfig(path="p.jsonl", chat_template_path="tiny-org/chat"))
    assert resolve_hub_sources(rows).reward_data.chat_template_path == str(snapshot)  # every data section
    sft.sft_data.chat_template_path = "tiny-org/not-cached"
    with pytest.raises(UsageError, match="--sft_data.chat_template_path 'tiny-org/not-cached'"):
        resolve_hub_sources(sft)


def test_a_hub_model_id_starts_the_run_from_its_snapshot_as_transformers_reads_it(tmp_path):
    """`--checkpoint.initial_load_path org/name` (TRL's model_name_or_path) is read through
    huggingface_hub's cache, offline here: the first loss is transformers' on the snapshot's
    weights; a repository neither cached nor reachable is one line naming the flag."""
    cache = tmp_path / "hf_cache"
    src = llama_checkpoint(hub_cache_snapshot(cache, "tiny-org/tiny-llama"))
    env = {**os.environ, **ENV_ONE_THREAD, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    dump = tmp_path / "run"
    result = run_titan(["train", *FLAGS, "--checkpoint.initial_load_path", "tiny-org/tiny-llama",
                        "--job.dump_folder", dump], env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"tiny-org/tiny-llama from the Hugging Face Hub: {src}" in result.stderr
    losses, expected = step_losses(dump), transformers_loss(src)
    assert abs(losses[1] - expected) <= 1e-5 * expected, (losses[1], expected)

    # A snapshot with the model's own tokenizer: adopted when no tokenizer is named, and named
    # by its id in the flags to add when the byte tokenizer is typed.
    with_bpe_tokenizer(src)
    adopted = run_titan(["train", *FLAGS, "--checkpoint.initial_load_path", "tiny-org/tiny-llama",
                         "--job.dump_folder", tmp_path / "adopted"], env=env, timeout=300)
    assert adopted.returncode == 0 and "tokenizing with tiny-org/tiny-llama's own tokenizer" in adopted.stderr, \
        adopted.stderr[-3000:]
    byte = run_titan(["train", *FLAGS, "--checkpoint.initial_load_path", "tiny-org/tiny-llama", "--tokenizer.kind",
                      "byte", "--job.dump_folder", tmp_path / "byte"], env=env, timeout=300)
    assert byte.returncode == 2 and ("tiny-org/tiny-llama holds the model's own tokenizer.json, but this run "
                                     "tokenizes with the byte tokenizer") in byte.stderr, byte.stderr[-3000:]
    assert "Add --tokenizer.kind hf --tokenizer.path tiny-org/tiny-llama" in byte.stderr

    missing = run_titan(["train", *FLAGS, "--checkpoint.initial_load_path", "tiny-org/not-cached",
                         "--job.dump_folder", tmp_path / "missing"], env=env, timeout=300)
    errors = [line for line in missing.stderr.splitlines() if line.startswith("titan train: error: ")]
    assert missing.returncode == 2 and len(errors) == 1, missing.stderr[-3000:]
    assert ("--checkpoint.initial_load_path 'tiny-org/not-cached' is no local folder, so it is read from the "
            "Hugging Face Hub, which could not be reached") in errors[0]


def test_a_hub_tokenizer_id_is_its_cached_snapshot(tmp_path, monkeypatch):
    """`--tokenizer.path org/name` (kind hf) reads the tokenizer of the repository's snapshot."""
    import huggingface_hub.constants as hub_constants

    from titan.recipes.cli import parse_train_args, resolve_hub_sources

    cache = tmp_path / "hf_cache"
    snapshot = hub_cache_snapshot(cache, "tiny-org/tiny-tokenizer")
    snapshot.mkdir(parents=True)
    tok = with_bpe_tokenizer(snapshot)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    config = resolve_hub_sources(parse_train_args(["--config", "llama3_debug", "--tokenizer.kind", "hf",
                                                   "--tokenizer.path", "tiny-org/tiny-tokenizer"]))
    assert config.tokenizer.path == str(snapshot)
    # --tokenizer.revision reads another snapshot (here a tag naming the same commit), and a
    # revision for a local path or the byte tokenizer is refused.
    (snapshot.parents[1] / "refs" / "v1").write_text(snapshot.name)
    tagged = resolve_hub_sources(parse_train_args(["--config", "llama3_debug", "--tokenizer.kind", "hf", "--tokenizer.path",
                                                   "tiny-org/tiny-tokenizer", "--tokenizer.revision", "v1"]))
    assert tagged.tokenizer.path == str(snapshot)
    from titan.train.data import TokenizerConfig

    with pytest.raises(ValueError, match="--tokenizer.revision 'v1' is only read with --tokenizer.kind hf"):
        TokenizerConfig(revision="v1")
    from titan.ckpt import CheckpointConfig

    with pytest.raises(ValueError, match="--checkpoint.initial_load_revision 'v1' picks a revision of a Hub model"):
        CheckpointConfig(initial_load_path="org/name", initial_load_revision="v1")
    text = "def f(x):\n    return x + 1\n"
    assert config.tokenizer.build().encode(text) == tok.encode(text).ids

    # `titan data tokenize` takes the same id.
    from titan.train.data import TokenizedCorpus

    from titan.recipes.cli import main

    docs = [f"def f(x):\n    return x + {i}\n" for i in range(5)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert main(["data", "tokenize", str(tmp_path / "docs.jsonl"), str(tmp_path / "corpus"), "--no_progress",
                 "--num_proc", "1", "--tokenizer.kind", "hf", "--tokenizer.path", "tiny-org/tiny-tokenizer"]) == 0
    corpus = TokenizedCorpus(tmp_path / "corpus")
    assert [corpus.document(i).tolist() for i in range(5)] == [tok.encode(d).ids for d in docs]


def test_the_dry_run_sizes_a_hub_model_id_from_its_config_alone(tmp_path, monkeypatch, capsys):
    """`titan dry-run` on a Hub id needs the config, not the weights: a snapshot holding only
    `config.json` and the tokenizer (what it fetches) sizes the model, and the model's own
    tokenizer is taken as `titan train` takes it."""
    import huggingface_hub.constants as hub_constants

    from titan.recipes.cli import main

    cache = tmp_path / "hf_cache"
    snapshot = hub_cache_snapshot(cache, "tiny-org/tiny-llama")
    llama_checkpoint(tmp_path / "full")
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    with_bpe_tokenizer(snapshot)  # the dry run tokenizes as the run would: with the model's own
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    rc = main(["dry-run", "--world_size", "2", *FLAGS, "--checkpoint.initial_load_path", "tiny-org/tiny-llama"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    assert "llama3 hf: " in captured.out and "(vocab 320 from the checkpoint's config.json)" in captured.out
    assert "titan: tokenizing with tiny-org/tiny-llama's own tokenizer" in captured.err


def test_convert_hf_reads_a_hub_model_id_from_the_cache(tmp_path, monkeypatch):
    """`tools/convert_hf.py from-hf org/name OUT`: the snapshot's weights, under titan's names."""
    import importlib.util

    import huggingface_hub.constants as hub_constants
    from safetensors.torch import load_file
    from titan.ckpt import load_dcp_model

    cache = tmp_path / "hf_cache"
    src = llama_checkpoint(hub_cache_snapshot(cache, "tiny-org/tiny-llama"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    spec = importlib.util.spec_from_file_location("convert_hf", Path(__file__).parents[1] / "tools" / "convert_hf.py")
    convert_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert_hf)
    convert_hf.main(["from-hf", "tiny-org/tiny-llama", str(tmp_path / "dcp"), "--model", "llama3"])
    hub = load_file(str(src / "model.safetensors"))
    titan = load_dcp_model(str(tmp_path / "dcp"))
    assert torch.equal(titan["tok_embeddings.weight"], hub["model.embed_tokens.weight"])
    assert torch.equal(titan["layers.1.feed_forward.w2.weight"], hub["model.layers.1.mlp.down_proj.weight"])
    with pytest.raises(SystemExit, match="SRC 'tiny-org/absent' is no local folder"):
        convert_hf.main(["from-hf", "tiny-org/absent", str(tmp_path / "dcp2"), "--model", "llama3"])


def test_a_tied_qwen3_trains_from_its_config_under_fsdp2_as_in_one_process(tmp_path):
    src = qwen3_checkpoint(tmp_path / "hf")
    flags = [*FLAGS, "--model.name", "qwen3", "--checkpoint.initial_load_path", str(src)]
    env = {**os.environ, **ENV_ONE_THREAD}
    one = run_titan(["train", *flags, "--job.dump_folder", tmp_path / "one"], env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-4000:]
    two = run_torchrun(["--nproc_per_node", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0",
                        "-m", "titan.recipes.cli", "train", *flags, "--parallelism.data_parallel_shard_degree", "2",
                        "--training.local_batch_size", str(BATCH // 2), "--job.dump_folder", tmp_path / "two"],
                       env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-4000:]
    expected = transformers_loss(src)
    single, sharded = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert abs(single[1] - expected) <= 1e-5 * expected, (single[1], expected)
    for step in (1, 2):
        assert abs(sharded[step] - single[step]) <= 1e-5 * single[step], (step, sharded, single)


@pytest.mark.parametrize("case", ["no_hf_load", "other_family", "no_config"])
def test_what_the_hf_flavor_needs_is_refused_before_any_work(case, tmp_path):
    src = llama_checkpoint(tmp_path / "hf")
    flags = [*FLAGS, "--checkpoint.initial_load_path", str(src), "--job.dump_folder", str(tmp_path / "run")]
    expected = {
        "no_hf_load": "--model.flavor hf takes the architecture of the Hugging Face checkpoint the run starts "
                      "from: add --checkpoint.initial_load_path HF_FOLDER --checkpoint.initial_load_in_hf",
        "other_family": "is a 'llama' model, not --model.name qwen3's: run it with --model.name llama3",
        "no_config": "--model.flavor hf reads",
    }[case]
    if case == "no_hf_load":
        flags.remove("--checkpoint.initial_load_in_hf")
    elif case == "other_family":
        flags += ["--model.name", "qwen3"]
    else:
        (src / "config.json").unlink()
    result = run_titan(["train", *flags], timeout=120)
    assert result.returncode == 2 and expected in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def with_bpe_tokenizer(src: Path):
    """`src` with a tiny byte-level BPE (`tokenizer.json` + `tokenizer_config.json`); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 50, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok


def export_of_a_fine_tune(tmp_path: Path, steps: int, heads: int = 6):
    """(the HF export of `steps` steps on the llama checkpoint with a BPE tokenizer, the tokenizer)."""
    src = llama_checkpoint(tmp_path / "hf", heads)
    tok = with_bpe_tokenizer(src)
    dump = tmp_path / "run"
    result = run_titan(["train", "--config", "llama3_debug", "--model.flavor", "hf", "--checkpoint.initial_load_in_hf",
                        "--checkpoint.initial_load_path", src, "--tokenizer.kind", "hf", "--tokenizer.path", src,
                        "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", str(steps),
                        "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--job.dump_folder", dump],
                       env={**os.environ, **ENV_ONE_THREAD}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return dump / "checkpoint" / f"step-{steps}", tok


def test_the_dry_run_sizes_the_hf_flavor_from_the_checkpoints_config(tmp_path, capsys):
    """`titan dry-run --model.flavor hf` builds the folder's architecture and says where its
    vocabulary came from (it once named --model.vocab_size, a flag the user never set)."""
    from titan.recipes.cli import main

    src = llama_checkpoint(tmp_path / "hf")
    rc = main(["dry-run", "--world_size", "2", *FLAGS, "--checkpoint.initial_load_path", str(src)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "llama3 hf: " in out and "(vocab 320 from the checkpoint's config.json)" in out


def test_the_export_is_a_folder_transformers_loads_with_its_tokenizer(tmp_path):
    """A run with a Hugging Face tokenizer exports it beside the weights: `from_pretrained`
    loads model and tokenizer from the one folder, as a Hub download."""
    export, tok = export_of_a_fine_tune(tmp_path, steps=1)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in export.iterdir()}
    text = "def g(y):\n    return y\n"
    ours = transformers.AutoTokenizer.from_pretrained(str(export))
    assert ours(text)["input_ids"] == tok.encode(text).ids and ours.eos_token == "</s>"
    transformers.AutoModelForCausalLM.from_pretrained(str(export))


@pytest.mark.vllm
def test_stock_vllm_serves_the_export_as_transformers_runs_it(tmp_path, monkeypatch):
    """The export is a folder vLLM's own Llama loads, tokenizer included (no titan code in
    vLLM); its greedy tokens equal transformers' on the same folder."""
    pytest.importorskip("vllm", reason="vLLM is not installed: this test runs in `make test-vllm`")
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    export, _ = export_of_a_fine_tune(tmp_path, steps=20, heads=3)
    prompt = "def f(x):\n"
    llm = LLM(model=str(export), dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
              kv_cache_memory_bytes=64 << 20)
    served = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert list(served.prompt_token_ids) == ids[0].tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    expected = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:].tolist()
    got = list(served.outputs[0].token_ids)
    assert got == expected[:len(got)] and len(got) >= 1


def test_an_export_without_a_source_folder_names_the_run_tokenizer_special_tokens(tmp_path):
    """Pretraining from scratch with a Hub tokenizer: the export's config says where its
    tokenizer's BOS and EOS are, so transformers' `generate` stops at that EOS."""
    folder = tmp_path / "tok"
    folder.mkdir()
    tok = with_bpe_tokenizer(folder)
    dump = tmp_path / "run"
    result = run_titan(["train", "--config", "llama3_debug", "--model.flavor", "debugmodel_tiny", "--tokenizer.kind", "hf",
                        "--tokenizer.path", folder, "--training.seq_len", "32", "--training.local_batch_size", "2",
                        "--training.steps", "1", "--checkpoint.enable", "--checkpoint.last_save_in_hf",
                        "--job.dump_folder", dump], env={**os.environ, **ENV_ONE_THREAD}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    config = json.loads((dump / "checkpoint" / "step-1" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.token_to_id("<s>"), tok.token_to_id("</s>")) == (1, 2)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(dump / "checkpoint" / "step-1"))
    assert model.generation_config.eos_token_id == 2


def test_a_source_folder_with_its_own_tokenizer_is_not_tokenized_otherwise(tmp_path):
    """A Hub model that brings its own tokenizer is tokenized with it when the command line
    names none (as TRL loads the tokenizer beside the weights; the recipe's byte tokenizer
    would train the pretrained weights on other ids). The byte tokenizer typed on purpose is
    refused, with the flags; a Hub tokenizer of another vocabulary is warned about; the
    folder's own is quiet."""
    src = llama_checkpoint(tmp_path / "hf")
    tok = with_bpe_tokenizer(src)
    flags = [*FLAGS, "--checkpoint.initial_load_path", str(src), "--training.steps", "1"]
    env = {**os.environ, **ENV_ONE_THREAD}
    adopted = run_titan(["train", *flags, "--checkpoint.enable", "--checkpoint.last_save_in_hf",
                         "--job.dump_folder", str(tmp_path / "adopted")], env=env, timeout=300)
    assert adopted.returncode == 0, adopted.stderr[-3000:]
    assert f"titan: tokenizing with {src}'s own tokenizer" in adopted.stderr
    # The export carries the tokenizer it was trained with: the folder's own, not bytes.
    exported = tmp_path / "adopted" / "checkpoint" / "step-1" / "tokenizer.json"
    assert json.loads(exported.read_text())["model"]["vocab"] == json.loads(tok.to_str())["model"]["vocab"]

    byte = run_titan(["train", *flags, "--tokenizer.kind", "byte", "--job.dump_folder", str(tmp_path / "byte")],
                     timeout=120)
    assert byte.returncode == 2 and "Traceback" not in byte.stderr
    assert (f"{src} holds the model's own tokenizer.json, but this run tokenizes with the byte tokenizer: the "
            f"pretrained weights would see other token ids. Add --tokenizer.kind hf --tokenizer.path {src}") in byte.stderr
    assert not (tmp_path / "byte" / "metrics.jsonl").exists()

    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text((src / "tokenizer.json").read_text().replace('"<pad>"', '"<unused>"'))
    for tokenizer, warned in ((other, True), (src, False)):
        run = run_titan(["train", *flags, "--tokenizer.kind", "hf", "--tokenizer.path", str(tokenizer),
                         "--job.dump_folder", str(tmp_path / f"run_{warned}")], env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        assert (f"--tokenizer.path {other} has another vocabulary than {src / 'tokenizer.json'}" in run.stderr) is warned


def test_hf_weights_load_one_block_at_a_time_and_a_stage_reads_only_its_own(tmp_path, monkeypatch):
    """Importing Hub weights holds one block's tensors at a time (every rank of a large job
    imports them), and a pipeline stage reads only the blocks it holds; the values are the
    checkpoint's."""
    from titan.ckpt import CheckpointConfig, CheckpointManager, hf, save_hf
    from titan.models.llama3 import Llama3StateDictAdapter, build_llama3

    def model():
        with torch.device("meta"):
            built = build_llama3("debugmodel_tiny", vocab_size=320, max_seq_len=64)
        built.to_empty(device="cpu")
        with torch.no_grad():
            built.init_weights(seed=len(os.listdir(tmp_path)))  # another seed per model
        return built

    source = model()
    adapter = Llama3StateDictAdapter(source.args)
    save_hf(source.state_dict(), str(tmp_path / "hf"), adapter)
    n_layers = source.args.n_layers
    assert n_layers >= 2

    stage = model()  # a last pipeline stage: the blocks from 1 on, the norm and the output
    del stage.layers["0"]
    stage.tok_embeddings = None
    converted: list[set[str]] = []
    real_from_hf = adapter.from_hf
    monkeypatch.setattr(adapter, "from_hf", lambda sd: converted.append(set(sd)) or real_from_hf(sd))
    manager = CheckpointManager(CheckpointConfig(initial_load_path=str(tmp_path / "hf"), initial_load_in_hf=True),
                                dump_folder=str(tmp_path / "run"), states={}, model_parts=[stage], hf_adapter=adapter)
    manager.load()
    manager.close()

    blocks = [{hf.layer_of(key) for key in keys} for keys in converted]
    assert blocks == [{None}, *({i} for i in range(1, n_layers))]  # one block per conversion, never block 0
    expected = source.state_dict()
    for key, value in stage.state_dict().items():
        assert torch.equal(value, expected[key]), key


def moe_checkpoint(family: str, folder: Path) -> Path:
    """A tiny Hub-layout MoE of the family (per-expert tensors, as `save_pretrained` writes)."""
    torch.manual_seed(2)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
            max_position_embeddings=256, router_aux_loss_coef=0.05)  # titan reads it from config.json
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.DeepseekV3Config(
            vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256)
        model = transformers.DeepseekV3ForCausalLM(config)
    model.save_pretrained(str(folder))
    return folder


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_hub_moe_trains_from_its_config_with_transformers_first_loss(family, tmp_path):
    """The MoE families through the same path: experts stacked block by block on import; the
    first step's loss is transformers' on the same batch (Qwen3-MoE's with the router
    balancing loss of its config.json, pooled over both MoE layers as transformers does)."""
    src = moe_checkpoint(family, tmp_path / "hf")
    dump = tmp_path / "run"
    result = run_titan(["train", *FLAGS, "--model.name", family, "--checkpoint.initial_load_path", src,
                        "--job.dump_folder", dump], env={**os.environ, **ENV_ONE_THREAD}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    expected = transformers_loss(src, router_aux_loss=family == "qwen3_moe")
    got = step_losses(dump)[1]
    assert abs(got - expected) <= 1e-5 * expected, (got, expected)
    # The auxiliary part is logged on its own too: transformers' router loss for Qwen3-MoE;
    # none for DeepSeek-V3, whose Hub config trains with its selection bias alone.
    aux = step_records(dump)[1]["aux_loss"]
    expected_aux = transformers_router_loss(src) if family == "qwen3_moe" else 0.0
    assert abs(aux - expected_aux) <= 1e-5 * max(expected_aux, 1e-3), (aux, expected_aux)
    assert family != "qwen3_moe" or expected_aux > 0.05  # coef 0.05 x a balance loss near top_k (2)


def qwen3_moe_checkpoint(folder: Path) -> Path:
    """A Hub-layout Qwen3-MoE with vLLM's CPU attention's smallest head (32): a dense first
    layer, 4 experts top 2."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[0], max_position_embeddings=256)
    torch.manual_seed(3)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(str(folder))
    return folder


@pytest.mark.vllm
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_stock_vllm_serves_a_qwen_export_as_transformers_runs_it(family, tmp_path, monkeypatch):
    """A titan fine-tune of a Hub Qwen3 (tied, head_dim 32 != width / heads) or Qwen3-MoE,
    exported, runs in stock vLLM's own Qwen3 / Qwen3-MoE (no titan code) with transformers'
    greedy tokens on the same folder."""
    pytest.importorskip("vllm", reason="vLLM is not installed: this test runs in `make test-vllm`")
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    src = (qwen3_checkpoint if family == "qwen3" else qwen3_moe_checkpoint)(tmp_path / "hf")
    dump = tmp_path / "run"
    result = run_titan(["train", *FLAGS, "--model.name", family, "--checkpoint.initial_load_path", src,
                        "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--job.dump_folder", dump],
                       env={**os.environ, **ENV_ONE_THREAD}, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    export = dump / "checkpoint" / "step-2"
    prompt = first_batch()["input_ids"][0, :12].tolist()
    # An in-process engine keeps the model-parallel groups of this process's first model, which
    # has no expert-parallel group when it was dense: start them afresh for this model.
    from vllm.distributed.parallel_state import destroy_model_parallel

    destroy_model_parallel()
    llm = LLM(model=str(export), dtype="float32", max_model_len=128, enforce_eager=True, seed=0,
              skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20)
    served = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12,
                                                                          detokenize=False))[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    expected = model.generate(ids, max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    got = list(served.outputs[0].token_ids)
    assert got == expected[:len(got)] and len(got) >= 1
