"""The step-size controller: how many tokens a step should feed on this device, model and dtype.

A step that feeds ``T`` tokens costs ``t(T)`` seconds and is expected to emit ``1 + E(T)`` tokens, where ``E`` is
the sum of the reach probabilities of the tree nodes it verifies (``lookahead.draft`` estimates them from running
acceptance statistics per source and depth). The controller picks, each step, the tree size that maximises
``(1 + E) / t``; a tree of size 0 is a plain step. The cost model ``t`` is measured once per device, model, dtype
and thread count, in well under a second, and cached in memory (on the model object) and on disk.

On a GPU a step is bound by reading the weights up to a few hundred tokens, so ``t`` is nearly flat and the
controller takes big trees (and the lookahead window); on a CPU it grows with ``T`` and the controller takes
small trees, or plain steps when the guesses are poor.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import time

import torch

from lookahead_kernels import StepLayout

# Step sizes whose cost is measured; between them the cost is interpolated linearly.
CPU_MENU = (1, 4, 16, 64)
GPU_MENU = (1, 16, 64, 128, 256)
# Context the cost is measured at (attention over it is part of a step's cost).
_CONTEXT = 256
# The window runs when it makes a full step at most this much slower than the tree alone.
WINDOW_COST_LIMIT = 1.05


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """``t(T)``: seconds of one forward pass feeding ``T`` tokens, measured at ``tokens`` (ascending) and
    interpolated linearly between them, extrapolated from the last two beyond."""

    tokens: tuple
    seconds: tuple

    def __post_init__(self) -> None:
        tokens, seconds = tuple(int(t) for t in self.tokens), tuple(float(s) for s in self.seconds)
        if len(tokens) < 1 or len(tokens) != len(seconds) or list(tokens) != sorted(set(tokens)) or tokens[0] < 1 \
                or any(not s > 0 for s in seconds):
            raise ValueError(f"StepCosts needs ascending distinct token counts >= 1 with positive seconds, got "
                             f"{self.tokens!r} and {self.seconds!r}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "seconds", seconds)

    @classmethod
    def from_pairs(cls, pairs) -> "StepCosts":
        pairs = sorted((int(t), float(s)) for t, s in pairs)
        return cls(tuple(t for t, _ in pairs), tuple(s for _, s in pairs))

    def __call__(self, T: int) -> float:
        ts, ss = self.tokens, self.seconds
        if len(ts) == 1:
            return ss[0] * max(T, 1) / ts[0] if T > ts[0] else ss[0]
        if T <= ts[0]:
            return ss[0]
        i = min(bisect.bisect_left(ts, T), len(ts) - 1)
        lo, hi = i - 1, i
        slope = (ss[hi] - ss[lo]) / (ts[hi] - ts[lo])
        return max(ss[lo] + slope * (T - ts[lo]), ss[0])

    @property
    def max_tokens(self) -> int:
        return self.tokens[-1]


def _cache_dir() -> str:
    base = os.environ.get("LOOKAHEAD_CACHE_DIR")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lookahead")
    return base


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def cost_key(model) -> str:
    """The key of ``model``'s cost model in the caches: device name, dtype, threads, torch version, model shape."""
    config = json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str)
    parts = [_device_name(model.device), str(model.dtype), f"threads={torch.get_num_threads()}",
             f"torch={torch.__version__}", hashlib.sha256(config.encode()).hexdigest()[:16]]
    return "|".join(parts)


@torch.inference_mode()
def measure_step_costs(model, menu=None) -> StepCosts:
    """Time one forward pass of ``model`` at each step size of ``menu`` (default: by device) at a context of
    256 tokens; the fastest of two runs after a warm-up, about half a second in all on a CPU."""
    device = model.device
    menu = menu or (GPU_MENU if device.type == "cuda" else CPU_MENU)
    max_pos = model.config.max_position_embeddings
    context = max(0, min(_CONTEXT, max_pos - max(menu) - 1))
    cache = model.new_cache(1, context + max(menu))
    pairs = []
    for T in menu:
        ids = torch.zeros(1, T, dtype=torch.long, device=device)
        pos = torch.arange(context, context + T, device=device)[None]
        # A single-column tree of T-1 nodes: the same cost as any tree of that size.
        layout = StepLayout.prefill(T)
        rows = torch.arange(T, device=device)
        best = float("inf")
        for run in range(3):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            model(ids, pos, cache, context, layout, rows)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if run:  # the first run warms up
                best = min(best, time.perf_counter() - start)
        pairs.append((T, best))
    return StepCosts.from_pairs(pairs)


def step_costs(model, cache_to_disk: bool = True) -> StepCosts:
    """The cost model of ``model`` on its device: from the model object's memory, else the disk cache (keyed by
    device, dtype, thread count, torch version and model shape), else measured now and stored in both."""
    key = cost_key(model)
    memo = getattr(model, "step_costs_cache", None)
    if memo is None:
        memo = model.step_costs_cache = {}
    if key in memo:
        return memo[key]
    path = os.path.join(_cache_dir(), "step-costs.json")
    table = {}
    if cache_to_disk:
        try:
            with open(path) as f:
                table = json.load(f)
        except (OSError, ValueError):
            table = {}
        if isinstance(table, dict) and key in table:
            try:
                memo[key] = StepCosts.from_pairs(table[key])
                return memo[key]
            except (TypeError, ValueError):
                pass  # a damaged entry is measured again
    costs = measure_step_costs(model)
    memo[key] = costs
    if cache_to_disk:
        table = table if isinstance(table, dict) else {}
        table[key] = list(zip(costs.tokens, costs.seconds))
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(table, f, indent=1)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache only costs a measurement next time
    return costs


class StepPlanner:
    """Picks each step's tree size from the expected gains of its nodes and the cost model.

    Args:
        costs: the :class:`StepCosts` of this device, model and dtype.
        window_tokens: tokens the lookahead branch feeds (``1``: ``x`` alone, no window).
    """

    def __init__(self, costs: StepCosts, window_tokens: int):
        self.costs = costs
        self.window_tokens = window_tokens

    def choose(self, gains: list[float]) -> int:
        """How many of the nodes to verify. ``gains`` are the nodes' reach probabilities in the order the
        builder took them (each node after its parent), so any prefix is a tree."""
        best, best_rate, total = 0, 1.0 / self.costs(self.window_tokens), 0.0
        for b, g in enumerate(gains, start=1):
            total += g
            rate = (1.0 + total) / self.costs(self.window_tokens + b)
            if rate > best_rate:
                best, best_rate = b, rate
        return best


def window_pays(costs: StepCosts, window_tokens: int, tree_tokens: int) -> bool:
    """Whether running the window (``window_tokens`` instead of ``x`` alone) keeps a step within
    ``WINDOW_COST_LIMIT`` of its cost without: true where steps are bound by reading weights (GPUs)."""
    return costs(window_tokens + tree_tokens) <= WINDOW_COST_LIMIT * costs(1 + tree_tokens)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a generate call runs: the step shape, the tree's sources and, in automatic mode, the planner."""

    shape: object  # lookahead.config.StepShape
    sources: tuple
    planner: StepPlanner | None


def make_plan(config, model) -> Plan:
    """Resolve a :class:`~lookahead.config.LookaheadConfig` for ``model``.

    Explicit ``window``/``ngram``/``guess``/``max_step_tokens`` are honoured as given. ``LookaheadConfig()`` with
    none of them is the automatic mode: the cost model (``config.step_costs`` when given, else measured and
    cached) bounds the step at its largest measured size; the window (15 x 4, the paper's) runs only where it
    costs at most ``WINDOW_COST_LIMIT`` more (and with it the pool its n-grams feed); the planner sizes each
    step's tree.
    """
    from .config import StepShape

    if not config.automatic:
        return Plan(config.shape(), config.sources, None)
    costs = StepCosts.from_pairs(config.step_costs) if config.step_costs is not None else step_costs(model)
    total = costs.max_tokens
    window = StepShape(15, 4, 0)
    if total > window.max_tokens and window_pays(costs, window.max_tokens, total - window.max_tokens):
        shape = StepShape(window.window, window.levels, total - window.max_tokens)
        sources = config.sources
    else:
        shape = StepShape(1, 1, max(total - 1, 0))
        sources = tuple(s for s in config.sources if s != "pool")
    return Plan(shape, sources, StepPlanner(costs, shape.window * shape.levels))
