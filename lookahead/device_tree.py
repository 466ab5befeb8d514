"""A draft tree kept on the step's device: a fixed shape whose tokens are read from successor tables there.

Why: a batch's lookahead step builds each row's tree on the host (suffix matches, pool rows, successor tables, a
best-first walk), and at 16 rows that host work (about 0.3 ms a step on this project's CPU, more on the H200's
host) is what kept the GPU's batches from paying (``bench/MEASUREMENTS.md``, sessions 57 and 64-66). A tree of a
fixed shape whose node ``i`` holds the ``ranks[i]``-th recorded successor of its parent's token needs no host work:
reading the tokens, the forward, the verification and the tables' update are tensor operations of fixed shapes,
which a CUDA graph replays. ``bench/bench_static_tree.py --measure`` predicted and measured what such trees accept
(tables seeded from each prompt, 16 rows, 128 tokens): at 4 nodes a row 1.40 tokens a row-step on MT-Bench and
1.63 on HumanEval (``bench/results/static-tree-h200-bf16.md``).

The tree is in ``draft-tree.md``'s encoding: nodes in depth-first pre-order, ``depth`` and ``end`` per node.
"""

from __future__ import annotations

import heapq

import torch

from lookahead_kernels.tree import TreeShape

from .config import StepShape
from .draft import DraftTree, DraftTrees
from .step import Repositioned, build_step
from .successors import SuccessorTable
from .verification import StepVerifier

# How often the next token was a token's r-th recorded successor, r = 0..7, when it had any recorded (SmolLM2,
# both dev sets pooled, tops recorded from the tokens decoded so far: bench/results/static-tree-h200-bf16.json).
# Only their order and ratios shape a tree.
RANK_RATES = (0.487, 0.114, 0.052, 0.034, 0.021, 0.018, 0.012, 0.009)
SEED_CHUNK = 512  # prompt rows projected onto the vocabulary at once when a table is seeded


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
    """Per batch row, each token's most likely next tokens as the step's logits last said, on the step's device,
    and the tree's tokens read from them.

    Args:
        table: int32 ``[B, vocab, k]`` (``k >= tree.successors``), kept by the caller (a step runner's state: a
            captured graph reads it at its address); rows are zeroed by :meth:`reset`. A token with nothing
            recorded has successors ``0, 0, ...``: its nodes are verified like any other and almost never accepted.
        tree: the :class:`StaticTree` drafted from.
    """

    def __init__(self, table: torch.Tensor, tree: StaticTree, state=None):
        if table.dim() != 3 or table.dtype != torch.int32 or table.shape[2] < tree.successors:
            raise ValueError(f"DeviceSuccessors needs an int32 table [B, vocab, k >= {tree.successors}], got "
                             f"{tuple(table.shape)} {table.dtype}")
        self.table, self.tree = table, tree
        device = table.device
        if state is None:  # a runner's state under graphs: a captured step reads these index tensors at their address
            state = lambda name, shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731

        def constant(name: str, values: list[int], shape: tuple) -> torch.Tensor:
            t = state(f"device-tree {tree.paths} {name}", shape, torch.long)
            t.copy_(torch.tensor(values, dtype=torch.long).view(shape))
            return t

        self._rows = constant("rows", list(range(table.shape[0])), (table.shape[0], 1))
        # Per level: its nodes' columns in [x, nodes...], their parents' columns there, and their ranks.
        self._levels = [(constant(f"columns {d}", [i + 1 for i in level], (len(level),)),
                         constant(f"parents {d}", [tree.parents[i] + 1 for i in level], (len(level),)),
                         constant(f"ranks {d}", [tree.ranks[i] for i in level], (1, len(level))))
                        for d, level in enumerate(tree.levels())]

    def reset(self, rows: list[int] | None = None) -> None:
        """Forget what rows ``rows`` (every row: ``None``) recorded: a new sequence takes them."""
        if rows is None:
            self.table.zero_()
        elif rows:
            self.table[torch.tensor(rows, device=self.table.device)] = 0

    def draft(self, x: torch.Tensor) -> torch.Tensor:
        """int64 ``[B, V]``: each row's tree tokens under its ``x`` (integer ``[B]``), in the tree's pre-order."""
        B, V = x.shape[0], self.tree.num_nodes
        fed = torch.zeros(B, V + 1, dtype=torch.long, device=x.device)
        fed[:, 0] = x
        for columns, parents, ranks in self._levels:  # one gather a level: parents come before their children
            fed[:, columns] = self.table[self._rows, fed[:, parents], ranks].long()
        return fed[:, 1:]

    def record(self, fed: torch.Tensor, tops: torch.Tensor, path: torch.Tensor) -> None:
        """A verified step's tops into the tables: of ``x`` and of the accepted nodes, the rows that saw their
        true context. ``fed``: integer ``[B, 1 + V]``, ``x`` and the nodes' tokens; ``tops``: integer ``[B, 1 + V,
        j]`` (``j <= k``), the most likely next tokens after each of them; ``path``: integer ``[B, A]``, the
        accepted nodes (``-1`` past them). Each such row's ``j`` tops become its token's first ``j`` successors.
        The rejected nodes' rows are not recorded: in 8 HumanEval prompts (128 tokens, 4 nodes) recording them
        first gave 1.29 tokens a step against 1.30 without, and the write costs a scatter of every row."""
        j = tops.shape[2]
        true_rows = torch.cat([torch.zeros_like(path[:, :1]), path + 1], dim=1).long()  # -1 + 1: x's row again
        self.table[self._rows, fed.long().gather(1, true_rows), :j] = tops.gather(
            1, true_rows[:, :, None].expand(-1, -1, j)).to(self.table.dtype)


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
    """

    def __init__(self, tree: StaticTree, vocab_size: int):
        if tree.num_nodes < 1:
            raise ValueError("DeviceTreeSteps needs a tree of at least one node")
        self.tree, self.vocab_size = tree, vocab_size
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
        """Take ``runner``'s tables (its state, which its graphs read). A row's table is emptied when its prompt
        takes it (:meth:`reset`, then :meth:`seed`): until then it may hold an earlier call's, which only a parked
        row, whose tokens are never read, would draft from."""
        table = runner.state("device-successors", (runner.batch_size, self.vocab_size, self.k), torch.int32)
        self.successors = DeviceSuccessors(table, self.tree, runner.state)
        self._finish = None

    def moved(self, runner, slots: list[int]) -> None:
        """The call moved to ``runner``, whose row ``i`` is the old runner's row ``slots[i]``: the rows' tables
        go with them."""
        old = self.successors.table
        self.start(runner)
        self.successors.table[: len(slots)] = old[torch.tensor(slots, device=old.device)]

    def reset(self, rows: list[int]) -> None:
        """Rows ``rows`` start new sequences: their tables start empty."""
        self.successors.reset(rows)

    def seed(self, slot: int, tokens: list[int], hidden: torch.Tensor, logits) -> None:
        """Row ``slot``'s table from its prompt: ``tokens`` (a list of ``n``) were fed with hidden states ``hidden``
        (``[n, hidden_size]``, on the tables' device), whose vocabulary projection ``logits(rows)`` (the model's
        :meth:`~lookahead.model.LlamaForCausalLM.logits`) gives each token's most likely successors; a token's
        last occurrence wins. Taken in chunks of ``SEED_CHUNK`` rows: a long prompt's logits over a large
        vocabulary would otherwise take gigabytes at once."""
        last = {t: i for i, t in enumerate(tokens)}  # each token's last row
        device = self.successors.table.device
        keys = torch.tensor(list(last), dtype=torch.long)
        rows = torch.tensor(list(last.values()), dtype=torch.long)
        for at in range(0, len(keys), SEED_CHUNK):
            picked = rows[at: at + SEED_CHUNK].to(device)
            ids, _ = SuccessorTable.top(logits(hidden[picked]), self.k)
            self.successors.table[slot, keys[at: at + SEED_CHUNK].to(device), : ids.shape[1]] = \
                ids.to(self.successors.table.dtype)

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
