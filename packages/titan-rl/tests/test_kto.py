"""`titan kto`: its data (unpaired rows, pairs unpaired, twins) and its loss through the loop,
against a hand computation on unpacked sequences."""

from __future__ import annotations

import copy
import json
import math
import types

import numpy as np
import pytest
import torch
from preference_runs import resumed_without_the_last_save, tiny_run, trained
from titan.rl.kto import KTOConfig, KTOSection, KTOTrainer
from titan.rl.kto_data import KL_SHIFT, KTODataConfig, build_kto_source
from titan.rl.preference_data import build_preference_dataloader
from titan.train.data.chat import encode_prompt_completion
from titan.train.data.tokenizer import ByteTokenizer

from titan.recipes.families import model_spec

TOK = ByteTokenizer()


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_unpaired_rows_get_a_twin_from_another_prompt(tmp_path):
    rows = [{"prompt": f"q{i}=", "completion": f"a{i}", "label": i % 2 == 0} for i in range(4)]
    source = build_kto_source(KTODataConfig(path=_write(tmp_path / "u.jsonl", rows)), TOK)
    assert len(source) == 4
    example = source.example(1)
    assert example.label is False
    np.testing.assert_array_equal(example.chosen.ids, encode_prompt_completion("q1=", "a1", TOK).ids)
    # the twin: this prompt, the completion of example 1 + KL_SHIFT
    np.testing.assert_array_equal(example.rejected.ids, encode_prompt_completion("q1=", f"a{1 + KL_SHIFT}", TOK).ids)


def test_preference_rows_are_unpaired_chosen_desirable_rejected_not(tmp_path):
    rows = [{"prompt": f"q{i}=", "chosen": f"good{i}", "rejected": f"bad{i}"} for i in range(3)]
    source = build_kto_source(KTODataConfig(path=_write(tmp_path / "p.jsonl", rows)), TOK)
    assert len(source) == 6
    texts = [(source.example(i).label, TOK.decode(source.example(i).chosen.ids.tolist()),
              TOK.decode(source.example(i).rejected.ids.tolist())) for i in range(6)]
    assert texts[0][0] is True and texts[0][1].endswith("q0=good0")
    assert texts[1][0] is False and texts[1][1].endswith("q0=bad0")
    # a twin never pairs a prompt with its own completions
    assert texts[0][2].endswith("q0=good1") and texts[1][2].endswith("q0=bad1")


def test_bad_unpaired_rows_and_flags_are_refused(tmp_path):
    path = _write(tmp_path / "b.jsonl", [{"prompt": "p", "completion": "c", "label": "yes"}] * 3)
    with pytest.raises(ValueError, match="row 0.*not true or false"):
        build_kto_source(KTODataConfig(path=path), TOK).example(0)
    with pytest.raises(ValueError, match="--kto_data.label_field"):
        KTODataConfig(label_field="ok")  # the synthetic task reads no file
    pairs = _write(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "c", "rejected": "r"}] * 3)
    with pytest.raises(ValueError, match="--kto_data.completion_field 'answer' is read by --kto_data.format unpaired"):
        build_kto_source(KTODataConfig(path=pairs, completion_field="answer"), TOK)
    with pytest.raises(ValueError, match="--kto.undesirable_weight"):
        KTOSection(undesirable_weight=0)


def test_rows_carry_the_label_on_the_example_and_its_twin():
    cfg = KTODataConfig(synthetic_examples=20)
    batch = next(build_preference_dataloader(cfg, TOK, dp_rank=0, dp_world_size=1, local_batch_size=2, seq_len=128,
                                             seed=0))
    source = build_kto_source(cfg, TOK)
    docs = batch["document_ids"]
    for index in {int(i) for i in batch["pair_index"].unique() if i >= 0}:
        tokens = batch["pair_index"] == index
        assert (batch["desirable"][tokens] == float(source.example(index).label)).all()
    assert (batch["desirable"][docs < 0] == 0).all()


def _config(tmp_path, steps=2) -> KTOConfig:
    cfg = tiny_run(KTOConfig(), tmp_path, steps=steps, examples=128)
    cfg.kto.beta, cfg.kto.undesirable_weight = 0.5, 1.5
    return cfg


def _logprobs(model, pair) -> list[float]:
    """The summed target log-probs of the example and of its twin, each from a plain forward
    of the sequence alone."""
    out = []
    for side in pair.sides:
        ids = torch.as_tensor(side.ids)[None]
        with torch.no_grad():
            logp = model(ids[:, :-1]).float().log_softmax(-1)[0].gather(-1, ids[0, 1:, None])[:, 0]
        out.append(float(logp[torch.as_tensor(side.targets[1:])].sum()))
    return out


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired", "bco"])
def test_kto_loss_of_a_batch_matches_a_hand_computation(tmp_path, loss_type):
    """Each loss type's mean over a batch against the formula by hand, with the reference
    written in by hand; BCO's baseline: the examples' mean log-ratio over the run's steps and
    this batch (its step-1 loss is log 2 x the weights, the policy being the reference)."""
    cfg = _config(tmp_path)
    cfg.kto.loss_type = loss_type
    trainer = KTOTrainer(cfg, model_spec=model_spec("llama3"))
    try:
        start = copy.deepcopy(trainer.model_parts[0]).eval()
        records = trainer.train()
        # Step 1: the policy is the reference: every log-ratio and z0 are 0, each loss 1/2 x its
        # weight (BCO: -log sigmoid(0) = log 2).
        first = records[0]
        weights = (first["count_chosen"] * 1.0 + first["count_rejected"] * 1.5) / first["pairs"]
        at_zero = math.log(2) if loss_type == "bco" else 0.5
        assert first["loss"] == pytest.approx(at_zero * weights, rel=1e-6)
        assert first["delta" if loss_type == "bco" else "kl"] == 0.0
        # BCO alone keeps (and checkpoints) a running baseline.
        assert (trainer.baseline is None) == (loss_type != "bco")
        baseline = trainer.baseline or types.SimpleNamespace(total=0.0, count=0.0)
        total_before, count_before = float(baseline.total), float(baseline.count)
        source = build_kto_source(cfg.kto_data, trainer.tokenizer)
        rows = trainer._with_rows(next(trainer.dataloader))
        examples = sorted({int(i) for i in rows["pair_index"].unique() if i >= 0})
        ref = {}
        for index in examples:  # past the run's steps: the reference written in by hand, the
            # twins' 2 nats lower, so that their mean log-ratio z0 is positive (not clamped)
            ref[index] = [a - b for a, b in zip(_logprobs(start, source.example(index)), (0.0, 2.0), strict=True)]
            trainer.reference.logprobs[index] = torch.tensor(ref[index], dtype=torch.float64)
            trainer.reference.known[index] = True
        batch = trainer.engine.to_device(trainer._with_reference(rows, trainer.reference))
        trainer.before_pass([batch])  # the reference point of this batch
        trainer.engine.train(False)
        count = torch.tensor(float(len(examples)))
        total = trainer.engine.forward_only(batch, lambda logits, b: trainer._pair_loss(
            logits, b, global_pairs=count, global_chosen_tokens=count))
        policy = trainer.model_parts[0]
        logps = {i: _logprobs(policy, source.example(i)) for i in examples}
        z0 = max(0.0, sum(logps[i][1] - ref[i][1] for i in examples) / len(examples))
        if loss_type == "bco":  # the running mean of the examples' log-ratios, this batch's included
            z0 = (total_before + sum(logps[i][0] - ref[i][0] for i in examples)) / (count_before + len(examples))
            assert count_before == sum(r["count_chosen"] + r["count_rejected"] for r in records)
        losses = []
        for i in examples:
            r = logps[i][0] - ref[i][0]
            if loss_type == "apo_zero_unpaired":  # no reference point
                losses.append(1 - _sigmoid(0.5 * r) if source.example(i).label else 1.5 * _sigmoid(0.5 * r))
            elif loss_type == "bco":
                losses.append(-math.log(_sigmoid(0.5 * (r - z0))) if source.example(i).label
                              else -1.5 * math.log(_sigmoid(0.5 * (z0 - r))))
            elif source.example(i).label:
                losses.append(1.0 * (1 - _sigmoid(0.5 * (r - z0))))
            else:
                losses.append(1.5 * (1 - _sigmoid(0.5 * (z0 - r))))
        assert float(total) / len(examples) == pytest.approx(sum(losses) / len(losses), rel=1e-4)
        if loss_type in ("kto", "bco"):
            assert z0 != 0 and float(trainer._z0) == pytest.approx(z0, rel=1e-4)  # the reference point is in play
        else:
            assert float(trainer._z0) == 0 and all(r["kl"] == 0 for r in records)
    finally:
        trainer.close()


def test_bco_learns_and_a_resume_continues_its_baseline(tmp_path):
    """BCO separates the labels (the reward margin grows from 0), and its running baseline is
    checkpointed: a run resumed from step 3 logs the uninterrupted run's losses and deltas; a
    baseline restarted from 0 would move the resumed losses."""
    cfg = _config(tmp_path, steps=6)
    cfg.kto.loss_type = "bco"
    cfg.checkpoint.enable, cfg.checkpoint.interval = True, 3

    def build() -> KTOTrainer:
        return KTOTrainer(cfg, model_spec=model_spec("llama3"))

    full = trained(build())
    assert full[0]["rewards_margins"] == 0 and full[-1]["rewards_margins"] > 0.1, [r["rewards_margins"] for r in full]
    assert all(r["delta"] != 0 for r in full[1:])
    resumed = resumed_without_the_last_save(build, tmp_path, last_step=6)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for got, want in zip(resumed, full[3:], strict=True):
        assert (got["loss"], got["delta"], got["rewards_margins"]) == (want["loss"], want["delta"], want["rewards_margins"])
