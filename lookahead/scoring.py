"""transformers' forward call on our model: ``model(input_ids, attention_mask=..., labels=...)`` scores whole
sequences and returns their logits (and loss), as ``transformers``' ``LlamaForCausalLM`` does.

Our :meth:`~lookahead.model.LlamaForCausalLM.forward` is a decoding step (a layout, a KV cache, positions); called
without those, it comes here: each sequence is one causal prefill into a fresh cache, positions from 0. A padded row
(left or right padding) is run on its own tokens only, so its logits are the unpadded sequence's exactly; the
logits at its padded positions are zeros.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from lookahead_kernels.layout import StepLayout

from .arguments import check_ids_dtype, mask_rows

IGNORE_INDEX = -100  # transformers' label for "no loss here"


@dataclasses.dataclass
class CausalLMOutput:
    """What ``model(input_ids, ...)`` returns.

    Attributes:
        logits: float32 ``[B, L, vocab_size]``: position ``i``'s scores for the token after it; zeros at padded
            positions.
        loss: float32 scalar, the mean cross-entropy of ``labels`` (given ``labels``), else None.

    ``out.logits``, ``out["logits"]`` and ``out[0]`` (the loss first when there is one, as transformers orders
    them) all work.
    """

    logits: torch.Tensor
    loss: torch.Tensor | None = None

    def to_tuple(self) -> tuple:
        return (self.logits,) if self.loss is None else (self.loss, self.logits)

    def __getitem__(self, key):
        if isinstance(key, str):
            if key not in ("logits", "loss") or getattr(self, key) is None:
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]


def _as_ids(input_ids) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be an integer tensor [B, L], got {type(input_ids).__name__}")
    check_ids_dtype(input_ids, "input_ids")
    ids = input_ids[None] if input_ids.dim() == 1 else input_ids
    if ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [B, L] with B, L >= 1, got shape {tuple(input_ids.shape)}")
    return ids


def _spans(attention_mask, shape: tuple[int, int]) -> list[tuple[int, int]] | None:
    """Per row ``(start, end)`` of its tokens (one unbroken run of ones), or None where there is no padding."""
    if attention_mask is None:
        return None
    rows = mask_rows(attention_mask, shape)
    if all(count == shape[1] for _, _, count in rows):
        return None
    for b, (start, end, count) in enumerate(rows):
        if count != end - start:
            raise ValueError(f"attention_mask row {b} has gaps; each row must be one run of ones (left or right "
                             f"padding around it)")
    return [(start, end) for start, end, _ in rows]


def _prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    B, L = ids.shape
    positions = torch.arange(L, device=ids.device).expand(B, L)
    return model(ids, positions, model.new_cache(B, L), 0, StepLayout.prefill(L))


def _loss(logits: torch.Tensor, labels, spans) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor like input_ids, got "
                         f"{labels.dtype if isinstance(labels, torch.Tensor) else type(labels).__name__}")
    labels = labels[None] if labels.dim() == 1 else labels
    if tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"labels has shape {tuple(labels.shape)} but input_ids is {list(logits.shape[:2])}; "
                         f"they must match")
    vocab = logits.shape[-1]
    labels = labels.to(logits.device, torch.long)
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels must be token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored)")
    target = labels[:, 1:].clone()  # position i predicts label i + 1
    if spans is not None:  # a label predicted from a padded position (zero logits) counts for nothing
        for b, (start, end) in enumerate(spans):
            target[b, :start] = IGNORE_INDEX
            target[b, end - 1:] = IGNORE_INDEX
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), target.reshape(-1), ignore_index=IGNORE_INDEX)


def score(model, input_ids, attention_mask=None, labels=None) -> CausalLMOutput:
    """Logits of every position of ``input_ids [B, L]`` (or ``[L]``), and the loss of ``labels``.

    Args:
        input_ids: integer tensor ``[B, L]`` on the model's device.
        attention_mask: optional ``[B, L]`` of 0 (padding) and 1 (token); each row's ones in one run, padding on
            either side.
        labels: optional integer ``[B, L]``: the targets, ``-100`` where none (transformers' convention: the
            model shifts them, position ``i`` predicting ``labels[:, i + 1]``). Labels at padded positions, and
            labels predicted from one, are ignored.
    Returns:
        :class:`CausalLMOutput`.
    """
    ids = _as_ids(input_ids)
    spans = _spans(attention_mask, tuple(ids.shape))
    if spans is None:
        logits = _prefill_logits(model, ids)
    else:
        logits = torch.zeros(*ids.shape, model.config.vocab_size, dtype=torch.float32, device=ids.device)
        for b, (start, end) in enumerate(spans):
            logits[b, start:end] = _prefill_logits(model, ids[b:b + 1, start:end])[0]
    loss = None if labels is None else _loss(logits, labels, spans)
    return CausalLMOutput(logits=logits, loss=loss)


def transition_scores(sequences: torch.Tensor, scores, beam_indices=None, normalize_logits: bool = False):
    """Each new token's score, as transformers' ``compute_transition_scores`` gives it for greedy or sampled
    decoding: float32 ``[B, new]``, row ``b``'s ``t``-th new token's entry in ``scores[t][b]`` (``generate(...,
    output_scores=True).scores``), after a log-softmax over the vocabulary with ``normalize_logits``. NaN where a
    row had ended (its scores are NaN there). ``sequences``: ``[B, L + new]``, generate's."""
    if beam_indices is not None:
        raise ValueError("beam_indices come from beam search, which lookahead's generate does not do; pass None")
    if not isinstance(scores, (tuple, list)) or not scores or not all(isinstance(s, torch.Tensor) for s in scores):
        raise ValueError("scores must be generate's output_scores=True scores: a non-empty tuple of [B, vocab] "
                         "tensors")
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 or sequences.shape[1] < len(scores) \
            or sequences.shape[0] != scores[0].shape[0]:
        raise ValueError(f"sequences must be generate's [B, L + new] for {len(scores)} new tokens of a batch of "
                         f"{scores[0].shape[0]}, got {getattr(sequences, 'shape', type(sequences).__name__)}")
    stacked = torch.stack(scores, 1).float()  # [B, new, vocab]
    if normalize_logits:
        stacked = torch.log_softmax(stacked, dim=-1)
    tokens = sequences[:, sequences.shape[1] - len(scores):].to(stacked.device)
    return stacked.gather(2, tokens[..., None]).squeeze(2)


__all__ = ["CausalLMOutput", "IGNORE_INDEX", "score", "transition_scores"]
