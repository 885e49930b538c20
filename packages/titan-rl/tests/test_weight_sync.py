"""Weight sync from the trainer into the generator: colocated (1 process and 2-rank FSDP)
and disaggregated (2 trainer + 2 generator gloo ranks in one job)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("sync_worker.py")


def load_worker():
    spec = importlib.util.spec_from_file_location("rl_sync_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_ranks(ranks: int, mode: str, out: Path) -> list[dict]:
    """The worker on ``ranks`` gloo ranks with torchrun's worker environment, forked from the
    suite's preloaded server (tests/forked_cli.py)."""
    from launching import launch  # the repository's tests/ (root conftest.py)

    launch(ranks, [str(WORKER), mode, str(out)], out / "launch.log", timeout=600, torchrun=False)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(ranks)]


def assert_same_weights(trainer: dict, generator: dict) -> None:
    assert set(trainer) <= set(generator)
    for name, value in trainer.items():
        assert torch.equal(generator[name], value), name


@pytest.fixture
def one_process(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    worker = load_worker()
    engine = worker.make_engine(str(tmp_path))
    yield worker, engine
    engine.close()


def test_colocated_sync_from_one_process_engine(one_process):
    from titan.rl.weight_sync import sync_colocated

    worker, engine = one_process
    generator = worker.make_generator()
    # Cloned: on one process the engine yields its live parameters (detached views).
    before = {k: v.clone() for k, v in engine.full_state_dict()}
    assert any(not torch.equal(generator.model.state_dict()[k], v) for k, v in before.items())
    assert generator.version == 0
    stats = sync_colocated(engine, generator, version=1)
    assert generator.version == stats.version == 1
    assert stats.tensors == len(before) and stats.bytes == sum(t.numel() * 4 for t in before.values())
    assert_same_weights(before, dict(generator.named_weights()))
    # The generator now computes what the trainer's model computes.
    tokens = torch.randint(0, worker.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(generator.model(tokens), engine.model_parts[0](tokens), rtol=0, atol=0)

    worker.train_step(engine)
    after = dict(engine.full_state_dict())
    assert all(not torch.equal(after[k], before[k]) for k in after)
    sync_colocated(engine, generator, version=2)
    assert generator.version == 2
    assert_same_weights(after, dict(generator.named_weights()))


def test_moe_sync_carries_the_trained_balancing_bias(tmp_path, monkeypatch):
    """An MoE policy: after steps that moved the router's load-balancing bias (a buffer, not a
    parameter), the generator's whole state_dict equals the trainer's and its logits are the
    trainer's bit for bit; a sync that leaves the bias out is refused."""
    from titan.rl.weight_sync import WeightMismatchError, sync_colocated

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    worker = load_worker()
    moe = {"spec": worker.qwen3_moe_spec(), "overrides": {"load_balance_coeff": 0.05}}
    engine = worker.make_engine(str(tmp_path), **moe)
    try:
        for _ in range(2):
            worker.train_step(engine)
        trainer = {k: v.clone() for k, v in engine.full_state_dict(dtype=torch.float32)}
        biases = [k for k in trainer if k.endswith("expert_bias")]
        assert biases and all(torch.count_nonzero(trainer[k]) for k in biases), "the bias did not move"
        generator = worker.make_generator(**moe)
        sync_colocated(engine, generator, version=2, dtype=torch.float32)
        held = generator.model.state_dict()
        assert set(held) == set(trainer)  # untied: no alias names
        for name, value in held.items():
            assert torch.equal(value, trainer[name]), name
        tokens = torch.randint(0, worker.VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
        engine.model_parts[0].eval()
        with torch.no_grad():
            torch.testing.assert_close(generator.model(tokens), engine.model_parts[0](tokens), rtol=0, atol=0)

        without_bias = [(k, v) for k, v in engine.full_state_dict() if not k.endswith("expert_bias")]
        with pytest.raises(ValueError, match="expert_bias"):
            sync_colocated(without_bias, worker.make_generator(**moe), version=3)
        # A generator whose load skips the bias silently is caught by the check.
        lazy = worker.make_generator(**moe)
        real_load = lazy.load_weights
        lazy.load_weights = lambda tensors, *, version: real_load(
            ((k, torch.zeros_like(v) if k.endswith("expert_bias") else v) for k, v in tensors), version=version)
        with pytest.raises(WeightMismatchError, match="expert_bias"):
            sync_colocated(engine, lazy, version=3)
    finally:
        engine.close()


def test_an_unsent_state_tensor_is_caught_even_when_it_equals_a_sent_one():
    """The coverage check goes by storage (a tied alias shares its twin's), not by value: an
    unsent zero buffer next to a sent zero buffer is still reported."""
    from titan.rl.weight_sync import WeightMismatchError, sync_colocated

    class Permissive:  # loads what it gets and checks nothing itself
        def __init__(self):
            shared = torch.zeros(3)
            self.state = {"a": torch.zeros(4), "bias0": torch.zeros(2), "bias1": torch.zeros(2), "tied": shared,
                          "twin": shared}

        def load_weights(self, tensors, *, version):
            for name, t in tensors:
                self.state[name].copy_(t)

        def named_weights(self):
            return self.state.items()

    sent = [("a", torch.ones(4)), ("bias0", torch.zeros(2)), ("tied", torch.ones(3))]
    sync_colocated(sent + [("bias1", torch.zeros(2))], Permissive(), version=1)  # "twin" is "tied"
    with pytest.raises(WeightMismatchError, match=r"did not cover 1 .*\['bias1'\]"):
        sync_colocated(sent, Permissive(), version=1)


def test_colocated_sync_detects_a_bad_load(one_process):
    """The post-sync check can fail: a generator that perturbs one tensor is caught."""
    from titan.rl.weight_sync import WeightMismatchError, sync_colocated

    worker, engine = one_process
    generator = worker.make_generator()
    real_load = generator.load_weights

    def corrupting_load(named_tensors, *, version):
        real_load(((n, t + 1e-6 if n == "norm.weight" else t) for n, t in named_tensors), version=version)

    generator.load_weights = corrupting_load
    with pytest.raises(WeightMismatchError, match="norm.weight"):
        sync_colocated(engine, generator, version=1)


def test_load_weights_rejects_unknown_missing_and_misshapen(one_process):
    worker, engine = one_process
    generator = worker.make_generator()
    weights = dict(engine.full_state_dict())
    with pytest.raises(KeyError, match="nope"):
        generator.load_weights([("nope", torch.zeros(1))], version=1)
    with pytest.raises(ValueError, match="unset"):
        generator.load_weights(list(weights.items())[:-1], version=1)
    with pytest.raises(ValueError, match="shape"):
        generator.load_weights([("norm.weight", torch.zeros(3))], version=1)
    assert generator.version == 0


@pytest.mark.slow
def test_colocated_sync_from_two_rank_fsdp_engine(tmp_path):
    records = run_ranks(2, "colocated", tmp_path)
    for record in records:
        assert record["versions"] == [1, 2]
        for trainer, generator in zip(record["trainer"], record["generator"], strict=True):
            assert_same_weights(trainer, generator)
        assert any(not torch.equal(record["trainer"][0][k], record["trainer"][1][k]) for k in record["trainer"][0])


@pytest.mark.slow
def test_disaggregated_sync_two_trainers_two_generators(tmp_path):
    trainer0, trainer1, gen0, gen1 = run_ranks(4, "disaggregated", tmp_path)
    for gen in (gen0, gen1):
        assert gen["versions"] == [1, 2]
        for sent, got in zip(trainer0["weights"], gen["weights"], strict=True):
            assert_same_weights(sent, got)
    for a, b in zip(trainer0["weights"], trainer1["weights"], strict=True):
        assert_same_weights(a, b)  # both trainer ranks saw the same full weights
    first, second = trainer0["weights"]
    assert any(not torch.equal(first[k], second[k]) for k in first)  # the second sync moved new weights


@pytest.mark.slow
def test_split_job_sync_from_a_two_rank_engine_to_two_generators(tmp_path):
    trainer0, trainer1, gen0, gen1 = run_ranks(4, "split", tmp_path)
    assert trainer0["engine_world"] == trainer1["engine_world"] == 2  # the engine spans the trainer part only
    assert all(r["group_size"] == 2 for r in (trainer0, trainer1, gen0, gen1))
    for gen in (gen0, gen1):
        assert gen["versions"] == [1, 2]
        for sent, got in zip(trainer0["weights"], gen["weights"], strict=True):
            assert_same_weights(sent, got)
    first, second = trainer0["weights"]
    assert any(not torch.equal(first[k], second[k]) for k in first)  # the step between syncs moved weights


def test_tensor_checksum_is_exact_and_position_sensitive():
    from titan.rl.weight_sync import tensor_checksum

    a = torch.randn(5, 1024 + 7, generator=torch.Generator().manual_seed(0))
    assert tensor_checksum(a) == tensor_checksum(a.clone())
    assert tensor_checksum(a) == tensor_checksum(a.t().contiguous().t())  # layout does not matter
    changed = a.clone()
    changed[3, 9] = torch.nextafter(changed[3, 9], torch.tensor(float("inf")))  # one ulp
    swapped_cols, swapped_rows = a.clone(), a.clone()
    swapped_cols.view(-1)[[0, 1]] = a.view(-1)[[1, 0]]
    swapped_rows.view(-1)[[0, 1024]] = a.view(-1)[[1024, 0]]
    for other in (changed, swapped_cols, swapped_rows):
        assert tensor_checksum(other) != tensor_checksum(a)
    assert tensor_checksum(a.bfloat16()) != tensor_checksum(a)
