"""A prompt's prefill on the graph path: its keys and values written by a replayed CUDA graph.

Why: ``generate`` prefills each row of a batch on its own (the prompts' lengths differ, and a row prefilled alone
keeps its numbers, and so its greedy output, its own), and an eager forward launches every layer's kernels from
Python. On the H200 of session 46 that took about 25-30 ms a SmolLM2 prompt against 1.3 ms for a replayed decoding
step: 16 prompts of 64 new tokens spent 0.46 s prefilling against 1.22 s decoding one at a time, and a batch of 16
spent more on its prefills than on its 64 steps (``bench/results/gpu-h200.md``).

How: a prompt of ``n`` tokens is padded to a bucket of ``T`` tokens (the next power of two, at least 16) and run
from slot 0 of a one-row scratch cache, position ``i`` at slot ``i``; ``T``'s graph is captured the first time a
bucket is used. Its first ``n`` rows, which causal attention keeps free of the padding after them, are then copied
into the row's place in the call's cache. Prompts longer than the largest bucket, and the part of a prompt after
rows a :class:`lookahead.PromptCache` restored, are prefilled eagerly as before. Without graphs (``graphs=False``,
the CPU's static path in tests) the same buckets run eagerly, so that path is tested everywhere.

A padded prefill multiplies matrices of ``T`` rows where an exact one has ``n``: the rounding of its keys and values
may differ in the last bits from an eager prefill's (greedy outputs then agree except at near-ties). Plain decoding,
lookahead, batches and single rows all take this path on the graph path, so they stay equal to each other.
"""

from __future__ import annotations

import torch

from lookahead_kernels import StepLayout

from .runner import capture_graph

SMALLEST_BUCKET = 16
LARGEST_BUCKET = 2048  # the scratch cache's rows; longer prompts prefill eagerly


class _Bucket:
    """One bucket's static inputs (and its graph, once captured)."""

    def __init__(self, tokens: int, device: torch.device):
        self.tokens = torch.zeros(1, tokens, dtype=torch.long, device=device)
        self.positions = torch.arange(tokens, device=device)[None]
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # the scratch's committed rows: none
        self.layout = StepLayout.prefill(tokens)
        self.graph = None
        self.hidden = None  # the last prefill's hidden states [1, tokens, hidden_size] (the graph's output)


class PrefillGraphs:
    """Prefills on static buffers, one CUDA graph per bucket of prompt lengths (see the module's docstring).

    Args:
        model: a :class:`lookahead.model.LlamaForCausalLM`; the scratch cache takes its dtype and device.
        graphs: capture and replay (CUDA only); ``False`` runs the buckets eagerly.
        largest: the largest bucket (a power of two; capped at the model's positions).
    """

    def __init__(self, model, graphs: bool, largest: int = LARGEST_BUCKET):
        if graphs and model.device.type != "cuda":
            raise ValueError(f"prefill graphs need a CUDA model; this one is on {model.device}")
        if isinstance(largest, bool) or not isinstance(largest, int) or largest < SMALLEST_BUCKET \
                or largest & (largest - 1):
            raise ValueError(f"largest must be a power of two >= {SMALLEST_BUCKET}, got {largest!r}")
        # The padding's positions must have rotary angles too: at most the model's positions (none below 16).
        largest = min(largest, 1 << (model.config.max_position_embeddings.bit_length() - 1))
        self.model = model
        self.graphs = bool(graphs)
        self.largest = largest if largest >= SMALLEST_BUCKET else 0
        self.device, self.dtype = model.device, model.dtype
        self.scratch = None  # a one-row KV cache of `largest` rows, made on first use
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None
        self.capture_seconds = 0.0  # spent capturing, warm-up runs included (generate leaves it untimed)

    def prepared(self) -> "PrefillGraphs":
        """Itself, its scratch cache allocated (setup, outside a call's timed part)."""
        if self.scratch is None and self.largest:
            self.scratch = self.model.new_cache(1, self.largest)
        return self

    def bucket(self, n: int) -> int | None:
        """The bucket a prompt of ``n`` tokens runs in, or ``None`` (eager) when none holds it."""
        size = max(SMALLEST_BUCKET, 1 << max(0, int(n) - 1).bit_length())
        return size if 0 < n and size <= self.largest else None

    def prefill(self, tokens: list[int], cache_row) -> bool:
        """Write the keys and values of ``tokens`` (positions and slots ``0 .. n-1``) into ``cache_row``, a
        one-sequence :class:`lookahead.model.KVCache` of this model's dtype and device (e.g. ``cache.sequence(b)``).
        Returns ``False``, having done nothing, when no bucket holds ``n`` tokens."""
        return self.prefill_hidden(tokens, cache_row) is not None

    def prefill_hidden(self, tokens: list[int], cache_row) -> torch.Tensor | None:
        """:meth:`prefill`, returning the prompt's hidden states (``[1, n, hidden_size]``, the model's
        :meth:`~lookahead.model.LlamaForCausalLM.hidden`, a view that the bucket's next prefill overwrites), or
        ``None`` when no bucket holds ``n`` tokens."""
        n = len(tokens)
        size = self.bucket(n)
        if size is None:
            return None
        if cache_row.batch_size != 1 or cache_row.max_len < n or cache_row.dtype != self.dtype \
                or cache_row.device != self.device:
            raise ValueError(f"cache_row must be one sequence of at least {n} rows, {self.dtype} on {self.device}")
        self.prepared()
        buf = self._buckets.get(size)
        if buf is None:
            buf = self._buckets[size] = _Bucket(size, self.device)
        padded = torch.zeros(1, size, dtype=torch.long)  # padding: token 0, never seen by the prompt's rows
        padded[0, :n] = torch.as_tensor(tokens, dtype=torch.long)
        buf.tokens.copy_(padded)
        if not self.graphs:
            buf.hidden = self._forward(buf)
        else:
            if buf.graph is None:
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                buf.graph, buf.hidden, seconds = capture_graph(lambda: self._forward(buf), self.device, self._pool,
                                                               f"a {size}-token prefill")
                self.capture_seconds += seconds
            buf.graph.replay()
        cache_row.k[:, :, :n].copy_(self.scratch.k[:, :, :n])
        cache_row.v[:, :, :n].copy_(self.scratch.v[:, :, :n])
        return buf.hidden[:, :n]

    def _forward(self, buf: _Bucket) -> torch.Tensor:
        with torch.inference_mode():  # hidden states only: a prefill's last token is the first step's input
            return self.model.hidden(buf.tokens, buf.positions, self.scratch, buf.start, buf.layout)


def prefill_graphs(model, graphs: bool) -> PrefillGraphs:
    """The :class:`PrefillGraphs` that ``generate``'s graph path keeps on the model (``model.prefill_graphs``, one
    per device, dtype and ``graphs``; created on first use, as :func:`lookahead.runner.runner_cache` keeps runners)."""
    kept = getattr(model, "prefill_graphs", None)
    if kept is None:
        kept = model.prefill_graphs = {}
    key = (model.device, model.dtype, bool(graphs))
    if key not in kept:
        kept[key] = PrefillGraphs(model, graphs)
    return kept[key]
