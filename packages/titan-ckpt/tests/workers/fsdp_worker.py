"""One rank of a FSDP (fully_shard) run of TinyLM that saves or loads a checkpoint.

Launched by test_fsdp.py on two ranks with torchrun's worker environment (forked from the
suite's preloaded server; ``torchrun --nproc-per-node=2 fsdp_worker.py ...`` runs it alike); writes what the test compares into --out:
  ref.pt       full (unsharded) model and flattened optimizer state right after save/load
  losses.json  the global mean loss of each step after that point
"""

import argparse
import json
import os
import sys
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from ckpt_testlib import CountingLoader, NamesAsIs, TinyLM, lm_loss, make_optimizer  # noqa: E402
from titan.ckpt import CheckpointConfig, CheckpointManager, OptimizerWrapper, TrainState  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


def full_state(model, opt) -> dict:
    """Unsharded model and optimizer state on rank 0 (collective)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True,
                            flatten_optimizer_state_dict=True)
    state = {"model": get_model_state_dict(model, options=opts),
             "optim": get_optimizer_state_dict(model, opt, options=opts)}
    # Copies: some entries (the optimizer's step counters) alias live tensors.
    return {part: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}
            for part, sd in state.items()}


def train_step(model, opt, sched, loader) -> float:
    loss = lm_loss(model, loader.next())
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return mean.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["save", "load"], required=True)
    parser.add_argument("--dump", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--more", type=int, default=2)
    parser.add_argument("--async-mode", default="disabled")
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0 if args.mode == "save" else 100)  # a load must not rely on the seed
    model = TinyLM(dropout=0.0)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optimizer(model)
    loader, train_state = CountingLoader(seed=0, dp_rank=rank), TrainState()
    cfg = CheckpointConfig(enable=True, interval=args.steps, async_mode=args.async_mode,
                           last_save_in_hf=True)
    manager = CheckpointManager(
        cfg, dump_folder=args.dump, model_parts=[model],
        optimizers=OptimizerWrapper(model, opt), hf_adapter=NamesAsIs(),
        states={"lr_scheduler": sched, "dataloader": loader, "train_state": train_state},
        collective_timeout=timedelta(seconds=60),
    )
    if args.mode == "save":
        for step in range(1, args.steps + 1):
            train_step(model, opt, sched, loader)
            train_state.step = step
            manager.maybe_save(step)
        manager.wait()
    else:
        assert manager.load() == args.steps
        assert train_state.step == args.steps
        if rank == 0:
            assert loader.pos == args.steps
        else:  # a 1-process checkpoint holds no state for this rank: it starts fresh
            assert loader.pos == 0
            loader.pos = args.steps
    ref = full_state(model, opt)
    losses = [train_step(model, opt, sched, loader) for _ in range(args.more)]
    if args.mode == "save":
        final = args.steps + args.more
        manager.maybe_save(final, last_step=True)  # the Hugging Face export
        ref["final_model"] = full_state(model, opt)["model"]
    manager.close()
    if rank == 0:
        torch.save(ref, os.path.join(args.out, "ref.pt"))
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
