"""The RL controller: the staleness bound of the async schedule (fast, with stand-ins for the
engine and generator), config checks, and short real runs (slow): reward rises on held-out
prompts, trainer and generator log-probs agree, a resumed run continues the same trajectory."""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from forked_cli import run_command, run_titan
from launching import launch_train_runs, run_output
from titan.rl.config import RLConfig, RLSection
from titan.rl.controller import RLTrainer
from titan.rl.rollouts import Rollout
from titan.rl.schedule import RolloutSchedule

# ---- the staleness bound ---------------------------------------------------------------


class ScheduledRun:
    """A :class:`RolloutSchedule` over stand-ins: a version counter for the engine, a
    generator that reports the weights' version it generated with (and fails the test if
    its weights change while it generates), a broadcast to one rank. Background threads are
    real when bound >= 1."""

    def __init__(self, bound: int, steps: int) -> None:
        self.step, self.syncs = 0, []
        self.busy = threading.Lock()
        self.schedule = RolloutSchedule(max_staleness=bound, updates_per_rollout=1, total_steps=steps,
                                        sync=self.sync, produce=self.produce, broadcast=self.broadcast,
                                        background=True)

    def sync(self) -> None:
        # The generator must be idle while its weights change.
        assert self.busy.acquire(blocking=False), "weights synced while a rollout was being generated"
        self.busy.release()
        self.syncs.append(self.step)

    def produce(self, index: int) -> Rollout:
        with self.busy:
            version = self.syncs[-1]
            time.sleep(0.002)  # widens the window a concurrent sync would hit
            return Rollout(index=index, version=version, groups=[], rewards=[])

    @staticmethod
    def broadcast(result):
        return result() if callable(result) else result


@pytest.mark.parametrize("bound", [0, 1, 2, 3])
def test_async_schedule_never_exceeds_the_staleness_bound(bound):
    steps = 12
    run = ScheduledRun(bound, steps)
    staleness = []
    for step in range(steps):
        rollout = run.schedule.next_rollout(step, run.step)
        assert rollout.index == step
        staleness.append(run.step - rollout.version)
        run.step += 1  # the optimizer step
    run.schedule.close()
    assert all(0 <= s <= bound for s in staleness), staleness
    if bound == 0:
        assert staleness == [0] * steps and run.syncs == list(range(steps))
    else:
        # The bound is used, not just respected: later rollouts run `bound` versions behind,
        # with one sync every `bound` steps.
        assert max(staleness) == bound, staleness
        assert len(run.syncs) <= steps // bound + 1, run.syncs


def test_a_skipped_rollout_still_respects_the_bound():
    """A rollout with nothing to learn takes no optimizer step; the next must still fit."""
    run = ScheduledRun(1, 10)
    for step in range(8):
        rollout = run.schedule.next_rollout(step, run.step)
        assert 0 <= run.step - rollout.version <= 1
        if step % 3 != 1:  # every third rollout is skipped: no version change
            run.step += 1
    run.schedule.close()


# ---- config ------------------------------------------------------------------------------


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--rl.loss_type"):
        RLSection(loss_type="ppo")
    with pytest.raises(ValueError, match="--rl.is_cap"):
        RLSection(is_cap=0.5)
    with pytest.raises(ValueError, match="--rl.reward_weights"):
        RLSection(rewards=("exact_match",), reward_weights=(1.0, 2.0))
    with pytest.raises(ValueError, match="--rl.sft_warmup_steps"):
        RLConfig(rl=RLSection(sft_warmup_steps=10), training=RLConfig().training.__class__(steps=5))
    assert RLSection(loss_type="dr_grpo").use_std is False and RLSection().use_std is True
    assert RLSection(advantage_estimator="rloo").use_std is False
    with pytest.raises(ValueError, match="rloo does not divide by a std"):
        RLSection(advantage_estimator="rloo", normalize_std=True)
    with pytest.raises(ValueError, match="--rl.drop_zero_variance"):
        RLSection(max_refill_rounds=2, drop_zero_variance=False)
    with pytest.raises(ValueError, match="--rl.old_logprobs trainer"):
        RLSection(old_logprobs="generator", is_level="sequence")
    with pytest.raises(ValueError, match="--rl.colocated_generation every_rank is for colocated runs"):
        RLSection(colocated_generation="every_rank", generator_ranks=1)
    with pytest.raises(ValueError, match="--rl.colocated_generation must be rank0 or every_rank"):
        RLSection(colocated_generation="all")
    with pytest.raises(ValueError, match="--rl.sapo_temperature_neg shape the gate of --rl.loss_type sapo"):
        RLSection(sapo_temperature_neg=2.0)
    with pytest.raises(ValueError, match="sapo has no hard clip .*: drop --rl.clip_eps_high, --rl.dual_clip"):
        RLSection(loss_type="sapo", clip_eps_high=0.28, dual_clip=3.0)
    with pytest.raises(ValueError, match="--rl.sapo_temperature_pos must be > 0"):
        RLSection(loss_type="sapo", sapo_temperature_pos=0.0)
    with pytest.raises(ValueError, match="normalize_then_sum divides each reward by its group std"):
        RLSection(multi_objective_aggregation="normalize_then_sum", loss_type="dr_grpo")
    with pytest.raises(ValueError, match="--rl.entropy_target steer --rl.adaptive_entropy"):
        RLSection(entropy_target=1.0)
    with pytest.raises(ValueError, match=r"--rl.entropy_coef 2.0 is where --rl.adaptive_entropy starts"):
        RLSection(adaptive_entropy=True, entropy_coef=2.0)
    from titan.recipes.cli import parse_train_args

    def parsed(*flags: str) -> RLSection:  # the flags reach RLSection (its use: test_losses, gradient parity)
        return parse_train_args(["--config", "grpo_debug", *flags], command="rl").rl

    assert parsed("--rl.loss_type", "luspo").loss_type == "luspo"
    assert parsed("--rl.loss_type", "sapo", "--rl.sapo_temperature_neg", "2").sapo_temperature_neg == 2.0
    assert parsed("--rl.kl_coef", "0.1", "--rl.kl_bias_correction").kl_bias_correction
    with pytest.raises(ValueError, match="--rl.gamma discounts reinforce_plus_plus.s and gae.s per-token returns"):
        RLSection(gamma=0.9)
    with pytest.raises(ValueError, match="--rl.kl_in_reward_estimator is read with --rl.kl_in_reward_coef"):
        RLSection(kl_in_reward_estimator="k3")
    with pytest.raises(ValueError, match="--rl.kl_in_reward_target and --rl.kl_in_reward_horizon adapt"):
        RLSection(kl_in_reward_target=0.1)
    with pytest.raises(ValueError, match="--rl.kl_in_reward_horizon is read by the adaptive controller"):
        RLSection(kl_in_reward_coef=0.1, kl_in_reward_horizon=100)
    with pytest.raises(ValueError, match="--rl.kl_in_reward_target must be > 0, got 0.0"):
        RLSection(kl_in_reward_coef=0.1, kl_in_reward_target=0.0)
    with pytest.raises(ValueError, match="--rl.kl_in_reward_horizon must be >= 1, got 0"):
        RLSection(kl_in_reward_coef=0.1, kl_in_reward_target=0.1, kl_in_reward_horizon=0)
    adaptive = parsed("--rl.kl_in_reward_coef", "0.1", "--rl.kl_in_reward_target", "0.02", "--rl.kl_in_reward_horizon", "500")
    assert (adaptive.kl_in_reward_target, adaptive.kl_in_reward_horizon) == (0.02, 500)
    with pytest.raises(ValueError, match="whitens over the rollout's tokens, never by a group std"):
        RLSection(advantage_estimator="reinforce_plus_plus", normalize_std=True)
    with pytest.raises(ValueError, match="--rl.drop_zero_variance would drop every group"):
        RLSection(advantage_estimator="reinforce_plus_plus", group_size=1)
    assert RLSection(kl_in_reward_coef=0.1).uses_reference and not RLSection().uses_reference
    with pytest.raises(ValueError, match="--rl.off_policy_mask_threshold must be >= 0"):
        RLSection(off_policy_mask_threshold=-0.1)
    with pytest.raises(ValueError, match="--rl.kl_bias_correction weights the KL penalty"):
        RLSection(kl_bias_correction=True)
    for quantile in (0.0, 1.5):
        with pytest.raises(ValueError, match="--rl.top_entropy_quantile must be in \\(0, 1\\]"):
            RLSection(top_entropy_quantile=quantile)
    with pytest.raises(ValueError, match="--rl.minibatches_per_rollout 9 exceeds --rl.group_size 8"):
        RLSection(minibatches_per_rollout=9)
    for estimator in ("grpo", "rloo"):  # a group of one: every advantage 0, nothing ever learned
        with pytest.raises(ValueError, match=f"--rl.group_size 1: --rl.advantage_estimator {estimator} compares"):
            RLSection(group_size=1, advantage_estimator=estimator, normalize_std=False if estimator == "rloo" else None)
    with pytest.raises(ValueError, match="--rl.overlong_buffer_len 10 must be below"):
        RLConfig(rl=RLSection(overlong_buffer_len=10), sampling=RLConfig().sampling.__class__(max_new_tokens=10))
    with pytest.raises(ValueError, match="not a multiple of the 4 optimizer steps"):
        RLConfig(rl=RLSection(ppo_epochs=2, minibatches_per_rollout=2, sft_warmup_steps=1),
                 training=RLConfig().training.__class__(steps=6))
    # titan rl never ran --validation (held-out prompts are its evaluation): refused, not ignored
    with pytest.raises(ValueError, match="titan rl scores held-out prompts greedily instead"):
        RLConfig(validation=RLConfig().validation.__class__(enable=True))


def test_vllm_generator_is_refused_with_the_extra_named():
    pytest.importorskip("titan.recipes")
    from titan.rl.controller import check_generator_kind

    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match=r"titan-rl\[vllm\]"):
            check_generator_kind("vllm")
    check_generator_kind("native")


def test_rl_builds_the_vocabulary_model_vocab_size_asks_for(tmp_path, monkeypatch):
    """`--model.vocab_size` reaches the policy and the generator (it used to be ignored: RL
    rounded the tokenizer's size up on its own)."""
    pytest.importorskip("titan.recipes")
    from titan.recipes.cli import parse_train_args
    from titan.recipes.families import model_spec

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    config = parse_train_args(["--config", "grpo_debug", "--model.vocab_size", "1000", "--job.dump_folder",
                               str(tmp_path)], command="rl")
    trainer = RLTrainer(config, model_spec=model_spec("llama3"))
    try:
        assert trainer.engine.model_parts[0].args.vocab_size == trainer.generator.model.args.vocab_size == 1000
    finally:
        trainer.close()


def test_sft_warmup_accumulates_to_the_global_batch(tmp_path, monkeypatch):
    """`--training.global_batch_size` twice the local batch: the warm-up accumulates two
    microbatches per step, equal to one step on the double batch (it used to take one
    microbatch per step, the flag silently ignored); without a warm-up the flag is refused."""
    pytest.importorskip("titan.recipes")
    from titan.recipes.cli import parse_train_args
    from titan.recipes.families import model_spec

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    common = ["--config", "grpo_debug", "--training.steps", "3", "--rl.sft_warmup_steps", "2", "--rl.eval_freq", "0",
              "--rl.kl_coef", "0", "--rl.ppo_epochs", "1", "--metrics.log_freq", "1", "--rl.prompts_per_step", "2",
              "--rl.group_size", "2"]

    def warmup(name, *flags):
        config = parse_train_args([*common, "--job.dump_folder", str(tmp_path / name), *flags], command="rl")
        trainer = RLTrainer(config, model_spec=model_spec("llama3"))
        try:
            return [r["loss"] for r in trainer.train() if r.get("phase") == "sft_warmup"]
        finally:
            trainer.close()

    accumulated = warmup("accum", "--training.local_batch_size", "8", "--training.global_batch_size", "16")
    big = warmup("big", "--training.local_batch_size", "16")
    half = warmup("half", "--training.local_batch_size", "8")
    # Step 1's loss is over all 16 rows, step 2's follows step 1's update: both equal the big
    # batch's up to float reassociation of the two halves (fp32 sums of ~500 token losses of
    # O(1): ~1e-7 relative; 1e-5 leaves room for a kernel's other order). One microbatch of 8
    # per step (the old behaviour, `half`) differs at step 1 already.
    assert len(accumulated) == len(big) == 2
    assert accumulated == pytest.approx(big, rel=1e-5)
    assert abs(half[0] - big[0]) > 1e-3
    config = parse_train_args([*common, "--rl.sft_warmup_steps", "0", "--training.global_batch_size", "64",
                               "--job.dump_folder", str(tmp_path / "none")], command="rl")
    with pytest.raises(ValueError, match="sets the SFT warm-up's batch"):
        RLTrainer(config, model_spec=model_spec("llama3"))


def test_vllm_only_generator_flags_are_refused_with_the_native_generator():
    from titan.rl.config import GeneratorConfig

    for flag, value in (("dtype", "bfloat16"), ("kv_cache_memory_bytes", 1 << 20), ("max_num_seqs", 8),
                        ("tensor_parallel_size", 2)):
        with pytest.raises(ValueError, match=f"--generator.{flag} sets up the vLLM generator"):
            GeneratorConfig(**{flag: value})
        GeneratorConfig(kind="vllm", **{flag: value})
    with pytest.raises(ValueError, match="--generator.max_num_seqs must be >= 1"):
        GeneratorConfig(kind="vllm", max_num_seqs=0)
    with pytest.raises(ValueError, match="--generator.tensor_parallel_size must be >= 1"):
        GeneratorConfig(kind="vllm", tensor_parallel_size=0)


def test_vllm_tensor_parallel_needs_an_engine_on_every_rank_and_a_rank_count_it_divides():
    """N ranks run one sharded engine together: every rank must run vLLM, and N divide the
    ranks; or the generator ranks of a disaggregated run run them, and N divides those."""
    from titan.rl.config import GeneratorConfig
    from titan.rl.generate.build import check_generator_tensor_parallel

    tp2 = GeneratorConfig(kind="vllm", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="needs an engine on every rank of a multi-rank run.*has 1 rank"):
        check_generator_tensor_parallel(tp2, 1, every_rank=False)
    with pytest.raises(ValueError, match="or generator ranks .*has 4 rank.*generates on its first rank"):
        check_generator_tensor_parallel(tp2, 4, every_rank=False)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 must divide the run's 3 generator ranks"):
        check_generator_tensor_parallel(tp2, 1, every_rank=False, generator_ranks=3)
    for trainer_ranks in (1, 3):  # the trainer's layout is its own: the engines live on the generator ranks
        check_generator_tensor_parallel(tp2, trainer_ranks, every_rank=False, generator_ranks=4)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 must divide the run's 3 ranks"):
        check_generator_tensor_parallel(tp2, 3, every_rank=True)
    for ranks in (2, 4):
        check_generator_tensor_parallel(tp2, ranks, every_rank=True)
    check_generator_tensor_parallel(GeneratorConfig(kind="vllm"), 1, every_rank=False)


def test_refill_rounds_are_refused_with_a_shared_vllm_engine():
    """DAPO's refill rounds run as often as each rank's share needs, and ranks sharing an
    engine must generate together."""
    from titan.recipes.cli import UsageError, parse_train_args

    flags = ["--config", "grpo_debug", "--generator.kind", "vllm", "--generator.tensor_parallel_size", "2"]
    with pytest.raises(UsageError, match="--rl.max_refill_rounds refills each rank's share on its own"):
        parse_train_args([*flags, "--rl.max_refill_rounds", "2"], command="rl")
    assert parse_train_args(flags, command="rl").generator.tensor_parallel_size == 2


def test_generator_ranks_must_be_a_multiple_of_the_vllm_tensor_parallel_size():
    from titan.recipes.cli import UsageError, parse_train_args

    flags = ["--config", "grpo_debug", "--generator.kind", "vllm", "--generator.tensor_parallel_size", "2"]
    with pytest.raises(UsageError, match="--generator.tensor_parallel_size 2 must divide --rl.generator_ranks 3"):
        parse_train_args([*flags, "--rl.generator_ranks", "3"], command="rl")
    assert parse_train_args([*flags, "--rl.generator_ranks", "4"], command="rl").rl.generator_ranks == 4


@pytest.mark.vllm
def test_vllm_generator_is_refused_on_several_ranks():
    pytest.importorskip("vllm", reason="vLLM is not installed: checked in `make test-vllm`")
    from titan.rl.controller import check_generator_kind

    with pytest.raises(ValueError, match="single-process trainer; this run has 2 ranks. Add --rl.colocated_generation"):
        check_generator_kind("vllm", world_size=2)
    check_generator_kind("vllm", world_size=1)
    check_generator_kind("vllm", world_size=2, every_rank=True)  # one engine per rank


def test_titan_rl_is_a_command_with_its_recipe():
    from titan.recipes.cli import parse_train_args, recipe_command

    assert recipe_command("grpo_debug") == "rl"
    cfg = parse_train_args(["--rl.loss_type", "dapo", "--sampling.temperature", "0.7"], command="rl")
    assert isinstance(cfg, RLConfig) and cfg.rl.loss_type == "dapo" and cfg.sampling.temperature == 0.7
    assert cfg.training.document_mask is True


# ---- real runs (slow) --------------------------------------------------------------------

TITAN = [sys.executable, "-m", "titan.recipes.cli"]


def rl_flags(dump: Path, *flags: str) -> list[str]:
    """The flags of `titan rl --config grpo_debug` writing to ``dump``, then ``flags``."""
    return ["--config", "grpo_debug", "--job.dump_folder", str(dump), "--metrics.no_enable_progress_bar", *flags]


def run_rl(dump: Path, *flags: str) -> subprocess.CompletedProcess:
    """`titan rl --config grpo_debug` with `flags` in one process (forked with titan imported:
    tests/forked_cli.py; threads: the suite's share, conftest.py); asserts it succeeded."""
    args = ["rl", *rl_flags(dump, *flags)]
    result = run_titan(args, timeout=900)
    assert result.returncode == 0, f"titan {' '.join(args)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def pythonpath_with_this_folder() -> str:
    """PYTHONPATH with this folder first: reward functions given by dotted path, and the
    probes of sitecustomize.py."""
    return os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)


def run_rl_ranks(ranks: int, dump: Path, *flags: str, check: bool = True, timeout: float = 900,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`titan rl --config grpo_debug` under torchrun with ``ranks`` gloo processes (this
    folder importable, for reward functions given by dotted path)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "-m", "titan.recipes.cli", "rl", *rl_flags(dump, *flags)]
    result = run_command(cmd, timeout=timeout,  # torchrun's agent forked (tests/forked_cli.py)
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath_with_this_folder(),
                              **(env or {})})
    if check:
        assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_debug_beats_its_sft_only_control(tmp_path):
    """The recipe as the README runs it: a warm-up on 32 demonstrations, then GRPO on fresh
    prompts raises held-out reward and exact match, and ends clearly above an SFT-only control
    that spends the same 120 steps on the demonstrations (measured at seed 0: exact match
    0.156 vs 0.047; seeds 1 and 2: 0.109 vs 0.047, 0.125 vs 0.047). Trainer and generator
    log-probs agree to 1e-5 in fp32 on every step."""
    start = time.perf_counter()
    log = run_rl(tmp_path / "rl", "--metrics.log_freq", "1", "--rl.eval_freq", "60")  # evals at 60 and 120
    run_rl(tmp_path / "control", "--rl.sft_warmup_steps", "119", "--rl.ppo_epochs", "1", "--rl.eval_freq", "120")
    rows = records(tmp_path / "rl")
    evals = [r for r in rows if r.get("phase") == "eval"]
    control = [r for r in records(tmp_path / "control") if r.get("phase") == "eval"][-1]
    rl = [r for r in rows if r.get("phase") == "rl"]
    print(f"wall {time.perf_counter() - start:.0f}s; held-out (reward, exact match) by step:",
          [(r["step"], round(r["eval_reward"], 3), r["eval_exact_match"]) for r in evals],
          "control:", (control["step"], round(control["eval_reward"], 3), control["eval_exact_match"]))
    assert evals[0]["step"] == 60 and evals[-1]["step"] == control["step"] == 120
    assert evals[-1]["eval_reward"] >= evals[0]["eval_reward"] + 0.05, evals
    assert evals[-1]["eval_exact_match"] >= control["eval_exact_match"] + 0.05, (evals[-1], control)
    assert "held-out (64 prompts, greedy): exact match" in log.stderr + log.stdout
    assert max(r["logprob_diff_max"] for r in rl) <= 1e-5
    # Two optimizer steps per rollout (--rl.ppo_epochs 2): logged every 2 steps, on-policy.
    assert [r["step"] for r in rl] == list(range(62, 121, 2))
    assert all(r["staleness"] == 0 and r["policy_version"] == r["step"] - 2 and r["updates"] == 2 for r in rl)
    first, last = rl[: len(rl) // 2], rl[len(rl) // 2 :]
    mean = lambda rs: sum(r["reward_mean"] for r in rs) / len(rs)  # noqa: E731
    assert mean(last) > mean(first), (mean(first), mean(last))
    for key in ("reward_std", "response_length_mean", "truncated_fraction", "kl", "clip_fraction", "entropy",
                "logprob_diff_mean", "generation_s", "sync_s", "train_s"):
        assert key in rl[-1], key


# Short runs of the recipe with one optimizer step per rollout and no KL, so step, rollout
# and policy version advance together (the recipe itself takes 2 steps per rollout).
SHORT = ["--training.steps", "8", "--rl.sft_warmup_steps", "2", "--rl.eval_freq", "0", "--rl.prompts_per_step", "4",
         "--rl.group_size", "4", "--training.local_batch_size", "8", "--metrics.log_freq", "1",
         "--rl.ppo_epochs", "1", "--rl.kl_coef", "0"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_moe_policy_trainer_and_generator_agree(family, tmp_path):
    """The MoE families move their router's balancing bias after every step: the generator
    must get it with the weights, or their log-probs of the same tokens differ (0.5-1.8
    before). DeepSeek-V3's native generator decodes from MLA's latent cache."""
    log = run_rl(tmp_path, *SHORT, "--model.name", family, "--model.flavor", "debugmodel")
    rl = [r for r in records(tmp_path) if r.get("phase") == "rl"]
    assert len(rl) >= 3 and max(r["logprob_diff_max"] for r in rl) <= 1e-5, rl
    assert "--rl.max_logprob_diff" not in log.stderr


def test_logprob_disagreement_is_warned_on_policy_only(caplog):
    trainer = RLTrainer.__new__(RLTrainer)
    trainer.config = SimpleNamespace(rl=SimpleNamespace(max_logprob_diff=0.5))
    trainer.engine, trainer.is_rank0 = SimpleNamespace(step=3), True
    with caplog.at_level("WARNING", logger="titan"):
        trainer._check_logprob_agreement({"staleness": 0, "logprob_diff_max": 0.4, "logprob_diff_mean": 0.01})
        trainer._check_logprob_agreement({"staleness": 1, "logprob_diff_max": 0.9, "logprob_diff_mean": 0.01})
        assert not caplog.records
        trainer._check_logprob_agreement({"staleness": 0, "logprob_diff_max": 0.9, "logprob_diff_mean": 0.01})
    assert len(caplog.records) == 1 and "--rl.max_logprob_diff 0.5" in caplog.records[0].getMessage()


@pytest.mark.slow
@pytest.mark.parametrize("generator_ranks", [0, 1, pytest.param("every_rank", marks=pytest.mark.xdist_group("rl_two_ranks"))],
                         ids=["one_rank", "disaggregated", "every_rank"])
def test_rl_resume_continues_the_same_trajectory(request, tmp_path, generator_ranks):
    """Losses, rewards, gradient norms and KL of the resumed steps equal the uninterrupted
    run's. KL is on: its reference is the policy RL started from (step 2, after the warm-up),
    restored from the checkpoint, not the resumed weights of step 5. Disaggregated: 2 FSDP
    trainer ranks and a generator rank, whose weights come from the resumed trainer. Every
    rank: 2 FSDP ranks each generating half of every rollout, each with its own copy of the
    reference (stored once in the checkpoint, restored on both). The adaptive entropy
    coefficient climbs 0.005 per update (every step's entropy is below the target) and resumes
    where it was (restarting from 0 changes the resumed losses). PPO's critic (gae) resumes
    its weights and AdamW state from the checkpoint (rank 0's copy): its values, and so the
    advantages and losses, continue as if never stopped; its one warm-up rollout
    (--rl.critic_warmup) is not repeated, and its LR warmup (--rl.critic_lr_warmup_steps 8,
    one critic step per rollout) goes on from its place. The KL-in-reward coefficient adapts
    every rollout (--rl.kl_in_reward_target) and resumes where it was."""
    flags = list(RESUMED)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    if generator_ranks == "every_rank":  # the uninterrupted run is one of the shared 2-rank launch's
        flags = TWO_RANK_RUNS["resume_every_rank"]
        run = functools.partial(run_rl_ranks, 2)
        straight = request.getfixturevalue("two_rank_runs") / "resume_every_rank"
    elif generator_ranks:
        flags += ["--rl.generator_ranks", str(generator_ranks)]
        run = functools.partial(run_rl_ranks, 2 + generator_ranks)
    else:
        run = run_rl
    if generator_ranks != "every_rank":
        run(straight, *flags)
    (resumed / "checkpoint").mkdir(parents=True)
    shutil.copytree(straight / "checkpoint" / "step-5", resumed / "checkpoint" / "step-5")
    log = run(resumed, *flags)
    assert "resumed from step 5" in log.stderr + log.stdout
    warmups = [[r["warmup_rollout"] for r in records(run) if r.get("phase") == "critic_warmup"] for run in (straight, resumed)]
    assert warmups == [[1], []]  # the resumed run's critic was warmed before step 5
    keys = ("loss", "reward_mean", "grad_norm", "logprob_diff_max", "kl", "entropy_coef", "value_loss", "values_mean",
            "returns_mean", "kl_in_reward_coef", "value_lr")
    straight_rl = [r for r in records(straight) if r.get("phase") == "rl"]
    updates = list(itertools.accumulate(r["updates"] for r in straight_rl))
    assert [r["entropy_coef"] for r in straight_rl] == pytest.approx([0.005 * n for n in updates], abs=1e-12)
    want = {r["step"]: [r[k] for k in keys] for r in straight_rl}
    got = {r["step"]: [r[k] for k in keys] for r in records(resumed) if r.get("phase") == "rl"}
    assert sorted(got) == [6, 7, 8] and all(got[s] == want[s] for s in got), (got, want)
    assert got[6][keys.index("kl")] > 0  # the policy has moved away from its reference by step 6
    # The warm-up's rollout is penalized with the flag's coefficient; it moves at every rollout.
    assert [r["kl_in_reward_coef"] for r in records(straight) if r.get("phase") == "critic_warmup"] == [0.05]
    coefs = [r["kl_in_reward_coef"] for r in straight_rl]
    assert len(set(coefs)) == len(coefs), coefs
    # The critic's LR climbs 1e-3 / 8 per critic step: the warm-up rollout's step, then one per rollout.
    critic_rows = [r for r in records(straight) if r.get("phase") in ("critic_warmup", "rl")]
    assert critic_rows[0]["phase"] == "critic_warmup"
    steps = list(itertools.accumulate(r["value_updates"] for r in critic_rows))
    assert [r["value_lr"] for r in critic_rows] == pytest.approx([1e-3 * min(n, 8) / 8 for n in steps], rel=1e-9)


# With the entropy bonus on, so that its gradient is part of every layout's comparison with one
# rank (under TP it was wrong until 2026-12-05, and nothing trained with it).
DETERMINISTIC = [*SHORT, "--debug.deterministic", "--rl.entropy_coef", "0.01"]
# PPO with a critic, fast enough to move its values in a few steps.
GAE = ["--rl.advantage_estimator", "gae", "--rl.critic_lr", "1e-3", "--rl.gamma", "0.99", "--rl.gae_lambda", "0.95"]
# A run checkpointed at step 5 and resumed from it, with the KL reference and the critic (and
# its warm-up, done once) to restore. Adaptive entropy control with a target every step is below: its coefficient climbs
# by 0.005 per update, and a resume must restore it.
RESUMED = [*SHORT, "--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.no_last_save_model_only",
           "--debug.deterministic", "--rl.kl_coef", "0.05", "--rl.adaptive_entropy", "--rl.entropy_target", "100",
           *GAE, "--rl.critic_warmup", "1", "--rl.kl_in_reward_coef", "0.05", "--rl.kl_in_reward_target", "1e-3",
           "--rl.kl_in_reward_horizon", "50", "--rl.critic_lr_warmup_steps", "8"]
# The critic on 2 FSDP ranks against one: RL from the initial weights (an SFT warm-up's batches
# are sharded over the data-parallel ranks, so its weights would differ), every group trained.
CRITIC_LAYOUT = [*SHORT, "--rl.sft_warmup_steps", "0", "--rl.no_drop_zero_variance", "--debug.deterministic", *GAE,
                 "--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.last_save_in_hf"]
# Generator ranks' shares, async with KL and dynamic sampling; every rank generating equals them.
SHARED = [*SHORT, "--rl.max_refill_rounds", "1", "--rl.eval_freq", "3", "--rl.eval_prompts", "5",
          "--debug.deterministic", "--rl.max_policy_staleness", "1", "--rl.kl_coef", "0.05", "--rl.log_completions"]


def _sigterm_after_records(dump: Path, flags: list[str], count: int) -> tuple[int, str]:
    """Start `titan rl` with ``flags`` writing to ``dump``, send it one SIGTERM once
    ``count`` records are logged (so it is inside the loop), and return its exit code and
    stderr."""
    import signal

    cmd = [*TITAN, "rl", *rl_flags(dump, *flags)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    metrics = dump / "metrics.jsonl"
    try:
        while proc.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= count):
            time.sleep(0.2)  # polls a condition; pytest-timeout bounds the wait
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.slow
def test_sigterm_during_titan_rl_saves_and_the_same_command_resumes(tmp_path):
    """The first SIGTERM finishes the step, saves it and exits 0 (RL had no preemption guard);
    the same command resumes from that step. The signal is sent once three steps are logged,
    so the process is known to be inside the loop."""

    flags = [*SHORT, "--training.steps", "400", "--checkpoint.enable", "--checkpoint.interval", "1000"]
    returncode, err = _sigterm_after_records(tmp_path, flags, 3)
    assert returncode == 0, err[-3000:]
    stopped = max(r["step"] for r in records(tmp_path))
    assert stopped < 400 and f"stopped at step {stopped}" in err and "RL preempted" in err, err[-2000:]
    assert (tmp_path / "checkpoint" / f"step-{stopped}").is_dir()
    resumed = run_rl(tmp_path, *flags, "--training.steps", str(stopped + 2))
    assert f"resumed from step {stopped}" in resumed.stderr
    assert [r["step"] for r in records(tmp_path) if r.get("phase") != "eval"][-2:] == [stopped + 1, stopped + 2]


@pytest.mark.slow
def test_critic_warmup_trains_the_critic_alone_and_a_preempted_warmup_resumes_its_count(tmp_path):
    """--rl.critic_warmup: the critic trains on rollouts of the starting policy before its first
    update, each logged as a critic_warmup record at the step the policy stands at, with every
    group (all rewards are 0 here, which --rl.drop_zero_variance would drop). The policy does
    not move: the KL to the reference it started as is exactly 0 at the first RL step. A
    SIGTERM during the warm-up saves the count so far with the step, replacing that step's
    checkpoint (saved at the end of the SFT warm-up, before the critic's); the same command
    resumes the count (not from 0), and its warm-up and RL records equal a straight run's.
    --rl.critic_epochs sets the critic's passes apart from the policy's."""
    flags = [*SHORT, "--training.steps", "4", "--debug.deterministic", "--rl.kl_coef", "0.05", *GAE,
             "--checkpoint.enable", "--checkpoint.interval", "2", "--rl.critic_epochs", "3"]
    stopped = tmp_path / "stopped"
    returncode, err = _sigterm_after_records(stopped, [*flags, "--rl.critic_warmup", "400"], 4)
    assert returncode == 0 and "stopped at step 2" in err, err[-3000:]
    assert err.count("saved step 2 in") == 2  # at the SFT warm-up's end, and again with the critic's count
    sft = 2
    done = [r["warmup_rollout"] for r in records(stopped)[sft:]]
    assert done == list(range(1, len(done) + 1)) and 2 <= len(done) < 400

    warmup = str(len(done) + 2)
    resumed = run_rl(stopped, *flags, "--rl.critic_warmup", warmup)
    assert "resumed from step 2" in resumed.stderr
    straight = tmp_path / "straight"
    run_rl(straight, *flags, "--rl.critic_warmup", warmup)
    rows = records(straight)[sft:]
    assert [(r["phase"], r["step"]) for r in rows] == [("critic_warmup", 2)] * (len(done) + 2) + [("rl", 3), ("rl", 4)]
    assert all(r["value_grad_norm"] > 0 and r["rollout_index"] == r["warmup_rollout"] for r in rows[:-2])
    assert rows[-2]["kl"] == 0 and rows[-1]["kl"] > 0  # the policy first moves at step 3
    # --rl.critic_epochs 3: three critic steps per rollout, warm-up or not; the policy takes one.
    assert all(r["value_updates"] == 3 for r in rows) and [r["updates"] for r in rows[-2:]] == [1, 1]
    keys = ("warmup_rollout", "rollout_index", "value_loss", "values_mean", "reward_mean", "loss", "kl", "grad_norm")
    tail = [[r.get(k) for k in keys] for r in records(stopped)[sft + len(done):]]
    assert tail == [[r.get(k) for k in keys] for r in rows[len(done):]], (tail, rows)


def test_profiler_flags_write_traces_from_titan_rl(tmp_path):
    """`--profiling.enable_profiling` was accepted by `titan rl` and ignored: the window that
    ends on step 2 (the last warm-up step: a trace of an RL step, generation included, takes
    ~25 s more to write on CPU) now writes a Chrome trace with the step's operators in it."""
    run_rl(tmp_path, *SHORT, "--training.steps", "3", "--profiling.enable_profiling", "--profiling.profile_freq", "2",
           "--profiling.profiler_warmup", "0", "--profiling.profiler_active", "1")
    traces = sorted(tmp_path.rglob("*trace*.json"))
    assert traces, sorted(p.name for p in tmp_path.rglob("*"))
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)


def test_rl_writes_a_seed_checkpoint_then_starts_from_it(tmp_path):
    """`--checkpoint.create_seed_checkpoint` was accepted by `titan rl` and ignored (it trained
    instead): it now writes the initial weights as step 0 and stops, as in `titan train`, and
    a run with the same flags resumes from it; the warm-up counts its tokens."""
    flags = [*SHORT, "--training.steps", "3", "--checkpoint.enable"]
    seed_run = run_rl(tmp_path, *flags, "--checkpoint.create_seed_checkpoint")
    assert "seed checkpoint written" in seed_run.stderr + seed_run.stdout
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-0"]
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing trained
    resumed = run_rl(tmp_path, *flags)
    assert "training starts at step 0 from the loaded weights" in resumed.stderr + resumed.stdout
    warmup = [r for r in records(tmp_path) if r.get("phase") == "sft_warmup"]
    assert [r["step"] for r in warmup] == [1, 2]
    assert 0 < warmup[0]["tokens_seen"] < warmup[1]["tokens_seen"]


def test_every_loop_shares_the_loop_base():
    """Pretraining, SFT and RL run one shell (titan.train.loop): the run, the supervised step,
    the metrics path; a loop adds its data and its steps only."""
    from titan.train.loop import TrainingLoop
    from titan.train.sft import SFTTrainer
    from titan.train.trainer import Trainer

    for loop in (Trainer, SFTTrainer, RLTrainer):
        assert issubclass(loop, TrainingLoop)
        for shared in ("train", "train_step", "global_loss", "log_step", "log_record"):
            assert getattr(loop, shared) is getattr(TrainingLoop, shared), (loop, shared)


def test_async_rl_from_loaded_weights_generates_its_first_rollout_with_them(tmp_path):
    """With --rl.max_policy_staleness >= 1 and no KL reference, nothing synced the generator
    before the first background rollout: a run starting from --checkpoint.initial_load_path
    generated rollout 0 with the generator's freshly built weights (reported as version 0,
    so no staleness check caught it). The first sync now always precedes the first rollout:
    trainer and generator log-probs of rollout 0 agree."""
    run_rl(tmp_path / "trained", *SHORT, "--training.steps", "3", "--checkpoint.enable")
    loaded = ["--checkpoint.initial_load_path", str(tmp_path / "trained" / "checkpoint" / "step-3")]
    run_rl(tmp_path / "rl", *SHORT, *loaded, "--rl.sft_warmup_steps", "0", "--training.steps", "2",
           "--rl.max_policy_staleness", "1", "--rl.no_drop_zero_variance")
    rl = [r for r in records(tmp_path / "rl") if r.get("phase") == "rl"]
    assert rl[0]["step"] == 1 and rl[0]["staleness"] == 0
    assert rl[0]["logprob_diff_max"] <= 1e-5, rl[0]


def test_rl_evaluations_reach_tensorboard(tmp_path):
    """Held-out evaluations go through the metrics logger like every step: TensorBoard gets
    `eval_reward` and `eval_exact_match` at the evaluation steps, equal to the JSONL lines
    (they used to be appended to metrics.jsonl by hand, so TensorBoard and W&B never saw them)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_rl(tmp_path, *SHORT, "--rl.eval_freq", "4", "--rl.eval_prompts", "8", "--metrics.enable_tensorboard")
    saved = json.loads((tmp_path / "config.json").read_text())  # the run folder says how it was made
    assert saved["type"] == "RLConfig" and saved["rl"]["eval_freq"] == 4
    evals = [r for r in records(tmp_path) if r.get("phase") == "eval"]
    assert [r["step"] for r in evals] == [2, 4, 8]  # RL's start (after the 2 warm-up steps), every 4th, the last
    acc = EventAccumulator(str(tmp_path / "tb" / "rank0"))
    acc.Reload()
    for key in ("eval_reward", "eval_exact_match", "eval_reward_char_match"):  # each reward term too
        got = {e.step: e.value for e in acc.Scalars(key)}
        assert got == {r["step"]: pytest.approx(r[key], rel=1e-6, abs=1e-12) for r in evals}, key


# The recipe before its demonstrations-only warm-up: quicker to show a rise (20 RL steps).
LEARNS = ["--training.steps", "80", "--metrics.log_freq", "1", "--rl_data.sft_demonstrations", "0",
          "--rl.ppo_epochs", "1", "--rl.kl_coef", "0", "--rl.eval_prompts", "32"]
# Async (staleness 1: rollout i + 1 generates while rollout i trains) with the KL penalty on.
ASYNC_KL = [*DETERMINISTIC, "--rl.max_policy_staleness", "1", "--rl.no_drop_zero_variance", "--rl.kl_coef", "0.05"]

# Two PPO passes with sequence-level importance weights (the product of a completion's token
# ratios), trained one rollout behind the generator so that trainer and generator differ; in
# rows of 24 positions, so that CP 2's load-balanced quarters (0-5 and 18-23 on one rank, 6-17
# on the other) split the completions (at 32 they lay within one rank's share).
SEQUENCE_IS = ["--rl.ppo_epochs", "2", "--rl.is_level", "sequence", "--rl.max_policy_staleness", "1",
               "--training.seq_len", "24"]

# CP 2 with grpo also trains on the rollout's top half of tokens by entropy: each rank holds a
# share of every completion, so the cut is taken over the shares of both ranks.
CP_EXTRA = {"grpo": ["--rl.top_entropy_quantile", "0.5"], "gspo": []}

# The 2-rank runs of several tests, in one launch (tests/train_runs_worker.py): starting
# torchrun, importing torch and rendezvousing cost ~11 s of CPU per launch, as much as some of
# these runs. The full-logits probe (sitecustomize.py) is on for all of them: only the TP run
# shards its logits, and no run may gather them whole.
TWO_RANK_RUNS = {
    "learns": LEARNS,
    "pp": [*DETERMINISTIC, "--parallelism.pipeline_parallel_degree", "2"],
    "pp_two_passes": [*DETERMINISTIC, "--rl.ppo_epochs", "2", "--parallelism.pipeline_parallel_degree", "2"],
    "tp": [*DETERMINISTIC, "--parallelism.tensor_parallel_degree", "2", "--training.loss_chunk_tokens", "40"],
    "async_kl": ASYNC_KL,
    # Groups of 3 split unevenly over the 2 ranks; rows of 40 positions hold up to 2
    # completions, one row per microbatch: the ranks' packed shares come to different
    # microbatch counts (the shorter runs a row of padding).
    **{name: [*DETERMINISTIC, "--training.steps", "6", "--rl.group_size", "3", "--training.seq_len", "40",
              "--training.local_batch_size", "1", *flags] for name, flags in (("fsdp", []), ("padding_free", ["--rl.padding_free"]))},
    "every_rank": [*SHARED, "--rl.colocated_generation", "every_rank"],
    "resume_every_rank": [*RESUMED, "--rl.colocated_generation", "every_rank"],
    "critic_fsdp": CRITIC_LAYOUT,
    **{f"critic_{name}": [*CRITIC_LAYOUT, *flags, "--parallelism.data_parallel_shard_degree", "1"]
       for name, flags in (("tp", ["--parallelism.tensor_parallel_degree", "2"]),
                           ("pp", ["--parallelism.pipeline_parallel_degree", "2"]),
                           ("cp", ["--parallelism.context_parallel_degree", "2"]))},
    **{f"cp_{loss}": [*DETERMINISTIC, *SEQUENCE_IS, *CP_EXTRA[loss], "--rl.loss_type", loss,
                      "--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
       for loss in ("grpo", "gspo")},
}
TWO_RANKS = pytest.mark.xdist_group("rl_two_ranks")


@pytest.fixture
def two_rank_runs(build_once) -> Path:
    """The folder of the launch of ``TWO_RANK_RUNS`` (one dump folder per run, and launch.log)."""

    def build(folder: Path) -> None:
        runs = [(name, rl_flags(folder / name, *flags)) for name, flags in TWO_RANK_RUNS.items()]
        launch_train_runs(2, runs, folder / "launch.log", command="rl",
                          env={"PYTHONPATH": pythonpath_with_this_folder(), "TITAN_TEST_REFUSE_FULL_LOGITS": "1"})

    return build_once("rl_two_ranks", build)


@pytest.fixture
def one_rank_short(build_once) -> list[dict]:
    """The records of one 1-rank run of ``DETERMINISTIC`` (shared by the layout tests)."""
    return records(build_once("rl_one_rank_short", lambda folder: run_rl(folder / "run", *DETERMINISTIC)) / "run")


@pytest.mark.slow
@TWO_RANKS
def test_two_fsdp_trainer_ranks_raise_held_out_reward(two_rank_runs):
    """FSDP over 2 trainer ranks, rank 0 generating for both: every sync is checked tensor by
    tensor (a mismatch stops the run), trainer and generator log-probs agree on every step,
    and the held-out reward rises over 20 RL steps (0.33 -> 0.49 measured on one rank). The
    disaggregated launch (NGPU=3, one generator rank) is not run 80 steps again: it equals
    this layout record for record (test_one_generator_rank_reproduces_the_colocated_run)."""
    rows = records(two_rank_runs / "learns")
    rl = [r for r in rows if r.get("phase") == "rl"]
    evals = [r for r in rows if r.get("phase") == "eval"]
    assert len(rl) == 20 and all(r["staleness"] == 0 for r in rl)
    assert max(r["logprob_diff_max"] for r in rl) <= 1e-5
    assert [e["step"] for e in evals] == [60, 80]
    assert evals[-1]["eval_reward"] >= evals[0]["eval_reward"] + 0.05, evals


@pytest.mark.slow
@TWO_RANKS
def test_pipeline_parallel_rl_steps_run_and_match_one_rank(two_rank_runs, one_rank_short):
    """PP 2: the stage without the loss takes part in the stats' reductions (it crashed), the
    warm-up loss is the last stage's (it logged 0), and the trainer's weights reach the
    generator (log-probs agree)."""
    assert "autograd kernel was not registered" not in run_output(two_rank_runs / "launch.log", "pp")
    one, pp = one_rank_short, records(two_rank_runs / "pp")
    assert [r["step"] for r in pp] == [r["step"] for r in one] == list(range(1, 9))
    # The warm-up has no sampling: same init, same batches, the same loss up to summation order.
    assert pp[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-5) and pp[0]["loss"] > 1
    rl = [r for r in pp if r.get("phase") == "rl"]
    assert len(rl) == 6 and max(r["logprob_diff_max"] for r in rl) <= 1e-5
    assert all(r["grad_norm"] > 0 for r in rl)


@pytest.mark.slow
@TWO_RANKS
def test_padding_free_under_fsdp_matches_one_completion_per_row(two_rank_runs):
    """--rl.padding_free on 2 FSDP ranks: each packs its own share of the rollout, so the ranks
    may hold different numbers of microbatches (the shorter adds rows of padding to run the
    same collectives: checked once by logging each rank's count, 1 against 2);
    the RL steps equal the same layout's unpacked run up to float32 summation order (measured:
    6e-7 relative; FSDP 2 itself is 1e-5 from one rank after a few steps, so the comparison
    stays within the layout)."""
    packed, plain = ([r for r in records(two_rank_runs / name) if r.get("phase") == "rl"] for name in ("padding_free",
                                                                                                      "fsdp"))
    assert [r["step"] for r in packed] == [r["step"] for r in plain] and packed
    for mine, theirs in zip(packed, plain, strict=True):
        assert mine["reward_mean"] == theirs["reward_mean"]
        for key in ("loss", "grad_norm", "entropy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (mine["step"], key)
    assert any(m["padding_fraction"] < t["padding_fraction"] for m, t in zip(packed, plain, strict=True))


@pytest.mark.slow
@TWO_RANKS
def test_pipeline_parallel_with_a_pre_update_pass_matches_one_rank(tmp_path, two_rank_runs):
    """PP 2 with two PPO passes per rollout: the trainer's pre-update log-probs come from a
    forward-only pipeline pass, after which torch's schedule infers its stage metadata again
    by running the loss on placeholder tensors; the RL loss must not count that call (its
    KL and entropy came out NaN). Equal to one rank up to float32 summation order."""
    run_rl(tmp_path / "one", *DETERMINISTIC, "--rl.ppo_epochs", "2")
    assert_two_pass_runs_match(two_rank_runs / "pp_two_passes", tmp_path / "one")


@pytest.mark.slow
@TWO_RANKS
@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_context_parallel_rl_with_sequence_weights_matches_one_rank(tmp_path, two_rank_runs, loss):
    """CP 2 gives each rank a share of every completion's tokens. A sequence's importance
    weight (--rl.is_level sequence) is the product of all its tokens' ratios: each rank used
    its own share's (the gradient 17% off, tests/test_gradient_parity.py) until the log-ratio
    sums were added over the CP ranks; GSPO's sequence ratio, the geometric mean of them, was
    refused under CP. Equal to one rank up to float32 summation order. With grpo only the top
    half of the rollout's tokens by entropy train (--rl.top_entropy_quantile 0.5): the cut over
    both ranks' shares is the one rank's, and so are the tokens it keeps."""
    run_rl(tmp_path / "one", *DETERMINISTIC, *SEQUENCE_IS, *CP_EXTRA[loss], "--rl.loss_type", loss)
    assert_two_pass_runs_match(two_rank_runs / f"cp_{loss}", tmp_path / "one")
    if CP_EXTRA[loss]:
        cp, one = ([r for r in records(folder) if r.get("phase") == "rl"] for folder in (two_rank_runs / "cp_grpo",
                                                                                           tmp_path / "one"))
        for mine, theirs in zip(cp, one, strict=True):
            assert mine["entropy_cut"] == pytest.approx(theirs["entropy_cut"], rel=1e-5)
            assert mine["policy_token_fraction"] == theirs["policy_token_fraction"]
            assert 0.5 <= mine["policy_token_fraction"] <= 0.55, mine


def assert_two_pass_runs_match(run: Path, one_rank: Path) -> None:
    """The RL steps of ``run`` (two PPO passes per rollout) equal the one-rank run's."""
    pp, one = ([r for r in records(folder) if r.get("phase") == "rl"] for folder in (run, one_rank))
    assert [r["step"] for r in pp] == [r["step"] for r in one] == [4, 6, 8]
    for mine, theirs in zip(pp, one, strict=True):
        # The loss sums per-token terms of order 1 and of either sign to ~0.02 (advantages
        # cancel): compare it absolutely at a few float32 ulp of its terms (2e-8 measured);
        # norm, KL and entropy relatively (float32 sums in another order: ~1e-7 measured).
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=0, abs=1e-6), mine["step"]
        for key in ("grad_norm", "kl", "entropy"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (mine["step"], key)
        # The trainer/generator mismatch: ~0 on policy, the policy's lag when async.
        assert mine["updates"] == 2
        assert mine["logprob_diff_max"] == pytest.approx(theirs["logprob_diff_max"], rel=1e-4, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("staleness,generator_ranks", [("0", "0"), ("1", "0"), ("1", "1"), ("1", "every_rank")],
                         ids=["on_policy", "async", "disaggregated", "every_rank"])
def test_a_failing_reward_stops_every_rank_with_its_message(tmp_path, staleness, generator_ranks):
    """Rank 0 scores the rollouts (in a background thread when async; a generator rank when
    disaggregated): its error must reach every trainer rank, instead of leaving them in the
    rollout broadcast until the collective timeout (10 minutes), and a generator rank must
    stop too. With every rank generating, a reward that fails on rank 1 only stops rank 0 as
    well. The subprocess timeout guards against that hang."""
    every_rank = generator_ranks == "every_rank"
    ranks = 2 if every_rank else 2 + int(generator_ranks)
    layout = (["--rl.colocated_generation", "every_rank", "--rl.reward_function", "failing_reward:raises_on_rank_1"]
              if every_rank else ["--rl.generator_ranks", generator_ranks, "--rl.reward_function", "failing_reward:raises"])
    result = run_rl_ranks(ranks, tmp_path, *SHORT, "--rl.rewards", "function", "--rl.max_policy_staleness", staleness,
                          *layout, check=False, timeout=300)
    assert result.returncode != 0
    output = result.stdout + result.stderr
    error = "RewardError: reward 'function' raised ValueError: the grader is broken"
    if every_rank:
        assert output.count(f"failed on rank 1: {error}") >= 2, output[-4000:]  # rank 0 stops with it
    elif generator_ranks == "0":
        assert output.count(f"failed on rank 0: {error}") >= 2, output[-4000:]  # both ranks stop with it
    else:
        assert output.count(f"failed on rank 0: GeneratorError: generator rank 0: {error}") >= 2, output[-4000:]
        assert f"GeneratorError: generator rank 0: {error}" in output.replace(
            f"failed on rank 0: GeneratorError: generator rank 0: {error}", ""), output[-4000:]  # the generator too


@pytest.mark.slow
def test_completions_are_logged_with_the_rewards_the_metrics_average(tmp_path):
    """--rl.log_completions writes each rollout's 16 completions (4 prompts x 4) with their
    prompt and answer, at the step its metrics record has; their rewards average to that
    record's reward_mean; their advantages sum to 0 in every group; a rollout with nothing to
    learn is logged too, untrained; --rl.num_completions_to_print 2 prints two completions of
    each trained rollout at its logged step. With --rl.advantage_std_scope batch (TRL's
    scale_rewards="batch") an advantage is its reward minus its group's mean over the std of
    the rollout's 16 rewards, by hand. Two rewards (exact_match, char_match at weight 0.5):
    each completion logs both, its reward is their weighted sum, and each step's record has
    each reward's mean over its completions (TRL's per-reward metrics)."""
    result = run_rl(tmp_path, *SHORT, "--rl.log_completions", "--rl.num_completions_to_print", "2",
                    "--rl.advantage_std_scope", "batch", "--rl.rewards", "exact_match", "char_match",
                    "--rl.reward_weights", "1", "0.5")
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    rl = [r for r in records(tmp_path) if r.get("phase") == "rl"]
    trained = {r["rollout_index"] - 1 for r in rl}  # the record holds the next rollout's index
    assert rl and {r["rollout"] for r in rows} >= trained
    assert all(not r["trained"] for r in rows if r["rollout"] not in trained)
    for record in rl:
        mine = [r for r in rows if r["rollout"] == record["rollout_index"] - 1]
        assert {r["step"] for r in mine} == {record["step"]}
        assert len(mine) == 16 and all(r["prompt"] and r["answer"] is not None and r["tokens"] >= 1 for r in mine)
        assert sum(r["reward"] for r in mine) / 16 == pytest.approx(record["reward_mean"], abs=1e-12)
        for name in ("exact_match", "char_match"):
            assert record[f"reward_{name}_mean"] == pytest.approx(sum(r["rewards"][name] for r in mine) / 16, abs=1e-12)
        assert all(r["reward"] == pytest.approx(r["rewards"]["exact_match"] + 0.5 * r["rewards"]["char_match"])
                   for r in mine)
        rewards = [r["reward"] for r in mine]
        batch_std = (sum((x - sum(rewards) / 16) ** 2 for x in rewards) / 16) ** 0.5
        for group in range(4):
            members = [r for r in mine if r["group"] == group]
            mean = sum(r["reward"] for r in members) / len(members)
            # float32 advantages, against the float64 formula: a few float32 ulps
            assert [r["advantage"] for r in members] == pytest.approx(
                [(r["reward"] - mean) / (batch_std + 1e-6) for r in members], rel=1e-5, abs=1e-6)
    output = result.stdout + result.stderr
    assert output.count(" of rollout ") == len(rl) and output.count("  group ") == 2 * len(rl)


def _gdpo_by_hand(groups: list[list[dict]], weights: dict[str, float]) -> list[list[float]]:
    """GDPO's advantages of the kept groups' logged completions: each reward normalized within
    its group (population std + 1e-6), weighted, summed; the sums normalized over them all."""
    def normalized(values: list[float]) -> list[float]:
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
        return [(v - mean) / (std + 1e-6) for v in values]

    sums = [[0.0] * len(group) for group in groups]
    for label, weight in weights.items():
        for g, group in enumerate(groups):
            for j, value in enumerate(normalized([r["rewards"][label] for r in group])):
                sums[g][j] += weight * value
    flat = [v for group in sums for v in group]
    mean = sum(flat) / len(flat)
    std = (sum((v - mean) ** 2 for v in flat) / len(flat)) ** 0.5
    return [[(v - mean) / (std + 1e-6) for v in group] for group in sums]


@pytest.mark.slow
def test_gdpo_advantages_normalize_each_reward_first_by_hand(tmp_path):
    """--rl.multi_objective_aggregation normalize_then_sum with exact_match, char_match (weight
    0.5) and the soft overlong penalty (weight 1): each logged completion's advantage is GDPO's,
    recomputed from the logged per-reward values (the groups that train make the batch; the
    others get 0), and the update is not the summed rewards' one."""
    flags = [*SHORT, "--training.steps", "5", "--rl.log_completions", "--rl.rewards", "exact_match", "char_match",
             "--rl.reward_weights", "1", "0.5", "--rl.overlong_buffer_len", "4"]
    run_rl(tmp_path / "summed", *flags, "--training.steps", "3")  # its first RL step only
    run_rl(tmp_path / "gdpo", *flags, "--rl.multi_objective_aggregation", "normalize_then_sum")
    rows = [json.loads(line) for line in (tmp_path / "gdpo" / "completions.jsonl").read_text().splitlines()]
    weights = {"exact_match": 1.0, "char_match": 0.5, "overlong_penalty": 1.0}
    checked = 0
    for rollout in sorted({r["rollout"] for r in rows}):
        groups = [[r for r in rows if r["rollout"] == rollout and r["group"] == g]
                  for g in sorted({r["group"] for r in rows if r["rollout"] == rollout})]
        assert all(set(r["rewards"]) == set(weights) for group in groups for r in group)
        kept = [group for group in groups if len({r["reward"] for r in group}) > 1]
        assert all(r["advantage"] == 0 for group in groups if group not in kept for r in group)
        if kept:
            want = _gdpo_by_hand(kept, weights)
            for group, advantages in zip(kept, want, strict=True):
                assert [r["advantage"] for r in group] == pytest.approx(advantages, rel=1e-5, abs=1e-6)
            checked += 1
    assert checked >= 2
    summed, gdpo = ([r for r in records(tmp_path / name) if r.get("phase") == "rl"] for name in ("summed", "gdpo"))
    assert summed[0]["reward_mean"] == gdpo[0]["reward_mean"] and summed[0]["grad_norm"] != gdpo[0]["grad_norm"]


@pytest.mark.slow
def test_padding_free_rows_train_as_one_completion_per_row(tmp_path, one_rank_short):
    """--rl.padding_free packs the completions (best-fit decreasing, each its own document):
    the same rollouts train to the same losses, gradient norms, KL and entropy as one
    completion per padded row, up to float32 summation order (each completion attends only to
    itself); its refusals name the flags."""
    run_rl(tmp_path / "packed", *DETERMINISTIC, "--rl.padding_free")
    packed = [r for r in records(tmp_path / "packed") if r.get("phase") == "rl"]
    plain = [r for r in one_rank_short if r.get("phase") == "rl"]
    assert [r["step"] for r in packed] == [r["step"] for r in plain] and packed
    for mine, theirs in zip(packed, plain, strict=True):
        assert mine["reward_mean"] == theirs["reward_mean"]
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=0, abs=1e-6), mine["step"]
        for key in ("grad_norm", "entropy", "kl"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (mine["step"], key)
        assert mine["padding_fraction"] <= theirs["padding_fraction"], mine["step"]
    # Measured: 0.31 vs 0.31 at step 3 (8 completions of 17+ positions: no two share a row of
    # 32), 0.28 vs 0.64 after (4 completions: one microbatch of fewer rows, no filler rows).
    assert any(m["padding_fraction"] < t["padding_fraction"] for m, t in zip(packed, plain, strict=True))
    # Sequence-level terms sum each completion's own document (tests/test_gradient_parity.py:
    # CP 2, FSDP 2 and PP 2 packed equal one process unpacked); packing without document
    # masking would let completions see each other: refused.
    RLSection(padding_free=True, loss_type="gspo", is_level="sequence", off_policy_mask_threshold=0.1)
    from titan.recipes.cli import parse_train_args
    from titan.recipes.families import model_spec

    config = parse_train_args(["--config", "grpo_debug", "--rl.padding_free", "--training.no_document_mask",
                               "--job.dump_folder", str(tmp_path / "unmasked")], command="rl")
    with pytest.raises(ValueError, match="drop --training.no_document_mask"):
        RLTrainer(config, model_spec=model_spec("llama3"))


@pytest.mark.slow
def test_reinforce_pp_baseline_advantages_by_hand_and_kl_in_the_reward(tmp_path):
    """--rl.advantage_estimator reinforce_plus_plus_baseline: each logged advantage is its
    reward less its group's mean, whitened over every token of the rollout (each completion
    counted for its length), recomputed from completions.jsonl. reinforce_plus_plus with
    --rl.kl_in_reward_coef: a reference is kept for the reward alone (no KL term in the loss),
    nothing is taken at the first RL step (the policy is the reference), then a positive
    KL (k3) is, and the steps train."""
    flags = [*SHORT, "--training.steps", "4", "--rl.rewards", "char_match", "--rl.no_drop_zero_variance"]
    run_rl(tmp_path / "baseline", *flags, "--rl.advantage_estimator", "reinforce_plus_plus_baseline",
           "--rl.log_completions")
    rows = [json.loads(line) for line in (tmp_path / "baseline" / "completions.jsonl").read_text().splitlines()]
    for rollout in sorted({r["rollout"] for r in rows}):
        mine = [r for r in rows if r["rollout"] == rollout]
        means = {g: sum(r["reward"] for r in mine if r["group"] == g) / sum(r["group"] == g for r in mine)
                 for g in {r["group"] for r in mine}}
        tokens = [(r["reward"] - means[r["group"]], r["tokens"]) for r in mine]
        total = sum(n for _, n in tokens)
        mean = sum(x * n for x, n in tokens) / total
        std = (sum((x - mean) ** 2 * n for x, n in tokens) / total) ** 0.5
        assert [r["advantage"] for r in mine] == pytest.approx([(x - mean) / (std + 1e-6) for x, _ in tokens],
                                                              rel=1e-5, abs=1e-6)
    run_rl(tmp_path / "kl", *flags, "--training.steps", "6", "--rl.advantage_estimator", "reinforce_plus_plus",
           "--rl.kl_in_reward_coef", "0.5", "--rl.kl_in_reward_estimator", "k3", "--rl.kl_in_reward_target", "1e-4",
           "--rl.kl_in_reward_horizon", "100")
    rl = [r for r in records(tmp_path / "kl") if r.get("phase") == "rl"]
    # k3 >= 0 per token; at the first step generator and reference agree up to float32 (~1e-7)
    assert abs(rl[0]["kl_in_reward"]) < 1e-5 and all(r["kl_in_reward"] > 1e-5 for r in rl[1:]) and len(rl) >= 2
    assert all(r["grad_norm"] > 0 for r in rl)
    # The adaptive coefficient (--rl.kl_in_reward_target): each rollout's, by hand from the one
    # before and the KL it measured (16 completions a rollout), starting at the flag's 0.5.
    assert rl[0]["kl_in_reward_coef"] == 0.5
    for before, after in itertools.pairwise(rl):
        error = min(max(before["kl_in_reward_kl"] / 1e-4 - 1, -0.2), 0.2)
        assert after["kl_in_reward_coef"] == pytest.approx(before["kl_in_reward_coef"] * (1 + error * 16 / 100), rel=1e-12)
    assert rl[1]["kl_in_reward_coef"] < 0.5  # the first rollout measured no KL: below the target, it shrinks


@pytest.mark.slow
def test_soft_overlong_penalty_lowers_the_first_rollouts_rewards_by_hand(tmp_path):
    """Budget 10, buffer 9: every completion (at least 1 token) pays (length - 1) / 9, so the
    first RL rollout (the same completions in both runs) loses (mean length - 1) / 9."""
    flags = [*SHORT, "--training.steps", "3", "--rl.no_drop_zero_variance"]  # rollout 0 trains in both
    run_rl(tmp_path / "plain", *flags)
    run_rl(tmp_path / "penalty", *flags, "--rl.overlong_buffer_len", "9")
    plain, penalty = ([r for r in records(tmp_path / name) if r.get("phase") == "rl"][0] for name in ("plain", "penalty"))
    assert penalty["rollout_index"] == plain["rollout_index"] == 1  # rollout 0 done
    assert penalty["response_length_mean"] == plain["response_length_mean"] > 1
    want = plain["reward_mean"] - (plain["response_length_mean"] - 1) / 9
    assert penalty["reward_mean"] == pytest.approx(want, abs=1e-9)


@pytest.mark.slow
def test_top_entropy_quantile_trains_the_top_share_of_tokens_by_entropy(tmp_path):
    """--rl.top_entropy_quantile 0.2 with one update per rollout (the entropies come from a pass
    of their own): the same first rollout as without it, a fifth of its loss tokens carry the
    policy term (ties aside: at least 20%), and the update is smaller."""
    flags = [*SHORT, "--training.steps", "3", "--rl.ppo_epochs", "1", "--rl.rewards", "char_match"]  # graded: variance
    run_rl(tmp_path / "plain", *flags)
    run_rl(tmp_path / "top", *flags, "--rl.top_entropy_quantile", "0.2")
    plain, top = ([r for r in records(tmp_path / name) if r.get("phase") == "rl"][0] for name in ("plain", "top"))
    assert top["reward_mean"] == plain["reward_mean"] and top["entropy"] == pytest.approx(plain["entropy"], rel=1e-6)
    assert "policy_token_fraction" not in plain and "entropy_cut" not in plain
    assert 0.2 <= top["policy_token_fraction"] <= 0.25, top
    assert 0 < top["entropy_cut"] and top["grad_norm"] < plain["grad_norm"]


@pytest.mark.slow
def test_off_policy_masking_drops_drifted_bad_samples_of_an_async_run(tmp_path):
    """One rollout behind (--rl.max_policy_staleness 1) the policy has moved from the one that
    sampled: a threshold of 0 nats masks the negative-advantage completions it now finds less
    likely (some, not all tokens), and the update changes (a mask of ones changes nothing:
    test_losses.py)."""
    flags = [*SHORT, "--training.steps", "6", "--rl.rewards", "char_match", "--rl.max_policy_staleness", "1",
             "--debug.deterministic"]
    run_rl(tmp_path / "plain", *flags)
    run_rl(tmp_path / "zero", *flags, "--rl.off_policy_mask_threshold", "0")
    plain, zero = ([r for r in records(tmp_path / name) if r.get("phase") == "rl"] for name in ("plain", "zero"))
    stale = [r for r in zero if r["staleness"] == 1]
    assert stale and all(0 < r["off_policy_masked_fraction"] < 1 for r in stale), stale
    assert all(r["policy_token_fraction"] == 1 - r["off_policy_masked_fraction"] for r in zero)
    first = next(i for i, r in enumerate(zero) if r["off_policy_masked_fraction"] > 0)
    assert zero[first]["reward_mean"] == plain[first]["reward_mean"]  # the same rollout ...
    assert zero[first]["grad_norm"] != plain[first]["grad_norm"]  # ... trained on fewer tokens


@pytest.mark.slow
def test_titan_rl_on_conversational_jsonl_prompts(tmp_path, monkeypatch):
    """`titan rl` on JSONL prompts in TRL's conversational format (a list of messages per row):
    each is rendered with the chat template (the byte tokenizer's: the built-in one) and the
    assistant header, generated from, scored and trained on; the reward sees the rendered text
    and the row's answer."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"reverse {w}"}], "answer": w[::-1]})
                               + "\n" for w in ("abc", "hello", "xyz", "rl")))
    log = tmp_path / "rewards.jsonl"
    monkeypatch.setenv("TITAN_TEST_REWARD_LOG", str(log))
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # the reward module (titan runs forked)
    result = run_rl(tmp_path / "run", *SHORT, "--training.steps", "2", "--rl.sft_warmup_steps", "0", "--training.seq_len", "48",
           "--rl_data.format", "jsonl",
           "--rl_data.path", str(prompts), "--rl.rewards", "function", "--rl.reward_function",
           "recording_reward:records", "--rl.no_drop_zero_variance", "--rl.eval_freq", "1")
    # no --rl_data.eval_path: said once, and no evaluation records (they were logged as NaN)
    assert "no held-out prompts (--rl_data.eval_path): the run is not evaluated" in result.stderr + result.stdout
    assert not [r for r in records(tmp_path / "run") if r.get("phase") == "eval"]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 2 * 4 * 4  # 2 rollouts of 4 prompts x 4 completions
    assert {(c["prompt"], c["answer"]) for c in calls} == {
        (f"<|user|>\nreverse {w}\n<|assistant|>\n", w[::-1]) for w in ("abc", "hello", "xyz", "rl")}
    rl_steps = [r for r in records(tmp_path / "run") if r.get("phase") == "rl"]
    assert len(rl_steps) == 2 and all(r["rows"] == 16 for r in rl_steps)

    # a reward written for TRL's GRPOTrainer: the conversation, the completion as an assistant
    # message, the row's columns by name
    trl_log = tmp_path / "trl_rewards.jsonl"
    monkeypatch.setenv("TITAN_TEST_REWARD_LOG", str(trl_log))
    run_rl(tmp_path / "trl", *SHORT, "--training.steps", "1", "--rl.ppo_epochs", "1", "--rl.sft_warmup_steps", "0",
           "--training.seq_len", "48", "--rl_data.format", "jsonl", "--rl_data.path", str(prompts), "--rl.rewards",
           "function", "--rl.reward_function", "recording_reward:trl_records", "--rl.no_drop_zero_variance")
    calls = [json.loads(line) for line in trl_log.read_text().splitlines()]
    assert len(calls) == 4 * 4 and all(c["other"] == [] for c in calls)
    assert {(json.dumps(c["prompt"]), c["answer"]) for c in calls} == {
        (json.dumps([{"role": "user", "content": f"reverse {w}"}]), w[::-1]) for w in ("abc", "hello", "xyz", "rl")}
    assert all(c["completion"][0]["role"] == "assistant" and len(c["completion"]) == 1 for c in calls)


@pytest.mark.slow
def test_dynamic_sampling_refills_dropped_groups(tmp_path):
    """DAPO's dynamic sampling: groups without reward variance are replaced by fresh ones, so
    every step trains on --rl.prompts_per_step groups; without it those steps train on fewer."""
    flags = ["--training.steps", "26", "--rl.sft_warmup_steps", "20", "--rl.eval_freq", "0", "--rl.prompts_per_step",
             "4", "--rl.group_size", "4", "--training.local_batch_size", "16", "--metrics.log_freq", "1",
             "--rl.ppo_epochs", "1", "--rl.kl_coef", "0", "--rl_data.sft_demonstrations", "0"]
    run_rl(tmp_path / "plain", *flags)
    run_rl(tmp_path / "refill", *flags, "--rl.max_refill_rounds", "3")
    plain = [r for r in records(tmp_path / "plain") if r.get("phase") == "rl"]
    refill = [r for r in records(tmp_path / "refill") if r.get("phase") == "rl"]
    assert any(r["rows"] < 16 for r in plain), "no group was dropped: the test shows nothing"
    assert all(r["refill_rounds"] == 0 for r in plain)
    assert any(r["refill_rounds"] > 0 for r in refill)
    for r in refill:  # full steps, unless the bound on extra rounds was reached
        assert r["rows"] == 16 or r["refill_rounds"] == 3, r
        assert r["refill_rounds"] <= 3


@pytest.mark.slow
@TWO_RANKS
def test_tensor_parallel_rl_keeps_the_logits_sharded_and_matches_one_rank(two_rank_runs, one_rank_short):
    """TP 2 with loss parallel: the RL loss computes token log-probs and entropy from the
    vocab-sharded logits (a gather of the full logits raises in every process of the run:
    the probe in this folder's sitecustomize.py), in chunks of 40 positions
    (--training.loss_chunk_tokens; a microbatch has 8 rows of 32), and trains like one rank in one
    piece."""
    one, tp = one_rank_short, records(two_rank_runs / "tp")
    rl_one, rl_tp = ([r for r in rows if r.get("phase") == "rl"] for rows in (one, tp))
    assert [r["step"] for r in rl_tp] == [r["step"] for r in rl_one] and len(rl_tp) >= 3
    # The first RL step trains on the same rollout (same warm-up weights, same sampling seed).
    assert rl_tp[0]["rollout_index"] == rl_one[0]["rollout_index"]
    assert rl_tp[0]["reward_mean"] == rl_one[0]["reward_mean"]
    assert rl_tp[0]["grad_norm"] == pytest.approx(rl_one[0]["grad_norm"], rel=1e-4)
    assert rl_tp[0]["entropy"] == pytest.approx(rl_one[0]["entropy"], rel=1e-5)
    assert max(r["logprob_diff_max"] for r in rl_tp) <= 1e-5


@pytest.mark.slow
def test_a_run_that_stops_early_still_saves_its_final_checkpoint(tmp_path):
    # A reward every completion earns alike: no group has variance, every rollout is skipped.
    log = run_rl(tmp_path, *SHORT, "--training.steps", "40", "--rl.rewards", "format", "--rl.format_regex", "(?s).*",
                 "--checkpoint.enable", "--checkpoint.interval", "100")
    assert "stopping early at step 2" in log.stderr + log.stdout
    assert [p.name for p in (tmp_path / "checkpoint").iterdir()] == ["step-2"]


@pytest.mark.slow
def test_async_run_uses_but_never_exceeds_its_staleness_bound(tmp_path):
    # Every rollout trains (no group is dropped), so the schedule is exact: sync every 2 steps.
    run_rl(tmp_path, *SHORT, "--rl.max_policy_staleness", "2", "--rl.no_drop_zero_variance")
    rl = [r for r in records(tmp_path) if r.get("phase") == "rl"]
    assert [r["staleness"] for r in rl] == [0, 1, 2, 1, 2, 1], rl
    assert all(r["policy_version"] == r["step"] - 1 - r["staleness"] for r in rl)


# ---- disaggregated: generator ranks beside the trainer ranks ------------------------------

# What a disaggregated run must reproduce of a colocated one: everything but timings and memory.
COMPARED = ("loss", "grad_norm", "reward_mean", "reward_std", "response_length_mean", "kl", "entropy",
            "clip_fraction", "staleness", "policy_version", "logprob_diff_max", "tokens_seen")


@pytest.mark.slow
@TWO_RANKS
def test_one_generator_rank_reproduces_the_colocated_run(tmp_path, two_rank_runs):
    """1 generator rank + 2 FSDP trainer ranks vs the same 2 trainer ranks with rank 0
    generating: the generator rank draws the same prompts and seeds with weights checked
    tensor by tensor after every sync, so the runs are equal record for record. Async
    (staleness 1: rollout i + 1 generates while rollout i trains) with the KL penalty on, so
    the overlap schedule and the reference (taken from the engine, not a generator) are both
    covered."""
    run_rl_ranks(3, tmp_path / "disaggregated", *ASYNC_KL, "--rl.generator_ranks", "1")
    disaggregated, colocated = records(tmp_path / "disaggregated"), records(two_rank_runs / "async_kl")
    assert [r["step"] for r in disaggregated] == [r["step"] for r in colocated] == list(range(1, 9))
    for mine, theirs in zip(disaggregated, colocated, strict=True):
        assert {k: mine.get(k) for k in COMPARED} == {k: theirs.get(k) for k in COMPARED}, mine["step"]
    rl = [r for r in disaggregated if r.get("phase") == "rl"]
    assert [r["staleness"] for r in rl] == [0, 1, 1, 1, 1, 1]  # generation overlapped training
    assert any(r["kl"] > 0 for r in rl)  # the reference is the step-2 policy, not the current one
    assert max(r["logprob_diff_max"] for r in rl if r["staleness"] == 0) <= 1e-5


@pytest.mark.slow
@TWO_RANKS
def test_two_generator_ranks_and_every_rank_generating_share_each_rollout_alike(tmp_path, two_rank_runs):
    """2 generator ranks + 2 trainer ranks: each generator rank generates half of every
    rollout's prompts (dynamic sampling refills its own half), the trainer merges the halves,
    held-out prompts are split too; log-probs agree on every step. The same 2 trainer ranks
    each generating their half themselves (--rl.colocated_generation every_rank) reproduce
    that run record for record: async (each rank's half in its own background thread) with
    the KL penalty (each rank rescoring its half with its own reference copy). Rank 0 alone
    would draw the second half with another sampling seed, so the equality shows that both
    ranks generated."""
    result = run_rl_ranks(4, tmp_path / "disaggregated", *SHARED, "--rl.generator_ranks", "2")
    every = two_rank_runs / "every_rank"  # the same flags, every rank generating: in the shared 2-rank launch
    rows = records(tmp_path / "disaggregated")
    rl = [r for r in rows if r.get("phase") == "rl"]
    assert len(rl) + sum(1 for r in rows if r.get("phase") == "sft_warmup") <= 8 and rl
    assert max(r["logprob_diff_max"] for r in rl if r["staleness"] == 0) <= 1e-5
    assert any(r["kl"] > 0 for r in rl)
    evals = [r for r in rows if r.get("phase") == "eval"]
    assert evals and all(0 <= e["eval_exact_match"] <= 1 for e in evals)
    # 5 held-out prompts over 2 ranks: 3 + 2; an exact match rate is a multiple of 1/5.
    assert all(abs(e["eval_exact_match"] * 5 - round(e["eval_exact_match"] * 5)) < 1e-9 for e in evals)
    assert "Traceback" not in result.stderr
    mine = records(every)
    assert [r["step"] for r in mine] == [r["step"] for r in rows]
    for got, want in zip(mine, rows, strict=True):
        assert {k: got.get(k) for k in (*COMPARED, "eval_reward", "eval_exact_match")} == \
            {k: want.get(k) for k in (*COMPARED, "eval_reward", "eval_exact_match")}, got["step"]
    assert "every rank generates: each of the 2 ranks" in run_output(two_rank_runs / "launch.log", "every_rank")
    # The merged rollouts' completions, with the prompts each share drew (refills included), alike.
    logged = [(folder / "completions.jsonl").read_text().splitlines() for folder in (tmp_path / "disaggregated", every)]
    assert logged[0] == logged[1]
    assert {json.loads(line)["step"] for line in logged[0]} >= {r["step"] for r in rl}


def test_generator_ranks_need_a_trainer_rank(monkeypatch):
    from titan.rl.disaggregated import split_for_generators

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="--rl.generator_ranks 2 leaves no trainer rank in a launch of 2 ranks"):
        split_for_generators(2, timeout_s=10)


def test_disaggregated_flags_are_checked():
    with pytest.raises(ValueError, match="--rl.generator_ranks must be >= 0"):
        RLSection(generator_ranks=-1)
    with pytest.raises(ValueError, match="which this run does not have"):
        RLSection(generator_timeout_s=60)

def test_vllm_generator_ranks_must_own_the_first_gpu_of_their_process():
    import torch
    from titan.rl.generate.build import check_vllm_device

    check_vllm_device("vllm", torch.device("cpu"))
    check_vllm_device("vllm", torch.device("cuda", 0))
    check_vllm_device("native", torch.device("cuda", 3))
    with pytest.raises(ValueError, match="would take cuda:0, another rank's GPU"):
        check_vllm_device("vllm", torch.device("cuda", 2))
    # Engines sharded over the generator ranks run under their group: vLLM takes LOCAL_RANK's GPU.
    check_vllm_device("vllm", torch.device("cuda", 2), in_group=True)


@pytest.mark.slow
def test_sigterm_to_a_disaggregated_launch_saves_and_resumes(tmp_path):
    """torchrun forwards a SIGTERM to every rank: the trainer ranks finish the step and save,
    the generator rank keeps serving until the trainer's stop (it died at the signal before,
    and the trainer could not stop it); the same command then resumes from the checkpoint."""
    import signal

    flags = [*SHORT, "--training.steps", "400", "--checkpoint.enable", "--checkpoint.interval", "1000",
             "--rl.generator_ranks", "1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "-m", "titan.recipes.cli", "rl", *rl_flags(tmp_path, *flags)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = tmp_path / "metrics.jsonl"
    try:
        while proc.poll() is None and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.2)  # polls a condition; pytest-timeout bounds the wait
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGTERM)  # torchrun exits 1 on a signal, after its ranks stop
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    stopped = max(r["step"] for r in records(tmp_path))
    assert stopped < 400 and f"stopped at step {stopped}" in output, output[-3000:]
    assert (tmp_path / "checkpoint" / f"step-{stopped}").is_dir()
    assert "could not tell the generator ranks to stop" not in output, output[-3000:]
    resumed = run_rl_ranks(3, tmp_path, *flags, "--training.steps", str(stopped + 2))
    assert f"resumed from step {stopped}" in resumed.stdout + resumed.stderr
    assert [r["step"] for r in records(tmp_path) if r.get("phase") != "eval"][-1] == stopped + 2


def test_the_reference_moves_toward_the_policy_by_hand():
    """ReferencePolicy.mix: reference <- alpha x policy + (1 - alpha) x reference, by hand; a
    rank without the reference only iterates the (collective) weights."""
    import torch
    from titan.rl.controller import ReferencePolicy

    model = torch.nn.Linear(2, 1, bias=True)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 2.0]]))
        model.bias.fill_(4.0)
    reference = ReferencePolicy(SimpleNamespace(model=model))
    reference.mix(iter([("weight", torch.tensor([[3.0, 6.0]])), ("bias", torch.tensor([0.0]))]), 0.25)
    assert model.weight.tolist() == [[1.5, 3.0]] and model.bias.tolist() == [3.0]
    seen = []
    ReferencePolicy(None).mix((seen.append(name) or (name, None) for name in ("a", "b")), 0.5)
    assert seen == ["a", "b"]
    with pytest.raises(ValueError, match="--rl.ref_sync_steps 4 moves the KL reference"):
        RLSection(ref_sync_steps=4)
    with pytest.raises(ValueError, match="--rl.ref_mixup_alpha is read at each --rl.ref_sync_steps"):
        RLSection(ref_mixup_alpha=0.5, kl_coef=0.1)
    with pytest.raises(ValueError, match="--rl.ref_mixup_alpha must be in"):
        RLSection(ref_mixup_alpha=0.0, ref_sync_steps=2, kl_coef=0.1)


@pytest.mark.slow
def test_a_synced_reference_is_the_policy_after_each_sync(tmp_path):
    """--rl.ref_sync_steps 2 --rl.ref_mixup_alpha 1 (TRL's sync_ref_model): after steps 4 and 6
    the reference becomes the policy, so the on-policy rollouts trained at steps 5 and 7 have
    no KL to it (the frozen reference's run has), while steps 4, 6 and 8 do."""
    flags = [*SHORT, "--debug.deterministic", "--rl.kl_coef", "0.05", "--rl.no_drop_zero_variance"]
    run_rl(tmp_path / "frozen", *flags)
    result = run_rl(tmp_path / "synced", *flags, "--rl.ref_sync_steps", "2", "--rl.ref_mixup_alpha", "1")
    kl = {r["step"]: r["kl"] for r in records(tmp_path / "synced") if r.get("phase") == "rl"}
    frozen = {r["step"]: r["kl"] for r in records(tmp_path / "frozen") if r.get("phase") == "rl"}
    assert sorted(kl) == [3, 4, 5, 6, 7, 8]
    assert kl[5] < 1e-7 and kl[7] < 1e-7 and frozen[5] > 1e-5 and frozen[7] > 1e-5, (kl, frozen)
    assert all(kl[s] > 1e-5 for s in (4, 6, 8)), kl
    assert (kl[3], kl[4]) == (frozen[3], frozen[4])  # the same run until the first sync
    output = result.stdout + result.stderr
    assert "step 4: KL reference moved toward the policy" in output and "step 6: KL reference" in output


@pytest.mark.slow
@TWO_RANKS
def test_ppo_critic_under_every_layout_matches_one_rank_and_is_checkpointed(tmp_path, two_rank_runs):
    """PPO with a critic on 2 ranks (FSDP, TP, PP, CP): the critic is an engine laid out as
    the policy, each rank scoring and training its share of the rollout, so the values,
    returns, value loss and the policy's losses equal one rank's up to float32 summation
    order. The critic ran: its values move from step to step and it has a loss; the
    checkpoint holds its weights and AdamW moments (each rank its shards), and the last step
    exports it whole, gathered from every layout's shards, as a Hugging Face folder."""
    from torch.distributed.checkpoint import FileSystemReader

    one_rank = tmp_path / "one_rank"
    run_rl(one_rank, *CRITIC_LAYOUT)
    one = [r for r in records(one_rank) if r.get("phase") == "rl"]
    assert [r["step"] for r in one] == list(range(1, 9))
    assert all(r["value_loss"] > 0 and r["value_grad_norm"] > 0 for r in one)
    assert len({round(r["values_mean"], 6) for r in one}) == len(one)  # the critic moved every step
    for layout in ("fsdp", "tp", "pp", "cp"):
        run = [r for r in records(two_rank_runs / f"critic_{layout}") if r.get("phase") == "rl"]
        assert [r["step"] for r in run] == [r["step"] for r in one], layout
        for mine, theirs in zip(run, one, strict=True):
            assert mine["loss"] == pytest.approx(theirs["loss"], rel=0, abs=1e-6), (layout, mine["step"])
            for key in ("grad_norm", "value_loss", "values_mean", "returns_mean", "value_grad_norm"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (layout, mine["step"], key)
    for folder in (two_rank_runs / "critic_fsdp", one_rank):
        keys = set(FileSystemReader(str(folder / "checkpoint" / "step-5")).read_metadata().state_dict_metadata)
        critic = {k for k in keys if k.startswith("rl_critic.")}
        assert {"rl_critic.taken", "rl_critic.model.output.weight", "rl_critic.model.tok_embeddings.weight",
                "rl_critic.optimizer.state.output.weight.exp_avg"} <= critic, sorted(critic)[:8]
    from titan.ckpt.hf import load_hf

    exported = {name: load_hf(str(folder / "checkpoint_critic" / "step-8"))
                for name, folder in [("one", one_rank)] + [(n, two_rank_runs / f"critic_{n}")
                                                            for n in ("fsdp", "tp", "pp", "cp")]}
    shapes = {name: {k: tuple(v.shape) for k, v in state.items()} for name, state in exported.items()}
    assert shapes["one"]["score.weight"] == (1, 64) and all(s == shapes["one"] for s in shapes.values()), shapes
    config = json.loads((one_rank / "checkpoint_critic" / "step-8" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
