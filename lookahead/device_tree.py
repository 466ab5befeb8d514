"""A draft tree kept on the step's device: a fixed shape whose tokens are read from successor tables there.

Why: a batch's lookahead step builds each row's tree on the host (suffix matches, pool rows, successor tables, a
best-first walk), and at 16 rows that host work (about 0.3 ms a step on this project's CPU, more on the H200's
host) is what kept the GPU's batches from paying (``bench/MEASUREMENTS.md``, sessions 57 and 64-66). A tree of a
fixed shape whose node ``i`` holds the ``ranks[i]``-th recorded successor of its parent's token needs no host work:
reading the tokens, the forward, the verification and the tables' update are tensor operations of fixed shapes,
which a CUDA graph replays. ``bench/bench_static_tree.py --measure`` predicted and measured what such trees accept
(tables seeded from each prompt, 16 rows, 128 tokens): at 4 nodes a row 1.48 tokens a row-step on MT-Bench and
1.83 on HumanEval, every output plain decoding's (``bench/results/static-tree-h200-bf16-s69.md``).

The tree is in ``draft-tree.md``'s encoding: nodes in depth-first pre-order, ``depth`` and ``end`` per node.
"""

from __future__ import annotations

import heapq
import sys

import torch

from lookahead_kernels import StepLayout
from lookahead_kernels.tree import BEFORE_X, TreeShape, pair_key, pair_slot

from . import weights_cache
from .config import StepShape
from .cpu_linear import weights_signature
from .draft import DraftTree, DraftTrees
from .step import Repositioned, build_step
from .successors import SuccessorTable
from .verification import StepVerifier

# How often the next token was a token's r-th recorded successor, r = 0..7, when it had any recorded (SmolLM2,
# both dev sets pooled, tables seeded from the prompt and read as DeviceSuccessors reads them:
# bench/results/static-tree-h200-bf16-s69.json's pooled_rank_rates). A path's score is the product of its ranks'
# rates, so they weigh depth against breadth.
# Trees from the rates a device-tree step meets (per depth: deeper trees) or wider ones took no more tokens a step
# (bench/MEASUREMENTS.md, session 71): the shape also decides which tokens' predictions a step records.
RANK_RATES = (0.587, 0.086, 0.040, 0.028, 0.017, 0.013, 0.010, 0.006)
SEED_CHUNK = 512  # prompt rows projected onto the vocabulary at once when a table is seeded
PAIR_SLOTS = 16384  # a row's pair table (a power of two): direct-mapped, 4-16 times a dev prompt and output's pairs


class StaticTree:
    """A tree of ``V`` nodes over successor ranks, in depth-first pre-order, children in rank order.

    Attributes:
        parents: per node, its parent's index (``-1``: a child of ``x``); ``parents[i] < i``.
        ranks: per node, which of its parent token's recorded successors it holds (0: the most likely).
        shape: its :class:`TreeShape` (int64 ``depth`` and ``end``, ``[V]``, on the CPU).
        successors: the successors a token must keep for this tree, ``max(ranks) + 1`` (0 for no node).
    """

    def __init__(self, paths: list[tuple[int, ...]]):
        paths = sorted(set(map(tuple, paths)))  # lexicographic order of rank paths is pre-order, ranks ascending
        index = {p: i for i, p in enumerate(paths)}
        if any(not p or min(p) < 0 or (len(p) > 1 and p[:-1] not in index) for p in paths):
            raise ValueError(f"StaticTree needs non-empty paths of ranks >= 0 holding each path's parent, got {paths}")
        self.paths = paths
        self.parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
        self.ranks = [p[-1] for p in paths]
        self.shape = TreeShape.from_parents(self.parents)
        self.successors = max(self.ranks) + 1 if paths else 0

    @classmethod
    def best(cls, budget: int, rates=RANK_RATES) -> "StaticTree":
        """The ``budget`` rank paths with the largest products of ``rates`` (``rates[r]``: how often rank ``r``
        is the next token): each path's product is at most its parent's, so they form a tree."""
        if budget < 0:
            raise ValueError(f"StaticTree.best needs budget >= 0, got {budget}")
        heap = [(-rate, (r,)) for r, rate in enumerate(rates) if rate > 0]
        heapq.heapify(heap)
        paths: list[tuple[int, ...]] = []
        while heap and len(paths) < budget:
            score, path = heapq.heappop(heap)
            paths.append(path)
            for r, rate in enumerate(rates):
                if rate > 0:
                    heapq.heappush(heap, (score * rate, path + (r,)))
        return cls(paths)

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def levels(self) -> list[list[int]]:
        """Node indexes by depth, shallowest first (a level's parents are all in the levels before it)."""
        depth = self.shape.depth.tolist()
        return [[i for i, d in enumerate(depth) if d == level] for level in range(1, max(depth, default=0) + 1)]


class DeviceSuccessors:
    """Per batch row, the next tokens the step's logits last predicted after each token and after each pair of
    tokens, on the step's device, and the tree's tokens read from them.

    A node's token is read off the pair (its grandparent's token, its parent's token) where that pair was
    recorded, else off its parent's token alone: on the dev sets, with a prompt position's following token
    recorded first (:meth:`seed`), trees of 4 to 32 nodes took 6-8% more tokens a step on MT-Bench and 12-15% on
    HumanEval than off the parent's token alone (``bench/bench_static_tree.py``). Pairs live in a direct-mapped
    table of ``PAIR_SLOTS`` slots a row (a slot keeps its latest pair); the token before ``x`` (``prev``) is
    kept here too, advanced by :meth:`record`.

    Args:
        tree: the :class:`StaticTree` drafted from.
        batch_size, vocab_size: the rows and the model's vocabulary.
        state: ``state(name, shape, dtype)`` gives a zeroed tensor kept by the caller (a step runner's state: a
            captured graph reads it at its address); default: new tensors on ``device``.
        prior: int32 ``[vocab, k' >= k]`` on the tables' device (:func:`token_prior`): what a row's token table
            starts from when :meth:`reset` empties it; ``None``: nothing.

    Attributes (all zero at first; :meth:`reset` gives a row's table the prior, zeroes its pair keys and prev,
    leaving its pairs unread):
        table: int32 ``[B, vocab, k]`` (``k = tree.successors``): a token's recorded successors, most likely first;
            where nothing was recorded, the prior's (without one, ``0, 0, ...``: verified like any other and
            almost never accepted).
        pairs: int32 ``[B, PAIR_SLOTS, k]``: a pair's successors, in the slot :meth:`slot` gives it.
        pair_keys: int64 ``[B, PAIR_SLOTS]``: which pair a slot holds (:meth:`pair_key`; 0: none).
        prev: int64 ``[B]``: each row's token before its ``x``.
    """

    def __init__(self, tree: StaticTree, batch_size: int, vocab_size: int, device="cpu", state=None, prior=None):
        self.tree, self.vocab_size = tree, vocab_size
        if prior is not None and (prior.dim() != 2 or prior.shape[0] != vocab_size or prior.shape[1] < tree.successors):
            raise ValueError(f"DeviceSuccessors: prior must be [{vocab_size}, >= {tree.successors}], "
                             f"got {list(prior.shape)}")
        self.prior = None if prior is None else prior[:, : tree.successors]
        if state is None:
            state = lambda name, shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        k = tree.successors
        self.table = state("device-successors", (batch_size, vocab_size, k), torch.int32)
        self.pairs = state("device-successors pairs", (batch_size, PAIR_SLOTS, k), torch.int32)
        self.pair_keys = state("device-successors pair keys", (batch_size, PAIR_SLOTS), torch.long)
        self.prev = state("device-successors prev", (batch_size,), torch.long)

        def constant(name: str, values: list[int], shape: tuple, dtype=torch.long) -> torch.Tensor:
            t = state(f"device-tree {tree.paths} {name}", shape, dtype)
            t.copy_(torch.tensor(values, dtype=dtype).view(shape))
            return t

        self._rows = constant("rows", list(range(batch_size)), (batch_size, 1))
        # Per level, in draft()'s columns [prev, x, nodes...]: its nodes', their parents' and grandparents'
        # columns, and their ranks.
        column = [i + 2 for i in range(tree.num_nodes)]
        parent = [1 if p < 0 else column[p] for p in tree.parents]
        grand = [0 if p < 0 else parent[p] for p in tree.parents]
        self._levels = [(constant(f"columns {d}", [column[i] for i in level], (len(level),)),
                         constant(f"parents {d}", [parent[i] for i in level], (len(level),)),
                         constant(f"grandparents {d}", [grand[i] for i in level], (len(level),)),
                         constant(f"ranks {d}", [tree.ranks[i] for i in level], (1, len(level))))
                        for d, level in enumerate(tree.levels())]
        # The same in lookahead_kernels.tree_draft's terms: node indexes, x -1 and the token before it -2.
        V = tree.num_nodes
        self._nodes = tuple(constant(f"kernel {name}", values, (V,), torch.int32) for name, values in (
            ("parents", tree.parents),
            ("grandparents", [BEFORE_X if p < 0 else tree.parents[p] for p in tree.parents]),
            ("ranks", tree.ranks), ("depths", tree.shape.depth.tolist())))
        self._depth = int(tree.shape.depth.max()) if V else 0
        self._node_index = constant("node index", list(range(V)), (1, 1, V))

    @staticmethod
    def slot(before, token):
        """The pair slot of tokens ``before`` then ``token`` (ints or int64 tensors of one shape)."""
        return pair_slot(before, token, PAIR_SLOTS)

    def pair_key(self, before, token):
        """What a slot holding the pair ``before``, ``token`` stores (never 0)."""
        return pair_key(before, token, self.vocab_size)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Everything recorded, each with its rows first: what moves with a row to another runner."""
        return self.table, self.pairs, self.pair_keys, self.prev

    def reset(self, rows: list[int] | None = None) -> None:
        """Forget what rows ``rows`` (every row: ``None``) recorded: a new sequence takes them, its token table
        the prior's."""
        if rows is not None and not rows:
            return
        at = slice(None) if rows is None else torch.tensor(rows, device=self.table.device)
        self.table[at] = 0 if self.prior is None else self.prior
        self.pair_keys[at] = 0
        self.prev[at] = 0

    def draft(self, x: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, V]``: each row's tree tokens under its ``x`` (int64 ``[B]``), in the tree's pre-order: one
        launch on a GPU (``lookahead_kernels.tree_draft``), :meth:`draft_reference` elsewhere."""
        if x.is_cuda:
            from lookahead_kernels.tree_draft import tree_draft

            return tree_draft(x, self.prev, self.table, self.pairs, self.pair_keys, *self._nodes, self._depth)
        return self.draft_reference(x)

    def draft_reference(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`draft` in torch, a level at a time: the kernel's reference and the CPU's path."""
        B, V = x.shape[0], self.tree.num_nodes
        fed = torch.zeros(B, V + 2, dtype=torch.long, device=x.device)
        fed[:, 0] = self.prev
        fed[:, 1] = x
        for columns, parents, grands, ranks in self._levels:  # one level at a time: parents come first
            parent, grand = fed[:, parents], fed[:, grands]
            slot = self.slot(grand, parent)
            seen = self.pair_keys[self._rows, slot] == self.pair_key(grand, parent)
            fed[:, columns] = torch.where(seen, self.pairs[self._rows, slot, ranks],
                                          self.table[self._rows, parent, ranks]).long()
        return fed[:, 2:]

    def record(self, fed: torch.Tensor, tops: torch.Tensor, path: torch.Tensor) -> None:
        """A verified step's tops into the tables. First every node's under its token, whether accepted or not (a token
        fed twice: its last node's): a rejected node's context was a guess, but its tops are the model's
        prediction after its token, as the lookahead window's n-grams are, and fresher than what the table held
        (on 24 prompts a set at 32 nodes 1.91 / 2.52 tokens a step on MT-Bench / HumanEval against 1.65 / 2.15
        without; writing a node's only where its token had nothing recorded: 1.80 / 2.36; under its pair too:
        1.72 / 1.93 on MT-Bench at 16 / 32 nodes, as without). Then the rows that saw their true context,
        ``x``'s and the accepted nodes', each under its token and under the pair of the token before it and its
        token, overwriting. ``prev`` becomes the token before the next ``x`` (the last accepted node's, or
        ``x``). ``fed``: integer ``[B, 1 + V]``, ``x`` and the nodes' tokens; ``tops``: integer ``[B, 1 + V,
        j]`` (``j <= k``), the most likely next tokens after each of them; ``path``: integer ``[B, A]``, the
        accepted nodes (``-1`` past them). Two writes of one step to one token or slot: on a GPU the later wins
        (one launch a step, ``lookahead_kernels.tree_record``); :meth:`record_reference` elsewhere."""
        if fed.is_cuda:
            from lookahead_kernels.tree_record import tree_record

            tree_record(fed.long(), tops.long(), path.long(), self.table, self.pairs, self.pair_keys, self.prev)
            return
        self.record_reference(fed, tops, path)

    def record_reference(self, fed: torch.Tensor, tops: torch.Tensor, path: torch.Tensor) -> None:
        """:meth:`record` in torch: the kernel's reference and the CPU's path (where a token or slot written twice
        in one step keeps the later write, as the kernel does, though torch does not promise that order)."""
        j = tops.shape[2]
        nodes = fed[:, 1:].long()
        if nodes.shape[1]:
            # Each node writes its token's last node's tops: the same writes twice, whatever their order.
            last = torch.where(nodes[:, :, None] == nodes[:, None, :], self._node_index, -1).amax(2)
            self.table[self._rows, nodes, :j] = tops[:, 1:].gather(1, last[:, :, None].expand(-1, -1, j)).to(
                self.table.dtype)
        accepted = (path >= 0).sum(1, keepdim=True)
        rows = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1).long()  # -1 + 1: x's row, unused
        tokens = fed.long().gather(1, rows)
        before = torch.cat([self.prev[:, None], tokens[:, :-1]], dim=1)
        # Past the path, the last accepted entry again: the same writes twice, whatever their order.
        entry = torch.minimum(torch.arange(rows.shape[1], device=rows.device)[None], accepted)
        rows, before, tokens = rows.gather(1, entry), before.gather(1, entry), tokens.gather(1, entry)
        values = tops.gather(1, rows[:, :, None].expand(-1, -1, j)).to(self.table.dtype)
        self.table[self._rows, tokens, :j] = values
        slot = self.slot(before, tokens)
        self.pair_keys[self._rows, slot] = self.pair_key(before, tokens)
        self.pairs[self._rows, slot, :j] = values
        self.prev.copy_(tokens[:, -1])

    def seed(self, row: int, context: list[int], start: int, hidden: torch.Tensor | None, logits) -> None:
        """Row ``row``'s tables from its prompt: ``context`` holds its tokens and ends with its ``x``; positions
        ``start`` to ``len(context) - 2`` were fed with hidden states ``hidden`` (``[len(context) - 1 - start,
        hidden_size]``, on the tables' device; ``None`` where none were fed), whose vocabulary projection
        ``logits(rows)`` (the model's :meth:`~lookahead.model.LlamaForCausalLM.logits`) gives each position's most
        likely next tokens. A position records the token that followed it first, then those (it pays where the
        prompt's text is copied: on the dev sets about two fifths of the gain over the parent's token alone); a
        token's or a pair slot's last position wins. Taken in chunks of ``SEED_CHUNK`` positions: a long prompt's
        logits over a large vocabulary would otherwise take gigabytes at once. ``prev`` becomes the token before
        ``x``."""
        n = len(context) - 1
        device = self.table.device
        self.prev[row] = context[n - 1] if n else 0
        last = {t: i for i, t in enumerate(context[start:n], start)}  # a token's last position
        last_pair = {self.slot(context[i - 1], context[i]): i for i in range(max(start, 1), n)}
        positions = sorted(set(last.values()) | set(last_pair.values()))
        if not positions:
            return
        entries = []  # per position of `positions`, its entry
        for at in range(0, len(positions), SEED_CHUNK):
            chunk = torch.tensor(positions[at: at + SEED_CHUNK], dtype=torch.long, device=device)
            ids, _ = SuccessorTable.top(logits(hidden[chunk - start]), self.table.shape[2])
            following = torch.tensor([context[i + 1] for i in positions[at: at + SEED_CHUNK]], device=device)
            entries.append(_followed_first(ids.long(), following).to(self.table.dtype))
        entries = torch.cat(entries)
        entry_of = {p: e for e, p in enumerate(positions)}

        def entry_rows(at: list[int]) -> torch.Tensor:
            return entries[torch.tensor([entry_of[i] for i in at], device=device)]

        self.table[row, torch.tensor(list(last), device=device)] = entry_rows(list(last.values()))
        if last_pair:
            at = list(last_pair.values())
            slots = torch.tensor(list(last_pair), device=device)
            self.pairs[row, slots] = entry_rows(at)
            self.pair_keys[row, slots] = torch.tensor([self.pair_key(context[i - 1], context[i]) for i in at],
                                                      device=device)


PRIOR_CHUNK = 512  # tokens fed at once by token_prior (their logits: 512 x vocab floats)


def prior_context(config) -> tuple[int, ...]:
    """What :func:`token_prior` feeds before every token: the model's end-of-text token (its first ``eos_token_id``),
    as if each token began a new text after another's end; nothing where the model names none. Fed alone at
    position 0, a token meets the model's first position (where every later token's attention rests) and its
    predictions read worse: after the end-of-text token the device trees took 3-8% more tokens a step on the dev
    prompts that chose it and 2.5-5% more on the rest (``bench/MEASUREMENTS.md``, session 72: end-of-text, newline,
    beginning-of-text and chat headers all within a few percent of each other, all above the token alone)."""
    return tuple(t for t in config.eos_token_id[:1] if 0 <= t < config.vocab_size)  # an id past the vocabulary: none


def token_prior(model, k: int = len(RANK_RATES)) -> torch.Tensor:
    """int32 ``[vocab, k]`` on the model's device: each token's ``k`` most likely next tokens when it is fed after
    :func:`prior_context`, most likely first: where a row's table has nothing recorded for a token, its trees read
    these instead of token 0. On the dev sets a quarter of a 64-node tree's steps met an ``x`` with nothing recorded
    (the whole tree then drafted token 0); starting every table from these took 2.50 / 3.14 tokens a step on
    MT-Bench / HumanEval at 64 nodes against 2.07 / 2.74 with none (``bench/MEASUREMENTS.md``, sessions 71-72). One
    decoding step of every token at once in chunks (the context's keys computed once, in one cache), once per ``k``
    and state of the model's weights (kept on the model object; moved, cast or changed in place, they compute it
    again): about 80 s for SmolLM2 on this project's 2-core CPU, where device trees do not pay (unmeasured on a
    GPU), with a progress bar on stderr once it has taken a second. A model read from a file keeps it on disk
    (:mod:`lookahead.weights_cache`: per file, dtype, device type and ``k``, while its weights are as read), so the
    next process that loads the same file reads it instead. The default ``k`` covers every tree's ranks."""
    memo = getattr(model, "token_prior_cache", None)
    if memo is None:
        memo = model.token_prior_cache = {}
    signature = weights_signature(model)
    if k not in memo or memo[k][0] != signature:
        context, vocab = prior_context(model.config), model.config.vocab_size
        kept = weights_cache.entry(model, "prior", signature, k=k, context=list(context))
        tops = None if kept is None else weights_cache.read(*kept, check=lambda t: _check_prior(t, vocab, k))
        if tops is None:
            tops = prior_tops(model, context, k, progress=True)
            if kept is not None:
                weights_cache.write(*kept, tops)
        memo[k] = signature, tops.to(model.embed.weight.device)
    return memo[k][1]


def _check_prior(tops: torch.Tensor, vocab: int, k: int) -> None:
    """Raises ``ValueError`` unless ``tops`` is a prior of ``vocab`` tokens and ``k`` successors each."""
    if tops.dtype != torch.int32 or tuple(tops.shape) != (vocab, k):
        raise ValueError(f"expected int32 [{vocab}, {k}], got {tops.dtype} {tuple(tops.shape)}")
    if tops.numel() and (int(tops.min()) < 0 or int(tops.max()) >= vocab):
        raise ValueError(f"token ids outside [0, {vocab})")


def prior_tops(model, context: tuple[int, ...], k: int, tokens: torch.Tensor | None = None,
               progress: bool = False) -> torch.Tensor:
    """int32 ``[len(tokens), k]``: the top ``k`` next tokens of each of ``tokens`` (integer ``[N]``; ``None``: the
    whole vocabulary, :func:`token_prior`'s rows) when it follows ``context``, most likely first. ``progress``: a
    progress bar on stderr, shown once the work has taken a second (a CPU's minute explained; a GPU's second not)."""
    from tqdm.auto import tqdm  # here: importing the package does not pay for it

    device, n = model.embed.weight.device, len(context)
    tokens = torch.arange(model.config.vocab_size) if tokens is None else tokens
    tokens = tokens.to(device=device, dtype=torch.long)
    cache = model.new_cache(max(1, min(PRIOR_CHUNK, len(tokens))), n + 1)
    tops = [torch.empty(0, k, dtype=torch.int32, device=device)]
    with torch.no_grad():
        if n:  # the context's keys once, into every row: each chunk's step writes slot n alone
            model(torch.tensor([context], device=device), positions=torch.arange(n, device=device)[None],
                  cache=cache.sequence(0), cache_len=0, layout=StepLayout.prefill(n))
            cache.k[:, 1:, :n], cache.v[:, 1:, :n] = cache.k[:, :1, :n], cache.v[:, :1, :n]
        with tqdm(total=len(tokens), desc="lookahead: the device trees' prior", unit="token", file=sys.stderr,
                  delay=1.0, leave=False, disable=not progress) as bar:
            for at in range(0, len(tokens), cache.batch_size):
                ids = tokens[at: at + cache.batch_size, None]
                if ids.shape[0] < cache.batch_size:  # the last chunk is short: its rows alone
                    cache.remove_rows(list(range(ids.shape[0], cache.batch_size)))
                logits = model(ids, positions=torch.full_like(ids, n), cache=cache, cache_len=n,
                               layout=StepLayout(1, 1))
                tops.append(SuccessorTable.top(logits[:, 0], k)[0].to(torch.int32))
                bar.update(ids.shape[0])
    return torch.cat(tops)


def _followed_first(ids: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
    """int64 ``[R, k]``: each row's ``following`` token, then its ``ids`` (``[R, k]``) without it, cut to ``k``."""
    R, k = ids.shape
    candidates = torch.cat([following[:, None], ids], dim=1)
    repeated = torch.cat([torch.zeros_like(ids[:, :1], dtype=torch.bool), ids == following[:, None]], dim=1)
    order = (repeated.long() * (k + 1) + torch.arange(k + 1, device=ids.device)).argsort(dim=1)
    return candidates.gather(1, order[:, :k])


class DeviceTreeFinish:
    """A device-tree step's finish (what a step runner runs on the logits, in the step's graph): before the
    forward, :meth:`prepare` writes each row's tree tokens into the step's inputs; after it, ``verifier``
    verifies, and the tops of ``x``'s and the accepted nodes' logits go into the tables
    (:meth:`DeviceSuccessors.record`).

    Args:
        verifier: the step's :class:`lookahead.verification.StepVerifier`, with no successor tops of its own.
        successors: the tables, on the runner the step runs on.
    """

    def __init__(self, verifier, successors: DeviceSuccessors):
        if verifier.successor_k or verifier.lookahead_len != 1 or verifier.shape.tree_budget != \
                successors.tree.num_nodes:
            raise ValueError("DeviceTreeFinish needs a verifier of x and the tree alone, without successor tops")
        self.verifier, self.successors = verifier, successors
        self.sampler = verifier.sampler
        self.k = successors.table.shape[2]
        # Read every graph step to pick the graph: made once (a call keeps one finish for its tables).
        self._key = ("device-tree", tuple(successors.tree.paths), self.k) + verifier.key

    @property
    def shape(self):
        return self.verifier.shape

    @property
    def key(self) -> tuple:
        return self._key

    @property
    def uniforms_per_row(self) -> int:
        return self.verifier.uniforms_per_row

    def prepare(self, inputs) -> None:
        """Each row's tree tokens under its ``x`` into ``inputs.tokens`` (int64 ``[B, 1 + V]``), in place."""
        V = self.successors.tree.num_nodes
        inputs.tokens[:, 1: 1 + V] = self.successors.draft(inputs.tokens[:, 0])

    def __call__(self, logits: torch.Tensor, inputs) -> torch.Tensor:
        out = self.verifier(logits, inputs)
        V, A = self.successors.tree.num_nodes, self.verifier.max_accept
        ids, _ = SuccessorTable.top(logits[:, : 1 + V], self.k)
        path = (out[0] if isinstance(out, tuple) else out)[:, 1: 1 + A]
        self.successors.record(inputs.tokens[:, : 1 + V], ids, path)
        return out

    def next_inputs(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's next ``x`` and its count of emitted tokens (:meth:`StepVerifier.next_inputs`)."""
        return self.verifier.next_inputs(out)

    def read(self, out) -> tuple[list[list[int]], torch.Tensor | None]:
        """``(emitted, kept)``: per row the tokens the step emitted, and the rows they were chosen from
        (:meth:`StepVerifier.read_emitted`): the host learns nothing else from a device tree's step."""
        return self.verifier.read_emitted(out)


class DeviceTreeSteps:
    """A ``generate`` call's device-tree steps (``LookaheadConfig.device_tree``): the tree, its step shape, and the
    tables on the step runner the call runs on.

    Args:
        tree: the :class:`StaticTree` every step verifies.
        vocab_size: the model's vocabulary size.
        prior: what a row's token table starts from (:func:`token_prior`, on the runners' device), or ``None``.
    """

    def __init__(self, tree: StaticTree, vocab_size: int, prior: torch.Tensor | None = None):
        if tree.num_nodes < 1:
            raise ValueError("DeviceTreeSteps needs a tree of at least one node")
        self.tree, self.vocab_size, self.prior = tree, vocab_size, prior
        self.shape = StepShape(1, 1, tree.num_nodes)
        self.depth = int(tree.shape.depth.max())
        self.k = tree.successors
        self.constants: dict = {}  # lookahead.step.build_step's parts that every step packs the same
        V = tree.num_nodes
        # The host's view of a row's tree: its shape; its tokens are written on the device (DeviceTreeFinish).
        self._tree = DraftTree(torch.zeros(V, dtype=torch.long), tree.shape, V, tree.parents, [[] for _ in range(V)],
                               self.depth)
        self._templates: dict = {}  # batch size -> its packed step, rewritten each step (lookahead.step.Repositioned)
        self._finish = None  # (sampler, its DeviceTreeFinish) on the tables of now
        self.successors: DeviceSuccessors | None = None

    def start(self, runner) -> None:
        """Take ``runner``'s tables (its state, which its graphs read). A row's tables are emptied when its prompt
        takes it (:meth:`reset`, then :meth:`seed`): until then they may hold an earlier call's, which only a parked
        row, whose tokens are never read, would draft from."""
        self.successors = DeviceSuccessors(self.tree, runner.batch_size, self.vocab_size, state=runner.state,
                                           prior=self.prior)
        self._finish = None

    def moved(self, runner, slots: list[int]) -> None:
        """The call moved to ``runner``, whose row ``i`` is the old runner's row ``slots[i]``: the rows' tables
        go with them."""
        old = self.successors.tensors()
        self.start(runner)
        for new, before in zip(self.successors.tensors(), old):
            new[: len(slots)] = before[torch.tensor(slots, device=before.device)]

    def reset(self, rows: list[int]) -> None:
        """Rows ``rows`` start new sequences: their tables start empty."""
        self.successors.reset(rows)

    def seed(self, slot: int, context: list[int], start: int, hidden: torch.Tensor | None, logits) -> None:
        """Row ``slot``'s tables from its prompt (:meth:`DeviceSuccessors.seed`)."""
        self.successors.seed(slot, context, start, hidden, logits)

    def trees(self, batch_size: int) -> DraftTrees:
        """The step's trees for ``batch_size`` rows (as :func:`lookahead.step.build_step` takes them)."""
        return DraftTrees.stack([self._tree] * batch_size)

    def step(self, xs: list[int], positions: list[int]):
        """The packed inputs (:class:`lookahead.step.Step`) of a step of rows feeding ``xs`` at ``positions``, their
        tree tokens left for the device to write (:meth:`DeviceTreeFinish.prepare`); the same block each step of a
        batch size, rewritten (a step runner copies it in at once)."""
        B = len(xs)
        if B not in self._templates:
            self._templates[B] = Repositioned(build_step([0] * B, torch.zeros(B, 1, dtype=torch.long), 1, 1,
                                                         self.trees(B), "cpu", self.constants, pack=True))
        return self._templates[B](xs, positions)

    def finish(self, sampler) -> DeviceTreeFinish:
        """The steps' finish for ``sampler`` (the call's), made once for the tables of now."""
        if self._finish is None or self._finish[0] is not sampler:
            self._finish = (sampler, DeviceTreeFinish(StepVerifier(sampler, self.shape, self.depth), self.successors))
        return self._finish[1]
