"""Checkpoints torchtitan wrote: their weights warm-start a titan run
(`--checkpoint.initial_load_path`), and a checkpoint folder holding them is never taken over.

The torchtitan checkpoints here are written the way torchtitan's CheckpointManager writes them
(one DCP folder per `step-<N>`, the model's weights at the top level under torchtitan's module
names, next to its `optimizer`, `lr_scheduler`, `dataloader` and `train_state` states), under
the names of both of its releases' generations: before 0.3 and 0.3 (which names the output
`lm_head`, puts `wq`/`wk`/`wv` under `qkv_linear` and its routed experts under
`routed_experts.inner_experts` with their axes in the name). Checked once against a real
torchtitan 0.3.0 seed checkpoint of its Llama 3 debug model: titan's logits after loading it
equal torchtitan's model's to 1.2e-6 (fp32; the closing note of the session gives the run).
"""

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from forked_cli import run_titan
from launching import launch_train_runs
from titan.ckpt import CheckpointConfig, CheckpointError, CheckpointManager
from titan.models.deepseek_v3 import DeepseekV3StateDictAdapter, build_deepseek_v3
from titan.models.llama3 import Llama3StateDictAdapter, build_llama3
from titan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter
from titan.models.qwen3_moe import Qwen3MoeStateDictAdapter, build_qwen3_moe

BUILDERS = {
    "llama3": lambda: build_llama3("debugmodel_tiny"),
    "qwen3_moe": lambda: build_qwen3_moe("debugmodel", dim=64, n_layers=2),
    "deepseek_v3": lambda: build_deepseek_v3("debugmodel", n_layers=2),
}
ADAPTERS = {"llama3": Llama3StateDictAdapter, "qwen3_moe": Qwen3MoeStateDictAdapter,
            "deepseek_v3": DeepseekV3StateDictAdapter}
HALF_SPLIT_FAMILIES = ("qwen3", "qwen3_moe")
"""torchtitan's Qwen3 models rotate the two halves of each head (as the Hub does), so their
checkpoints hold the q/k rows and q/k norm weights in that layout; its Llama 3 and DeepSeek-V3
rotate interleaved pairs, as titan does."""
_EXPERT_AXES = {"w1": "w1_EFD", "w2": "w2_EDF", "w3": "w3_EFD"}


def torchtitan_name(fqn: str, release: str, family: str) -> str:
    """The name torchtitan's `release` ("0.2" or "0.3") gives the weight titan calls `fqn`
    (written out here from torchtitan's model definitions, independently of titan.ckpt)."""
    parts = fqn.split(".")
    if len(parts) > 3 and parts[0] == "layers" and parts[2] == "feed_forward" and parts[3] in (
            "experts", "router", "shared_experts", "expert_bias"):
        parts[2] = "moe"
        if release == "0.3" and parts[3] == "experts":
            parts[3:] = ["routed_experts", "inner_experts", _EXPERT_AXES[parts[4]]]
        if release == "0.3" and parts[3] == "expert_bias":
            parts[3] = "expert_bias_E"
    if release == "0.3" and family != "deepseek_v3" and parts[2:3] == ["attention"] and parts[3] in ("wq", "wk", "wv"):
        parts[3:3] = ["qkv_linear"]
    if release == "0.3" and fqn == "output.weight":
        return "lm_head.weight"
    return ".".join(parts)


def torchtitan_layout(fqn: str, value: torch.Tensor, family: str, head_dim: int) -> torch.Tensor:
    """`value` (titan's layout) as torchtitan's `family` stores it: for Qwen3, each head's
    channels (pair i: 2i, 2i+1) regrouped into two halves (i, head_dim/2 + i)."""
    parts = fqn.split(".")
    rotated = parts[2:3] == ["attention"] and parts[3] in ("wq", "wk", "q_norm", "k_norm")
    if family not in HALF_SPLIT_FAMILIES or not rotated:
        return value
    rest = value.shape[1:]
    return value.reshape(-1, head_dim // 2, 2, *rest).transpose(1, 2).reshape(value.shape).contiguous()


def save_torchtitan_step(folder, step: int, model: torch.nn.Module, *, release: str, family: str,
                         drop: tuple[str, ...] = (), extra: dict | None = None) -> str:
    """Write `model`'s weights as torchtitan's step `step` under `folder`, in its names and
    layout (with its training states beside them, as a full torchtitan checkpoint holds)."""
    head_dim = getattr(model.args, "head_dim", 0)
    weights = {torchtitan_name(k, release, family): torchtitan_layout(k, v, family, head_dim)
               for k, v in model.state_dict().items() if k not in drop}
    states = {
        "optimizer": {"state": {"tok_embeddings.weight": {"step": torch.tensor(3.0)}}},
        "lr_scheduler": {"last_epoch": step},
        "dataloader": {"dp_rank_0": b"opaque", "world_size": 1},
        "train_state": {"step": step, "ntokens_seen": 1234},
    }
    path = os.path.join(folder, f"step-{step}")
    dcp.save({**weights, **states, **(extra or {})}, checkpoint_id=path, no_dist=True)
    return path


def load_into(model: torch.nn.Module, path: str, tmp_path, hf_adapter=None, **config) -> None:
    """`model` warm-started from `path` the way the trainer does it."""
    manager = CheckpointManager(CheckpointConfig(initial_load_path=str(path), **config),
                                dump_folder=str(tmp_path / "run"), states={}, model_parts=model,
                                hf_adapter=hf_adapter)
    try:
        assert manager.load() == 0
    finally:
        manager.close()


def _seeded(family: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = BUILDERS[family]()
    # The builders leave the grouped experts uninitialized (torch.empty: NaN in a full run,
    # and NaN never equals itself): initialize every weight from the seed.
    model.init_weights()
    with torch.no_grad():  # a bias away from zero and norms away from one, so that loading them is seen
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.randn_like(buf))
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    return model


@pytest.mark.parametrize("release", ["0.2", "0.3"])
@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_the_weights_of_a_torchtitan_checkpoint_load_into_the_same_titan_model(tmp_path, family, release):
    source, target = _seeded(family, 0), _seeded(family, 1)
    save_torchtitan_step(tmp_path / "tt", 0, _seeded(family, 2), release=release, family=family)
    save_torchtitan_step(tmp_path / "tt", 20, source, release=release, family=family)
    # The checkpoint folder: its newest step, through the family's adapter, as the trainer loads.
    load_into(target, tmp_path / "tt", tmp_path, hf_adapter=ADAPTERS[family](target.args))

    expected, loaded = source.state_dict(), target.state_dict()
    assert expected.keys() == loaded.keys()
    assert all(torch.equal(expected[k], loaded[k]) for k in expected), [
        k for k in expected if not torch.equal(expected[k], loaded[k])]
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(source(tokens), target(tokens))


def test_an_absent_balancing_bias_stays_zero_and_everything_else_loads(tmp_path):
    """torchtitan saves the bias only when its run balanced with one; none means zero bias."""
    source, target = _seeded("deepseek_v3", 0), _seeded("deepseek_v3", 1)
    biases = [k for k in source.state_dict() if k.endswith("expert_bias")]
    path = save_torchtitan_step(tmp_path / "tt", 5, source, release="0.3", family="deepseek_v3", drop=tuple(biases))
    with torch.no_grad():
        for name, buf in target.named_buffers():
            if name.endswith("expert_bias"):
                buf.zero_()
    load_into(target, path, tmp_path, hf_adapter=DeepseekV3StateDictAdapter(target.args))
    loaded = target.state_dict()
    assert all(torch.count_nonzero(loaded[k]) == 0 for k in biases)
    assert all(torch.equal(v, loaded[k]) for k, v in source.state_dict().items() if k not in biases)


def test_a_reward_model_takes_its_body_from_a_torchtitan_checkpoint(tmp_path, caplog):
    """A score head on the body of torchtitan's language model: every body weight loads, the
    [vocab, dim] output is not read (not refused as unused), and the head keeps its init."""
    source = _seeded("llama3", 0)
    path = save_torchtitan_step(tmp_path / "tt", 1, source, release="0.3", family="llama3")
    target = build_llama3("debugmodel_tiny", num_labels=1)
    target.init_weights(seed=5)
    head = target.output.weight.detach().clone()
    with caplog.at_level("INFO", logger="titan"):
        load_into(target, path, tmp_path, hf_adapter=Llama3StateDictAdapter(target.args))
    assert torch.equal(target.output.weight, head)
    body = {k: v for k, v in source.state_dict().items() if k != "output.weight"}
    assert all(torch.equal(target.state_dict()[k], v) for k, v in body.items())
    # torchtitan 0.3 names the output lm_head.weight
    assert "this model's head ['output.weight'] starts from its initialization" in caplog.text
    assert "(the checkpoint's own head, ['lm_head.weight'], is not read)" in caplog.text


def test_a_missing_weight_is_named(tmp_path):
    path = save_torchtitan_step(tmp_path / "tt", 1, _seeded("llama3", 0), release="0.3", family="llama3",
                                drop=("layers.3.feed_forward.w2.weight",))
    with pytest.raises(CheckpointError, match=r"torchtitan checkpoint\) has no weights for \['layers\.3\.feed_forward\.w2\.weight'\]"):
        load_into(_seeded("llama3", 1), path, tmp_path)


def test_a_weight_titan_has_no_place_for_is_refused_not_dropped(tmp_path):
    """E.g. DeepSeek-V3's multi-token-prediction block, which titan's model does not have."""
    path = save_torchtitan_step(tmp_path / "tt", 1, _seeded("llama3", 0), release="0.3", family="llama3",
                                extra={"mtp_layers.0.eh_proj.weight": torch.zeros(4, 4)})
    with pytest.raises(CheckpointError, match=r"no place for: \['mtp_layers\.0\.eh_proj\.weight'\]"):
        load_into(_seeded("llama3", 1), path, tmp_path)


def test_another_size_is_named_by_its_shapes(tmp_path):
    path = save_torchtitan_step(tmp_path / "tt", 1, _seeded("llama3", 0), release="0.2", family="llama3")
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attention\.wk\.weight' has shape \[32, 64\] in the checkpoint but \[128, 256\]"):
        load_into(build_llama3("debugmodel"), path, tmp_path)


def test_its_training_states_are_not_taken_for_titans(tmp_path):
    path = save_torchtitan_step(tmp_path / "tt", 1, _seeded("llama3", 0), release="0.3", family="llama3")
    with pytest.raises(CheckpointError, match="torchtitan checkpoint: titan reads its model weights.*initial_load_model_only false"):
        load_into(_seeded("llama3", 1), path, tmp_path, initial_load_model_only=False)


COMMON = ["--config", "llama3_debug", "--model.flavor", "debugmodel_tiny", "--training.steps", "1",
          "--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.no_enable_progress_bar"]


def _first_loss(dump) -> float:
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return next(r["loss"] for r in records if "loss" in r)


def test_titan_train_starts_from_a_torchtitan_checkpoint_and_never_takes_over_its_folder(tmp_path):
    """Through the command line: the run from the torchtitan checkpoint computes the loss
    of the run from titan's own seed checkpoint of the same weights; pointed at the torchtitan
    folder as its own checkpoint folder, a run stops and leaves the folder as it was."""
    common = ["train", *COMMON]
    seed = run_titan([*common, "--job.dump_folder", tmp_path / "seed", "--checkpoint.enable",
                      "--checkpoint.create_seed_checkpoint", "--debug.seed", "7"], timeout=300)
    assert seed.returncode == 0, seed.stderr[-3000:]
    seed_step = tmp_path / "seed" / "checkpoint" / "step-0"
    model = build_llama3("debugmodel_tiny", vocab_size=320)  # the recipe's byte tokenizer
    load_into(model, seed_step, tmp_path)  # titan's own layout, for the weights to convert
    save_torchtitan_step(tmp_path / "tt", 10, model, release="0.3", family="llama3")

    losses = {}
    for name, path in (("titan", seed_step), ("torchtitan", tmp_path / "tt")):
        run = run_titan([*common, "--job.dump_folder", tmp_path / name, "--checkpoint.initial_load_path", path],
                        timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        losses[name] = _first_loss(tmp_path / name)
    fresh = run_titan([*common, "--job.dump_folder", tmp_path / "fresh"], timeout=300)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert losses["torchtitan"] == losses["titan"] != _first_loss(tmp_path / "fresh")

    before = sorted(os.listdir(tmp_path / "tt" / "step-10"))
    taken = run_titan([*common, "--job.dump_folder", tmp_path / "taken", "--checkpoint.enable",
                       "--checkpoint.folder", tmp_path / "tt", "--checkpoint.interval", "1"], timeout=300)
    assert taken.returncode != 0
    assert "step folders titan did not write (step-10" in taken.stderr and "torchtitan" in taken.stderr
    assert sorted(os.listdir(tmp_path / "tt" / "step-10")) == before


def test_pipeline_stages_each_load_their_own_weights_from_a_torchtitan_checkpoint(tmp_path):
    """Two pipeline stages on two ranks: each stage reads its blocks, and no weight counts as
    unused because the other rank's stage holds it. The loss equals the one from titan's own
    checkpoint of the same weights under the same layout."""
    model = _seeded("llama3", 3)
    with torch.no_grad():  # the recipe's byte vocabulary: keep the first 320 rows
        small = build_llama3("debugmodel_tiny", vocab_size=320)
        small.load_state_dict({k: v[:320] if v.shape[:1] == (2048,) else v for k, v in model.state_dict().items()})
    save_torchtitan_step(tmp_path / "tt", 4, small, release="0.3", family="llama3")
    manager = CheckpointManager(CheckpointConfig(enable=True, folder=str(tmp_path / "titan")),
                                dump_folder=str(tmp_path), states={}, model_parts=small)
    manager.save_now(4)
    manager.close()
    pp2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2",
           "--parallelism.pipeline_parallel_schedule", "1F1B", "--training.local_batch_size", "4"]
    runs = [(name, [*COMMON, *pp2, "--job.dump_folder", str(tmp_path / f"run_{name}"),
                    "--checkpoint.initial_load_path", str(tmp_path / name)]) for name in ("tt", "titan")]
    launch_train_runs(2, runs, tmp_path / "launch.log")
    assert _first_loss(tmp_path / "run_tt") == _first_loss(tmp_path / "run_titan")
    assert "loaded the weights of torchtitan checkpoint" in (tmp_path / "launch.log").read_text()


def test_convert_hf_exports_a_torchtitan_checkpoint_that_transformers_loads(tmp_path):
    """tools/convert_hf.py to-hf reads a torchtitan checkpoint (no config.json beside it: the
    flavor describes the model); transformers' Llama computes titan's logits from the export."""
    transformers = pytest.importorskip("transformers")
    source = _seeded("llama3", 4)
    save_torchtitan_step(tmp_path / "tt", 30, source, release="0.3", family="llama3")
    spec = importlib.util.spec_from_file_location("convert_hf", Path(__file__).parents[1] / "tools" / "convert_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["to-hf", str(tmp_path / "tt"), str(tmp_path / "hf"), "--model", "llama3", "--flavor", "debugmodel_tiny"])
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = float((source.eval()(tokens) - hf_model(tokens).logits).abs().max())
    assert diff <= 1e-5, diff  # fp32, as the export test of titan's own checkpoints


def test_a_torchtitan_checkpoint_folder_of_hugging_face_steps_loads_its_newest(tmp_path):
    """torchtitan's `last_save_in_hf` steps: safetensors under Hub names, no config.json, in
    `step-<N>` folders without titan's manifest; the folder given, the newest step is read."""
    from titan.ckpt import save_hf
    from titan.models.llama3 import LLAMA3_FLAVORS, Llama3StateDictAdapter

    adapter = Llama3StateDictAdapter(LLAMA3_FLAVORS["debugmodel_tiny"])
    source, older = _seeded("llama3", 5), _seeded("llama3", 6)
    for step, model in ((10, older), (40, source)):
        folder = tmp_path / "tt" / f"step-{step}"
        save_hf(model.state_dict(), str(folder), adapter)
        (folder / "config.json").unlink()
    target = _seeded("llama3", 7)
    load_into(target, tmp_path / "tt", tmp_path, hf_adapter=adapter, initial_load_in_hf=True)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in source.state_dict().items())


def _hub_qwen3(tmp_path):
    """A transformers Qwen3 (q/k norms, rotate-half RoPE, GQA) and its weights under the names
    torchtitan 0.3 saves (its Qwen3 keeps the Hub's q/k layout: no row moves)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(11)
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128, rope_theta=1e6, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # norm scales away from 1, so that their channel order matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    names = {"self_attn.q_proj": "attention.qkv_linear.wq", "self_attn.k_proj": "attention.qkv_linear.wk",
             "self_attn.v_proj": "attention.qkv_linear.wv", "self_attn.o_proj": "attention.wo",
             "self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm",
             "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
             "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}
    weights = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.layers."):
            _, _, layer, *rest = key.split(".")
            module, leaf = ".".join(rest[:-1]), rest[-1]
            weights[f"layers.{layer}.{names[module]}.{leaf}"] = value
        else:
            weights[{"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
                     "lm_head.weight": "lm_head.weight"}[key]] = value
    dcp.save({**weights, "train_state": {"step": 7}}, checkpoint_id=str(tmp_path / "tt" / "step-7"), no_dist=True)
    return model, config


def test_a_torchtitan_qwen3_checkpoint_computes_transformers_logits_in_titan(tmp_path):
    """The outside reference: transformers' Qwen3 with the weights a torchtitan Qwen3 checkpoint
    holds (the Hub's rotate-half layout). Loaded by name alone, titan's interleaved RoPE would
    pair the wrong channels: the q/k rows and norms are permuted on the way in."""
    reference, config = _hub_qwen3(tmp_path)
    adapter_args = Qwen3StateDictAdapter.args_from_hf_config(config.to_dict())
    titan = Qwen3Model(adapter_args)
    load_into(titan, tmp_path / "tt", tmp_path, hf_adapter=Qwen3StateDictAdapter(adapter_args))
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = titan.eval()(tokens), reference(tokens).logits
    diff = float((ours - theirs).abs().max())
    assert diff <= 1e-5, diff  # fp32, as the exports' transformers checks
    # Without the permutation the model is another one.
    unpermuted = Qwen3Model(adapter_args)
    load_into(unpermuted, tmp_path / "tt", tmp_path)  # no adapter: names only
    with torch.no_grad():
        assert float((unpermuted.eval()(tokens) - theirs).abs().max()) > 1e-2


def test_convert_hf_exports_a_torchtitan_qwen3_checkpoint_in_the_hubs_layout(tmp_path):
    """to-hf of a torchtitan Qwen3 checkpoint: its q/k rows are already in the Hub's layout, so
    they must come out as they went in (converted to titan's on reading, back on writing)."""
    transformers = pytest.importorskip("transformers")
    reference, config = _hub_qwen3(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    spec = importlib.util.spec_from_file_location("convert_hf", Path(__file__).parents[1] / "tools" / "convert_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.main(["to-hf", str(tmp_path / "tt"), str(tmp_path / "hf"), "--model", "qwen3",
               "--hf-config", str(tmp_path / "config.json")])
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = float((exported(tokens).logits - reference(tokens).logits).abs().max())
    assert diff <= 1e-5, diff
