"""AdamW parameter groups and the warmup–stable–decay schedule."""

import math

import pytest
import torch
from titan.train.lr_scheduler import (
    LRSchedulerConfig,
    build_lr_scheduler,
    warn_if_warmup_exceeds_steps,
    wsd_factor,
)
from titan.train.optimizer import OptimizerConfig, build_optimizer, split_decay_groups
from torch import nn


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.RMSNorm(4)
        self.proj = nn.Linear(4, 4, bias=True)
        self.out = nn.Linear(4, 10, bias=False)


def test_norms_biases_and_embeddings_are_exempt_from_decay():
    model = TinyLM()
    decay, exempt = split_decay_groups([model])
    assert {id(p) for p in decay} == {id(model.proj.weight), id(model.out.weight)}
    assert {id(p) for p in exempt} == {id(model.embed.weight), id(model.norm.weight), id(model.proj.bias)}


def test_build_optimizer_groups_and_hyperparameters():
    model = TinyLM()
    opt = build_optimizer(OptimizerConfig(lr=1e-3, weight_decay=0.2), [model], "cpu")
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    assert opt.param_groups[0]["fused"] is True  # "auto" on CPU
    assert build_optimizer(OptimizerConfig(), [model], "meta").param_groups[0]["foreach"] is True
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)


def test_weight_decay_leaves_exempt_params_alone():
    torch.manual_seed(0)
    model = TinyLM()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before_norm = model.norm.weight.detach().clone()
    before_proj = model.proj.weight.detach().clone()
    opt = build_optimizer(OptimizerConfig(lr=0.1, weight_decay=0.5), [model], "cpu")
    opt.step()
    assert torch.equal(model.norm.weight, before_norm)
    assert torch.allclose(model.proj.weight, before_proj * (1 - 0.1 * 0.5))


@pytest.mark.parametrize(
    "kwargs, match",
    [({"lr": 0.0}, "--optimizer.lr"), ({"beta2": 1.0}, "--optimizer.beta2"), ({"weight_decay": -1}, "weight_decay")],
)
def test_optimizer_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kwargs)


def test_wsd_shape():
    cfg = LRSchedulerConfig(warmup_steps=10, decay_ratio=0.2, decay_type="linear", min_lr_factor=0.1)
    factors = [wsd_factor(s, cfg=cfg, total_steps=100) for s in range(1, 101)]
    assert factors[0] == pytest.approx(0.1)
    assert factors[9] == pytest.approx(1.0)
    assert all(f == 1.0 for f in factors[10:81])  # stable phase, through step 81
    # 20 decay steps, the last a virtual 101st: step 100 is 19/20 of the way to min_lr_factor.
    assert factors[-1] == pytest.approx(0.1 + 0.9 * (1 / 20))
    assert all(a > b for a, b in zip(factors[80:], factors[81:], strict=False))


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_decay_types_end_at_min(decay_type):
    cfg = LRSchedulerConfig(warmup_steps=0, decay_type=decay_type, min_lr_factor=0.0)
    # Decay over 50 steps from step 1 (at the peak) to a virtual step 51 (at the minimum).
    assert wsd_factor(1, cfg=cfg, total_steps=50) == 1.0
    assert wsd_factor(51, cfg=cfg, total_steps=50) == pytest.approx(0.0, abs=1e-12)
    assert wsd_factor(50, cfg=cfg, total_steps=50) > 0  # the last step still learns
    mid = wsd_factor(26, cfg=cfg, total_steps=50)
    expected = {"linear": 0.5, "sqrt": 1 - math.sqrt(0.5), "cosine": 0.5}[decay_type]
    assert mid == pytest.approx(expected)


def test_scheduler_drives_optimizer_lr():
    model = TinyLM()
    opt = build_optimizer(OptimizerConfig(lr=1.0), [model], "cpu")
    sched = build_lr_scheduler(LRSchedulerConfig(warmup_steps=4), opt, total_steps=8)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # decay_ratio None: decay over the 4 steps after warmup, the first still at the peak, the
    # last at 1/4 (torchtitan's schedule, computed by hand from its definition).
    assert seen[4:] == pytest.approx([1.0, 0.75, 0.5, 0.25])


def test_a_resumed_schedule_follows_this_runs_flags_not_the_checkpoints(caplog):
    """Saved after 3 steps of a 3-step run at LR 1, loaded by a run of 8 steps at LR 0.5: the
    position (3 steps) comes from the checkpoint, the peak and the schedule from this run. The
    loaded optimizer state held the old schedule's LR for step 4 (its end: 0), and the loaded
    scheduler state the old peak (1.0); the scheduler's load replaces both by this run's
    0.5 x factor(4 of 8), and says the LR differs from the saved one."""
    from titan.train.engine import LRSchedulers

    model = TinyLM()
    opt = build_optimizer(OptimizerConfig(lr=1.0), [model], "cpu")
    old = LRSchedulers([build_lr_scheduler(LRSchedulerConfig(warmup_steps=2), opt, total_steps=3)])
    for _ in range(3):
        opt.step()
        old.step()
    assert opt.param_groups[0]["lr"] == 0.0  # the 3-step schedule's virtual last step
    saved_opt, saved_sched = opt.state_dict(), old.state_dict()
    cfg = LRSchedulerConfig(warmup_steps=2)
    resumed_opt = build_optimizer(OptimizerConfig(lr=0.5), [TinyLM()], "cpu")
    resumed = LRSchedulers([build_lr_scheduler(cfg, resumed_opt, total_steps=8)])
    resumed_opt.load_state_dict(saved_opt)
    assert resumed_opt.param_groups[0]["lr"] == 0.0  # what torch alone would train step 4 with
    with caplog.at_level("WARNING", logger="titan"):
        resumed.load_state_dict(saved_sched)
    assert (resumed_opt.param_groups[0]["lr"], resumed.last_lr()) == (0.5 * wsd_factor(4, cfg=cfg, total_steps=8),) * 2
    assert "step 4 trains at 0.417, where the run that saved step 3 had set 0" in caplog.text  # 0.5 x 5/6
    seen = []
    for _ in range(5):
        seen.append(resumed_opt.param_groups[0]["lr"])
        assert resumed.last_lr() == seen[-1]
        resumed_opt.step()
        resumed.step()
    assert seen == pytest.approx([0.5 * wsd_factor(s, cfg=cfg, total_steps=8) for s in range(4, 9)])
    assert resumed_opt.param_groups[0]["initial_lr"] == 0.5


def test_the_schedule_is_torchtitans_step_for_step():
    """torchtitan's linear_warmup_stable_decay, written out by hand for 10 steps, warmup 2:
    warmup 1/2, 2/2; decay_ratio None: 8 decay steps with a virtual last one, the first held
    at the peak; decay_ratio 0.5: 5 decay steps at the end."""
    cfg = LRSchedulerConfig(warmup_steps=2)
    assert [wsd_factor(s, cfg=cfg, total_steps=10) for s in range(1, 11)] == pytest.approx(
        [0.5, 1.0, 1.0, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8, 2 / 8, 1 / 8])
    cfg = LRSchedulerConfig(warmup_steps=2, decay_ratio=0.5, min_lr_factor=0.2)
    tail = [0.2 + 0.8 * (1 - k / 5) for k in range(1, 5)]
    assert [wsd_factor(s, cfg=cfg, total_steps=10) for s in range(1, 11)] == pytest.approx(
        [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, *tail])


def test_lr_config_validation():
    with pytest.raises(ValueError, match="decay_ratio"):
        LRSchedulerConfig(decay_ratio=1.5)


def test_a_warmup_longer_than_the_run_is_warned_and_spans_the_run(caplog):
    """torchtitan's rule: the warmup is cut to the run's steps (the LR peaks at the last
    one), and the user is told, since the flag's value is not what runs."""
    cfg = LRSchedulerConfig(warmup_steps=100)
    with caplog.at_level("WARNING", logger="titan"):
        warn_if_warmup_exceeds_steps(cfg, total_steps=10)
    assert ["--lr_scheduler.warmup_steps 100 exceeds the run's 10 steps" in r.getMessage() for r in caplog.records] == [True]
    assert [wsd_factor(s, cfg=cfg, total_steps=10) for s in (1, 5, 10)] == [0.1, 0.5, 1.0]
    caplog.clear()
    warn_if_warmup_exceeds_steps(LRSchedulerConfig(warmup_steps=10), total_steps=10)
    assert not caplog.records


@pytest.mark.parametrize("kinds, exempt_names", [
    (["embeddings", "norms", "biases"], {"embed.weight", "norm.weight", "proj.bias"}),
    (["norms", "biases"], {"norm.weight", "proj.bias"}),  # transformers' Trainer, Megatron-LM
    (["none"], set()),  # torchtitan: every parameter decays
])
def test_the_exempt_kinds_are_chosen(kinds, exempt_names):
    model = TinyLM()
    cfg = OptimizerConfig(weight_decay=0.1, weight_decay_exempt=kinds)
    decay, exempt = split_decay_groups([model], cfg.weight_decay_exempt)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in exempt} == exempt_names
    assert {names[id(p)] for p in decay} == set(names.values()) - exempt_names
    opt = build_optimizer(cfg, [model], "cpu")
    decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert decayed == set(names.values()) - exempt_names


def test_an_unknown_exempt_kind_is_refused():
    with pytest.raises(ValueError, match="weight_decay_exempt takes embeddings, norms, biases or none"):
        OptimizerConfig(weight_decay_exempt=["layernorms"])
