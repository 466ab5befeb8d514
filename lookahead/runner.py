"""The "run" part of a decoding step (``shared/design/decode-loop.md``, part 3): static input buffers, and on
CUDA one captured graph per step shape.

A :class:`StepRunner` owns, for each step shape of a small menu, preallocated buffers for everything a forward
reads: the step's tokens and positions, the committed length of each row (``cache_len``), the verification
tree (``depth``, ``end``, real nodes per row) and the rows whose logits are wanted. :meth:`StepRunner.run` writes
a step's inputs into those buffers in place and runs the model on them, eagerly or, with ``graphs=True`` on CUDA,
by replaying the CUDA graph captured for that shape the first time it ran. Given the step's verification
(``finish``, :class:`lookahead.verification.StepVerifier`), the graph holds it too, so one replay takes a step
from its inputs to the tensor the host reads back. Nothing else needs to know the buffers or graphs exist: the
caller hands in ordinary tensors and gets the logits (or the verification's result) back.

Why static buffers: a CUDA graph replays fixed device addresses, so every input must live at the same address on
every step; writing in place (``copy_``) is what makes replay possible, and on the CPU the same path runs eagerly
so both devices take one route through the loop.

The graph path needs a forward without host synchronisation: ``cache_len`` is kept as a device tensor (the
model and the attention kernel never read it back), the tree lives on the device, and the attention kernel
sizes its split-KV from the cache's capacity rather than the current length. A step's inputs given on the host
reach the device in one copy (a pinned staging block laid out like the device buffers). A caller that packs them
in that layout itself (:func:`input_spans`; ``generate``'s steps do, :func:`lookahead.step.build_step`) hands the
block over whole, in one copy, instead of each tensor checked and copied alone.
"""

from __future__ import annotations

import functools
import math
import time

import torch

from lookahead_kernels import StepLayout
from lookahead_kernels.tree import TreeShape

from .config import StepShape


@functools.lru_cache(maxsize=256)
def input_spans(B: int, T: int, V: int, rows: int | None) -> dict[str, tuple[slice, tuple]]:
    """Where a step's integer inputs lie in a runner's flat int64 block, in order: ``{name: (slice, shape)}`` for
    ``tokens``, ``positions [B, T]``, ``cache_len``, ``num_nodes [B]``, ``depth``, ``end [B, V]`` and ``rows [R]``
    (empty without rows); the block's size is ``rows``' stop. A caller that packs a step's inputs in this layout
    (:func:`lookahead.step.build_step`) hands them over in one copy (:meth:`StepRunner.run`'s ``packed``). Cached
    per shape: read it, never change it."""
    spans, start = {}, 0
    for name, shape in (("tokens", (B, T)), ("positions", (B, T)), ("cache_len", (B,)), ("num_nodes", (B,)),
                        ("depth", (B, V)), ("end", (B, V)), ("rows", (rows or 0,))):
        spans[name] = (slice(start, start + math.prod(shape)), shape)
        start += math.prod(shape)
    return spans


class _Inputs:
    """A step's integer inputs as views of one flat int64 block laid out by :func:`input_spans` (``rows`` is
    ``None`` without rows)."""

    def __init__(self, block: torch.Tensor, spans: dict, has_rows: bool):
        for name, (where, shape) in spans.items():
            setattr(self, name, block[where].view(shape))
        if not has_rows:
            self.rows = None


class _ShapeBuffers:
    """The static inputs (and, once captured, the graph and its output) of one ``(shape, logits rows)``.

    The inputs are views of one device block; on CUDA a pinned host block of the same layout stages a step's host
    inputs, so that they reach the device in one copy (each small copy is a launch of its own)."""

    def __init__(self, shape: StepShape, batch_size: int, rows: int | None, device: torch.device,
                 advance: bool = False):
        B, T, V = batch_size, shape.max_tokens, shape.tree_budget
        self.shape = shape
        self.advance = advance  # the step writes the next one's inputs (StepRunner.run's advance)
        self.spans = input_spans(B, T, V, rows)
        size = self.spans["rows"][0].stop
        self.device_block = torch.zeros(size, dtype=torch.long, device=device)
        self.inputs = _Inputs(self.device_block, self.spans, rows is not None)
        self.host_block = self.staging = self.staged = None
        if device.type == "cuda":
            self.host_block = torch.zeros(size, dtype=torch.long, pin_memory=True)
            self.staging = _Inputs(self.host_block, self.spans, rows is not None)
            self.staged = None  # an event recorded after the last copy out of the staging block
        x = self.inputs
        x.positions.copy_(torch.arange(T).expand(B, T))
        # A valid tree to start from (every node a child of x); each step overwrites it in place.
        x.depth.fill_(1)
        x.end.copy_(torch.arange(1, V + 1).expand(B, V))
        x.num_nodes.fill_(V)
        if rows is not None:
            x.rows.copy_(torch.arange(rows))
        tree = TreeShape(x.depth, x.end) if V else None
        self.layout = StepLayout(shape.window, shape.levels, tree)
        # float64 [B, U]: a sampled finish's random numbers, drawn before each step (a captured buffer keeps one
        # size: its key holds the sampler's parameters and the shape).
        self.uniforms = None
        self.graph = None
        self.out = None  # the graph's output: the logits, or the captured verification's result


class StepRunner:
    """Runs a model's steps on static input buffers, one set per step shape of ``menu``.

    Args:
        model: a :class:`lookahead.model.LlamaForCausalLM`.
        cache: the :class:`lookahead.model.KVCache` every step writes (the graphs hold its address: keep it).
        menu: the step shapes this runner serves (:class:`lookahead.config.StepShape`; ``StepShape(1, 1, 0)``
            is a plain step). A step runs at its shape's full size, ``window * levels + tree_budget`` tokens;
            a smaller tree is padded by the caller (verification ignores padding nodes).
        graphs: capture and replay a CUDA graph per shape (CUDA only); ``False`` runs eagerly on the same
            buffers (the debugging path, and the only one on the CPU).
    Raises:
        ValueError: on an empty menu, a cache that does not fit the model, or ``graphs=True`` off CUDA.
    """

    def __init__(self, model, cache, menu, *, graphs: bool = False):
        menu = list(dict.fromkeys(menu))
        if not menu or not all(isinstance(s, StepShape) for s in menu):
            raise ValueError(f"menu must be a non-empty list of StepShape, got {menu!r}")
        if cache.device != model.device or cache.dtype != model.dtype:
            raise ValueError(f"cache is {cache.dtype} on {cache.device} but the model is {model.dtype} on "
                             f"{model.device}")
        if graphs and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model; this one is on {model.device} (use graphs=False)")
        self.model = model
        self.cache = cache
        self.menu = tuple(menu)
        self.graphs = bool(graphs)
        self.batch_size = cache.batch_size
        self.device = model.device
        self._buffers: dict[tuple, _ShapeBuffers] = {}  # (shape, logits rows, captured finish key)
        self._pool = None  # one memory pool for all graphs: only one step's activations live at a time
        self.capture_seconds = 0.0  # spent capturing graphs, warm-up runs included (generate leaves it untimed)
        self._state: dict[tuple, torch.Tensor] = {}  # state() tensors, kept while the runner lives

    # ---- public ---------------------------------------------------------------------------------------------
    def run(self, shape: StepShape, tokens: torch.Tensor, positions: torch.Tensor, cache_len,
            tree: TreeShape | None = None, logits_rows: torch.Tensor | None = None, num_nodes=None,
            finish=None, packed: torch.Tensor | None = None, advance: bool = False) -> torch.Tensor:
        """Write one step's inputs into ``shape``'s buffers and run the model; returns its logits, or with
        ``finish`` what ``finish`` makes of them.

        Args:
            shape: one of the runner's menu.
            tokens, positions: integer ``[B, T]`` with ``T == shape.max_tokens`` (any device: copied in).
            cache_len: int or integer ``[B]``: committed rows per sequence.
            tree: the step's verification tree of ``shape.tree_budget`` nodes (``[V]`` or ``[B, V]``); ``None``
                for a shape without a tree.
            logits_rows: optional integer ``[R]`` of step rows whose logits are wanted (all rows when ``None``).
                Each distinct ``R`` of a shape gets its own buffers (and graph).
            num_nodes: integer ``[B]``: real tree nodes per row (``None``: the whole tree), for ``finish``.
            finish: optional ``finish(logits, inputs)`` run on the logits and the step's buffers as a
                :class:`lookahead.verification.StepInputs` (with graphs, captured with the forward), with ``key``
                (hashable: its own graph per key) and ``uniforms_per_row`` (sampling: that many random numbers a
                row, drawn into a buffer of this shape before each step, outside the graph:
                :func:`lookahead.verification.step_uniforms`); where it has ``prepare(inputs)``, that runs before
                the forward, in the graph too (inputs made on the device: :mod:`lookahead.device_tree`).
            packed: optional: the same inputs (every one of them, ``num_nodes`` and ``logits_rows`` included) as one
                contiguous int64 CPU tensor laid out by :func:`input_spans` for this shape, batch and ``R``: copied
                in as it is, in one copy, instead of each argument checked and copied alone (the caller packed them
                from the same values: :func:`lookahead.step.build_step`). The arguments above still pick the
                buffers (``logits_rows``' length) and are what the eager path would read.
            advance: the step also writes the next step's inputs into its buffers, on the device, for :meth:`replay`
                (a step of ``x`` alone or before a tree, with ``finish``, which gives ``next_inputs(out)``: each row's
                next ``x`` and how many tokens it emitted, integer ``[B]``): each live row (:meth:`set_live`) feeds
                its last emitted token next, its cache length grows by what it emitted, and its positions follow;
                a parked row stays where it is. The host may then launch the next step before reading this one's
                result (``generate``'s overlapped steps). Its own buffers and graph.
        Returns:
            float32 ``[B, R or T, vocab]`` logits, or ``finish``'s result. With graphs this is the graph's static
            output, overwritten by the next replay of the same shape: read it (or copy it) before then.
        Raises:
            ValueError: on a shape outside the menu or inputs of the wrong shape, dtype or tree size.
        """
        if advance and (finish is None or shape.window * shape.levels != 1):
            raise ValueError(f"advance needs a finish and a step of x alone or before a tree, got shape {shape}")
        buf = self._buffers_for(shape, logits_rows, finish, advance)
        if packed is not None:
            self._write_packed(buf, packed)
        else:
            self._write_inputs(buf, tokens, positions, cache_len, tree, logits_rows, num_nodes)
        return self._launch(buf, finish)

    def replay(self, shape: StepShape, finish, logits_rows: torch.Tensor | None = None):
        """Run an advancing step (:meth:`run` with ``advance=True``) again on the inputs its last run left in its
        buffers: nothing is written from the host. Returns what :meth:`run` returns.

        Raises:
            ValueError: when no advancing step of this shape, rows and finish has run on this runner."""
        buf = self._buffers.get(self._key(shape, None if logits_rows is None else logits_rows.shape[0], finish, True))
        if buf is None:
            raise ValueError(f"replay needs an advancing run of step shape {shape} with this finish first")
        return self._launch(buf, finish)

    def set_live(self, live: list[bool]) -> None:
        """Which rows an advancing step moves on (the others are parked: their inputs stay as written)."""
        if len(live) != self.batch_size:
            raise ValueError(f"set_live needs {self.batch_size} flags, got {len(live)}")
        self._live().copy_(torch.tensor([int(bool(f)) for f in live], dtype=torch.long))

    def _live(self) -> torch.Tensor:
        return self.state("live rows", (self.batch_size,), torch.long)

    def _launch(self, buf: _ShapeBuffers, finish):
        """The step on ``buf``'s inputs as they are: eagerly, or by replaying its graph (captured on first use)."""
        shape = buf.shape
        if finish is not None:
            from .verification import step_uniforms

            buf.uniforms = step_uniforms(finish, self.batch_size, self.device, buf.uniforms)
        if not self.graphs:
            with torch.inference_mode():
                return self._step(buf, finish)
        if buf.graph is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            # The warm-up runs rewrite the step's own KV rows from the same inputs (and compact them again from the
            # same verification), so running them before the capture leaves the cache as one run would.
            # An advancing step moves its own inputs on: each warm-up run starts from the inputs as written, and
            # so does the first replay.
            written = buf.device_block.clone() if buf.advance else None
            restore = None if written is None else lambda: buf.device_block.copy_(written)
            buf.graph, buf.out, seconds = capture_graph(lambda: self._step(buf, finish), self.device, self._pool,
                                                        f"step shape {shape}", restore)
            self.capture_seconds += seconds
        buf.graph.replay()
        return buf.out

    def state(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A zero-initialised tensor on the device, the same one for every call asking with these arguments (a
        captured graph reads it at its address, so none is ever replaced): per-row state a step's finish reads,
        such as the logits processors' (:mod:`lookahead.processors`)."""
        key = (name, tuple(shape), dtype)
        if key not in self._state:
            self._state[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self._state[key]

    def captured(self) -> list[StepShape]:
        """Shapes whose graph has been captured (in first-run order)."""
        return [b.shape for b in self._buffers.values() if b.graph is not None]

    # ---- internals ----------------------------------------------------------------------------------------
    def _key(self, shape: StepShape, rows: int | None, finish, advance: bool) -> tuple:
        """A step's buffers (and graph): by shape, logits rows, the captured finish (graphs only) and advance."""
        return (shape, rows, None if finish is None or not self.graphs else finish.key, advance)

    def _buffers_for(self, shape: StepShape, logits_rows, finish=None, advance: bool = False) -> _ShapeBuffers:
        if shape not in self.menu:
            raise ValueError(f"step shape {shape} is not on this runner's menu {list(self.menu)}")
        rows = None
        if logits_rows is not None:
            if not isinstance(logits_rows, torch.Tensor) or logits_rows.dim() != 1 \
                    or logits_rows.is_floating_point() or logits_rows.dtype == torch.bool:
                raise ValueError(f"logits_rows must be None or an integer tensor [R], got {logits_rows!r}")
            rows = logits_rows.shape[0]
        key = self._key(shape, rows, finish, advance)
        if key not in self._buffers:
            self._buffers[key] = _ShapeBuffers(shape, self.batch_size, rows, self.device, advance)
        return self._buffers[key]

    def _write_inputs(self, buf: _ShapeBuffers, tokens, positions, cache_len, tree, logits_rows, num_nodes) -> None:
        B, T, V = self.batch_size, buf.shape.max_tokens, buf.shape.tree_budget
        for name, t in (("tokens", tokens), ("positions", positions)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (B, T) or t.is_floating_point() \
                    or t.dtype == torch.bool:
                desc = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} must be an integer tensor [B={B}, T={T}] for shape {buf.shape}, got {desc}")
        if V:
            if not isinstance(tree, TreeShape) or tree.size != V:
                got = tree.size if isinstance(tree, TreeShape) else type(tree).__name__
                raise ValueError(f"shape {buf.shape} needs a TreeShape of {V} nodes, got {got}")
            if tree.batched and tree.end.shape[0] != B:
                raise ValueError(f"the per-sequence tree has {tree.end.shape[0]} rows but the batch has B={B}")
        elif tree is not None and tree.size:
            raise ValueError(f"shape {buf.shape} has no tree, but a tree of {tree.size} nodes was given")
        if isinstance(cache_len, bool) or not isinstance(cache_len, (int, torch.Tensor)):
            raise ValueError(f"cache_len must be an int or an integer tensor [B], got {cache_len!r}")
        if isinstance(cache_len, torch.Tensor) and (cache_len.is_floating_point() or cache_len.dtype == torch.bool
                                                    or cache_len.numel() not in (1, B)):
            raise ValueError(f"cache_len must be an int or an integer tensor [B={B}], got {cache_len!r}")
        # Host-side bounds only where checking costs no synchronisation.
        if not isinstance(cache_len, torch.Tensor) or cache_len.device.type == "cpu":
            self._check_cache_len(torch.as_tensor(cache_len).reshape(-1).tolist(), T)
        if num_nodes is not None and (not isinstance(num_nodes, torch.Tensor) or num_nodes.shape != (B,)
                                      or num_nodes.is_floating_point() or num_nodes.dtype == torch.bool):
            raise ValueError(f"num_nodes must be None or an integer tensor [B={B}], got {num_nodes!r}")
        given = [tokens, positions, cache_len, logits_rows, num_nodes] + ([tree.depth, tree.end] if V else [])
        # Host inputs go through the pinned block: one copy to the device instead of one per buffer.
        staged = buf.staging is not None and all(not isinstance(t, torch.Tensor) or t.device.type == "cpu"
                                                 for t in given)
        if staged:
            self._staging_free(buf)
        dst = buf.staging if staged else buf.inputs
        dst.tokens.copy_(tokens, non_blocking=True)
        dst.positions.copy_(positions, non_blocking=True)
        if isinstance(cache_len, int):
            dst.cache_len.fill_(cache_len)
        else:
            dst.cache_len.copy_(cache_len.reshape(-1).expand(B), non_blocking=True)
        if V:
            dst.depth.copy_(tree.depth.expand(B, V), non_blocking=True)
            dst.end.copy_(tree.end.expand(B, V), non_blocking=True)
        if logits_rows is not None:
            dst.rows.copy_(logits_rows, non_blocking=True)
        if num_nodes is None:
            dst.num_nodes.fill_(V)
        else:
            dst.num_nodes.copy_(num_nodes, non_blocking=True)
        if staged:
            self._send_staged(buf)

    @staticmethod
    def _staging_free(buf: _ShapeBuffers) -> None:
        if buf.staged is not None:
            buf.staged.synchronize()  # the last step's copy has left the staging block (its read-back waited)

    @staticmethod
    def _send_staged(buf: _ShapeBuffers) -> None:
        """The staging block to the device in one copy, and an event to know when it has left."""
        buf.device_block.copy_(buf.host_block, non_blocking=True)
        buf.staged = torch.cuda.Event()
        buf.staged.record()

    def _check_cache_len(self, lens: list[int], T: int) -> None:
        if min(lens) < 0 or max(lens) + T > self.cache.max_len:
            raise ValueError(f"cache_len {lens} + T {T} must lie within the cache's {self.cache.max_len} rows")

    def _write_packed(self, buf: _ShapeBuffers, packed: torch.Tensor) -> None:
        """``packed`` (see :meth:`run`) into ``buf``'s inputs in one copy (through the pinned block on CUDA). Checked:
        its type, size and the rows' cache lengths (a step past the cache would write past its rows); the rest is
        the packer's (tests/test_runner.py checks a packed step against one given argument by argument)."""
        block = buf.device_block
        if not isinstance(packed, torch.Tensor) or packed.dtype != torch.long or packed.device.type != "cpu" \
                or not packed.is_contiguous() or packed.numel() != block.numel():
            desc = (packed.dtype, tuple(packed.shape), str(packed.device)) if isinstance(packed, torch.Tensor) \
                else type(packed).__name__
            raise ValueError(f"packed must be a contiguous int64 CPU tensor of {block.numel()} elements (the "
                             f"inputs of shape {buf.shape} for {self.batch_size} rows), got {desc}")
        # A few ints: Python's min and max beat NumPy's calls.
        self._check_cache_len(packed.numpy()[buf.spans["cache_len"][0]].tolist(), buf.shape.max_tokens)
        if buf.staging is None:
            block.copy_(packed)
            return
        self._staging_free(buf)
        buf.host_block.copy_(packed)
        self._send_staged(buf)

    def _inputs(self, buf: _ShapeBuffers):
        from .verification import StepInputs

        x = buf.inputs
        tree = buf.shape.tree_budget > 0
        return StepInputs(tokens=x.tokens, end=x.end if tree else None, num_nodes=x.num_nodes, cache=self.cache,
                          cache_len=x.cache_len, uniforms=buf.uniforms, depth=x.depth if tree else None)

    def _forward(self, buf: _ShapeBuffers) -> torch.Tensor:
        x = buf.inputs
        return self.model(x.tokens, x.positions, self.cache, x.cache_len, buf.layout, x.rows)

    def _step(self, buf: _ShapeBuffers, finish):
        if finish is not None and hasattr(finish, "prepare"):  # inputs made on the device (lookahead.device_tree)
            finish.prepare(self._inputs(buf))
        logits = self._forward(buf)
        if finish is None:
            return logits
        out = finish(logits, self._inputs(buf))
        if buf.advance:
            self._advance(buf, *finish.next_inputs(out))
        return out

    def _advance(self, buf: _ShapeBuffers, x: torch.Tensor, emitted: torch.Tensor) -> None:
        """The next step's inputs from this one's result, in place (``run``'s ``advance``): x first, then the tree's
        nodes at their depths past the new cache length."""
        inputs = buf.inputs
        live = self._live()
        inputs.tokens[:, 0] = torch.where(live > 0, x, inputs.tokens[:, 0])
        inputs.cache_len.add_(emitted * live)
        inputs.positions[:, 0] = inputs.cache_len
        if buf.shape.tree_budget:
            inputs.positions[:, 1:] = inputs.depth + inputs.cache_len[:, None]


def capture_graph(run, device: torch.device, pool, what: str, restore=None):
    """Capture ``run()`` (device work only, no host synchronisation) in a CUDA graph drawing on memory ``pool``
    (``torch.cuda.graph_pool_handle()``): two warm-up runs on a side stream first (they compile the kernels), then
    the capture. ``restore()`` (optional, device work, not captured) runs before each warm-up run and after the
    capture: for a ``run`` that changes its own inputs. Returns ``(graph, run's output inside the graph, seconds it
    all took)``, the device's work included. Raises ``RuntimeError`` naming ``what`` and the eager loop when the
    capture fails."""
    started = time.perf_counter()
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for _ in range(2):
                if restore is not None:
                    restore()
                run()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
            out = run()
        if restore is not None:
            with torch.inference_mode():
                restore()
    except Exception as exc:
        raise RuntimeError(f"capturing the CUDA graph of {what} failed ({type(exc).__name__}: {exc}); "
                           "generate(..., cuda_graphs=False) runs the eager loop") from exc
    torch.cuda.synchronize(device)  # the warm-up runs' device work belongs to the capture's time
    return graph, out, time.perf_counter() - started


def _pooled_rows(min_len: int, limit: int) -> int:
    """Rows of a cache kept for later calls: ``min_len`` rounded up to a power of two, at least 1024, at most
    ``limit`` (never below ``min_len``), so that later calls with somewhat longer prompts reuse it."""
    return min(max(1024, 1 << (int(min_len) - 1).bit_length()), max(int(limit), int(min_len)))


class RunnerCache:
    """Step runners kept between ``generate`` calls on one model, so that each step shape's CUDA graph is captured
    once rather than once per call (a capture runs the step's forward three times, two warm-up runs and the
    capture: captured per call, the five shapes of a warming-up lookahead call would add about fifteen eager
    forwards to every call).

    A runner is keyed by its model's device and dtype, its batch size, step menu and ``graphs``; it serves any call
    whose KV cache fits its own. :meth:`take` hands a runner out (a stored one, else a new one) and removes it
    from the cache, so two calls never share one; :meth:`give_back` stores it again, dropping the least recently
    used beyond ``keep``. Stored runners hold their KV cache and graphs (device memory): :meth:`clear` frees them.

    Args:
        keep: how many idle runners to keep (>= 0). A padded batch moves to smaller runners as its rows finish (16
            rows: runners of 16, 8, 4, 2 and 1), all of which a next call of that size takes again: fewer kept would
            capture some sizes' graphs again every call. Plain decoding and lookahead have different menus, so
            calls alternating between them at 16 rows use ten (with 8 kept, the bench's dry run rebuilt a runner
            inside a timed call). A new runner that does not fit in the device's memory first frees the idle ones.
    """

    def __init__(self, keep: int = 12):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an int >= 0, got {keep!r}")
        self.keep = keep
        self._idle: dict[tuple, StepRunner] = {}

    @staticmethod
    def _key(model, batch_size: int, menu, graphs: bool) -> tuple:
        return (model.device, model.dtype, batch_size, tuple(dict.fromkeys(menu)), bool(graphs))

    def take(self, model, batch_size: int, menu, min_len: int, *, graphs: bool) -> StepRunner:
        """A runner for ``batch_size`` rows and ``menu`` whose cache holds at least ``min_len`` rows per sequence.

        A new runner's cache is rounded up to a power of two (at least 1024 rows, at most the model's positions
        plus the menu's largest step), so that later calls with somewhat longer prompts reuse it."""
        key = self._key(model, batch_size, menu, graphs)
        runner = self._idle.pop(key, None)
        if runner is not None and runner.cache.max_len >= min_len:
            return runner
        limit = model.config.max_position_embeddings + max(s.max_tokens for s in key[3])
        try:
            cache = model.new_cache(batch_size, _pooled_rows(min_len, limit))
        except torch.OutOfMemoryError:
            if not self._idle:
                raise
            self.clear()  # idle runners hold their caches and graphs: give their memory to this one
            if model.device.type == "cuda":
                torch.cuda.empty_cache()
            cache = model.new_cache(batch_size, _pooled_rows(min_len, limit))
        return StepRunner(model, cache, key[3], graphs=graphs)

    def give_back(self, runner: StepRunner) -> None:
        """Store ``runner`` for a later :meth:`take` (the most recently given back is kept longest)."""
        key = self._key(runner.model, runner.batch_size, runner.menu, runner.graphs)
        self._idle.pop(key, None)
        self._idle[key] = runner
        while len(self._idle) > self.keep:
            self._idle.pop(next(iter(self._idle)))

    def runners(self) -> list[StepRunner]:
        """The idle runners, least recently given back first."""
        return list(self._idle.values())

    def clear(self) -> None:
        """Drop every idle runner (their caches and graphs are freed once nothing else holds them)."""
        self._idle.clear()


class CachePool:
    """KV caches kept between ``generate`` calls on one model for the eager loop (the graph path's live in its
    runners). Why: allocating and zeroing a cache is paid per call otherwise, ~0.1-0.4 s of a 4-second call for 16
    SmolLM2 rows on this project's CPU, and a lookahead call's cache is a few rows longer than plain decoding's,
    which alone made lookahead 2-3% slower than plain in 16-row batches that took only plain steps.

    One idle cache per model device, dtype and batch size (the ``keep`` most recently given back); :meth:`take`
    hands it out when it is long enough, else a new one, its rows rounded up to a power of two (at least 1024,
    at most ``limit``) so that later calls with somewhat longer prompts reuse it. Stored caches hold memory:
    :meth:`clear` frees them.
    """

    def __init__(self, keep: int = 4):
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise ValueError(f"keep must be an int >= 0, got {keep!r}")
        self.keep = keep
        self._idle: dict[tuple, object] = {}

    def take(self, model, batch_size: int, min_len: int, limit: int):
        """A :class:`lookahead.model.KVCache` of ``batch_size`` rows holding at least ``min_len`` positions each."""
        key = (model.device, model.dtype, batch_size)
        cache = self._idle.pop(key, None)
        if cache is not None and cache.max_len >= min_len:
            return cache
        return model.new_cache(batch_size, _pooled_rows(min_len, limit))

    def give_back(self, cache) -> None:
        """Store ``cache`` (its whole storage, every batch row) for a later :meth:`take`."""
        whole = cache.renewed()
        key = (whole.device, whole.dtype, whole.batch_size)
        self._idle.pop(key, None)
        self._idle[key] = whole
        while len(self._idle) > self.keep:
            self._idle.pop(next(iter(self._idle)))

    def clear(self) -> None:
        self._idle.clear()


def cache_pool(model) -> CachePool:
    """``model.kv_caches``, the :class:`CachePool` that ``generate``'s eager loop keeps on the model (created on
    first use)."""
    pool = getattr(model, "kv_caches", None)
    if pool is None:
        pool = model.kv_caches = CachePool()
    return pool


def runner_cache(model) -> RunnerCache:
    """``model.step_runners``, the :class:`RunnerCache` that ``generate`` keeps on the model (created on first use,
    as the controller keeps its cost model in ``model.step_costs_cache``)."""
    cache = getattr(model, "step_runners", None)
    if cache is None:
        cache = model.step_runners = RunnerCache()
    return cache
