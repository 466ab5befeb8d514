"""The algorithm's units against hand-worked examples: config, layout, window, pool, step, verification."""

import pytest
import torch

from lookahead import LookaheadConfig
from lookahead.config import StepShape
from lookahead.pool import NGramPool
from lookahead.draft import DraftTree
from lookahead.step import build_step
from lookahead.window import LookaheadWindow, stack_step_tokens
from lookahead_kernels import StepLayout, dense_mask, verify_tree_greedy_reference
from lookahead_kernels.tree import TreeShape


# ---- configuration -------------------------------------------------------------------------------------------
def test_config_defaults_and_tokens_per_step():
    c = LookaheadConfig()
    assert c.shape() == StepShape(15, 4, 60) and c.pool_from_prompt
    assert c.tokens_per_step == 120  # 1 + 14 + 3*15 + 15*4, the design note's figure
    assert LookaheadConfig(15, 5, 15).shape() == StepShape(15, 4, 60)
    assert LookaheadConfig(7, 3).shape() == StepShape(7, 2, 30)
    assert LookaheadConfig(window=4, ngram=3, max_step_tokens=20).shape() == StepShape(4, 2, 12)
    for budget in (1, 2, 5, 8, 16, 32, 64, 120, 200):
        shape = LookaheadConfig(max_step_tokens=budget).shape()
        assert shape.max_tokens == budget and shape.tree_budget >= budget // 2 - 1, (budget, shape)
    with pytest.raises(dataclasses_frozen_error()):
        c.window = 3


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("kwargs, word", [
    ({"window": 0}, "window"), ({"ngram": 1}, "ngram"), ({"guess": -1}, "guess"),
    ({"window": 2.5}, "window"), ({"ngram": "5"}, "ngram"), ({"guess": True}, "guess"),
    ({"pool_backend": "gpu"}, "pool_backend"), ({"pool_from_prompt": 1}, "pool_from_prompt"),
    ({"pad_tree": 1}, "pad_tree"), ({"pad_tree": "auto"}, "pad_tree"),
    ({"max_step_tokens": 0}, "max_step_tokens"), ({"max_step_tokens": 10, "window": 5, "ngram": 4}, "window alone"),
    ({"sources": ("pool", "lookup")}, "sources"), ({"sources": "pool"}, "sources"),
    ({"sources": ("pool", "pool")}, "sources"),
])
def test_config_rejects_bad_values(kwargs, word):
    with pytest.raises(ValueError, match=word):
        LookaheadConfig(**kwargs)


# ---- layout --------------------------------------------------------------------------------------------------
def test_layout_hand_worked_mask_and_positions():
    layout = StepLayout.linear(window=3, levels=2, guesses=2, guess_len=2)
    assert layout.T == 3 * 2 + 2 * 2
    idx = torch.arange(layout.T)
    got = layout.visible(idx[:, None], idx[None, :]).int()
    # rows/cols: x, L0[1], L0[2], L1[0], L1[1], L1[2], c0[1], c0[2], c1[1], c1[2]
    want = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 0, 0, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        [1, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    ])
    assert torch.equal(got, want)
    assert layout.position_offsets().tolist() == [0, 1, 2, 1, 2, 3, 1, 2, 1, 2]
    assert list(layout.last_level_rows()) == [3, 4, 5]
    assert layout.node_row(1 * 2 + 2 - 1) == 9


def test_layout_prefill_is_causal_and_dense_mask_sees_prefix():
    layout = StepLayout.prefill(5)
    idx = torch.arange(5)
    assert torch.equal(layout.visible(idx[:, None], idx[None, :]), torch.ones(5, 5, dtype=torch.bool).tril())
    m = dense_mask(StepLayout.linear(2, 1, 1, 1), cache_len=3, kv_len=8)
    assert m[:, :3].all() and not m[:, 6:].any()


@pytest.mark.parametrize("kwargs", [{"window": 0, "levels": 1}, {"window": 2, "levels": 0},
                                    {"window": 2, "levels": 1, "guesses": -1}, {"window": 2.0, "levels": 1}])
def test_layout_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="StepLayout|TreeShape"):
        StepLayout.linear(**kwargs)


# ---- window --------------------------------------------------------------------------------------------------
def test_window_warm_up_then_slide_hand_worked():
    w = LookaheadWindow(window=3, ngram=3, generator=torch.Generator().manual_seed(0))
    w.reset(torch.tensor([7]))
    assert w.tokens.tolist() == [[7, 7, 7]] and not w.warm
    assert stack_step_tokens([w], [1], 3).tolist() == [[1, 7, 7]]
    # warming up: every row shifts by 1 + a columns and the outputs become a new level; no n-grams yet
    assert w.advance(1, torch.tensor([10, 11, 12]), accepted=0, source=torch.tensor([9])) is None
    assert w.tokens.tolist() == [[7, 7, 9], [11, 12, 9]] and w.warm
    # a parked row (no window) feeds its x throughout
    assert stack_step_tokens([w, None], [5, 4], 6).tolist() == [[5, 7, 9, 11, 12, 9], [4] * 6]
    alone = LookaheadWindow(window=1, ngram=2, generator=torch.Generator().manual_seed(0))  # x alone: its x
    alone.reset(torch.tensor([7]))
    assert stack_step_tokens([alone, None], [5, 4], 1).tolist() == [[5], [4]]
    # warm, a = 1: n-grams are the columns (x first), then level j takes old level j+1 from column a
    ngrams = w.advance(5, torch.tensor([20, 21, 22]), accepted=1, source=torch.tensor([9]))
    assert ngrams.tolist() == [[5, 11, 20], [7, 12, 21], [9, 9, 22]]
    assert w.tokens.tolist() == [[12, 9, 9], [21, 22, 9]]


def test_a_window_joining_a_batch_starts_at_its_level():
    """A row that takes a finished row's place (``max_batch_size``) starts with as many levels as the batch's
    windows, drawn from its prompt, and then slides as they do."""
    w = LookaheadWindow(window=3, ngram=4, generator=torch.Generator().manual_seed(0))
    w.reset(torch.tensor([7]), levels=2)
    assert w.tokens.tolist() == [[7, 7, 7], [7, 7, 7]] and w.levels == 2 and not w.warm
    assert w.advance(1, torch.tensor([10, 11, 12]), accepted=0, source=torch.tensor([9])) is None
    assert w.tokens.tolist() == [[7, 7, 9], [7, 7, 9], [11, 12, 9]] and w.warm
    w.reset(torch.tensor([7]), levels=3)
    assert w.warm
    for levels in (0, 4):
        with pytest.raises(ValueError, match=r"levels must be in \[1, 3\]"):
            w.reset(torch.tensor([7]), levels=levels)


def test_window_refills_from_a_list_as_from_a_tensor():
    source = torch.randint(0, 1000, (50,)).tolist()
    windows = []
    for given in (source, torch.tensor(source)):
        w = LookaheadWindow(window=5, ngram=4, generator=torch.Generator().manual_seed(3))
        w.reset(torch.tensor(source[:7]))
        for x, a in ((1, 0), (2, 0), (3, 2), (4, 4), (5, 1)):
            w.advance(x, torch.arange(5) + 10 * x, accepted=a, source=given)
        windows.append(w.tokens)
    assert torch.equal(windows[0], windows[1])


def test_window_ngram_2_is_warm_from_the_start():
    w = LookaheadWindow(window=2, ngram=2, generator=torch.Generator().manual_seed(0))
    w.reset(torch.tensor([4]))
    assert w.warm
    ngrams = w.advance(3, torch.tensor([8, 9]), accepted=0, source=torch.tensor([4]))
    assert ngrams.tolist() == [[3, 8], [4, 9]]
    assert w.tokens.tolist() == [[8, 9]]


def test_a_window_of_x_alone_gives_x_and_its_guess():
    w = LookaheadWindow(window=1, ngram=2, generator=torch.Generator().manual_seed(0))
    w.reset(torch.tensor([4, 5]))
    for x, out, a in ((3, 8, 0), (8, 9, 2), (7, 1, 5)):
        assert stack_step_tokens([w], [x], 1).tolist() == [[x]] and w.levels == 1
        assert w.advance(x, torch.tensor([out]), accepted=a, source=torch.tensor([6])).tolist() == [[x, out]]
        assert w.advance(x, torch.tensor([out]), accepted=a, source=torch.tensor([6]), ngrams=False) is None


def test_window_acceptance_beyond_width_refills_everything():
    w = LookaheadWindow(window=1, ngram=3, generator=torch.Generator().manual_seed(0))
    w.reset(torch.tensor([4]))
    w.advance(1, torch.tensor([2]), accepted=0, source=torch.tensor([6]))
    w.advance(1, torch.tensor([3]), accepted=2, source=torch.tensor([6]))
    assert w.tokens.tolist() == [[6], [6]]


# ---- pool ----------------------------------------------------------------------------------------------------
def test_pool_lru_order_dedup_and_capacity():
    pool = NGramPool(ngram=3, guess=2)
    pool.insert(torch.tensor([[1, 2, 3], [1, 4, 5], [1, 2, 3]]))  # the repeat moves (2, 3) to the newest end
    assert pool.lookup(1).tolist() == [[4, 5], [2, 3]]
    pool.insert(torch.tensor([[1, 6, 7]]))  # over capacity: the oldest, (4, 5), goes
    assert pool.lookup(1).tolist() == [[2, 3], [6, 7]]
    assert pool.lookup(9).shape == (0, 2)
    assert len(pool) == 2


def test_pool_from_sequence_and_disabled_pool():
    pool = NGramPool(ngram=2, guess=3)
    pool.insert_sequence(torch.tensor([5, 6, 5, 7]))
    assert pool.lookup(5).tolist() == [[6], [7]]
    off = NGramPool(ngram=2, guess=0)
    off.insert_sequence(torch.tensor([5, 6, 5, 7]))
    assert len(off) == 0


# ---- step builder --------------------------------------------------------------------------------------------
def test_build_step_packs_tokens_positions_and_rows():
    tree = DraftTree(torch.tensor([30, 31, 40, 41]), TreeShape.linear(2, 2), 4, [-1, 0, -1, 2], [[]] * 4, 2)
    step = build_step([100], torch.tensor([[5, 7, 9, 11, 12, 9]]), levels=2, window=3, trees=[tree], device="cpu")
    assert step.tokens.tolist() == [[5, 7, 9, 11, 12, 9, 30, 31, 40, 41]]
    assert step.positions.tolist() == [[100, 101, 102, 101, 102, 103, 101, 102, 101, 102]]
    assert (step.layout.window, step.layout.levels, step.layout.tree_size) == (3, 2, 4)
    assert step.layout.tree.end.tolist() == [2, 2, 4, 4]
    assert step.logits_rows.tolist() == [0, 3, 4, 5, 6, 7, 8, 9]
    assert (step.window_rows, step.node_rows) == (slice(1, 4), slice(4, 8))
    one = build_step([0], torch.tensor([[5, 7, 9]]), levels=1, window=3, trees=None, device="cpu")
    assert one.logits_rows.tolist() == [0, 1, 2] and one.window_rows == slice(0, 3)
    assert one.node_rows == slice(3, 3)


def test_build_step_batch_has_a_tree_per_row():
    chain = DraftTree(torch.tensor([30, 31, 32]), TreeShape.from_parents([-1, 0, 1]), 3, [-1, 0, 1], [[]] * 3, 3)
    star = DraftTree(torch.tensor([40, 41, 0]), TreeShape.from_parents([-1, -1, -1]), 2, [-1, -1], [[]] * 2, 1)
    step = build_step([10, 20], torch.tensor([[5], [6]]), levels=1, window=1, trees=[chain, star], device="cpu")
    assert step.tokens.tolist() == [[5, 30, 31, 32], [6, 40, 41, 0]]
    assert step.positions.tolist() == [[10, 11, 12, 13], [20, 21, 21, 21]]
    assert step.layout.tree.end.tolist() == [[3, 3, 3], [1, 2, 3]]
    assert step.num_nodes.tolist() == [3, 2] and step.positions[:, 0].tolist() == [10, 20]
    assert step.logits_tokens.tolist() == [[5, 30, 31, 32], [6, 40, 41, 0]]


def test_build_step_reuses_a_shape_s_constant_parts_unchanged():
    # The parts every step of a shape packs the same (rows read back, the window's offsets) are kept in the
    # caller's dict: later steps of that shape pack the same as without it, and nothing writes them.
    constants = {}
    for p, levels, window in ((100, 2, 3), (140, 2, 3), (7, 1, 1), (9, 1, 1)):
        trees = [DraftTree(torch.tensor([30, 31, 40, 41]), TreeShape.linear(2, 2), 4, [-1, 0, -1, 2], [[]] * 4, 2)]
        tokens = torch.arange(levels * window)[None] + 5
        kept = build_step([p], tokens, levels, window, trees, "cpu", constants)
        fresh = build_step([p], tokens, levels, window, trees, "cpu")
        for field in ("tokens", "positions", "logits_rows", "logits_tokens", "num_nodes"):
            assert torch.equal(getattr(kept, field), getattr(fresh, field)), field
    assert len(constants) == 2  # one entry a shape
    from lookahead.step import constant_parts

    for key, (rows, head) in constants.items():
        want_rows, want_head = constant_parts(*key)
        assert torch.equal(rows, want_rows) and torch.equal(head, want_head)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_upload_moves_a_step_s_inputs_in_one_block(device):
    from lookahead.step import upload

    host = [torch.arange(6).reshape(2, 3), torch.tensor([7]).expand(2, 4), torch.empty(0, dtype=torch.long)]
    moved = upload(host, device)
    assert [tuple(t.shape) for t in moved] == [(2, 3), (2, 4), (0,)]
    assert all(t.device.type == device and t.is_contiguous() for t in moved)
    assert [t.cpu().tolist() for t in moved] == [t.tolist() for t in host]


# ---- greedy verification -------------------------------------------------------------------------------------
def _onehot_logits(ids, vocab=10):
    out = torch.zeros(*torch.as_tensor(ids).shape, vocab)
    return out.scatter_(-1, torch.as_tensor(ids)[..., None], 1.0)


def test_verify_tree_greedy_hand_worked():
    # x's argmax is 3; tree: node 0 = 3 (-> node 1 = 5, node 2 = 6), node 3 = 4
    tree = TreeShape.from_parents([-1, 0, 0, -1])
    tokens = torch.tensor([[3, 5, 6, 4]])
    node_logits = _onehot_logits([[6, 1, 1, 1]])  # argmax after node 0 is 6: node 2 is accepted, then bonus 1
    a, path, emitted = verify_tree_greedy_reference(_onehot_logits([3]), node_logits, tokens, tree.end, None, 3)
    assert (a.tolist(), path.tolist(), emitted.tolist()) == ([2], [[0, 2, -1]], [[3, 6, 1, -1]])
    # the same tree with only the first two nodes real: node 2 is padding and never accepted
    a, path, emitted = verify_tree_greedy_reference(_onehot_logits([3]), node_logits, tokens, tree.end,
                                                   torch.tensor([2]), 3)
    assert (a.tolist(), emitted.tolist()) == ([1], [[3, 6, -1, -1]])


def test_attention_args_reject_empty_batch_and_short_cache():
    from lookahead_kernels import attention_torch

    layout = StepLayout(2, 1)
    q = torch.zeros(0, 2, 2, 4)
    kv = torch.zeros(0, 8, 2, 4)
    with pytest.raises(ValueError, match="batch of 0"):
        attention_torch(q, kv, kv, cache_len=torch.zeros(0, dtype=torch.long), layout=layout)
    q, kv = torch.zeros(1, 2, 2, 4), torch.zeros(1, 8, 2, 4)
    with pytest.raises(ValueError, match="cache too short"):
        attention_torch(q, kv, kv, cache_len=7, layout=layout)
