"""stop_strings, stopping_criteria and max_time: generate ends each row where transformers' generate ends it, with
lookahead dropping a step's tokens after the stop; and the arguments' errors."""

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from lookahead import LlamaForCausalLM, LookaheadConfig

from .test_batch import mixed_prompts
from .test_generate import dev_prompts, tiny_hf_model

CONFIGS = [None, LookaheadConfig(window=4, ngram=3, guess=4), LookaheadConfig(),
           LookaheadConfig(max_step_tokens=16, sources=("pool",))]


class StopAfterToken(StoppingCriteria):
    """Stops a row right after ``token`` (per row, as transformers' criteria decide), recording the ids it saw."""

    def __init__(self, token: int):
        self.token = token
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        assert scores is None
        self.seen.append(input_ids.clone())
        return input_ids[:, -1] == self.token


@pytest.fixture(scope="module")
def tiny():
    hf = tiny_hf_model(seed=3)
    return hf, LlamaForCausalLM.from_hf(hf)


def hf_generate(hf, ids, max_new_tokens, **kwargs):
    mask = kwargs.pop("attention_mask", torch.ones_like(ids))
    return hf.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                       **kwargs)


def test_a_criterion_ends_the_row_where_transformers_ends_it(tiny):
    hf, model = tiny
    for ids in [p[None] for p in mixed_prompts()]:
        free = hf_generate(hf, ids, 32)
        token = int(free[0, ids.shape[1] + 9])
        want = hf_generate(hf, ids, 32, stopping_criteria=StoppingCriteriaList([StopAfterToken(token)]))
        assert want.shape[1] < free.shape[1] and int(want[0, -1]) == token
        for la in CONFIGS:
            criterion = StopAfterToken(token)
            got = model.generate(ids, max_new_tokens=32, lookahead=la, stopping_criteria=[criterion])
            assert torch.equal(got.sequences, want), la
            # asked after each token, with the row's ids so far (the prompt first)
            assert [s.shape[1] for s in criterion.seen] == list(range(ids.shape[1] + 1, want.shape[1] + 1))
            assert torch.equal(criterion.seen[-1], want)
        static = model.generate(ids, max_new_tokens=32, lookahead=CONFIGS[1], cuda_graphs=False, _static_steps=True,
                                stopping_criteria=StoppingCriteriaList([StopAfterToken(token)]))
        assert torch.equal(static.sequences, want)


@pytest.mark.parametrize("static", [False, True])
def test_rows_of_a_left_padded_batch_stop_apart(tiny, static):
    """Each row is asked alone, its left padding in front as transformers passes it; rows stop at their own
    steps and the rest of each is padding. (Without an EOS transformers lets a stopped row go on generating while
    others run; its tokens up to the stop are what count.)"""
    hf, model = tiny
    prompts = mixed_prompts()
    L = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(L - len(p), dtype=torch.long), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(L - len(p), dtype=torch.long), torch.ones(len(p), dtype=torch.long)])
                        for p in prompts])
    token = int(hf_generate(hf, prompts[0][None], 8)[0, -1])
    free = hf_generate(hf, ids, 24, attention_mask=mask)
    want = []  # per row: its new tokens up to and including the first `token`
    for row in free[:, L:].tolist():
        want.append(row[: row.index(token) + 1] if token in row else row)
    assert len({len(w) for w in want}) >= 2, "the rows should stop apart"
    kwargs = dict(cuda_graphs=False, _static_steps=True) if static else {}
    for la in (None, CONFIGS[1], CONFIGS[2]):
        criterion = StopAfterToken(token)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=24, lookahead=la, pad_token_id=0,
                             stopping_criteria=criterion, **kwargs).sequences
        assert torch.equal(got[:, :L], ids) and got.shape[1] == L + max(map(len, want)), la
        for b, w in enumerate(want):
            assert got[b, L:].tolist() == w + [0] * (got.shape[1] - L - len(w)), (la, b)
        assert all(s.shape[0] == 1 for s in criterion.seen) and any(s.shape[1] == L + 1 for s in criterion.seen)


def test_stop_strings_match_transformers_on_smollm2(smollm2):
    """transformers' own StopStringCriteria: a stop string across token boundaries, or overhanging the last token
    ("return" stops at "returns"), ends the answer where transformers' generate ends it."""
    hf, ours, tok = smollm2
    for name, stops in (("humaneval_dev.jsonl", ["return", "\n\n"]), ("mt_bench_dev.jsonl", [" the", "Dear"])):
        for ids in dev_prompts(tok, name, 2):
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                               stop_strings=stops, tokenizer=tok, pad_token_id=tok.pad_token_id)
            text = tok.decode(want[0, ids.shape[1]:])
            assert want.shape[1] < ids.shape[1] + 40 and any(s in text for s in stops), text
            for la in (None, LookaheadConfig(), LookaheadConfig(7, 5, 7)):
                got = ours.generate(ids, max_new_tokens=40, lookahead=la, stop_strings=stops, tokenizer=tok)
                assert torch.equal(got.sequences, want), (name, la, text)


def test_max_time_ends_every_row_after_the_step_that_passes_it(tiny):
    _, model = tiny
    prompts = mixed_prompts()
    for la in (None, CONFIGS[1]):
        out = model.generate(prompts, max_new_tokens=32, lookahead=la, max_time=1e-9, pad_token_id=0)
        assert out.stats.steps == 1 and all(r.new_tokens == r.accepted[0] for r in out.stats.rows)
        out = model.generate(prompts, max_new_tokens=32, lookahead=la, max_time=600.0, pad_token_id=0)
        assert all(r.new_tokens == 32 for r in out.stats.rows)


def test_a_criterion_answering_for_more_than_its_row_is_a_clear_error(tiny):
    _, model = tiny
    with pytest.raises(ValueError, match="one element for the one row it is given, got a tensor of shape"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3,
                       stopping_criteria=[lambda ids, scores: torch.zeros(2, dtype=torch.bool)])


@pytest.mark.parametrize("kwargs,message", [
    (dict(stop_strings="\n"), "stop_strings need the model's tokenizer"),
    (dict(stop_strings=[""], tokenizer=object()), "stop_strings must be a non-empty string"),
    (dict(stop_strings=[1], tokenizer=object()), "stop_strings must be a non-empty string"),
    (dict(stop_strings="x", tokenizer=object()), "tokenizer cannot match stop_strings"),
    (dict(stopping_criteria=5), "stopping_criteria must be a transformers StoppingCriteriaList"),
    (dict(stopping_criteria=[5]), "stopping_criteria must be a transformers StoppingCriteriaList"),
    (dict(max_time=0), "max_time must be a number of seconds > 0"),
    (dict(max_time="1"), "max_time must be a number of seconds > 0"),
])
def test_bad_arguments_are_clear_errors(tiny, kwargs, message):
    _, model = tiny
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, **kwargs)
