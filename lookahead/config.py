"""Lookahead decoding parameters (frozen and validated)."""

from __future__ import annotations

import dataclasses

POOL_BACKENDS = ("auto", "python", "cpp", "cuda")


def _require_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"LookaheadConfig.{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"LookaheadConfig.{name} must be >= {minimum}, got {value}")


@dataclasses.dataclass(frozen=True)
class LookaheadConfig:
    """Parameters of lookahead decoding.

    Attributes:
        window: ``W``, columns decoded in parallel by the lookahead branch (>= 1).
        ngram: ``N``, n-gram size (>= 2); the window keeps ``N - 1`` levels and candidates have ``N - 1`` tokens.
        guess: ``G``, at most this many candidates verified per step and kept per pool key (>= 0; 0 turns
            verification off, leaving pure Jacobi lookahead).
        pool_from_prompt: seed the n-gram pool with the prompt's own n-grams.
        pool_backend: ``"auto"`` (CUDA on a GPU, C++ on CPU where it builds, else Python), ``"python"``,
            ``"cpp"`` or ``"cuda"``.
        seed: seeds the tokens that fill the window's empty columns (drawn from the sequence so far).
    """

    window: int = 15
    ngram: int = 5
    guess: int = 15
    pool_from_prompt: bool = True
    pool_backend: str = "auto"
    seed: int = 0

    def __post_init__(self) -> None:
        _require_int("window", self.window, 1)
        _require_int("ngram", self.ngram, 2)
        _require_int("guess", self.guess, 0)
        _require_int("seed", self.seed, 0)
        if not isinstance(self.pool_from_prompt, bool):
            raise ValueError(f"LookaheadConfig.pool_from_prompt must be a bool, got {self.pool_from_prompt!r}")
        if self.pool_backend not in POOL_BACKENDS:
            raise ValueError(f"LookaheadConfig.pool_backend must be one of {POOL_BACKENDS}, got {self.pool_backend!r}")

    @property
    def levels(self) -> int:
        """Levels the window holds once warm: ``ngram - 1``."""
        return self.ngram - 1

    @property
    def tokens_per_step(self) -> int:
        """Tokens fed per warm step with a full guess set: ``1 + (W-1) + (N-2)*W + G*(N-1)``."""
        return self.window * (self.ngram - 1) + self.guess * (self.ngram - 1)
