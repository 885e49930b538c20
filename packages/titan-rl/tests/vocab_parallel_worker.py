"""The multi-rank half of test_gkd.py's vocab-parallel loss test (forked with torchrun's worker
environment, gloo)::

    python -m torch.distributed.run --nproc_per_node 2 vocab_parallel_worker.py OUT

Every rank draws the same student and teacher logits, shards the student's over a 1-D mesh of
the ranks along the vocabulary (as tensor parallel with loss parallel hands them to the loss),
and computes ``vocab_parallel_gkd_loss_sum`` and its gradient; rank 0 writes, per case, that
loss and the gathered gradient beside ``gkd_loss_sum``'s on the whole tensors to OUT (torch.save).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

# [B, S, V] = [2, 5, 12] over 2 ranks (6 columns each); the tokenizer's 10 ids are compared.
BATCH, SEQ, VOCAB, IDS = 2, 5, 12, 10


def _inputs(teacher_vocab: int, rule_out: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Student and teacher logits (spread: far-apart distributions) and labels with ignored
    positions; ``rule_out``: the teacher gives one token no mass (a reverse KL would be infinite)."""
    generator = torch.Generator().manual_seed(0)
    # float64: the two computations agree to rounding far below any difference of method.
    student = torch.randn(BATCH, SEQ, VOCAB, generator=generator, dtype=torch.float64) * 3
    teacher = torch.randn(BATCH, SEQ, teacher_vocab, generator=generator, dtype=torch.float64) * 3
    if rule_out:
        teacher[0, 1, 3] = -torch.inf
    labels = torch.randint(0, IDS, (BATCH, SEQ), generator=generator)
    labels[0, 0] = labels[1, 4] = -100
    return student, teacher, labels


def main(out: str) -> None:
    """Every case's (sharded loss, plain loss, sharded gradient, plain gradient)."""
    from titan.rl.distill_loss import (
        gkd_loss_sum,
        vocab_parallel_gkd_loss_sum,
        vocab_parallel_logits,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    # Teacher sharded as the student (same vocabulary), or whole with a vocabulary of its own.
    for teacher_layout, teacher_vocab in (("sharded", VOCAB), ("whole", 11)):
        for beta in (0.0, 0.5, 1.0):
            for chunk_tokens in (0, 3):
                student, teacher, labels = _inputs(teacher_vocab, rule_out=beta < 1)
                sharded = distribute_tensor(student, mesh, [Shard(2)]).requires_grad_()
                assert vocab_parallel_logits(sharded)
                teacher_in = (distribute_tensor(teacher, mesh, [Shard(2)]).to_local() if teacher_layout == "sharded"
                              else teacher)
                loss = vocab_parallel_gkd_loss_sum(sharded, teacher_in, labels, beta=beta, vocab_size=IDS,
                                                   teacher_sharded=teacher_layout == "sharded",
                                                   chunk_tokens=chunk_tokens)
                loss.backward()
                plain = student.clone().requires_grad_()
                want = gkd_loss_sum(plain, teacher, labels, beta=beta, vocab_size=IDS, chunk_tokens=chunk_tokens)
                want.backward()
                results[(teacher_layout, beta, chunk_tokens)] = (loss.detach(), want.detach(),
                                                                 sharded.grad.full_tensor(), plain.grad)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()  # rank 1 must not tear the group down while rank 0 still writes (it aborted 1 run in 10)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
