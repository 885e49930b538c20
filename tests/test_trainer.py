"""The trainer in-process at world size 1: accumulation, normalization, non-finite stops."""

import math

import pytest
import torch
from titan.train.loss import NonFiniteLossError
from titan.train.trainer import Trainer

from titan.recipes.families import model_spec
from titan.recipes.recipes import llama3_debug_synthetic


def tiny_config(tmp_path, **training):
    cfg = llama3_debug_synthetic()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.seq_len = 32
    cfg.training.steps = 3
    cfg.lr_scheduler.warmup_steps = 1
    cfg.metrics.log_freq = 1
    cfg.metrics.enable_progress_bar = False
    for key, value in training.items():
        setattr(cfg.training, key, value)
    return cfg


def run(cfg, *, capture_grads: bool = False):
    """Train `cfg`; (records, final weights) and, with `capture_grads`, every step's gradients
    as the optimizer sees them (after clipping), by parameter name."""
    trainer = Trainer(cfg, model_spec=model_spec("llama3"))
    grads: list[dict[str, torch.Tensor]] = []
    if capture_grads:
        names = {id(p): n for n, p in trainer.model_parts[0].named_parameters()}

        def keep_grads(optimizer, args, kwargs):
            grads.append({names[id(p)]: p.grad.detach().clone()
                          for group in optimizer.param_groups for p in group["params"]})

        trainer.optimizers[0].register_step_pre_hook(keep_grads)
    try:
        records = trainer.train()
        weights = {k: v.detach().clone() for k, v in trainer.model_parts[0].state_dict().items()}
    finally:
        trainer.close()
    return (records, weights, grads) if capture_grads else (records, weights)


# One batch of 8 and two microbatches of 4 are equal in exact arithmetic; in float32 they differ
# by the order of the sums over the batch's 8 x 32 = 256 tokens, which the CPU's GEMM kernels
# choose by instruction set (AVX2, AVX-512, AMX). Worst case for a reordered sum of n terms:
# n * 2^-24 = 1.5e-5 of the sum of the terms' magnitudes, which in these dense gradients is of
# the order of each tensor's largest entry. So gradients are compared per tensor within 2e-5 of
# that tensor's largest entry (~1e-6 measured).
GRAD_REL_TO_MAX = 2e-5
# Weights after 3 AdamW steps: AdamW divides each entry by sqrt(v) + eps, so with the default eps
# 1e-8 an entry whose gradient is ~0 by cancellation turns its ~1e-10 reordering error into an
# update of order lr (seen: 1.2e-5 on an AVX-512 + AMX Xeon, 0 elsewhere). eps 1e-5 caps that
# amplification at lr / eps = 200 while staying ~1% of a typical entry's RMS (~1e-3), so an
# entry moves by at most 200 x its reordering error, well inside atol 1e-6 (measured: 4e-8
# beyond rtol). The parity matrix (tests/test_parallel_parity.py) does the same.
ACCUM_EPS = 1e-5


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    """Two microbatches of 4 normalized by the global token count step exactly like one
    batch of 8: the same samples, the same loss, the same gradients, the same weights."""
    big_cfg = tiny_config(tmp_path / "big", local_batch_size=8)
    acc_cfg = tiny_config(tmp_path / "acc", local_batch_size=4, global_batch_size=8)
    for cfg in (big_cfg, acc_cfg):
        cfg.optimizer.eps = ACCUM_EPS
    big, big_w, big_g = run(big_cfg, capture_grads=True)
    acc, acc_w, acc_g = run(acc_cfg, capture_grads=True)
    for a, b in zip(big, acc, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert len(big_g) == len(acc_g) == 3
    for step, (want, got) in enumerate(zip(big_g, acc_g, strict=True), start=1):
        assert want.keys() == got.keys()
        for name, grad in want.items():
            scale = float(grad.abs().max())
            assert scale > 0, f"step {step}: {name} has no gradient"
            torch.testing.assert_close(got[name], grad, rtol=0, atol=GRAD_REL_TO_MAX * scale,
                                       msg=lambda m, name=name, step=step: f"step {step}: {name}: {m}")
    for name, tensor in big_w.items():
        torch.testing.assert_close(acc_w[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_non_finite_loss_stops_before_the_optimizer_step(tmp_path):
    trainer = Trainer(tiny_config(tmp_path), model_spec=model_spec("llama3"))
    model = trainer.model_parts[0]
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.register_forward_hook(lambda module, args, out: out * float("nan"))
    try:
        with pytest.raises(NonFiniteLossError, match="step 1: loss nan"):
            trainer.train()
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "weights changed"
        assert all(torch.isfinite(v).all() for v in after.values())
    finally:
        trainer.close()


def test_non_finite_gradient_names_its_parameter_and_keeps_weights(tmp_path):
    """A finite loss with one non-finite gradient: the stop names the first such parameter."""
    trainer = Trainer(tiny_config(tmp_path), model_spec=model_spec("llama3"))
    model = trainer.model_parts[0]
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.get_parameter("layers.1.feed_forward.w2.weight").register_hook(lambda grad: grad * float("inf"))
    try:
        with pytest.raises(NonFiniteLossError, match=r"first non-finite gradient on this rank: layers\.1\.feed_forward\.w2\.weight"):
            trainer.train()
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "weights changed"
    finally:
        trainer.close()


def test_loss_starts_at_uniform_and_tokens_are_counted(tmp_path):
    records, _ = run(tiny_config(tmp_path, local_batch_size=2))
    vocab = 320  # 259 byte-tokenizer ids padded to a multiple of 64
    # Output logits start with unit-order spread, so the first loss sits a little above
    # uniform over the vocabulary; far off means a broken init or loss normalization.
    assert math.log(vocab) <= records[0]["loss"] < math.log(vocab) + 1.0
    assert records[-1]["tokens_seen"] == 3 * 2 * 32


def test_bf16_without_fsdp_autocasts_and_tracks_fp32(tmp_path):
    """One process has no FSDP policy to cast parameters: --training.mixed_precision_param
    must still take effect (autocast), close to fp32 but not bitwise."""
    fp32, fp32_w = run(tiny_config(tmp_path / "fp32"))
    bf16, bf16_w = run(tiny_config(tmp_path / "bf16", mixed_precision_param="bfloat16"))
    assert all(w.dtype == torch.float32 for w in bf16_w.values())  # master weights stay fp32
    for a, b in zip(fp32, bf16, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
    assert any(a["loss"] != b["loss"] for a, b in zip(fp32, bf16, strict=True))


def test_mfu_is_against_the_peak_of_the_compute_dtype(tmp_path, monkeypatch):
    """A bf16 run's MFU uses the bf16 peak (on CPU measured in bf16: AMX makes it several times
    float32's), and the logger corrects that peak, not float32's."""
    import titan.train.loop as loop

    asked = []
    monkeypatch.setattr(loop, "device_peak_flops", lambda device, dtype: asked.append((device.type, dtype)) or 1e12)
    trainer = Trainer(tiny_config(tmp_path, mixed_precision_param="bfloat16"), model_spec=model_spec("llama3"))
    trainer.close()
    assert asked == [("cpu", torch.bfloat16)]
    assert trainer.metrics.compute_dtype == torch.bfloat16


def test_model_vocab_size_is_taken_as_given_or_refused(tmp_path):
    """`--model.vocab_size` sizes the embedding and output (a checkpoint with more rows than the
    tokenizer has tokens); below the tokenizer's vocabulary it is refused by name."""
    cfg = tiny_config(tmp_path)
    cfg.model.vocab_size = 400
    trainer = Trainer(cfg, model_spec=model_spec("llama3"))
    try:
        assert trainer.model_parts[0].tok_embeddings.weight.shape[0] == 400
        assert trainer.model_parts[0].output.weight.shape[0] == 400
    finally:
        trainer.close()
    cfg.model.vocab_size = 100
    with pytest.raises(ValueError, match="--model.vocab_size 100 is smaller than the tokenizer's 259 tokens"):
        Trainer(cfg, model_spec=model_spec("llama3"))


def test_job_description_opens_the_log(tmp_path, capfd):
    """`--job.description` is printed at start, as its help says (it was accepted and dropped)."""
    cfg = tiny_config(tmp_path, steps=1)
    cfg.job.description = "lr sweep, arm 3 of 5"
    run(cfg)
    assert "job: lr sweep, arm 3 of 5" in capfd.readouterr().err
