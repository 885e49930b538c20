"""Hugging Face in and out: transformers loads the export; HF -> titan -> HF is bit-identical."""

import json
import os

import pytest
import torch
from ckpt_testlib import tensors_equal
from safetensors.torch import load_file, save_file
from titan.ckpt import CheckpointConfig, CheckpointError, CheckpointManager, hf, load_hf, save_hf

transformers = pytest.importorskip("transformers")


def _tiny_llama(seed: int):
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


class IdentityAdapter:
    """A family adapter whose titan names are the Hugging Face names (the model is HF's)."""

    def __init__(self, model) -> None:
        self.model = model

    def to_hf(self, sd):
        return dict(sd)

    def from_hf(self, sd):
        return dict(sd)

    def hf_config(self):
        return self.model.config.to_dict()


def _manager(tmp_path, model, **cfg):
    config = CheckpointConfig(enable=True, **cfg)
    return CheckpointManager(config, dump_folder=str(tmp_path), states={}, model_parts=[model],
                             hf_adapter=IdentityAdapter(model), hf_max_shard_bytes=40_000)


def test_export_loads_in_transformers_with_same_logits(tmp_path):
    model = _tiny_llama(0)
    manager = _manager(tmp_path, model, last_save_in_hf=True)
    assert manager.maybe_save(5, last_step=True)
    manager.close()
    folder = tmp_path / "checkpoint" / "step-5"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded

    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


def test_export_dtype_casts_weights(tmp_path):
    manager = _manager(tmp_path, _tiny_llama(0), last_save_in_hf=True, export_dtype="bfloat16")
    manager.maybe_save(1, last_step=True)
    manager.close()
    weights = load_hf(str(tmp_path / "checkpoint" / "step-1"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def test_hf_to_titan_to_hf_is_bit_identical(tmp_path):
    source = _tiny_llama(0)
    src = tmp_path / "hf_in"
    source.save_pretrained(str(src), max_shard_size="20KB")
    assert (src / "model.safetensors.index.json").exists()

    model = _tiny_llama(1)  # other weights, overwritten by the initial load
    manager = _manager(tmp_path, model, initial_load_path=str(src), initial_load_in_hf=True,
                       last_save_in_hf=True)
    assert manager.load() == 0
    assert tensors_equal(model.state_dict(), source.state_dict())
    manager.maybe_save(1, last_step=True)
    manager.close()
    assert tensors_equal(load_hf(str(src)), load_hf(str(tmp_path / "checkpoint" / "step-1")))


def test_save_hf_and_load_hf_helpers(tmp_path):
    sd = {"a.weight": torch.randn(8, 8), "b.weight": torch.randn(300, 100),
          "c.count": torch.arange(4)}
    weight_map = save_hf(sd, str(tmp_path / "out"), dtype="float16", max_shard_bytes=20_000)
    assert len(set(weight_map.values())) == 3  # b alone: it is larger than a shard
    back = load_hf(str(tmp_path / "out"))
    assert back["a.weight"].dtype == torch.float16 and back["c.count"].dtype == torch.int64
    assert torch.equal(back["b.weight"], sd["b.weight"].half())

    single = tmp_path / "single"
    single.mkdir()
    save_file({"x": torch.ones(2)}, str(single / "model.safetensors"))
    assert torch.equal(load_hf(str(single))["x"], torch.ones(2))
    assert load_file(str(single / "model.safetensors")).keys() == {"x"}


def test_hf_shape_mismatch_is_named(tmp_path):
    src = tmp_path / "hf_in"
    _tiny_llama(0).save_pretrained(str(src))
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    bigger = transformers.LlamaForCausalLM(config)
    manager = _manager(tmp_path, bigger, initial_load_path=str(src), initial_load_in_hf=True)
    with pytest.raises(Exception, match=r"'lm_head.weight' has shape \[64, 32\] in the checkpoint but \[64, 48\]"):
        manager.load()
    manager.close()
    assert not os.path.exists(tmp_path / "checkpoint")


class ComparingAdapter(IdentityAdapter):
    """An identity adapter that also compares a checkpoint's config.json with its model's, as
    the families' adapters do (`config_differences`): here only `rope_theta`."""

    def config_differences(self, checkpoint_config):
        mine, theirs = self.model.config.rope_theta, checkpoint_config["rope_theta"]
        return [] if mine == theirs else [f"rope_theta: checkpoint {theirs}, this run {mine}"]


def _comparing_manager(tmp_path, model, src):
    config = CheckpointConfig(enable=True, initial_load_path=str(src), initial_load_in_hf=True)
    return CheckpointManager(config, dump_folder=str(tmp_path), states={}, model_parts=[model],
                             hf_adapter=ComparingAdapter(model))


def _with_rope_theta(model, theta: float):
    model.config.rope_theta = theta
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    return model


def test_hf_config_of_another_model_is_refused_before_loading(tmp_path):
    """Same shapes, another RoPE base: loading would compute another function silently."""
    src = tmp_path / "hf_in"
    _with_rope_theta(_tiny_llama(0), 10_000.0).save_pretrained(str(src))
    model = _with_rope_theta(_tiny_llama(1), 500_000.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager = _comparing_manager(tmp_path, model, src)
    with pytest.raises(CheckpointError, match=r"config.json describes another model than this run's: "
                                              r"rope_theta: checkpoint 10000.0, this run 500000.0"):
        manager.load()
    manager.close()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing loaded


def test_hf_config_of_the_same_model_loads_and_weights_only_folders_warn(tmp_path, caplog):
    src = tmp_path / "hf_in"
    source = _with_rope_theta(_tiny_llama(0), 10_000.0)
    source.save_pretrained(str(src))
    model = _with_rope_theta(_tiny_llama(1), 10_000.0)
    manager = _comparing_manager(tmp_path, model, src)
    manager.load()
    manager.close()
    assert tensors_equal(model.state_dict(), source.state_dict())

    os.remove(src / "config.json")  # weights only: shapes are all that can be checked
    with caplog.at_level("WARNING", logger="titan.ckpt.hf"):
        manager = _comparing_manager(tmp_path, _tiny_llama(2), src)
        manager.load()
        manager.close()
    assert "has no config.json: only the tensor shapes are checked" in caplog.text


def test_unreadable_hf_config_is_named(tmp_path):
    src = tmp_path / "hf_in"
    _tiny_llama(0).save_pretrained(str(src))
    (src / "config.json").write_text("{not json")
    manager = _comparing_manager(tmp_path, _tiny_llama(1), src)
    with pytest.raises(CheckpointError, match=r"config.json cannot be read as this model family's config"):
        manager.load()
    manager.close()


def test_export_config_keeps_the_source_tokens_and_generation_config(tmp_path):
    """An export of a run that started from a Hub folder generates and stops like it: the
    source's special tokens and generation_config.json travel; its architecture keys are the
    adapter's, its dtype and writer are not carried."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({
        "bos_token_id": 1, "eos_token_id": [2, 7], "initializer_range": 0.01, "hidden_size": 999,
        "dtype": "float32", "transformers_version": "5.0.0",
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }))
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "temperature": 0.6}))

    class Adapter:
        def hf_config(self):
            return {"hidden_size": 32, "eos_token_id": 128001, "max_position_embeddings": 64, "torch_dtype": "bfloat16"}

    out = tmp_path / "out"
    out.mkdir()
    hf.write_config(str(out), Adapter(), "bfloat16", overrides={"max_position_embeddings": 4096}, source=str(source))
    config = json.loads((out / "config.json").read_text())
    assert config == {"bos_token_id": 1, "eos_token_id": [2, 7], "initializer_range": 0.01, "hidden_size": 32,
                      "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    assert json.loads((out / "generation_config.json").read_text()) == {"eos_token_id": [2, 7], "temperature": 0.6}

    # A source that names no tokens (null, as a bare `save_pretrained` config) leaves the run's.
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps({"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}))
    out_bare = tmp_path / "out_bare"
    out_bare.mkdir()
    hf.write_config(str(out_bare), Adapter(), "bfloat16", overrides={"eos_token_id": 257}, source=str(bare))
    config = json.loads((out_bare / "config.json").read_text())
    assert config["eos_token_id"] == 257 and config["bos_token_id"] is None

    # No source: the adapter's keys and the overrides, nothing else.
    alone = tmp_path / "alone"
    alone.mkdir()
    hf.write_config(str(alone), Adapter(), None)
    assert json.loads((alone / "config.json").read_text()) == Adapter().hf_config()
    assert not (alone / "generation_config.json").exists()


def test_export_writes_each_file_as_soon_as_its_weights_are_gathered(tmp_path, monkeypatch):
    """The writing rank holds one file's tensors at a time, in the export dtype, not the
    whole model: one write per planned file, none above the file size unless one tensor is."""
    written: list[dict[str, torch.Tensor]] = []
    real_write = hf.write_shards

    def spy(state_dict, groups, folder, *, first, total):
        written.append({key: state_dict[key] for group in groups for key in group})
        return real_write(state_dict, groups, folder, first=first, total=total)

    monkeypatch.setattr(hf, "write_shards", spy)
    model = _tiny_llama(0)
    manager = _manager(tmp_path, model, last_save_in_hf=True, export_dtype="bfloat16")
    assert manager.maybe_save(5, last_step=True)
    manager.close()
    folder = tmp_path / "checkpoint" / "step-5"
    files = set(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(written) == len(files) > 1
    for piece in written:
        sizes = [t.numel() * t.element_size() for t in piece.values()]
        assert sum(sizes) <= 40_000 or len(sizes) == 1
        assert all(t.dtype == torch.bfloat16 for t in piece.values())
    assert tensors_equal(load_hf(str(folder)), {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})


def test_an_import_reports_what_it_read_and_long_ones_report_progress(tmp_path, caplog):
    from titan.ckpt.manager import _Progress

    src = tmp_path / "hf_in"
    _tiny_llama(0).save_pretrained(str(src))
    model = _tiny_llama(1)
    with caplog.at_level("INFO", logger="titan.ckpt"):
        manager = _manager(tmp_path, model, initial_load_path=str(src), initial_load_in_hf=True)
        manager.load()
        manager.close()
    n_tensors = len(model.state_dict())
    assert f"loaded Hugging Face weights from {src}: {n_tensors} tensors, " in caplog.text

    caplog.clear()
    with caplog.at_level("INFO", logger="titan.ckpt"):
        progress = _Progress("loading x", total=3, every_s=0.0)
        for done in range(1, 4):
            progress.advance(done * 2**30)
    assert [r.getMessage().split(", ")[0] for r in caplog.records] == ["loading x: 1 of 3 blocks", "loading x: 2 of 3 blocks"]
