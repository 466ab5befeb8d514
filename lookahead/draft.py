"""One builder merges every guess source into one token tree per step, under a node budget.

Sources (``LookaheadConfig.sources``):

* ``pool``: the lookahead window's n-grams keyed by ``x`` (the original algorithm; ``lookahead.pools``);
* ``suffix``: what followed earlier occurrences of the sequence's last tokens (``lookahead.suffix``);
* ``successors``: the model's own top next tokens after each token (``lookahead.successors``), grown from any
  node of the tree.

Every proposed node carries an estimate of its *conditional* acceptance (the chance it is accepted once its
parent is), kept per source and depth (or successor rank) from what earlier steps accepted. A node's score is
the product along its path, the chance the verifier reaches it; the builder takes the ``budget`` best nodes
best-first from ``x``. Since scores only shrink along a path, a node is always taken after its parent, and the
expected number of accepted tokens, the sum of the taken scores, is as large as this model of acceptance allows.
Nothing here changes what is accepted, only what is offered, so greedy output stays the model's own.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq

import torch

from lookahead_kernels.tree import TreeShape

from .config import LookaheadConfig
from .successors import SuccessorTable
from .suffix import SuffixIndex

# Prior acceptance estimates and their weight in pseudo-trials: what a source is trusted with before any step.
_PRIOR_WEIGHT = 4.0
_SUFFIX_CANDIDATES = 4
_SUCCESSORS_PER_NODE = 8
_MAX_DEPTH_KEY = 8


# Successor probabilities are bucketed by these upper bounds; acceptance is learned per bucket.
_PROB_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)


def _prob_bucket(p: float) -> int:
    """The first bucket whose upper bound exceeds ``p`` (a bisection: it runs for every successor offered)."""
    return bisect.bisect_right(_PROB_BUCKETS, p)


def _prior(key: tuple) -> float:
    source = key[0]
    if source == "pool":
        return 0.3
    if source == "suffix":
        return 0.5
    return _PROB_BUCKETS[key[1]] * 0.8  # successors: about the model's own probability, a little less


class AcceptanceStats:
    """Running conditional acceptance per key: ``(source, depth)``, or ``("successors", probability bucket,
    depth)`` where the bucket is that of the probability the model gave the successor when it was recorded."""

    def __init__(self):
        self.tested: dict[tuple, int] = {}
        self.accepted: dict[tuple, int] = {}

    def rate(self, key: tuple) -> float:
        """Estimated chance a node of ``key`` is accepted once its parent is."""
        t, a = self.tested.get(key, 0), self.accepted.get(key, 0)
        return (a + _PRIOR_WEIGHT * _prior(key)) / (t + _PRIOR_WEIGHT)

    def record(self, key: tuple, accepted: bool) -> None:
        self.tested[key] = self.tested.get(key, 0) + 1
        self.accepted[key] = self.accepted.get(key, 0) + int(accepted)


@dataclasses.dataclass
class DraftTree:
    """One step's verification tree.

    Attributes:
        tokens: LongTensor ``[V]`` in depth-first pre-order (padding nodes hold token 0).
        shape: its :class:`TreeShape` (``depth``, ``end``).
        num_nodes: real nodes; ``num_nodes .. V-1`` are padding leaves.
        parents: per real node, its parent (``-1`` for children of ``x``).
        keys: per real node, the acceptance keys of the sources that proposed it.
    """

    tokens: torch.Tensor
    shape: TreeShape
    num_nodes: int
    parents: list[int]
    keys: list[list[tuple]]

    @property
    def sources(self) -> list[set]:
        """Per real node, the names of the sources that proposed it (the keys' first fields)."""
        return [{k[0] for k in keys} for keys in self.keys]

    @property
    def size(self) -> int:
        return self.shape.size


class _Node:
    __slots__ = ("token", "parent", "cond", "keys", "children", "depth", "index", "score")

    def __init__(self, token: int, parent, depth: int):
        self.token, self.parent, self.depth = token, parent, depth
        self.cond, self.keys, self.children = 0.0, [], {}
        self.index, self.score = -1, 0.0

    def child(self, token: int) -> "_Node":
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = _Node(token, self, self.depth + 1)
        return node

    def propose(self, key: tuple, rate: float) -> None:
        self.keys.append(key)
        self.cond = max(self.cond, rate)


class DraftBuilder:
    """Owns the guess sources of one sequence and builds each step's :class:`DraftTree`.

    Args:
        config: the lookahead parameters (sources, pool options).
        vocab_size: the model's vocabulary size.
        device: where the pool lives (``pool_backend="auto"`` picks from it).
        shape, sources: the resolved step shape and sources (default: the config's own).
        planner: a :class:`lookahead.controller.StepPlanner` that cuts each tree to the size that pays (``None``:
            every tree takes its whole budget).
    """

    def __init__(self, config: LookaheadConfig, vocab_size: int, device, *, shape=None, sources=None,
                 planner=None):
        self.config = config
        shape = shape if shape is not None else config.shape()
        sources = config.sources if sources is None else sources
        self.ngram = shape.ngram
        self.planner = planner
        self.pool = None
        if "pool" in sources and config.pool_guess > 0:
            from .pools import TableNGramPool, make_pool

            concrete = dataclasses.replace(config, window=shape.window, ngram=shape.ngram, max_step_tokens=None,
                                           guess=config.pool_guess, step_costs=None)
            self.pool = make_pool(concrete, vocab_size, device)
            # The model's own ids are in range: table pools skip the check (a host sync on CUDA).
            self._pool_unchecked = isinstance(self.pool, TableNGramPool)
        self.suffix = SuffixIndex() if "suffix" in sources else None
        self.successors = SuccessorTable(vocab_size, _SUCCESSORS_PER_NODE) if "successors" in sources else None
        self.stats = AcceptanceStats()

    # ---- the pool's inputs ------------------------------------------------------------------------------------
    def _pool_insert(self, ngrams: torch.Tensor) -> None:
        if self.pool is None or ngrams.numel() == 0:
            return
        if self._pool_unchecked:
            self.pool.insert(ngrams, check=False)
        else:
            self.pool.insert(ngrams)

    def start(self, prompt: torch.Tensor) -> None:
        """Called once with the prompt (1-D LongTensor) before the first step."""
        if self.pool is not None and self.config.pool_from_prompt:
            self.pool.insert_sequence(prompt.reshape(-1).cpu())

    # ---- building ---------------------------------------------------------------------------------------------
    def build(self, sequence: list[int], budget: int, pad: bool = False) -> DraftTree:
        """The tree for the step whose ``x`` is ``sequence[-1]``: at most ``budget`` nodes (exactly ``budget``
        with ``pad``, the extra ones padding)."""
        chosen = self.propose(sequence, budget)
        if self.planner is not None:  # best-first order: any prefix is a tree
            chosen = chosen[: self.planner.choose([n.score for n in chosen])]
        return self.encode(chosen, budget if pad else len(chosen))

    def propose(self, sequence: list[int], budget: int) -> list:
        """Up to ``budget`` candidate nodes for the step whose ``x`` is ``sequence[-1]``, best first (each after
        its parent, so any prefix is a tree); ``node.score`` is the chance the verifier reaches it. A batch cuts
        every row's list to one size (:meth:`lookahead.controller.StepPlanner.choose_batch`) before
        :meth:`encode`."""
        root = _Node(sequence[-1], None, 0)
        rate = self.stats.rate
        if budget > 0:
            if self.suffix is not None:
                for cont, _match in self.suffix.matches(sequence, _SUFFIX_CANDIDATES):
                    node = root
                    for d, t in enumerate(cont, start=1):
                        node = node.child(t)
                        node.propose(("suffix", min(d, _MAX_DEPTH_KEY)), rate(("suffix", min(d, _MAX_DEPTH_KEY))))
            if self.pool is not None:
                for cont in self.pool.lookup(root.token).tolist():
                    node = root
                    for d, t in enumerate(cont, start=1):
                        node = node.child(t)
                        node.propose(("pool", d), rate(("pool", d)))
        return self._best_first(root, budget)

    def _expand_successors(self, node: _Node) -> None:
        if self.successors is None:
            return
        depth = min(node.depth + 1, 4)
        for t, p in self.successors.successors(node.token):
            key = ("successors", _prob_bucket(p), depth)
            node.child(t).propose(key, self.stats.rate(key))

    def _best_first(self, root: _Node, budget: int) -> list[_Node]:
        chosen: list[_Node] = []
        heap: list = []
        counter = 0  # ties: first proposed first
        node, node.score = root, 1.0
        while True:
            if node is not root:
                chosen.append(node)
                if len(chosen) >= budget:
                    break
            self._expand_successors(node)
            for child in node.children.values():
                child.score = node.score * child.cond
                heapq.heappush(heap, (-child.score, counter, child))
                counter += 1
            if not heap or budget == 0:
                break
            node = heapq.heappop(heap)[2]
        return chosen

    @staticmethod
    def encode(chosen: list, size: int) -> DraftTree:
        """The tree of ``chosen`` (a prefix of :meth:`propose`'s list): pre-order numbering (children best first),
        padded with leaves to ``size`` nodes."""
        taken = set(map(id, chosen))
        kids: dict[int, list[_Node]] = {}
        roots = []
        for n in chosen:  # chosen is best-first, so each list is best first too
            (roots if n.parent is None or n.parent.parent is None else kids.setdefault(id(n.parent), [])).append(n)
        order: list[_Node] = []
        stack = list(reversed(roots))
        while stack:
            n = stack.pop()
            n.index = len(order)
            order.append(n)
            stack.extend(reversed([c for c in kids.get(id(n), []) if id(c) in taken]))
        parents = [-1 if n.parent.parent is None else n.parent.index for n in order]
        real = len(order)
        tokens = [n.token for n in order] + [0] * (size - real)
        shape = TreeShape.from_parents(parents + [-1] * (size - real))
        return DraftTree(torch.tensor(tokens, dtype=torch.long), shape, real, parents,
                         [n.keys for n in order])

    # ---- after the step ---------------------------------------------------------------------------------------
    def observe(self, tree: DraftTree, path: list[int], ngrams: torch.Tensor | None, sequence: list[int],
                emitted: int, logits_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Learn from a verified step.

        Args:
            tree: the step's tree.
            path: the accepted nodes, root first.
            ngrams: the window's n-grams ``[W, N]`` (``None`` while warming up).
            sequence: the committed sequence, this step's emitted tokens included.
            emitted: tokens this step committed (accepted + bonus, fewer when a stop cut them).
            logits_rows: ``(tokens [R], logits [R, vocab])`` the step computed, for the successor table; the
                rows of ``x`` and the accepted path last, so that rows seen in their true context win.
        """
        accepted = set(path)
        # A node was tested iff its parent was accepted (or it hangs from x): those are the trials.
        for i in range(tree.num_nodes):
            p = tree.parents[i]
            if p == -1 or p in accepted:
                for key in tree.keys[i]:
                    self.stats.record(key, i in accepted)
        if ngrams is not None:
            self._pool_insert(ngrams)
        if self.pool is not None and self.config.pool_from_output:
            n = self.ngram
            start = max(len(sequence) - emitted, n - 1)
            if start < len(sequence):
                self._pool_insert(torch.tensor([sequence[e - n + 1: e + 1] for e in range(start, len(sequence))],
                                               dtype=torch.long))
        if self.successors is not None and logits_rows is not None:
            self.successors.update(*logits_rows)
