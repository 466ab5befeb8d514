"""transformers' ``logits_processor`` (the caller's own processors) and ``prefix_allowed_tokens_fn``, on a step's
rows for plain and lookahead steps alike.

They are Python callables, so they run on the host, in the eager loop only (a CUDA graph cannot call back into
Python), after every built-in processor, as transformers orders them (before temperature, top-k and top-p). Each
row is given its own sequence, as if it were decoded alone: ``x``'s row the committed sequence ``[1, L]``, and a
tree node's row that sequence followed by the node's path (``shared/design/draft-tree.md``), nodes of one depth
together ``[G, L + d]``. Nodes are processed depth by depth, and a node only where its parent's processed row
leaves its token possible (not ``-inf``): a node past an impossible token can never be accepted, and a processor
(a grammar's, say) then only sees sequences it allowed, as under plain decoding.

A processor must depend only on each row's ids and scores (no state that changes from call to call): a lookahead
step calls it for guesses that may not be accepted. ``prefix_allowed_tokens_fn(batch_id, ids)`` gets the row's
index in the batch (``num_return_sequences`` copies counted apart, as transformers counts them).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def _node_parents(depth: list[int]) -> list[int]:
    """Each node's parent (``-1``: ``x``) in a pre-ordered tree: the last node before it one level up."""
    last_at, parents = {}, []
    for i, d in enumerate(depth):
        parents.append(last_at.get(d - 1, -1) if d > 1 else -1)
        last_at[d] = i
    return parents


class CustomProcessors:
    """A call's own processors and prefix constraint, with each row's sequence kept on the host.

    Args:
        processors: callables ``(input_ids [G, L], scores [G, V]) -> scores [G, V]`` (a transformers
            ``LogitsProcessorList`` or its processors), applied in order.
        prefix_allowed_tokens_fn: ``(batch_id, ids [L]) -> list of allowed ids`` or ``None``.
    """

    def __init__(self, processors=(), prefix_allowed_tokens_fn=None):
        self.processors = list(processors)
        self.prefix_allowed_tokens_fn = prefix_allowed_tokens_fn
        self.sequences: list[list[int]] = []
        self.batch_ids: list[int] = []
        self.x_rows: torch.Tensor | None = None  # this step's processed x rows, which tree() starts from

    @property
    def key(self) -> tuple:
        return ("custom", id(self))  # never replayed: a graph cannot call back into Python

    def start(self, state, sequences, counts, replayed) -> None:
        if replayed:
            raise ValueError("a logits_processor or prefix_allowed_tokens_fn runs Python on each row, which a CUDA "
                             "graph cannot replay; pass cuda_graphs=False")
        self.sequences = [list(s) for s in sequences]
        self.batch_ids = list(range(len(sequences)))

    def restart(self, rows, sequences, counts) -> None:
        for b, s in zip(rows, sequences):
            self.sequences[b] = list(s)

    def add(self, tokens, counts) -> None:
        for seq, new in zip(self.sequences, tokens):
            seq.extend(new)

    def keep(self, kept) -> None:
        self.sequences = [self.sequences[i] for i in kept]
        self.batch_ids = [self.batch_ids[i] for i in kept]

    def _process(self, b: int, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Row ``b``'s sequences ``ids [G, L]`` and their ``scores [G, V]``, processed."""
        if self.prefix_allowed_tokens_fn is not None:
            mask = torch.full_like(scores, NEG_INF)
            for g in range(ids.shape[0]):
                allowed = self.prefix_allowed_tokens_fn(self.batch_ids[b], ids[g])
                if len(allowed) == 0:
                    raise ValueError(f"prefix_allowed_tokens_fn returned no allowed token for batch id "
                                     f"{self.batch_ids[b]}: the constraint cannot be satisfied")
                mask[g, torch.as_tensor(allowed, dtype=torch.long, device=scores.device)] = 0
            scores = scores + mask
        for p in self.processors:
            out = p(ids, scores)
            if not isinstance(out, torch.Tensor) or out.shape != scores.shape:
                raise ValueError(f"logits_processor {type(p).__name__} must return scores of shape "
                                 f"{tuple(scores.shape)}, got {getattr(out, 'shape', type(out).__name__)}")
            scores = out
        return scores

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        """``x``'s rows ``[B, V]`` (or ``[B, R, V]``, every row choosing the next token), processed; kept for
        this step's :meth:`tree`."""
        rows = logits[:, None] if logits.dim() == 2 else logits
        out = torch.stack([self._process(b, torch.tensor([seq] * rows.shape[1], device=rows.device), rows[b])
                           for b, seq in enumerate(self.sequences)])
        self.x_rows = out[:, 0]
        return out[:, 0] if logits.dim() == 2 else out

    def tree(self, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
             depth: torch.Tensor) -> torch.Tensor:
        """``node_logits [B, N, V]``: each node's row processed after its sequence, depth by depth, where its
        parent's processed row (``x``'s from this step's :meth:`rows`) leaves its token possible."""
        B, N, _ = node_logits.shape
        if N == 0:
            return node_logits
        if self.x_rows is None or self.x_rows.shape[0] != B:
            raise RuntimeError("CustomProcessors.tree needs this step's x rows: call rows() first")
        out = node_logits.clone()
        host_tokens = tokens.tolist()
        host_depth = depth.expand(B, N).tolist()
        for b in range(B):
            parents = _node_parents(host_depth[b])
            reachable = [False] * N
            for level in sorted(set(host_depth[b])):
                candidates = [i for i in range(N) if host_depth[b][i] == level
                              and (parents[i] < 0 or reachable[parents[i]])]
                if not candidates:
                    break
                # each candidate's token in its parent's processed row (x's where it has none), read back at once
                parent = torch.tensor([parents[i] for i in candidates], device=out.device)
                token = torch.tensor([host_tokens[b][i] for i in candidates], device=out.device)
                scores = torch.where(parent < 0, self.x_rows[b, token], out[b, parent.clamp(min=0), token])
                group = [i for i, s in zip(candidates, scores.tolist()) if s != NEG_INF]
                if not group:
                    break
                ids = []
                for i in group:
                    path, j = [], i
                    while j >= 0:
                        path.append(host_tokens[b][j])
                        j = parents[j]
                    ids.append(self.sequences[b] + path[::-1])
                    reachable[i] = True
                index = torch.tensor(group, device=out.device)
                out[b, index] = self._process(b, torch.tensor(ids, device=out.device), node_logits[b, index])
        return out


# transformers' processors that a generate argument also makes: given both, transformers would use the caller's in
# the built-in's place, and applying both would process twice.
_BUILT_IN = {"RepetitionPenaltyLogitsProcessor": "repetition_penalty",
             "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size", "NoBadWordsLogitsProcessor": "bad_words_ids",
             "SequenceBiasLogitsProcessor": "sequence_bias", "MinLengthLogitsProcessor": "min_length",
             "MinNewTokensLengthLogitsProcessor": "min_new_tokens", "SuppressTokensLogitsProcessor": "suppress_tokens",
             "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
             "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
             "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
             "EncoderNoRepeatNGramLogitsProcessor": "encoder_no_repeat_ngram_size",
             "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
             "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
             "InfNanRemoveLogitsProcessor": "remove_invalid_values",
             "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty"}
# Rules transformers applies after prefix_allowed_tokens_fn that do not commute with it (a forced row replaces the
# constraint's; the others change its -inf scores): with the constraint run last here, the two orders would differ.
_AFTER_PREFIX = ("forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
                 "exponential_decay_length_penalty")


def make_custom_processors(logits_processor, prefix_allowed_tokens_fn, settings: set[str],
                           cuda_graphs) -> CustomProcessors | None:
    """The call's :class:`CustomProcessors`, or ``None`` without any.

    ``settings``: the generate arguments in use among ``_BUILT_IN``'s (``min_length`` and ``min_new_tokens`` count
    as one). ``cuda_graphs``: the call's; ``True`` with a processor is a ``ValueError``.
    Raises ``ValueError`` for anything but a list of callables, a non-callable function, or a processor of a kind
    an argument in use also makes."""
    if logits_processor is None:
        logits_processor = []
    if not isinstance(logits_processor, (list, tuple)) or not all(callable(p) for p in logits_processor):
        raise ValueError(f"logits_processor must be a list of callables (input_ids, scores) -> scores, such as a "
                         f"transformers LogitsProcessorList, got {logits_processor!r}")
    if prefix_allowed_tokens_fn is not None and not callable(prefix_allowed_tokens_fn):
        raise ValueError(f"prefix_allowed_tokens_fn must be a callable (batch_id, input_ids) -> list of allowed "
                         f"ids, got {type(prefix_allowed_tokens_fn).__name__}")
    if not logits_processor and prefix_allowed_tokens_fn is None:
        return None
    if prefix_allowed_tokens_fn is not None:
        clash = [name for name in _AFTER_PREFIX if name in settings]
        if clash:
            raise ValueError(f"prefix_allowed_tokens_fn together with {', '.join(clash)} is not supported: "
                             f"transformers applies the constraint first, and here it runs last")
        settings = settings | {"prefix_allowed_tokens_fn"}
    if settings & {"min_length", "min_new_tokens"}:
        settings = settings | {"min_length", "min_new_tokens"}
    for p in logits_processor:
        setting = _BUILT_IN.get(type(p).__name__)
        if setting in settings:
            raise ValueError(f"logits_processor holds a {type(p).__name__} and {setting} is set too, which makes "
                             f"one; pass one of them")
    if cuda_graphs:
        raise ValueError("a logits_processor or prefix_allowed_tokens_fn runs Python on each row, which a CUDA "
                         "graph cannot replay; leave cuda_graphs unset or pass cuda_graphs=False")
    return CustomProcessors(logits_processor, prefix_allowed_tokens_fn)


__all__ = ["CustomProcessors", "make_custom_processors"]
