"""Keys and values kept from one ``generate`` call to the next: a conversation's next turn prefills only its new
tokens.

``generate(..., prompt_cache=cache)`` (one prompt) looks for the longest common start of the prompt and the tokens
the cache holds, copies those rows of keys and values into the call's KV cache, and prefills only the rest; after
the call the cache holds the prompt and the new tokens that were fed. A token's key and value depend only on the
tokens before it, so reusing them changes nothing but the time: on the CPU in float32 the rows are bit for bit what
a fresh prefill writes (every CPU op's result per row is independent of how many rows a step has; the tests check
it), so greedy output is identical. On CUDA the matrix products choose their blocking by the number of rows, so
reused rows may differ from a fresh prefill's in the last bits, as lookahead's own steps may.
"""

from __future__ import annotations

import weakref

import torch

from .cpu_linear import weights_signature


class PromptCache:
    """The keys and values of one sequence's tokens, for the next ``generate`` call on the same model.

    One cache serves one model: used with another model, or after the model's weights, dtype or device changed, it
    starts over (it never serves stale rows). It holds ``len(cache)`` tokens (``cache.tokens``), at
    ``2 * layers * kv_heads * head_dim`` values each (46 KB a token for SmolLM2 in float32). ``clear()`` frees them.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._k: torch.Tensor | None = None  # [layers, capacity, Hkv, D]
        self._v: torch.Tensor | None = None
        self._model = None  # weak reference to the model the rows belong to
        self._signature: tuple = ()

    def __len__(self) -> int:
        return len(self.tokens)

    def __repr__(self) -> str:
        return f"PromptCache({len(self.tokens)} tokens)"

    def clear(self) -> None:
        self.tokens = []
        self._k = self._v = None
        self._model = None
        self._signature = ()

    def _serves(self, model, signature: tuple) -> bool:
        return self._model is not None and self._model() is model and self._signature == signature

    def restore(self, model, tokens: list[int], cache) -> int:
        """Copy the rows of the longest common start of ``tokens`` and the held tokens into sequence 0 of
        ``cache`` (a :class:`~lookahead.model.KVCache`); returns how many."""
        if not self._serves(model, weights_signature(model)):
            self.clear()
            return 0
        reused = 0
        for held, wanted in zip(self.tokens, tokens):
            if held != wanted:
                break
            reused += 1
        if reused:
            cache.k[:, 0, :reused].copy_(self._k[:, :reused])
            cache.v[:, 0, :reused].copy_(self._v[:, :reused])
        return reused

    def keep(self, model, tokens: list[int], cache) -> None:
        """Hold ``tokens`` and their rows, sequence 0's first ``len(tokens)`` rows of ``cache``."""
        rows = len(tokens)
        signature = weights_signature(model)
        capacity = self._k.shape[1] if self._serves(model, signature) else 0
        if rows > capacity:  # grow geometrically: a conversation adds a turn at a time
            shape = (cache.k.shape[0], max(rows, 2 * capacity), cache.k.shape[3], cache.k.shape[4])
            self._k = torch.empty(shape, dtype=cache.dtype, device=cache.device)
            self._v = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        self._k[:, :rows].copy_(cache.k[:, 0, :rows])
        self._v[:, :rows].copy_(cache.v[:, 0, :rows])
        self.tokens = list(tokens)
        self._model = weakref.ref(model)
        self._signature = signature


__all__ = ["PromptCache"]
