"""The fake-backend dry run from the command line: a 512-rank Llama 3 405B layout on one CPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from titan.dist import ActivationCheckpointConfig
from titan.dist.activation_checkpoint import apply_activation_checkpointing
from titan.dist.dry_run import measure_block_units
from titan.models.llama3 import build_llama3

from titan.recipes.cli import main, parse_train_args
from titan.recipes.dry_run import run_dry_run, split_world_size_flag, world_size_from_env

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"ranks\s+\d+-\d+ \(pp (\d+)\): ([\d,]+) params \| params .* total ([\d.]+) (GiB|MiB|KiB)")


def _script_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "NNODES", "NPROC")}
    env.update(PYTHON=sys.executable, **extra)
    return env


def run_measuring_peak_memory(cmd: list[str], tmp_path: Path, **kwargs) -> tuple[subprocess.CompletedProcess, int]:
    """Run `cmd` to completion; (its result, the peak resident memory in bytes of the largest
    process of its tree), from the kernel's own accounting (wait4), not from the clock."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        child = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, **kwargs)
        try:
            _, status, usage = os.wait4(child.pid, 0)
        except BaseException:  # e.g. the per-test timeout: leave no process behind
            child.kill()
            child.wait()
            raise
    result = subprocess.CompletedProcess(cmd, os.waitstatus_to_exitcode(status), out.read_text(), err.read_text())
    return result, usage.ru_maxrss * 1024  # Linux reports KiB


@pytest.mark.slow
def test_405b_on_512_ranks_through_run_train_sh(tmp_path):
    proc, peak_rss = run_measuring_peak_memory(
        ["./tools/run_train.sh", "--config", "llama3_405b", "--parallelism.data_parallel_shard_degree", "8"],
        tmp_path, cwd=ROOT, env=_script_env(NGPU="512", COMM_MODE="fake_backend"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torch.distributed.run" not in proc.stderr  # no torchrun in this mode
    rows = [LINE.search(line) for line in proc.stdout.splitlines()]
    rows = [r for r in rows if r]
    assert [int(r.group(1)) for r in rows] == list(range(8)), proc.stdout
    params = [int(r.group(2).replace(",", "")) for r in rows]
    # 405B / (tp 8 x pp 8) / FSDP 8 ~ 0.79B per rank; the ends also hold embedding / output.
    for p in params:
        assert 0.7e9 < p < 0.9e9, params
    # Every rank of a pp rank holds the same shard size: the sum over ranks is the model.
    assert 400e9 < sum(params) * 64 < 410e9
    # Each rank also holds its stage gathered with fp32 gradients under PP (37 GiB); torchtitan
    # measured 73-83 GiB per rank for this layout with 4x the batch.
    assert all(r.group(4) == "GiB" and 40 < float(r.group(3)) < 80 for r in rows), proc.stdout
    print(f"dry run peak memory {peak_rss / 2**30:.2f} GiB")
    # Nothing of the model is ever allocated (the meta device): one rank's shard alone is
    # ~0.8B fp32 parameters (3 GiB), the whole model 1.6 TB. A wall-clock budget would prove
    # the same less reliably (it fails on a loaded machine); memory does not depend on load.
    assert peak_rss < 3 * 2**30, f"the dry run's peak memory was {peak_rss / 2**30:.1f} GiB"


def test_dry_run_resolves_flags_like_titan_train(capsys):
    # The debug model, 8 ranks: dp_shard 2 x tp 2 x pp 2; same tyro parsing as `titan train`.
    rc = main(["dry-run", "--world_size", "8", "--config", "llama3_debug", "--training.seq_len", "32",
               "--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "on 8 ranks: pp 2 x dp_replicate 1 x dp_shard 2 x cp 1 x tp 2" in out
    assert len(LINE.findall(out)) == 2


@pytest.mark.parametrize("flags, ep, per_rank", [
    # The recipe: FSDP over 256 ranks, EP 64 (4 experts per rank, FSDP-sharded over 4).
    ([], 64, 671.03e9 / 256),
    # TP 2 (MLA heads split, low-rank projections replicated) x PP 4 x EP 32.
    (["--parallelism.tensor_parallel_degree", "2", "--parallelism.pipeline_parallel_degree", "4",
      "--parallelism.expert_parallel_degree", "32", "--training.local_batch_size", "8"], 32, None),
], ids=["fsdp256_ep64", "tp2_pp4_ep32"])
def test_deepseek_v3_671b_on_256_ranks_with_expert_parallel(flags, ep, per_rank, capsys):
    rc = main(["dry-run", "--world_size", "256", "--config", "deepseek_v3_671b", *flags])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "deepseek_v3 671B: 671026.40M params" in out
    assert f"(ep {ep})" in out
    rows = LINE.findall(out)
    # Under PP each rank also holds its stage gathered with fp32 gradients (FSDP keeps them
    # between microbatches): with EP 32 the experts are not FSDP-sharded, so the
    # TP 2 x PP 4 x EP 32 layout needs an H200's 141 GB, the recipe's a 96 GB H100's.
    limit = 141 if "--parallelism.pipeline_parallel_degree" in flags else 96
    assert rows and all(unit == "GiB" and float(total) < limit for _, _, total, unit in rows), out
    if per_rank is not None:
        assert int(rows[0][1].replace(",", "")) == pytest.approx(per_rank, rel=1e-3)


def test_fake_backend_env_turns_train_into_a_dry_run(monkeypatch, capsys):
    monkeypatch.setenv("COMM_MODE", "fake_backend")
    monkeypatch.setenv("NGPU", "4")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("NNODES", raising=False)
    assert main(["train", "--config", "llama3_debug", "--training.seq_len", "32"]) == 0
    assert "on 4 ranks" in capsys.readouterr().out


def test_an_rl_dry_run_lists_the_models_beside_the_policy(monkeypatch, capsys):
    """`titan rl` under the fake backend (as `titan dry-run` would): rank 0 also holds the
    generator, the KL reference and PPO's critic, each named with its size, in the total."""
    monkeypatch.setenv("COMM_MODE", "fake_backend")
    monkeypatch.setenv("NGPU", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("NNODES", raising=False)
    assert main(["rl", "--config", "grpo_debug", "--rl.kl_coef", "0.05", "--rl.advantage_estimator", "gae"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"dry run: pp rank 0 also holds [\d.]+ \w+ of other models \(critic [\d.]+ \w+, generator "
                     r"[\d.]+ \w+, KL reference [\d.]+ \w+\): total", out), out


def test_a_disaggregated_rl_dry_run_trains_on_the_first_ranks_and_shows_the_generator_ranks(capsys):
    """--rl.generator_ranks G on W ranks: the layout is the W - G trainer ranks' (FSDP over 2 of
    4 here), and each generator rank holds its generating copy: vLLM's weights (1/N of them
    under --generator.tensor_parallel_size N) plus its KV cache bound, or a native float32 copy."""
    from titan.dist.dry_run import format_bytes

    from titan.recipes.dry_run import policy_params

    flags = ["dry-run", "--world_size", "4", "--config", "grpo_debug", "--rl.generator_ranks", "2"]
    kv = 64 << 20
    assert main([*flags, "--generator.kind", "vllm", "--generator.dtype", "bfloat16", "--generator.tensor_parallel_size",
                 "2", "--generator.kv_cache_memory_bytes", str(kv)]) == 0
    out = capsys.readouterr().out
    params = policy_params(parse_train_args(["--config", "grpo_debug"], command="rl"))
    assert "on 2 ranks: pp 1 x dp_replicate 1 x dp_shard 2 x" in out, out
    assert (f"dry run: generator ranks 2-3 each hold {format_bytes(params * 2 // 2 + kv)} (--rl.generator_ranks 2): 1/2 "
            "of a vLLM engine's bfloat16 weights and its 64.00 MiB KV cache; the first 2 rank(s) train") in out, out
    assert main([*flags[:-1], "1"]) == 0
    out = capsys.readouterr().out
    assert "on 3 ranks: pp 1 x dp_replicate 1 x dp_shard 3 x" in out, out
    assert (f"dry run: generator rank 3 holds {format_bytes(params * 4)} (--rl.generator_ranks 1): a native float32 "
            "model copy; the first 3 rank(s) train") in out, out
    assert main([*flags[:-1], "4"]) == 2
    assert "--rl.generator_ranks 4 leaves no trainer rank in a launch of 4 rank(s)" in capsys.readouterr().err


def test_bad_tp_names_the_kv_heads_and_the_fix():
    cfg = parse_train_args(["--config", "llama3_405b", "--parallelism.tensor_parallel_degree", "16"])
    with pytest.raises(ValueError, match=r"tensor_parallel_degree=16 must divide the model's n_kv_heads=8"):
        run_dry_run(cfg, world_size=512, print_fn=lambda s: None)


def test_degrees_not_multiplying_to_the_world_size_fail_with_the_fix(capsys):
    rc = main(["dry-run", "--world_size", "512", "--config", "llama3_405b",
               "--parallelism.data_parallel_shard_degree", "4"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "= 256, but the world size is 512" in err
    assert "data_parallel_shard_degree -1" in err


def test_world_size_sources():
    assert world_size_from_env({"WORLD_SIZE": "16", "NGPU": "8"}) == 16
    assert world_size_from_env({"NGPU": "8", "NNODES": "4"}) == 32
    assert world_size_from_env({}) == 1
    assert split_world_size_flag(["--world_size=64", "--x", "1"]) == (64, ["--x", "1"])
    with pytest.raises(SystemExit, match="positive integer"):
        split_world_size_flag(["--world_size", "zero"])


# ---- each component of the memory estimate against bytes computed by hand ----------------

TINY = ["--config", "llama3_debug", "--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
        "--training.local_batch_size", "2"]  # fmt: skip
TINY_VOCAB = 320  # the byte tokenizer's 259 ids padded to a multiple of 64


def _tiny_model(ac: str | ActivationCheckpointConfig = "none"):
    """The debugmodel_tiny the dry run estimates, built for real on this CPU, checkpointed
    per `ac` (a mode or a whole config)."""
    model = build_llama3("debugmodel_tiny", vocab_size=TINY_VOCAB, max_seq_len=32)
    model.init_weights(seed=0)
    config = ac if isinstance(ac, ActivationCheckpointConfig) else ActivationCheckpointConfig(mode=ac)
    return apply_activation_checkpointing(model, None, config)


def _ceil_shard_numel(shape: tuple[int, ...], shards: int) -> int:
    """Elements of the first (largest) of `shards` dim-0 shards, as FSDP2 splits a parameter."""
    rows = -(-shape[0] // shards)
    rest = 1
    for size in shape[1:]:
        rest *= size
    return min(rows, shape[0]) * rest


def test_dry_run_fsdp3_components_match_hand_computed_bytes():
    """FSDP 3 of debugmodel_tiny with full activation checkpointing: dim-0 sizes 320, 192, 64
    and 32 do not divide by 3, so rank 0 holds ceil(rows / 3) rows of every parameter. fp32
    params and grads (4 B/element), AdamW's two fp32 states, and activations = each block's
    fp32 input (dim per token) plus the fp32 logits (vocab per token) of the local batch, and
    the one block the backward recomputes at a time."""
    cfg = parse_train_args([*TINY, "--parallelism.data_parallel_shard_degree", "3",
                            "--activation_checkpoint.mode", "full"])  # fmt: skip
    (est,) = run_dry_run(cfg, world_size=3, print_fn=lambda s: None)

    shapes = [tuple(p.shape) for p in _tiny_model().parameters()]
    numel = sum(_ceil_shard_numel(s, 3) for s in shapes)
    # Written out: embedding and output 107 x 64 each; per block wq, wo 22 x 64, wk, wv 11 x 64,
    # w1, w3 64 x 64, w2 22 x 192, two norms of 22; the final norm 22.
    assert numel == 2 * 107 * 64 + 4 * (2 * 22 * 64 + 2 * 11 * 64 + 2 * 64 * 64 + 22 * 192 + 2 * 22) + 22
    assert est.params == numel
    assert est.param_bytes == 4 * numel
    assert est.grad_bytes == 4 * numel
    assert est.optimizer_bytes == 2 * 4 * numel
    dim, layers, tokens = 64, 4, 2 * 32
    # Each block's fp32 input; the loss's peak: 3 fp32 copies of the logits.
    assert est.activation_bytes == layers * dim * tokens * 4
    assert est.loss_bytes == tokens * TINY_VOCAB * 3 * 4
    # During one block's backward its forward is rebuilt (the dim-wide tensors per token an
    # unchecked block keeps, measured on fake tensors: 19.1, less the input already kept) and
    # its activations' gradients are held (measured: 10).
    units = measure_block_units(lambda: build_llama3("debugmodel_tiny", vocab_size=TINY_VOCAB, max_seq_len=32),
                                seq_len=32)
    assert units["none"] == pytest.approx(19.1, abs=0.1) and units["backward"] == pytest.approx(10, abs=0.5)
    assert est.recompute_bytes == int((units["none"] - 1 + units["backward"]) * dim * tokens * 4)
    # FSDP: one block gathered and one prefetched (fp32 compute here), one block's fp32
    # gradients before the reduce-scatter; a block is 2 x 64 x 64 + 2 x 32 x 64 + 3 x 64 x 192
    # + 2 x 64 parameters whole.
    block = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 192 + 2 * 64
    assert est.fsdp_buffer_bytes == block * (2 * 4 + 4)
    assert est.total_bytes == (4 * 4 * numel + est.activation_bytes + est.recompute_bytes + est.loss_bytes
                               + est.fsdp_buffer_bytes)


def test_weight_sized_parts_are_split_from_the_per_token_units():
    """Hand computation: a block keeping 100 bytes per token and 5,000 bytes whatever the
    tokens reads 25.625 units of 10 bytes at 32 tokens and 17.8125 at 64."""
    from titan.dist.dry_run import split_fixed_bytes

    split = split_fixed_bytes({"none": 25.625}, {"none": 17.8125}, 32, 10)
    assert split == {"none": 10.0, "none_fixed_bytes": 5000.0}


@pytest.mark.slow
def test_float8_blocks_are_measured_converted_with_the_weight_casts_apart():
    """A float8 block's casts of its weights are sized by the weights: measured at two
    lengths they are split out of the per-token units. What the block keeps has no
    weight-sized part; eager it keeps what the unconverted block keeps (torchao saves the
    linears' high-precision inputs), compiled 30% less (the inputs in float8); its backward
    casts the weights and their gradients (about 2.25 bytes per converted weight)."""
    pytest.importorskip("torchao.float8")
    from titan.train.quantize import (
        Float8LinearConfig,
        QuantizeConfig,
        QuantizeLinearConfig,
        apply_quantization,
    )

    def plain():
        return build_llama3("debugmodel_tiny", vocab_size=TINY_VOCAB, max_seq_len=32)

    def converted():
        model = plain()
        apply_quantization(model, QuantizeConfig(linear=QuantizeLinearConfig(float8=Float8LinearConfig(
            recipe="tensorwise"))))
        return model

    base = measure_block_units(plain, seq_len=32, compiled=True)
    f8 = measure_block_units(converted, seq_len=32, compiled=True, converted=True)
    assert f8["none"] == base["none"] and f8["selective"] == base["selective"]
    assert f8["none_compiled"] < 0.75 * base["none_compiled"]
    linear_weights = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 192
    for key in ("none", "selective", "none_compiled", "selective_compiled"):
        assert abs(f8[f"{key}_fixed_bytes"]) < 0.01 * linear_weights, key  # a few scalar scales at most
    assert 2 * linear_weights < f8["backward_fixed_bytes"] < 3 * linear_weights
    # Unconverted the units are the same at any length: measured once, nothing split.
    assert "backward_fixed_bytes" not in base


def _saved_activation_bytes(model) -> int:
    """Bytes autograd keeps for backward in one forward + cross-entropy of a [2, 32] batch,
    parameters and buffers excluded, each storage counted once."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, 259, (2, 32), generator=gen) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    return sum(saved.values())


@pytest.mark.parametrize("components, dtype, bytes_per_logit", [
    (["model", "loss"], "float32", 8), (["model"], "float32", 12), (["model", "loss"], "bfloat16", 4),
], ids=["compiled_loss", "compiled_model_only", "compiled_loss_bf16"])
def test_dry_run_counts_the_compiled_loss_as_the_logits_and_their_gradient(components, dtype, bytes_per_logit):
    """With the loss compiled the peak is the saved logits and their gradient in the compute
    dtype (tests/test_plan.py measures it), not the eager loss's 3 fp32 copies: the memory
    check must not refuse a compiled run that fits."""
    cfg = parse_train_args([*TINY, "--compile.enable", "--compile.components", *components,
                            "--training.mixed_precision_param", dtype])
    (est,) = run_dry_run(cfg, world_size=1, print_fn=lambda s: None)
    assert est.loss_bytes == 2 * 32 * TINY_VOCAB * bytes_per_logit


@pytest.mark.parametrize("ac_flags", [
    ["--activation_checkpoint.mode", "none"],
    ["--activation_checkpoint.mode", "full"],
    # Whole blocks checkpointed (every block, then every 2nd): the former "selective" figure
    # (8 units, per-op) overstated both 1.9x and 1.4x.
    ["--activation_checkpoint.mode", "selective"],
    ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_layer_every", "2"],
], ids=["none", "full", "selective_every_block", "selective_every_2nd"])
def test_dry_run_activation_estimate_tracks_what_autograd_saves(ac_flags):
    """An outside check of the activation figure: what autograd actually saves for one
    microbatch on one process. The estimate is rough by design (it leaves out e.g. the final
    norm's and the output projection's inputs), so within 0.6x-1.2x of the measurement."""
    cfg = parse_train_args([*TINY, *ac_flags])
    (est,) = run_dry_run(cfg, world_size=1, print_fn=lambda s: None)
    measured = _saved_activation_bytes(_tiny_model(cfg.activation_checkpoint))
    # Autograd also saves the loss's fp32 log-softmax: one of the loss peak's 3 copies.
    estimate = est.activation_bytes + est.loss_bytes / 3
    assert 0.6 * measured <= estimate <= 1.2 * measured, (estimate, measured)


def test_dry_run_builds_the_model_titan_train_builds(capsys, tmp_path, monkeypatch):
    """`--model.vocab_size` and `--model.*` shape overrides reach the dry run as they reach
    the trainer: both report the same vocabulary and parameter count (one resolution rule,
    `ModelConfig.resolve_vocab_size`, and the same overrides)."""
    from titan.train.trainer import Trainer

    from titan.recipes.families import model_spec

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    flags = ["--config", "llama3_debug", "--model.vocab_size", "1000", "--model.n_layers", "2",
             "--training.seq_len", "32", "--training.steps", "1", "--job.dump_folder", str(tmp_path)]
    assert main(["dry-run", "--world_size", "1", *flags]) == 0
    out = capsys.readouterr().out
    params, vocab = re.search(r": ([\d.]+)M params \(vocab ([\d,]+) from --model.vocab_size\)", out).groups()
    config = parse_train_args(flags)
    trainer = Trainer(config, model_spec=model_spec(config.model.name))
    try:
        assert trainer.engine.model_parts[0].args.vocab_size == int(vocab.replace(",", "")) == 1000
        assert len(trainer.engine.model_parts[0].layers) == 2
        assert f"{trainer.num_params / 1e6:.2f}" == params
    finally:
        trainer.close()


def test_dry_run_parallelizes_tensorwise_float8_with_float8_tensor_parallel():
    """The dry run gives TP the engine's float8 styles (every pipeline stage's: the whole
    model's count) and sizes its blocks with float8 inputs; the row-wise recipe keeps
    high-precision gathers and the high-precision sizes."""
    pytest.importorskip("torchao.float8")
    layout = ["--config", "llama3_debug", "--parallelism.tensor_parallel_degree", "2",
              "--parallelism.pipeline_parallel_degree", "2", "--quantize.linear.float8.recipe"]
    lines = []
    tensorwise = run_dry_run(parse_train_args([*layout, "tensorwise"]), world_size=4, print_fn=lines.append)
    # debugmodel: 6 blocks of 7 linears, each block's attention and feed-forward inputs.
    assert ("dry run: float8 tensor parallel: 42 linears with torchao's float8 styles, "
            "12 block inputs all-gathered in float8") in lines
    lines = []
    rowwise = run_dry_run(parse_train_args([*layout, "rowwise"]), world_size=4, print_fn=lines.append)
    assert not any("float8 tensor parallel" in line for line in lines)
    for f8tp, hp in zip(tensorwise, rowwise, strict=True):
        assert f8tp.activation_bytes < 0.9 * hp.activation_bytes


@pytest.mark.slow
def test_dry_run_converts_float8_before_the_layout_like_titan_train():
    pytest.importorskip("torchao.float8")
    lines = []
    cfg = parse_train_args(["--config", "llama3_8b", "--parallelism.tensor_parallel_degree", "2",
                            "--quantize.linear.float8.recipe", "rowwise"])
    (converted,) = run_dry_run(cfg, world_size=8, print_fn=lines.append)
    # 32 blocks x 7 linears converted; the output projection kept.
    assert "dry run: float8 rowwise: converted 224 of 225 linears" in lines[0]
    # The conversion's casts are weight-sized: measured apart from the per-token activations
    # (read per token at 64 tokens, one block's backward came to 64 GiB instead of 1.6 at FSDP
    # 8, and the memory check refused the run). Eager, a float8 block keeps what a bf16 one
    # keeps; one block's backward adds its TP shard of the weights' casts (~2.25 bytes each).
    (plain,) = run_dry_run(parse_train_args(["--config", "llama3_8b", "--parallelism.tensor_parallel_degree", "2"]),
                           world_size=8, print_fn=lambda s: None)
    assert converted.activation_bytes == plain.activation_bytes
    block_linears = 4096 * (2 * 4096 + 2 * 1024 + 3 * 14336) / 2  # a block's linear weights per TP rank
    assert 0 < converted.recompute_bytes - plain.recompute_bytes < 2.25 * block_linears
    # Compiled without AC, a float8 block keeps its linears' inputs in float8: less than a
    # bf16 one (under titan's per-op AC both keep the linears' outputs).
    compiled = [*TINY, "--parallelism.tensor_parallel_degree", "2", "--compile.enable",
                "--activation_checkpoint.mode", "none", "--training.mixed_precision_param", "bfloat16"]
    (compiled_plain,) = run_dry_run(parse_train_args(compiled), world_size=2, print_fn=lambda s: None)
    (compiled_f8,) = run_dry_run(parse_train_args([*compiled, "--quantize.linear.float8.recipe", "rowwise"]),
                                 world_size=2, print_fn=lambda s: None)
    assert compiled_f8.activation_bytes < 0.8 * compiled_plain.activation_bytes
    with pytest.raises(ValueError, match="needs FSDP2"):
        run_dry_run(parse_train_args(["--config", "llama3_8b", "--parallelism.tensor_parallel_degree", "8",
                                      "--quantize.linear.float8.recipe", "tensorwise",
                                      "--quantize.linear.float8.enable_fsdp_float8_all_gather"]),
                    world_size=8, print_fn=lines.append)


@pytest.mark.parametrize("schedule, held", [("1F1B", 6), ("Interleaved1F1B", 9)])
def test_pipeline_activations_count_the_blocks_of_each_stage_in_flight(schedule, held):
    """6 blocks, pp 2, 4 microbatches of 2 x 32 tokens, full AC (one dim-wide fp32 tensor per
    block and token). 1F1B: rank 0 holds 2 forwards of its 3 blocks (6 block-microbatches).
    Interleaved 1F1B splits the blocks 2, 2, 1, 1 over 4 stages; rank 0 (stages 0 and 2)
    peaks at 9: F0:0 F0:1 F2:0 F2:1 F0:2 B2:0 F0:3 -> 2 + 2 + 1 + 1 + 2 - 1 + 2."""
    cfg = parse_train_args([*TINY, "--model.n_layers", "6", "--training.local_batch_size", "8",
                            "--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
                            "--parallelism.pipeline_parallel_microbatch_size", "2",
                            "--parallelism.pipeline_parallel_schedule", schedule, "--activation_checkpoint.mode", "full"])
    estimates = run_dry_run(cfg, world_size=2, print_fn=lambda s: None)
    first = next(e for e in estimates if e.pp_rank == 0)
    assert first.activation_bytes == held * 64 * (2 * 32) * 4


@pytest.mark.parametrize("flags, blocks", [
    ([], ["0-2", "3-5"]),
    # torchtitan's split: 6 + 1 + 1 units over 2 stages, the first and last a block lighter each
    (["--parallelism.pipeline_parallel_first_stage_less_layers", "1",
      "--parallelism.pipeline_parallel_last_stage_less_layers", "1"], ["0-2", "3-5"]),
    (["--parallelism.pipeline_parallel_last_stage_less_layers", "2"], ["0-3", "4-5"]),
    (["--parallelism.pipeline_parallel_first_stage_less_layers", "2"], ["0-1", "2-5"]),
    # 4 stages of 8 units (2 each), the first and last a block lighter: 1, 2, 2, 1 blocks;
    # rank 0 runs stages 0 and 2, rank 1 stages 1 and 3.
    (["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
      "--parallelism.pipeline_parallel_first_stage_less_layers", "1",
      "--parallelism.pipeline_parallel_last_stage_less_layers", "1"], ["0, 3-4", "1-2, 5"]),
])
def test_pipeline_stages_hold_the_blocks_the_split_gives_them(flags, blocks):
    """Each pipeline rank's line names its blocks, and its parameter count is those blocks'
    (plus the embedding on the first stage, the output on the last): the stage weights move
    blocks off the stages that hold the embedding and the output."""
    cfg = parse_train_args([*TINY, "--model.n_layers", "6", "--parallelism.data_parallel_shard_degree", "1",
                            "--parallelism.pipeline_parallel_degree", "2", *flags])
    lines: list[str] = []
    estimates = run_dry_run(cfg, world_size=2, print_fn=lines.append)
    assert [e.blocks for e in estimates] == blocks
    rank_lines = [line for line in lines if line.startswith("ranks")]
    assert all(line.endswith(f" | blocks {b}") for b, line in zip(blocks, rank_lines, strict=True))
    model = _tiny_model()
    block = sum(p.numel() for p in model.layers["0"].parameters())
    first_extra = model.tok_embeddings.weight.numel()
    last_extra = sum(p.numel() for p in (*model.norm.parameters(), *model.output.parameters()))
    for estimate, (extra, span) in zip(estimates, ((first_extra, blocks[0]), (last_extra, blocks[1])), strict=True):
        n_blocks = sum(1 if "-" not in part else int(part.split("-")[1]) - int(part.split("-")[0]) + 1
                       for part in span.split(", "))
        assert estimate.params == extra + n_blocks * block


def test_async_tp_without_compile_is_refused_before_anything_is_built(capsys):
    """`--parallelism.enable_async_tensor_parallel` works inside inductor's compiled graphs;
    without `--compile.enable` it would change nothing, so the dry run (and `titan train`,
    through the same check) refuses it in one line instead of running without it."""
    flags = ["--config", "llama3_debug", "--training.seq_len", "32", "--parallelism.tensor_parallel_degree", "2",
             "--parallelism.enable_async_tensor_parallel"]
    rc = main(["dry-run", "--world_size", "4", *flags])
    err = capsys.readouterr().err
    assert rc == 2 and "needs --compile.enable" in err and err.count("\n") == 1
    assert main(["dry-run", "--world_size", "4", *flags, "--compile.enable"]) == 0


def test_layer_wise_per_op_ac_counts_the_blocks_the_engine_checkpoints():
    """`--activation_checkpoint.selective_op` with `selective_layer_every 2` checkpoints (per op)
    blocks 0, 2, 4 and leaves the others whole: the dry run (and the pre-run memory check)
    counted the per-op units in every block, as with every 1."""
    from titan.dist.dry_run import checkpointed_blocks, kept_units
    from titan.dist.plan import blocks_of

    ac = ActivationCheckpointConfig(mode="selective", selective_op=True, selective_layer_every=2)
    model = build_llama3("debugmodel", vocab_size=64, max_seq_len=32)
    apply_activation_checkpointing(model, None, ac)
    wrapped = sum(hasattr(block.forward, "__wrapped__") for _, block in blocks_of(model))
    assert wrapped == checkpointed_blocks(ac, [len(model.layers)]) == 3
    assert kept_units(ac, [6], 12.0, 21.0)[0] == 3 * 12.0 + 3 * 21.0
    assert checkpointed_blocks(ac, [3, 3]) == 4  # each pipeline stage numbers its blocks from 0

    def activations(*flags):
        config = parse_train_args(["--config", "llama3_debug", "--training.seq_len", "32", *flags])
        return run_dry_run(config, world_size=1, print_fn=lambda s: None)[0].activation_bytes

    per_op = ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_op"]
    none, every_block = activations(), activations(*per_op)
    every_second = activations(*per_op, "--activation_checkpoint.selective_layer_every", "2")
    assert every_block < every_second < none
    assert every_second == pytest.approx((none + every_block) / 2, rel=1e-6)


@pytest.mark.parametrize("flags, wrapped", [
    # torchtitan's meaning of mode selective alone (its selective_ac_option default "2").
    (["--activation_checkpoint.mode", "selective"], [0, 2, 4]),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_op"], [0, 1, 2, 3, 4, 5]),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_layer_every", "1"],
     [0, 1, 2, 3, 4, 5]),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_layer_every", "3"], [0, 3]),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"], [0, 2, 4]),
    (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
     [0, 1, 2, 3, 4, 5]),
    (["--activation_checkpoint.mode", "full"], [0, 1, 2, 3, 4, 5]),
], ids=["selective", "selective_op", "every_1", "every_3", "torchtitan_2", "torchtitan_op", "full"])
def test_the_blocks_each_ac_setting_checkpoints(flags, wrapped):
    """The blocks the engine wraps for each way of asking, torchtitan's spellings included,
    and the count the dry run, the memory check and the planner use for them."""
    from titan.dist.dry_run import checkpointed_blocks
    from titan.dist.plan import blocks_of

    from titan.recipes.plan import ac_choice

    ac = parse_train_args(["--config", "llama3_debug", *flags]).activation_checkpoint
    model = build_llama3("debugmodel", vocab_size=64, max_seq_len=32)
    apply_activation_checkpointing(model, None, ac)
    blocks = [i for i, (_, block) in enumerate(blocks_of(model)) if hasattr(block.forward, "__wrapped__")]
    assert blocks == wrapped
    assert checkpointed_blocks(ac, [len(model.layers)]) == len(wrapped)
    assert ac_choice(ac)[1] == ac.checkpoint_every() == wrapped[1] - wrapped[0]


def test_block_units_of_one_model_key_are_measured_once_per_process():
    """`measure_block_units(model_key=...)`: the same model and arguments are traced once
    (the plan, the dry run and the memory check of one process ask alike); another key, or
    other arguments, measure again, and a caller cannot change what the next one reads."""
    builds = []

    def build():
        builds.append(1)
        return build_llama3("debugmodel_tiny", vocab_size=TINY_VOCAB, max_seq_len=32)

    key = ("test_block_units_memo", id(builds))
    first = measure_block_units(build, seq_len=32, model_key=key)
    traced = len(builds)
    assert traced >= 1
    first["none"] = -1.0  # the caller's copy
    again = measure_block_units(build, seq_len=32, model_key=key)
    assert len(builds) == traced and again["none"] == pytest.approx(19.1, abs=0.1)
    assert again == measure_block_units(build, seq_len=32)  # unkeyed: measured, and equal
    assert len(builds) == 2 * traced
    measure_block_units(build, seq_len=16, model_key=key)  # other arguments
    measure_block_units(build, seq_len=32, model_key=(*key, "other"))
    assert len(builds) == 4 * traced


@pytest.mark.parametrize("schedule", ["InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"])
def test_fsdp_resharding_after_every_forward_under_a_zero_bubble_schedule_is_refused(schedule, capsys):
    """The zero-bubble schedules compute a microbatch's weight gradients after FSDP's backward
    hooks ran for it; resharding after each forward lost them (a 4-rank FSDP 2 x PP 2 run's
    gradient norm 0.20 where 1.29 is right). Refused before anything is built; the default
    policy and the other schedules are fine."""
    from titan.dist import ParallelDims, ParallelismConfig, check_reshard_under_zero_bubble

    def config(**kw) -> ParallelismConfig:
        return ParallelismConfig(data_parallel_shard_degree=2, pipeline_parallel_degree=2, **kw)

    always = config(pipeline_parallel_schedule=schedule, fsdp_reshard_after_forward="always")
    with pytest.raises(ValueError, match=f"{schedule} computes the weight gradients in a later pass"):
        check_reshard_under_zero_bubble(always, ParallelDims.from_config(always, world_size=4))
    for fine in (config(pipeline_parallel_schedule=schedule),
                 config(pipeline_parallel_schedule="Interleaved1F1B", fsdp_reshard_after_forward="always")):
        check_reshard_under_zero_bubble(fine, ParallelDims.from_config(fine, world_size=4))
    rc = main(["dry-run", "--world_size", "4", "--config", "llama3_debug", "--parallelism.data_parallel_shard_degree",
               "2", "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule,
               "--parallelism.fsdp_reshard_after_forward", "always", "--training.local_batch_size", "8"])
    assert rc == 2
    assert "--parallelism.fsdp_reshard_after_forward always frees" in capsys.readouterr().err
