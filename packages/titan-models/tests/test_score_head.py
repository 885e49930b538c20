"""Score heads (``num_labels``): titan's decoders as Hugging Face ``...ForSequenceClassification``
models (a reward model), checked against transformers."""

from __future__ import annotations

import json

import pytest
import torch
from titan.models.common.hf_config import hf_num_labels
from titan.models.deepseek_v3 import DeepseekV3Model, DeepseekV3StateDictAdapter
from titan.models.deepseek_v3.args import DeepseekV3Args
from titan.models.llama3 import Llama3Model, Llama3StateDictAdapter
from titan.models.llama3.args import Llama3Args
from titan.models.qwen3 import Qwen3Model, Qwen3StateDictAdapter
from titan.models.qwen3.args import Qwen3Args
from titan.models.qwen3_moe import Qwen3MoeModel, Qwen3MoeStateDictAdapter
from titan.models.qwen3_moe.args import Qwen3MoeArgs

transformers = pytest.importorskip("transformers")

PAD = 0  # transformers pools each row's score at its last token that is not the pad id


def _llama_args(**overrides) -> Llama3Args:
    fields = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32, max_seq_len=64,
                  rope_theta=10000.0)
    return Llama3Args(**{**fields, **overrides})


def _qwen_args(**overrides) -> Qwen3Args:
    fields = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=96, vocab_size=128,
                  max_seq_len=64, rope_theta=10000.0)
    return Qwen3Args(**{**fields, **overrides})


def _moe_args(**overrides) -> Qwen3MoeArgs:
    fields = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=96, vocab_size=128,
                  max_seq_len=64, rope_theta=10000.0, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                  mlp_only_layers=(0,))
    return Qwen3MoeArgs(**{**fields, **overrides})


def _deepseek_args(**overrides) -> DeepseekV3Args:
    fields = dict(dim=64, n_layers=2, n_heads=4, vocab_size=128, ffn_hidden_dim=96, max_seq_len=64,
                  moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                  topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                  qk_nope_head_dim=16, v_head_dim=16)
    return DeepseekV3Args(**{**fields, **overrides})


def _randomized(model_cls, args, seed: int):
    model = model_cls(args)
    model.init_weights(seed=seed)
    with torch.no_grad():  # every weight off its init (norms too), so a swapped name shows
        gen = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            # A router sharpened far from ties, so both sides route every token alike.
            scale = 1.0 if "router" in name else 0.05
            param.add_(torch.randn(param.shape, generator=gen) * scale)
    return model.eval()


def _export(model, adapter, folder) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = adapter.hf_config(torch_dtype="float32")
    config["pad_token_id"] = PAD
    (folder / "config.json").write_text(json.dumps(config))


def _rows() -> tuple[torch.Tensor, list[int]]:
    """Two rows of different lengths, right-padded with PAD (no other token is PAD)."""
    gen = torch.Generator().manual_seed(0)
    lengths = [19, 12]
    tokens = torch.full((2, 19), PAD)
    for row, n in enumerate(lengths):
        tokens[row, :n] = torch.randint(1, 128, (n,), generator=gen)
    return tokens, lengths


@pytest.mark.parametrize("family", ["llama3", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_exported_score_head_is_the_transformers_sequence_classifier(family, tmp_path):
    model_cls, adapter_cls, args = {
        "llama3": (Llama3Model, Llama3StateDictAdapter, _llama_args(num_labels=1)),
        "qwen3": (Qwen3Model, Qwen3StateDictAdapter, _qwen_args(num_labels=1)),
        "qwen3_moe": (Qwen3MoeModel, Qwen3MoeStateDictAdapter, _moe_args(num_labels=1)),
        "deepseek_v3": (DeepseekV3Model, DeepseekV3StateDictAdapter, _deepseek_args(num_labels=1)),
    }[family]
    titan = _randomized(model_cls, args, seed=1)
    assert titan.output.weight.shape == (1, 64) and titan.output.weight is not titan.tok_embeddings.weight
    adapter = adapter_cls(args)
    _export(titan, adapter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    expected = {"llama3": "LlamaForSequenceClassification", "qwen3": "Qwen3ForSequenceClassification",
                "qwen3_moe": "Qwen3MoeForSequenceClassification",
                "deepseek_v3": "DeepseekV3ForSequenceClassification"}[family]
    assert config["architectures"] == [expected]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf).__name__ == expected and hf.config.num_labels == 1
    tokens, lengths = _rows()
    with torch.no_grad():
        theirs = hf(tokens).logits[:, 0]
        # titan scores every position; a sequence's score is its last token's.
        ours = torch.stack([titan(tokens[row : row + 1, :n])[0, -1, 0] for row, n in enumerate(lengths)])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (theirs[0] - theirs[1]).abs() > 1e-3  # the rows score apart: the check can fail
    # ... and back: the checkpoint's args and weights rebuild the same model.
    back_args = adapter_cls.args_from_hf_config(config)
    assert back_args.num_labels == 1
    rebuilt = model_cls(back_args)
    from safetensors.torch import load_file

    rebuilt.load_state_dict(adapter_cls(back_args).from_hf(load_file(str(tmp_path / "model.safetensors"))),
                            strict=True)
    for name, value in titan.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], value), name


def test_a_score_head_is_never_tied():
    model = Llama3Model(_llama_args(num_labels=1, tie_word_embeddings=True))
    assert model.output.weight.shape == (1, 64)
    assert model.output.weight is not model.tok_embeddings.weight
    assert model.sharding_plan().tied_parameters == ()
    assert model.sharding_plan().tensor_parallel["output"] == "score"
    assert Llama3Model(_llama_args()).sharding_plan().tensor_parallel["output"] == "output"


def test_language_model_checkpoint_loads_the_body_and_skips_its_head():
    lm_args = _llama_args()
    lm = _randomized(Llama3Model, lm_args, seed=2)
    hub = Llama3StateDictAdapter(lm_args).to_hf(lm.state_dict())
    adapter = Llama3StateDictAdapter(_llama_args(num_labels=1))
    loaded = adapter.from_hf(hub)
    assert "output.weight" not in loaded and adapter.skipped == ["lm_head.weight"]
    assert adapter.keeps_init_when_absent("output.weight") and not adapter.keeps_init_when_absent("norm.weight")
    assert not Llama3StateDictAdapter(lm_args).keeps_init_when_absent("output.weight")
    for name, value in loaded.items():
        assert torch.equal(value, lm.state_dict()[name]), name


def test_a_score_head_is_refused_by_a_language_model():
    scorer = _randomized(Llama3Model, _llama_args(num_labels=1), seed=3)
    hub = Llama3StateDictAdapter(_llama_args(num_labels=1)).to_hf(scorer.state_dict())
    with pytest.raises(ValueError, match="score head of a sequence-classification model"):
        Llama3StateDictAdapter(_llama_args()).from_hf(hub)


def test_num_labels_from_a_config():
    assert hf_num_labels({"architectures": ["LlamaForCausalLM"], "num_labels": 2}) == 0
    assert hf_num_labels({"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "x"}}) == 1
    assert hf_num_labels({"architectures": ["LlamaForSequenceClassification"]}) == 2
    with pytest.raises(ValueError, match="num_labels must be >= 0"):
        Llama3Model(_llama_args(num_labels=-1))
