"""Validation of the config sections and of ParallelDims (no process group needed)."""

import pytest
from titan.dist import ActivationCheckpointConfig, CompileConfig, ParallelDims, ParallelismConfig


def test_defaults_are_valid():
    ParallelismConfig()
    ActivationCheckpointConfig()
    CompileConfig()


@pytest.mark.parametrize("kwargs, flag", [
    ({"tensor_parallel_degree": 0}, "tensor_parallel_degree"),
    ({"data_parallel_shard_degree": -2}, "data_parallel_shard_degree"),
    ({"data_parallel_replicate_degree": 0}, "data_parallel_replicate_degree"),
    ({"pipeline_parallel_schedule": "2F2B"}, "pipeline_parallel_schedule"),
    ({"fsdp_reshard_after_forward": "sometimes"}, "fsdp_reshard_after_forward"),
    ({"pipeline_parallel_microbatch_size": 0}, "pipeline_parallel_microbatch_size"),
    ({"pipeline_parallel_layers_per_stage": 0}, "pipeline_parallel_layers_per_stage"),
    ({"pipeline_parallel_layers_per_stage": 1, "pipeline_parallel_split_points": ["layers.1"]},
     "pipeline_parallel_split_points"),
    ({"context_parallel_rotate_method": "teleport"}, "context_parallel_rotate_method"),
])
def test_parallelism_rejects(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        ParallelismConfig(**kwargs)


def test_ac_and_compile_reject():
    with pytest.raises(ValueError, match="activation_checkpoint.mode"):
        ActivationCheckpointConfig(mode="partial")
    with pytest.raises(ValueError, match="selective_layer_every"):
        ActivationCheckpointConfig(mode="selective", selective_layer_every=0)
    with pytest.raises(ValueError, match="compile.backend"):
        CompileConfig(backend="")


def test_dims_resolve_rest_and_properties():
    d = ParallelDims.from_config(
        ParallelismConfig(data_parallel_replicate_degree=2, tensor_parallel_degree=2,
                          pipeline_parallel_degree=2), world_size=16)
    assert d.dp_shard == 2 and d.dp_world_size == 4 and d.non_data_parallel_size == 4
    assert d.fsdp_enabled and d.tp_enabled and d.pp_enabled and not d.cp_enabled
    # rank 13 = pp 1, dp_replicate 1, dp_shard 0, cp 0, tp 1 -> batch index 1*2 + 0
    d.rank = 13
    assert d.coords == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "cp": 0, "tp": 1}
    assert d.dp_rank == 2


def test_dims_product_error_names_every_degree():
    with pytest.raises(ValueError) as err:
        ParallelDims(dp_replicate=2, dp_shard=2, cp=1, tp=2, pp=1, ep=1, world_size=4)
    for name in ("data_parallel_replicate_degree=2", "data_parallel_shard_degree=2",
                 "context_parallel_degree=1", "tensor_parallel_degree=2",
                 "pipeline_parallel_degree=1", "world size is 4"):
        assert name in str(err.value)


def test_dims_rest_does_not_divide():
    with pytest.raises(ValueError, match="not divisible"):
        ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=3, pp=1, ep=1, world_size=4)


def test_dims_ep_must_divide_dp_shard_cp():
    with pytest.raises(ValueError, match="expert_parallel_degree=3"):
        ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=1, pp=1, ep=3, world_size=4)


def test_world_size_one_has_no_mesh():
    d = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    assert d.dp_shard == 1 and not d.dp_enabled and d.build_mesh("cpu") is None
    assert d.mesh("dp") is None and d.dp_rank == 0


@pytest.mark.parametrize("dims, kwargs, needle", [
    ({"tp": 4, "dp_shard": 1}, {"tensor_parallel_divisible": {"n_kv_heads": 2}}, "n_kv_heads=2"),
    ({"tp": 4, "dp_shard": 1}, {"tensor_parallel_divisible": {"n_kv_heads": 4, "ffn_hidden_dim": 66}},
     "ffn_hidden_dim=66"),
    ({"ep": 4, "dp_shard": 4}, {"expert_parallel_divisible": {"n_routed_experts": 6}}, "n_routed_experts=6"),
    ({"pp": 4, "dp_shard": 1}, {"n_layers": 2}, "exceeds the model's 2 layers"),
    ({"cp": 2, "dp_shard": 2}, {"seq_len": 18}, "seq_len=18"),
    ({"dp_shard": 4}, {"global_batch_size": 10, "local_batch_size": 2}, "global_batch_size=10"),
])
def test_validate_model(dims, kwargs, needle):
    base = dict(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=4)
    d = ParallelDims(**{**base, **dims})
    args = dict(n_layers=8, seq_len=64, global_batch_size=8, local_batch_size=1,
                tensor_parallel_divisible={"n_kv_heads": 8, "ffn_hidden_dim": 64},
                expert_parallel_divisible={"n_routed_experts": 8})
    with pytest.raises(ValueError, match=needle):
        d.validate_model(**{**args, **kwargs})
    d.validate_model(**args)  # the same sizes without the bad value pass


def test_compile_components_name_what_is_compiled():
    """`--compile.components` (torchtitan's flag): model and loss by default, either alone; an
    unknown, repeated or empty list is refused by flag name."""
    both = CompileConfig(enable=True)
    assert both.compiles_model and both.compiles_loss
    loss_only = CompileConfig(enable=True, components=["loss"])
    assert loss_only.compiles_loss and not loss_only.compiles_model
    assert not CompileConfig(components=["model"]).compiles_model  # nothing without enable
    for bad in (["optimizer"], ["loss", "loss"], []):
        with pytest.raises(ValueError, match="--compile.components"):
            CompileConfig(enable=True, components=bad)
