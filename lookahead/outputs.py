"""What :func:`lookahead.generate.generate` returns: the token ids as a tensor (:class:`GenerateOutput`), with the
call's statistics (:class:`GenerationStats`, each row's too) and, when traced, each lookahead step's record
(:class:`StepTrace`)."""

from __future__ import annotations

import copy
import dataclasses

import torch


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
        expected: the tokens the tree was expected to add: the sum of its nodes' estimated chances of being
            reached (``lookahead.draft``), which the planner weighed against the step's cost.
    """

    x_index: int
    tokens: tuple
    parents: tuple
    sources: tuple
    ngrams: tuple
    path: tuple
    expected: float = 0.0

    @property
    def accepted(self) -> int:
        return len(self.path)


@dataclasses.dataclass
class GenerationStats:
    """What one ``generate`` call did.

    For one prompt the fields describe it. For a batch they are the batch's totals (``steps`` counts forward
    passes, each serving every row still running) and ``rows`` holds each row's own statistics, in the batch's
    order: its ``steps`` are the passes it took part in, its ``fed_tokens`` its share of them (tree padding
    included), its ``seconds`` the time from the call's start until it finished, its ``prefill_seconds`` its own
    prefill (with ``max_batch_size``, a waiting row's prefill runs when it takes a finished row's place: part of
    ``seconds`` like every prefill).

    Attributes:
        new_tokens: tokens emitted after the prompt(s).
        steps: forward passes after the prefill.
        fed_tokens: tokens fed by all steps after the prefill, over all rows (``fed_tokens / steps`` is the mean
            step size).
        seconds: wall time of the whole call, prefill included; one-time setup excluded (the device's step costs,
            measured on first use; a new KV cache or step runner; CUDA graph captures).
        prefill_seconds: wall time of the prefill alone.
        reused_tokens: prompt tokens whose keys and values came from ``prompt_cache`` instead of the prefill.
        host_seconds: wall time the lookahead steps spent on the host outside the forward pass, verification and
            the read-back (candidates, trees, step inputs, learning), over all steps, those whose trees the
            planner declined included; part of ``seconds``. Where the forward is cheap (a GPU) this bounds the
            speed.
        accepted: per step, the tokens it emitted over all rows (accepted candidate tokens plus bonus tokens).
        trace: per lookahead step, a :class:`StepTrace` when ``generate`` was called with ``trace=True``, else
            ``None``. For analysing guess quality (``bench/bench_tree.py``, ``bench/bench_calibration.py``); it
            costs host memory per step. For a batch, each row's trace is in ``rows[b].trace``.
        rows: per row, its :class:`GenerationStats` (``None`` on a row's own statistics).
    """

    new_tokens: int = 0
    steps: int = 0
    fed_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    reused_tokens: int = 0
    host_seconds: float = 0.0
    accepted: list = dataclasses.field(default_factory=list)
    trace: list | None = None
    rows: list | None = None

    @property
    def compression_ratio(self) -> float:
        """New tokens per forward pass after the prefill (1.0 for plain decoding of one prompt)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second (for a batch, over all rows: its throughput)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class GenerateOutput(torch.Tensor):
    """What :func:`generate` returns: the LongTensor ``sequences`` ``[B, L + new]`` itself, as transformers'
    ``generate`` returns it, with the rest as attributes.

    Each row is its prompt as given (left padding included; a list's shorter prompts left-padded to ``L``) followed
    by its new tokens, then ``pad_token_id`` after its end (``new``: the longest row's new tokens). So
    transformers' habits work: ``tokenizer.decode(out[0])``, ``tokenizer.batch_decode(out)``, ``out[0, L:]``,
    ``out.shape``; torch ops on it give plain tensors.

    Attributes:
        sequences: the same tokens as a plain LongTensor (transformers' ``return_dict_in_generate=True`` habit).
        stats: :class:`GenerationStats`.
        scores, logits: with ``output_scores``/``output_logits``, transformers' (a tuple of float32 ``[B, vocab]``,
            one per new token: the row the token was chosen from, processed and warped as the choice saw it, or
            raw; NaN in a row that had ended), else ``None``.

    ``out["sequences"]`` (``"scores"``, ``"logits"``, ``"stats"``) reads an attribute. With
    ``return_dict_in_generate=True`` an integer index reads it as transformers' output object does: ``out[0]`` is
    ``sequences``, then ``scores`` and ``logits`` where returned (:meth:`to_tuple`); otherwise it indexes the tokens.
    """

    # Results of torch ops (indexing included) are plain tensors, without this class's attributes.
    __torch_function__ = torch._C._disabled_torch_function_impl

    def __new__(cls, sequences: torch.Tensor, stats: GenerationStats, scores: tuple | None = None,
                logits: tuple | None = None, return_dict_in_generate: bool = False):
        out = torch.Tensor._make_subclass(cls, sequences, False)
        out.stats, out.scores, out.logits = stats, scores, logits
        out.return_dict_in_generate = return_dict_in_generate
        return out

    def __init__(self, *args, **kwargs):  # all set in __new__ (torch.Tensor's __init__ takes no arguments)
        pass

    @property
    def sequences(self) -> torch.Tensor:
        return self.as_subclass(torch.Tensor)

    def to_tuple(self) -> tuple:
        """transformers' ``ModelOutput.to_tuple``: ``sequences``, then ``scores`` and ``logits`` where returned."""
        return tuple(v for v in (self.sequences, self.scores, self.logits) if v is not None)

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in ("sequences", "scores", "logits", "stats") or getattr(self, key) is None:
                raise KeyError(f"{key!r}: the output holds sequences, stats"
                               f"{', scores' if self.scores is not None else ''}"
                               f"{', logits' if self.logits is not None else ''}")
            return getattr(self, key)
        if self.return_dict_in_generate and isinstance(key, (int, slice)):
            return self.to_tuple()[key]
        return super().__getitem__(key)

    def __reduce_ex__(self, protocol):
        return (_rebuild_output, (self.sequences, self.stats, self.scores, self.logits,
                                  self.return_dict_in_generate))

    def __deepcopy__(self, memo):
        return _rebuild_output(*copy.deepcopy(self.__reduce_ex__(2)[1], memo))


def _rebuild_output(sequences, stats, scores, logits, return_dict_in_generate) -> GenerateOutput:
    return GenerateOutput(sequences, stats, scores, logits, return_dict_in_generate)
