"""GuessSource and its pool improvements: two-token hashed table, hit ranking, output n-grams.

Pure table logic first (fast), then greedy identity end to end on a tiny random Llama for every option combination.
"""

import itertools
import random

import pytest
import torch
import transformers

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.guesses import GuessSource, HistoryIndex, NGramTable
from lookahead.pool import NGramPool

OFF = dict(pool_two_token_key=False, pool_rank_by_hits=False, pool_from_output=False)


def source(w=3, n=3, g=3, **options):
    cfg = LookaheadConfig(window=w, ngram=n, guess=g, pool_backend="python", pool_from_prompt=False,
                          **{**OFF, **options})
    return GuessSource(cfg, 100, "cpu")


def rows(t: torch.Tensor):
    return [tuple(r) for r in t.tolist()]


# ---- two-token table: collisions, bound ---------------------------------------------------------------------------

def test_colliding_keys_never_share_continuations():
    t = NGramTable(2, 3, 2, ranked=False, slots=1)  # one slot: every key hashes there
    t.insert([[1, 2, 10, 11]])
    assert t.lookup((1, 2)) == [(10, 11)]
    t.insert([[3, 4, 20, 21]])  # takes the slot over
    assert t.lookup((1, 2)) == [] and t.lookup((3, 4)) == [(20, 21)]
    assert t.lookup((1, 3)) == [] and t.lookup((2, 1)) == []


@pytest.mark.parametrize("slots", [1, 2, 3, 5, 8])
def test_hashed_table_matches_a_dict_for_every_key_it_still_holds(slots):
    rng = random.Random(slots)
    t = NGramTable(2, 3, 2, ranked=False, slots=slots)
    truth: dict[tuple, list] = {}
    for _ in range(300):
        key = (rng.randrange(6), rng.randrange(6))
        cont = (rng.randrange(4), rng.randrange(4))
        t.insert([list(key) + list(cont)])
        kept = [c for c in truth.get(key, []) if c != cont] + [cont]
        truth[key] = kept[-2:]
        for k in truth:
            got = t.lookup(k)
            # A key is either gone (evicted by another key) or holds exactly its own last continuations.
            assert got == [] or got == truth[k], (k, got, truth[k])
            if not got:
                truth[k] = []
        assert len(t.keys()) <= slots
        assert len(t) <= slots * 2


def test_two_token_table_is_bounded_through_guess_source():
    src = source(w=4, n=3, g=2, pool_two_token_key=True, pool_two_token_slots=8)
    rng = random.Random(0)
    seq = [rng.randrange(100) for _ in range(5)]
    for _ in range(200):
        src.candidates(seq)
        seq = seq + [rng.randrange(100)]
        src.observe(torch.randint(0, 100, (4, 3)), seq, 0, -1)
    assert src.two.slots == 8 and len(src.two.keys()) <= 8 and len(src.two) <= 8 * 2


def test_default_slot_count_is_sized_from_the_parameters():
    assert LookaheadConfig(window=15, ngram=5, guess=15).two_token_slots == 16384
    assert LookaheadConfig(window=7, ngram=5, guess=7).two_token_slots == 4096
    assert LookaheadConfig(window=7, guess=0).two_token_slots == 512
    assert LookaheadConfig(pool_two_token_slots=5).two_token_slots == 5


# ---- fallback, de-duplication, key positions ----------------------------------------------------------------------

def test_two_token_candidates_first_then_one_token_fill_deduplicated():
    src = source(g=4, pool_two_token_key=True)
    src.two.insert([[7, 1, 50, 51], [7, 1, 60, 61]])
    src.pool.insert(torch.tensor([[1, 70, 71], [1, 60, 61], [1, 80, 81], [1, 90, 91]]))
    got = rows(src.candidates([5, 7, 1]))
    assert got == [(50, 51), (60, 61), (70, 71), (80, 81)]  # (60, 61) under both keys is offered once
    # Another previous token: only the one-token key matches.
    assert rows(src.candidates([5, 8, 1])) == [(70, 71), (60, 61), (80, 81), (90, 91)]
    # A one-token sequence has no two-token key.
    assert rows(src.candidates([1])) == [(70, 71), (60, 61), (80, 81), (90, 91)]


def test_history_offers_longest_context_first_then_most_recent():
    h = HistoryIndex(ngram=3)
    seq = [1, 2, 3, 9, 9, 4, 2, 3, 8, 8, 5, 3, 7, 7, 2, 3]
    # Last tokens (.., 2, 3): the 2-token context (2, 3) ended at 7 and 2 -> (8, 8) newest, then (9, 9); then the
    # 1-token context 3 adds (7, 7) (ended at 11); x itself (index 15) is never a match.
    assert h.continuations(seq, 10) == [(8, 8), (9, 9), (7, 7)]
    assert h.continuations(seq, 2) == [(8, 8), (9, 9)]
    # Growing the sequence indexes only the new tokens: (4, 2, 3) ended at 7, then (2, 3) at 15 and 2.
    seq += [4, 2, 3]
    assert h.continuations(seq, 10)[:3] == [(8, 8), (4, 2), (9, 9)]
    with pytest.raises(ValueError, match="shorter"):
        h.continuations(seq[:3], 1)


def test_history_takes_half_the_slots_then_the_pool_then_tops_up():
    src = source(g=4, guess_from_history=True)
    seq = [1, 10, 11, 2, 1, 20, 21, 2, 1, 30, 31, 2, 1]
    src.start(torch.tensor(seq[:-1]))
    src.pool.insert(torch.tensor([[1, 70, 71], [1, 80, 81], [1, 90, 91]]))
    # History for x=1: (2, 1) ended at 8 and 4 -> (30, 31), (20, 21), in half of the 4 slots; the pool fills the
    # rest oldest first. With fewer pool candidates the history tops up: 1 alone adds (10, 11).
    assert rows(src.candidates(seq)) == [(30, 31), (20, 21), (70, 71), (80, 81)]
    src = source(g=4, guess_from_history=True)
    src.start(torch.tensor(seq[:-1]))
    src.pool.insert(torch.tensor([[1, 70, 71]]))
    assert rows(src.candidates(seq)) == [(30, 31), (20, 21), (70, 71), (10, 11)]


def test_window_ngrams_are_keyed_by_the_token_before_their_column():
    src = source(w=3, n=3, g=4, pool_two_token_key=True)
    seq = [9, 4, 1]  # x = 1 at index 2; the token before it is 4
    src.candidates(seq)
    ngrams = torch.tensor([[1, 20, 21], [30, 31, 32], [40, 41, 42]])  # column 0 starts with x
    src.observe(ngrams, seq + [20], 0, -1)
    assert src.two.lookup((4, 1)) == [(20, 21)]  # column 0: committed token before x
    assert src.two.lookup((1, 30)) == [(31, 32)]  # column 1: level-0 token of column 0
    assert src.two.lookup((30, 40)) == [(41, 42)]  # column 2: level-0 token of column 1
    assert len(src.two) == 3


def test_prompt_ngrams_fill_both_keys():
    cfg = LookaheadConfig(window=2, ngram=3, guess=2, pool_backend="python", **{**OFF, "pool_two_token_key": True})
    src = GuessSource(cfg, 100, "cpu")
    src.start(torch.tensor([1, 2, 3, 4, 5]))
    assert src.two.lookup((1, 2)) == [(3, 4)] and src.two.lookup((2, 3)) == [(4, 5)]
    assert rows(src.pool.lookup(3)) == [(4, 5)]


def test_all_options_off_is_the_original_pool():
    ref = NGramPool(3, 2)
    src = GuessSource(LookaheadConfig(window=2, ngram=3, guess=2, pool_backend="python", **OFF), 100, "cpu")
    prompt = torch.tensor([1, 2, 3, 1, 2, 4, 1, 5, 6])
    ref.insert_sequence(prompt)
    src.start(prompt)
    seq = prompt.tolist()
    for step in range(5):
        ng = torch.tensor([[seq[-1], 2, 7 + step], [2, 3, step]])
        assert torch.equal(src.candidates(seq), ref.lookup(seq[-1])[:2])
        seq = seq + [2]
        src.observe(ng, seq, 0, -1)
        ref.insert(ng)


# ---- ranking by hits ----------------------------------------------------------------------------------------------

def test_ranking_orders_by_hits_then_most_recent():
    t = NGramTable(1, 3, 4, ranked=True)
    t.insert([[1, 10, 11], [1, 20, 21], [1, 30, 31], [1, 40, 41]])
    assert t.lookup((1,)) == [(40, 41), (30, 31), (20, 21), (10, 11)]  # no hits: newest first
    t.credit((1,), (10, 11), 1)
    t.credit((1,), (20, 21), 2)
    assert t.lookup((1,)) == [(20, 21), (10, 11), (40, 41), (30, 31)]
    assert t.hits((1,), (20, 21)) == 2 and t.hits((1,), (99, 99)) == 0


def test_ranked_eviction_keeps_hit_continuations_and_admits_the_newcomer():
    t = NGramTable(1, 3, 2, ranked=True)
    t.insert([[1, 10, 11], [1, 20, 21]])
    t.credit((1,), (10, 11), 3)
    t.insert([[1, 30, 31]])  # full: the least-hit older one (20, 21) goes
    assert t.lookup((1,)) == [(10, 11), (30, 31)]
    t.insert([[1, 40, 41]])  # (30, 31) has 0 hits: it goes, not the newcomer
    assert t.lookup((1,)) == [(10, 11), (40, 41)]


def test_observe_credits_the_accepted_tokens_to_every_source_entry():
    src = source(n=4, g=4, pool_two_token_key=True, pool_rank_by_hits=True)
    src.two.insert([[8, 1, 5, 6, 7]])
    src.one.insert([[1, 5, 6, 9], [1, 5, 2, 2], [1, 3, 3, 3]])
    seq = [8, 1]
    cands = rows(src.candidates(seq))
    assert cands[0] == (5, 6, 7)  # the two-token key's continuation first
    best = cands.index((5, 6, 7))
    src.observe(None, seq + [5, 6, 4], 2, best)  # accepted 5, 6; bonus 4
    assert src.two.hits((8, 1), (5, 6, 7)) == 2
    assert src.one.hits((1,), (5, 6, 9)) == 2 and src.one.hits((1,), (5, 2, 2)) == 1
    assert src.one.hits((1,), (3, 3, 3)) == 0
    assert rows(src.candidates([0, 1])) == [(5, 6, 9), (5, 2, 2), (3, 3, 3)]  # by hits now


# ---- n-grams from the accepted output -----------------------------------------------------------------------------

@pytest.mark.parametrize("ranked", [False, True])
def test_output_ngrams_are_added(ranked):
    src = source(n=3, g=4, pool_from_output=True, pool_two_token_key=True, pool_rank_by_hits=ranked)
    seq = [1, 2, 3]
    src.candidates(seq)
    seq = seq + [4, 5]  # one accepted token and the bonus
    src.observe(None, seq, 1, 0)
    one = (lambda k: src.one.lookup((k,))) if ranked else (lambda k: rows(src.pool.lookup(k)))
    assert one(2) == [(3, 4)] and one(3) == [(4, 5)]  # the n-grams ending in 4 and in 5
    assert one(1) == []  # (1, 2, 3) ends in x, committed by an earlier step
    assert src.two.lookup((1, 2)) == [(3, 4)] and src.two.lookup((2, 3)) == [(4, 5)]


def test_output_ngrams_off_adds_nothing():
    src = source(n=3, g=4)
    src.candidates([1, 2, 3])
    src.observe(None, [1, 2, 3, 4, 5], 1, 0)
    assert len(src.pool) == 0


# ---- options ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [{"pool_two_token_key": 1}, {"pool_rank_by_hits": "yes"}, {"pool_from_output": None},
                                 {"guess_from_history": 1},
                                 {"pool_two_token_slots": -1}, {"pool_two_token_slots": 2.0},
                                 {"pool_two_token_slots": True}])
def test_bad_options_raise(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        LookaheadConfig(**bad)


def test_options_exist_with_bool_defaults():
    c = LookaheadConfig()
    for name in ("pool_two_token_key", "pool_rank_by_hits", "pool_from_output", "guess_from_history"):
        assert isinstance(getattr(c, name), bool)
    assert c.pool_two_token_slots == 0


# ---- greedy identity end to end -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=53, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                                   tie_word_embeddings=False)
    return LlamaForCausalLM.from_hf(transformers.LlamaForCausalLM(cfg).eval())


@pytest.mark.parametrize("two,ranked,output,history", list(itertools.product([False, True], repeat=4)))
def test_every_option_combination_is_greedy_identical(tiny, two, ranked, output, history):
    opts = dict(pool_two_token_key=two, pool_rank_by_hits=ranked, pool_from_output=output,
                guess_from_history=history)
    prompts = [torch.randint(0, 53, (1, 9), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    prompts.append(torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]]))  # repetitive: candidates get accepted
    for ids in prompts:
        ref = tiny.generate(ids, max_new_tokens=48).sequences
        for w, n, g, slots in [(5, 3, 5, 0), (4, 4, 3, 2), (1, 2, 1, 1), (3, 3, 0, 0)]:
            la = LookaheadConfig(window=w, ngram=n, guess=g, pool_two_token_slots=slots, **opts)
            out = tiny.generate(ids, max_new_tokens=48, lookahead=la)
            assert torch.equal(out.sequences, ref), (opts, w, n, g, slots)
            assert sum(out.stats.accepted) == 48
