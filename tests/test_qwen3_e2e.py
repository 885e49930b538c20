"""Qwen3 through the whole stack: `titan train` of `qwen3_debug` learns, and tensor parallel 2
with sequence parallel (per-head q/k norms on sharded heads) trains exactly like one process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from forked_cli import run_command
from titan.ckpt import load_dcp_model

STEPS = 5
RTOL = 1e-5
PARITY = [
    "--config", "qwen3_debug",
    "--model.flavor", "debugmodel_tiny",
    "--dataset.name", "synthetic",
    "--dataset.synthetic_documents", "2000",
    "--training.seq_len", "32",
    "--training.local_batch_size", "8",
    "--training.steps", str(STEPS),
    "--training.max_norm", "0.5",
    "--optimizer.lr", "1e-2",
    "--optimizer.eps", "1e-5",  # keeps AdamW from magnifying reassociation noise (see test_parallel_parity)
    "--lr_scheduler.warmup_steps", "2",
    "--debug.seed", "0",
    "--debug.deterministic",
    "--metrics.log_freq", "1",
    "--metrics.no_enable_progress_bar",
    "--checkpoint.enable",
    "--checkpoint.interval", str(STEPS),
    "--checkpoint.export_dtype", "float32",
]


def titan_train(dump: Path, *flags: str, ranks: int = 1) -> list[dict]:
    """One `titan train` run (under torchrun when ranks > 1); returns metrics.jsonl rows."""
    launcher = [sys.executable, "-m", "titan.recipes.cli"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                    "--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0", "-m", "titan.recipes.cli"]
    cmd = [*launcher, "train", "--job.dump_folder", str(dump), *flags]
    result = run_command(cmd, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def max_rel(got: list[float], ref: list[float]) -> float:
    return max(abs(g - r) / abs(r) for g, r in zip(got, ref, strict=True))


@pytest.mark.slow
def test_qwen3_debug_trains_with_falling_loss(tmp_path):
    rows = titan_train(
        tmp_path, "--config", "qwen3_debug", "--training.steps", "30", "--training.seq_len", "64",
        "--training.local_batch_size", "8", "--lr_scheduler.warmup_steps", "5",
        "--metrics.log_freq", "5", "--metrics.no_enable_progress_bar",
    )
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30]
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < first - 1.5, f"loss fell only from {first:.3f} to {last:.3f}"


@pytest.mark.slow
def test_qwen3_tp2_with_sp_matches_one_process(tmp_path):
    ref_rows = titan_train(tmp_path / "one", *PARITY)
    tp_rows = titan_train(tmp_path / "tp2", *PARITY, "--parallelism.tensor_parallel_degree", "2",
                          "--parallelism.enable_sequence_parallel", ranks=2)
    for key in ("loss", "grad_norm"):
        ref, got = [r[key] for r in ref_rows], [r[key] for r in tp_rows]
        assert len(got) == STEPS and max_rel(got, ref) <= RTOL, (key, got, ref)
    assert ref_rows[-1]["loss"] < ref_rows[0]["loss"] - 0.3  # a meaningful reference: it learns

    ref_w = load_dcp_model(str(tmp_path / "one" / "checkpoint"))
    tp_w = load_dcp_model(str(tmp_path / "tp2" / "checkpoint"))
    assert ref_w.keys() == tp_w.keys()
    # The per-head norms trained (their partial TP gradients were reduced: a rank-local
    # gradient would leave the replicas, and the weights, apart).
    q_norm = ref_w["layers.0.attention.q_norm.weight"]
    assert q_norm.shape == (32,) and not torch.equal(q_norm, torch.ones(32))
    for key, ref in ref_w.items():
        torch.testing.assert_close(tp_w[key], ref, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "deepseek_v3"])
def test_convert_hf_knows_the_moe_and_qwen3_families_by_name(family, tmp_path):
    """`tools/convert_hf.py from-hf/to-hf --model <family>` on a tiny Hub-layout checkpoint
    written by transformers: HF -> titan DCP -> HF is bitwise, and transformers' logits are
    unchanged."""
    import importlib.util

    transformers = pytest.importorskip("transformers")
    from titan.ckpt import load_hf

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen3":
        config, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
            q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0})
        cls = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(**common, moe_intermediate_size=32, num_experts=8,
                                             num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])
        cls = transformers.Qwen3MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    model.save_pretrained(tmp_path / "hf")
    spec = importlib.util.spec_from_file_location("convert_hf", Path(__file__).resolve().parents[1] / "tools" / "convert_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--model", family])
    tool.main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "back"), "--model", family])
    original, again = load_hf(str(tmp_path / "hf")), load_hf(str(tmp_path / "back"))
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original)
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    reloaded = cls.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, model(tokens).logits, rtol=0, atol=0)
