"""``DraftMemory``: earlier calls' text as suffix matches for later calls. Its lookups against a brute-force
reference; end to end, output identical to plain decoding with a memory in every loop, and a prompt seen before
decoded in fewer steps."""

from __future__ import annotations

import dataclasses
import gc
import random
import weakref

import pytest
import torch

from lookahead import DraftMemory, LlamaForCausalLM, LookaheadConfig
from lookahead.draft import SUCCESSORS_PER_NODE
from lookahead.memory import merged_matches
from lookahead.suffix import SuffixIndex

from .test_generate import tiny_hf_model


def _reference(kept: list[list[int]], sequence: list[int], limit: int, max_match: int = 8, max_len: int = 32):
    """Every occurrence of the sequence's last two tokens in the kept sequences, measured and ordered as the
    memory promises (longest match first, most recent first among equal ones), prefixes of earlier ones left out."""
    found, order = [], 0
    for seq in kept:
        for p in range(1, len(seq) - 1):
            if seq[p - 1: p + 1] != sequence[-2:]:
                continue
            m = 2
            while m < max_match and m < len(sequence) and p - m >= 0 and seq[p - m] == sequence[-1 - m]:
                m += 1
            found.append((m, order, tuple(seq[p + 1: p + 1 + SuffixIndex.length_for(m, max_len)])))
            order += 1
    found.sort(key=lambda f: (-f[0], -f[1]))
    out = []
    for m, _, cont in found:
        if not any(prev[: len(cont)] == cont for prev, _ in out):
            out.append((cont, m))
    return out[:limit]


@pytest.mark.parametrize("seed", range(6))
def test_lookups_match_a_brute_force_reference(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 11])
    memory = DraftMemory(max_match=rng.choice([2, 3, 8]), max_len=rng.choice([1, 5, 32]), scan=10_000)
    kept = []
    for _ in range(rng.randint(1, 6)):
        seq = [rng.randrange(vocab) for _ in range(rng.randint(0, 40))]
        memory.add(seq)
        if len(seq) >= 3:
            kept.append(seq)
    assert memory.sequences == len(kept) and len(memory) == sum(map(len, kept))
    for _ in range(30):
        query = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        limit = rng.randint(1, 6)
        want = _reference(kept, query, limit, memory.max_match, memory.max_len) if len(query) >= 2 else []
        assert memory.matches(query, limit) == want, (query, limit)


def test_a_match_stays_within_its_sequence_and_needs_two_tokens():
    memory = DraftMemory()
    memory.add([1, 2, 3, 4])
    memory.add(torch.tensor([9, 1, 2, 7, 8, 9, 9]))  # a tensor is taken as well
    assert memory.matches([5, 3, 4], 4) == []  # 3 4 ends its sequence: nothing followed it there
    assert memory.matches([1, 2], 4) == [((7, 8, 9, 9), 2), ((3, 4), 2)]  # the more recent first
    assert memory.matches([9, 1, 2], 4) == [((7, 8, 9, 9), 3), ((3, 4), 2)]  # the longer match first
    assert memory.matches([6, 2], 4) == [] and memory.matches([2], 4) == []  # a one-token match is not offered
    memory.add([5, 5])  # too short to offer anything: not kept
    assert memory.sequences == 2


def test_a_continuation_ends_before_a_token_the_model_cannot_take():
    memory = DraftMemory()
    memory.add([1, 2, 3, 99, 4])
    memory.add([5, 6, 120, 7])
    assert memory.matches([1, 2], 4) == [((3, 99, 4), 2)]
    assert memory.matches([1, 2], 4, vocab_size=50) == [((3,), 2)]
    assert memory.matches([5, 6], 4, vocab_size=50) == []  # nothing left of it
    with pytest.raises(ValueError, match="token ids >= 0, got -1"):
        memory.add([3, 4, -1])


def test_the_oldest_sequences_go_first_past_max_tokens():
    memory = DraftMemory(max_tokens=20)
    for first in range(5):
        memory.add([first, 50, 51, 52, 53])
    # The 25th token dropped the oldest sequences down to three quarters of the memory, the new one included.
    assert len(memory) == 15 and memory.sequences == 3
    assert memory.matches([0, 50], 4) == [] and memory.matches([1, 50], 4) == []
    assert memory.matches([4, 50], 4) == [((51, 52, 53), 2)]
    memory.add(list(range(100, 130)))  # longer than the memory: its last 20 tokens, alone
    assert memory.sequences == 1 and len(memory) == 20
    assert memory.matches([110, 111], 1) == [(tuple(range(112, 120)), 2)]
    memory.clear()
    assert len(memory) == 0 and memory.matches([110, 111], 1) == []


def test_a_lookup_examines_only_the_most_recent_occurrences():
    memory = DraftMemory(scan=2)
    memory.add([7, 1, 2, 3, 3, 3])  # the longest match, but the oldest occurrence
    memory.add([0, 1, 2, 4])
    memory.add([0, 1, 2, 5])
    assert memory.matches([7, 1, 2], 4) == [((5,), 2), ((4,), 2)]


def test_merged_matches_keep_the_rows_own_first():
    own = [((1, 2, 3), 3), ((4,), 1)]
    remembered = [((1, 2), 4), ((6, 7), 3), ((4,), 2)]
    assert merged_matches(own, remembered) == [((1, 2, 3), 3), ((6, 7), 3), ((4,), 1)]
    assert merged_matches([], remembered) == remembered


@pytest.mark.parametrize("bad", [dict(max_tokens=0), dict(max_match=1), dict(max_len=0), dict(scan=0),
                                 dict(max_tokens=True), dict(scan=2.0)])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="DraftMemory's"):
        DraftMemory(**bad)


@pytest.fixture(scope="module")
def tiny():
    return LlamaForCausalLM.from_hf(tiny_hf_model(hidden_size=64, num_attention_heads=4, num_key_value_heads=2))


def _prompt(seed: int, length: int) -> list[int]:
    return torch.randint(0, 97, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


TREES = LookaheadConfig(window=1, ngram=2, guess=0, max_step_tokens=16)  # trees only, taken whole
MODES = {
    "automatic": dict(),  # on this random model the planner may take no tree: identity only
    "fixed": dict(lookahead=TREES),
    "static steps": dict(lookahead=TREES, cuda_graphs=False, _static_steps=True),
    "python builder": dict(lookahead=TREES, _native_draft=False),
    "sampled": dict(lookahead=TREES, do_sample=True, top_k=1),  # top_k=1: greedy's tokens, sampled verification
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_output_is_plain_decodings_and_a_seen_prompt_takes_fewer_steps(tiny, mode):
    kwargs = MODES[mode]
    memory = DraftMemory()
    prompts = [torch.tensor([_prompt(seed, 6 + seed)]) for seed in range(3)]
    first = [tiny.generate(p, max_new_tokens=40, draft_memory=memory, **kwargs) for p in prompts]
    assert memory.sequences == 3 and len(memory) == sum(out.sequences.numel() for out in first)
    again = tiny.generate(prompts[0], max_new_tokens=40, draft_memory=memory, **kwargs)
    plain = tiny.generate(prompts[0], max_new_tokens=40, lookahead=None)
    assert torch.equal(first[0].sequences, plain.sequences) and torch.equal(again.sequences, plain.sequences), mode
    if mode != "automatic":
        assert again.stats.steps <= first[0].stats.steps // 4, mode  # its whole output is in the memory


def test_smollm2_decodes_a_prompt_seen_before_in_fewer_steps(smollm2):
    """The automatic planner on a real model trusts the memory's long matches: the same HumanEval prompt again."""
    _, model, tokenizer = smollm2
    ids = tokenizer("def running_mean(values):\n    \"\"\"Return the running mean of a list of numbers.",
                    return_tensors="pt")["input_ids"]
    memory = DraftMemory()
    first = model.generate(ids, max_new_tokens=48, draft_memory=memory)
    again = model.generate(ids, max_new_tokens=48, draft_memory=memory)
    plain = model.generate(ids, max_new_tokens=48, lookahead=None)
    assert torch.equal(first.sequences, plain.sequences) and torch.equal(again.sequences, plain.sequences)
    assert again.stats.steps <= first.stats.steps // 2, (first.stats.steps, again.stats.steps)


def test_a_batch_reads_and_fills_the_memory_row_by_row(tiny):
    memory = DraftMemory()
    prompts = [_prompt(seed, 4 + 3 * seed) for seed in range(4)]
    tiny.generate(prompts[:2], max_new_tokens=32, draft_memory=memory)
    assert memory.sequences == 2
    for loop in (dict(), dict(cuda_graphs=False, _static_steps=True), dict(max_batch_size=2)):
        out = tiny.generate(prompts, max_new_tokens=32, draft_memory=DraftMemory(), **loop)
        again = tiny.generate(prompts, max_new_tokens=32, draft_memory=memory, **loop)
        plain = tiny.generate(prompts, max_new_tokens=32, lookahead=None)
        assert torch.equal(out.sequences, plain.sequences) and torch.equal(again.sequences, plain.sequences), loop
    # Plain decoding adds its rows too: the memory serves calls of either kind.
    before = memory.sequences
    tiny.generate(prompts[:1], max_new_tokens=8, lookahead=None, draft_memory=memory)
    assert memory.sequences == before + 1


def test_a_memory_filled_with_a_larger_vocabulary_guesses_only_what_the_model_takes(tiny):
    # Another tokenizer's model filled it: its text follows the prompt's tokens with ids past this model's 97.
    prompt = _prompt(5, 12)

    def filled() -> DraftMemory:
        memory = DraftMemory()
        for k in range(4):
            memory.add(prompt[-4:] + [500 + k, 3, 4] + prompt[:6] + [200, 201])
        return memory

    assert filled().matches(prompt, 2) and not filled().matches(prompt, 2, vocab_size=97)
    plain = tiny.generate(torch.tensor([prompt]), max_new_tokens=24, lookahead=None)
    for kwargs in (dict(lookahead=TREES), dict(lookahead=TREES, cuda_graphs=False, _static_steps=True),
                   dict(lookahead=TREES, _native_draft=False)):
        out = tiny.generate(torch.tensor([prompt]), max_new_tokens=24, draft_memory=filled(), **kwargs)
        assert torch.equal(out.sequences, plain.sequences), kwargs


def test_each_model_keeps_a_successor_table_of_its_own_while_it_lives():
    memory = DraftMemory()
    first, second = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    table = memory.successor_table(first, 97, 8)
    assert memory.successor_table(first, 97, 8) is table and (table.vocab_size, table.k) == (97, 8)
    assert memory.successor_table(second, 97, 8) is not table
    assert memory.successor_table(first, 98, 8) is not table  # another vocabulary or k: a new table
    table = memory.successor_table(first, 97, 8)
    memory.clear()
    assert memory.successor_table(first, 97, 8) is not table
    kept = weakref.ref(memory.successor_table(second, 97, 8))
    del second
    gc.collect()
    assert kept() is None  # the memory does not keep a model's table past the model


SUCCESSORS_ONLY = dataclasses.replace(TREES, sources=("successors",))


@pytest.mark.parametrize("loop", [dict(), dict(cuda_graphs=False, _static_steps=True), dict(_native_draft=False)])
def test_a_call_starts_with_the_successors_its_models_earlier_calls_learned(tiny, loop):
    """Without a memory a call's successor table starts empty: its first tree has nothing to grow from. With one,
    the model's table carries over, and the rows of a batch share it."""
    prompts = [_prompt(seed, 5 + seed) for seed in range(3)]
    plain = tiny.generate(prompts, max_new_tokens=24, lookahead=None)  # left-padded
    plain_first = tiny.generate(torch.tensor([prompts[0]]), max_new_tokens=24, lookahead=None)
    memory = DraftMemory()
    for call in range(2):
        out = tiny.generate(torch.tensor([prompts[0]]), max_new_tokens=24, lookahead=SUCCESSORS_ONLY, trace=True,
                            draft_memory=memory, **loop)
        assert torch.equal(out.sequences, plain_first.sequences), (loop, call)
        assert (len(out.stats.trace[0].tokens) > 0) == (call == 1), (loop, call)
    table = memory.successor_table(tiny, tiny.config.vocab_size, SUCCESSORS_PER_NODE)
    assert table.allocated and table.recorded > 0
    batch = tiny.generate(prompts, max_new_tokens=24, lookahead=SUCCESSORS_ONLY, draft_memory=memory, **loop)
    assert torch.equal(batch.sequences, plain.sequences), loop
    alone = tiny.generate(prompts, max_new_tokens=24, lookahead=SUCCESSORS_ONLY, trace=True, **loop)
    assert all(len(row.trace[0].tokens) == 0 for row in alone.stats.rows), loop


def test_a_memory_of_another_type_is_refused(tiny):
    with pytest.raises(ValueError, match="draft_memory must be a lookahead.DraftMemory or None"):
        tiny.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, draft_memory=[1, 2, 3])
