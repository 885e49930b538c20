"""The native generator against hand-written loops over the full-sequence forward."""

from __future__ import annotations

import math

import pytest
import torch
from titan.models.llama3 import build_llama3
from titan.rl.generate import Completion, Generator, NativeGenerator, SamplingConfig
from titan.rl.generate.native import filter_top_k_top_p
from titan.rl.logprobs import pad_sequences, token_logprobs

VOCAB = 96
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15]]


@pytest.fixture(scope="module")
def model():
    m = build_llama3("debugmodel_tiny", vocab_size=VOCAB, max_seq_len=64)
    m.init_weights(seed=2)
    return m.eval()


@pytest.fixture(scope="module")
def generator(model):
    return NativeGenerator(model, device="cpu", max_batch_size=6)


@torch.no_grad()
def full_forward_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] that scored each generated token, from one uncached forward."""
    seq = torch.tensor([prompt + tokens])
    return model(seq)[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)].float()


def test_is_a_generator(generator):
    assert isinstance(generator, Generator)


@torch.no_grad()
def test_greedy_equals_argmax_of_full_forward_step_by_step(model, generator):
    sampling = SamplingConfig(temperature=0, max_new_tokens=10, n=2)
    out = generator.generate(PROMPTS, sampling)
    assert [len(group) for group in out] == [2] * len(PROMPTS)
    for prompt, group in zip(PROMPTS, out, strict=True):
        seq = list(prompt)
        for _ in range(10):  # the reference: re-run the whole sequence for every token
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
        for completion in group:
            assert completion.prompt_ids == prompt
            assert completion.token_ids == seq[len(prompt):]
            assert completion.finish_reason == "length"
            ref = torch.log_softmax(full_forward_logits(model, prompt, completion.token_ids), -1)
            expected = ref.gather(-1, torch.tensor(completion.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(completion.logprobs), expected, rtol=0, atol=1e-5)


def test_sampling_reproducible_with_seed_and_different_across_seeds(generator):
    def run(seed):
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, n=3, seed=seed)
        return [[c.token_ids for c in group] for group in generator.generate(PROMPTS, sampling)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    group = run(7)[0]
    assert len({tuple(t) for t in group}) > 1  # a group's completions differ from each other


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 1.0), (1.3, 20, 0.9)])
def test_logprobs_are_temperature_log_softmax_of_full_forward(model, generator, temperature, top_k, top_p):
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, n=2, seed=1)
    for prompt, group in zip(PROMPTS, generator.generate(PROMPTS, sampling), strict=True):
        for c in group:
            logits = full_forward_logits(model, prompt, c.token_ids)
            expected = torch.log_softmax(logits / temperature, -1)
            expected = expected.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            assert len(c.logprobs) == len(c.token_ids) == 12
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, rtol=0, atol=1e-5)
            if top_k:  # every sampled token was inside the top-k of its step
                ranks = (logits > logits.gather(-1, torch.tensor(c.token_ids)[:, None])).sum(-1)
                assert int(ranks.max()) < top_k


def test_top_k_one_and_tiny_top_p_are_greedy(generator):
    greedy = generator.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=6))
    for kwargs in ({"top_k": 1}, {"top_p": 1e-6}):
        sampled = generator.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=6, seed=4, **kwargs))
        assert [g[0].token_ids for g in sampled] == [g[0].token_ids for g in greedy]


def test_filter_top_k_top_p_by_hand():
    probs = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    logits = probs.log()
    kept = filter_top_k_top_p(logits, 0, 0.8).isfinite()  # 0.5 + 0.2 < 0.8 <= 0.5 + 0.2 + 0.15
    assert kept.tolist() == [[True, True, True, False, False]]
    kept = filter_top_k_top_p(logits, 2, 1.0).isfinite()
    assert kept.tolist() == [[True, True, False, False, False]]


def test_first_token_frequencies_follow_the_tempered_distribution(model):
    """Many one-token samples of one prompt: empirical frequencies match softmax(logits / T)."""
    gen = NativeGenerator(model, device="cpu", max_batch_size=4000)
    t, n = 0.5, 4000
    out = gen.generate([PROMPTS[1]], SamplingConfig(temperature=t, max_new_tokens=1, n=n, seed=0))[0]
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in out]), minlength=VOCAB).double() / n
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([PROMPTS[1]]))[0, -1].double() / t, -1)
    # Sampling noise gives a total variation of ~0.04 here; a wrong temperature (T = 1, or
    # T off by 25%) is >= 0.12 away, and ignoring the temperature 0.36.
    assert 0.5 * (counts - probs).abs().sum() < 0.08
    top = int(probs.argmax())
    assert abs(counts[top] - probs[top]) < 4 * math.sqrt(probs[top] * (1 - probs[top]) / n) + 1e-3


def test_stop_tokens_and_max_tokens(generator):
    greedy = generator.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=8))
    stop = greedy[0][0].token_ids[2]  # the third greedy token of prompt 0
    out = generator.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=8, stop_token_ids=(stop,)))
    for ref, group in zip(greedy, out, strict=True):
        c, r = group[0], ref[0].token_ids
        if stop in r:
            cut = r.index(stop) + 1
            assert c.token_ids == r[:cut] and c.finish_reason == "stop"
            assert len(c.logprobs) == cut
        else:
            assert c.token_ids == r and c.finish_reason == "length"
    assert out[0][0].token_ids[-1] == stop and len(out[0][0].token_ids) <= 3
    eos = NativeGenerator(generator.model, max_batch_size=6, eos_token_id=stop)
    assert eos.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=8))[0][0].finish_reason == "stop"
    short = generator.generate(PROMPTS, SamplingConfig(temperature=1.0, max_new_tokens=3, seed=0))
    assert all(len(g[0].token_ids) == 3 and g[0].finish_reason == "length" for g in short)


def test_rescore_is_the_trainers_computation_exactly(model, generator):
    """Rescoring equals `token_logprobs` over the right-padded batch bit for bit, and the
    sampled logprobs within 1e-5."""
    sampling = SamplingConfig(temperature=0.9, max_new_tokens=9, n=1, seed=3, stop_token_ids=(5, 6, 7))
    completions = [g[0] for g in generator.generate(PROMPTS, sampling)]
    got = generator.rescore(completions, temperature=0.9)
    input_ids, targets, mask = pad_sequences([c.prompt_ids for c in completions], [c.token_ids for c in completions])
    with torch.no_grad():
        trainer = token_logprobs(model(input_ids), targets, 0.9)
    for row, c in enumerate(completions):
        assert got[row] == trainer[row][mask[row]].tolist()
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(got[row]), rtol=0, atol=1e-5)
    assert generator.rescore([(c.prompt_ids, c.token_ids) for c in completions], temperature=0.9) == got


def test_bad_requests_are_rejected(generator):
    with pytest.raises(ValueError, match="max_seq_len"):
        generator.generate([[1] * 60], SamplingConfig(max_new_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        generator.generate([[]], SamplingConfig())
    with pytest.raises(ValueError, match="--sampling.top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="--sampling.temperature"):
        SamplingConfig(temperature=-1)


def test_completion_fields():
    c = Completion(prompt_ids=[1], token_ids=[2], logprobs=[-0.1], finish_reason="stop")
    assert c.version == 0


def test_min_p_and_repetition_penalty_are_transformers_processors():
    """min_p and the repetition penalty equal transformers' own logits processors on the same
    logits (the outside reference), min_p by hand too."""
    transformers = pytest.importorskip("transformers")
    from titan.rl.generate.native import penalize_repetitions

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_top_k_top_p(probs.log(), 0, 1.0, min_p=0.2).isfinite()  # floor 0.2 x 0.5 = 0.1
    assert kept.tolist() == [[True, True, True, False]]
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    reference = transformers.MinPLogitsWarper(min_p=0.1)(torch.zeros(3, 1, dtype=torch.long), logits.clone())
    assert torch.equal(filter_top_k_top_p(logits, 0, 1.0, min_p=0.1).isfinite(), reference.isfinite())
    history = torch.randint(0, VOCAB, (3, 7))
    seen = torch.zeros(3, VOCAB, dtype=torch.bool).scatter(1, history, True)
    want = transformers.RepetitionPenaltyLogitsProcessor(penalty=1.3)(history, logits.clone())
    torch.testing.assert_close(penalize_repetitions(logits, seen, 1.3), want, rtol=0, atol=0)


@torch.no_grad()
def test_greedy_with_repetition_penalty_equals_transformers_processor_step_by_step(model, generator):
    """Greedy decoding under --sampling.repetition_penalty 1.5: each token is the argmax of the
    full forward's logits after transformers' repetition-penalty processor over the prompt and
    the tokens so far; the reported log-probs stay the unpenalized ones (the trainer's)."""
    transformers = pytest.importorskip("transformers")
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=1.5)
    sampling = SamplingConfig(temperature=0, max_new_tokens=12, repetition_penalty=1.5)
    out = generator.generate(PROMPTS, sampling)
    plain = generator.generate(PROMPTS, SamplingConfig(temperature=0, max_new_tokens=12))
    assert [g[0].token_ids for g in out] != [g[0].token_ids for g in plain]  # the penalty changed something
    for prompt, group in zip(PROMPTS, out, strict=True):
        seq = list(prompt)
        for _ in range(12):
            scores = processor(torch.tensor([seq]), model(torch.tensor([seq]))[:, -1].float())
            seq.append(int(scores.argmax()))
        assert group[0].token_ids == seq[len(prompt):]
        ref = torch.log_softmax(full_forward_logits(model, prompt, group[0].token_ids), -1)
        expected = ref.gather(-1, torch.tensor(group[0].token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(group[0].logprobs), expected, rtol=0, atol=1e-5)


def test_sampling_flags_are_checked():
    with pytest.raises(ValueError, match="--sampling.min_p must be in"):
        SamplingConfig(min_p=1.5)
    with pytest.raises(ValueError, match="--sampling.repetition_penalty must be > 0"):
        SamplingConfig(repetition_penalty=0)


def test_vllm_claims_only_the_gpu_memory_a_colocated_trainer_left():
    """vLLM refuses to start when less than gpu_memory_utilization x the device is free (0.9 by
    default), which a colocated trainer has already taken: the generator asks for 95% of the
    free share, never more than vLLM's default."""
    from titan.rl.generate.vllm.generator import utilization_of

    gib = 1 << 30
    assert utilization_of(40 * gib, 80 * gib) == pytest.approx(0.475)
    assert utilization_of(80 * gib, 80 * gib) == 0.9
    with pytest.raises(ValueError, match="no free GPU memory"):
        utilization_of(0, 80 * gib)
