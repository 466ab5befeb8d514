"""N-gram pool backends and the choice between them.

Two pools share one interface and one meaning, that of the Python reference :class:`lookahead.pool.NGramPool`
(key token -> at most ``guess`` continuations of ``ngram - 1`` tokens, least recently inserted first):

* ``"python"``: :class:`lookahead.pool.NGramPool`, dicts on the host;
* ``"cpp"``: :class:`CppNGramPool`, fixed tables on the CPU updated by C++ torch ops.

Both live on the host, whatever device the model runs on: the draft tree is built there. (A CUDA pool was tried
and removed: on an H200 it took 36 us a step against the C++ pool's 14 us, ``bench/MEASUREMENTS.md``.)

Table layout of the C++ pool (allocated once, when the pool is made; ``V`` vocab size, ``G`` guess,
``M = ngram - 1``), also documented in ``csrc/ngram_pool.h``:

* ``conts``: int32 ``[V, G, M]``; ``conts[k, s]`` is the continuation in slot ``s`` of key ``k``;
* ``stamp``: int64 ``[V, G]``; the insertion clock value when slot ``s`` of key ``k`` was last inserted, ``-1``
  for an empty slot. A key's continuations, oldest first, are its occupied slots by increasing stamp;
* ``clock``: int64 ``[1]``; the next stamp.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from lookahead_kernels.validation import require_int

from .config import LookaheadConfig
from .pool import NGramPool

# () -> the torch.ops.lookahead_pool namespace; raises when the extension cannot be built.
PoolLoader = Callable[[], object]


def _default_loader():
    # Imported here so that importing lookahead never touches the extension machinery.
    from lookahead_kernels.pool_ext import load_pool_extension

    return load_pool_extension()


def _int_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be an integer torch.Tensor, got {type(value).__name__}")
    if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
        raise ValueError(f"{name} must hold integer token ids (int32 or int64), got dtype {value.dtype}")
    return value


class TableNGramPool:
    """N-gram pool in fixed CPU tensors (layout in the module docstring), updated by the ``lookahead_pool`` ops.

    Use :class:`CppNGramPool` (or :func:`make_pool`) to make one.

    Attributes:
        ngram: ``N``; continuations have ``N - 1`` tokens.
        guess: ``G``; at most this many continuations per key (0: the pool stores nothing).
        vocab_size: ``V``; token ids must lie in ``[0, V)``.
        device: the CPU, where the tables live and where lookups return their tensors.
        conts: int32 ``[V, G, N-1]``; ``conts[k, s]`` is the continuation in slot ``s`` of key ``k``.
        stamp: int64 ``[V, G]``; insertion clock value of each slot's last insert, ``-1`` = empty slot.
        clock: int64 ``[1]``; the next stamp. (Read the tables; only the ops write them.)
    """

    def __init__(self, ngram: int, guess: int, vocab_size: int, ops):
        self.ngram = require_int("ngram", ngram, 2)
        self.guess = require_int("guess", guess, 0)
        self.vocab_size = require_int("vocab_size", vocab_size, 1)
        if vocab_size > torch.iinfo(torch.int32).max:
            raise ValueError(f"vocab_size must be < 2**31 (tokens are stored as int32), got {vocab_size}")
        self.device = torch.device("cpu")
        self._ops = ops
        self.conts = torch.zeros(vocab_size, guess, ngram - 1, dtype=torch.int32, device=self.device)
        self.stamp = torch.full((vocab_size, guess), -1, dtype=torch.long, device=self.device)
        self.clock = torch.zeros(1, dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        """Number of stored continuations, all keys together."""
        return int((self.stamp != -1).sum())

    def _check_range(self, name: str, tokens: torch.Tensor) -> None:
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if tokens.numel() and bool(bad.any()):
            value = int(tokens[bad].reshape(-1)[0])
            raise ValueError(f"{name}: token ids must be in [0, {self.vocab_size}), got {value}")

    def insert(self, ngrams: torch.Tensor) -> None:
        """Insert n-grams row by row: row ``r`` is key ``ngrams[r, 0]`` and continuation ``ngrams[r, 1:]``.

        Args:
            ngrams: integer tensor ``[K, ngram]`` (any device; moved to the CPU), ids in ``[0, vocab_size)``.

        Raises:
            ValueError: wrong shape or dtype, or an id outside ``[0, vocab_size)`` (checked by the op before it
                changes anything, so the pool is then unchanged).
        """
        ngrams = _int_tensor("ngrams", ngrams)
        if ngrams.dim() != 2 or ngrams.shape[1] != self.ngram:
            raise ValueError(f"ngrams must be [K, {self.ngram}], got {tuple(ngrams.shape)}")
        ngrams = ngrams.to(device=self.device, dtype=torch.long).contiguous()
        self._ops.insert(self.conts, self.stamp, self.clock, ngrams)

    def insert_sequence(self, tokens: torch.Tensor) -> None:
        """Insert every n-gram of a token sequence (integer tensor, flattened to ``[L]``), in order."""
        tokens = _int_tensor("tokens", tokens).reshape(-1)
        if tokens.numel() >= self.ngram:
            self.insert(tokens.unfold(0, self.ngram, 1))
        else:  # too short to insert, but a bad id is still the caller's error
            self._check_range("tokens", tokens)

    def _key_tensor(self, key) -> torch.Tensor:
        if isinstance(key, torch.Tensor):
            key = _int_tensor("key", key)
            if key.numel() != 1:
                raise ValueError(f"key must be one token id (an int or a 0-d tensor), got shape {tuple(key.shape)}")
            return key.reshape(()).to(device=self.device, dtype=torch.long)
        if isinstance(key, bool) or not isinstance(key, int):
            raise ValueError(f"key must be an int or a 0-d integer tensor, got {type(key).__name__}")
        if not 0 <= key < self.vocab_size:
            raise ValueError(f"key must be a token id in [0, {self.vocab_size}), got {key}")
        return torch.tensor(key, dtype=torch.long, device=self.device)

    def lookup_padded(self, key) -> tuple[torch.Tensor, torch.Tensor]:
        """The key's continuations, padded to a fixed shape (a caller can read rows until the first ``-1``).

        Args:
            key: 0-d integer tensor (or int), a token id in ``[0, vocab_size)``.

        Returns:
            ``(out, count)`` on the CPU: ``out`` int64 ``[guess, ngram-1]``, rows ``0..count-1`` the
            continuations oldest first, the other rows ``-1``; ``count`` int64 0-d.

        Raises:
            ValueError: ``key`` is not one integer token id in ``[0, vocab_size)``.
        """
        return self._ops.lookup(self.conts, self.stamp, self._key_tensor(key))

    def lookup(self, key) -> torch.Tensor:
        """int64 ``[g, ngram-1]`` on the CPU (``g <= guess``, possibly 0): the key's continuations, oldest first.
        Changes nothing."""
        out, count = self.lookup_padded(key)
        return out[: int(count)]


class CppNGramPool(TableNGramPool):
    """The pool on the CPU, in C++ (built just in time on first use).

    Raises:
        lookahead_kernels.pool_ext.PoolExtensionError: the C++ extension could not be built (compiler message
            included).
    """

    def __init__(self, ngram: int, guess: int, vocab_size: int, *, loader: PoolLoader | None = None):
        ops = (loader or _default_loader)()
        super().__init__(ngram, guess, vocab_size, ops)


NO_ROWS = torch.empty(0, 0, dtype=torch.long)  # no continuations: a row without a pool, or none found


def lookup_rows(pools: list, keys: list[int]) -> list[torch.Tensor]:
    """Pool ``i``'s continuations of ``keys[i]`` for every row of a batch: int64 ``[g, ngram-1]`` on the CPU,
    oldest first, as its :meth:`lookup` gives them (``None``: no pool, ``[0, 0]``). The table pools' rows in one
    C++ call: a lookup from Python cost about 5 us a row (a key tensor made, an op dispatched, two tensors back).

    Raises:
        ValueError: a key outside ``[0, vocab_size)`` of its pool.
    """
    out: list[torch.Tensor] = [NO_ROWS] * len(pools)
    tables = [i for i, p in enumerate(pools) if isinstance(p, TableNGramPool)]
    if tables:
        found = pools[tables[0]]._ops.lookup_rows([pools[i].conts for i in tables], [pools[i].stamp for i in tables],
                                                  [keys[i] for i in tables])
        for i, rows in zip(tables, found):
            out[i] = rows
    for i, pool in enumerate(pools):
        if pool is not None and not isinstance(pool, TableNGramPool):
            out[i] = pool.lookup(keys[i])
    return out


def _short(exc: Exception, limit: int = 800) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


def make_pool(config: LookaheadConfig, vocab_size: int, *, loader: PoolLoader | None = None):
    """Make the n-gram pool ``config.pool_backend`` asks for.

    Args:
        config: gives the n-gram size (``config.shape().ngram``), the continuations per key
            (``config.pool_guess``) and ``pool_backend``: ``"python"`` (:class:`NGramPool`), ``"cpp"``
            (:class:`CppNGramPool`), or ``"auto"``: the C++ pool where it builds, else the Python pool with a
            warning that says why the C++ pool was passed over (``"auto"`` never raises for a failed build).
        vocab_size: token ids lie in ``[0, vocab_size)``; sizes the C++ tables.
        loader: ``() -> ops`` builds/loads the extension; default
            :func:`lookahead_kernels.pool_ext.load_pool_extension` (tests inject failing loaders here).

    Raises:
        ValueError: bad ``config``/``vocab_size``.
        lookahead_kernels.pool_ext.PoolExtensionError: backend ``"cpp"`` failed to build.
    """
    if not isinstance(config, LookaheadConfig):
        raise ValueError(f"config must be a LookaheadConfig, got {type(config).__name__}")
    require_int("vocab_size", vocab_size, 1)
    backend, n, g = config.pool_backend, config.shape().ngram, config.pool_guess
    if backend == "python":
        return NGramPool(n, g)
    if backend == "cpp":
        return CppNGramPool(n, g, vocab_size, loader=loader)
    try:
        return CppNGramPool(n, g, vocab_size, loader=loader)
    except Exception as exc:  # "auto" falls back on any failure, as documented
        warnings.warn(f"pool_backend='auto': using the slower Python n-gram pool; C++ pool unavailable "
                      f"({_short(exc)})", RuntimeWarning, stacklevel=2)
    return NGramPool(n, g)
