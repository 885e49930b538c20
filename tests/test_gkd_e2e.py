"""`titan gkd` end to end: the loss of a step against transformers' student and teacher by hand
(on the data's completions, the student's and the teacher's greedy completions; a teacher of
another family; a bfloat16 teacher), held-out figures, learning toward a teacher, every 2-rank
layout against one process, an exact resume, the dry run's bytes, and bad input."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from forked_cli import run_titan
from launching import RUNS_WORKER, launch_runs

from titan.recipes.cli import parse_train_args

transformers = pytest.importorskip("transformers")

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ROWS = [("sort: dcba\n", "abcd"), ("sort: ca\n", "ac"), ("sort: fed\n", "def"), ("sort: bab\n", "abb")]


def _llama(folder: Path, *, seed: int, initializer_range: float = 0.02, **config) -> Path:
    """A random transformers Llama over the byte tokenizer's ids (padded to 320), saved as the
    Hub does."""
    fields = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=64,
                  tie_word_embeddings=False, initializer_range=initializer_range)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config})).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(student folder, teacher folder, data file): the teacher wider and deeper, its logits
    spread (initializer range 0.2) so that its distributions are far from the student's."""
    root = tmp_path_factory.mktemp("gkd_models")
    student = _llama(root / "student", seed=0)
    teacher = _llama(root / "teacher", seed=1, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                     initializer_range=0.2)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in ROWS))
    return student, teacher, data


def _flags(models, dump: Path, *extra: str) -> list[str]:
    """`titan gkd` flags: the student from its Hugging Face folder, the data one example a row,
    one step logged."""
    student, teacher, data = models
    return ["--config", "gkd_debug", "--model.flavor", "hf", "--checkpoint.initial_load_path", str(student),
            "--checkpoint.initial_load_in_hf", "--gkd.teacher_model", str(teacher), "--sft_data.path", str(data),
            "--sft_data.no_packing", "--training.local_batch_size", "4", "--training.seq_len", "24",
            "--training.steps", "1", "--metrics.log_freq", "1", "--metrics.no_enable_progress_bar",
            "--job.dump_folder", str(dump), *extra]


def _records(dump: Path) -> list[dict]:
    """The run's metric records."""
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _gkd(models, dump: Path, *extra: str) -> list[dict]:
    """Run `titan gkd` in one process; its records."""
    result = run_titan(["gkd", *_flags(models, dump, *extra)], env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return _records(dump)


def _hand_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> torch.Tensor:
    """Each row's generalized JSD from probabilities in float64 (TRL's ends at 0 and 1)."""
    s, t = student_logits.double().softmax(-1), teacher_logits.double().softmax(-1)

    def kl(p, q):
        return torch.where(p > 0, p * (p / q).log(), 0.0).sum(-1)

    if beta == 0:
        return kl(t, s)
    if beta == 1:
        return kl(s, t)
    m = (1 - beta) * s + beta * t
    return beta * kl(t, m) + (1 - beta) * kl(s, m)


def _expected_loss(models, sequences: list[tuple[list[int], list[int]]], beta: float, vocab: int) -> float:
    """The mean over completion tokens of the divergence between transformers' student and
    teacher at each position predicting a completion token."""
    student, teacher = (transformers.AutoModelForCausalLM.from_pretrained(str(f), dtype=torch.float32).eval()
                        for f in models[:2])
    total, count = 0.0, 0
    for prompt, completion in sequences:
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            s, t = (m(ids).logits[0, len(prompt) - 1 : -1, :vocab] for m in (student, teacher))
        total += float(_hand_jsd(s, t, beta).sum())
        count += len(completion)
    return total / count


def _data_sequences(models, dump: Path) -> tuple[list[tuple[list[int], list[int]]], object]:
    """(prompt ids, completion ids) of the data's examples as titan tokenizes them, and the tokenizer."""
    from titan.train.data.chat import encode_prompt_completion

    config = parse_train_args(_flags(models, dump), command="gkd")
    tokenizer = config.tokenizer.build()
    out = []
    for prompt, completion in ROWS:
        example = encode_prompt_completion(prompt, completion, tokenizer)
        first = int(example.targets.argmax())
        out.append((example.ids[:first].tolist(), example.ids[first:].tolist()))
    return out, tokenizer


@pytest.mark.parametrize("beta, layout", [(0.0, "sharded"), (0.5, "sharded"), (1.0, "sharded"), (0.5, "whole")])
def test_the_first_step_loss_is_the_divergence_of_transformers_models_by_hand(tmp_path, models, beta, layout):
    """Supervised distillation (--gkd.lmbda 0): step 1's loss is the mean over the data's
    completion tokens of the generalized JSD between the student and the teacher, both read
    by transformers from their folders (the student's vocabulary and the teacher's padded past
    the tokenizer's: compared over its ids); the teacher on an engine of its own or whole."""
    records = _gkd(models, tmp_path / "run", "--gkd.lmbda", "0", "--gkd.beta", str(beta), "--validation.enable",
                   "--sft_data.eval_path", str(models[2]), "--optimizer.lr", "1e-30", "--gkd.teacher_layout", layout)
    sequences, tokenizer = _data_sequences(models, tmp_path / "run")
    want = _expected_loss(models, sequences, beta, tokenizer.vocab_size)
    assert records[0]["loss"] == pytest.approx(want, rel=1e-5), (records[0]["loss"], want)
    assert records[0]["on_policy"] == 0 and records[0]["teacher_s"] > 0
    # Held-out (the same examples, the weights unmoved at LR 1e-30): the divergence, and the NLL.
    assert records[0]["validation_distill_loss"] == pytest.approx(want, rel=1e-5)
    student = transformers.LlamaForCausalLM.from_pretrained(str(models[0]), dtype=torch.float32).eval()
    with torch.no_grad():
        nll = [float(-student(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].log_softmax(-1)
                     .gather(-1, torch.tensor(c)[:, None]).sum()) for p, c in sequences]
    assert records[0]["validation_loss"] == pytest.approx(sum(nll) / sum(len(c) for _, c in sequences), rel=1e-5)


@pytest.mark.parametrize("who, flags", [("student", ["--gkd.lmbda", "1"]),
                                        ("teacher", ["--gkd.lmbda", "0", "--gkd.seq_kd", "--gkd.teacher_layout", "whole"])])
def test_regenerated_steps_distill_on_greedy_completions_of_the_model_that_wrote_them(tmp_path, models, who, flags):
    """--gkd.lmbda 1 (on-policy: the student's own completions) or --gkd.seq_kd (the teacher's)
    with greedy sampling: every example's completion is transformers' greedy decoding of its
    prompt by that model (5 new tokens at most), and the loss is the divergence over them."""
    records = _gkd(models, tmp_path / "run", *flags, "--sampling.temperature", "0", "--sampling.max_new_tokens", "5")
    check_first_step_on_greedy_completions(models, tmp_path / "run", records[0], who)


def check_first_step_on_greedy_completions(models, dump: Path, record: dict, who: str) -> None:
    """Assert that step 1 (``record``, of the run writing to ``dump`` with 5 new tokens at
    temperature 0) trained on transformers' greedy completions of every prompt by ``who``
    (student or teacher): their mean length, and the divergence over them by hand."""
    sequences, tokenizer = _data_sequences(models, dump)
    writer = transformers.LlamaForCausalLM.from_pretrained(str(models[0 if who == "student" else 1]),
                                                           dtype=torch.float32).eval()
    greedy = []
    for prompt, _ in sequences:
        out = writer.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                              eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
        greedy.append((prompt, out[0, len(prompt):].tolist()))
    assert all(c != completion for (_, c), (_, completion) in zip(greedy, sequences, strict=True))
    want = _expected_loss(models, greedy, 0.5, tokenizer.vocab_size)
    assert record["on_policy"] == (1.0 if who == "student" else 0.0)
    assert record["gkd_dropped"] == 0  # one example a row: the new tokens always fit
    assert record["gkd_generated_tokens"] == pytest.approx(sum(len(c) for _, c in greedy) / len(greedy))
    assert record["loss"] == pytest.approx(want, rel=1e-5), (record["loss"], want)


def test_a_bfloat16_teacher_gives_the_float32_teachers_loss_up_to_its_rounding(tmp_path, models):
    """--gkd.teacher_dtype bfloat16: the teacher's weights and logits in bfloat16, the
    divergence in float32; the loss moves by bfloat16's rounding of the teacher, no more (and
    does move: the teacher ran in bfloat16). The dry run counts half the teacher's bytes."""
    flags = ["--gkd.lmbda", "0", "--gkd.teacher_layout", "whole"]
    full = _gkd(models, tmp_path / "full", *flags)[0]["loss"]
    half = _gkd(models, tmp_path / "half", *flags, "--gkd.teacher_dtype", "bfloat16")[0]["loss"]
    assert half != full and half == pytest.approx(full, rel=5e-3), (half, full)  # 5e-4 measured
    result = run_titan(["dry-run", "--world_size", "1", *_flags(models, tmp_path / "dry", *flags, "--gkd.teacher_dtype",
                                                               "bfloat16")], env=ENV, timeout=120)
    teacher = transformers.LlamaForCausalLM.from_pretrained(str(models[1])).num_parameters()
    from titan.dist.dry_run import format_bytes

    assert f"teacher (whole) {format_bytes(teacher * 2)}, teacher logits {format_bytes(4 * 24 * 320 * 2)}" in result.stdout


@pytest.mark.parametrize("layout", ["sharded", "whole"])
def test_a_teacher_of_another_family_a_qwen3_moe_teaching_a_dense_qwen3(tmp_path, models, layout):
    """The teacher's family is its folder's (`model_type`), not the student's: a Qwen3-MoE
    teacher (4 experts, top 2) of a dense Qwen3 student, both transformers' and over the same
    tokenizer; step 1's loss is their divergence by hand."""
    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=10_000.0)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(intermediate_size=128, **common)).save_pretrained(
        str(tmp_path / "student"))
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], initializer_range=0.2, **common)).save_pretrained(str(tmp_path / "teacher"))
    qwen = (tmp_path / "student", tmp_path / "teacher", models[2])
    records = _gkd(qwen, tmp_path / "run", "--model.name", "qwen3", "--gkd.lmbda", "0", "--gkd.teacher_layout", layout)
    sequences, tokenizer = _data_sequences(qwen, tmp_path / "run")
    want = _expected_loss(qwen, sequences, 0.5, tokenizer.vocab_size)
    assert records[0]["loss"] == pytest.approx(want, rel=1e-5), (records[0]["loss"], want)


def test_the_sampling_seed_flag_picks_the_students_samples(tmp_path, models):
    """--sampling.seed keys the on-policy samples: the same seed samples the same completions,
    another seed others."""
    runs = {name: _gkd(models, tmp_path / name, "--gkd.lmbda", "1", "--sampling.seed", seed)[0]
            for name, seed in (("a", "1"), ("again", "1"), ("b", "2"))}
    assert runs["a"]["loss"] == runs["again"]["loss"] and runs["a"]["loss"] != runs["b"]["loss"]


def test_the_students_completions_stop_at_its_folders_end_of_sequence_ids(tmp_path, models):
    """The student's folder lists another end-of-sequence id in its `generation_config.json`
    (an instruct model's end of turn): its own completions stop there too, as transformers'
    `generate` (and titan rl's rollouts) stop."""
    from titan.train.data.tokenizer import TokenizerConfig

    student = tmp_path / "student"
    shutil.copytree(models[0], student)
    tokenizer = TokenizerConfig(kind="byte").build()
    sequences, _ = _data_sequences(models, tmp_path / "probe")
    model = transformers.LlamaForCausalLM.from_pretrained(str(student), dtype=torch.float32).eval()
    first = int(model(torch.tensor([sequences[0][0]])).logits[0, -1].argmax())  # prompt 0's first greedy token
    stops = [tokenizer.eos_id, first]
    (student / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    flagged = (student, models[1], models[2])
    records = _gkd(flagged, tmp_path / "run", "--gkd.lmbda", "1", "--sampling.temperature", "0",
                   "--sampling.max_new_tokens", "5")
    greedy = []
    for prompt, _ in sequences:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_id)
        greedy.append((prompt, out[0, len(prompt):].tolist()))
    assert greedy[0][1] == [first]  # stopped at once
    assert records[0]["gkd_generated_tokens"] == pytest.approx(sum(len(c) for _, c in greedy) / len(greedy))
    want = _expected_loss(flagged, greedy, 0.5, tokenizer.vocab_size)
    assert records[0]["loss"] == pytest.approx(want, rel=1e-5), (records[0]["loss"], want)


@pytest.mark.slow
def test_the_student_learns_the_teachers_distributions(tmp_path, models):
    """Half the microbatches on-policy, 30 steps over the same 4 examples: the divergence on the
    data's completions falls (0.327 -> 0.174 measured); the student's own completions, fresh
    samples every time, stay further from the teacher."""
    records = _gkd(models, tmp_path / "run", "--training.steps", "30", "--optimizer.lr", "3e-3",
                   "--lr_scheduler.warmup_steps", "2")
    assert len(records) == 30
    on_data = [r["loss"] for r in records if r["on_policy"] == 0]
    own = [r["loss"] for r in records if r["on_policy"] == 1]
    assert len(on_data) >= 5 and len(own) >= 5  # both kinds of microbatch ran
    assert on_data[-1] < 0.65 * on_data[0] and sorted(on_data[-3:]) == sorted(on_data)[:3], on_data


# The 2-rank layouts, each against one process: FSDP (each rank generates its own rows'
# completions), and TP with loss parallel (the divergence from each rank's vocabulary columns
# of the student's and the sharded teacher's logits, or of a whole teacher's; the launch
# refuses any gathering of full logits: packages/titan-rl/tests/sitecustomize.py), CP (each rank's share of the sequence from the sharded teacher) and PP (a whole
# teacher on the last stage: its logits reach it with each pipeline microbatch's rows), where
# the replica's first rank generates and hands the rows to the other (the other has no student
# copy: without the hand-over the two would train on different rows). The teacher is sharded as
# the student but under PP, where it is whole: the one-process run's is an engine of its own.
LAYOUTS = {
    "fsdp": [],
    "tp": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "tp_whole": ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                 "--gkd.teacher_layout", "whole"],
    "cp": ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "pp": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
           "--gkd.teacher_layout", "whole"],
}


@pytest.mark.slow
@pytest.mark.xdist_group("gkd_two_ranks")
def test_every_layout_matches_one_process_and_a_resume_continues_exactly(tmp_path, models):
    """Half the microbatches regenerated by the student, sampled at temperature 0.9: the draws
    and sampling seeds are keyed by the global microbatch, so every 2-rank layout logs the
    one-process run's losses and gradient norms, and its held-out NLL and divergence at step 4
    (both from one forward per held-out batch). A one-process run resumed from its step-2
    checkpoint draws and samples what the uninterrupted run did."""
    common = ["--training.steps", "4", "--training.local_batch_size", "2", "--training.global_batch_size", "4",
              "--validation.enable", "--sft_data.eval_path", str(models[2]), "--validation.freq", "4"]
    runs = [[name, _flags(models, tmp_path / name, *common, *flags), "gkd"] for name, flags in LAYOUTS.items()]
    probes = str(Path(__file__).parents[1] / "packages" / "titan-rl" / "tests")  # sitecustomize.py
    launch_runs(2, RUNS_WORKER, runs, tmp_path / "launch.log",
                env={"PYTHONPATH": os.pathsep.join(filter(None, (probes, os.environ.get("PYTHONPATH")))),
                     "TITAN_TEST_REFUSE_FULL_LOGITS": "1"})
    one = _gkd(models, tmp_path / "one", *common)
    assert 0 < sum(r["on_policy"] for r in one) < 4
    for name in LAYOUTS:
        got = _records(tmp_path / name)
        assert [r["step"] for r in got] == [r["step"] for r in one] == [1, 2, 3, 4]
        for mine, theirs in zip(got, one, strict=True):
            assert mine["on_policy"] == theirs["on_policy"], name
            assert mine["gkd_generated_tokens"] == theirs["gkd_generated_tokens"], name
            for key in ("loss", "grad_norm"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5), (name, mine["step"], key)
        # Held-out at step 4: the NLL and the divergence from one forward, on every layout.
        for key in ("validation_loss", "validation_distill_loss"):
            assert got[-1][key] == pytest.approx(one[-1][key], rel=1e-5), (name, key)
    resumable = [*common, "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]
    straight = _gkd(models, tmp_path / "straight", *resumable)
    resumed_dump = tmp_path / "resumed"
    (resumed_dump / "checkpoint").mkdir(parents=True)
    shutil.copytree(tmp_path / "straight" / "checkpoint" / "step-2", resumed_dump / "checkpoint" / "step-2")
    resumed = _gkd(models, resumed_dump, *resumable)
    assert [r["step"] for r in resumed] == [3, 4]
    keys = ("loss", "grad_norm", "on_policy", "gkd_generated_tokens")
    for mine, theirs in zip(resumed, straight[2:], strict=True):
        assert [mine[k] for k in keys] == [theirs[k] for k in keys]
    assert any(r["on_policy"] for r in straight[2:]) and not math.isnan(straight[-1]["loss"])


@pytest.mark.parametrize("extra, message", [
    (["--gkd.teacher_model", ""], "set --gkd.teacher_model"),
    (["--training.loss_type", "dft"], "titan gkd's loss is the divergence to the teacher"),
    (["--sampling.n", "2"], "regenerates one completion per example"),
    (["--gkd.lmbda", "2"], "--gkd.lmbda is the share of on-policy microbatches"),
    (["--generator.kind", "vllm", "--gkd.lmbda", "0"], "this run generates none"),
    (["--generator.dtype", "bfloat16"], "--generator.dtype sets up the vLLM generator"),
    (["--generator.tensor_parallel_size", "2"], "--generator.tensor_parallel_size sets up the vLLM generator"),
])
def test_bad_input_is_one_line(tmp_path, models, extra, message):
    result = run_titan(["gkd", *_flags(models, tmp_path / "run", *extra)], env=ENV, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]


def test_the_dry_run_counts_the_teacher_its_logits_and_the_generating_copy(tmp_path, models):
    """`titan dry-run` of a GKD run adds what every rank holds beside the student's shards: the
    teacher (whole in float32, or sharded as the student: half of it on each of 2 FSDP ranks),
    its logits of one microbatch, and the student's float32 copy that generates (--gkd.lmbda
    above 0), by hand from transformers' parameter counts."""
    import re

    from titan.dist.dry_run import format_bytes

    student, teacher = (transformers.LlamaForCausalLM.from_pretrained(str(f)).num_parameters() for f in models[:2])
    logits = 4 * 24 * 320 * 4  # local batch x seq x the teacher's vocabulary, float32

    def dry_run(*extra: str) -> str:
        result = run_titan(["dry-run", "--world_size", "2", *_flags(models, tmp_path / "run", *extra)], env=ENV,
                           timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    out = dry_run("--gkd.teacher_layout", "whole")
    assert (f"(teacher (whole) {format_bytes(teacher * 4)}, teacher logits {format_bytes(logits)}, "
            f"generating copy {format_bytes(student * 4)})") in out, out
    # vLLM's copy in its dtype, with its paged KV cache (the dry run does not start vLLM).
    out = dry_run("--gkd.teacher_layout", "whole", "--generator.kind", "vllm", "--generator.dtype", "bfloat16",
                  "--generator.kv_cache_memory_bytes", str(1 << 20))
    assert f"generating copy {format_bytes(student * 2 + (1 << 20))})" in out, out
    # --gkd.seq_kd under vLLM: an engine of the teacher's too.
    out = dry_run("--gkd.seq_kd", "--generator.kind", "vllm", "--generator.kv_cache_memory_bytes", str(1 << 20))
    assert f"teacher's generator {format_bytes(teacher * 4 + (1 << 20))})" in out, out
    # vLLM's tensor parallel over the 2 ranks: each holds half of each engine's weights.
    out = dry_run("--gkd.seq_kd", "--gkd.teacher_layout", "whole", "--generator.kind", "vllm",
                  "--generator.kv_cache_memory_bytes", str(1 << 20), "--generator.tensor_parallel_size", "2")
    assert f"generating copy {format_bytes(student * 4 // 2 + (1 << 20))}" in out, out
    assert f"teacher's generator {format_bytes(teacher * 4 // 2 + (1 << 20))})" in out, out
    # TP 2 with loss parallel: a sharded teacher keeps half its logits' columns on each rank.
    out = dry_run("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")
    assert f"teacher logits {format_bytes(logits // 2)}," in out, out
    out = dry_run("--gkd.lmbda", "0")
    assert "generating copy" not in out, out
    held = re.search(r"teacher \(sharded\) ([\d.]+) KiB", out)
    assert held and float(held.group(1)) * 1024 == pytest.approx(teacher * 4 / 2, rel=0.02), out
