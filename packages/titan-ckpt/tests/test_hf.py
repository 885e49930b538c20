"""Hugging Face in and out: transformers loads the export; HF -> titan -> HF is bit-identical."""

import json
import os

import pytest
import torch
from ckpt_testlib import tensors_equal
from safetensors.torch import load_file, save_file
from titan.ckpt import CheckpointConfig, CheckpointManager, load_hf, save_hf

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
