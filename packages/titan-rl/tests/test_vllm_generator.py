"""The vLLM generator, for real: vLLM runs titan's model code (`make test-vllm`).

Each family's checkpoint is a random `transformers` model written with `save_pretrained`; vLLM
reads it through the registered titan class, titan imports it through the family's adapter. Greedy tokens must equal `transformers`' and the native
generator's, and vLLM's log-probs titan's own forward on the same tokens. Weight updates from a
trainer that took optimizer steps must move vLLM's log-probs to the new weights' (and a partial
update is refused); seeded sampling reproduces.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: these tests run in `make test-vllm`")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from titan.rl.generate import NativeGenerator, SamplingConfig  # noqa: E402
from titan.rl.generate.vllm import VLLMGenerator  # noqa: E402
from titan.rl.generate.vllm.plugin import FAMILY_ARCHITECTURES  # noqa: E402

from titan.recipes.families import model_spec  # noqa: E402

# fp32 log-probs of the same weights on the same tokens: vLLM's paged CPU kernels and titan's
# SDPA and GEMMs sum in different orders, with the host's vector width. A token's log-prob is a
# difference of logits of magnitude ~10 and their logsumexp, each the end of a chain of ~10
# reductions (2 blocks' projections, attention and MLP, then the head) whose relative rounding
# differences (a few fp32 ulps, 1.2e-7 each) add up: tens of ulps at magnitude 10, i.e. 1e-5 to
# 5e-5. Measured max: under 1e-5 on AVX-512 hosts, 1.1e-5 (one engine) and 1.6e-5 (the trainer
# after updates) on an AVX2 AMD EPYC (2026-12-07), where 1e-5, the bound first used, failed.
LOGPROB_ATOL = 5e-5
TINY = {"vocab_size": 320, "max_seq_len": 64, "dim": 64, "n_heads": 2, "n_kv_heads": 1, "n_layers": 2}
# Llama keeps debugmodel_tiny's 4 heads of 16 channels: below the CPU kernels' smallest head
# size (32), so vLLM runs it zero-padded (checked below); the Qwen families run 2 heads of 32.
HEADS = {"llama3": {"n_heads": 4, "n_kv_heads": 2}}
FLAVORS = {"llama3": "debugmodel_tiny", "qwen3": "debugmodel", "qwen3_moe": "debugmodel",
           "deepseek_v3": "debugmodel_tiny"}
HF_CLASSES = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "deepseek_v3": "DeepseekV3ForCausalLM"}
# DeepSeek-V3's tiny flavor keeps its own MLA shape (4 heads, q/k 16 + 8 channels, v 16):
# vLLM runs it zero-padded to the CPU kernels' 32 channels.
PADS = {"llama3": 16, "deepseek_v3": 32 - 24}
PROMPTS = [[5, 17, 33, 2, 9], [100, 101, 102], [7, 8, 9, 10, 11, 12, 13, 14]]


def hf_checkpoint(family: str, folder):
    """A random `transformers` model of `family` (tiny titan flavor's config, every weight
    perturbed, the MoE router sharpened away from ties) written with `save_pretrained`, and
    the titan model imported from that folder through the family's adapter."""
    spec = model_spec(family)
    overrides = {**TINY, **HEADS.get(family, {})}
    if family == "qwen3_moe":
        overrides.pop("n_layers")
    if family == "deepseek_v3":
        overrides = {"vocab_size": TINY["vocab_size"], "max_seq_len": TINY["max_seq_len"]}
    with torch.device("meta"):
        meta = spec.build(FLAVORS[family], **overrides)
    config = spec.adapter(meta).hf_config(torch_dtype="float32")
    hf_class = getattr(transformers, HF_CLASSES[family])
    torch.manual_seed(0)
    hf_model = hf_class(hf_class.config_class(**config)).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.add_(torch.randn_like(param) * (1.0 if "gate." in name else 0.1))
    hf_model.save_pretrained(folder)
    state = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(safetensors_torch.load_file(str(path)))
    adapter = spec.adapter(meta)
    model = spec.build(FLAVORS[family], **overrides)
    model.load_state_dict(adapter.from_hf(state), strict=True)
    return model.eval(), overrides


@pytest.fixture(scope="module", params=list(FAMILY_ARCHITECTURES))
def family_setup(request, tmp_path_factory):
    """Per family: the titan model, a Hub checkpoint of it, and vLLM reading that checkpoint."""
    family = request.param
    folder = tmp_path_factory.mktemp(f"hf-{family}")
    model, overrides = hf_checkpoint(family, folder)
    generator = VLLMGenerator(None, architecture=FAMILY_ARCHITECTURES[family], checkpoint=folder,
                              kv_cache_memory_bytes=32 << 20, max_num_seqs=16)
    yield family, model, overrides, folder, generator
    del generator


def test_greedy_tokens_equal_transformers_and_native(family_setup):
    family, model, _, folder, generator = family_setup
    greedy = SamplingConfig(temperature=0, max_new_tokens=12)
    got = [g[0].token_ids for g in generator.generate(PROMPTS, greedy)]
    native = NativeGenerator(model, device="cpu")
    assert got == [g[0].token_ids for g in native.generate(PROMPTS, greedy)]
    hf = getattr(transformers, HF_CLASSES[family]).from_pretrained(folder, attn_implementation="eager").eval()
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tokens
    pads = generator.llm.apply_model(lambda m: [b.attention.inner_attention.pad for b in m.model.layers.values()])[0]
    assert pads == [PADS.get(family, 0)] * len(pads)


def test_repetition_penalty_and_min_p_decode_as_native_and_transformers(family_setup):
    """--sampling.repetition_penalty reaches vLLM: greedy tokens under a penalty of 1.5 equal
    the native generator's and transformers' `generate(repetition_penalty=1.5)`, and differ
    from plain greedy; min_p 1.0 keeps only the argmax, so sampling with it is greedy."""
    family, model, _, folder, generator = family_setup
    if family != "llama3":
        pytest.skip("one family suffices: the penalty is the sampler's, not the model's")
    penalized = SamplingConfig(temperature=0, max_new_tokens=12, repetition_penalty=1.5)
    got = [g[0].token_ids for g in generator.generate(PROMPTS, penalized)]
    assert got == [g[0].token_ids for g in NativeGenerator(model, device="cpu").generate(PROMPTS, penalized)]
    greedy = [g[0].token_ids for g in generator.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=12))]
    assert got != greedy
    hf = getattr(transformers, HF_CLASSES[family]).from_pretrained(folder, attn_implementation="eager").eval()
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                          repetition_penalty=1.5, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == tokens
    only_argmax = SamplingConfig(temperature=1.0, min_p=1.0, max_new_tokens=12, n=2, seed=1)
    assert [[c.token_ids for c in g] for g in generator.generate(PROMPTS, only_argmax)] == [[t, t] for t in greedy]


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_equal_titans_forward(family_setup, temperature):
    _, model, _, _, generator = family_setup
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=10, n=2, seed=3)
    completions = [c for group in generator.generate(PROMPTS, sampling) for c in group]
    rescored = NativeGenerator(model, device="cpu").rescore(completions, temperature=temperature or 1.0)
    diffs = [abs(a - b) for c, r in zip(completions, rescored, strict=True) for a, b in zip(c.logprobs, r, strict=True)]
    assert len(diffs) == sum(len(c.token_ids) for c in completions) > 0
    assert max(diffs) < LOGPROB_ATOL


def test_top_k_and_top_p_filter_and_report_the_filtered_distribution(family_setup):
    """top-k 1 (and a tiny top-p) keep only the argmax: sampling is greedy, and vLLM's
    processed log-prob is that of the filtered distribution, log 1 = 0 (the documented
    difference from the native generator, which reports the unfiltered one)."""
    *_, generator = family_setup
    greedy = [g[0].token_ids for g in generator.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6))]
    for filtered in (SamplingConfig(temperature=1.0, top_k=1, max_new_tokens=6, n=2, seed=1),
                     SamplingConfig(temperature=1.0, top_p=1e-6, max_new_tokens=6, n=2, seed=1)):
        groups = generator.generate(PROMPTS, filtered)
        assert [[c.token_ids for c in g] for g in groups] == [[t, t] for t in greedy]
        assert all(abs(lp) < 1e-6 for g in groups for c in g for lp in c.logprobs)


def test_seeded_sampling_reproduces_and_seeds_differ(family_setup):
    *_, generator = family_setup

    def run(seed):
        groups = generator.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=8, n=3, seed=seed))
        return [[c.token_ids for c in g] for g in groups]

    first = run(11)
    assert run(11) == first
    assert run(12) != first
    # The n completions of a prompt are distinct draws, not copies of one stream.
    assert any(len({tuple(t) for t in group}) > 1 for group in first)


def test_stop_tokens_end_a_completion_and_are_kept(family_setup):
    *_, generator = family_setup
    free = generator.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=8))[0][0]
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    stopped = generator.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=8, stop_token_ids=(stop,)))[0][0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and free.finish_reason == "length"


def test_only_titans_stop_tokens_end_a_completion(family_setup):
    """vLLM's own eos (the model config's `eos_token_id`) must not end a completion: titan
    passes its tokenizer's eos and --sampling.stop_token_ids explicitly."""
    family, model, _, _, generator = family_setup
    if family != "llama3":
        pytest.skip("one family suffices: the stop rule is the generator's, not the model's")
    free = generator.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=8))[0][0]
    config = model_spec(family).adapter(model).hf_config(torch_dtype="float32")
    config["eos_token_id"] = free.token_ids[2]  # what vLLM would otherwise stop at
    other = VLLMGenerator(config, architecture=FAMILY_ARCHITECTURES[family], kv_cache_memory_bytes=16 << 20)
    other.load_weights(model.state_dict().items(), version=1)
    again = other.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=8))[0][0]
    assert again.token_ids == free.token_ids and again.finish_reason == "length"


def load_sync_worker():
    """The weight-sync tests' helpers (a 1-process TrainingEngine and its train step)."""
    path = Path(__file__).with_name("sync_worker.py")
    spec = importlib.util.spec_from_file_location("rl_sync_worker_vllm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_weight_updates_from_a_training_engine_move_vllms_logprobs(family, tmp_path, monkeypatch):
    """vLLM generates with the trainer's weights after each sync (optimizer steps between
    syncs): its log-probs equal the trainer's forward within LOGPROB_ATOL and differ from the old
    weights'; a partial update raises and leaves the version where it was.

    MoE: after training, the balancing bias (a buffer the optimizer step moves) must be in
    the model vLLM runs. Its log-probs are compared before training only: the trained bias
    shifts every expert's score by the same +-0.001 steps, so the second expert of a token is
    then chosen among near-equal biased scores, and two kernels' last-bit differences may pick
    different ones — a tie, not a sync error (the checksums of `sync_colocated` are exact)."""
    from titan.rl.weight_sync import sync_colocated

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    worker = load_sync_worker()
    spec = model_spec(family)
    tiny = family in ("llama3", "deepseek_v3")  # flavors already test-sized
    flavor = "debugmodel_tiny" if tiny else "debugmodel"
    overrides = {} if tiny else {"dim": 64, "n_heads": 2, "n_kv_heads": 1}
    engine = worker.make_engine(str(tmp_path), flavor=flavor, spec=spec, overrides=overrides)
    sharpen_routers(engine.model_parts[0])
    generator = VLLMGenerator.from_model_spec(
        spec, flavor, overrides={**overrides, "vocab_size": worker.VOCAB, "max_seq_len": worker.SEQ},
        kv_cache_memory_bytes=16 << 20, max_num_seqs=16,
    )
    prompts = [p[:4] for p in PROMPTS]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, n=2, seed=0)
    try:
        previous = None
        for version in (1, 2):
            if version == 2:
                for _ in range(3):
                    worker.train_step(engine)
            stats = sync_colocated(engine, generator, version=version)  # checksums verified too
            assert generator.version == stats.version == version
            completions = [c for g in generator.generate(prompts, sampling) for c in g]
            assert all(c.version == version for c in completions)
            got = [lp for c in completions for lp in c.logprobs]
            if family in ("qwen3_moe", "deepseek_v3") and version == 2:
                trained = dict(engine.full_state_dict())
                biases = [n for n in trained if n.endswith("expert_bias")]
                held = dict(generator.named_weights())
                assert biases and all(torch.equal(held[n], trained[n]) for n in biases)
                assert any(trained[n].abs().sum() > 0 for n in biases)
            else:
                trainer = trainer_logprobs(engine.model_parts[0], completions)
                assert max(abs(a - b) for a, b in zip(got, trainer, strict=True)) < LOGPROB_ATOL
            if previous is not None:  # the same tokens now score differently: the update took
                assert max(abs(a - b) for a, b in zip(trainer_logprobs(previous, completions), got, strict=True)) > 1e-3
            previous = copy.deepcopy(engine.model_parts[0])
        partial = [(n, t) for n, t in engine.full_state_dict() if not n.endswith("ffn_norm.weight")]
        with pytest.raises(ValueError, match="left .* state_dict entries unset"):
            generator.load_weights(partial, version=3)
        assert generator.version == 2
    finally:
        engine.close()


@torch.no_grad()
def sharpen_routers(model) -> None:
    """Scale MoE router weights up: at init every expert scores alike, and a routing near-tie
    that float rounding breaks differently in two kernels would pick different experts."""
    for name, param in model.named_parameters():
        if name.endswith("router.gate.weight"):
            param.mul_(100.0)


@torch.no_grad()
def trainer_logprobs(model, completions) -> list[float]:
    """The trainer's log-probs of each completion's tokens (T = 1), flattened."""
    out = []
    for c in completions:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        logp = torch.log_softmax(model(ids)[0, :-1].float(), dim=-1)
        targets = torch.tensor(c.token_ids)
        out += logp[len(c.prompt_ids) - 1 :].gather(-1, targets[:, None]).squeeze(-1).tolist()
    return out


def test_grpo_debug_with_vllm_raises_held_out_reward(tmp_path):
    """`titan rl --config grpo_debug --generator.kind vllm`, as the README runs it: vLLM
    generates every rollout and the held-out greedy evals (through the padded head size:
    the recipe's heads have 16 channels). Held-out reward rises from the start of RL
    (step 60) to the end (measured at seed 0: 0.455 -> 0.540; the native generator's test
    asserts the same +0.05), and trainer and vLLM log-probs agree to LOGPROB_ATOL in fp32 on every
    logged step (measured: at most 2.6e-6)."""
    dump = tmp_path / "rl"
    cmd = [sys.executable, "-m", "titan.recipes.cli", "rl", "--config", "grpo_debug", "--generator.kind", "vllm",
           "--job.dump_folder", str(dump), "--metrics.no_enable_progress_bar", "--metrics.log_freq", "1",
           "--rl.eval_freq", "60"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r.get("phase") == "eval"]
    rl = [r for r in rows if r.get("phase") == "rl"]
    assert [r["step"] for r in evals] == [60, 120]
    assert evals[-1]["eval_reward"] >= evals[0]["eval_reward"] + 0.05, evals
    assert [r["step"] for r in rl] == list(range(62, 121, 2))  # every rollout's record (2 updates each)
    assert all("logprob_diff_max" in r for r in rl)
    assert max(r["logprob_diff_max"] for r in rl) <= LOGPROB_ATOL


# A short `titan rl --config grpo_debug --generator.kind vllm` under torchrun: 2 warm-up and 6 RL steps.
SHORT_VLLM_RL = ["--config", "grpo_debug", "--generator.kind", "vllm", "--metrics.no_enable_progress_bar",
                 "--metrics.log_freq", "1", "--training.steps", "8", "--rl.sft_warmup_steps", "2", "--rl.eval_freq", "6",
                 "--rl.prompts_per_step", "4", "--rl.group_size", "4", "--training.local_batch_size", "8",
                 "--rl.ppo_epochs", "1"]


def run_vllm_rl(ranks: int, dump: Path, *flags: str) -> tuple[str, list[dict]]:
    """``SHORT_VLLM_RL`` then ``flags`` on ``ranks`` gloo processes writing to ``dump``; asserts
    it succeeded and returns its output and its metrics records."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "-m", "titan.recipes.cli", "rl", *SHORT_VLLM_RL,
           "--job.dump_folder", str(dump), *flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout + result.stderr, [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_disaggregated_vllm_generator_rank_serves_two_fsdp_trainer_ranks(tmp_path):
    """`--rl.generator_ranks 1 --generator.kind vllm`: vLLM runs on the generator rank (its
    own in-process engine, which needs that rank free of titan's process groups) and the
    engine trains over FSDP 2 on the other two ranks; weights reach vLLM after every update
    (trainer and vLLM log-probs agree on every step), held-out prompts are scored by vLLM."""
    _, rows = run_vllm_rl(3, tmp_path / "rl", "--rl.generator_ranks", "1", "--rl.kl_coef", "0")
    rl = [r for r in rows if r.get("phase") == "rl"]
    evals = [r for r in rows if r.get("phase") == "eval"]
    assert [r["step"] for r in rl] == list(range(3, 9))
    assert max(r["logprob_diff_max"] for r in rl) <= LOGPROB_ATOL
    assert [e["step"] for e in evals] == [2, 6, 8] and all("eval_reward" in e for e in evals)


def run_tp_worker(out: Path, tensor_parallel_size: int, families: list[str]) -> dict[str, list[dict]]:
    """tests' vllm_tp_worker.py on 2 gloo ranks; each family's results, by rank."""
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", str(Path(__file__).with_name("vllm_tp_worker.py")), str(out),
           str(tensor_parallel_size), ",".join(families)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return {family: [json.loads((out / f"{family}-rank{r}.json").read_text()) for r in range(2)] for family in families}


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe", "deepseek_v3"])
def test_an_engine_sharded_over_two_ranks_decodes_as_the_native_generator(tmp_path, family):
    """One vLLM engine over 2 ranks (tensor_parallel_size 2): each rank holds half of every
    attention output projection's input columns, its greedy tokens of its own prompts are the
    native generator's (log-probs within LOGPROB_ATOL), the weights gathered back are the ones
    loaded, and a call without prompts returns none. Qwen3-MoE: per-head norms and replicated
    experts; DeepSeek-V3: latent attention. (That the sampled tokens are an engine per rank's:
    the RL test below.) One family a launch: a third engine built after two were closed in the
    same processes failed to connect its gloo groups once (vLLM's group set-up, not a run's path)."""
    ranks = run_tp_worker(tmp_path / "tp2", 2, [family])[family]
    for got in ranks:
        assert got["collective"]
        assert got["wo_held"] == [got["wo_whole"][0], got["wo_whole"][1] // 2]
        assert got["greedy"] == got["native"] and got["logprob_diff"] <= LOGPROB_ATOL
        assert got["gathered_equal"] and got["nothing"] == []
    assert ranks[0]["greedy"] != ranks[1]["greedy"]  # each rank got its own prompts' back


def test_a_tensor_parallel_size_that_splits_heads_unevenly_is_refused():
    from titan.rl.generate.vllm.models import shard_over_vllm_tensor_parallel

    with torch.device("meta"):
        model = model_spec("llama3").build("debugmodel_tiny", **{**TINY, **HEADS["llama3"]})
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide .*'n_heads': 4"):
        shard_over_vllm_tensor_parallel(model, 3, "cpu")
    assert shard_over_vllm_tensor_parallel(model, 1, "cpu") is None


def assert_same_rollouts(sharded: list[dict], two_engines: list[dict]) -> None:
    """A run with one engine sharded over 2 ranks logged the RL steps 3-5 (rewards, completion
    lengths, losses, staleness) and the held-out scores of the run with an engine each; its
    on-policy log-probs agree with the trainer's."""
    rows = [[r for r in rows if r.get("phase") == "rl"] for rows in (two_engines, sharded)]
    assert [r["step"] for r in rows[1]] == [r["step"] for r in rows[0]] == [3, 4, 5]
    for mine, theirs in zip(rows[1], rows[0], strict=True):
        assert mine["reward_mean"] == theirs["reward_mean"] and mine["response_length_mean"] == theirs["response_length_mean"]
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-7)
        assert mine["staleness"] == theirs["staleness"]
        assert mine["logprob_diff_max"] <= LOGPROB_ATOL or mine["staleness"] > 0
    evals = [[{k: v for k, v in r.items() if k.startswith("eval_")} for r in rows if r.get("phase") == "eval"]
             for rows in (two_engines, sharded)]
    assert evals[1] == evals[0] and len(evals[0]) >= 2, evals


def test_tensor_parallel_engine_generates_each_ranks_share_as_two_engines_do(tmp_path):
    """--generator.tensor_parallel_size 2 with --rl.colocated_generation every_rank on 2 FSDP
    ranks: one vLLM engine sharded over both ranks (each holds about half its weights) takes
    both ranks' prompts together and hands each its own completions, seeded as with an engine
    per rank: the rollouts' rewards, losses and completion lengths and the held-out scores are
    the 2-engine run's, and vLLM's log-probs agree with the trainer's after every update (the
    sharded weight sync). Generation runs in each rank's background thread, a rollout ahead
    (--rl.max_policy_staleness 1), beside the training step."""
    flags = ["--rl.colocated_generation", "every_rank", "--sampling.seed", "7", "--training.steps", "5",
             "--rl.eval_freq", "3", "--rl.eval_prompts", "3", "--rl.kl_coef", "0", "--rl.max_policy_staleness", "1"]
    _, two_engines = run_vllm_rl(2, tmp_path / "two", *flags)
    output, sharded = run_vllm_rl(2, tmp_path / "sharded", *flags, "--generator.tensor_parallel_size", "2")
    held = re.search(r"vLLM tensor parallel 2: this rank holds (\d+) of the model's (\d+) weight elements", output)
    assert held and 0.5 <= int(held.group(1)) / int(held.group(2)) < 0.6, output[-3000:]
    assert_same_rollouts(sharded, two_engines)


def test_generator_ranks_share_a_sharded_engine_as_two_engines_do(tmp_path):
    """--rl.generator_ranks 2 --generator.tensor_parallel_size 2 (verl's and OpenRLHF's layout):
    the launch's last 2 ranks run one vLLM engine sharded over them, under a process group of
    their own, while the first rank trains; each generates its share of every rollout, a
    rollout ahead (--rl.max_policy_staleness 1), and of the held-out prompts (one prompt: the
    second generator rank takes part with none). The rollouts' rewards and completion lengths,
    the losses and the held-out scores are those of 2 generator ranks with an engine each, and
    every sync's weights check out on both shards (a mismatch stops the run)."""
    flags = ["--rl.generator_ranks", "2", "--sampling.seed", "7", "--training.steps", "5", "--rl.eval_freq", "3",
             "--rl.eval_prompts", "1", "--rl.kl_coef", "0", "--rl.max_policy_staleness", "1"]
    _, two_engines = run_vllm_rl(3, tmp_path / "two", *flags)
    output, sharded = run_vllm_rl(3, tmp_path / "sharded", *flags, "--generator.tensor_parallel_size", "2")
    # The first generator rank logs at INFO, under its own prefix.
    held = re.findall(r"\[titan generator [0-9:]+\] vLLM tensor parallel 2: this rank holds (\d+) of the model's (\d+) "
                      "weight elements", output)
    assert len(held) == 1 and 0.5 <= int(held[0][0]) / int(held[0][1]) < 0.6, output[-3000:]
    assert re.search(r"\[titan generator [0-9:]+\] generator rank 0: done \(\{'sync': \d+, 'rollout': \d+, 'eval': 3\}\)",
                     output), output[-3000:]
    assert_same_rollouts(sharded, two_engines)


def test_every_rank_runs_its_own_vllm_engine_in_the_trainers_group(tmp_path):
    """`--generator.kind vllm --rl.colocated_generation every_rank` on 2 FSDP ranks (TRL's
    colocate mode): each rank runs a vLLM engine under the trainer's process group (vLLM's
    external_launcher executor) and generates half of every rollout and of the held-out
    prompts; weights reach both engines after every update (trainer and vLLM log-probs agree
    on every on-policy step), each rank rescores its half with its KL reference, and the run
    ends without vLLM destroying the trainer's groups twice. PPO's critic (gae), a second
    engine on the trainer's group, scores and trains beside the two vLLM engines, first alone
    on 2 rollouts (--rl.critic_warmup); the KL in the reward adapts its coefficient."""
    output, rows = run_vllm_rl(2, tmp_path / "rl", "--rl.colocated_generation", "every_rank", "--rl.eval_prompts", "5",
                               "--rl.kl_coef", "0.05", "--rl.no_drop_zero_variance", "--rl.advantage_estimator", "gae",
                               "--rl.critic_lr", "1e-3", "--rl.critic_warmup", "2", "--rl.kl_in_reward_coef", "0.02",
                               "--rl.kl_in_reward_target", "0.01", "--rl.kl_in_reward_horizon", "100")
    assert "every rank generates: each of the 2 ranks" in output
    assert "Invalid process group" not in output, output[-3000:]
    rl = [r for r in rows if r.get("phase") == "rl"]
    evals = [r for r in rows if r.get("phase") == "eval"]
    assert [r["step"] for r in rl] == list(range(3, 9))
    assert max(r["logprob_diff_max"] for r in rl) <= LOGPROB_ATOL
    assert rl[-1]["kl"] > 0  # each rank's reference rescored its half
    assert all(r["value_loss"] > 0 for r in rl) and len({r["values_mean"] for r in rl}) == len(rl)
    warmup = [r for r in rows if r.get("phase") == "critic_warmup"]
    assert [(r["step"], r["warmup_rollout"]) for r in warmup] == [(2, 1), (2, 2)]
    assert all(r["value_loss"] > 0 for r in warmup) and rl[0]["kl"] == pytest.approx(0, abs=1e-6)
    coefs = [r["kl_in_reward_coef"] for r in warmup + rl]
    assert coefs[0] == 0.02 and len(set(coefs)) == len(coefs)
    # 5 held-out prompts over 2 ranks (3 + 2): an exact match rate is a multiple of 1/5.
    assert [e["step"] for e in evals] == [2, 6, 8]
    assert all(abs(e["eval_exact_match"] * 5 - round(e["eval_exact_match"] * 5)) < 1e-9 for e in evals)
