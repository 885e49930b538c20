"""`titan reward` end to end: from a language model (a transformers checkpoint, or titan's own
DCP checkpoint) to a reward model that transformers loads and `titan rl --rl.rewards model`
trains with, the scores equal everywhere."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from forked_cli import run_script, run_titan

transformers = pytest.importorskip("transformers")

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ROOT = Path(__file__).resolve().parents[1]


def _records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _hf_tokenizer(folder: Path) -> Path:
    """A small byte-level BPE tokenizer trained on sort-task strings, saved as the Hub lays one
    out, with an end-of-text and a pad token of its own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    corpus = []
    for _ in range(400):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 8)))
        corpus.append(f"sort: {word}\n{''.join(sorted(word))}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                                     pad_token="<|pad|>")
    tokenizer.save_pretrained(str(folder))
    return folder


def _language_model(folder: Path, vocab_size: int) -> Path:
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=160,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    return folder


def _transformers_scores(folder: Path, texts: list[str]) -> list[float]:
    """Each text scored alone by transformers' sequence classifier (no padding at all)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0])
                for t in texts]


@pytest.mark.slow
def test_a_transformers_language_model_becomes_a_reward_model_transformers_scores_alike(tmp_path):
    tokenizer_folder = _hf_tokenizer(tmp_path / "tokenizer")
    source = _language_model(tmp_path / "lm", vocab_size=320)
    dump = tmp_path / "reward"
    result = run_titan([
        "reward", "--config", "reward_debug", "--model.flavor", "hf", "--checkpoint.initial_load_in_hf",
        "--checkpoint.initial_load_path", source, "--tokenizer.kind", "hf", "--tokenizer.path", tokenizer_folder,
        "--training.steps", "4", "--training.seq_len", "64", "--training.local_batch_size", "4",
        "--reward_data.synthetic_examples", "64", "--reward_data.synthetic_eval_examples", "8",
        "--validation.enable", "--validation.freq", "4", "--validation.steps", "-1",
        "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--metrics.no_enable_progress_bar",
        "--job.dump_folder", dump], env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    log = result.stdout + result.stderr
    # The body came from the language model; its head did not.
    assert "this model's head ['output.weight'] starts from its initialization" in log
    assert "(the checkpoint's own head, ['lm_head.weight'], is not read)" in log
    export = dump / "checkpoint" / "step-4"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["id2label"] == {"0": "LABEL_0"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    assert config["pad_token_id"] == tokenizer.pad_token_id == tokenizer.convert_tokens_to_ids("<|pad|>")

    # What the run measured on its held-out pairs is what transformers and titan rl's scorer
    # compute from the export.
    from titan.rl.reward_data import RewardDataConfig
    from titan.rl.reward_model import RewardModel

    held_out = RewardDataConfig(synthetic_examples=64, synthetic_eval_examples=8).source(None, held_out=True).pairs
    triples = [held_out.raw_pair(i) for i in range(len(held_out))]
    record = _records(dump)[-1]
    assert record["validation_pairs"] == len(triples) == 8
    chosen = _transformers_scores(export, [p + c for p, c, _ in triples])
    rejected = _transformers_scores(export, [p + r for p, _, r in triples])
    assert record["validation_rewards_chosen"] == pytest.approx(sum(chosen) / 8, rel=1e-4, abs=1e-5)
    assert record["validation_rewards_rejected"] == pytest.approx(sum(rejected) / 8, rel=1e-4, abs=1e-5)
    assert len({round(s, 4) for s in chosen + rejected}) > 8  # the texts score apart
    scorer = RewardModel(str(export), batch_size=3)  # padded batches: the pad id in config.json
    got = scorer.score_batch([p for p, _, _ in triples], [c for _, c, _ in triples], [None] * 8)
    assert got == pytest.approx(chosen, abs=1e-5)


@pytest.mark.slow
def test_a_titan_checkpoint_gives_the_reward_model_its_body(tmp_path):
    """Warm start from titan's own DCP checkpoint of a language model: every body weight is the
    checkpoint's, the [vocab, dim] output is not read, and the score head starts fresh."""
    lm_dump = tmp_path / "lm"
    common = ["--model.flavor", "debugmodel_tiny", "--training.seq_len", "64", "--training.local_batch_size", "4",
              "--metrics.no_enable_progress_bar"]
    result = run_titan(["sft", "--config", "sft_debug", *common, "--training.steps", "2", "--checkpoint.enable",
                        "--checkpoint.interval", "2", "--job.dump_folder", lm_dump], env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    step = lm_dump / "checkpoint" / "step-2"
    dump = tmp_path / "reward"
    # A learning rate too small to move a weight: the export holds what the warm start loaded.
    result = run_titan(["reward", "--config", "reward_debug", *common, "--training.steps", "1",
                        "--optimizer.lr", "1e-12", "--checkpoint.initial_load_path", step, "--checkpoint.enable",
                        "--job.dump_folder", dump], env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    log = result.stdout + result.stderr
    assert "this model's head ['output.weight'] starts from its initialization" in log
    assert "(the checkpoint's own head, ['model.output.weight'], is not read)" in log
    # The reward model's DCP step converts to the Hub layout (its config.json names the head).
    converted = tmp_path / "reward_hf"
    result = run_script(ROOT / "tools" / "convert_hf.py", ["to-hf", dump / "checkpoint" / "step-1", converted,
                                                            "--model", "llama3"], env=ENV, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]
    assert type(transformers.AutoModelForSequenceClassification.from_pretrained(str(converted))).__name__ == \
        "LlamaForSequenceClassification"

    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(step), str(tmp_path / "lm.pt"))
    language_model = torch.load(tmp_path / "lm.pt", weights_only=False)["model"]
    exported = {}
    for name in os.listdir(converted):
        if name.endswith(".safetensors"):
            exported.update(load_file(str(converted / name)))
    from titan.models.llama3 import LLAMA3_FLAVORS, Llama3StateDictAdapter

    hub = Llama3StateDictAdapter(LLAMA3_FLAVORS["debugmodel_tiny"]).to_hf(
        {k: v for k, v in language_model.items() if k != "output.weight"})
    assert hub.keys() == exported.keys() - {"score.weight"}
    for key, value in hub.items():
        torch.testing.assert_close(exported[key].float(), value.float(), rtol=0, atol=1e-6, msg=key)
    assert exported["score.weight"].shape == (1, language_model["output.weight"].shape[1])


@pytest.mark.slow
def test_a_reward_model_is_refused_by_the_language_model_loops(tmp_path):
    from titan.models.llama3 import Llama3Model, Llama3StateDictAdapter
    from titan.models.llama3.args import Llama3Args

    args = Llama3Args(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=320, multiple_of=32, max_seq_len=128,
                      num_labels=1)
    model = Llama3Model(args)
    model.init_weights(seed=0)
    adapter = Llama3StateDictAdapter(args)
    from safetensors.torch import save_file

    folder = tmp_path / "rm"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(adapter.hf_config(torch_dtype="float32")))
    result = run_titan(["sft", "--config", "sft_debug", "--model.flavor", "hf", "--checkpoint.initial_load_in_hf",
                        "--checkpoint.initial_load_path", folder, "--training.steps", "1",
                        "--metrics.no_enable_progress_bar", "--job.dump_folder", tmp_path / "run"], env=ENV,
                       timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "the model is a sequence classifier (1-score head" in result.stderr
    assert "train the classifier with titan reward" in result.stderr


@pytest.mark.slow
def test_the_readme_flow_from_reward_debug_to_titan_rl(tmp_path):
    """The README's commands: `titan reward --config reward_debug` exported with the byte
    tokenizer's Hub form, then `titan rl --rl.rewards model` with it: every completion's reward
    is transformers' score of the prompt and completion (the reward model, of the policy's
    family, runs on titan's model code). The same folder starts PPO's critic
    (--rl.critic_model, as OpenRLHF starts its critic from the reward model), which the last
    step exports beside the policy as a reward-model folder transformers loads."""
    dump = tmp_path / "reward"
    result = run_titan(["reward", "--config", "reward_debug", "--training.steps", "4", "--checkpoint.enable",
                        "--checkpoint.last_save_in_hf", "--metrics.no_enable_progress_bar", "--job.dump_folder", dump],
                       env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    export = dump / "checkpoint" / "step-4"
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(os.listdir(export))
    rl_dump = tmp_path / "rl"
    result = run_titan([
        "rl", "--config", "grpo_debug", "--training.steps", "3", "--rl.sft_warmup_steps", "1", "--rl.eval_freq", "0",
        "--rl.ppo_epochs", "1", "--rl.prompts_per_step", "2", "--rl.group_size", "4", "--training.local_batch_size", "8",
        "--rl.rewards", "model", "--rl.reward_model", export, "--rl.log_completions", "--metrics.no_enable_progress_bar",
        "--rl.advantage_estimator", "gae", "--rl.critic_model", export, "--metrics.log_freq", "1",
        "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--job.dump_folder", rl_dump], env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"critic started from the reward model {export}" in result.stderr
    assert f"reward model {export} runs on titan's model code" in result.stderr  # the policy's family
    assert [r["step"] for r in _records(rl_dump) if "value_loss" in r] == [2, 3]
    critic = rl_dump / "checkpoint_critic" / "step-3"
    assert {"tokenizer.json", "config.json"} <= set(os.listdir(critic))
    assert {"tokenizer.json", "config.json"} <= set(os.listdir(rl_dump / "checkpoint" / "step-3"))  # the policy
    trained = transformers.AutoModelForSequenceClassification.from_pretrained(str(critic))
    assert trained.config.num_labels == 1 and type(trained).__name__ == "LlamaForSequenceClassification"
    start = transformers.AutoModelForSequenceClassification.from_pretrained(str(export))
    assert not torch.equal(trained.model.norm.weight, start.model.norm.weight)  # it trained from the reward model
    rows = [json.loads(line) for line in (rl_dump / "completions.jsonl").read_text().splitlines()]
    want = _transformers_scores(export, [r["prompt"] + r["completion"] for r in rows])
    assert len(rows) == 16 and [r["reward"] for r in rows] == pytest.approx(want, abs=1e-5)


@pytest.mark.vllm
def test_stock_vllm_serves_the_reward_model_with_transformers_scores(tmp_path, monkeypatch):
    """The export is a reward model vLLM's own Llama classifier serves (no titan code in vLLM):
    its one-label probabilities are the sigmoid of transformers' scores on the same folder."""
    pytest.importorskip("vllm", reason="vLLM is not installed: this test runs in `make test-vllm`")
    from vllm import LLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
    dump = tmp_path / "reward"
    # debugmodel: vLLM's CPU attention needs a head size of 32 or more
    result = run_titan(["reward", "--config", "reward_debug", "--model.flavor", "debugmodel", "--training.steps", "5",
                        "--checkpoint.enable", "--checkpoint.last_save_in_hf", "--metrics.no_enable_progress_bar",
                        "--job.dump_folder", dump], env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    export = dump / "checkpoint" / "step-5"
    texts = ["sort: cab\nabc", "sort: cab\nabd", "sort: zyx\nxyz"]
    # A KV cache bound of its own: without one, vLLM's CPU worker refuses to start unless 92% of
    # the host's memory is free (it failed so with 20.9 of 23.5 GiB free on 2026-12-07).
    llm = LLM(model=str(export), runner="pooling", dtype="float32", max_model_len=128, enforce_eager=True,
              kv_cache_memory_bytes=16 << 20)
    served = [float(o.outputs.probs[0]) for o in llm.classify(texts)]
    want = torch.sigmoid(torch.tensor(_transformers_scores(export, texts))).tolist()
    assert served == pytest.approx(want, abs=1e-5)
    assert max(want) - min(want) > 1e-3  # the texts score apart
