"""The step-size controller: how many tokens a step should feed on this device, model and dtype.

A step that feeds ``T`` tokens costs ``t(T)`` seconds and is expected to emit ``1 + E(T)`` tokens, where ``E`` is
the sum of the reach probabilities of the tree nodes it verifies (``lookahead.draft`` estimates them from running
acceptance statistics per source and depth). The controller picks, each step, the tree size that maximises
``(1 + E) / t``; a tree of size 0 is a plain step. The cost model ``t`` is measured once per device, model, dtype
and thread count, in well under a second, and cached in memory (on the model object) and on disk.

On a GPU a step is bound by reading the weights up to a few hundred tokens, so ``t`` is nearly flat and the
controller takes big trees (and the lookahead window); on a CPU it grows with ``T`` and the controller takes
small trees, or plain steps when the guesses are poor.

A batch of ``B`` rows feeds ``B * T`` tokens per step and reads the weights once for all of them, so a step costs
``t(B * T)``: the more rows, the sooner the step is compute-bound, and the tree per row shrinks (to nothing, a
plain step, when it no longer pays). The planner picks one tree size for all rows (they are padded to one shape)
maximising the batch's expected tokens per second.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import operator
import os
import platform
import sys
import time
from pathlib import Path

import torch

from lookahead_kernels import StepLayout
from lookahead_kernels.validation import require_int

from . import cpu_linear
from .loading import cache_dir, save_text

# Step sizes whose cost is measured; between them the cost is interpolated linearly.
CPU_MENU = (1, 4, 16, 64)
GPU_MENU = (1, 16, 64, 128, 256)
# Measured on first use by a batch whose steps feed more tokens than the menu's last (beyond it, ``t`` is
# extrapolated linearly: there a step is compute-bound). One point keeps that first use short.
CPU_BATCH_MENU = (256,)
GPU_BATCH_MENU = (1024,)
# Context the cost is measured at (attention over it is part of a step's cost).
_CONTEXT = 256
# The window runs when it makes a full step at most this much slower than the tree alone.
WINDOW_COST_LIMIT = 1.05
# A batch takes trees only where they are expected to beat a plain step by this much: what the cost models
# miss (the noise of their estimates, work they do not count) is paid B times over, and a batch that loses to
# plain decoding is the peers' common failure under load.
BATCH_MARGIN = 1.05
# Each new measurement of the host work (and of the realised gains) discounts the older ones by this factor.
HOST_DECAY = 0.95
# One measurement of a step's host work counts at most this many times what the fit predicts for it (see
# HostCost.observe).
HOST_OUTLIER = 3.0
# The gain calibration starts as if this many expected extra tokens had all come true: one unlucky step moves
# it, but does not turn lookahead off on its own.
CALIBRATION_PRIOR = 10.0
# A batch builds trees only as large as could pay if each node were accepted with this chance once its parent is
# (a chain): beyond, no tree pays for its rows' host work (building, learning), and at 0 the batch steps plainly.
OPTIMISTIC_ACCEPTANCE = 0.9
# reach() scales its chain by the gain calibration rounded up to a multiple of this.
REACH_SCALE_STEP = 0.05
# reach()'s answers kept on a model (shared by its calls) at most, before they are dropped and worked out anew.
REACH_MEMO_LIMIT = 4096


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

    def least_from(self, T: int) -> float:
        """A lower bound of ``t(T')`` for every ``T' >= T`` (a measured table need not grow with ``T``): linear
        pieces take their least at an end, and beyond the table ``t`` grows, or falls to ``t(tokens[0])``."""
        ts, ss = self.tokens, self.seconds
        least = min([self(T)] + [s for t, s in zip(ts, ss) if t > T])
        return min(least, ss[0]) if len(ts) > 1 and ss[-1] < ss[-2] else least


def cpu_model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name with its family and model numbers where ``cpuinfo`` gives them (``"AMD EPYC (family
    26, model 2)"``: hypervisors often name every CPU "AMD EPYC", a Zen 4 and a Zen 5 alike, whose steps cost
    twofold apart), else what ``platform`` says, else ``"cpu"``."""
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block says it for all
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine() or "cpu"
    numbers = [f"{key.split()[-1]} {fields[key]}" for key in ("cpu family", "model") if fields.get(key)]
    return f"{name} ({', '.join(numbers)})" if numbers else name


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model_name()


def cost_key(model) -> str:
    """The key of ``model``'s cost model in the caches: device name, dtype, threads, torch version, model shape
    and, on a CPU, the linear layers' and attention's paths (a table measured on other ops says nothing of these)."""
    config = json.dumps(dataclasses.asdict(model.config), sort_keys=True, default=str)
    parts = [_device_name(model.device), str(model.dtype), f"threads={torch.get_num_threads()}",
             f"torch={torch.__version__}", hashlib.sha256(config.encode()).hexdigest()[:16]]
    if model.device.type == "cpu":
        parts.append(f"linear={_cpu_linear_path(model)}")
        parts.append(f"attention={_cpu_attention_path(model)}")
    else:
        parts.append("steps=graphs+verify")  # as generate runs them: replayed graphs holding verification
        # float32 steps of a few rows run our linear kernel (cpu_linear.GPU_KERNEL_ROWS): tables measured before it
        # priced them at cuBLAS's cost.
        rows = cpu_linear.GPU_KERNEL_ROWS
        parts.append(f"linear=kernel-{rows.start}-{rows.stop - 1}" if len(rows) else "linear=cublas")
    return "|".join(parts)


def _cpu_linear_path(model) -> str:
    mode = model.cpu_linear_mode
    if mode == "packed":
        from .cpu_linear import gemm_available

        if not gemm_available():
            return "onednn"  # the fallback "packed" takes without our GEMM
        from lookahead_kernels.cpu_ops import sources_digest

        # The instruction set the ops run (their speed differs severalfold between sets, and hypervisors often
        # name every CPU "AMD EPYC") and the sources they were built from (a kernel 3x faster makes a table stale).
        return f"ops-{torch.ops.lookahead_gemm.isa()}-{sources_digest()}"
    return mode


def _cpu_attention_path(model) -> str:
    from lookahead_kernels.cpu_attention import cpu_attention_applies

    return "cpu-op" if cpu_attention_applies(model.device, model.dtype, model.config.head_dim) else "sdpa"


def _greedy_finish(shape):
    """What a greedy step of ``shape`` runs after its forward in ``generate``: the plain step's argmax, or a lookahead
    step's verifier (a graph verifies up to the tree's size; the successor tops of every computed row)."""
    from .draft import SUCCESSORS_PER_NODE
    from .verification import PlainChoice, Sampler, StepVerifier

    greedy = Sampler(False, None, None, None, None)
    if not shape.tree_budget:
        return PlainChoice(greedy)
    return StepVerifier(greedy, shape, shape.tree_budget, SUCCESSORS_PER_NODE, shape.max_tokens)


@torch.inference_mode()
def measure_step_costs(model, menu=None, runs: int = 5, static: bool | None = None) -> StepCosts:
    """Time one forward pass of ``model`` at each step size of ``menu`` (default: by device) at a context of
    256 tokens; the fastest of ``runs`` rounds (each times every size once) after a warm-up, 2-3 s in all on a
    CPU.

    ``static`` (default: on CUDA) times each size as ``generate`` runs it there: a step of a
    :class:`lookahead.runner.StepRunner`, replaying its CUDA graph on CUDA (a chain tree of ``T - 1`` nodes, the
    same cost as any tree of that size); eager forwards cost more host time per step than replays, which would
    make the planner take too few tokens. Each step there includes its greedy verification (with the window's
    guesses, the successor table's tops and KV compaction), captured with the forward as ``generate`` captures it.
    Where a capture fails the model's own forward is timed instead."""
    device = model.device
    menu = menu or (GPU_MENU if device.type == "cuda" else CPU_MENU)
    static = device.type == "cuda" if static is None else static
    max_pos = model.config.max_position_embeddings
    context = max(0, min(_CONTEXT, max_pos - max(menu) - 1))
    cache = model.new_cache(1, context + max(menu))
    runner = None
    if static:
        from .config import StepShape
        from .runner import StepRunner
        from lookahead_kernels.tree import TreeShape

        runner = StepRunner(model, cache, [StepShape(1, 1, T - 1) for T in menu], graphs=device.type == "cuda")

    def timed(step) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    steps = []
    for T in menu:
        ids = torch.zeros(1, T, dtype=torch.long, device=device)
        pos = torch.arange(context, context + T, device=device)[None]
        step = None
        if runner is not None:
            shape = runner.menu[menu.index(T)]
            tree = TreeShape.from_parents(list(range(-1, T - 2)), device=device) if T > 1 else None
            finish = _greedy_finish(shape)
            step = functools.partial(runner.run, shape, ids, pos, context, tree, None, None, finish)
            try:
                timed(step)  # warms up and captures
            except RuntimeError:  # a capture that fails here fails in generate too, which says so
                step = None
        if step is None:
            # A causal block of T tokens: the same cost as a tree of T - 1 nodes after x.
            step = functools.partial(model, ids, pos, cache, context, StepLayout.prefill(T),
                                     torch.arange(T, device=device))
            timed(step)
        steps.append(step)
    # Every size once a round, the rounds one after another: a slow spell of a busy machine (another process, a
    # frequency change) then slows every size alike instead of inflating one, whose table would then steer every
    # later call (a table of 2 back-to-back runs a size once read t(16)/t(1) = 3.6 against 2.6).
    best = [float("inf")] * len(menu)
    for _ in range(runs):
        for i, step in enumerate(steps):
            best[i] = min(best[i], timed(step))
    pairs = list(zip(menu, best))
    return StepCosts.from_pairs(pairs)


def _load_table(path: str) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def _cached_costs(model, key: str, measure, cache_to_disk: bool) -> StepCosts:
    """The costs stored under ``key``: in the model object's memory, else on disk, else ``measure()`` stored
    in both."""
    memo = getattr(model, "step_costs_cache", None)
    if memo is None:
        memo = model.step_costs_cache = {}
    if key in memo:
        return memo[key]
    path = os.path.join(cache_dir(), "step-costs.json")  # beside the converted weights
    table = _load_table(path) if cache_to_disk else {}
    if key in table:
        try:
            memo[key] = StepCosts.from_pairs(table[key])
            return memo[key]
        except (TypeError, ValueError):
            pass  # a damaged entry is measured again
    # Seconds on a CPU, longer on a GPU (graph captures): said, so the pause before a first call's tokens is explained.
    what = "batch step costs" if key.endswith("|batch") else "step costs"
    where = f"; cached in {path}" if cache_to_disk else ""
    print(f"lookahead: measuring this device's {what} (first use{where})", file=sys.stderr, flush=True)
    costs = measure()
    memo[key] = costs
    if cache_to_disk:
        table = _load_table(path)  # re-read: another entry may have been written meanwhile
        table[key] = list(zip(costs.tokens, costs.seconds))
        try:
            save_text(Path(path), json.dumps(table, indent=1))
        except OSError:
            pass  # a read-only cache only costs a measurement next time
    return costs


def step_costs(model, cache_to_disk: bool = True) -> StepCosts:
    """The cost model of ``model`` on its device: from the model object's memory, else the disk cache (keyed by
    device, dtype, thread count, torch version and model shape), else measured now and stored in both."""
    return _cached_costs(model, cost_key(model), lambda: measure_step_costs(model), cache_to_disk)


def batch_step_costs(model, base: StepCosts, tokens: int, cache_to_disk: bool = True) -> StepCosts:
    """``base`` extended with the batch menu's sizes up to ``tokens`` fed per step (measured on first use, with
    one timed run each, and cached like :func:`step_costs` under the key plus ``|batch``)."""
    menu = CPU_BATCH_MENU if model.device.type != "cuda" else GPU_BATCH_MENU
    if tokens <= base.max_tokens or menu[0] <= base.max_tokens:
        return base
    extra = _cached_costs(model, cost_key(model) + "|batch", lambda: measure_step_costs(model, menu, runs=2),
                          cache_to_disk)
    pairs = dict(zip(base.tokens, base.seconds))
    pairs.update((t, s) for t, s in zip(extra.tokens, extra.seconds) if t > base.max_tokens)
    return StepCosts.from_pairs(pairs.items())


class HostCost:
    """Seconds of host work a step with trees takes beside the forward: ``c + a * rows + b * nodes`` (the step's own
    work, e.g. packing its inputs and reading back its results; a row's tree building, KV compaction and
    bookkeeping; each real node's learning, e.g. the successor table's top-k over its logits), fitted by least
    squares with every part >= 0 to the steps measured, older ones discounted by ``HOST_DECAY`` per new one. Where
    the steps measured cannot tell the parts apart (one batch size throughout: ``c`` and ``a * rows`` are then one
    number) the fit without ``c`` is kept. Measured on a CPU with SmolLM2: about 0.5 ms a row and 0.2 ms a node.

    Why ``c`` (session 48): a batch whose rows finish step by step changes size, and a fit through the origin, right
    at 16 rows, took 8 rows' host work for half of 16's where a fixed part kept it at three quarters; predicted on
    the H200 with a flat step cost and 0.3 ms + 0.02 ms a row of host work, 48 MT-Bench prompts refilled through 16
    rows lost to plain decoding (0.98x) on the trees its 8-row tail took; with ``c`` 0.99x (HumanEval 1.04x both)."""

    # The parts' subsets tried where the full fit has a negative part, those without the fixed part first (a tie
    # keeps the earlier: session 47's fit).
    _SUBSETS = ((1, 2), (1,), (2,), (0, 1), (0, 2), (0,))

    def __init__(self):
        # Discounted sums of x_i * x_j for the features x = (1, rows, nodes), of x_i * seconds, and of seconds^2.
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._yy = 0.0
        self._fit = (0.0, 0.0, 0.0)
        self.rounded = self._fit  # the fit in steps of 10 us: StepPlanner.reach's memo key, made once a fit

    def observe(self, rows: int, nodes: int, seconds: float) -> None:
        if not seconds >= 0 or rows < 1 or nodes < 0:
            return
        # A step slowed by something else (a garbage collection, another process on the core) must not turn
        # lookahead off for good: while the fit says trees cost too much the planner takes none, so nothing is
        # measured again, and the fit lives on the model across calls. One 200 ms step after a warm call held
        # the 1.4x of a 500-token prompt that copies its context at plain speed for every later call (session
        # 39). Capped, such a step moves the fit by a few percent; a real rise is followed within tens of steps.
        predicted = self.predict(rows, nodes)
        if predicted > 0:
            seconds = min(seconds, HOST_OUTLIER * predicted)
        d = HOST_DECAY
        xx, xy = self._xx, self._xy
        r, n = float(rows), float(nodes)
        xx[0][0] = d * xx[0][0] + 1.0
        xx[0][1] = xx[1][0] = d * xx[0][1] + r
        xx[0][2] = xx[2][0] = d * xx[0][2] + n
        xx[1][1] = d * xx[1][1] + r * r
        xx[1][2] = xx[2][1] = d * xx[1][2] + r * n
        xx[2][2] = d * xx[2][2] + n * n
        xy[0], xy[1], xy[2] = d * xy[0] + seconds, d * xy[1] + r * seconds, d * xy[2] + n * seconds
        self._yy = d * self._yy + seconds * seconds
        self._fit = self._solve()
        self.rounded = tuple(round(c, 5) for c in self._fit)

    def _solve(self) -> tuple[float, float, float]:
        """The least-squares ``(c, a, b)`` with every part >= 0: the full fit where the rows measured vary and it
        has no negative part (then no subset fits better); else each subset of the parts solved alone, the one
        with the least residual kept (without ``c`` where the rows never varied: ``c`` and ``a`` are one)."""
        xx, xy = self._xx, self._xy
        rows_vary = xx[0][0] * xx[1][1] - xx[0][1] * xx[0][1] > 1e-9 * xx[0][0] * xx[1][1]
        if rows_vary:
            theta = _solve_small((0, 1, 2), xx, xy)
            if theta is not None and min(theta) >= 0:
                return theta
        best, best_sse = (0.0, 0.0, 0.0), None
        for subset in self._SUBSETS:
            if 0 in subset and not rows_vary:
                break
            theta = _solve_small(subset, xx, xy)
            if theta is None or min(theta) < 0:
                continue
            if not rows_vary and subset == (1, 2):  # the least squares of every part but c: no subset fits better
                return theta
            sse = self._yy - 2 * sum(f * y for f, y in zip(theta, xy)) \
                + sum(theta[i] * theta[j] * xx[i][j] for i in subset for j in subset)
            if best_sse is None or sse < best_sse - 1e-9 * max(self._yy, 1e-30):
                best, best_sse = theta, sse
        return best

    @property
    def coefficients(self) -> tuple[float, float]:
        """``(seconds per row, seconds per node)``; ``(0, 0)`` before any measurement."""
        return self._fit[1], self._fit[2]

    @property
    def per_step(self) -> float:
        """Seconds a step with trees takes whatever its rows and nodes (``c``)."""
        return self._fit[0]

    def predict(self, rows: int, nodes: int) -> float:
        c, a, b = self._fit
        return c + a * rows + b * nodes


def _det3(a) -> float:
    return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))


def _solve_small(parts: tuple, xx: list, xy: list) -> tuple[float, float, float] | None:
    """Least squares over ``parts`` (indices into ``(c, a, b)``) from the normal equations ``xx`` and ``xy``, by
    Cramer's rule, as a full ``(c, a, b)`` (0 for the parts left out); None where the system is singular or nearly
    (its determinant under 1e-9 of its diagonal's product)."""
    m = [[xx[i][j] for j in parts] for i in parts]
    y = [xy[i] for i in parts]
    if len(parts) == 1:
        d, scale = m[0][0], m[0][0]
    elif len(parts) == 2:
        d, scale = m[0][0] * m[1][1] - m[0][1] * m[1][0], m[0][0] * m[1][1]
    else:
        d, scale = _det3(m), m[0][0] * m[1][1] * m[2][2]
    if not (scale > 0 and d > 1e-9 * scale):
        return None
    if len(parts) == 1:
        sol = (y[0] / d,)
    elif len(parts) == 2:
        sol = ((y[0] * m[1][1] - m[0][1] * y[1]) / d, (m[0][0] * y[1] - y[0] * m[1][0]) / d)
    else:
        sol = tuple(_det3([[y[r] if c == col else m[r][c] for c in range(3)] for r in range(3)]) / d
                    for col in range(3))
    full = [0.0, 0.0, 0.0]
    for i, t in zip(parts, sol):
        full[i] = t
    return full[0], full[1], full[2]


class GainCalibration:
    """How far the expected extra tokens came true: the tokens the trees' accepted nodes added over the sum of
    the builder's acceptance estimates for the nodes verified, older steps discounted by ``HOST_DECAY`` per new
    one, from a prior of ``CALIBRATION_PRIOR`` tokens come true; at most 1 (estimates are only scaled down).

    Why: at 10 rows on HumanEval 2-node trees emitted 14% fewer tokens than expected, which turned the gain the
    planner saw into a loss (measured step by step, session 7); a batch pays such an error B times over. One
    row too: sampled on MT-Bench, trees came true to 30-40% of their estimates, and scaling them turned 0.96x of
    plain decoding into 1.00x (session 24)."""

    def __init__(self):
        self._expected = self._realised = CALIBRATION_PRIOR

    def observe(self, expected: float, realised: float) -> None:
        if not expected > 0 or not realised >= 0:
            return
        self._expected = HOST_DECAY * self._expected + expected
        self._realised = HOST_DECAY * self._realised + realised

    def relax(self) -> None:
        """A step whose proposals the planner declined: nothing was verified, so the estimate ages back toward the
        prior as an observation would age it. Without this a few failed trees early in a call scaled every later
        estimate down until no tree paid, and with no tree taken nothing could lift it again: a 500-token prompt
        whose answer copies its context ran at plain speed in some calls, 1.4x in others (session 39).

        Greedy decoding only: there whether guesses come true is a property of the text, which changes within a
        call (a stretch that copies comes and goes); a sampled token matches a guess at a rate the temperature
        sets for the whole call, so there ageing only brought back trees that failed again (sampled MT-Bench, 24
        prompts, side by side: 0.951x plain with it, 0.979x without)."""
        self._expected = CALIBRATION_PRIOR + HOST_DECAY * (self._expected - CALIBRATION_PRIOR)
        self._realised = CALIBRATION_PRIOR + HOST_DECAY * (self._realised - CALIBRATION_PRIOR)

    @property
    def factor(self) -> float:
        return min(1.0, self._realised / self._expected)


class StepPlanner:
    """Picks each step's tree size from the expected gains of its nodes and the cost model.

    Args:
        costs: the :class:`StepCosts` of this device, model and dtype.
        window_tokens: tokens the lookahead branch feeds per row (``1``: ``x`` alone, no window).
        host: the :class:`HostCost` learned so far (``None``: no host work counted, nothing learned).
        memo: ``(reach answers, t(T) values)``, dicts the caller keeps for planners of these ``costs`` and
            ``window_tokens`` (:func:`make_plan`: on the model, across calls); ``None``: this planner's own.
    """

    def __init__(self, costs: StepCosts, window_tokens: int, host: "HostCost | None" = None,
                 memo: tuple[dict, dict] | None = None):
        self.costs = costs
        self.window_tokens = window_tokens
        # Host work a step with trees adds beside the forward (building, verifying, learning), by batch size:
        # learned from the steps taken with a measured cost table; none (0) with a given one, so that such a
        # plan stays deterministic.
        self.host = host
        # The estimates scaled by what came true, where the plan learns (a measured cost table) only.
        self.calibration = GainCalibration() if host is not None else None
        # reach()'s answers, and t(T) by T (a step's choice asks for the same few sizes again). Shared by a model's
        # calls: a reach missed is a walk of up to ``budget`` links (0.1 ms for 16 rows on this project's CPU), and
        # each call met its batch's few keys anew (22 walks for 3 calls of 16 rows, session 52).
        self._reach, self._costs = memo if memo is not None else ({}, {})

    def _cost(self, tokens: int) -> float:
        cost = self._costs.get(tokens)
        if cost is None:
            cost = self._costs[tokens] = self.costs(tokens)
        return cost

    def reach(self, batch_size: int, budget: int) -> int:
        """The largest tree per row (at most ``budget``) that a batch of ``batch_size`` rows would take if every
        node were a chain link accepted with chance ``OPTIMISTIC_ACCEPTANCE``; 0: lookahead cannot pay."""
        # The host cost's coefficients, in steps of 10 us, belong to the key: they change as steps are measured.
        # The gain calibration moves a little every step: the chain is scaled by it rounded up to a multiple of
        # REACH_SCALE_STEP (optimistic, as a reach must be), so that a call meets a few scales, not one a step
        # (rounded to 0.01 it missed this cache on a quarter of a row's steps, 0.04-0.1 ms a miss on this
        # project's CPU, session 48).
        scale = min(1.0, math.ceil(self._scale() / REACH_SCALE_STEP - 1e-9) * REACH_SCALE_STEP)
        key = (batch_size, budget, scale) + (self.host.rounded if self.host is not None else ())
        if key not in self._reach:
            if len(self._reach) >= REACH_MEMO_LIMIT:  # a long-lived model meets host fits without end
                self._reach.clear()
            # Every row the same chain: its columns are the chain's links times the rows, without summing a
            # [rows, budget] table (worked out afresh for each batch size and host-cost fit the model meets).
            q = OPTIMISTIC_ACCEPTANCE
            chain = [batch_size * q ** (d + 1) for d in range(budget)]

            def rest(v: int) -> float:  # the links after the v-th: a geometric tail (rounding only adds)
                return batch_size * (q ** (v + 2) - q ** (budget + 1)) / (1 - q) * (1 + 1e-9) + 1e-12

            self._reach[key] = self._best_size(chain, itertools.repeat(batch_size), batch_size, scale=scale,
                                               rest=rest) if batch_size else 0
        return self._reach[key]

    def _scale(self) -> float:
        return self.calibration.factor if self.calibration is not None else 1.0

    def observe_gain(self, expected: float, realised: float) -> None:
        """A step with trees: ``expected`` extra tokens (its rows' estimates for the nodes verified), of which
        ``realised`` came true (nodes accepted)."""
        if self.calibration is not None:
            self.calibration.observe(expected, realised)

    def observe_declined(self) -> None:
        """A greedy step that took none of the trees proposed (see :meth:`GainCalibration.relax`)."""
        if self.calibration is not None:
            self.calibration.relax()

    def choose(self, gains: list[float]) -> int:
        """How many of the nodes to verify. ``gains`` are the nodes' reach probabilities in the order the
        builder took them (each node after its parent), so any prefix is a tree."""
        return self.choose_batch([gains])

    def choose_batch(self, gains: list[list[float]], sizes: list[int] | None = None, rows: int | None = None,
                     weights: list[float] | None = None) -> int:
        """One tree size ``V`` for a batch of rows (``gains[b]``: row ``b``'s nodes as in :meth:`choose`): every
        row feeds ``window_tokens + V`` tokens (shorter trees padded), the step costs ``t(R * (window_tokens +
        V))`` plus, for ``V >= 1``, the trees' host work (:class:`HostCost`) and emits ``B + sum_b E_b(V)`` expected
        tokens (scaled by :class:`GainCalibration`); the best rate wins, 0 (a plain step) when none
        beats it. Ties go to the smaller tree.

        ``sizes`` (ascending): the only tree sizes a step can take (a step replayed from a CUDA graph is padded to
        the next of them); each ``V`` is then costed at the size it is padded to. ``rows``: the rows the step feeds,
        ``R`` (default ``B``, the rows with gains): a padded batch keeps its finished rows, parked, and feeds them
        as many tokens as the others, so its last running rows pay for a tree as wide as the whole batch.
        ``weights[b]``: what a token of row ``b`` is worth (default 1 each): a step's expected tokens are then
        ``sum_b weights[b] * (1 + E_b(V))`` (a batch whose call ends with its slowest row weighs that row's most)."""
        B = len(gains)
        if B == 0:
            return 0
        # Per tree size v + 1: the expected tokens its v-th nodes add (a column of the rows' gains) and how many
        # rows have a v-th node. One pass over columns, not rows within sizes: this runs every step.
        if weights is not None and (len(weights) != B or any(not w >= 0 for w in weights)):
            raise ValueError(f"weights must be None or {B} values >= 0 (one a row), got {weights!r}")
        if weights is not None and B > 1:
            worth = float(sum(weights))
            weighted = [[w * g for g in row] for w, row in zip(weights, gains)]
        else:
            worth, weighted = float(B), gains
        if B == 1:
            columns, widths = gains[0], itertools.repeat(1)
        else:
            columns = [sum(c) for c in itertools.zip_longest(*weighted, fillvalue=0.0)]
            ends = [0] * (len(columns) + 1)
            for row in gains:
                ends[len(row)] += 1
            widths = itertools.accumulate(ends[1:], operator.sub, initial=B - ends[0])  # rows longer than v
        return self._best_size(columns, widths, B, sizes, rows, worth)

    def _best_size(self, columns, widths, B: int, sizes: list[int] | None = None, rows: int | None = None,
                   worth: float | None = None, scale: float | None = None, rest=None) -> int:
        """:meth:`choose_batch` from the rows' gains summed per tree depth (``columns[v]``: the expected tokens the
        rows' ``v``-th nodes add) and ``widths[v]``, how many rows have a ``v``-th node; ``scale``: the gain
        calibration's factor to use (default its own); ``rest(v)``: at least the sum of the columns after the
        ``v``-th, with which the walk stops where no larger tree could beat the best (the same answer: a chain of
        1023 links for 16 rows took 0.7 ms walked to its end, at every call's first steps)."""
        R = B if rows is None else max(rows, B)
        worth = float(B) if worth is None else worth
        best, best_rate = 0, worth / self._cost(R * self.window_tokens)
        per_row, per_node = self.host.coefficients if self.host is not None else (0.0, 0.0)  # one fit per call
        host_step = per_row * B + (self.host.per_step if self.host is not None else 0.0)  # beside the nodes' part
        scale = self._scale() if scale is None else scale
        expected, nodes, fed, cost = worth, 0, 0, 0.0
        padded = iter(sizes) if sizes is not None else None
        for v, (column, width) in enumerate(zip(columns, widths)):
            expected += scale * column
            nodes += width
            if v + 1 > fed:  # the step this many nodes take: v + 1 fed, or the next size it is padded to
                fed = v + 1 if padded is None else next((z for z in padded if z >= v + 1), None)
                if fed is None:  # past the largest size a step can take
                    break
                cost = self._cost(R * (self.window_tokens + fed)) + host_step
            rate = expected / (cost + per_node * nodes)
            bar = best_rate * (BATCH_MARGIN if R > 1 and best == 0 else 1.0)  # the rate a larger tree must beat
            if rate > bar:
                best, best_rate = v + 1, rate
                bar = rate
            # Every 16th size past 32 (a check costs about a size's walk): a larger tree feeds at least v + 2
            # tokens a row and adds at most rest(v) expected tokens.
            if rest is not None and v >= 31 and v % 16 == 15:
                least = self.costs.least_from(R * (self.window_tokens + v + 2)) + host_step + per_node * nodes
                if (expected + scale * rest(v)) / least <= bar:
                    break
        return best


def window_pays(costs: StepCosts, window_tokens: int, tree_tokens: int, batch_size: int = 1) -> bool:
    """Whether running the window (``window_tokens`` instead of ``x`` alone, per row) keeps a step of
    ``batch_size`` rows within ``WINDOW_COST_LIMIT`` of its cost without: true where steps are bound by reading
    weights (GPUs, small batches)."""
    B = batch_size
    return costs(B * (window_tokens + tree_tokens)) <= WINDOW_COST_LIMIT * costs(B * (1 + tree_tokens))


# Tokens a row-step a device tree of V nodes took (lookahead.device_tree, measured: greedy decoding of SmolLM2, 24
# prompts of MT-Bench and of HumanEval, their figures averaged, 128 tokens; what device_tree_size weighs against
# each size's step cost), the tables starting from the token prior: bench/results/static-tree-h200-bf16-prior-s72.md.
DEVICE_TREE_TOKENS = ((1, 1.37), (2, 1.56), (4, 1.73), (8, 2.01), (16, 2.31), (32, 2.56), (64, 2.82))
# The same sampled at transformers' default (temperature 1, top-k 50): a node is accepted with the probability the
# warped distribution gives its token, not whenever it is the top one, so a tree takes fewer tokens a step and smaller
# ones pay at 2-4 and 32-64 rows (bench/results/device-tree-tokens-cpu-zen4-sampled-s76.md; at temperature 0.7,
# top-p 0.9 trees took between the two tables, nearer greedy's).
DEVICE_TREE_TOKENS_SAMPLED = ((1, 1.22), (2, 1.29), (4, 1.31), (8, 1.48), (16, 1.69), (32, 1.84), (64, 1.97))


def device_tree_size(costs: StepCosts, batch_size: int, margin: float = BATCH_MARGIN,
                     tokens: tuple = DEVICE_TREE_TOKENS) -> int:
    """The device tree's node count (``LookaheadConfig(device_tree="auto")``) that maximises a batch's expected
    tokens a second, ``tokens[V] / t(B (1 + V))``, on the step costs ``costs``; 0 (plain steps) unless it beats a
    plain step's ``1 / t(B)`` by ``margin`` (the tree's two launches and its host work are not in ``costs``).
    ``tokens``: ``(V, tokens a row-step)`` pairs, :data:`DEVICE_TREE_TOKENS` (greedy) or
    :data:`DEVICE_TREE_TOKENS_SAMPLED`. On the H200's bfloat16 table, greedy: 64 nodes at one row, 8 at 16 rows, 2
    at 64."""
    require_int("batch_size", batch_size, 1)
    B = batch_size
    plain = 1.0 / costs(B)
    best, best_rate = 0, plain * margin
    for nodes, per_step in tokens:
        rate = per_step / costs(B * (1 + nodes))
        if rate > best_rate:
            best, best_rate = nodes, rate
    return best


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a generate call runs: the step shape, the tree's sources and, in automatic mode, the planner; and
    the parts its steps pack the same every time (:func:`lookahead.step.build_step`'s ``constants``)."""

    shape: object  # lookahead.config.StepShape
    sources: tuple
    planner: StepPlanner | None
    step_constants: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    device_tree: int = 0  # nodes of every step's device tree (LookaheadConfig.device_tree, "auto" resolved); 0: none


def _costs(config, model, tokens: int) -> StepCosts:
    """The step costs ``config`` gives, else ``model``'s measured ones, extended to steps of ``tokens``
    (:func:`batch_step_costs`)."""
    if config.step_costs is not None:
        return StepCosts.from_pairs(config.step_costs)
    return batch_step_costs(model, step_costs(model), tokens)


def make_plan(config, model, batch_size: int = 1, sampled: bool = False) -> Plan:
    """Resolve a :class:`~lookahead.config.LookaheadConfig` for ``model`` and a batch of ``batch_size`` rows.

    Explicit ``window``/``ngram``/``guess``/``max_step_tokens`` are honoured as given. ``LookaheadConfig()`` with
    none of them is the automatic mode: the cost model (``config.step_costs`` when given, else measured and
    cached, and extended to the batch's step sizes on first use) bounds a row's step at the menu's largest size;
    the window (15 x 4, the paper's) runs only where it costs at most ``WINDOW_COST_LIMIT`` more at this batch
    size (and with it the pool its n-grams feed); the planner sizes each step's trees. ``device_tree="auto"``
    takes the same costs and sizes the device tree (:func:`device_tree_size`, on the tokens a step trees took
    sampled where ``sampled``, else greedy; the plan's ``device_tree``, 0 where none pays).
    """
    from .config import StepShape

    if config.device_tree == "auto":
        table = DEVICE_TREE_TOKENS_SAMPLED if sampled else DEVICE_TREE_TOKENS
        nodes = device_tree_size(_costs(config, model, batch_size * (1 + table[-1][0])), batch_size, tokens=table)
        return Plan(StepShape(1, 1, nodes), (), None, device_tree=nodes)
    if not config.automatic:
        return Plan(config.shape(), config.sources, None, device_tree=config.device_tree)
    total = _costs(config, model, 0).max_tokens  # a row's step at most: the menu's largest
    costs = _costs(config, model, batch_size * total)
    window = StepShape(15, 4, 0)
    if total > window.max_tokens and window_pays(costs, window.max_tokens, total - window.max_tokens, batch_size):
        shape = StepShape(window.window, window.levels, total - window.max_tokens)
        sources = config.sources
    else:
        shape = StepShape(1, 1, max(total - 1, 0))
        sources = tuple(s for s in config.sources if s != "pool")
    host = None
    if config.step_costs is None:  # learned across calls: kept on the model (memory only), per cost key
        memo = getattr(model, "host_costs_cache", None)
        if memo is None:
            memo = model.host_costs_cache = {}
        host = memo.setdefault(cost_key(model), HostCost())
    window_tokens = shape.window * shape.levels
    planners = getattr(model, "planner_cache", None)
    if planners is None:
        planners = model.planner_cache = {}
    # Keyed by the table itself (a given one, a measured one, a batch's extension) and the window: every other
    # input of a reach (batch size, budget, gain scale, host fit) is part of its own key.
    memo = planners.setdefault((costs, window_tokens), ({}, {}))
    return Plan(shape, sources, StepPlanner(costs, window_tokens, host, memo))
