"""transformers' forward call, ``model(input_ids, attention_mask=..., labels=...)``, on our model: logits and loss
against transformers' own model, padded rows against the same rows alone, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lookahead import CausalLMOutput, LlamaForCausalLM
from lookahead_kernels import StepLayout

from .test_model import HF_CONFIGS, TOL, VOCAB, random_hf_model, rel_err


@pytest.fixture(scope="module", params=["llama-gqa-tied", "qwen2", "llama3-rope", "qwen3", "smollm3"])
def pair(request):
    hf = random_hf_model(HF_CONFIGS[request.param]())
    return hf, LlamaForCausalLM.from_hf(hf)


def test_the_forward_call_gives_transformers_logits_and_loss(pair):
    hf, ours = pair
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 11))
    labels = ids.clone()
    labels[0, 4] = labels[2, 1:3] = -100  # transformers' "no loss here"
    with torch.inference_mode():
        out = ours(ids, labels=labels)
        ref = hf(ids, labels=labels)
        plain = ours(input_ids=ids)
    assert isinstance(out, CausalLMOutput) and out.logits.dtype == torch.float32
    assert out.logits.shape == (3, 11, VOCAB)
    assert rel_err(out.logits, ref.logits) < TOL
    assert abs(float(out.loss) - float(ref.loss)) < 1e-5 * max(1.0, abs(float(ref.loss)))
    assert plain.loss is None and torch.equal(plain.logits, out.logits)


@pytest.mark.parametrize("side", ["left", "right"])
@torch.no_grad()
def test_a_padded_row_scores_as_it_does_alone(pair, side):
    _, ours = pair
    torch.manual_seed(1)
    lengths = [7, 3, 9, 1]
    L = max(lengths)
    rows = [torch.randint(0, VOCAB, (n,)) for n in lengths]
    ids = torch.full((len(rows), L), 5)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    spans = []
    for b, row in enumerate(rows):
        start = L - len(row) if side == "left" else 0
        ids[b, start:start + len(row)] = row
        mask[b, start:start + len(row)] = 1
        spans.append((start, start + len(row)))
    labels = ids.masked_fill(mask == 0, -100)
    out = ours(ids, attention_mask=mask, labels=labels)
    total, count = 0.0, 0
    for b, (row, (start, end)) in enumerate(zip(rows, spans)):
        alone = ours(row[None]).logits[0]
        assert torch.equal(out.logits[b, start:end], alone)
        assert not out.logits[b, :start].any() and not out.logits[b, end:].any()
        if len(row) > 1:
            total += float(F.cross_entropy(alone[:-1].double(), row[1:], reduction="sum"))
            count += len(row) - 1
    assert abs(float(out.loss) - total / count) < 1e-5 * total / count
    # Labels left at the padding token count for nothing either (transformers would count some of them).
    assert torch.equal(ours(ids, attention_mask=mask, labels=ids).loss, out.loss)
    # A mask of ones is no padding: one batched pass, the same logits as each row alone.
    ones = ours(ids, attention_mask=torch.ones_like(ids))
    assert torch.allclose(ones.logits[0], ours(ids[:1]).logits[0], rtol=0, atol=1e-5)


def test_the_output_indexes_as_transformers_does(pair):
    _, ours = pair
    ids = torch.tensor([[1, 2, 3, 4]])
    with_loss = ours(ids, labels=ids)
    assert with_loss[0] is with_loss.loss and with_loss[1] is with_loss.logits
    assert with_loss["logits"] is with_loss.logits and with_loss.to_tuple() == (with_loss.loss, with_loss.logits)
    without = ours(ids[0])  # [L] is one row
    assert without.logits.shape == (1, 4, VOCAB) and without[0] is without.logits
    with pytest.raises(KeyError):
        without["loss"]
    # transformers' keywords an evaluation script passes: a tuple for return_dict=False, use_cache changes nothing
    as_tuple = ours(ids, labels=ids, use_cache=False, return_dict=False)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 2
    assert torch.equal(as_tuple[0], with_loss.loss) and torch.equal(as_tuple[1], with_loss.logits)
    assert torch.equal(ours(ids, use_cache=True, return_dict=True).logits, with_loss.logits)


def test_bad_calls_are_value_errors(pair):
    _, ours = pair
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    cases = [
        (dict(input_ids=ids.float()), "integer token ids"),
        (dict(input_ids=ids[:, :0]), r"\[B, L\]"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])), "gaps"),
        (dict(input_ids=ids, attention_mask=torch.tensor([[0, 0, 0, 0], [1, 1, 1, 1]])), "all zeros"),
        (dict(input_ids=ids, attention_mask=torch.ones(2, 3)), "must match"),
        (dict(input_ids=ids, attention_mask=torch.full((2, 4), 2)), "only 0"),
        (dict(input_ids=ids, attention_mask=[[1] * 4] * 2), "tensor"),
        (dict(input_ids=ids, labels=ids[:, :3]), "must match"),
        (dict(input_ids=ids, labels=ids + VOCAB), r"\[0, 97\)"),
        (dict(input_ids=ids, labels=ids.float()), "integer tensor"),
        (dict(input_ids=ids + VOCAB), "vocab_size"),
        (dict(input_ids=ids, positions=torch.arange(4).expand(2, 4)), "missing"),
        (dict(input_ids=ids, positions=torch.arange(4).expand(2, 4), cache=ours.new_cache(2, 8), cache_len=0,
              layout=StepLayout.prefill(4), attention_mask=torch.ones_like(ids)), "attention_mask goes with"),
        (dict(input_ids=ids, positions=torch.arange(4).expand(2, 4), cache=ours.new_cache(2, 8), cache_len=0,
              layout=StepLayout.prefill(4), use_cache=False, return_dict=True), "use_cache, return_dict go with"),
        (dict(input_ids=ids, use_cache="yes"), "use_cache must be a bool"),
        (dict(input_ids=ids, return_dict=1), "return_dict must be a bool"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ours(**kwargs)
