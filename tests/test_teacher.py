"""`--rl.teacher_model`: a teacher of the policy's family (another size, read from its Hugging
Face folder) as the KL reference: its log-probs are transformers', and with the KL in the reward
per token (on-policy distillation) RL pulls the policy toward it."""

from __future__ import annotations

import json
import os
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


@pytest.mark.slow
def test_on_policy_distillation_pulls_the_policy_toward_the_teacher(tmp_path):
    """Each token's advantage is its reverse KL to the teacher (the KL in the reward, per token,
    undiscounted): the policy's KL to the teacher falls; the teacher is not checkpointed."""
    teacher = _teacher(tmp_path / "teacher")
    dump = tmp_path / "run"
    steps = 10
    result = run_titan([
        "rl", "--config", "grpo_debug", "--training.steps", str(steps), "--rl.sft_warmup_steps", "2",
        "--rl.eval_freq", "0", "--rl.prompts_per_step", "4", "--rl.group_size", "4", "--training.local_batch_size", "16",
        "--rl.teacher_model", teacher, "--rl.kl_in_reward_coef", "1", "--rl.advantage_estimator", "reinforce_plus_plus",
        "--rl.gamma", "0", "--rl.ppo_epochs", "1", "--metrics.log_freq", "1", "--checkpoint.enable",
        "--checkpoint.no_last_save_model_only", "--metrics.no_enable_progress_bar", "--job.dump_folder", dump],
        env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"teacher {teacher} (0.31M parameters) loaded as the KL reference" in result.stdout + result.stderr
    rl = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if "kl_in_reward" in line]
    assert len(rl) == steps - 2
    assert rl[-1]["kl_in_reward"] < 0.8 * rl[0]["kl_in_reward"], [r["kl_in_reward"] for r in rl]
    manifest = json.loads((dump / "checkpoint" / f"step-{steps}" / "titan_checkpoint.json").read_text())
    assert "model" in manifest["states"] and "rl_reference" not in manifest["states"]
