"""GKD's loss (titan.rl.distill_loss): the generalized Jensen-Shannon divergence between the
student's and the teacher's next-token distributions, against hand computations."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from titan.rl.distill_loss import generalized_jsd, gkd_loss_sum


def _hand_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float) -> list[float]:
    """Each row's divergence from probabilities, term by term in Python floats (the paper's
    definition; TRL's ends: beta 0 the forward KL, 1 the reverse KL)."""
    out = []
    for s_row, t_row in zip(student_logits.tolist(), teacher_logits.tolist(), strict=True):
        s_norm, t_norm = sum(math.exp(x) for x in s_row), sum(math.exp(x) for x in t_row)
        s = [math.exp(x) / s_norm for x in s_row]
        t = [math.exp(x) / t_norm for x in t_row]

        def kl(p, q):
            return sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)

        if beta == 0:
            out.append(kl(t, s))
        elif beta == 1:
            out.append(kl(s, t))
        else:
            m = [(1 - beta) * si + beta * ti for si, ti in zip(s, t, strict=True)]
            out.append(beta * kl(t, m) + (1 - beta) * kl(s, m))
    return out


def _logits(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_equals_the_definition_by_hand(beta):
    student, teacher = _logits(6, 11, seed=0), _logits(6, 11, seed=1)
    got = generalized_jsd(student, teacher, beta)
    assert got.dtype == torch.float64
    assert got.tolist() == pytest.approx(_hand_jsd(student, teacher, beta), rel=1e-12, abs=1e-15)
    assert (got > 0).all()
    assert generalized_jsd(student, student.clone(), beta).abs().max() < 1e-15  # equal distributions
    if beta == 0.5:  # the symmetric Jensen-Shannon divergence: symmetric, at most log 2
        assert got.tolist() == pytest.approx(generalized_jsd(teacher, student, beta).tolist(), rel=1e-12)
        assert got.max() <= math.log(2)


def test_the_ends_are_torch_kl_div_and_their_gradients_the_closed_forms():
    """beta 0 is KL(teacher || student), torch's ``kl_div(log S, log T)``; its gradient in the
    student's logits is ``softmax(s) - softmax(t)``. beta 1 is KL(student || teacher)."""
    student, teacher = _logits(5, 7, seed=2).requires_grad_(), _logits(5, 7, seed=3)
    log_s, log_t = F.log_softmax(student, -1), F.log_softmax(teacher, -1)
    forward = generalized_jsd(student, teacher, 0.0)
    torch.testing.assert_close(forward, F.kl_div(log_s, log_t, reduction="none", log_target=True).sum(-1))
    (grad,) = torch.autograd.grad(forward.sum(), student)
    torch.testing.assert_close(grad, student.softmax(-1) - teacher.softmax(-1), rtol=1e-12, atol=1e-14)
    reverse = generalized_jsd(student, teacher, 1.0)
    torch.testing.assert_close(reverse, F.kl_div(log_t, log_s, reduction="none", log_target=True).sum(-1))


def test_the_gradient_is_the_student_sides_only():
    student, teacher = _logits(3, 5, seed=4).requires_grad_(), _logits(3, 5, seed=5).requires_grad_()
    assert torch.autograd.gradcheck(lambda s: generalized_jsd(s, teacher, 0.3), (student,))
    generalized_jsd(student, teacher, 0.3).sum().backward()
    assert teacher.grad is None and student.grad.abs().sum() > 0


def test_a_token_the_teacher_rules_out_adds_nothing_to_the_forward_kl():
    """``0 log 0 = 0``: a teacher's -inf logit (a masked token) gives no NaN."""
    student = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
    teacher = torch.tensor([[0.0, -math.inf, 2.0]], dtype=torch.float64)
    got = generalized_jsd(student, teacher, 0.0)
    s, t = student.softmax(-1)[0], teacher.softmax(-1)[0]
    want = t[0] * math.log(t[0] / s[0]) + t[2] * math.log(t[2] / s[2])
    assert got.item() == pytest.approx(float(want), rel=1e-12)


def test_the_summed_loss_counts_labelled_positions_and_the_shared_vocabulary():
    """Summed over labelled positions only; ``vocab_size`` compares the tokenizer's columns
    (each side renormalized over them), the rest of either model's padded vocabulary left out;
    chunked equals whole, value and gradient."""
    student = _logits(2, 5, 9, seed=6).float().requires_grad_()
    teacher = _logits(2, 5, 12, seed=7).float()
    labels = torch.tensor([[-100, 3, 4, -100, 1], [2, -100, -100, 0, 6]])
    whole = gkd_loss_sum(student, teacher, labels, beta=0.5, vocab_size=8)
    keep = labels != -100
    want = sum(_hand_jsd(student[keep][:, :8].double().detach(), teacher[keep][:, :8].double(), 0.5))
    assert whole.item() == pytest.approx(want, rel=1e-5)
    (whole_grad,) = torch.autograd.grad(whole, student)
    assert whole_grad[~keep].abs().max() == 0 and whole_grad[..., 8:].abs().max() == 0
    chunked = gkd_loss_sum(student, teacher, labels, beta=0.5, vocab_size=8, chunk_tokens=2)
    assert chunked.item() == pytest.approx(whole.item(), rel=1e-6)
    (chunked_grad,) = torch.autograd.grad(chunked, student)
    torch.testing.assert_close(chunked_grad, whole_grad, rtol=1e-5, atol=1e-8)
    nothing = gkd_loss_sum(student, teacher, torch.full_like(labels, -100), beta=0.5, vocab_size=8)
    assert nothing.item() == 0 and nothing.requires_grad


def test_bad_input_is_refused():
    student, teacher, labels = torch.zeros(1, 2, 4), torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="do not both cover the 4 token ids"):
        gkd_loss_sum(student, teacher, labels, beta=0.5)
    assert gkd_loss_sum(student, teacher, labels, beta=0.5, vocab_size=3).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match=r"--gkd.beta must be in \[0, 1\]"):
        generalized_jsd(student[0], student[0], 1.5)


def test_row_prompts_cut_each_packed_example_before_its_last_completion_span():
    """A packed row of two examples (the second a chat with two assistant turns) and padding:
    each prompt is the example's tokens up to the position whose label is its last span's
    first token; an example without a label has no prompt."""
    from titan.rl.gkd import row_prompts

    # example 0: ids 1 2 3 | 4 5 (target 4 5); example 1: 6 7 | 8 | 9 | 10 (targets 8 and 10);
    # example 2: 11 12 (no target); padding.
    input_ids = np.array([1, 2, 3, 4, 6, 7, 8, 9, 11, 0, 0])
    labels = np.array([-100, -100, 4, 5, -100, 8, -100, 10, -100, -100, -100])
    document_ids = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, -1, -1])
    assert row_prompts(input_ids, labels, document_ids) == [[1, 2, 3], [6, 7, 8, 9]]


def test_repack_row_places_examples_in_order_and_cuts_what_overflows():
    from titan.rl.gkd import repack_row

    row, dropped = repack_row([[1, 2], [3, 4, 5], [6]], [[7, 8, 9], [10, 11], [12]], seq_len=7, pad_id=0)
    # [1 2 7 8 9] takes 4 positions; [3 4 5 10 11] would take 4 more: cut to 3 4 5 10 (3 positions).
    assert row["input_ids"].tolist() == [1, 2, 7, 8, 3, 4, 5]
    assert row["labels"].tolist() == [-100, 7, 8, 9, -100, -100, 10]
    assert row["document_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert row["positions"].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert dropped == 1  # [6, 12] had no room left
    row, dropped = repack_row([[1]], [[2]], seq_len=4, pad_id=0)
    assert row["input_ids"].tolist() == [1, 0, 0, 0] and row["labels"].tolist() == [2, -100, -100, -100]
    assert row["document_ids"].tolist() == [0, -1, -1, -1] and dropped == 0


@pytest.mark.parametrize("flags, message", [
    ({"teacher_model": ""}, "set --gkd.teacher_model"),
    ({"beta": -0.1}, r"--gkd.beta must be in \[0, 1\]"),
    ({"lmbda": 1.5}, r"--gkd.lmbda is the share of on-policy microbatches, in \[0, 1\]"),
    ({"seq_kd": True}, "--gkd.seq_kd .* takes a whole teacher .* or --generator.kind vllm"),
    ({"teacher_dtype": "bfloat16"}, "--gkd.teacher_dtype bfloat16 takes a whole teacher"),
])
def test_gkd_flags_out_of_range_are_refused(flags, message):
    from titan.rl.gkd import GKDSection

    with pytest.raises(ValueError, match=message):
        GKDSection(**{"teacher_model": "teacher", **flags}).check()


def test_a_sharded_teacher_samples_through_vllm():
    """--gkd.seq_kd with a sharded teacher (the default layout) is refused with the native
    generator, which samples a whole copy, and taken with vLLM, whose own engine samples."""
    from titan.rl.gkd import GKDSection

    section = GKDSection(teacher_model="teacher", seq_kd=True)
    with pytest.raises(ValueError, match="takes a whole teacher"):
        section.check("native")
    section.check("vllm")


def test_the_compiled_loss_equals_the_eager_one():
    """--compile.components loss: the summed divergence under torch.compile equals the eager one
    in value and gradient (chunks run the same compiled function on fewer rows)."""
    student = _logits(2, 6, 16, seed=8).float().requires_grad_()
    teacher = _logits(2, 6, 16, seed=9).float()
    labels = torch.tensor([[-100, 1, 2, 3, -100, 4], [5, 6, -100, 7, 8, 9]])
    eager = gkd_loss_sum(student, teacher, labels, beta=0.3)
    (eager_grad,) = torch.autograd.grad(eager, student)
    compiled = gkd_loss_sum(student, teacher, labels, beta=0.3, compiled=True)
    (compiled_grad,) = torch.autograd.grad(compiled, student)
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-7)


def test_the_vocab_parallel_loss_equals_the_whole_one_and_its_gradient(tmp_path):
    """Under tensor parallel with loss parallel the divergence is taken from each rank's
    vocabulary columns (vocab_parallel_worker.py, 2 gloo ranks): equal to the loss on the
    whole logits and so is its gradient (float64 logits), for beta 0 / 0.5 / 1, in chunks or not, with the
    teacher's columns sharded as the student's or sliced from a whole teacher of another
    (padded) vocabulary; padding columns past the tokenizer's ids and a token the teacher
    rules out (beta below 1) add nothing."""
    from launching import launch  # the repository's tests/ (root conftest.py)

    worker = Path(__file__).with_name("vocab_parallel_worker.py")
    out = tmp_path / "results.pt"
    launch(2, [str(worker), str(out)], tmp_path / "launch.log", timeout=300, torchrun=False)
    results = torch.load(out)
    assert len(results) == 12
    for case, (loss, want, grad, want_grad) in results.items():
        assert torch.isfinite(want) and want > 0, case
        # In float64 (the loss keeps it): the same up to float64 summation order.
        torch.testing.assert_close(loss, want, rtol=1e-12, atol=0, msg=str(case))
        torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-13, msg=str(case))
        assert grad[..., 10:].abs().max() == 0, case  # no gradient into the padding columns


def test_a_sharded_teacher_keeps_its_vocabulary_shards_only_where_they_line_up():
    """Under TP with loss parallel a sharded teacher hands over this rank's columns when its
    padded vocabulary is the student's and splits evenly; otherwise its logits are gathered."""
    from types import SimpleNamespace

    from titan.rl.distill_teacher import WholeTeacher, keeps_vocab_shards

    def par(tp: int, loss_parallel: bool = True):
        return SimpleNamespace(tensor_parallel_degree=tp, enable_loss_parallel=loss_parallel)

    assert keeps_vocab_shards(par(2), 320, 320)
    assert not keeps_vocab_shards(par(1), 320, 320)  # no tensor parallel
    assert not keeps_vocab_shards(par(2, loss_parallel=False), 320, 320)  # the student's are whole too
    assert not keeps_vocab_shards(par(2), 384, 320)  # another vocabulary: other columns per rank
    assert not keeps_vocab_shards(par(3), 320, 320)  # uneven shards
    assert WholeTeacher.vocab_shards is False
