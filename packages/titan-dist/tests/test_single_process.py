"""World size 1: no process group, activation checkpointing and compile per block."""

from collections import Counter

import pytest
import titan_dist_testlib as lib
import torch
from titan.dist import (
    ActivationCheckpointConfig,
    CompileConfig,
    ParallelDims,
    ParallelismConfig,
    clip_grad_norm_,
    init_distributed,
    parallelize,
    reduce_max,
    reduce_mean,
)
from torch.utils._python_dispatch import TorchDispatchMode


def _train(ac: ActivationCheckpointConfig, compile_cfg: CompileConfig, steps: int = 3):
    model = lib.make_model()
    dims = ParallelDims.from_config(ParallelismConfig(), world_size=1)
    parallelize(model, dims, dims.build_mesh("cpu"), parallelism=ParallelismConfig(),
                activation_checkpoint=ac, compile=compile_cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for inputs, labels in lib.make_batches(steps):
        loss = lib.loss_fn(model(inputs), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, lib.full_state(model)


def _assert_matches_reference(losses, state):
    ref_losses, ref_state = lib.reference_run()
    lib.assert_close_rel(losses, ref_losses, what="losses")
    assert state.keys() == ref_state.keys()  # AC and compile keep parameter names
    for k in ref_state:
        lib.assert_close_rel(state[k], ref_state[k], what=k)


def test_init_distributed_single(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    env = init_distributed()
    assert (env.rank, env.world_size) == (0, 1) and env.is_main
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("ac", [
    ActivationCheckpointConfig(mode="full"),
    ActivationCheckpointConfig(mode="selective", selective_layer_every=2),
    ActivationCheckpointConfig(mode="selective", selective_op=True),
])
def test_activation_checkpointing_matches(ac):
    _assert_matches_reference(*_train(ac, CompileConfig()))


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _op_counts(ac) -> Counter:
    model = lib.make_model()
    parallelize(model, ParallelDims(1, 1, 1, 1, 1, 1, 1), None, parallelism=ParallelismConfig(),
                activation_checkpoint=ac, compile=CompileConfig())
    with _OpCounter() as counter:
        model(lib.make_batches(1)[0][0]).sum().backward()
    return counter.counts


def test_selective_op_keeps_matmuls_and_recomputes_the_rest():
    """Per-op AC runs no extra matmul in backward (kept) but re-runs the activations."""
    none = _op_counts(ActivationCheckpointConfig())
    full = _op_counts(ActivationCheckpointConfig(mode="full"))
    per_op = _op_counts(ActivationCheckpointConfig(mode="selective", selective_op=True))
    assert per_op["mm"] == none["mm"] < full["mm"]
    assert none["silu"] < per_op["silu"] == full["silu"]


def test_compile_matches():
    _assert_matches_reference(*_train(ActivationCheckpointConfig(mode="selective", selective_op=True),
                                      CompileConfig(enable=True, backend="aot_eager")))


def test_clip_grad_norm_matches_torch():
    a, b = lib.make_model(), lib.make_model()
    inputs, labels = lib.make_batches(1)[0]
    for m in (a, b):
        lib.loss_fn(m(inputs), labels).backward()
    ours = clip_grad_norm_(a.parameters(), 0.1)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1)
    lib.assert_close_rel(ours, theirs)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        lib.assert_close_rel(pa.grad, pb.grad)


def test_reductions_are_identity_without_mesh():
    t = torch.tensor(3.0)
    assert reduce_mean(t, None) is t and reduce_max(t, None) is t
