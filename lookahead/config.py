"""Lookahead decoding parameters (frozen and validated) and the step shape they resolve to."""

from __future__ import annotations

import dataclasses

from lookahead_kernels.validation import require_int

POOL_BACKENDS = ("auto", "python", "cpp")
# Where the verification tree's candidates come from (``lookahead.draft``).
SOURCES = ("pool", "suffix", "successors")


@dataclasses.dataclass(frozen=True)
class StepShape:
    """A concrete step: ``window`` columns by ``levels`` levels of lookahead (``ngram = levels + 1``) and a
    verification tree of at most ``tree_budget`` nodes. A warm step feeds ``window * levels + tree_budget``
    tokens at most; ``window = levels = 1`` with ``tree_budget = 0`` is a plain step."""

    window: int
    levels: int
    tree_budget: int

    @property
    def ngram(self) -> int:
        return self.levels + 1

    @property
    def max_tokens(self) -> int:
        return self.window * self.levels + self.tree_budget


def shape_for_budget(max_step_tokens: int) -> StepShape:
    """The default split of a step budget between the window and the tree.

    Below 64 tokens the whole budget goes to the tree: at 16 tokens, on the first 10 prompts of each dev set, a
    tree of 15 nodes gave compression 2.45 (HumanEval) and 1.89 (MT-Bench) against 2.22 and 1.74 with an 8-token
    window beside an 8-node tree. From 64 tokens on the window (whose n-grams feed the pool, which chat needs)
    takes an eighth of the budget, in 3 levels.
    """
    require_int("max_step_tokens", max_step_tokens, 1)
    if max_step_tokens < 64:
        return StepShape(1, 1, max_step_tokens - 1)
    levels = 3
    window = (max_step_tokens // 8) // levels
    return StepShape(window, levels, max_step_tokens - window * levels)


@dataclasses.dataclass(frozen=True)
class LookaheadConfig:
    """Parameters of lookahead decoding.

    ``LookaheadConfig()`` is the automatic mode: a step-size controller (``lookahead.controller``) measures the
    forward's cost on this device once and sizes each step's tree to maximise expected tokens per second, taking
    plain steps when nothing pays. Otherwise the step size is set by ``max_step_tokens`` (tokens a warm step
    feeds, window and tree together; split by :func:`shape_for_budget`) or by the paper's ``window``, ``ngram``,
    ``guess`` (the tree then gets ``guess * (ngram - 1)`` nodes, the tokens the original linear candidates would
    take; unset ones default to ``window=15, ngram=5, guess=15``, 120 tokens per step), honoured as given.
    :meth:`shape` describes the fixed step (in automatic mode, the 120-token default it would take without a
    cost model).

    Attributes:
        window: ``W``, columns decoded in parallel by the lookahead branch (>= 1).
        ngram: ``N``, n-gram size (>= 2); the window keeps ``N - 1`` levels.
        guess: ``G``, continuations kept per pool key; with ``window``/``ngram`` it also sets the tree budget
            (>= 0; 0 with ``max_step_tokens`` unset turns verification off, leaving pure Jacobi lookahead).
        max_step_tokens: cap on the tokens a warm step feeds (>= 1). With ``window``/``ngram`` given as well,
            the tree gets what the window leaves.
        sources: which candidate sources feed the tree, a tuple of ``"pool"`` (the window's n-grams keyed by
            ``x``), ``"suffix"`` (what followed earlier occurrences of the sequence's last tokens) and
            ``"successors"`` (the model's own top next tokens after each token, from the logits a step computes).
        pool_from_prompt: seed the n-gram pool with the prompt's own n-grams.
        pool_from_output: also add the n-grams of the committed output to the pool.
        pool_backend: ``"auto"`` (C++ where it builds, else Python), ``"python"`` or ``"cpp"``. The pool lives on
            the host on a GPU too, where the draft tree is built.
        seed: seeds the tokens that fill the window's empty columns (drawn from the sequence so far).
        pad_tree: pad every step's tree to its budget (constant step shape; verification never accepts the
            padding). ``None`` (default): on for CUDA devices, off on the CPU, where padded rows cost compute.
        step_costs: automatic mode and ``device_tree="auto"`` only: the cost model as ``((tokens, seconds), ...)``
            pairs instead of measuring it (makes the controller's choices reproducible, e.g. in tests).
        device_tree: ``V >= 1``: every step verifies a tree of ``V`` nodes of a fixed shape whose tokens are read
            on the step's device from successor tables kept there (:mod:`lookahead.device_tree`), with no tree
            built on the host, no window and no planner; ``"auto"``: ``V`` chosen for the call's batch size from
            the device's measured step costs (``step_costs`` when given; :func:`lookahead.controller.device_tree_size`:
            64 nodes at one row, 8 at 16 rows on the H200's bfloat16 table; 0, plain steps, where no tree pays) and
            the tokens a step trees took, greedy or sampled as the call decodes;
            ``0`` (default): off. Needs the static step path (a CUDA model, or ``_static_steps=True``). Not measured
            on a GPU yet: predicted to pay there at one row and in batches, whose host-built trees cost more host
            work than they gain; on a CPU it loses (a step of 5 tokens costs about twice a step of one).
    """

    window: int | None = None
    ngram: int | None = None
    guess: int | None = None
    max_step_tokens: int | None = None
    sources: tuple = SOURCES
    pool_from_prompt: bool = True
    pool_from_output: bool = True
    pool_backend: str = "auto"
    seed: int = 0
    pad_tree: bool | None = None
    step_costs: tuple | None = None
    device_tree: int | str = 0

    def __post_init__(self) -> None:
        for name, low in (("window", 1), ("ngram", 2), ("guess", 0), ("max_step_tokens", 1)):
            if getattr(self, name) is not None:
                require_int(f"LookaheadConfig.{name}", getattr(self, name), low)
        require_int("LookaheadConfig.seed", self.seed, 0)
        if self.device_tree != "auto":
            if isinstance(self.device_tree, str):
                raise ValueError(f"LookaheadConfig.device_tree must be an int >= 0 or 'auto', got {self.device_tree!r}")
            require_int("LookaheadConfig.device_tree", self.device_tree, 0)
        if self.device_tree:
            fixed = ["window", "ngram", "guess", "max_step_tokens"]
            if self.device_tree != "auto":  # "auto" sizes its tree from the step costs, which may be given
                fixed.append("step_costs")
            given = [n for n in fixed if getattr(self, n) is not None]
            if given:
                raise ValueError(f"LookaheadConfig: device_tree={self.device_tree} fixes the step (x and the tree); "
                                 f"leave {', '.join(given)} unset")
        if self.max_step_tokens is not None and (self.window is not None or self.ngram is not None):
            w, n = self.window or 15, self.ngram or 5
            if w * (n - 1) > self.max_step_tokens:
                raise ValueError(f"LookaheadConfig: the window alone ({w} x {n - 1} levels) feeds more than "
                                 f"max_step_tokens={self.max_step_tokens}")
        sources = tuple(self.sources) if isinstance(self.sources, (tuple, list)) else None
        if sources is None or any(s not in SOURCES for s in sources) or len(set(sources)) != len(sources):
            raise ValueError(f"LookaheadConfig.sources must be a tuple of distinct names from {SOURCES}, got "
                             f"{self.sources!r}")
        object.__setattr__(self, "sources", sources)
        for name in ("pool_from_prompt", "pool_from_output"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"LookaheadConfig.{name} must be a bool (True or False), got {value!r}")
        if self.pad_tree is not None and not isinstance(self.pad_tree, bool):
            raise ValueError(f"LookaheadConfig.pad_tree must be None (auto), True or False, got {self.pad_tree!r}")
        if self.step_costs is not None:
            from .controller import StepCosts

            try:
                pairs = tuple((int(t), float(c)) for t, c in self.step_costs)
                StepCosts.from_pairs(pairs)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"LookaheadConfig.step_costs must be (tokens, seconds) pairs with distinct token "
                                 f"counts >= 1 and positive seconds, got {self.step_costs!r}") from exc
            object.__setattr__(self, "step_costs", pairs)
        if self.pool_backend not in POOL_BACKENDS:
            allowed = ", ".join(map(repr, POOL_BACKENDS))
            # "cuda" was a backend once: its users are told what replaced it.
            removed = "; the CUDA pool was removed ('auto' takes the C++ pool on a GPU too)"
            raise ValueError(f"LookaheadConfig.pool_backend must be one of {allowed}, got {self.pool_backend!r}"
                             f"{removed if self.pool_backend == 'cuda' else ''}")

    @property
    def automatic(self) -> bool:
        """No step size given (no ``window``, ``ngram``, ``guess`` or ``max_step_tokens``): the step-size
        controller (``lookahead.controller``) sizes every step from the device's measured cost."""
        return self.window is None and self.ngram is None and self.guess is None and self.max_step_tokens is None \
            and not self.device_tree

    def shape(self) -> StepShape:
        """The warm step's :class:`StepShape`."""
        if self.device_tree == "auto":
            raise ValueError("LookaheadConfig(device_tree='auto') has no shape of its own: "
                             "lookahead.controller.make_plan sizes its tree for a model and batch size")
        if self.device_tree:
            return StepShape(1, 1, self.device_tree)
        if self.max_step_tokens is not None and self.window is None and self.ngram is None:
            return shape_for_budget(self.max_step_tokens)
        window, levels = self.window or 15, (self.ngram or 5) - 1
        if self.max_step_tokens is not None:
            return StepShape(window, levels, self.max_step_tokens - window * levels)
        return StepShape(window, levels, (15 if self.guess is None else self.guess) * levels)

    @property
    def pool_guess(self) -> int:
        """Continuations kept per pool key: ``guess``, or the window width when unset (the paper's ``G = W``)."""
        return self.guess if self.guess is not None else max(self.shape().window, 4)

    @property
    def tokens_per_step(self) -> int:
        """Tokens fed per warm step at most."""
        return self.shape().max_tokens
