"""One builder merges every guess source into one token tree per step, under a node budget.

Sources (``LookaheadConfig.sources``):

* ``pool``: the lookahead window's n-grams keyed by ``x`` (the original algorithm; ``lookahead.pools``);
* ``suffix``: what followed earlier occurrences of the sequence's last tokens (``lookahead.suffix``);
* ``successors``: the model's own top next tokens after each token (``lookahead.successors``), grown from any
  node of the tree.

Every proposed node carries an estimate of its *conditional* acceptance (the chance it is accepted once its
parent is), kept per source and depth (or successor probability), apart for nodes that several sources propose,
from what earlier steps accepted and priors measured on held-out prompts. A node's score is
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

from lookahead_kernels.cpu_ops import host_ops
from lookahead_kernels.tree import TreeShape

from .config import LookaheadConfig
from .memory import DraftMemory, merged_matches
from .pools import NO_ROWS, lookup_rows
from .successors import SuccessorTable
from .suffix import SuffixIndex, flatten_matches, shared_limits, span_inputs, suffix_spans

# Prior acceptance estimates and their weight in pseudo-trials: what a source is trusted with before any step.
_PRIOR_WEIGHT = 4.0
SUFFIX_CANDIDATES = 4
# Continuations a draft memory adds beside the row's own (lookahead.memory).
MEMORY_CANDIDATES = 2
SUCCESSORS_PER_NODE = 8
_MAX_DEPTH_KEY = 8
_MAX_SUCCESSOR_DEPTH = 4
_MAX_POOL_DEPTH_KEY = 63


# Successor probabilities are bucketed by these upper bounds; acceptance is learned per bucket.
_PROB_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.01)


def _prob_bucket(p: float) -> int:
    """The first bucket whose upper bound exceeds ``p`` (a bisection: it runs for every successor offered)."""
    return min(bisect.bisect_right(_PROB_BUCKETS, p), len(_PROB_BUCKETS) - 1)


# A suffix match's length says how far its continuation is to be trusted: on the dev sets a one-token match's
# first token was the model's in 16-23% of steps, an eight-token match's in 92-94% (bench/results/suffix-match-
# cpu.md). Acceptance is learned per class of match length: 1, 2-3, 4-7, 8 or more (each class's shortest).
_MATCH_CLASSES = (1, 2, 4, 8)


def _match_class(match: int) -> int:
    return bisect.bisect_right(_MATCH_CLASSES, match) - 1


# Acceptance keys as small integer codes, shared with the C++ builder (csrc/draft_tree.cpp): pool depth d ->
# min(d, 63); suffix match class c at depth d -> 64 + 8 c + min(d, 8) - 1; successor of bucket b at depth d ->
# 96 + 4 b + min(d, 4) - 1; each plus AGREED (144) for a node that more than one source proposed. Why apart: a
# node's trials count for each of its codes, and nodes two sources agree on are accepted far more often. On 16
# MT-Bench prompts a successor that no suffix match proposed was accepted at 0.03-0.12 where one rate for both
# estimated 0.08-0.28, while those a match proposed too came true at about their estimate (session 41).
_SUFFIX_BASE = _MAX_POOL_DEPTH_KEY + 1
_SUCCESSOR_BASE = _SUFFIX_BASE + len(_MATCH_CLASSES) * _MAX_DEPTH_KEY
AGREED = _SUCCESSOR_BASE + _MAX_SUCCESSOR_DEPTH * len(_PROB_BUCKETS)
NUM_CODES = 2 * AGREED


def _source_bit(code: int) -> int:
    """The bit of the source a one-source code belongs to (pool 1, suffix 2, successors 4)."""
    return 1 if code < _SUFFIX_BASE else 2 if code < _SUCCESSOR_BASE else 4


def pool_code(depth: int) -> int:
    return min(depth, _MAX_POOL_DEPTH_KEY)


def suffix_code(match: int, depth: int) -> int:
    """A node ``depth`` tokens into the continuation of a suffix match of ``match`` tokens."""
    return _SUFFIX_BASE + _MAX_DEPTH_KEY * _match_class(match) + min(depth, _MAX_DEPTH_KEY) - 1


def successor_code(bucket: int, depth: int) -> int:
    return _SUCCESSOR_BASE + _MAX_SUCCESSOR_DEPTH * bucket + min(depth, _MAX_SUCCESSOR_DEPTH) - 1


def code_key(code: int) -> tuple:
    """The readable key of a code: ``("pool", depth)``, ``("suffix", match, depth)`` (``match``: the shortest
    match of its class, 1, 2, 4 or 8) or ``("successors", bucket, depth)``, followed by ``"agreed"`` where
    another source proposed the node too."""
    if code >= AGREED:
        return code_key(code - AGREED) + ("agreed",)
    if code < _SUFFIX_BASE:
        return ("pool", code)
    if code < _SUCCESSOR_BASE:
        match_class, depth = divmod(code - _SUFFIX_BASE, _MAX_DEPTH_KEY)
        return ("suffix", _MATCH_CLASSES[match_class], depth + 1)
    bucket, depth = divmod(code - _SUCCESSOR_BASE, _MAX_SUCCESSOR_DEPTH)
    return ("successors", bucket, depth + 1)


def key_code(key: tuple) -> int:
    """The code of a readable key (:func:`code_key`'s inverse)."""
    if key[-1] == "agreed":
        return key_code(key[:-1]) + AGREED
    if key[0] == "pool":
        return pool_code(key[1])
    if key[0] == "suffix":
        return suffix_code(key[1], key[2])
    return successor_code(key[1], key[2])


# Priors: where a call's learning starts, and with few trials per key (a call of 128 tokens tests a few dozen
# nodes) most of what it plans with. Rounded down from the rates of every node whose parent was on the true path,
# taken or not (what the planner weighs), on held-out dev prompts (MT-Bench 16-39, HumanEval 16-49, SmolLM2,
# greedy; session 41). Per match class, a suffix continuation's first token and those after it, alone and where
# another source proposed the node too:
_SUFFIX_PRIORS = {1: (0.13, 0.45), 2: (0.4, 0.6), 4: (0.6, 0.7), 8: (0.8, 0.85)}
_SUFFIX_AGREED_PRIORS = {1: (0.25, 0.55), 2: (0.5, 0.7), 4: (0.75, 0.75), 8: (0.9, 0.9)}
# A successor came true at about half the probability the model gave it where it was recorded (another context)
# when alone (0.45x the bucket's upper bound; before: 0.8x, which lone successors missed 2-4x as often as
# expected), and more often where a suffix match proposed it too.
_SUCCESSOR_PRIOR_SCALE = 0.45
_SUCCESSOR_AGREED_PRIOR_SCALE, _SUCCESSOR_AGREED_PRIOR_FLOOR = 0.6, 0.2


def _prior(code: int) -> float:
    agreed = code >= AGREED
    key = code_key(code % AGREED)
    if key[0] == "pool":
        return 0.3
    if key[0] == "suffix":
        first, later = (_SUFFIX_AGREED_PRIORS if agreed else _SUFFIX_PRIORS)[key[1]]
        return first if key[2] == 1 else later
    upper = min(_PROB_BUCKETS[key[1]], 1.0)
    if agreed:
        return max(_SUCCESSOR_AGREED_PRIOR_FLOOR, _SUCCESSOR_AGREED_PRIOR_SCALE * upper)
    return _SUCCESSOR_PRIOR_SCALE * upper


# Every code's prior, worked out once: each row's statistics start from them (0.25 ms a row when each builder
# worked them out again, a tenth of a millisecond a step where a batch refills its rows).
_PRIORS = tuple(_prior(c) for c in range(NUM_CODES))
# The same as a tensor, copied by each row's statistics (made from the tuple, 30 us a row here: a sixth of a 16-row
# batch's start on the H200 machine's host). Never written.
_PRIOR_RATES = torch.tensor(_PRIORS, dtype=torch.float64)


class AcceptanceStats:
    """Running conditional acceptance per key: ``("pool", depth)``, ``("suffix", match class, depth)``, or
    ``("successors", probability bucket, depth)`` where the bucket is that of the probability the model gave the
    successor when it was recorded; each apart (key + ``("agreed",)``) for nodes several sources proposed.

    Kept per key code (:func:`key_code`): ``trials`` (int64 ``[2, NUM_CODES]``: nodes tested, nodes accepted) and
    ``rates`` (float64 ``[NUM_CODES]``), which the C++ ops read (``lookahead_draft.propose``) and write
    (``lookahead_draft.record_trials``, :func:`record_trials`) in place."""

    def __init__(self):
        self.trials = torch.zeros(2, NUM_CODES, dtype=torch.long)
        self.rates = _PRIOR_RATES.clone()
        # Written through NumPy views of the same memory: a tensor's item assignment costs microseconds.
        self._trials, self._rates = self.trials.numpy(), self.rates.numpy()

    @property
    def tested(self) -> dict[tuple, int]:
        """Trials per readable key (keys never tried left out)."""
        return {code_key(c): n for c, n in enumerate(self._trials[0].tolist()) if n}

    @property
    def accepted(self) -> dict[tuple, int]:
        """Acceptances per readable key tried."""
        tested, accepted = self._trials.tolist()
        return {code_key(c): accepted[c] for c, n in enumerate(tested) if n}

    def rate(self, key: tuple) -> float:
        """Estimated chance a node of ``key`` is accepted once its parent is."""
        return float(self.rates[key_code(key)])

    def record(self, key: tuple, accepted: bool) -> None:
        self.record_code(key_code(key), accepted)

    def record_code(self, code: int, accepted: bool) -> None:
        """One trial of ``code`` (the reference of ``lookahead_draft.record_trials``' arithmetic)."""
        tested, hits = self._trials[0, code] + 1, self._trials[1, code] + int(accepted)
        self._trials[0, code], self._trials[1, code] = tested, hits
        self._rates[code] = (int(hits) + _PRIOR_WEIGHT * _PRIORS[code]) / (int(tested) + _PRIOR_WEIGHT)


@dataclasses.dataclass
class Proposal:
    """One row's candidate nodes for a step, best first (each after its parent, so any prefix is a tree).

    Attributes:
        tokens: LongTensor ``[n]``.
        parents: LongTensor ``[n]``: each node's parent as an index into this list (``-1`` under ``x``).
        scores: per node the chance the verifier reaches it (the product of conditional acceptances on its path).
        codes, code_offsets: LongTensors ``[m]`` and ``[n + 1]``: node ``i``'s acceptance key codes (one per
            source that proposed it) are ``codes[code_offsets[i]:code_offsets[i + 1]]``.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: list
    codes: torch.Tensor
    code_offsets: torch.Tensor

    def __len__(self) -> int:
        return len(self.scores)

    @classmethod
    def empty(cls) -> "Proposal":
        none = torch.empty(0, dtype=torch.long)
        return cls(none, none, [], none, torch.zeros(1, dtype=torch.long))


@dataclasses.dataclass
class Proposals:
    """Every row's :class:`Proposal` for one step, one row's nodes after another's (as the C++ builder returns
    them: one tensor per field for the batch, not per row).

    Attributes:
        tokens, parents: LongTensors ``[N]``: each node's token and parent (an index into its own row's list,
            ``-1`` under ``x``).
        scores: per row, its nodes' scores (lists of floats).
        codes, code_offsets: LongTensors ``[M]`` and ``[N + 1]``: node ``j``'s acceptance key codes are
            ``codes[code_offsets[j]:code_offsets[j + 1]]``.
        starts: per row, the index of its first node, then ``N`` (``len(rows) + 1`` entries).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    scores: list
    codes: torch.Tensor
    code_offsets: torch.Tensor
    starts: list

    def __len__(self) -> int:
        return len(self.scores)

    def row(self, i: int) -> Proposal:
        a, b = self.starts[i], self.starts[i + 1]
        offsets = self.code_offsets[a: b + 1]
        first = int(offsets[0])
        return Proposal(self.tokens[a:b], self.parents[a:b], self.scores[i],
                        self.codes[first: int(offsets[-1])], offsets - first)

    @classmethod
    def concat(cls, rows: list[Proposal]) -> "Proposals":
        starts, offsets, base = [0], [torch.zeros(1, dtype=torch.long)], 0
        for p in rows:
            starts.append(starts[-1] + len(p))
            offsets.append(p.code_offsets[1:] + base)
            base += int(p.code_offsets[-1])
        none = torch.empty(0, dtype=torch.long)
        return cls(torch.cat([none] + [p.tokens for p in rows]), torch.cat([none] + [p.parents for p in rows]),
                   [p.scores for p in rows], torch.cat([none] + [p.codes for p in rows]), torch.cat(offsets), starts)


class DraftTree:
    """One step's verification tree.

    Attributes:
        tokens: LongTensor ``[V]`` in depth-first pre-order (padding nodes hold token 0).
        shape: its :class:`TreeShape` (``depth``, ``end``).
        num_nodes: real nodes; ``num_nodes .. V-1`` are padding leaves.
        parents: per real node, its parent (``-1`` for children of ``x``).
        codes: per real node, the acceptance key codes of the sources that proposed it (:func:`code_key`).
        max_depth: the deepest real node's depth (0 for no node).

    A tree :func:`encode_rows` makes reads ``tokens``, ``shape`` and ``codes`` off the batch's tensors and lists
    when first asked (a step's learning reads the codes of the tested nodes only: :meth:`node_codes`): making
    each row's views and lists up front cost a 16-row batch a tenth of a millisecond a step.
    """

    def __init__(self, tokens: torch.Tensor, shape: TreeShape, num_nodes: int, parents: list[int],
                 codes: list[list[int]], max_depth: int):
        self._tokens, self._shape, self._codes = tokens, shape, codes
        self.num_nodes, self.parents, self.max_depth = num_nodes, parents, max_depth
        self._row = None  # (tokens [B, V], depth [B, V], end [B, V], b): where tokens and shape are read from
        self._code_source = None  # (_BatchEncoding, first, at): node i's codes, read on demand

    @classmethod
    def _in_batch(cls, row: tuple, num_nodes: int, parents: list[int], max_depth: int,
                  code_source: tuple) -> "DraftTree":
        tree = cls(None, None, num_nodes, parents, None, max_depth)
        tree._row, tree._code_source = row, code_source
        return tree

    @property
    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = self._row[0][self._row[3]]
        return self._tokens

    @property
    def shape(self) -> TreeShape:
        if self._shape is None:
            _tokens, depth, end, b = self._row
            self._shape = TreeShape.trusted(depth[b], end[b])
        return self._shape

    def node_codes(self, i: int) -> list[int]:
        """Real node ``i``'s acceptance key codes."""
        if self._codes is not None:
            return self._codes[i]
        encoding, first, at = self._code_source
        codes, offsets, order = encoding.lists()
        j = first + order[at + i]
        return codes[offsets[j]: offsets[j + 1]]

    @property
    def codes(self) -> list[list[int]]:
        if self._codes is None:
            self._codes = [self.node_codes(i) for i in range(self.num_nodes)]
        return self._codes

    @property
    def keys(self) -> list[list[tuple]]:
        """Per real node, its readable acceptance keys."""
        return [[code_key(c) for c in codes] for codes in self.codes]

    @property
    def sources(self) -> list[set]:
        """Per real node, the names of the sources that proposed it (the keys' first fields)."""
        return [{k[0] for k in keys} for keys in self.keys]

    @property
    def size(self) -> int:
        return self._row[2].shape[-1] if self._shape is None else self._shape.size


def _exclusive_conds(children: list) -> list[float]:
    """The children's chances of acceptance once their parent is, capped so that they sum to at most 1: at most
    one child of a node is accepted, so estimates that sum higher (three suffix candidates at a prior of 0.5 each,
    counted as 1.5 tokens) overstate what the step gains. The best first (ties in the order proposed), each capped
    at what those above it leave; the C++ builder does the same, double for double."""
    conds = [c.cond for c in children]
    if len(conds) < 2:
        return conds
    left = 1.0
    for i in sorted(range(len(conds)), key=lambda i: -conds[i]):
        conds[i] = min(conds[i], left)
        left -= conds[i]
    return conds


class _Node:
    __slots__ = ("token", "parent", "cond", "codes", "sources", "children", "depth", "index", "score")

    def __init__(self, token: int, parent, depth: int):
        self.token, self.parent, self.depth = token, parent, depth
        self.cond, self.codes, self.sources, self.children = 0.0, [], 0, {}
        self.index, self.score = -1, 0.0

    def child(self, token: int) -> "_Node":
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = _Node(token, self, self.depth + 1)
        return node

    def propose(self, code: int) -> None:
        self.codes.append(code)
        self.sources |= _source_bit(code)

    @property
    def keys(self) -> list[int]:
        """The codes as learned: + ``AGREED`` where several sources proposed the node (final once its parent is
        expanded: continuations come first, the parent's successors then)."""
        offset = AGREED if self.sources & (self.sources - 1) else 0
        return [c + offset for c in self.codes]

    def estimate(self, rates: list[float]) -> None:
        """The best estimate among the node's codes (0 without one)."""
        self.cond = max([0.0] + [rates[c] for c in self.keys])


class DraftBuilder:
    """Owns the guess sources of one sequence and builds each step's :class:`DraftTree`.

    Args:
        config: the lookahead parameters (sources, pool options).
        vocab_size: the model's vocabulary size.
        shape, sources: the resolved step shape and sources (default: the config's own).
        planner: a :class:`lookahead.controller.StepPlanner` that cuts each tree to the size that pays (``None``:
            every tree takes its whole budget).
        native: build with the C++ ops (``csrc/draft_tree.cpp``); ``None`` (default): where they build. ``False``
            runs the Python reference below, which makes the same trees (``tests/test_draft_native.py``).
        memory: a :class:`lookahead.memory.DraftMemory` whose earlier calls' text joins the suffix source.
        successors: the :class:`lookahead.successors.SuccessorTable` to read and fill, shared with other builders
            (a memory's, :meth:`lookahead.memory.DraftMemory.successor_table`); ``None``: a new one of its own.
    """

    def __init__(self, config: LookaheadConfig, vocab_size: int, *, shape=None, sources=None,
                 planner=None, native: bool | None = None, memory: DraftMemory | None = None,
                 successors: SuccessorTable | None = None):
        self.config = config
        shape = shape if shape is not None else config.shape()
        sources = config.sources if sources is None else sources
        self.ngram = shape.ngram
        self.planner = planner
        if native is None:
            from lookahead_kernels.cpu_ops import cpu_ops_available

            native = cpu_ops_available()
        self.native = native
        self.pool = None
        if "pool" in sources and config.pool_guess > 0:
            from .pools import make_pool

            concrete = dataclasses.replace(config, window=shape.window, ngram=shape.ngram, max_step_tokens=None,
                                           guess=config.pool_guess, step_costs=None)
            self.pool = make_pool(concrete, vocab_size)
        self.suffix = SuffixIndex() if "suffix" in sources else None
        # Earlier calls' text, whose matches join the suffix source's (lookahead.memory).
        self.memory = memory if self.suffix is not None else None
        self.vocab_size = vocab_size
        if successors is not None and (successors.vocab_size, successors.k) != (vocab_size, SUCCESSORS_PER_NODE):
            raise ValueError(f"DraftBuilder: a shared successor table must have vocab_size={vocab_size} and "
                             f"k={SUCCESSORS_PER_NODE}, got {successors.vocab_size} and {successors.k}")
        self.successors = None if "successors" not in sources else \
            successors if successors is not None else SuccessorTable(vocab_size, SUCCESSORS_PER_NODE)
        self.stats = AcceptanceStats()

    # ---- the pool's inputs ------------------------------------------------------------------------------------
    @property
    def learns_ngrams(self) -> bool:
        """Whether :meth:`observe` does anything with the window's n-grams (they feed the pool)."""
        return self.pool is not None

    def _pool_insert(self, ngrams: torch.Tensor) -> None:
        if self.pool is None or ngrams.numel() == 0:
            return
        self.pool.insert(ngrams)

    def start(self, prompt) -> None:
        """Called once with the prompt (a list of ints or a 1-D LongTensor) before the first step."""
        if self.pool is not None and self.config.pool_from_prompt:
            self.pool.insert_sequence(torch.as_tensor(prompt, dtype=torch.long).reshape(-1).cpu())

    # ---- building ---------------------------------------------------------------------------------------------
    def build(self, sequence: list[int], budget: int, pad: bool = False) -> DraftTree:
        """The tree for the step whose ``x`` is ``sequence[-1]``: at most ``budget`` nodes (exactly ``budget``
        with ``pad``, the extra ones padding)."""
        proposal = self.propose(sequence, budget)
        keep = len(proposal)
        if self.planner is not None:  # best-first order: any prefix is a tree
            keep = self.planner.choose(proposal.scores)
        return self.encode(proposal, keep, budget if pad else keep)

    def _candidates(self, sequence: list[int], budget: int) -> tuple[list[tuple], torch.Tensor]:
        """The suffix matches of ``x``, best first, as ``(continuation, match length)`` (the continuation a tuple
        of tokens), and the pool's continuations (int64 ``[C, L]`` on the CPU, a row read until its first negative
        entry)."""
        if budget == 0:
            return [], NO_ROWS
        suffix = []
        if self.suffix is not None:
            suffix = self.suffix.matches(sequence, SUFFIX_CANDIDATES)
        if self.memory is not None:
            suffix = merged_matches(suffix, self.memory.matches(sequence, MEMORY_CANDIDATES, self.vocab_size))
        return suffix, lookup_rows([self.pool], [sequence[-1]])[0]  # as propose_rows looks a batch's rows up

    def propose(self, sequence: list[int], budget: int) -> Proposal:
        """Up to ``budget`` candidate nodes for the step whose ``x`` is ``sequence[-1]``, best first (each after
        its parent, so any prefix is a tree), with the chance the verifier reaches each. A batch proposes for
        every row at once (:func:`propose_rows`) and cuts every row's list to one size
        (:meth:`lookahead.controller.StepPlanner.choose_batch`) before :func:`encode_rows`."""
        return propose_rows([self], [sequence], budget).row(0)

    # ---- the Python reference of the C++ builder ------------------------------------------------------------
    def _propose_reference(self, root_token: int, suffix: list[tuple], pool: torch.Tensor, budget: int) -> Proposal:
        root = _Node(root_token, None, 0)
        rates = self.stats.rates.tolist()  # indexed per proposal: a list, not the tensor
        continuations = [(cont, [suffix_code(match, d) for d in range(1, len(cont) + 1)]) for cont, match in suffix]
        continuations += [(cont, [pool_code(d) for d in range(1, len(cont) + 1)]) for cont in pool.tolist()]
        for cont, codes in continuations:
            node = root
            for t, code in zip(cont, codes):
                if t < 0:
                    break
                node = node.child(t)
                node.propose(code)
        chosen = self._best_first(root, budget, rates)
        for i, n in enumerate(chosen):
            n.index = i
        codes = [c for n in chosen for c in n.keys]
        offsets = [0]
        for n in chosen:
            offsets.append(offsets[-1] + len(n.keys))
        return Proposal(torch.tensor([n.token for n in chosen], dtype=torch.long),
                        torch.tensor([-1 if n.parent.parent is None else n.parent.index for n in chosen],
                                     dtype=torch.long),
                        [n.score for n in chosen], torch.tensor(codes, dtype=torch.long),
                        torch.tensor(offsets, dtype=torch.long))

    def _expand_successors(self, node: _Node) -> None:
        if self.successors is None:
            return
        depth = min(node.depth + 1, _MAX_SUCCESSOR_DEPTH)
        for t, p in self.successors.successors(node.token):
            code = successor_code(_prob_bucket(p), depth)
            node.child(t).propose(code)

    def _best_first(self, root: _Node, budget: int, rates: list[float]) -> list[_Node]:
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
            children = list(node.children.values())
            for child in children:
                child.estimate(rates)
            for child, cond in zip(children, _exclusive_conds(children)):
                child.score = node.score * cond
                heapq.heappush(heap, (-child.score, counter, child))
                counter += 1
            if not heap or budget == 0:
                break
            node = heapq.heappop(heap)[2]
        return chosen

    def encode(self, proposal: Proposal, keep: int, size: int) -> DraftTree:
        """The tree of the first ``keep`` nodes of ``proposal``: pre-order numbering (children best first), padded
        with leaves to ``size`` nodes (a batch encodes every row at once: :func:`encode_rows`)."""
        return encode_rows(Proposals.concat([proposal]), [0], [keep], size, self.native).trees[0]

    # ---- after the step ---------------------------------------------------------------------------------------
    def observe(self, tree: DraftTree, path: list[int], ngrams: torch.Tensor | None, sequence: list[int],
                emitted: int) -> None:
        """Learn from a verified step (the successor table learns from the step's logits beside this, for every
        row of a batch at once: :func:`lookahead.successors.record_step`; a batch records its rows' trials at once
        too, :func:`record_trials`, and each row's n-grams with :meth:`learn_ngrams`).

        Args:
            tree: the step's tree.
            path: the accepted nodes, root first.
            ngrams: the window's n-grams ``[W, N]`` (``None`` while warming up).
            sequence: the committed sequence, this step's emitted tokens included.
            emitted: tokens this step committed (accepted + bonus, fewer when a stop cut them).
        """
        record_trials_reference(self.stats, tree, path)
        self.learn_ngrams(ngrams, sequence, emitted)

    def learn_ngrams(self, ngrams: torch.Tensor | None, sequence: list[int], emitted: int) -> None:
        """:meth:`observe`'s n-grams into the pool: the window's, and the committed output's."""
        if ngrams is not None:
            self._pool_insert(ngrams)
        if self.pool is not None and self.config.pool_from_output:
            n = self.ngram
            start = max(len(sequence) - emitted, n - 1)
            if start < len(sequence):
                self._pool_insert(torch.tensor([sequence[e - n + 1: e + 1] for e in range(start, len(sequence))],
                                               dtype=torch.long))


_NO_TABLE = torch.empty(0, dtype=torch.int32)


def propose_rows(builders: list[DraftBuilder], sequences: list[list[int]], budget: int) -> Proposals:
    """:meth:`DraftBuilder.propose` for several rows (builder ``i`` for ``sequences[i]``): where every builder is
    native, in one C++ call, the rows' suffix matches included unless a draft memory's join them."""
    if not all(b.native for b in builders):  # the reference makes the same proposals (tests/test_draft_native.py)
        return Proposals.concat([b._propose_reference(seq[-1], *b._candidates(seq, budget), budget)
                                 for b, seq in zip(builders, sequences)])
    matched = [i for i, b in enumerate(builders) if b.suffix is not None] if budget else []
    roots = [seq[-1] for seq in sequences]
    pools = lookup_rows([b.pool for b in builders], roots) if budget else [NO_ROWS] * len(builders)
    rates, index, entries = _row_tensors(builders)
    indexes = [builders[i].suffix for i in matched]
    limits = shared_limits(indexes)
    if limits is not None and all(builders[i].memory is None for i in matched):
        # The matches found and proposed from in one call (the same matches as suffix_spans', never made lists).
        out = host_ops().propose_matched(roots, *span_inputs(indexes, [sequences[i] for i in matched]), matched,
                                         *limits, SUFFIX_CANDIDATES, pools, rates, index, entries, budget)
    else:
        span_tokens, span_lens, span_matches, found = suffix_spans(indexes, [sequences[i] for i in matched],
                                                                   SUFFIX_CANDIDATES)
        span_counts = [0] * len(builders)  # rows without the suffix source: none
        for i, count in zip(matched, found):
            span_counts[i] = count
        if any(builders[i].memory is not None for i in matched):
            span_tokens, span_lens, span_matches = _with_memory(builders, sequences, span_tokens, span_lens,
                                                                span_matches, span_counts)
        out = host_ops().propose(roots, span_tokens, span_lens, span_matches, span_counts, pools, rates, index,
                                 entries, budget)
    tokens, parents, scores, codes, offsets, row_counts = out
    scores, starts = scores.tolist(), [0]
    for n in row_counts.tolist():
        starts.append(starts[-1] + n)
    return Proposals(tokens, parents, [scores[a:b] for a, b in zip(starts, starts[1:])], codes, offsets, starts)


def _row_tensors(builders: list[DraftBuilder]) -> tuple[list, list, list]:
    """Each row's acceptance rates and successor table (index, entries; empty tensors for a row without one, or
    whose table was never written), as the C++ builder reads them."""
    rates, index, entries = [], [], []
    for b in builders:
        rates.append(b.stats.rates)
        table = b.successors
        made = None if table is None else table.tensors  # None until first written: read as empty
        if made is None:
            index.append(_NO_TABLE)
            entries.append(_NO_TABLE)
        else:
            index.append(made[0])
            entries.append(made[1])
    return rates, index, entries


def _with_memory(builders: list[DraftBuilder], sequences: list[list[int]], tokens: list[int], lens: list[int],
                 matches: list[int], counts: list[int]) -> tuple[list[int], list[int], list[int]]:
    """The rows' flattened suffix spans (:func:`lookahead.suffix.suffix_spans`' layout, ``counts`` per builder)
    with each memory's matches merged into its row's (:func:`lookahead.memory.merged_matches`); ``counts`` is
    updated in place."""
    rows, at, span = [], 0, 0
    for builder, sequence, count in zip(builders, sequences, counts):
        own = []
        for length, match in zip(lens[span: span + count], matches[span: span + count]):
            own.append((tuple(tokens[at: at + length]), match))
            at += length
        span += count
        if builder.memory is not None:
            own = merged_matches(own, builder.memory.matches(sequence, MEMORY_CANDIDATES, builder.vocab_size))
        rows.append(own)
    tokens, lens, matches, counts[:] = flatten_matches(rows)
    return tokens, lens, matches


class DraftTrees:
    """One step's trees for every row of a batch, all of one size ``V``.

    Attributes:
        tokens, depth, end: int64 ``[B, V]``: the rows' tokens and tree encodings, stacked for the step.
        num_nodes: per row, its tree's real nodes.
        encoding: where the C++ ops encoded the trees, what :func:`record_trials` reads (``None``: the Python
            encoding).
        trees: per row its :class:`DraftTree` (whose ``tokens`` and ``shape`` are rows of the tensors above), made
            when first asked for: a step that records its trials in C++ needs none (16 rows' objects were about
            30 us of a batch step, line-profiled).
    """

    __slots__ = ("tokens", "depth", "end", "num_nodes", "encoding", "_trees", "_make")

    def __init__(self, trees, tokens: torch.Tensor, depth: torch.Tensor, end: torch.Tensor, num_nodes: list[int],
                 encoding: "_BatchEncoding | None" = None):
        """``trees``: the rows' :class:`DraftTree` list, or a function that makes it."""
        self.tokens, self.depth, self.end, self.num_nodes, self.encoding = tokens, depth, end, num_nodes, encoding
        self._trees, self._make = (None, trees) if callable(trees) else (trees, None)

    @property
    def trees(self) -> list[DraftTree]:
        if self._trees is None:
            self._trees = self._make()
        return self._trees

    @classmethod
    def stack(cls, trees: list[DraftTree]) -> "DraftTrees":
        return cls(trees, torch.stack([t.tokens for t in trees]), torch.stack([t.shape.depth for t in trees]),
                   torch.stack([t.shape.end for t in trees]), [t.num_nodes for t in trees])


def encode_rows(proposals: Proposals, picks: list[int], keeps: list[int], size: int, native: bool) -> DraftTrees:
    """Row ``b``'s tree of the first ``keeps[b]`` nodes of row ``picks[b]`` of ``proposals`` (``-1``: none, with
    ``keeps[b] == 0``): pre-order numbering (children best first), padded with leaves to ``size`` nodes; with
    ``native``, every row in one C++ call."""
    if not native:
        return DraftTrees.stack([_encode_one(proposals.row(i) if i >= 0 else Proposal.empty(), keep, size)
                                 for i, keep in zip(picks, keeps)])
    starts = row_starts(proposals, picks)
    tokens, depth, end, parents, order, deepest = host_ops().encode(
        proposals.parents, proposals.tokens, starts, keeps, size)
    return trees_in_batch(proposals, starts, keeps, (tokens, depth, end), parents, order, deepest)


def row_starts(proposals: Proposals, picks: list[int]) -> list[int]:
    """Where each batch row's proposals start in ``proposals`` (``picks[b]``: its row there, ``-1``: none, 0)."""
    return [proposals.starts[i] if i >= 0 else 0 for i in picks]


def trees_in_batch(proposals: Proposals, starts: list[int], keeps: list[int], encoded: tuple, parents: torch.Tensor,
                   order: torch.Tensor, deepest: torch.Tensor) -> DraftTrees:
    """The batch's :class:`DraftTrees` from the C++ encoding of its rows (``lookahead_draft.encode`` or
    ``encode_step``): ``encoded`` the int64 ``[B, V]`` tokens, depth and end (views of a step's packed inputs
    will do), ``parents`` and ``order`` (int64 ``[K]``) each real node's pre-order parent and best-first index
    (rows one after another), ``deepest`` each row's deepest real node."""
    encoding = _BatchEncoding(proposals.codes, proposals.code_offsets, parents, order, starts, keeps)

    def make() -> list[DraftTree]:
        listed, trees, at = parents.tolist(), [], 0
        for b, (first, keep, row_deepest) in enumerate(zip(starts, keeps, deepest.tolist())):
            trees.append(DraftTree._in_batch(encoded + (b,), keep, listed[at: at + keep], row_deepest,
                                             (encoding, first, at)))
            at += keep
        return trees

    return DraftTrees(make, *encoded, keeps, encoding)


class _BatchEncoding:
    """What a batch's C++ encoding leaves for learning from its verified step (:func:`record_trials`): the
    proposals' codes and code offsets, every real node's pre-order parent and best-first index (int64 tensors, as
    :func:`trees_in_batch` takes them), each row's first proposal and real nodes. The Python reads of the codes
    (:meth:`DraftTree.node_codes`) take them as lists, made on first need: a step that records its trials in C++
    needs none."""

    __slots__ = ("codes", "code_offsets", "parents", "order", "starts", "keeps", "firsts", "_lists")

    def __init__(self, codes: torch.Tensor, code_offsets: torch.Tensor, parents: torch.Tensor, order: torch.Tensor,
                 starts: list[int], keeps: list[int]):
        self.codes, self.code_offsets, self.parents, self.order = codes, code_offsets, parents, order
        self.starts, self.keeps = starts, keeps
        self.firsts = [0]  # where each row's real nodes start in parents and order
        for keep in keeps[:-1]:
            self.firsts.append(self.firsts[-1] + keep)
        self._lists = None

    def lists(self) -> tuple[list[int], list[int], list[int]]:
        """``(codes, code_offsets, order)`` as lists."""
        if self._lists is None:
            self._lists = (self.codes.tolist(), self.code_offsets.tolist(), self.order.tolist())
        return self._lists


def record_trials(builders: list[DraftBuilder], trees: DraftTrees, rows: list[int], paths: list[list[int]]) -> None:
    """Each builder's acceptance trials from its row's verified tree: ``builders[i]`` learns from batch row
    ``rows[i]`` of ``trees``, whose accepted nodes (pre-order, root first) are ``paths[i]``. Trees from the C++
    encoding record in one C++ call for the batch (``lookahead_draft.record_trials``), others row by row
    (:func:`record_trials_reference`, which records the same)."""
    encoding = trees.encoding
    if encoding is None:
        for builder, b, path in zip(builders, rows, paths):
            record_trials_reference(builder.stats, trees.trees[b], path)
        return
    host_ops().record_trials(
        [b.stats.trials for b in builders], [b.stats.rates for b in builders], _PRIOR_RATES, _PRIOR_WEIGHT,
        encoding.codes, encoding.code_offsets, encoding.parents, encoding.order, [encoding.firsts[b] for b in rows],
        [encoding.starts[b] for b in rows], [encoding.keeps[b] for b in rows], [len(p) for p in paths],
        [n for p in paths for n in p])


def record_trials_reference(stats: AcceptanceStats, tree: DraftTree, path: list[int]) -> None:
    """One row's trials (:func:`record_trials`) in Python: a node was tested iff its parent was accepted (or it
    hangs from x); each of its codes counts a trial, an acceptance where it is on ``path``."""
    accepted = set(path)
    record = stats.record_code
    for i in range(tree.num_nodes):
        p = tree.parents[i]
        if p == -1 or p in accepted:
            hit = i in accepted
            for code in tree.node_codes(i):
                record(code, hit)


def _encode_one(proposal: Proposal, keep: int, size: int) -> DraftTree:
    """:func:`encode_rows` for one row, in Python: the C++ op's reference."""
    tokens, parents, order = _encode_reference(proposal.parents[:keep].tolist(), proposal.tokens[:keep].tolist(),
                                               size)
    shape = TreeShape.from_parents(parents + [-1] * (size - keep))
    offsets = proposal.code_offsets.tolist()
    codes = proposal.codes.tolist()
    return DraftTree(torch.tensor(tokens, dtype=torch.long), shape, keep, parents,
                     [codes[offsets[i]: offsets[i + 1]] for i in order],
                     int(shape.depth[:keep].max()) if keep else 0)


def _encode_reference(parents: list[int], tokens: list[int], size: int) -> tuple[list, list, list]:
    """Pre-order of a best-first list (``parents`` index into it): ``(tokens padded to size, pre-order parents,
    best-first index of each pre-order node)``."""
    kids: list[list[int]] = [[] for _ in parents]
    roots = []
    for i, p in enumerate(parents):  # best-first order: each list is best first too
        (roots if p < 0 else kids[p]).append(i)
    order: list[int] = []
    pre = [-1] * len(parents)
    stack = list(reversed(roots))
    while stack:
        i = stack.pop()
        pre[i] = len(order)
        order.append(i)
        stack.extend(reversed(kids[i]))
    return ([tokens[i] for i in order] + [0] * (size - len(order)),
            [-1 if parents[i] < 0 else pre[parents[i]] for i in order], order)
