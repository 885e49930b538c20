"""Document masking composes with FSDP, TP (+ sequence parallel) and context parallel.

Every case runs in one pair of gloo processes (this file is also the worker: `python <this
file> <rank> <world> <store> <out_dir>`, rendezvous through a FileStore, the cases one after
another in one process group: starting the processes costs more than the cases). Each case builds the
tiny Llama, parallelizes it with `titan.dist`, runs one forward/backward of a packed batch
with `positions` and `document_ids`, and compares logits and gradients with the same model
run whole in one process. The model-level test (packages/titan-models) ties that single
process to running each document alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

TINY = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32)
SEQ, BATCH = 16, 2
ROW_DOCS = ((5, 7, 4), (3, 9, 4))  # document lengths of each packed row
CASES = {
    "fsdp2": dict(data_parallel_shard_degree=2),
    "tp2": dict(tensor_parallel_degree=2, enable_loss_parallel=False),  # SP on (default)
    "cp2": dict(context_parallel_degree=2),
    # Every rank hands positions/document_ids to `schedule.step` as keyword arguments: torch's
    # schedules split them into microbatches and pass them to each stage's forward.
    "pp2": dict(pipeline_parallel_degree=2, pipeline_parallel_schedule="GPipe",
                pipeline_parallel_microbatch_size=1),
}
GRAD_NAMES = ("tok_embeddings.weight", "layers.0.attention.wq.weight",
              "layers.1.attention.wk.weight", "output.weight")


def packed_batch() -> dict[str, torch.Tensor]:
    """The packed [B, S] batch: tokens, per-document positions and document ids."""
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ), generator=g)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROW_DOCS])
    ids = torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)])
                       for row in ROW_DOCS])
    weights = torch.randn(BATCH, SEQ, TINY["vocab_size"], generator=g)  # a fixed loss
    return {"input_ids": tokens, "positions": positions, "document_ids": ids,
            "loss_weights": weights}


def build_model():
    """The tiny Llama, built on meta and initialized from a fixed seed."""
    from titan.models.llama3 import build_llama3

    with torch.device("meta"):
        model = build_llama3("debugmodel", **TINY)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def forward_backward(model, batch):
    """Logits and the gradients of sum(logits * loss_weights) for the named parameters."""
    from torch.distributed.tensor import DTensor

    logits = model(batch["input_ids"], batch["positions"], batch["document_ids"])
    (logits * batch["loss_weights"]).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        if name in GRAD_NAMES:
            g = p.grad
            grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return logits.detach(), grads


def pipeline_forward_backward(dims, pcfg, batch):
    """One pipelined forward/backward of the whole batch (2 microbatches); the logits come
    back on the last stage only, each stage has the gradients of its own blocks."""
    from titan.dist import ActivationCheckpointConfig, CompileConfig, build_pipeline
    from torch.distributed.tensor import DTensor

    schedule, parts, first, last = build_pipeline(
        build_model(), dims, parallelism=pcfg, activation_checkpoint=ActivationCheckpointConfig(),
        compile=CompileConfig(), loss_fn=lambda out, weights: (out * weights).sum(),
        local_batch_size=BATCH, device=torch.device("cpu"), scale_grads=False)
    kwargs = {"positions": batch["positions"], "document_ids": batch["document_ids"]}
    if last:
        kwargs.update(target=batch["loss_weights"], losses=[])
    args = (batch["input_ids"],) if first else ()
    out = schedule.step(*args, **kwargs)
    grads = {}
    for part in parts:
        for name, p in part.named_parameters():
            if name in GRAD_NAMES:
                g = p.grad
                grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return (out.detach() if last else None), grads


def run_case(case: str, world: int, out_path: str) -> None:
    """One rank of `case`: reference and parallel runs; saves both for the test."""
    from titan.dist import (
        ActivationCheckpointConfig,
        CompileConfig,
        ParallelDims,
        ParallelismConfig,
        parallelize,
        shard_batch_dict_for_context_parallel,
    )
    from titan.dist.context_parallel import ContextParallelAttention

    batch = packed_batch()
    ref_logits, ref_grads = forward_backward(build_model(), batch)
    pcfg = ParallelismConfig(**CASES[case])
    dims = ParallelDims.from_config(pcfg, world)
    root = dims.build_mesh("cpu")
    if dims.pp_enabled:
        logits, grads = pipeline_forward_backward(dims, pcfg, batch)
        torch.save({"ref_logits": ref_logits, "ref_grads": ref_grads, "logits": logits,
                    "grads": grads}, out_path)
        return
    model = parallelize(build_model(), dims, root, parallelism=pcfg,
                        activation_checkpoint=ActivationCheckpointConfig(),
                        compile=CompileConfig())
    local = batch
    if dims.dp_shard > 1:  # this rank's rows
        per = BATCH // dims.dp_shard
        local = {k: v[dims.dp_rank * per:(dims.dp_rank + 1) * per] for k, v in batch.items()}
    cp_mesh = dims.mesh("cp") if dims.cp_enabled else None
    local = shard_batch_dict_for_context_parallel(cp_mesh, local)
    logits, grads = forward_backward(model, local)
    used_cp = any(isinstance(m, ContextParallelAttention) for m in model.modules())
    torch.save({"ref_logits": ref_logits, "ref_grads": ref_grads, "logits": logits,
                "grads": grads, "local": local, "used_cp": used_cp,
                "dp_shard": dims.dp_shard, "dp_rank": dims.dp_rank}, out_path)


def worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    """One rank: every case in turn, each saved to ``<out_dir>/<case>.<rank>.pt``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        for case in CASES:
            run_case(case, world, os.path.join(out_dir, f"{case}.{rank}.pt"))
            dist.barrier()  # every rank done with this case's meshes before the next
    finally:
        dist.destroy_process_group()


def _run_cases(folder: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), "2", str(folder / "store"), str(folder)],
                              env=env, stderr=subprocess.PIPE, text=True) for r in range(2)]
    errors = [p.communicate(timeout=240)[1] for p in procs]
    for p, err in zip(procs, errors, strict=True):
        assert p.returncode == 0, err[-4000:]


@pytest.fixture(scope="module")
def case_results(build_once):
    """case -> each rank's saved results, every case from one pair of processes per session."""
    folder = build_once("document_mask_cases", _run_cases)
    return lambda case: [torch.load(folder / f"{case}.{r}.pt", weights_only=False) for r in range(2)]


def _shard_like_cp(t: torch.Tensor, rank: int) -> torch.Tensor:
    from titan.dist.context_parallel import shard_sequence

    return shard_sequence(t, rank, 2, seq_dim=1)


@pytest.mark.slow
@pytest.mark.xdist_group("document_mask_cases")  # one worker launches and reads (tests/conftest.py)
@pytest.mark.parametrize("case", list(CASES))
def test_document_mask_under_parallelism_equals_one_process(case, case_results):
    results = case_results(case)
    if case == "pp2":
        torch.testing.assert_close(results[1]["logits"], results[0]["ref_logits"],
                                   atol=1e-5, rtol=1e-5)
        assert results[0]["logits"] is None
        assert sorted(results[0]["grads"]) == ["layers.0.attention.wq.weight", "tok_embeddings.weight"]
        for r in results:
            for name, g in r["grads"].items():
                torch.testing.assert_close(g, r["ref_grads"][name], atol=1e-4, rtol=1e-4)
        return
    for rank, r in enumerate(results):
        ref = r["ref_logits"]
        if case == "fsdp2":
            ref = ref[rank:rank + 1]  # one row per data-parallel rank
        if case == "cp2":
            assert r["used_cp"]
            ref = _shard_like_cp(ref, rank)
            # The dict was sharded consistently: ids and per-document positions alike.
            batch = packed_batch()
            for key in ("input_ids", "positions", "document_ids"):
                assert torch.equal(r["local"][key], _shard_like_cp(batch[key], rank)), key
        torch.testing.assert_close(r["logits"], ref, atol=1e-5, rtol=1e-5)
        # FSDP averages gradients over its 2 ranks (each ran half of the tokens of the
        # reference loss); TP ranks each ran every token.
        scale = 1.0 if case == "tp2" else 0.5
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, scale * r["ref_grads"][name], atol=1e-4, rtol=1e-4,
                                       msg=lambda m, n=name: f"{case} grad {n}: {m}")


def test_masked_reference_differs_from_unmasked():
    # Guards the comparison above: on this batch, masking changes the logits.
    model, batch = build_model(), packed_batch()
    masked = model(batch["input_ids"], batch["positions"], batch["document_ids"])
    plain = model(batch["input_ids"], batch["positions"])
    assert not torch.allclose(masked, plain, atol=1e-3)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
