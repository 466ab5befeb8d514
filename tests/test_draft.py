"""The tree's guess sources (suffix matches, successor table, pool) and the builder that merges them."""

import pytest
import torch

from lookahead import LookaheadConfig
from lookahead.draft import AcceptanceStats, DraftBuilder
from lookahead.successors import SuccessorTable
from lookahead.suffix import SuffixIndex
from lookahead_kernels.tree import TreeShape


# ---- suffix matches ------------------------------------------------------------------------------------------
def test_suffix_longest_match_first_and_length_grows_with_the_match():
    idx = SuffixIndex(max_match=4, max_len=32)
    seq = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 8, 1, 2]
    got = idx.matches(seq, limit=4)
    # (8, 1, 2) occurred ending at index 10: up to 4 * 3 = 12 tokens follow it, 9 are there
    assert got[0] == (tuple(seq[11:]), 3)
    # (1, 2) also ends at 2 (at 10 its 8 tokens are a prefix of the first); one token (2) adds nothing new
    assert got[1] == (tuple(seq[3:11]), 2)
    assert len(got) == 2
    assert SuffixIndex.length_for(1, 32) == 4 and SuffixIndex.length_for(20, 32) == 32


def test_suffix_skips_continuations_that_are_prefixes_of_earlier_ones_and_respects_limit():
    idx = SuffixIndex(max_match=3, max_len=8)
    seq = [5, 6, 5, 6, 5, 6]
    got = idx.matches(seq, limit=1)
    assert len(got) == 1 and got[0][1] == 3
    assert SuffixIndex().matches([7], limit=4) == []  # a one-token sequence has nothing earlier


def test_suffix_index_is_incremental_and_rejects_a_shorter_sequence():
    idx = SuffixIndex()
    seq = [1, 2, 3, 1]
    assert idx.matches(seq, 4) == [((2, 3, 1), 1)]
    seq += [2]
    assert idx.matches(seq, 4)[0] == ((3, 1, 2), 2)
    with pytest.raises(ValueError, match="shorter"):
        idx.matches([1], 4)


def matches_by_contexts(sequence, limit, max_match=8, max_len=32):
    """The rule spelled out: for each context length from the longest down, every earlier end of the sequence's
    last ``c`` tokens, most recent first, offers what followed it; a continuation that is a prefix of one already
    taken is left out."""
    out = {}
    n = len(sequence)
    for c in range(min(max_match, n - 1), 0, -1):
        for j in range(n - 2, c - 2, -1):
            if sequence[j - c + 1: j + 1] != sequence[n - c:]:
                continue
            if len(out) >= limit:
                return list(out.items())
            cont = tuple(sequence[j + 1: j + 1 + SuffixIndex.length_for(c, max_len)])
            if cont and not any(prev[: len(cont)] == cont for prev in out):
                out[cont] = c
    return list(out.items())


@pytest.mark.parametrize("seed", range(12))
def test_suffix_matches_follow_the_rule_on_random_sequences(seed):
    """Small vocabularies make long and overlapping matches; the index grows a few tokens at a time."""
    g = torch.Generator().manual_seed(seed)
    vocab, max_match, max_len = [2, 3, 5, 20][seed % 4], [1, 3, 8][seed % 3], [2, 8, 32][seed % 3]
    seq = torch.randint(0, vocab, (int(torch.randint(1, 120, (1,), generator=g)),), generator=g).tolist()
    idx = SuffixIndex(max_match=max_match, max_len=max_len)
    for cut in list(range(1, len(seq), 7)) + [len(seq)]:
        for limit in (1, 4, 16):
            assert idx.matches(seq[:cut], limit) == matches_by_contexts(seq[:cut], limit, max_match, max_len), \
                (cut, limit)


# ---- successor table -------------------------------------------------------------------------------------------
def test_successor_table_keeps_the_top_k_of_the_latest_row():
    table = SuccessorTable(vocab_size=10, k=3)
    logits = torch.zeros(2, 10)
    logits[0, [4, 7, 1]] = torch.tensor([3.0, 2.0, 1.0])
    logits[1, [2, 3, 5]] = torch.tensor([1.0, 3.0, 2.0])
    table.update(torch.tensor([6, 6]), logits)  # the second row for token 6 wins
    assert [t for t, _ in table.successors(6)] == [3, 5, 2]
    assert table.successors(0) == []


# ---- builder -----------------------------------------------------------------------------------------------------
def builder(**kw):
    cfg = LookaheadConfig(window=3, ngram=4, guess=4, pool_backend="python", **kw)
    return DraftBuilder(cfg, 50)


def check_trie(tree):
    shape = TreeShape(tree.shape.depth, tree.shape.end)  # validates the encoding
    tokens = tree.tokens.tolist()
    parents = shape.parents().tolist()
    assert parents[: tree.num_nodes] == tree.parents
    seen = set()
    for i in range(tree.num_nodes):
        key = (parents[i], tokens[i])
        assert key not in seen, "two siblings share a token"
        seen.add(key)


def test_builder_merges_sources_into_a_trie_under_the_budget():
    b = builder()
    prompt = torch.tensor([1, 2, 3, 4, 1, 2, 3, 5, 1, 2])
    b.start(prompt)
    seq = prompt.tolist()
    b.successors.update(torch.tensor([2, 3]), torch.eye(50)[[3, 4]] * 5)
    for budget in (0, 1, 3, 6, 20):
        tree = b.build(seq, budget)
        assert tree.num_nodes <= budget and tree.size == tree.num_nodes
        check_trie(tree)
    tree = b.build(seq, 20)
    first = [tree.tokens[i].item() for i in range(tree.num_nodes) if tree.parents[i] == -1]
    assert 3 in first  # suffix, pool and successors all propose 3 after (.., 1, 2)
    node3 = first.index(3)
    roots = [i for i in range(tree.num_nodes) if tree.parents[i] == -1]
    assert {"suffix", "pool", "successors"} <= tree.sources[roots[node3]]
    padded = b.build(seq, 20, pad=True)
    assert padded.size == 20 and padded.num_nodes == tree.num_nodes
    assert padded.tokens[padded.num_nodes:].eq(0).all()
    assert padded.shape.end[padded.num_nodes:].tolist() == list(range(padded.num_nodes + 1, 21))


def test_builder_takes_the_likelier_nodes_first():
    b = builder(sources=("successors",))
    # among the top 8: after token 1 the model gives 2 probability 0.61 and 3 0.37; after 2 it gives 4 0.51
    logits = torch.zeros(2, 50)
    logits[0, 2], logits[0, 3] = 5.0, 4.5
    logits[1, 4] = 2.0
    b.successors.update(torch.tensor([1, 2]), logits)
    tree = b.build([7, 1], 2)
    # priors follow the probabilities (0.45 of the bucket's upper bound): 2 (0.315) then 3 (0.18) beat 2 -> 4
    # (0.315 * 0.27 = 0.085)
    assert tree.tokens.tolist() == [2, 3] and tree.parents == [-1, -1]
    tree = b.build([7, 1], 3)
    assert tree.tokens.tolist() == [2, 4, 3] and tree.parents == [-1, 0, -1]


def test_a_node_s_children_are_expected_to_add_at_most_one_token():
    """At most one child of a node is accepted, so their estimates are capped to sum to 1, the likeliest first
    (ties in the order proposed): three continuations of eight-token suffix matches, each at the prior 0.8, are
    worth 0.8, 0.2 and 0, not 2.4."""
    context = list(range(10, 18))
    prompt = context + [1] + context + [2] + context + [3] + context  # after the context came 1, then 2, then 3
    for native in (False, True):
        b = builder(sources=("suffix",))
        b.native = native and b.native
        b.start(torch.tensor(prompt))
        p = b.propose(prompt, 200)  # every node: the third continuation's is worth 0
        parents = p.parents.tolist()
        first = {int(p.tokens[i]): p.scores[i] for i in range(len(p)) if parents[i] == -1}
        assert first == pytest.approx({3: 0.8, 2: 0.2, 1: 0.0})  # the latest occurrence is proposed first
        for i in range(-1, len(p)):
            assert sum(s for s, q in zip(p.scores, parents) if q == i) <= (1.0 if i < 0 else p.scores[i])


def test_a_longer_suffix_match_is_trusted_further():
    """A suffix continuation's acceptance is learned per class of match length (1, 2-3, 4-7, 8+) and depth: the
    continuation of a one-token match starts at a lower prior than that of a long one, and observing a step
    teaches only its own class."""
    # x = 5: after (..., 3, 4, 5) came 6 earlier (a three-token match), after (9, 5) came 7 (one token)
    seq = [1, 3, 4, 5, 6, 9, 5, 7, 8, 3, 4, 5]
    for native in (False, True):
        b = builder(sources=("suffix",))
        b.native = native and b.native
        tree = b.build(seq, 20)
        first = {int(tree.tokens[i]): tree.keys[i] for i in range(tree.num_nodes) if tree.parents[i] == -1}
        assert first == {6: [("suffix", 2, 1)], 7: [("suffix", 1, 1)]}
        p = b.propose(seq, 20)
        roots = {int(p.tokens[i]): p.scores[i] for i in range(len(p)) if int(p.parents[i]) == -1}
        assert roots == pytest.approx({6: 0.4, 7: 0.13})  # the priors of the two classes' first tokens
        six = [i for i in range(tree.num_nodes) if int(tree.tokens[i]) == 6 and tree.parents[i] == -1][0]
        b.observe(tree, [six], None, seq + [6, 2], 2)
        assert b.stats.accepted[("suffix", 2, 1)] == 1 and b.stats.accepted[("suffix", 1, 1)] == 0
        assert ("suffix", 8, 1) not in b.stats.tested


def test_a_node_two_sources_propose_learns_apart_from_lone_ones():
    """A node that a suffix match and the successor table both propose carries its codes + AGREED: it starts from
    the agreed priors, and what it teaches stays with them; a lone successor keeps its own, lower, estimate."""
    seq = [1, 3, 4, 5, 6, 9, 5]  # x = 5: after (..., 5) came 6 earlier (a one-token match)
    for native in (False, True):
        b = builder(sources=("suffix", "successors"))
        b.native = native and b.native
        logits = torch.zeros(1, 50)
        logits[0, 6], logits[0, 8] = 5.0, 4.0  # after 5 the model gave 6 0.71 and 8 0.26 (of its top 8)
        b.successors.update(torch.tensor([5]), logits)
        tree = b.build(seq, 3)  # 6, the match's next token 9 (0.48 * 0.45), then 8
        keys = {int(tree.tokens[i]): tree.keys[i] for i in range(tree.num_nodes) if tree.parents[i] == -1}
        assert keys == {6: [("suffix", 1, 1, "agreed"), ("successors", 8, 1, "agreed")], 8: [("successors", 3, 1)]}
        p = b.propose(seq, 3)
        roots = {int(p.tokens[i]): p.scores[i] for i in range(len(p)) if int(p.parents[i]) == -1}
        # 6: the better of the agreed priors, max(0.25, 0.6 * 0.8); 8 alone: 0.45 * 0.3, under what 6 leaves
        assert roots == pytest.approx({6: 0.48, 8: 0.135})
        six = [i for i in range(tree.num_nodes) if int(tree.tokens[i]) == 6][0]
        b.observe(tree, [six], None, seq + [6, 2], 2)
        assert b.stats.accepted == {("suffix", 1, 1, "agreed"): 1, ("successors", 8, 1, "agreed"): 1,
                                    ("successors", 3, 1): 0, ("suffix", 1, 2): 0}
        assert ("successors", 8, 1) not in b.stats.tested


def test_observe_counts_only_tested_nodes():
    b = builder(sources=("successors",))
    b.successors = SuccessorTable(50, k=1)  # one successor per token: the tree is a chain
    logits = torch.zeros(3, 50)
    logits[0, 2], logits[1, 4], logits[2, 6] = 5.0, 5.0, 5.0
    b.successors.update(torch.tensor([1, 2, 4]), logits)
    tree = b.build([7, 1], 3)  # chain 2 -> 4 -> 6
    assert tree.parents == [-1, 0, 1]
    b.observe(tree, [0], None, [7, 1, 2, 9], 2)  # 2 accepted, 4 rejected, 6 never tested
    stats = b.stats
    # each successor is alone in its top 1, so its probability among them is 1: the last bucket (11)
    assert stats.tested == {("successors", 11, 1): 1, ("successors", 11, 2): 1}
    assert stats.accepted == {("successors", 11, 1): 1, ("successors", 11, 2): 0}


def test_acceptance_stats_move_from_the_prior_towards_the_observed_rate():
    s = AcceptanceStats()
    prior = s.rate(("pool", 1))
    for _ in range(100):
        s.record(("pool", 1), True)
    assert prior < s.rate(("pool", 1)) < 1.0
