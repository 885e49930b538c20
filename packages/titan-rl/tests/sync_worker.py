"""Helpers and the multi-rank entry point of the weight-sync tests (the test forks its ranks
with torchrun's worker environment; torchrun itself runs it the same way)::

    python -m torch.distributed.run --nproc_per_node N sync_worker.py MODE OUT

MODE "colocated": every rank is a trainer rank of an FSDP `TrainingEngine` with its own
`NativeGenerator`; two syncs (before and after an optimizer step).
MODE "split": the same over a job split by `titan.dist.split_job`: the first half's
`TrainingEngine` (FSDP over its part's own default group), the second half's generators.
MODE "disaggregated": the first half of the ranks train (a model sharded with FSDP2 over the
trainer ranks only), the second half generate; two syncs through `WeightBroadcaster`.

Each rank writes OUT/rank<R>.pt: the trainer's full weights (trainer ranks) or the generator's
weights (generator ranks) after each sync, the versions, and the sync times.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, SEQ, SEED = 128, 32, 3


def llama3_spec():
    """The llama3 family as a `ModelSpec` (what the recipes layer would hand the engine)."""
    from titan.models.llama3 import LLAMA3_FLAVORS, Llama3StateDictAdapter, build_llama3
    from titan.train.model_spec import ModelSpec

    return ModelSpec(name="llama3", flavors=LLAMA3_FLAVORS, build=build_llama3,
                     adapter=lambda model: Llama3StateDictAdapter(model.args))


def qwen3_moe_spec():
    """The qwen3_moe family as a `ModelSpec` (MoE layers with a load-balancing bias buffer)."""
    from titan.models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeStateDictAdapter, build_qwen3_moe
    from titan.train.model_spec import ModelSpec

    return ModelSpec(name="qwen3_moe", flavors=QWEN3_MOE_FLAVORS, build=build_qwen3_moe,
                     adapter=lambda model: Qwen3MoeStateDictAdapter(model.args))


def make_engine(dump_folder: str, *, flavor: str = "debugmodel_tiny", spec=None, overrides=None, adam_eps: float = 1e-8,
                weight_decay: float = 0.1):
    """A TrainingEngine over every rank of the job (FSDP), fp32, seed SEED (llama3 unless
    `spec` says otherwise; `overrides` are the family's build overrides)."""
    from titan.ckpt import CheckpointConfig
    from titan.dist import ActivationCheckpointConfig, CompileConfig, ParallelismConfig
    from titan.train.engine import TrainingEngine
    from titan.train.lr_scheduler import LRSchedulerConfig
    from titan.train.optimizer import OptimizerConfig

    return TrainingEngine(
        model_spec=spec or llama3_spec(), flavor=flavor, model_overrides=overrides, vocab_size=VOCAB, seq_len=SEQ, steps=10,
        parallelism=ParallelismConfig(), activation_checkpoint=ActivationCheckpointConfig(),
        compile=CompileConfig(), optimizer=OptimizerConfig(lr=1e-2, eps=adam_eps, weight_decay=weight_decay),
        lr_scheduler=LRSchedulerConfig(warmup_steps=1), checkpoint=CheckpointConfig(),
        dump_folder=dump_folder, local_batch_size=2, seed=SEED,
    )


def make_generator(flavor: str = "debugmodel_tiny", seed: int = 99, *, spec=None, overrides=None):
    """A native generator with its own (differently initialized) copy of the model."""
    from titan.rl.generate import NativeGenerator

    return NativeGenerator.from_model_spec(
        spec or llama3_spec(), flavor, seed=seed,
        overrides={**(overrides or {}), "vocab_size": VOCAB, "max_seq_len": SEQ},
        device="cpu", max_batch_size=8,
    )


def train_step(engine, rows: int = 2) -> None:
    """One optimizer step of next-token loss on random tokens (changes every weight)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    def loss(logits, b):
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        return F.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten(), reduction="sum")

    engine.forward_backward(batch, loss, global_token_count=batch["labels"].numel())
    engine.optimizer_step()


def colocated(out: Path) -> None:
    from titan.rl.weight_sync import sync_colocated

    engine = make_engine(str(out))
    generator = make_generator()
    record = {"versions": [], "trainer": [], "generator": [], "seconds": []}
    for version in (1, 2):
        stats = sync_colocated(engine, generator, version=version)
        record["versions"].append(generator.version)
        record["seconds"].append(stats.seconds)
        record["trainer"].append({k: v.clone() for k, v in engine.full_state_dict()})
        record["generator"].append({k: v.clone() for k, v in generator.named_weights()})
        train_step(engine)
    torch.save(record, out / f"rank{dist.get_rank()}.pt")
    engine.close()


def disaggregated(out: Path) -> None:
    from datetime import timedelta

    from titan.rl.weight_sync import WeightBroadcaster
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    trainers, generators = list(range(world // 2)), list(range(world // 2, world))
    # Trainer sub-group for FSDP (new_group is collective over the whole job).
    trainer_group = dist.new_group(trainers, timeout=timedelta(seconds=60))
    sync = WeightBroadcaster(trainer_ranks=trainers, generator_ranks=generators, bucket_mb=0.05,
                             timeout_s=60)
    record = {"versions": [], "weights": [], "seconds": []}
    if rank in trainers:
        from titan.models.llama3 import build_llama3

        model = build_llama3("debugmodel_tiny", vocab_size=VOCAB, max_seq_len=SEQ)
        model.init_weights(seed=SEED)
        mesh = DeviceMesh.from_group(trainer_group, "cpu")
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

        def full_weights():
            for name, p in model.named_parameters():
                yield name, p.full_tensor() if hasattr(p, "full_tensor") else p.detach()

        for version in (1, 2):
            stats = sync.send(full_weights(), version=version)
            record["versions"].append(version)
            record["seconds"].append(stats.seconds)
            record["weights"].append({k: v.clone() for k, v in full_weights()})
            tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(rank))
            model(tokens).float().logsumexp(-1).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    else:
        generator = make_generator(seed=100 + rank)
        for _ in (1, 2):
            stats = sync.receive(generator)
            record["versions"].append(generator.version)
            record["seconds"].append(stats.seconds)
            record["weights"].append({k: v.clone() for k, v in generator.named_weights()})
    torch.save(record, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def split(out: Path) -> None:
    """A job split by `split_job`: the first half trains a `TrainingEngine` (FSDP over its own
    part's default group), the second half generates; two syncs over the bridge."""
    from titan.dist import split_job
    from titan.rl.weight_sync import WeightBroadcaster

    world = int(__import__("os").environ["WORLD_SIZE"])
    job = split_job(world // 2, timeout_s=120)
    sync = WeightBroadcaster.over_bridge(job.bridge, is_trainer=job.part == 0, bucket_mb=0.05)
    record = {"versions": [], "weights": [], "seconds": [], "group_size": dist.get_world_size()}
    if job.part == 0:
        engine = make_engine(str(out))
        record["engine_world"] = engine.dist_env.world_size
        for version in (1, 2):
            stats = sync.send(engine, version=version)
            record["versions"].append(version)
            record["seconds"].append(stats.seconds)
            record["weights"].append({k: v.clone() for k, v in engine.full_state_dict()})
            train_step(engine)
        engine.close()
    else:
        from titan.dist import destroy_distributed

        generator = make_generator(seed=100 + job.rank)
        for _ in (1, 2):
            stats = sync.receive(generator)
            record["versions"].append(generator.version)
            record["seconds"].append(stats.seconds)
            record["weights"].append({k: v.clone() for k, v in generator.named_weights()})
        destroy_distributed()
    torch.save(record, out / f"rank{job.global_rank}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    {"colocated": colocated, "disaggregated": disaggregated, "split": split}[mode](out)
