"""``generate(..., prompt_cache=PromptCache())``: a conversation's next turn reuses the keys and values of the tokens
it starts with, and decodes exactly as without them (the rows kept are a fresh prefill's, bit for bit)."""

from __future__ import annotations

import pytest
import torch

from lookahead import LlamaForCausalLM, LookaheadConfig, PromptCache
from lookahead_kernels import StepLayout

from .test_generate import tiny_hf_model

VOCAB = 97
MODES = {
    "plain": dict(lookahead=None),
    "automatic": dict(),
    "fixed": dict(lookahead=LookaheadConfig(window=4, ngram=3, guess=4)),
    "static steps": dict(lookahead=LookaheadConfig(window=4, ngram=3, guess=4), cuda_graphs=False,
                         _static_steps=True),
}


@pytest.fixture(scope="module")
def tiny():
    # head_dim 16: the CPU forward's C++ step attention and fused layers serve it (they take 16 to 256).
    return LlamaForCausalLM.from_hf(tiny_hf_model(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_conversation_decodes_as_it_does_without_the_cache(tiny, mode):
    kwargs = MODES[mode]
    cache = PromptCache()
    first = _prompt(0, 9) + [5, 6, 7, 8] * 3  # a repeated n-gram: lookahead's trees get accepted
    turns = [first, None, first[:4] + _prompt(1, 6)]
    sequence, reused_wanted = None, [0, None, 4]
    for turn, prompt in enumerate(turns):
        if prompt is None:  # the next turn: the whole conversation so far, then new tokens
            prompt = sequence + _prompt(2, 5)
            reused_wanted[turn] = len(cache)
        ids = torch.tensor([prompt])
        out = tiny.generate(ids, max_new_tokens=24, prompt_cache=cache, **kwargs)
        alone = tiny.generate(ids, max_new_tokens=24, **kwargs)
        assert torch.equal(out.sequences, alone.sequences), (mode, turn)
        assert out.stats.reused_tokens == out.stats.rows[0].reused_tokens == reused_wanted[turn], (mode, turn)
        sequence = out.sequences[0].tolist()
        assert cache.tokens == sequence[:len(sequence) - 1], (mode, turn)  # all but the last token, never fed
    assert reused_wanted[1] == len(first) + 24 - 1


def test_the_rows_kept_are_a_fresh_prefills_bit_for_bit(tiny):
    cache = PromptCache()
    prompt = _prompt(3, 7) + [11, 12, 13] * 4
    out = tiny.generate(torch.tensor([prompt]), max_new_tokens=30, prompt_cache=cache,
                        lookahead=LookaheadConfig(window=4, ngram=3, guess=4))
    assert max(out.stats.accepted) >= 2  # rows written by lookahead steps and moved by compaction
    n = len(cache)
    fresh = tiny.new_cache(1, n)
    with torch.inference_mode():
        tiny.hidden(torch.tensor([cache.tokens]), torch.arange(n)[None], fresh, 0, StepLayout.prefill(n))
    assert torch.equal(cache._k[:, :n], fresh.k[:, 0]) and torch.equal(cache._v[:, :n], fresh.v[:, 0])


def test_sampling_with_the_cache_draws_the_same_tokens(tiny):
    cache = PromptCache()
    prompt = _prompt(4, 10)
    # A fixed step shape: the automatic planner weighs host time it measures, so its trees (and with them which
    # random numbers a step draws) may differ between two runs under load; a fixed shape draws the same.
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=0.8, top_p=0.9,
                  lookahead=LookaheadConfig(window=4, ngram=3, guess=4))
    first = tiny.generate(torch.tensor([prompt]), prompt_cache=cache, generator=torch.Generator().manual_seed(1),
                          **kwargs)
    ids = torch.cat([first.sequences, torch.tensor([_prompt(5, 4)])], dim=1)
    with_cache = tiny.generate(ids, prompt_cache=cache, generator=torch.Generator().manual_seed(2), **kwargs)
    without = tiny.generate(ids, generator=torch.Generator().manual_seed(2), **kwargs)
    assert with_cache.stats.reused_tokens == ids.shape[1] - 5 and torch.equal(with_cache.sequences, without.sequences)


def test_the_cache_starts_over_for_another_model_or_changed_weights(tiny):
    other = LlamaForCausalLM.from_hf(tiny_hf_model(seed=1, hidden_size=64, num_attention_heads=4,
                                                   num_key_value_heads=2))
    cache = PromptCache()
    prompt = torch.tensor([_prompt(6, 8)])
    tiny.generate(prompt, max_new_tokens=4, prompt_cache=cache)
    assert tiny.generate(prompt, max_new_tokens=4, prompt_cache=cache).stats.reused_tokens == 7
    out = other.generate(prompt, max_new_tokens=4, prompt_cache=cache, lookahead=None)
    assert out.stats.reused_tokens == 0 and torch.equal(out.sequences, other.generate(prompt, max_new_tokens=4).sequences)
    with torch.no_grad():
        other.norm.weight.mul_(1.5)  # changed in place: the rows held are stale
    assert other.generate(prompt, max_new_tokens=4, prompt_cache=cache).stats.reused_tokens == 0
    assert repr(cache) == f"PromptCache({len(cache)} tokens)" and len(cache) == 8 + 4 - 1
    cache.clear()
    assert len(cache) == 0 and tiny.generate(prompt, max_new_tokens=4, prompt_cache=cache).stats.reused_tokens == 0


def test_bad_prompt_caches_are_value_errors(tiny):
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="batch of 2"):
        tiny.generate(ids, max_new_tokens=2, prompt_cache=PromptCache())
    with pytest.raises(ValueError, match="PromptCache or None"):
        tiny.generate(ids[:1], max_new_tokens=2, prompt_cache={})


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_on_cuda_the_cache_serves_the_graphs_and_the_eager_loop(cuda_graphs):
    # On CUDA the rows kept need not equal a fresh prefill's bit for bit (the products' blocking depends on the
    # number of rows): they are checked to float32 rounding, and the copies in and out on the device.
    model = LlamaForCausalLM.from_hf(tiny_hf_model(hidden_size=64, num_attention_heads=4,
                                                   num_key_value_heads=2).to("cuda"))
    cache = PromptCache()
    prompt = _prompt(7, 9) + [5, 6, 7, 8] * 3
    first = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=20, prompt_cache=cache,
                           cuda_graphs=cuda_graphs)
    ids = torch.cat([first.sequences, torch.tensor([_prompt(8, 5)], device="cuda")], dim=1)
    out = model.generate(ids, max_new_tokens=20, prompt_cache=cache, cuda_graphs=cuda_graphs)
    assert out.stats.reused_tokens == first.sequences.shape[1] - 1 and out.sequences.shape[1] == ids.shape[1] + 20
    n = len(cache)
    fresh = model.new_cache(1, n)
    with torch.inference_mode():
        model.hidden(torch.tensor([cache.tokens], device="cuda"), torch.arange(n, device="cuda")[None], fresh, 0,
                     StepLayout.prefill(n))
    for kept, ref in ((cache._k[:, :n], fresh.k[:, 0]), (cache._v[:, :n], fresh.v[:, 0])):
        assert float((kept.double() - ref.double()).abs().max() / ref.double().abs().max()) < 1e-4
