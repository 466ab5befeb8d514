"""Prefill through padded buckets (lookahead.prefill): the graph path's prefill, run eagerly on the CPU."""

import pytest
import torch

from lookahead import LookaheadConfig
from lookahead.model import LlamaForCausalLM
from lookahead.prefill import PrefillGraphs, prefill_graphs
from lookahead_kernels import StepLayout
from tests.test_generate import tiny_hf_model


@pytest.fixture(scope="module")
def tiny():
    return LlamaForCausalLM.from_hf(tiny_hf_model(max_position_embeddings=512))


def exact_prefill(model, tokens):
    """The eager loop's prefill: the prompt's own length, no padding."""
    cache = model.new_cache(1, 600)
    with torch.inference_mode():
        model.hidden(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache, 0, StepLayout.prefill(len(tokens)))
    return cache


def rel_err(got, want):
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("n", [1, 16, 17, 100])
def test_a_padded_prefill_writes_the_prompt_s_rows_of_one_sequence(tiny, n):
    padded = PrefillGraphs(tiny, graphs=False)
    tokens = torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    cache = tiny.new_cache(3, 600)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    assert padded.prefill(tokens, cache.sequence(1))
    want = exact_prefill(tiny, tokens)
    for got, ref in ((cache.k, want.k), (cache.v, want.v)):
        assert rel_err(got[:, 1:2, :n], ref[:, :, :n]) < 1e-5  # padding after the prompt never reaches its rows
        assert got[:, 1, n:].isnan().all() and got[:, [0, 2]].isnan().all()  # nothing else written


def test_buckets_and_what_runs_eagerly(tiny):
    padded = PrefillGraphs(tiny, graphs=False, largest=64)
    assert [padded.bucket(n) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, None]
    assert not padded.prefill(list(range(65)), tiny.new_cache(1, 100))  # longer than the largest bucket
    assert padded.scratch is None or padded.scratch.max_len == 64
    assert PrefillGraphs(tiny, graphs=False, largest=4096).largest == 512  # the model's positions
    for bad in (0, 48, True, 15):
        with pytest.raises(ValueError, match="power of two"):
            PrefillGraphs(tiny, graphs=False, largest=bad)
    with pytest.raises(ValueError, match="one sequence"):
        padded.prefill([1, 2, 3], tiny.new_cache(2, 100))
    with pytest.raises(ValueError, match="one sequence"):
        padded.prefill([1, 2, 3], tiny.new_cache(1, 2))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            PrefillGraphs(tiny, graphs=True)


def test_the_static_path_prefills_through_the_buckets_and_keeps_the_outputs(tiny):
    """A batch on the static path prefills every prompt padded (one bucket object kept on the model); its outputs
    equal the eager loop's, which prefills each prompt at its own length."""
    prompts = [torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 23, 40)]
    for la in (None, LookaheadConfig(window=4, ngram=3, guess=4)):
        eager = tiny.generate(prompts, max_new_tokens=12, lookahead=la, pad_token_id=0)
        static = tiny.generate(prompts, max_new_tokens=12, lookahead=la, pad_token_id=0, cuda_graphs=False,
                               _static_steps=True)
        assert torch.equal(static.sequences, eager.sequences)
        assert all(r.prefill_seconds > 0 for r in static.stats.rows)
    kept = prefill_graphs(tiny, False)
    assert kept is tiny.prefill_graphs[(tiny.device, tiny.dtype, False)]
    assert sorted(kept._buckets) == [16, 32, 64]


@pytest.mark.gpu
def test_on_cuda_a_replayed_prefill_equals_its_eager_bucket():
    # head dim 16: the Triton attention's least (the default tiny model's 8 runs on the CPU only)
    model = LlamaForCausalLM.from_hf(tiny_hf_model(max_position_embeddings=512, hidden_size=64,
                                                   intermediate_size=128).to("cuda"))
    tokens = list(range(1, 38))
    rows = []
    for graphs in (False, True):
        padded = PrefillGraphs(model, graphs=graphs)
        cache = model.new_cache(2, 100)
        assert padded.prefill(tokens, cache.sequence(1))
        if graphs:
            first = padded.capture_seconds
            assert first > 0
            again = model.new_cache(2, 100)
            assert padded.prefill(tokens, again.sequence(1)) and padded.capture_seconds == first  # replayed
            assert torch.equal(again.k, cache.k) and torch.equal(again.v, cache.v)
        rows.append(cache)
    assert torch.equal(rows[0].k, rows[1].k) and torch.equal(rows[0].v, rows[1].v)  # the same kernels, replayed
