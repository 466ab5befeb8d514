"""When a sequence stops, besides its EOS and ``max_new_tokens``: transformers' ``stopping_criteria``, its
``stop_strings`` and ``max_time``.

* A stopping criterion is what transformers' generate takes: called as ``criterion(input_ids, scores)`` with a
  row's tokens so far, LongTensor ``[1, L]`` (its left padding, prompt and new tokens, as transformers passes a
  row), and ``scores=None`` (transformers passes ``None`` too unless scores are kept); it returns a bool or a
  BoolTensor of one element (``True``: the row is done). Each row is asked alone, so a criterion must decide a row
  by that row (every criterion transformers ships does).
* ``stop_strings`` become transformers' own ``StopStringCriteria`` over the tokenizer given, so a stop string
  matches exactly where transformers' would (across token boundaries, ending in the last token).
* ``max_time`` (seconds since generate was called) ends every row after the step that passes it.

With lookahead a step commits several tokens at once. The criteria are asked after each of them in order, as
transformers asks after each token, and the row stops right after the first one that says so (the step's later
tokens are dropped, as after an EOS): the output is what transformers' generate gives with the same criteria.
"""

from __future__ import annotations

import time

import torch


def _is_done(answer, criterion) -> bool:
    if isinstance(answer, torch.Tensor) and answer.numel() == 1:
        return bool(answer.item())
    if isinstance(answer, bool):
        return answer
    got = f"a tensor of shape {tuple(answer.shape)}" if isinstance(answer, torch.Tensor) else type(answer).__name__
    raise ValueError(f"a stopping criterion must return a bool or a BoolTensor of one element for the one row it is "
                     f"given, got {got} from {type(criterion).__name__}")


def make_criteria(stopping_criteria=None, stop_strings=None, tokenizer=None) -> list:
    """The criteria to ask, checked: ``stopping_criteria`` (transformers' ``StoppingCriteriaList``, a list of
    callables, or ``None``) and ``stop_strings`` (a string or a list of non-empty strings, needing ``tokenizer``)."""
    criteria = []
    if stopping_criteria is not None:
        if callable(stopping_criteria) and not isinstance(stopping_criteria, (list, tuple)):
            stopping_criteria = [stopping_criteria]
        if not isinstance(stopping_criteria, (list, tuple)) or not all(map(callable, stopping_criteria)):
            raise ValueError(f"stopping_criteria must be a transformers StoppingCriteriaList or a list of callables "
                             f"(input_ids, scores) -> bool, got {type(stopping_criteria).__name__}")
        criteria.extend(stopping_criteria)
    if stop_strings is not None:
        strings = [stop_strings] if isinstance(stop_strings, str) else stop_strings
        if not isinstance(strings, (list, tuple)) or not strings or \
                not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {stop_strings!r}")
        if tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass it as generate(..., tokenizer=tokenizer)")
        from transformers import StopStringCriteria

        try:
            criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=list(strings)))
        except Exception as exc:  # noqa: BLE001 - a tokenizer transformers cannot read: say which argument
            raise ValueError(f"tokenizer cannot match stop_strings ({type(exc).__name__}: {exc}); pass the model's "
                             f"transformers tokenizer") from exc
    return criteria


class RowStops:
    """One row's criteria: its tokens so far in a growing buffer, asked after each new token."""

    def __init__(self, criteria: list, padding: list[int], prompt: list[int], max_new_tokens: int):
        self.criteria = criteria
        self.ids = torch.empty(len(padding) + len(prompt) + max_new_tokens, dtype=torch.long)
        self.length = len(padding) + len(prompt)
        self.ids[: self.length] = torch.tensor(padding + prompt, dtype=torch.long)

    def after(self, token: int) -> bool:
        """Whether the row is done once ``token`` is appended."""
        self.ids[self.length] = token
        self.length += 1
        ids = self.ids[None, : self.length]
        return any(_is_done(c(ids, None), c) for c in self.criteria)


class Deadline:
    """``max_time``: seconds from the start of the call (``None``: none)."""

    def __init__(self, max_time, started: float):
        if max_time is not None and (isinstance(max_time, bool) or not isinstance(max_time, (int, float))
                                     or not max_time > 0):
            raise ValueError(f"max_time must be a number of seconds > 0, got {max_time!r}")
        self.at = None if max_time is None else started + float(max_time)

    def passed(self) -> bool:
        return self.at is not None and time.perf_counter() > self.at


__all__ = ["make_criteria", "RowStops", "Deadline"]
