"""N-gram pool backends and the choice between them.

Three pools share one interface and one meaning, that of the Python reference :class:`lookahead.pool.NGramPool`
(key token -> at most ``guess`` continuations of ``ngram - 1`` tokens, least recently inserted first):

* ``"python"``: :class:`lookahead.pool.NGramPool`, dicts on the host;
* ``"cpp"``: :class:`CppNGramPool`, fixed tables on the CPU updated by C++ torch ops;
* ``"cuda"``: :class:`CudaNGramPool`, the same tables on a GPU updated by CUDA kernels, with no host sync on
  the hot path (:meth:`TableNGramPool.insert` with ``check=False`` and :meth:`TableNGramPool.lookup_padded`).

Table layout of the C++ and CUDA pools (allocated once, when the pool is made; ``V`` vocab size, ``G`` guess,
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

# (cuda: bool) -> the torch.ops.lookahead_pool namespace; raises when the extension cannot be built.
PoolLoader = Callable[[bool], object]


def _default_loader(cuda: bool):
    # Imported here so that importing lookahead never touches the extension machinery.
    from lookahead_kernels.pool_ext import load_pool_extension

    return load_pool_extension(cuda)


def _int_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} must be an integer torch.Tensor, got {type(value).__name__}")
    if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
        raise ValueError(f"{name} must hold integer token ids (int32 or int64), got dtype {value.dtype}")
    return value


class TableNGramPool:
    """N-gram pool in fixed tensors (layout in the module docstring), updated by the ``lookahead_pool`` ops.

    Use :class:`CppNGramPool` or :class:`CudaNGramPool` (or :func:`make_pool`) to make one.

    Attributes:
        ngram: ``N``; continuations have ``N - 1`` tokens.
        guess: ``G``; at most this many continuations per key (0: the pool stores nothing).
        vocab_size: ``V``; token ids must lie in ``[0, V)``.
        device: where the tables live and where lookups return their tensors.
        conts: int32 ``[V, G, N-1]``; ``conts[k, s]`` is the continuation in slot ``s`` of key ``k``.
        stamp: int64 ``[V, G]``; insertion clock value of each slot's last insert, ``-1`` = empty slot.
        clock: int64 ``[1]``; the next stamp. (Read the tables; only the ops write them.)
    """

    def __init__(self, ngram: int, guess: int, vocab_size: int, device: torch.device, ops):
        self.ngram = require_int("ngram", ngram, 2)
        self.guess = require_int("guess", guess, 0)
        self.vocab_size = require_int("vocab_size", vocab_size, 1)
        if vocab_size > torch.iinfo(torch.int32).max:
            raise ValueError(f"vocab_size must be < 2**31 (tokens are stored as int32), got {vocab_size}")
        self.device = torch.device(device)
        self._ops = ops
        self.conts = torch.zeros(vocab_size, guess, ngram - 1, dtype=torch.int32, device=self.device)
        self.stamp = torch.full((vocab_size, guess), -1, dtype=torch.long, device=self.device)
        self.clock = torch.zeros(1, dtype=torch.long, device=self.device)

    def __len__(self) -> int:
        """Number of stored continuations, all keys together (a host sync on CUDA)."""
        return int((self.stamp != -1).sum())

    def _check_range(self, name: str, tokens: torch.Tensor) -> None:
        # One host sync on CUDA; only reached when the caller asked for checks.
        bad = (tokens < 0) | (tokens >= self.vocab_size)
        if tokens.numel() and bool(bad.any()):
            value = int(tokens[bad].reshape(-1)[0])
            raise ValueError(f"{name}: token ids must be in [0, {self.vocab_size}), got {value}")

    def insert(self, ngrams: torch.Tensor, check: bool = True) -> None:
        """Insert n-grams row by row: row ``r`` is key ``ngrams[r, 0]`` and continuation ``ngrams[r, 1:]``.

        Args:
            ngrams: integer tensor ``[K, ngram]`` (any device; moved to the pool's), ids in ``[0, vocab_size)``.
            check: on CUDA, check the ids first (one host sync) and raise ``ValueError`` on a bad one; with
                ``False`` there is no sync and rows holding a bad id are skipped. The CPU pool always checks.

        Raises:
            ValueError: wrong shape or dtype, or (when checked) an id outside ``[0, vocab_size)``; the pool is
                then unchanged.
        """
        ngrams = _int_tensor("ngrams", ngrams)
        if ngrams.dim() != 2 or ngrams.shape[1] != self.ngram:
            raise ValueError(f"ngrams must be [K, {self.ngram}], got {tuple(ngrams.shape)}")
        ngrams = ngrams.to(device=self.device, dtype=torch.long).contiguous()
        if check and self.device.type != "cpu":
            self._check_range("ngrams", ngrams)
        self._ops.insert(self.conts, self.stamp, self.clock, ngrams)

    def insert_sequence(self, tokens: torch.Tensor, check: bool = True) -> None:
        """Insert every n-gram of a token sequence (integer tensor, flattened to ``[L]``), in order."""
        tokens = _int_tensor("tokens", tokens).reshape(-1)
        if tokens.numel() >= self.ngram:
            self.insert(tokens.unfold(0, self.ngram, 1), check=check)
        elif check:
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
        """The key's continuations, padded: no host sync on CUDA when ``key`` is already on the pool's device.

        Args:
            key: 0-d integer tensor (or int), a token id in ``[0, vocab_size)``. On CUDA an out-of-range id in a
                device tensor is not an error (checking would need a sync): it reads as a key with nothing stored.

        Returns:
            ``(out, count)`` on the pool's device: ``out`` int64 ``[guess, ngram-1]``, rows ``0..count-1`` the
            continuations oldest first, the other rows ``-1``; ``count`` int64 0-d.
        """
        return self._ops.lookup(self.conts, self.stamp, self._key_tensor(key))

    def lookup(self, key) -> torch.Tensor:
        """int64 ``[g, ngram-1]`` on the pool's device (``g <= guess``, possibly 0): the key's continuations,
        oldest first. Changes nothing. Reads the count back to the host (a sync on CUDA)."""
        out, count = self.lookup_padded(key)
        return out[: int(count)]


class CppNGramPool(TableNGramPool):
    """The pool on the CPU, in C++ (built just in time on first use).

    Raises:
        lookahead_kernels.pool_ext.PoolExtensionError: the C++ extension could not be built (compiler message
            included).
    """

    def __init__(self, ngram: int, guess: int, vocab_size: int, *, loader: PoolLoader | None = None):
        ops = (loader or _default_loader)(False)
        super().__init__(ngram, guess, vocab_size, torch.device("cpu"), ops)


class CudaNGramPool(TableNGramPool):
    """The pool on a GPU, updated by CUDA kernels (built just in time on first use).

    Raises:
        ValueError: ``device`` is not a CUDA device, or this torch has no usable CUDA.
        lookahead_kernels.pool_ext.PoolExtensionError: the CUDA extension could not be built.
    """

    def __init__(self, ngram: int, guess: int, vocab_size: int, device="cuda", *,
                 loader: PoolLoader | None = None):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the CUDA n-gram pool needs a CUDA device, got {device}; use the 'cpp' or "
                             "'python' pool backend on the CPU")
        if torch.version.cuda is None or not torch.cuda.is_available():
            raise ValueError(f"the CUDA n-gram pool needs a CUDA build of torch and a visible GPU; this torch "
                             f"({torch.__version__}) has CUDA {torch.version.cuda}, GPU visible: "
                             f"{torch.cuda.is_available()}")
        ops = (loader or _default_loader)(True)
        super().__init__(ngram, guess, vocab_size, device, ops)


def _short(exc: Exception, limit: int = 800) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= limit else text[:limit] + " ..."


def make_pool(config: LookaheadConfig, vocab_size: int, device="cpu", *, loader: PoolLoader | None = None):
    """Make the n-gram pool ``config.pool_backend`` asks for.

    Args:
        config: gives the n-gram size (``config.shape().ngram``), the continuations per key
            (``config.pool_guess``) and ``pool_backend``: ``"python"`` (:class:`NGramPool`), ``"cpp"``
            (:class:`CppNGramPool`), ``"cuda"`` (:class:`CudaNGramPool` on ``device``), or ``"auto"``: the C++
            pool where it builds, on a GPU too (the draft tree is built on the host, which then reads the pool
            without a device sync; an H100 measured 24 us a step for the C++ pool against 38-79 us for the CUDA
            one, ``bench/results/pool-nvidia-h100-80gb-hbm3.md``), else the CUDA pool on a CUDA device, else the
            Python pool, with a warning that says why a faster pool was passed over (``"auto"`` never raises for
            a backend that fails to build).
        vocab_size: token ids lie in ``[0, vocab_size)``; sizes the C++/CUDA tables.
        device: the device the decoder runs on.
        loader: ``(cuda: bool) -> ops`` builds/loads the extension; default
            :func:`lookahead_kernels.pool_ext.load_pool_extension` (tests inject failing loaders here).

    Raises:
        ValueError: bad ``config``/``vocab_size``/``device``, or backend ``"cuda"`` without a usable GPU.
        lookahead_kernels.pool_ext.PoolExtensionError: backend ``"cpp"`` or ``"cuda"`` failed to build.
    """
    if not isinstance(config, LookaheadConfig):
        raise ValueError(f"config must be a LookaheadConfig, got {type(config).__name__}")
    require_int("vocab_size", vocab_size, 1)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device or a device string, got {device!r}") from exc
    backend, n, g = config.pool_backend, config.shape().ngram, config.pool_guess
    if backend == "python":
        return NGramPool(n, g)
    if backend == "cpp":
        return CppNGramPool(n, g, vocab_size, loader=loader)
    if backend == "cuda":
        return CudaNGramPool(n, g, vocab_size, device, loader=loader)

    passed_over = []
    pool = None
    try:
        return CppNGramPool(n, g, vocab_size, loader=loader)
    except Exception as exc:  # "auto" falls back on any failure, as documented
        passed_over.append(f"C++ pool unavailable ({_short(exc)})")
    if device.type == "cuda":
        try:
            pool = CudaNGramPool(n, g, vocab_size, device, loader=loader)
        except Exception as exc:
            passed_over.append(f"CUDA pool unavailable ({_short(exc)})")
    if pool is None:
        pool = NGramPool(n, g)
    if passed_over:
        chosen = "CUDA" if isinstance(pool, CudaNGramPool) else "Python"
        warnings.warn(f"pool_backend='auto': using the {chosen} n-gram pool; " + "; ".join(passed_over),
                      RuntimeWarning, stacklevel=2)
    return pool
