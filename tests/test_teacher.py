"""`--rl.teacher_model`: a teacher of the policy's family (another size, read from its Hugging
Face folder) as the KL reference: its log-probs are transformers', and with the KL in the reward
per token (on-policy distillation) RL pulls the policy toward it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from forked_cli import run_titan
from titan.rl.config import RLSection
from titan.rl.generate.build import build_teacher

from titan.recipes.families import model_spec

transformers = pytest.importorskip("transformers")

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _teacher(folder: Path, *, vocab_size: int = 320, **config) -> Path:
    """A random transformers Llama wider and deeper than the debug policy, saved as the Hub does."""
    fields = dict(vocab_size=vocab_size, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config})).save_pretrained(str(folder))
    return folder


def test_the_teachers_log_probs_are_transformers(tmp_path):
    folder = _teacher(tmp_path / "teacher")
    teacher = build_teacher(str(folder), model_spec("llama3"), vocab_size=260, seq_len=64, eos_token_id=1,
                            device=torch.device("cpu"))
    assert teacher.model.args.dim == 96 and len(teacher.model.layers) == 3  # its own architecture
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randint(0, 260, (n,), generator=gen).tolist(), torch.randint(0, 260, (m,), generator=gen).tolist())
             for n, m in ((5, 9), (12, 4), (3, 15))]
    got = teacher.rescore(pairs)
    model = transformers.LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for (prompt, completion), ours in zip(pairs, got, strict=True):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logp = model(ids).logits.float().log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(ours), logp[len(prompt) - 1:], rtol=1e-5, atol=1e-5)


def test_what_cannot_be_a_teacher_is_refused(tmp_path):
    spec = model_spec("llama3")
    build = dict(seq_len=64, eos_token_id=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="has 320 token ids and the run's tokenizer 400"):
        build_teacher(str(_teacher(tmp_path / "small")), spec, vocab_size=400, **build)
    with pytest.raises(ValueError, match="is a 'llama' model and the policy a 'qwen3' one"):
        build_teacher(str(tmp_path / "small"), model_spec("qwen3"), vocab_size=260, **build)
    with pytest.raises(ValueError, match="no config.json"):
        build_teacher(str(tmp_path), spec, vocab_size=260, **build)
    with pytest.raises(ValueError, match="and this run has no KL"):
        RLSection(teacher_model="org/teacher")
    with pytest.raises(ValueError, match="drop one of the two"):
        RLSection(teacher_model="org/teacher", kl_coef=0.1, ref_sync_steps=2)
    with pytest.raises(ValueError, match="add --rl.no_drop_zero_variance"):
        RLSection(teacher_model="org/teacher", kl_in_reward_coef=1.0, reward_weights=(0.0,))
    RLSection(teacher_model="org/teacher", kl_in_reward_coef=1.0, reward_weights=(0.0,), drop_zero_variance=False)


def test_a_teacher_of_another_family_is_the_kl_reference(tmp_path):
    """`--rl.teacher_model` of another family than the policy (its folder's `model_type`): a
    transformers Qwen3-MoE teacher of a Qwen3 policy is built with titan's Qwen3-MoE code, the
    KL to it is logged, and the dry run counts its bytes."""
    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], **common)).save_pretrained(str(tmp_path / "teacher"))
    dump = tmp_path / "run"
    result = run_titan(["rl", "--config", "grpo_debug", "--model.name", "qwen3", "--training.steps", "3",
                        "--rl.sft_warmup_steps", "1", "--rl.prompts_per_step", "2", "--rl.group_size", "2",
                        "--training.local_batch_size", "4", "--rl.eval_freq", "0", "--rl.kl_coef", "0.05",
                        "--rl.teacher_model", str(tmp_path / "teacher"), "--metrics.log_freq", "1",
                        "--metrics.no_enable_progress_bar", "--job.dump_folder", dump], env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(r"teacher \S+ \([0-9.]+M parameters\) loaded as the KL reference", result.stderr)
    rl = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rl if r.get("phase") == "rl"]
    assert rl and all(r["kl"] > 0 for r in rl), rl
    # The dry run counts it in place of the KL reference's copy: float32, its own size.
    from titan.dist.dry_run import format_bytes

    dry = run_titan(["dry-run", "--world_size", "2", "--config", "grpo_debug", "--model.name", "qwen3",
                     "--rl.kl_coef", "0.05", "--rl.teacher_model", str(tmp_path / "teacher")], env=ENV, timeout=120)
    params = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "teacher")).num_parameters()
    assert f", teacher {format_bytes(params * 4)})" in dry.stdout and "KL reference" not in dry.stdout, dry.stdout


@pytest.mark.slow
def test_on_policy_distillation_teaches_the_task_with_no_task_reward(tmp_path):
    """A teacher fine-tuned on the sort task, a student from scratch, and no task reward (weight
    0): each token's advantage is its reverse KL to the teacher (the KL in the reward, per token,
    undiscounted). The student's KL to the teacher falls and its held-out answers start matching
    characters of the right ones: what it learned came from the teacher. The teacher is not
    checkpointed."""
    teacher_run = tmp_path / "teacher"
    result = run_titan(["sft", "--config", "sft_debug", "--model.flavor", "debugmodel_tiny", "--sft_data.synthetic_task",
                        "sort", "--training.seq_len", "32", "--training.steps", "80", "--checkpoint.enable",
                        "--checkpoint.last_save_in_hf", "--metrics.no_enable_progress_bar", "--job.dump_folder",
                        teacher_run], env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    teacher = teacher_run / "checkpoint" / "step-80"
    dump = tmp_path / "student"
    steps = 21
    result = run_titan([
        "rl", "--config", "grpo_debug", "--training.steps", str(steps), "--rl.sft_warmup_steps", "1",
        "--rl.eval_freq", "20", "--rl.eval_prompts", "64", "--rl.prompts_per_step", "4", "--rl.group_size", "4",
        "--training.local_batch_size", "16", "--rl.teacher_model", teacher, "--rl.kl_in_reward_coef", "1",
        "--rl.advantage_estimator", "reinforce_plus_plus", "--rl.gamma", "0", "--rl.reward_weights", "0",
        "--rl.no_drop_zero_variance", "--rl.kl_coef", "0", "--rl.ppo_epochs", "1", "--optimizer.lr", "3e-3",
        "--lr_scheduler.warmup_steps", "1", "--metrics.log_freq", "1", "--checkpoint.enable",
        "--checkpoint.no_last_save_model_only", "--metrics.no_enable_progress_bar", "--job.dump_folder", dump],
        env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert re.search(rf"teacher {re.escape(str(teacher))} \([0-9.]+M parameters\) loaded as the KL reference",
                     result.stderr)
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    kl = [r["kl_in_reward"] for r in records if "kl_in_reward" in r]
    assert len(kl) == steps - 1 and sum(kl[-3:]) < 0.6 * sum(kl[:3]), kl
    matched = [r["eval_reward_char_match"] for r in records if "eval_reward_char_match" in r]
    assert matched[0] == 0 and matched[-1] > 0.02, matched
    manifest = json.loads((dump / "checkpoint" / f"step-{steps}" / "titan_checkpoint.json").read_text())
    assert "model" in manifest["states"] and "rl_reference" not in manifest["states"]
