"""Where a step's verification candidates come from: the n-gram pool, behind one small interface.

The decoding loop talks only to a :class:`GuessSource`; it never touches the pool directly. The plain source is
the original implementation's: one pool keyed by the input token ``x``, fed with the window's n-grams (and the
prompt's when ``pool_from_prompt``).
"""

from __future__ import annotations

import torch

from .config import LookaheadConfig


class GuessSource:
    """Candidates for each step from an n-gram pool keyed by ``x`` (the original one-token pool).

    Args:
        config: the lookahead parameters (``ngram``, ``guess``, ``pool_from_prompt``, ``pool_backend``).
        vocab_size: the model's vocabulary size (fixed-size pools are allocated from it).
        device: where the pool lives (``auto`` picks CUDA / C++ / Python from it).
    """

    def __init__(self, config: LookaheadConfig, vocab_size: int, device):
        from .pools import make_pool

        self.config = config
        self.pool = make_pool(config, vocab_size, device)

    def start(self, prompt: torch.Tensor) -> None:
        """Called once with the prompt (1-D LongTensor) before the first step."""
        if self.config.pool_from_prompt and self.config.guess > 0:
            self.pool.insert_sequence(prompt.reshape(-1).cpu())

    def candidates(self, sequence: list[int]) -> torch.Tensor:
        """LongTensor ``[g, N-1]`` (``g <= guess``) for the step whose ``x`` is ``sequence[-1]``."""
        k = self.config.ngram - 1
        if self.config.guess == 0:
            return torch.empty(0, k, dtype=torch.long)
        return self.pool.lookup(sequence[-1])[: self.config.guess].cpu()

    def observe(self, ngrams: torch.Tensor | None, sequence: list[int], accepted: int, best: int) -> None:
        """After a step: the window's n-grams ``[W, N]`` (or ``None`` while warming up), the committed sequence
        (the step's emitted tokens included), how many candidate tokens were accepted and from which candidate
        (``-1`` when none)."""
        if ngrams is not None and self.config.guess > 0:
            self.pool.insert(ngrams)
