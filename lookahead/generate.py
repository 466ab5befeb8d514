"""The decoding loop: plain autoregressive or lookahead, greedy or sampled, for a batch of prompts (one prompt
is the special case), with one read-back per step.

Convention: the prefill writes each prompt minus its last token into its cache row, and every step then feeds
each row's ``x`` (its last committed token) at position ``cache_len``. So each step is one forward pass for the
whole batch, and plain decoding makes exactly one step per new token (compression 1.0).

Per row (:class:`_Row`): its window, draft builder, ``cache_len``, statistics and stopping. Per step: every row
has the same shape (window and levels; trees padded to one size, with per-row tree metadata and ``cache_len``),
verification runs for the batch at once, KV compaction moves each row's own accepted nodes, and a finished row
leaves the batch (its cache row is dropped).

Two ways to run a step's forward ("run", part 3 of ``shared/design/decode-loop.md``), one loop around them:

* directly (the CPU's default, and ``cuda_graphs=False``): each step calls the model at whatever shape it has;
* through a :class:`lookahead.runner.StepRunner` (CUDA's default, with graphs): static buffers per step shape,
  one CUDA graph per shape, so a step costs no host work for the forward. A graph replays fixed shapes, so the
  steps come from a small menu (:func:`_static_menu`): the plain step, and the plan's shape at each window
  warm-up level with its tree padded to the budget; and finished rows stay in the batch, parked, until the running
  rows fit half of it and move to a runner of fewer rows (``_decode``, ``_shrunk``).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from typing import Iterable

import torch

from lookahead_kernels import StepLayout

from .arguments import resolve_generate_arguments
from .config import LookaheadConfig, StepShape
from .controller import make_plan
from .custom_processors import make_custom_processors
from .device_tree import DeviceTreeSteps, StaticTree, token_prior
from .draft import SUCCESSORS_PER_NODE, DraftBuilder, encode_rows, propose_rows, record_trials
from .memory import DraftMemory
from .outputs import GenerateOutput, GenerationStats, StepTrace
from .overlap import OverlappedSteps
from .prefill import prefill_graphs
from .processors import LogitsProcessors
from .prompt_cache import PromptCache
from .runner import StepRunner, cache_pool, runner_cache
from .sequence_rules import bad_words, check_vocabulary
from .step import build_step, build_tree_step, packed_plain_step, upload
from .stopping import Deadline, RowStops, make_criteria
from .successors import SuccessorTable, record_step
from .verification import PlainChoice, Sampler, StepInputs, StepVerifier, step_uniforms
from .window import LookaheadWindow, stack_step_tokens

# The longest run of plain steps a batch takes, after its planner kept choosing no tree, before asking again.
MAX_BACKOFF = 16
PLAIN = StepShape(1, 1, 0)
# On the static path (CUDA graphs) a tree is padded to the next of a few sizes, its level's budget halved down to
# this many nodes at one row: padded to the full budget, a step of 4 real nodes paid for 256 tokens (SmolLM2,
# H100), while a step of 16 tokens costs a GPU little more than one of 2. A batch halves down to as many tokens a
# step (rows x (1 + nodes)), so at 16 rows down to one node (_smallest_padded_tree).
SMALLEST_PADDED_TREE = 15
# generate's default: the automatic step size (a frozen config, shared safely).
AUTOMATIC = LookaheadConfig()


def _check_prompt(prompt: torch.Tensor, vocab_size: int, b: int, batch: int) -> torch.Tensor:
    lo, hi = int(prompt.min()), int(prompt.max())
    if lo < 0 or hi >= vocab_size:
        where = f" (prompt {b})" if batch > 1 else ""
        raise ValueError(f"token ids must be in [0, {vocab_size}), got values in [{lo}, {hi}]{where}")
    return prompt.long()


def _eos_set(model, eos_token_id) -> set[int]:
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def _pad_id(model, pad_token_id, eos_token_id) -> int:
    """The id after a row's end: ``pad_token_id``, else the model's pad, else the (first) EOS, else 0."""
    if pad_token_id is not None:
        return int(pad_token_id)
    if model.config.pad_token_id is not None:
        return model.config.pad_token_id
    eos = eos_token_id if eos_token_id is not None else model.config.eos_token_id
    if isinstance(eos, int):
        return eos
    return int(eos[0]) if eos else 0


class _Emitter:
    """Collects emitted tokens, stopping exactly at ``max_new_tokens``, right after an EOS token or a token after
    which a stopping criterion says stop (``stops``), or after the step that passes the ``deadline``."""

    def __init__(self, prompt: list[int], max_new_tokens: int, eos: set[int], streamer,
                 stops: RowStops | None = None, deadline: Deadline | None = None):
        self.sequence = list(prompt)
        self.new = 0
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.streamer = streamer
        self.stops = stops
        self.deadline = deadline
        self.done = False

    def emit(self, tokens: Iterable[int]) -> int:
        """Append tokens until a stop; returns how many were taken."""
        taken = []
        for t in tokens:
            if t < 0:  # the draw's sentinel (sampling.sample_rows): a row left no token any probability
                raise ValueError(f"no token could be drawn for new token {self.new + 1}: the logits processors and "
                                 f"warpers left every token at probability 0 (suppress_tokens, bad_words_ids, "
                                 f"prefix_allowed_tokens_fn or a processor of your own removing every token)")
            taken.append(t)
            self.new += 1
            if t in self.eos or self.new >= self.max_new_tokens or (self.stops is not None and self.stops.after(t)):
                self.done = True
                break
        if self.deadline is not None and self.deadline.passed():
            self.done = True
        self.sequence.extend(taken)
        if self.streamer is not None and taken:
            self.streamer(taken)
        return len(taken)


class _Row:
    """One sequence of the batch: its emitter and statistics, its cache length and next input ``x``, and with
    lookahead its window and draft builder."""

    def __init__(self, emitter: _Emitter, stats: GenerationStats, index: int = 0, memory: DraftMemory | None = None):
        self.index = index  # among the call's prompts (a refilled batch's rows are not in prompt order)
        self.emitter = emitter
        self.stats = stats
        self.memory = memory
        self.cache_len = len(emitter.sequence) - 1
        self.x = emitter.sequence[-1]
        self.window = None
        self.drafts = None
        self.kept = []  # with output_scores/output_logits: per step, float32 [K, taken, vocab] (host)

    def start_lookahead(self, la: LookaheadConfig, plan, vocab_size: int, native: bool | None,
                        successors: SuccessorTable | None, levels: int = 1) -> None:
        """The row's window and draft builder, from its sequence so far (a host list: a prompt on the GPU read
        here would wait for the prefill just queued, so the host's work here could not overlap it). ``successors``:
        the draft memory's table for this model, shared by every row (``None``: each row a table of its own)."""
        prompt = self.emitter.sequence
        shape = plan.shape
        self.window = LookaheadWindow(shape.window, shape.ngram, torch.Generator().manual_seed(la.seed))
        self.window.reset(prompt, levels)
        # The planner cuts the trees of the whole batch at once (_lookahead_step), not each builder alone.
        self.drafts = DraftBuilder(la, vocab_size, shape=shape, sources=plan.sources, native=native,
                                   memory=self.memory, successors=successors)
        self.drafts.start(prompt)

    def finished(self, seconds: float) -> None:
        """The row has ended (``seconds`` into the call): its sequence joins the draft memory, if any."""
        self.stats.seconds = seconds
        if self.memory is not None:
            self.memory.add(self.emitter.sequence)

    def commit(self, tokens: list[int], fed: int, kept: torch.Tensor | None = None) -> int:
        """Count a step that fed ``fed`` tokens for this row and emit ``tokens``; returns how many were taken.
        ``kept``: ``[K, >= len(tokens), vocab]``, the rows they were chosen from (``Sampler.outputs``)."""
        self.stats.steps += 1
        self.stats.fed_tokens += fed
        taken = self.emitter.emit(tokens)
        self.stats.accepted.append(taken)
        if kept is not None:
            self.kept.append(kept[:, :taken])
        return taken


def _one_call_at_a_time(fn):
    """``fn(model, ...)`` under the model's :class:`lookahead.model.GenerationLock` (a model without one, none)."""
    @functools.wraps(fn)
    def locked(model, *args, **kwargs):
        with getattr(model, "generation_lock", None) or contextlib.nullcontext():
            return fn(model, *args, **kwargs)
    return locked


@_one_call_at_a_time
@torch.inference_mode()
def generate(model, input_ids=None, max_new_tokens: int | None = None, *,
             lookahead: LookaheadConfig | None = AUTOMATIC, do_sample: bool | None = None,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None, eos_token_id=None, pad_token_id: int | None = None,
             attention_mask: torch.Tensor | None = None, generation_config=None, streamer=None,
             trace: bool = False, cuda_graphs: bool | None = None, _static_steps: bool | None = None,
             _native_draft: bool | None = None, prompt_cache: PromptCache | None = None,
             draft_memory: DraftMemory | None = None,
             stopping_criteria=None, tokenizer=None, logits_processor=None, prefix_allowed_tokens_fn=None,
             max_batch_size: int | None = None, _on_finish=None, _overlap_steps: bool | None = None,
             **kwargs) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    ``input_ids``: ``[B, prompt_len]`` (``[prompt_len]`` for one prompt), left-padded rows with an
    ``attention_mask`` as transformers takes them, or a list of prompts of any lengths (lists of ints or 1-D
    tensors). Each row decodes as it would alone (greedy: the same tokens; sampled: the same distribution) and
    stops on its own; one forward pass per step serves the whole batch. ``max_batch_size`` (``None``: every
    prompt at once) decodes at most that many rows at a time: when a row ends, the next prompt is prefilled into
    its place (continuous batching), so a batch never waits for its slowest row with its other rows idle (the
    processors' per-row state restarted from the rows' sequences; ``prefix_allowed_tokens_fn`` gets each row's
    index among the prompts as its batch id).
    ``lookahead=None`` decodes one token per forward pass; a :class:`LookaheadConfig` decodes with lookahead; the
    default ``LookaheadConfig()`` sizes each step from the device's measured cost and the batch size (measured
    once, outside ``stats.seconds``).
    Generation stops after ``max_new_tokens`` tokens (default 128) or right after an EOS token (``eos_token_id``:
    an int or a list; default the model's own); a row's later positions in ``sequences`` hold ``pad_token_id``
    (default: the model's pad, else the EOS).
    transformers' conventions are accepted (:mod:`lookahead.arguments`): ``attention_mask`` (per row all ones, or
    left padding, which ``sequences`` keeps in front), a tokenizer's output as ``input_ids``, ``pad_token_id``,
    ``max_length``, ``num_return_sequences`` (sampling), a ``generation_config`` (keywords override it; it
    overrides ``model.generation_config``, whose set fields are the defaults), ``None`` for an unset parameter
    (transformers' default: top-k 50 when sampling); anything unsupported is a ``ValueError`` naming it.
    ``min_new_tokens``/``min_length``, ``suppress_tokens``, ``begin_suppress_tokens``, ``repetition_penalty``,
    ``no_repeat_ngram_size``, ``sequence_bias`` and ``bad_words_ids`` process every row a step chooses or verifies
    from, as transformers' processors do (:mod:`lookahead.processors`).
    ``logits_processor`` (the caller's processors: callables ``(input_ids, scores) -> scores``, such as a
    transformers ``LogitsProcessorList``) and ``prefix_allowed_tokens_fn`` run last, on each row with its own
    sequence (tree nodes too, depth by depth), in the eager loop (:mod:`lookahead.custom_processors`).
    ``stop_strings`` (with ``tokenizer=``), ``stopping_criteria`` (called per row with ``[1, L]`` ids and
    ``scores=None``) and ``max_time`` end a row as transformers ends it (:mod:`lookahead.stopping`).
    ``streamer`` (one prompt only) is a callable called with each step's newly emitted tokens, or an object with
    ``put``/``end`` such as transformers' ``TextStreamer``. ``trace=True`` records each lookahead step's
    candidates and window n-grams in ``stats.trace`` (per row: ``stats.rows[b].trace``; see :class:`StepTrace`).
    ``cuda_graphs`` (``None``: on where the model is on CUDA) runs every decode step by replaying a CUDA graph
    captured once per step shape (:class:`lookahead.runner.StepRunner`); the steps then come from a small fixed
    menu (the plain step; the lookahead shape at each warm-up level of the window, trees padded to the budget;
    in automatic mode a step with no window and no candidate is a plain step), and a row that finishes gives its
    place to a waiting prompt (``max_batch_size``) or stays in the batch, parked, its outputs ignored, until the
    running rows fit a runner of half the rows (or fewer). The runners (their KV cache and graphs) are kept on the
    model for the next call with the same batch size and menu (``model.step_runners``, a
    :class:`lookahead.runner.RunnerCache`; ``model.step_runners.clear()`` frees them), so a shape is captured
    once per model, not per call (capturing is setup: not counted in ``stats.seconds``). ``cuda_graphs=False``
    is the eager loop (for debugging and comparison); ``True`` off CUDA is a ``ValueError``. ``_static_steps``
    (private, for tests) forces the graph path's loop, run eagerly when graphs are off, e.g. on the CPU
    (``cuda_graphs=False, _static_steps=True``). On that path plain steps (a lookahead call's too) and device-tree
    steps are overlapped (:mod:`lookahead.overlap`: the host reads a step's result while the next one runs) where
    no logits processor
    and no ``output_scores``/``output_logits`` needs each step's result first; ``_overlap_steps`` (private, for
    tests and benches) turns that off (``False``) or asks for it (``True``: a ``ValueError`` where it cannot be).
    ``prompt_cache`` (one prompt): a :class:`~lookahead.prompt_cache.PromptCache` whose tokens the prompt may
    start with (a conversation's earlier turns); their keys and values are copied instead of prefilled
    (``stats.reused_tokens``), and after the call it holds this prompt and its new tokens.
    ``draft_memory``: a :class:`~lookahead.memory.DraftMemory` of earlier calls' text: its suffix matches join each
    row's own as guesses, and each row's prompt and output join it as the row finishes (plain decoding adds too).
    The output does not depend on it (greedy: the same tokens; sampling: the same distribution, though a seeded
    call's draws follow its guesses, so the same seed may give other text with a fuller memory).
    ``_native_draft`` (private, for tests and benches) picks the draft builder: ``True`` the C++ one, ``False`` its
    Python reference, ``None`` the C++ one where it builds. ``_on_finish`` (private, for the command line's
    progress bar) is called with the number of rows that just finished, as they finish.

    Returns a :class:`GenerateOutput`: the LongTensor of the sequences ``[B, L + new]`` itself, with ``stats`` (and
    ``scores``/``logits`` when asked) as attributes.
    """
    called = time.perf_counter()
    args = resolve_generate_arguments(
        input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        generation_config=generation_config, model_generation_config=model.generation_config, streamer=streamer,
        one_token_per_step=lookahead is None, extra=kwargs)
    max_new_tokens, streamer, eos_token_id = args.max_new_tokens, args.streamer, args.eos_token_id
    do_sample, temperature, top_k, top_p = args.do_sample, args.temperature, args.top_k, args.top_p
    N = len(args.prompts)
    if streamer is not None and N > 1:
        raise ValueError(f"a streamer follows one sequence but generate got a batch of {N} prompts; stream one "
                         f"prompt at a time, or pass no streamer for a batch (transformers refuses this too)")
    if draft_memory is not None and not isinstance(draft_memory, DraftMemory):
        raise ValueError(f"draft_memory must be a lookahead.DraftMemory or None, got {type(draft_memory).__name__}")
    if prompt_cache is not None:
        if not isinstance(prompt_cache, PromptCache):
            raise ValueError(f"prompt_cache must be a lookahead.PromptCache or None, got {type(prompt_cache).__name__}")
        if N > 1:
            raise ValueError(f"a prompt_cache follows one sequence but generate got a batch of {N} prompts")
    custom = make_custom_processors(logits_processor, prefix_allowed_tokens_fn, _processor_settings(args),
                                    cuda_graphs)
    # the caller's processors are Python: the eager loop runs them
    graphs, static = _step_path(False if custom is not None else cuda_graphs, _static_steps, model.device)
    if streamer is not None:
        streamer.start(torch.cat([args.padding[0], args.prompts[0]])[None])
    _load_extensions_untimed(lookahead, model.device)
    started = time.perf_counter()
    cfg = model.config
    prompts = [_check_prompt(p, cfg.vocab_size, b, N) for b, p in enumerate(args.prompts)]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    longest = max(p.numel() for p in prompts)  # of every prompt: a refilled row reuses the cache
    if longest + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt ({longest} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"{cfg.max_position_embeddings} positions")
    if lookahead is not None and not isinstance(lookahead, LookaheadConfig):
        raise ValueError(f"lookahead must be a LookaheadConfig or None, got {type(lookahead).__name__}")
    if static and lookahead is not None and lookahead.pad_tree is False:
        raise ValueError("LookaheadConfig(pad_tree=False) lets the step shape vary, which CUDA graphs cannot replay; "
                         "leave pad_tree unset or pass cuda_graphs=False")
    if lookahead is not None and lookahead.device_tree:
        _check_device_tree(static, draft_memory)
    if not isinstance(trace, bool):
        raise ValueError(f"trace must be a bool, got {trace!r}")
    if _native_draft is not None and not isinstance(_native_draft, bool):
        raise ValueError(f"_native_draft must be None, True or False, got {_native_draft!r}")
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be a bool, got {do_sample!r}")
    device = model.device
    # The step's random numbers are drawn on the model's device (a greedy call never draws from it).
    if generator is not None and (not isinstance(generator, torch.Generator)
                                  or do_sample and generator.device.type != device.type):
        got = f"one on {generator.device}" if isinstance(generator, torch.Generator) else type(generator).__name__
        raise ValueError(f"generator must be a torch.Generator on the model's device ({device.type}: "
                         f"torch.Generator(device={device.type!r})) or None, got {got}")
    eos = _eos_set(model, eos_token_id)
    criteria = make_criteria(stopping_criteria, args.stop_strings, tokenizer)
    deadline = Deadline(args.max_time, called)
    for name, sequences in (("suppress_tokens", [args.suppress_tokens]),
                            ("begin_suppress_tokens", [args.begin_suppress_tokens]),
                            ("sequence_bias", args.sequence_bias), ("bad_words_ids", args.bad_words_ids),
                            ("forced_bos_token_id", [[] if args.forced_bos_token_id is None
                                                     else [args.forced_bos_token_id]]),
                            ("forced_eos_token_id", [args.forced_eos_token_id])):
        check_vocabulary(name, sequences, cfg.vocab_size)
    processors = LogitsProcessors(
        cfg.vocab_size, args.repetition_penalty, eos=sorted(eos), prompt_penalty=args.prompt_penalty,
        no_repeat_ngram_size=args.no_repeat_ngram_size, prompt_ngram_size=args.prompt_ngram_size,
        sequence_bias=args.sequence_bias, bad_words=bad_words(args.bad_words_ids, eos),
        length=_length_rules(args, max_new_tokens), custom=custom)
    B = N  # rows decoded at once
    if max_batch_size is not None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be None (every prompt at once) or an int >= 1, got "
                             f"{max_batch_size!r}")
        B = min(N, max_batch_size)
    sampler = Sampler(do_sample, temperature, top_k, top_p, generator, processors, args.outputs, args.min_p,
                      args.typical_p, args.epsilon_cutoff, args.eta_cutoff, args.top_h, args.renormalize_logits)
    rows = [_Row(_Emitter(p.tolist(), max_new_tokens, eos, streamer,
                          RowStops(criteria, pad.tolist(), p.tolist(), max_new_tokens) if criteria else None,
                          deadline if deadline.at is not None else None),
                 GenerationStats(trace=[] if trace else None), b, draft_memory)
            for b, (p, pad) in enumerate(zip(prompts, args.padding))]

    # One-time setup is not part of this call's time: the CPU forward's packed weights (made once per weight), the
    # plan may measure the device's step costs (once per model and batch menu), and the first call at a batch size
    # builds its KV cache or step runner (kept on the model).
    setup_started = time.perf_counter()
    model.prepare_cpu_weights()
    plan = make_plan(lookahead, model, B, sampled=do_sample) if lookahead is not None else None
    if plan is not None and lookahead.device_tree == "auto" and not plan.device_tree:
        plan = None  # no device tree pays at this batch size here: plain steps
    step_cap = plan.shape.max_tokens if plan is not None else 1
    device_steps = None
    if plan is not None and plan.device_tree:
        tree = StaticTree.best(plan.device_tree)
        device_steps = DeviceTreeSteps(tree, cfg.vocab_size, prior=token_prior(model))
    overlap = _overlap_wanted(_overlap_steps, static, sampler)
    if overlap and device_steps is not None:  # a row's last overlapped step may run a step past its end
        step_cap *= 2
    runner = None
    if static:
        runner = runner_cache(model).take(model, B, _static_menu(plan, B), longest + max_new_tokens + step_cap,
                                          graphs=graphs)
        cache = runner.cache
        if device_steps is not None:
            device_steps.start(runner)
    else:
        cache = cache_pool(model).take(model, B, longest + max_new_tokens + step_cap,
                                       cfg.max_position_embeddings + step_cap)
    if processors:
        _start_processors(processors, runner, cache, rows[:B], device)
    # On the graph path a whole prompt's prefill replays a graph of its length's bucket (lookahead.prefill).
    padded_prefill = prefill_graphs(model, graphs).prepared() if static else None
    started += time.perf_counter() - setup_started
    clock = _CallClock(started, runner)
    if padded_prefill is not None:
        clock.follow(padded_prefill)
    # A batch too big for any tree at the start decodes plainly, its rows' lookahead state (window, drafts) made
    # only if the batch shrinks enough for trees to pay (_decode): building it (then with seeds for the successor
    # table) cost 64 HumanEval rows 0.79x plain decoding when it steered nothing.
    deferred = plan is not None and B > 1 and plan.planner is not None and plan.shape.window == 1 and \
        plan.planner.reach(B, plan.shape.max_tokens - 1) == 0
    # A draft memory carries the model's successor table from call to call (and the rows of a call share it).
    successors = draft_memory.successor_table(model, cfg.vocab_size, SUCCESSORS_PER_NODE) \
        if draft_memory is not None and plan is not None and "successors" in plan.sources else None
    # The successor table is not seeded from the prompt's rows (a vocabulary projection each): at one row it saved
    # 0-4% of the steps and cost 2-12% of the time on a CPU (MEASUREMENTS, "Seeding the successor table"); in
    # batches of 4 it changed no step count. A device tree's tables are (DeviceTreeSteps.seed): read from them
    # alone, its trees took a quarter more tokens a step that way (bench/results/static-tree-h200-bf16.md).
    # Prefill row by row, each into its own cache row: the prompts' lengths differ and a step has no padding
    # mask, and doing what batch 1 does keeps every row's numbers (and so its greedy output) its own. It runs once.
    # The weights cannot change during the call: the CPU forward looks its packed weights up once.
    with model.weights_fixed():
        def prefill(row: _Row, slot: int, cache_row) -> None:  # the KV cache only: the prompt's last token is x
            prefill_started = time.perf_counter()
            captured = padded_prefill.capture_seconds if padded_prefill is not None else 0.0
            n = row.cache_len
            reused = 0 if prompt_cache is None else prompt_cache.restore(model, row.emitter.sequence[:n], cache_row)
            row.stats.reused_tokens = reused
            hidden = None
            if n > reused:
                hidden = padded_prefill.prefill_hidden(row.emitter.sequence[:n], cache_row) \
                    if reused == 0 and padded_prefill is not None else None
                if hidden is None:
                    hidden = model.hidden(torch.tensor([row.emitter.sequence[reused:n]], device=device),
                                          torch.arange(reused, n, device=device)[None], cache_row, reused,
                                          StepLayout.prefill(n - reused))
            if device_steps is not None:  # the row's device tables start anew, from what its prompt predicts
                device_steps.reset([slot])
                device_steps.seed(slot, row.emitter.sequence, reused, None if hidden is None else hidden[0],
                                  model.logits)
            if padded_prefill is not None:  # a capture is setup, not the prefill's time
                captured = padded_prefill.capture_seconds - captured
            row.stats.prefill_seconds = time.perf_counter() - prefill_started - captured

        for b, row in enumerate(rows[:B]):
            prefill(row, b, cache.sequence(b))
            if plan is not None and not deferred and device_steps is None:
                row.start_lookahead(lookahead, plan, cfg.vocab_size, _native_draft, successors)

        def start_late(row: _Row, levels: int) -> None:  # a deferred or refilled row, at its first lookahead step
            row.start_lookahead(lookahead, plan, cfg.vocab_size, _native_draft, successors, levels)

        waiting = collections.deque(rows[B:])

        def refill(slot: int, cache_row) -> _Row | None:  # the next prompt into a finished row's place
            if not waiting:
                return None
            row = waiting.popleft()
            prefill(row, slot, cache_row)
            return row

        pad = lookahead is not None and (lookahead.pad_tree if lookahead.pad_tree is not None else
                                         static or device.type == "cuda")
        host = _HostClock()
        # A padded batch may end on a smaller runner than it began with (_shrunk): that one goes back to the model.
        accepted, runner = _decode(model, cache, runner, rows[:B], sampler, plan, pad, device, clock, host,
                                   start_late, refill, _on_finish, lambda: bool(waiting), device_steps, overlap)
        if prompt_cache is not None:  # rows past the emitted tokens (a last step's excess) are not kept
            row = rows[0]
            prompt_cache.keep(model, row.emitter.sequence[:row.cache_len], cache)
    if runner is not None:  # only after a clean run: a runner left mid-step or mid-capture is dropped
        runner_cache(model).give_back(runner)
    else:
        cache_pool(model).give_back(cache)
    seconds = clock.elapsed()
    if streamer is not None:
        streamer.end()
    for row in rows:
        row.stats.new_tokens = row.emitter.new
    stats = GenerationStats(
        new_tokens=sum(r.stats.new_tokens for r in rows), steps=len(accepted),
        fed_tokens=sum(r.stats.fed_tokens for r in rows), seconds=seconds,
        prefill_seconds=sum(r.stats.prefill_seconds for r in rows), host_seconds=host.seconds, accepted=accepted,
        reused_tokens=sum(r.stats.reused_tokens for r in rows),
        trace=rows[0].stats.trace if N == 1 else None, rows=[r.stats for r in rows])
    if N == 1:
        rows[0].stats.seconds = seconds
    kept = _kept_outputs(rows, sampler.outputs, args.prompts[0].device)
    return GenerateOutput(_sequences(rows, args.padding, _pad_id(model, args.pad_token_id, eos_token_id),
                                     args.prompts[0].device), stats, scores=kept.get("scores"),
                          logits=kept.get("logits"), return_dict_in_generate=args.return_dict_in_generate)


def _kept_outputs(rows, outputs: tuple, device) -> dict:
    """Per name of ``outputs``, a tuple of float32 ``[B, vocab]`` a new token (transformers' ``scores`` and
    ``logits``): row ``b`` of the ``t``-th holds what row ``b``'s ``t``-th new token was chosen from, NaN once it
    had ended."""
    if not outputs:
        return {}
    new = max(r.emitter.new for r in rows)
    vocab = next(k.shape[-1] for r in rows for k in r.kept)
    out = torch.full((len(outputs), new, len(rows), vocab), float("nan"))
    for b, row in enumerate(rows):
        per_row = torch.cat(row.kept, 1)  # [K, new_b, vocab]
        out[:, : per_row.shape[1], b] = per_row
    out = out.to(device)
    return {name: tuple(out[k].unbind(0)) for k, name in enumerate(outputs)}


def _sequences(rows, padding, pad_id: int, device) -> torch.Tensor:
    """``[B, L + new]``: per row, pad ids up to ``L``, its given padding and prompt, its new tokens, pad ids."""
    given = [pad.numel() + len(r.emitter.sequence) - r.emitter.new for pad, r in zip(padding, rows)]
    L, new = max(given), max(r.emitter.new for r in rows)
    out = torch.full((len(rows), L + new), pad_id, dtype=torch.long)
    for b, (pad, row) in enumerate(zip(padding, rows)):
        start = L - given[b]
        out[b, start: start + pad.numel()] = pad.cpu()
        out[b, start + pad.numel(): L + row.emitter.new] = torch.tensor(row.emitter.sequence, dtype=torch.long)
    return out.to(device)


def _load_extensions_untimed(lookahead, device: torch.device) -> None:
    """Build (first use) or load the C++ ops lookahead takes, the draft builder's and the n-gram pool's, before
    the clock starts, so ``stats.seconds`` never includes them. A failure is left to the fallbacks inside the loop
    (the builder's Python reference; the pool's own fallback or error)."""
    if not isinstance(lookahead, LookaheadConfig):
        return
    from lookahead_kernels.cpu_ops import cpu_ops_available

    cpu_ops_available()  # remembers a failure for the process
    # "auto" and "cpp" both take the C++ pool, on every device.
    if "pool" not in lookahead.sources or lookahead.pool_backend == "python":
        return
    try:
        from lookahead_kernels.pool_ext import load_pool_extension

        load_pool_extension()  # a failed build is remembered there, not tried again
    except Exception:  # noqa: BLE001 - make_pool reports (or falls back) with the real error
        pass


def _processor_settings(args) -> set[str]:
    """The generate arguments in use that make one of transformers' processors."""
    used = {"repetition_penalty": args.repetition_penalty != 1.0, "no_repeat_ngram_size": args.no_repeat_ngram_size,
            "bad_words_ids": args.bad_words_ids, "sequence_bias": args.sequence_bias,
            "min_new_tokens": args.min_new_tokens, "suppress_tokens": args.suppress_tokens,
            "begin_suppress_tokens": args.begin_suppress_tokens,
            "encoder_repetition_penalty": args.prompt_penalty != 1.0,
            "encoder_no_repeat_ngram_size": args.prompt_ngram_size,
            "forced_bos_token_id": _forced_first(args) is not None,
            "forced_eos_token_id": args.forced_eos_token_id, "remove_invalid_values": args.remove_invalid_values,
            "exponential_decay_length_penalty": args.decay is not None}
    return {name for name, value in used.items() if value}


def _forced_first(args):
    """The token forced first, or ``None``: transformers forces ``forced_bos_token_id`` only where the padded
    prompt is one token."""
    return args.forced_bos_token_id if args.padded_length == 1 else None


def _length_rules(args, max_new_tokens: int) -> dict:
    """:class:`lookahead.length_rules.LengthRules`' keywords (but the EOS) for the call's arguments. Where a first
    token is forced, transformers moves ``begin_suppress_tokens`` to the second."""
    forced_first = _forced_first(args)
    return dict(min_new=args.min_new_tokens, forced_first=forced_first, forced_last=args.forced_eos_token_id,
                last=max_new_tokens - 1, remove_invalid=args.remove_invalid_values, decay=args.decay,
                always=args.suppress_tokens, at_start=args.begin_suppress_tokens,
                begin=0 if forced_first is None else 1)


def _step_path(cuda_graphs, static_steps, device: torch.device) -> tuple[bool, bool]:
    """``(graphs, static)``: whether steps replay CUDA graphs, and whether they run through a StepRunner."""
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs must be None (on where the model is on CUDA), True or False, got "
                         f"{cuda_graphs!r}")
    if static_steps is not None and not isinstance(static_steps, bool):
        raise ValueError(f"_static_steps must be None, True or False, got {static_steps!r}")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a model on CUDA; this one is on {device} (leave cuda_graphs unset)")
    graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
    static = graphs if static_steps is None else static_steps
    if graphs and not static:
        raise ValueError("CUDA graphs replay static step buffers: _static_steps=False needs cuda_graphs=False")
    return graphs, static


def _cache_len_arg(lens: list[int], device):
    """An int when every row has the same length (one attention call per step on the CPU), else a LongTensor."""
    if all(n == lens[0] for n in lens):
        return lens[0]
    return torch.tensor(lens, dtype=torch.long, device=device)


def _run(model, cache, runner: StepRunner | None, shape: StepShape, tokens, positions, lens: list[int],
         layout: StepLayout, logits_rows, num_nodes, finish, host: "_HostClock | None" = None, packed=None):
    """Parts 3 and 4 of a step: the forward and ``finish`` (its verification) on the logits, through the runner's
    static buffers (and graphs, which hold ``finish`` too) when there is one, else the model itself.
    With graphs the result is overwritten by the next step of the same shape: the step reads it before then.
    Without a runner ``finish``'s time is added to ``host.verify_seconds``: there it is work the trees cost beside
    the forward that the planner's step costs (forward passes alone) do not count. ``packed`` (with a runner, always):
    the inputs in the runner's layout, one host block (:func:`lookahead.step.build_step`'s ``pack``,
    :func:`lookahead.step.packed_plain_step`), which the runner copies in at once."""
    if runner is None:
        logits = model(tokens, positions, cache, _cache_len_arg(lens, device=tokens.device), layout, logits_rows)
        tree = layout.tree
        started = time.perf_counter()
        uniforms = step_uniforms(finish, tokens.shape[0], tokens.device)  # as a runner draws them (sampling)
        out = finish(logits, StepInputs(tokens, None if tree is None else tree.end, num_nodes, cache,
                                        positions[:, 0], uniforms, None if tree is None else tree.depth))
        if host is not None:
            host.verify_seconds = time.perf_counter() - started
        return out
    # The block holds every input (the rows' cache lengths too); the arguments pick the shape's buffers.
    return runner.run(shape, tokens, positions, None, layout.tree, logits_rows, num_nodes, finish, packed)


def _step_shape(plan, levels: int, batch_size: int) -> StepShape:
    """A lookahead step's shape at this window level: the tree gets what the window leaves of the step (while it
    warms up the window feeds fewer tokens), and for a batch in automatic mode at most the planner's reach."""
    shape = plan.shape
    budget = shape.max_tokens - shape.window * levels
    if plan.planner is not None and batch_size > 1:  # batch 1 keeps its tuned behaviour: the planner alone
        budget = min(budget, plan.planner.reach(batch_size, budget))
    return StepShape(shape.window, levels, budget)


def _level_budget(plan, runner: StepRunner | None, levels: int, batch_size: int) -> int:
    """A lookahead step's tree budget at this window level. On the static path, the largest the runner's menu
    holds there: the menu was made when the call began and is fixed for it, while the planner's reach (which
    bounds a batch's budget) moves as it learns the host cost; a budget off the menu would have no buffers (or
    graph) to run in. Eagerly, the reach of now (:func:`_step_shape`)."""
    if runner is None:
        return _step_shape(plan, levels, batch_size).tree_budget
    W = plan.shape.window
    return max(s.tree_budget for s in runner.menu if s.window == W and s.levels == levels)


def _smallest_padded_tree(batch_size: int) -> int:
    """The fewest nodes a padded tree of a batch's rows is halved down to: a step of at least as many tokens as
    one row's smallest (``SMALLEST_PADDED_TREE`` nodes and ``x``), at least one node."""
    return max(1, -(-(SMALLEST_PADDED_TREE + 1) // batch_size) - 1)


def _tree_sizes(plan, budget: int, batch_size: int) -> list[int]:
    """The tree sizes a padded step of this budget can take, ascending: the budget alone for a fixed config; in
    automatic mode the budget halved down to :func:`_smallest_padded_tree` nodes (and 0 beside a window: a step
    of the window alone), so a step that keeps a few nodes feeds a few tokens."""
    if budget == 0 or plan.planner is None:
        return [budget]
    sizes, smallest = [budget], _smallest_padded_tree(batch_size)
    while sizes[-1] // 2 >= smallest:
        sizes.append(sizes[-1] // 2)
    if plan.shape.window > 1:
        sizes.append(0)
    return sorted(sizes)


def _static_menu(plan, batch_size: int) -> list[StepShape]:
    """Every step shape a call on the static path can take: the plain step (also the end of a batch near the
    model's last positions), and at each level the window passes through while warming up, the plan's shape
    with each of its padded tree sizes (each captured once per model with the runner kept on it). A runner keeps
    its batch size (finished rows are parked until the batch moves to a smaller runner, with a menu of its own);
    each level's tree budget is the planner's reach now, and stays the runner's (:func:`_level_budget`)."""
    if plan is None:
        return [PLAIN]
    menu = [PLAIN]
    for levels in range(1, plan.shape.levels + 1):
        shape = _step_shape(plan, levels, batch_size)
        menu += [StepShape(shape.window, levels, z) for z in _tree_sizes(plan, shape.tree_budget, batch_size)]
    return menu


class _CallClock:
    """Seconds since the call's clock started, less the CUDA graphs its runners captured meanwhile (one-time
    setup, like the runners themselves: a later call with the same shapes replays them)."""

    def __init__(self, started: float, runner: StepRunner | None):
        self.started = started
        self.runners: list[tuple[StepRunner, float]] = []
        if runner is not None:
            self.follow(runner)

    def follow(self, runner) -> None:
        """Leave out the graphs ``runner`` (anything counting its ``capture_seconds``: a step runner, the prefill
        graphs) captures from now on too (a batch moved to a smaller runner)."""
        self.runners.append((runner, runner.capture_seconds))

    def elapsed(self) -> float:
        captured = sum(r.capture_seconds - before for r, before in self.runners)
        return time.perf_counter() - self.started - captured


class _HostClock:
    """Seconds the lookahead steps spent on host work (``GenerationStats.host_seconds``), and the last eager
    step's verification (0 where a graph holds it)."""

    def __init__(self):
        self.seconds = 0.0
        self.verify_seconds = 0.0


def _decode(model, cache, runner: StepRunner | None, rows: list[_Row], sampler: Sampler, plan, pad: bool, device,
            clock: "_CallClock", host: _HostClock, start_late=None, refill=None, on_finish=None,
            queued=None, device_steps: DeviceTreeSteps | None = None, overlap: bool = False) -> tuple:
    """Step until every row has stopped. Returns, per step, the tokens emitted, and the runner the call ended on.

    ``refill(slot, cache_row)``: the next waiting row, prefilled into ``cache_row`` (batch row ``slot`` of the
    cache, a batch-1 view), or ``None`` when no row waits; a finished row's place goes to it before anything
    below happens to that place.
    ``queued()``: whether rows wait (then every token counts alike in a step's plan, else the rows furthest from
    their end count most: :func:`_finish_weights`). ``device_steps``: every step a device-tree step
    (:func:`_device_tree_step`; plain near the model's last positions). ``overlap`` (with a runner): plain and
    device-tree steps launched before the last one is read (:func:`_overlapped_steps`), a lookahead call's plain
    steps too; whatever changes rows (a row finished) or takes another kind of step first waits for the step in
    flight.

    Without a runner a finished row leaves the batch (its cache row is dropped), so later steps are smaller. With
    one it stays in the batch, parked, its inputs fed at position 0 and its outputs ignored, which keeps the batch
    dimension, and so every captured graph, valid; once the running rows fit half the batch they move to a runner
    of fewer rows (:func:`_shrunk`; the processors' per-row state restarted there). Parked
    rows cost a padded batch a full share of every step: a batch ends with its slowest row."""
    accepted = []
    backoff = _Backoff()
    too_big: dict = {}  # _batch_too_big's answers since the last lookahead step (the planner moves only in one)
    batch = list(rows)  # the rows each forward runs: every row with a runner, the active ones without
    active = list(rows)
    max_pos = model.config.max_position_embeddings
    processors = sampler.processors
    steps = _overlapped_steps(runner, sampler, device_steps) if overlap else None
    plain_next = None  # a lookahead call's choice of a plain next step, kept while waiting for a step in flight
    while active:
        before = [len(r.emitter.sequence) for r in batch] if processors is not None else None
        if plan is not None and device_steps is None and plain_next is None:
            # The memo's answer first: a batch too big for trees then skips reading every row's cache length.
            plain_next = _batch_too_big(active, batch, plan, too_big) or _near_the_end(active, plan.shape, max_pos) \
                or backoff.waiting()
        if steps is not None and plain_next is not False and _may_launch(steps, active, device_steps, max_pos):
            host_started, device_seconds = time.perf_counter(), steps.device_seconds
            _count_step(accepted, steps.launch(batch, [not r.emitter.done for r in batch]), steps)
            host.seconds += time.perf_counter() - host_started - (steps.device_seconds - device_seconds)
            plain_next = None
        elif steps is not None and steps.pending:  # the step in flight, alone: then the rows end, or go on step by step
            _count_step(accepted, steps.drain(), steps)
        elif device_steps is not None:
            if _past_the_end(active, device_steps.depth, max_pos):
                accepted.append(_plain_step(model, cache, runner, batch, sampler, device))
            else:
                accepted.append(_device_tree_step(model, cache, runner, batch, sampler, device_steps, host))
        elif plain_next is not False:
            accepted.append(_plain_step(model, cache, runner, batch, sampler, device))
            plain_next = None
        else:
            plain_next = None
            too_big.clear()
            levels = _levels(active)
            for row in active:
                if row.drafts is None:
                    start_late(row, levels)
            accepted.append(_lookahead_step(model, cache, runner, batch, sampler, plan, pad, device, host, backoff,
                                            queued is not None and queued()))
        if processors is not None:  # the tokens each row committed join its context, and its count
            processors.add([r.emitter.sequence[n:] for r, n in zip(batch, before)], [r.emitter.new for r in batch])
        finished = [i for i, r in enumerate(active) if r.emitter.done]
        if finished and steps is not None and steps.pending:  # the step in flight first: it may finish rows too
            _count_step(accepted, steps.drain(), steps)
            finished = [i for i, r in enumerate(active) if r.emitter.done]
        if finished:
            now = clock.elapsed()
            for i in finished:
                active[i].finished(now)
            if on_finish is not None:
                on_finish(len(finished))
            if refill is not None:
                left, places = _refilled(cache, runner, batch, active, finished, refill)
                if processors is not None and places:  # the new rows' state from their prompts
                    processors.restart(places, [batch[b].emitter.sequence for b in places],
                                       [batch[b].emitter.new for b in places], [batch[b].index for b in places])
                finished = left
                if not finished:
                    continue
            if len(finished) == len(active):
                break
            if runner is None:
                kept = cache.remove_rows(finished)
                active = batch = [active[i] for i in kept]
                if processors is not None:
                    processors.keep(kept)
            else:
                active = [r for r in active if not r.emitter.done]
                before_shrink = batch
                smaller, batch = _shrunk(model, runner, batch, active, plan, clock)
                if device_steps is not None and smaller is not runner:
                    device_steps.moved(smaller, [before_shrink.index(r) for r in batch])
                if steps is not None and smaller is not runner:
                    steps.moved(smaller, device_steps.finish(sampler) if device_steps is not None else steps.finish)
                if processors is not None and smaller is not runner:  # its rows' state in its own tensors
                    _start_processors(processors, smaller, cache, batch, device)
                runner = smaller
    return accepted, runner


def _start_processors(processors: LogitsProcessors, runner: StepRunner | None, cache, rows: list, device) -> None:
    """(Re)start the processors' per-row state from each row's sequence and count of new tokens: before the first
    step, and after the batch moved to a smaller runner (a refilled place restarts alone,
    :meth:`LogitsProcessors.restart`). A runner's state tensors stay the same ones (a graph holds their
    addresses); the eager loop gets new ones (it narrows its own as rows leave)."""
    state = runner.state if runner is not None else \
        lambda name, shape, dtype: torch.zeros(shape, dtype=dtype, device=device)
    processors.start(state, [r.emitter.sequence for r in rows], [r.emitter.new for r in rows],
                     replayed=runner is not None and runner.graphs,
                     capacity=(runner.cache if runner is not None else cache).max_len,
                     batch_ids=[r.index for r in rows])


def _refilled(cache, runner: StepRunner | None, batch: list, active: list, finished: list[int],
              refill) -> tuple[list[int], list[int]]:
    """Give the places of the finished rows ``active[i]`` (``i`` in ``finished``) to waiting rows (``refill``),
    in ``batch`` and ``active`` in place; returns the finished rows that kept their place (no row waited) and the
    places in ``batch`` that new rows took."""
    left, places = [], []
    for i in finished:
        slot = batch.index(active[i])  # its cache row (without a runner, batch and active hold the same rows)
        row = refill(slot, (runner.cache if runner is not None else cache).sequence(slot))
        if row is None:
            left.append(i)
            continue
        batch[slot] = row
        active[i] = row
        places.append(slot)
    return left, places


def _shrunk(model, runner: StepRunner, batch: list, active: list, plan, clock: "_CallClock") -> tuple:
    """``(runner, batch)`` for the rest of a padded call: unchanged while the running rows ``active`` fill more than
    half of ``batch``; else a runner of the next power of two rows at least ``len(active)`` (from the model's kept
    runners: each size's graphs are captured once), the running rows' keys and values copied into it, and the new
    batch: the running rows, then finished ones as its parked rows. The old runner goes back to the model."""
    size = 1 << (len(active) - 1).bit_length()
    if size > len(batch) // 2:
        return runner, batch
    kept = runner_cache(model)
    smaller = kept.take(model, size, _static_menu(plan, size), runner.cache.max_len, graphs=runner.graphs)
    new_batch = active + [r for r in batch if r.emitter.done][: size - len(active)]
    # Past a row's own length nothing is read.
    smaller.cache.load_rows(runner.cache, [batch.index(r) for r in new_batch], max(r.cache_len for r in new_batch))
    kept.give_back(runner)
    clock.follow(smaller)
    return smaller, new_batch


def _start(row: _Row) -> int:
    """Where a row's step starts in its cache row: its committed length, or 0 once it has finished (a parked row
    rewrites the start of its own cache row, which nothing reads again, and stays within the model's positions)."""
    return 0 if row.emitter.done else row.cache_len


def _near_the_end(active: list[_Row], shape, max_pos: int) -> bool:
    """Whether a row's window or tree would run past the model's positions: then the batch finishes plainly."""
    levels = _levels(active)
    budget = shape.max_tokens - shape.window * levels
    return _past_the_end(active, max(shape.window - 1 + levels - 1, budget), max_pos)


def _past_the_end(active: list[_Row], reach: int, max_pos: int) -> bool:
    """Whether a row's step reaching ``reach`` positions past its cache length would pass the model's last
    position: every step kind's test before it runs (the rows then go on with plain steps)."""
    return any(r.cache_len + reach >= max_pos for r in active)


class _Backoff:
    """After a batch's planner chose no tree, the next steps are plain without asking it (building every row's
    candidates only to drop them cost 4% of a 16-row batch's time on HumanEval, all its steps plain): 1 step,
    then 2, 4, ... up to ``MAX_BACKOFF`` while it keeps saying no; a step with trees starts over."""

    def __init__(self):
        self.wait = 0
        self.length = 1

    def waiting(self) -> bool:
        if self.wait > 0:
            self.wait -= 1
            return True
        return False

    def miss(self) -> None:
        self.wait = self.length
        self.length = min(2 * self.length, MAX_BACKOFF)

    def hit(self) -> None:
        self.length = 1


def _batch_too_big(active: list[_Row], batch: list[_Row], plan, memo: dict) -> bool:
    """Whether, in automatic mode, no tree could pay for this many rows (and there is no window): a plain step
    then saves every row's host work on trees. ``memo``: answers by rows and window levels that the caller keeps
    while the planner does not move (it learns in lookahead steps only): worked out every plain step, the answer
    cost 33 us of a 16-row CPU step's host work (cold caches beside the forward), 1% of a 4-row one."""
    if not (len(batch) > 1 and plan.planner is not None and plan.shape.window == 1):
        return False
    key = (len(batch), _levels(active))
    if key not in memo:
        memo[key] = _step_shape(plan, key[1], key[0]).tree_budget == 0
    return memo[key]


def _levels(active: list[_Row]) -> int:
    """The levels the rows' windows feed (they warm up in step, and a refilled row starts at theirs); 1 before a
    deferred batch has windows (its plan has none beyond x)."""
    return next((r.window.levels for r in active if r.window is not None), 1)


def _check_device_tree(static: bool, draft_memory) -> None:
    """Refuse what a call with device trees (``LookaheadConfig.device_tree``) cannot do."""
    if not static:
        raise ValueError("LookaheadConfig.device_tree needs the static step path: a model on CUDA, or "
                         "_static_steps=True")
    if draft_memory is not None:
        raise ValueError("draft_memory feeds the trees built on the host; LookaheadConfig.device_tree builds none "
                         "(leave draft_memory unset)")


def _overlap_wanted(asked: bool | None, static: bool, sampler: Sampler) -> bool:
    """Whether the call's plain and device-tree steps overlap (``generate``'s ``_overlap_steps``): on the static
    path, where nothing needs a step's result before the next step (processors, kept outputs)."""
    if asked is not None and not isinstance(asked, bool):
        raise ValueError(f"_overlap_steps must be None, True or False, got {asked!r}")
    possible = static and sampler.processors is None and not sampler.outputs
    if asked and not possible:
        raise ValueError("_overlap_steps=True needs the static step path and no logits processor or kept outputs")
    return possible if asked is None else asked


def _device_tree_inputs(steps: DeviceTreeSteps, batch: list[_Row]) -> dict:
    """A device-tree step's inputs, packed from each row's ``x`` and length, as :meth:`StepRunner.run` takes them."""
    step = steps.step([r.x for r in batch], [_start(r) for r in batch])
    return dict(tokens=step.tokens, positions=step.positions, cache_len=None, tree=step.layout.tree,
                logits_rows=step.logits_rows, num_nodes=step.num_nodes, packed=step.packed)


def _plain_inputs(batch: list[_Row]) -> dict:
    """A plain step's inputs, packed from each row's ``x`` and length, as :meth:`StepRunner.run` takes them."""
    packed, tokens, positions = packed_plain_step([r.x for r in batch], [_start(r) for r in batch])
    return dict(tokens=tokens, positions=positions, cache_len=None, packed=packed)


def _overlapped_steps(runner: StepRunner, sampler: Sampler, device_steps: DeviceTreeSteps | None) -> OverlappedSteps:
    """The call's overlapped steps: device-tree steps, else plain ones."""
    if device_steps is not None:
        return OverlappedSteps(runner, device_steps.shape, device_steps.finish(sampler),
                               lambda batch: _device_tree_inputs(device_steps, batch))
    return OverlappedSteps(runner, PLAIN, PlainChoice(sampler), _plain_inputs)


def _may_launch(steps: OverlappedSteps, active: list[_Row], device_steps: DeviceTreeSteps | None,
                max_pos: int) -> bool:
    """Whether an overlapped step may be launched now: not when every row reaches its ``max_new_tokens`` with the
    step in flight (a step emits at least one token a row: the next would run for nobody), nor where a device
    tree would pass the model's last position from where the step in flight may leave a row (those steps go one
    by one, the last ones plain)."""
    if not steps.pending:
        return device_steps is None or not _past_the_end(active, device_steps.depth, max_pos)
    if all(r.emitter.new + 1 >= r.emitter.max_new_tokens for r in active):
        return False
    reach = 0 if device_steps is None else device_steps.depth + steps.shape.max_tokens
    return not _past_the_end(active, reach, max_pos)


def _count_step(accepted: list[int], done, steps: OverlappedSteps) -> None:
    """Commit an overlapped step read back (``done``: ``(rows, emitted)``, or ``None``) and count it among the call's
    steps, unless every row had stopped before it (it ran past the batch's end: device time, but no step of any
    row's)."""
    if done is not None and any(not r.emitter.done for r in done[0]):
        accepted.append(_commit_emitted(*done, steps.shape.max_tokens))


def _commit_emitted(batch: list[_Row], emitted_rows: list[list[int]], fed: int, kept=None) -> int:
    """Each running row of ``batch`` takes the tokens its step emitted (a parked row's are ignored), with ``kept[b]``
    (``Sampler.outputs``); returns how many were taken."""
    taken = 0
    for b, (row, emitted) in enumerate(zip(batch, emitted_rows)):
        if row.emitter.done:  # parked, or stopped by an earlier step (an overlapped step ran on past its end)
            continue
        row.cache_len += len(emitted)
        taken += row.commit(emitted, fed, None if kept is None else kept[b])
        row.x = emitted[-1]
    return taken


def _device_tree_step(model, cache, runner: StepRunner, batch: list[_Row], sampler: Sampler,
                      steps: DeviceTreeSteps, host: _HostClock) -> int:
    """A step of ``x`` and a tree of a fixed shape whose tokens the step's device reads from its successor tables
    (:mod:`lookahead.device_tree`): the host packs ``x`` and the positions as a plain step's, reads back the
    verified tokens and commits them; the tree, its verification and the tables' update run in the step."""
    host_started = time.perf_counter()
    inputs = _device_tree_inputs(steps, batch)
    finish = steps.finish(sampler)
    forward_started = time.perf_counter()
    emitted_rows, kept = finish.read(runner.run(steps.shape, finish=finish, **inputs))
    forward_done = time.perf_counter()
    emitted_total = _commit_emitted(batch, emitted_rows, steps.shape.max_tokens, kept)
    host.seconds += (forward_started - host_started) + (time.perf_counter() - forward_done)
    return emitted_total


def _plain_step(model, cache, runner, batch: list[_Row], sampler: Sampler, device,
                learn: SuccessorTable | None = None) -> int:
    """One token a row. ``learn`` (one row, eager): that row's successor table takes the tops of x's logits."""
    finish = PlainChoice(sampler, 0 if learn is None else learn.k)
    if runner is not None:  # the runner's layout in one block, which it copies in at once
        result = runner.run(PLAIN, finish=finish, **_plain_inputs(batch))
    else:  # the model takes them on its device
        lens = [_start(r) for r in batch]
        tokens, positions = upload([torch.tensor([[r.x] for r in batch]), torch.tensor([[n] for n in lens])], device)
        result = _run(model, cache, None, PLAIN, tokens, positions, lens, StepLayout(1, 1), None, None, finish)
        if learn is not None:
            record_step([learn], tokens.cpu(), result[1].cpu(), [0], [1], [[]])
    emitted, kept = finish.read(result)
    return _commit_emitted(batch, emitted, 1, kept)


# _finish_weights: a row's pace starts from this many plain steps; the weights are its steps to go to this power.
_PACE_PRIOR = 4
_PACE_POWER = 8


def _finish_weights(active: list[_Row]) -> list[float] | None:
    """What a token of each running row is worth to a padded batch that no waiting prompt will join: the call lasts
    as long as its slowest row, and a finished row stays parked, costing as much as a running one until half the
    batch has finished, so a token of a row ahead of the slowest shortens little. Each row's steps still to go at
    its pace so far (its remaining budget over its tokens a step, from a prior of ``_PACE_PRIOR`` plain steps), over
    the most any row has to go, to the power ``_PACE_POWER`` (1 for the slowest rows, near 0 for rows well ahead);
    ``None`` (every token alike) for one row. (The eager loop drops a finished row at once, so there every row's
    tokens shorten the call: it takes no weights.)

    Why the pace and the power: rows that all run to ``max_new_tokens`` end together unless every one of them
    gains, and the rows whose guesses fail are the ones the call waits for; weighing only the budget left (session
    47) still counted the gains of rows that accepted at full worth. Predicted for the H200 (``bench_predict.py``,
    16 prompts, 64 tokens; MT-Bench / HumanEval): a flat table with 0.1 ms of host work, 16 rows, 0.97x / 1.00x
    -> 1.00x / 1.00x (its trees had bought no step: the slowest row took plain's 64); the H200's table, 4 rows
    1.01x / 1.07x -> 1.03x / 1.07x, 16 rows 1.00x / 1.00x -> 1.00x / 1.03x (power 1: 0.97x / 1.00x, 1.02x / 1.08x,
    1.00x / 1.01x; power 4 about as 8)."""
    if len(active) < 2:
        return None
    remaining = [(r.emitter.max_new_tokens - r.emitter.new) * (r.stats.steps + _PACE_PRIOR)
                 / (r.emitter.new + _PACE_PRIOR) for r in active]
    most = max(remaining)
    return [(n / most) ** _PACE_POWER for n in remaining]


def _lookahead_step(model, cache, runner, batch: list[_Row], sampler: Sampler, plan, pad: bool, device,
                    host: _HostClock, backoff: _Backoff | None = None, queued: bool = False) -> int:
    """One step for every row of the batch: plan and build the trees, run, verify, compact, commit and observe.
    Parked rows (finished, with a runner) feed their last token and an empty tree; their outputs are ignored."""
    host_started = time.perf_counter()
    active = [r for r in batch if not r.emitter.done]
    W = plan.shape.window
    levels = active[0].window.levels  # the rows started together: their windows warm up in step
    budget = _level_budget(plan, runner, levels, len(batch))
    wanted = budget
    if runner is not None and plan.planner is not None and len(batch) > 1:
        # The menu's budget is the planner's reach when the call began; the host cost it has learned since may
        # have lowered it (a batch builds no more than could pay now, and pads to a size the menu holds).
        wanted = plan.planner.reach(len(batch), budget)
    elif pad and plan.planner is not None and len(batch) == 1:
        # Where a step's cost hardly grows with its size (a GPU) the host's work on the tree bounds it: build only
        # what the planner could take of the best possible chain at the host cost measured so far (a batch's
        # budget is bounded so already, _step_shape). At least the smallest padded size, so that it keeps
        # measuring. SmolLM2 on an H100: 255 proposed nodes cost 3-6 ms of Python a step, the step itself 2 ms.
        wanted = max(min(budget, SMALLEST_PADDED_TREE), plan.planner.reach(1, budget))
    proposals = propose_rows([r.drafts for r in active], [r.emitter.sequence for r in active], wanted)
    sizes = _tree_sizes(plan, budget, len(batch)) if pad else None
    proposed = keep = max(map(len, proposals.scores))
    if plan.planner is not None:  # one size for all rows: they are padded to one shape anyway
        weights = None if queued or runner is None else _finish_weights(active)
        keep = plan.planner.choose_batch(proposals.scores, sizes, len(batch), weights)  # parked rows are fed too
        if keep == 0 and proposed and sampler.greedy:
            plan.planner.observe_declined()
        # The step would feed x (and padding) only: a plain step does the same. One row keeps learning (its
        # successor table takes x's logits' tops: 0.1 ms, where the lookahead step's machinery around an empty
        # tree cost 0.8 ms of an 11 ms step, session 23); a batch cannot afford even that, nor can a graph.
        if keep == 0 and W == 1:
            if backoff is not None and len(batch) > 1:
                backoff.miss()
            # The declined trees' work is host work all the same (on a GPU the device waits for it), though not a
            # tree step's for the planner's host cost: 50 us a step at one row on this project's CPU (session 49).
            host.seconds += time.perf_counter() - host_started
            learn = None if pad or len(batch) > 1 else active[0].drafts.successors
            return _plain_step(model, cache, runner, batch, sampler, device, learn)
        if backoff is not None and keep > 0:
            backoff.hit()
    picks, active_row = [], 0  # per batch row its row of proposals (active rows in order), -1 when parked (padding)
    for r in batch:
        picks.append(-1 if r.emitter.done else active_row)
        active_row += not r.emitter.done
    keeps = [min(keep, len(proposals.scores[i])) if i >= 0 else 0 for i in picks]
    longest = max(keeps)
    size = next(z for z in sizes if z >= longest) if pad else longest
    lens, xs, width = [_start(r) for r in batch], [r.x for r in batch], levels * W
    windows = [None if r.emitter.done else r.window for r in batch]
    if runner is not None and active[0].drafts.native:  # the trees encoded into the runner's block in one call
        step, drafts = build_tree_step(lens, xs, None if width == 1 else stack_step_tokens(windows, xs, width),
                                       levels, W, proposals, picks, keeps, size, plan.step_constants)
    else:
        drafts = encode_rows(proposals, picks, keeps, size, active[0].drafts.native)
        step = build_step(lens, stack_step_tokens(windows, xs, width), levels, W, drafts,
                          "cpu" if runner is not None else device, plan.step_constants, pack=runner is not None)
    num_nodes = drafts.num_nodes  # per row (its trees are made only where read: eagerly, or traced)
    step_shape = StepShape(W, levels, size)
    successors = active[0].drafts.successors
    if runner is None:  # the eager loop verifies as deep as this step's trees go, and tops only computed rows
        depth = max(t.max_depth for t in drafts.trees)
        computed = step.node_rows.start + max(num_nodes)
    else:  # a replayed graph has the shape's sizes
        depth, computed = size, step.node_rows.stop
    verifier = StepVerifier(sampler, step_shape, depth, 0 if successors is None else successors.k, computed)
    forward_started = time.perf_counter()
    # Forward, verification and KV compaction (one graph replay for greedy decoding); one read-back per step.
    host.verify_seconds = 0.0
    back = verifier.read(_run(model, cache, runner, step_shape, step.tokens, step.positions, lens, step.layout,
                              step.logits_rows, step.num_nodes, verifier, host, step.packed))
    forward_done = time.perf_counter()
    emitted_total = 0
    recorded, computed, last = [], [], []  # the successor tables' rows, recorded together after the loop
    learners, learned, paths = [], [], []  # the rows' acceptance trials, likewise
    first_node = step.node_rows.start
    for b, row in enumerate(batch):
        if row.emitter.done:  # parked
            continue
        a, nodes, emitted = back.accept_len[b], back.nodes[b], back.emitted[b]
        sequence = row.emitter.sequence
        committed = len(sequence)
        ngrams = row.window.advance(row.x, back.guesses[b], a, sequence,  # committed before this step's
                                    row.drafts.learns_ngrams or row.stats.trace is not None)
        row.cache_len += 1 + a
        taken = row.commit(emitted, step.layout.T, None if back.kept is None else back.kept[b])
        emitted_total += taken
        if row.stats.trace is not None:
            tree = drafts.trees[b]
            row.stats.trace.append(StepTrace(committed - 1, tuple(tree.tokens[: tree.num_nodes].tolist()),
                                             tuple(tree.parents), tuple(map(frozenset, tree.sources)),
                                             () if ngrams is None else tuple(map(tuple, ngrams.tolist())),
                                             tuple(nodes), float(sum(proposals.scores[picks[b]][:keeps[b]]))))
        if successors is not None:  # every row computed but padding; x and the accepted path last, to win
            recorded.append(b)
            computed.append(first_node + num_nodes[b])
            last.append([0] + [first_node + n for n in nodes])
        learners.append(row.drafts)
        learned.append(b)
        paths.append(nodes)
        row.drafts.learn_ngrams(ngrams, sequence, taken)
        row.x = emitted[-1]
    record_trials(learners, drafts, learned, paths)
    if recorded:
        record_step([batch[b].drafts.successors for b in recorded], step.logits_tokens, back.tops, recorded,
                    computed, last)
    host_seconds = (forward_started - host_started) + (time.perf_counter() - forward_done)
    host.seconds += host_seconds
    if plan.planner is not None and size:  # how far the estimates came true
        verified = [proposals.scores[i][:k] for i, k in zip(picks, keeps) if i >= 0]
        accepted = sum(a for i, a in zip(picks, back.accept_len) if i >= 0)
        plan.planner.observe_gain(float(sum(map(sum, verified))), accepted)
    if plan.planner is not None and plan.planner.host is not None and size:
        # The trees' work beside the forward (host work, and verification where it runs eagerly), for the
        # planner's next choices.
        plan.planner.host.observe(len(active), sum(num_nodes), host_seconds + host.verify_seconds)
    return emitted_total
