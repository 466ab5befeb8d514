"""Lookahead decoding parameters (frozen and validated)."""

from __future__ import annotations

import dataclasses

from lookahead_kernels.validation import require_int

POOL_BACKENDS = ("auto", "python", "cpp", "cuda")


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
        The guess improvements below were measured against the original one-token pool (greedy, SmolLM2, 34
        MT-Bench and 20 HumanEval dev prompts, 64 tokens; ``bench/results/guesses-cpu-20.md``). Only
        ``pool_from_output`` is on by default: it raised compression in every set and configuration (+1.5% at
        (15,5,15), +3.6% at (7,5,7), mean over the two sets) and keeps the pool on the C++/CUDA backends. The
        others need host-side tables; ``guess_from_history`` pays at a small ``guess`` (+4.9% at (7,5,7)).
        pool_two_token_key: look candidates up by the last two committed tokens ``(sequence[-2], x)`` first, in a
            bounded hashed table, and fill up with the one-token pool's candidates (de-duplicated).
        pool_two_token_slots: slots of that hashed table (>= 0); ``0`` sizes it from the parameters, the next
            power of two >= ``64 * window * max(guess, 1)``. Each slot holds one two-token key and at most
            ``guess`` continuations.
        pool_rank_by_hits: offer each key's continuations by how many of their tokens were accepted, then most
            recently used first, and evict the least-hit (then oldest) one when a key is full; without it a key
            keeps its ``guess`` most recently inserted continuations, oldest first. With it on, the one-token key
            lives in a Python table (the C++/CUDA pools keep no hit counts): ``pool_backend`` applies only when
            this is off.
        pool_from_output: also add the n-grams of the committed output (those ending in each step's new
            tokens) to the pool(s), after the window's.
        guess_from_history: offer first (in up to half of the ``guess`` slots) what followed the latest earlier
            occurrences of the sequence's last 3, 2 or 1 tokens in the prompt and output, then the pool's
            candidates. A host-side index that is never evicted, so the prompt's n-grams survive a small ``guess``.
        pad_candidates: give every step room for all ``guess`` candidates, padding the unused ones (verification
            ignores them through its ``num_candidates``). The step's shape is then constant and the one-token
            pool's lookup stays on the device, with no host sync. ``None`` (default): on for CUDA devices, off on
            the CPU, where the padded rows would cost compute.
    """

    window: int = 15
    ngram: int = 5
    guess: int = 15
    pool_from_prompt: bool = True
    pool_backend: str = "auto"
    seed: int = 0
    pool_two_token_key: bool = False
    pool_two_token_slots: int = 0
    pool_rank_by_hits: bool = False
    pool_from_output: bool = True
    guess_from_history: bool = False
    pad_candidates: bool | None = None

    def __post_init__(self) -> None:
        require_int("LookaheadConfig.window", self.window, 1)
        require_int("LookaheadConfig.ngram", self.ngram, 2)
        require_int("LookaheadConfig.guess", self.guess, 0)
        require_int("LookaheadConfig.seed", self.seed, 0)
        require_int("LookaheadConfig.pool_two_token_slots", self.pool_two_token_slots, 0)
        for name in ("pool_from_prompt", "pool_two_token_key", "pool_rank_by_hits", "pool_from_output",
                     "guess_from_history"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"LookaheadConfig.{name} must be a bool (True or False), got {value!r}")
        if self.pad_candidates is not None and not isinstance(self.pad_candidates, bool):
            raise ValueError(f"LookaheadConfig.pad_candidates must be None (auto), True or False, got "
                             f"{self.pad_candidates!r}")
        if self.pool_backend not in POOL_BACKENDS:
            raise ValueError(f"LookaheadConfig.pool_backend must be one of {POOL_BACKENDS}, got {self.pool_backend!r}")

    @property
    def levels(self) -> int:
        """Levels the window holds once warm: ``ngram - 1``."""
        return self.ngram - 1

    @property
    def two_token_slots(self) -> int:
        """Slots of the two-token table: ``pool_two_token_slots``, or when 0 the next power of two >=
        ``64 * W * max(G, 1)`` (room for the window n-grams of about ``64 * G`` steps)."""
        if self.pool_two_token_slots:
            return self.pool_two_token_slots
        return 1 << (64 * self.window * max(self.guess, 1) - 1).bit_length()

    @property
    def tokens_per_step(self) -> int:
        """Tokens fed per warm step with a full guess set: ``1 + (W-1) + (N-2)*W + G*(N-1)``."""
        return self.window * (self.ngram - 1) + self.guess * (self.ngram - 1)
