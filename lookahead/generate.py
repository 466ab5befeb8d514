"""The decoding loops: plain autoregressive and lookahead, greedy or sampled, with one read-back per step.

Convention shared by both loops: the prefill writes the prompt minus its last token into the cache, and every
step then feeds ``x`` (the last committed token) at position ``cache_len``. So each step is one forward pass,
and plain decoding makes exactly one step per new token (compression 1.0).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import torch

from lookahead_kernels import StepLayout

from .arguments import resolve_generate_arguments
from .config import LookaheadConfig
from .controller import make_plan
from .draft import DraftBuilder
from .step import build_step
from .window import LookaheadWindow

PROMPT_SUCCESSOR_ROWS = 256
# generate's default: the automatic step size (a frozen config, shared safely).
AUTOMATIC = LookaheadConfig()


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """What one lookahead step offered and produced (recorded only with ``generate(..., trace=True)``).

    Attributes:
        x_index: index of the step's input token ``x`` in ``sequences[0]``.
        tokens: the tree's real nodes' tokens, in pre-order.
        parents: each node's parent (``-1`` for children of ``x``).
        sources: per node, the names of the sources that proposed it.
        ngrams: the window's n-grams the step produced (``W`` tuples of ``N`` ids; empty while warming up).
        path: the accepted nodes, root first (the bonus token not counted).
    """

    x_index: int
    tokens: tuple
    parents: tuple
    sources: tuple
    ngrams: tuple
    path: tuple

    @property
    def accepted(self) -> int:
        return len(self.path)


@dataclasses.dataclass
class GenerationStats:
    """What one ``generate`` call did.

    Attributes:
        new_tokens: tokens emitted after the prompt.
        steps: forward passes after the prefill.
        fed_tokens: tokens fed by all steps after the prefill (``fed_tokens / steps`` is the mean step size).
        seconds: wall time of the whole call, prefill included.
        prefill_seconds: wall time of the prefill alone.
        accepted: per step, the tokens it emitted (accepted candidate tokens plus the bonus token).
        trace: per lookahead step, a :class:`StepTrace` when ``generate`` was called with ``trace=True``, else
            ``None``. For analysing guess quality (``bench/bench_guesses.py``); it costs host memory per step.
    """

    new_tokens: int = 0
    steps: int = 0
    fed_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    accepted: list = dataclasses.field(default_factory=list)
    trace: list | None = None

    @property
    def compression_ratio(self) -> float:
        """New tokens per forward pass after the prefill (1.0 for plain decoding)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass
class GenerateOutput:
    """``sequences``: LongTensor ``[1, prompt_len + new_tokens]``; ``stats``: :class:`GenerationStats`."""

    sequences: torch.Tensor
    stats: GenerationStats


def _check_input_ids(input_ids, vocab_size: int) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a LongTensor [1, prompt_len], got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [1, prompt_len], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"generate supports batch size 1 only, got a batch of {input_ids.shape[0]}")
    if input_ids.shape[1] == 0:
        raise ValueError("the prompt is empty: input_ids needs at least one token")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got values in [{lo}, {hi}]")
    return input_ids.long()


def _eos_set(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


class _Emitter:
    """Collects emitted tokens, stopping exactly at ``max_new_tokens`` and right after an EOS token."""

    def __init__(self, prompt: list[int], max_new_tokens: int, eos: set[int], streamer):
        self.sequence = list(prompt)
        self.new = 0
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.streamer = streamer
        self.done = False

    def emit(self, tokens: Iterable[int]) -> int:
        """Append tokens until a stop; returns how many were taken."""
        taken = []
        for t in tokens:
            taken.append(t)
            self.new += 1
            if t in self.eos or self.new >= self.max_new_tokens:
                self.done = True
                break
        self.sequence.extend(taken)
        if self.streamer is not None and taken:
            self.streamer(taken)
        return len(taken)


class _Sampler:
    """Greedy or sampled choice of tokens from logits rows; holds the sampling parameters and generator."""

    def __init__(self, do_sample: bool, temperature, top_k, top_p, generator):
        self.params = None
        self.generator = generator
        if do_sample:
            from .sampling import SamplingParams  # sampling utilities live beside the verifier's reference

            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            self.params = None if params.is_greedy else params

    @property
    def greedy(self) -> bool:
        return self.params is None

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """LongTensor ``[R]``: one token per row of ``logits [R, V]``."""
        if self.greedy:
            if logits.device.type == "cuda":
                from lookahead_kernels import row_argmax

                return row_argmax(logits)
            return logits.argmax(-1)
        from .sampling import sample_rows, warp_logits

        return sample_rows(warp_logits(logits, self.params), self.generator)

    def verify_tree(self, x_logits, node_logits, tokens, end, num_nodes, max_accept: int):
        """Verification of one sequence's tree: ``(accept_len [1], path [1, max_accept], emitted [1, max_accept+1])``.

        ``x_logits [vocab]``, ``node_logits [V, vocab]``, ``tokens``/``end`` ``[V]`` on the logits' device;
        ``num_nodes``: int64 ``[1]`` real nodes (the rest padding) or ``None`` for all."""
        device = x_logits.device
        cuda = device.type == "cuda"
        if self.greedy:
            if cuda:
                from lookahead_kernels import verify_tree_greedy as verify
            else:
                from lookahead_kernels import verify_tree_greedy_reference as verify
            return verify(x_logits[None], node_logits[None], tokens[None], end[None], num_nodes, max_accept)
        from lookahead_kernels import draw_tree_uniforms

        from .sampling import warp_logits

        x_probs = warp_logits(x_logits[None], self.params)
        node_probs = warp_logits(node_logits, self.params)[None]
        uniforms = draw_tree_uniforms(1, tokens.shape[0], device, self.generator)
        if cuda:
            from lookahead_kernels import verify_tree_sample as verify
        else:
            from lookahead_kernels import verify_tree_sample_reference as verify
        return verify(x_probs, node_probs, tokens[None], end[None], num_nodes, max_accept, uniforms=uniforms)


@torch.inference_mode()
def generate(model, input_ids=None, max_new_tokens: int | None = None, *,
             lookahead: LookaheadConfig | None = AUTOMATIC, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None, eos_token_id=None, pad_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, generation_config=None, streamer=None,
             trace: bool = False, **kwargs) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (``[1, prompt_len]`` or ``[prompt_len]``).

    ``lookahead=None`` decodes one token per forward pass; a :class:`LookaheadConfig` decodes with lookahead; the
    default ``LookaheadConfig()`` sizes each step from the device's measured cost (measured once, outside
    ``stats.seconds``).
    Greedy output is identical either way; sampled output has the same distribution. Generation stops after
    ``max_new_tokens`` tokens (default 128) or right after an EOS token (``eos_token_id``: an int or a list;
    default the model's own).
    transformers' conventions are accepted (:mod:`lookahead.arguments`): ``attention_mask`` (all ones, or left
    padding, which ``sequences`` keeps in front), ``pad_token_id``, ``max_length``, a ``generation_config``
    (keywords override it), ``None`` for an unset parameter; anything unsupported is a ``ValueError`` naming it.
    ``streamer`` is a callable called with each step's newly emitted tokens, or an object with ``put``/``end``
    such as transformers' ``TextStreamer``. ``trace=True`` records each lookahead step's candidates and window
    n-grams in ``stats.trace`` (see :class:`StepTrace`).
    """
    args = resolve_generate_arguments(
        input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        generation_config=generation_config, streamer=streamer, one_token_per_step=lookahead is None, extra=kwargs)
    input_ids, max_new_tokens, streamer, eos_token_id = args.input_ids, args.max_new_tokens, args.streamer, \
        args.eos_token_id
    do_sample, temperature, top_k, top_p = args.do_sample, args.temperature, args.top_k, args.top_p
    if streamer is not None:
        streamer.start(torch.cat([args.padding, input_ids], dim=1))
    _load_pool_extension_untimed(lookahead, model.device)
    started = time.perf_counter()
    cfg = model.config
    ids = _check_input_ids(input_ids, cfg.vocab_size)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    prompt_len = ids.shape[1]
    if prompt_len + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({prompt_len} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"{cfg.max_position_embeddings} positions")
    if lookahead is not None and not isinstance(lookahead, LookaheadConfig):
        raise ValueError(f"lookahead must be a LookaheadConfig or None, got {type(lookahead).__name__}")
    if not isinstance(trace, bool):
        raise ValueError(f"trace must be a bool, got {trace!r}")
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be a bool, got {do_sample!r}")
    sampler = _Sampler(do_sample, temperature, top_k, top_p, generator)
    device = model.device
    prompt = ids[0].tolist()
    emitter = _Emitter(prompt, max_new_tokens, _eos_set(model, eos_token_id), streamer)
    stats = GenerationStats(trace=[] if trace else None)

    # The plan may measure the device's step costs (once per model): not part of this call's time.
    plan_started = time.perf_counter()
    plan = make_plan(lookahead, model) if lookahead is not None else None
    started += time.perf_counter() - plan_started
    step_cap = plan.shape.max_tokens if plan is not None else 1
    cache = model.new_cache(1, prompt_len + max_new_tokens + step_cap)
    cache_len = prompt_len - 1
    # The successor table starts from what the model predicts after the prompt's last tokens: the prefill
    # computes their logits too (the last PROMPT_SUCCESSOR_ROWS rows, to bound the cost of long prompts).
    seed_rows = 0
    if plan is not None and "successors" in plan.sources and max_new_tokens > 1:
        seed_rows = min(cache_len, PROMPT_SUCCESSOR_ROWS)
    prompt_logits = None
    if cache_len > 0:  # prefill: the prompt's last token is the first step's x
        rows = torch.arange(cache_len - max(seed_rows, 1), cache_len, device=device)
        prompt_logits = model(ids[:, :-1].to(device), torch.arange(cache_len, device=device)[None], cache, 0,
                              StepLayout.prefill(cache_len), rows)[0]
    stats.prefill_seconds = time.perf_counter() - started

    if lookahead is None:
        _plain_loop(model, cache, cache_len, emitter, sampler, stats, device)
    else:
        prompt_rows = (ids[0, cache_len - seed_rows: cache_len], prompt_logits[-seed_rows:]) if seed_rows else None
        _lookahead_loop(model, cache, cache_len, emitter, sampler, stats, device, lookahead, plan, ids, prompt_rows)
    stats.new_tokens = emitter.new
    stats.seconds = time.perf_counter() - started
    if streamer is not None:
        streamer.end()
    sequence = torch.tensor([emitter.sequence], dtype=torch.long, device=ids.device)
    return GenerateOutput(torch.cat([args.padding.to(sequence), sequence], dim=1), stats)


# (cuda,) variants whose untimed pre-build failed in this process: not tried again before each call.
_POOL_PREBUILD_FAILED: set = set()


def _load_pool_extension_untimed(lookahead, device: torch.device) -> None:
    """Build (first use) or load the C++/CUDA n-gram pool before the clock starts, so ``stats.seconds`` never
    includes it. A failure is left to the pool's own fallback or error inside the loop."""
    if not isinstance(lookahead, LookaheadConfig) or "pool" not in lookahead.sources or \
            lookahead.pool_backend == "python":
        return
    cuda = device.type == "cuda" and lookahead.pool_backend != "cpp"
    if cuda in _POOL_PREBUILD_FAILED:
        return
    try:
        from lookahead_kernels.pool_ext import load_pool_extension

        load_pool_extension(cuda=cuda)
    except Exception:  # noqa: BLE001 - make_pool reports (or falls back) with the real error
        _POOL_PREBUILD_FAILED.add(cuda)


def _plain_step(model, cache, cache_len, x, sampler, device) -> int:
    logits = model(torch.tensor([[x]], device=device), torch.tensor([[cache_len]], device=device), cache,
                   cache_len, StepLayout(1, 1))
    return int(sampler.choose(logits[0])[0])


def _plain_loop(model, cache, cache_len, emitter, sampler, stats, device) -> None:
    x = emitter.sequence[-1]
    while not emitter.done:
        y = _plain_step(model, cache, cache_len, x, sampler, device)
        cache_len += 1
        stats.steps += 1
        stats.fed_tokens += 1
        stats.accepted.append(emitter.emit([y]))
        x = y


def _lookahead_loop(model, cache, cache_len, emitter, sampler, stats, device, la: LookaheadConfig, plan, ids,
                    prompt_rows) -> None:
    shape = plan.shape
    W = shape.window
    max_pos = model.config.max_position_embeddings
    window = LookaheadWindow(W, shape.ngram, torch.Generator().manual_seed(la.seed))
    window.reset(ids[0])
    # The committed sequence as a tensor, filled as tokens are emitted: refill tokens are drawn from it.
    history = torch.empty(len(emitter.sequence) + emitter.max_new_tokens, dtype=torch.long)
    history[: len(emitter.sequence)] = torch.tensor(emitter.sequence)
    drafts = DraftBuilder(la, model.config.vocab_size, device, shape=shape, sources=plan.sources,
                          planner=plan.planner)
    drafts.start(ids[0])
    if prompt_rows is not None:
        drafts.successors.update(*prompt_rows)
    pad = la.pad_tree if la.pad_tree is not None else device.type == "cuda"
    x = emitter.sequence[-1]
    while not emitter.done:
        # While warming up the window feeds fewer tokens: the tree may take what it leaves of the step.
        budget = shape.max_tokens - W * window.levels
        # Near the end of the model's positions the window or tree would run past them: finish plainly.
        if cache_len + max(W - 1 + window.levels - 1, budget) >= max_pos:
            y = _plain_step(model, cache, cache_len, x, sampler, device)
            cache_len += 1
            stats.steps += 1
            stats.fed_tokens += 1
            stats.accepted.append(emitter.emit([y]))
            x = y
            continue
        tree = drafts.build(emitter.sequence, budget, pad)
        step = build_step(x, cache_len, window.step_tokens(x), window.levels, W, tree, device)
        logits = model(step.tokens[None], step.positions[None], cache, cache_len, step.layout, step.logits_rows)[0]
        depth = int(tree.shape.depth[: tree.num_nodes].max()) if tree.num_nodes else 0
        if tree.size:
            num_nodes = torch.tensor([tree.num_nodes], device=device) if pad else None
            accept_len, path, tokens = sampler.verify_tree(
                logits[0], logits[step.node_rows], step.tokens[step.layout.lookahead_len:], step.layout.tree.end,
                num_nodes, depth)
        else:
            accept_len = torch.zeros(1, dtype=torch.long, device=device)
            path = torch.empty(1, 0, dtype=torch.long, device=device)
            tokens = sampler.choose(logits[:1])[None]
        outputs = sampler.choose(logits[step.window_rows])
        # One read-back per step: accepted length, accepted nodes, emitted tokens, the window's new guesses.
        back = torch.cat([accept_len, path[0], tokens[0], outputs]).tolist()
        a = back[0]
        nodes = back[1: 1 + a]
        emitted = back[1 + depth: 1 + depth + a + 1]
        new_guesses = back[1 + 2 * depth + 1:]
        if a > 0:
            src = cache_len + step.layout.lookahead_len + torch.tensor([nodes], device=device)
            cache.move_rows(src, cache_len + 1)
        committed = len(emitter.sequence)
        ngrams = window.advance(x, torch.tensor(new_guesses), a, history[:committed])
        cache_len += 1 + a
        stats.steps += 1
        stats.fed_tokens += step.layout.T
        taken = emitter.emit(emitted)
        stats.accepted.append(taken)
        history[committed: len(emitter.sequence)] = torch.tensor(emitter.sequence[committed:], dtype=torch.long)
        if stats.trace is not None:
            stats.trace.append(StepTrace(committed - 1, tuple(tree.tokens[: tree.num_nodes].tolist()),
                                         tuple(tree.parents), tuple(map(frozenset, tree.sources)),
                                         () if ngrams is None else tuple(map(tuple, ngrams.tolist())), tuple(nodes)))
        rows = None
        if drafts.successors is not None:
            rows = _successor_rows(step, logits, tree.num_nodes, nodes)
        drafts.observe(tree, nodes, ngrams, emitter.sequence, taken, rows)
        x = emitted[-1]


def _successor_rows(step, logits, num_nodes, nodes):
    """``(tokens, logits)`` of every row the step computed but padding, with ``x`` and the accepted nodes last
    (their rows saw the true context, so their successors should win)."""
    row_tokens = step.tokens[step.logits_rows]
    first_node = step.node_rows.start
    last = [0] + [first_node + n for n in nodes]
    order = [i for i in range(first_node + num_nodes) if i not in last] + last
    idx = torch.tensor(order, device=logits.device)
    return row_tokens[idx], logits[idx]
