"""A thin Llama-family decoder in plain PyTorch, with an explicit preallocated KV cache.

The model runs one *step* at a time: ``T`` new tokens laid out by a :class:`~lookahead_kernels.StepLayout`
(a prefill block, a single decode token, or a lookahead step with its window and candidates). Each layer
writes the step's keys/values into the cache at rows ``cache_len .. cache_len+T-1`` and attends over the
committed prefix plus the step's own tokens under the layout's visibility rule. Nothing is hidden in module
state: the cache is an object the caller owns and passes in.

Supported checkpoints: Llama (incl. Llama-3 rope scaling), Mistral without sliding windows, Qwen2 and Qwen3
without sliding windows, SmolLM3. Loading lives in :mod:`lookahead.loading`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Callable

import torch
from torch import nn

from lookahead_kernels.cpu_attention import CpuStepAttention
from lookahead_kernels.cpu_layer import decoder_stack_cpu, forward_step_cpu
from lookahead_kernels.layer_ops_ref import (apply_rotary, head_norms, rms_norm_reference, silu_mul_reference,
                                             write_rows)
from lookahead_kernels.layout import StepLayout

from . import cpu_linear
from .cpu_linear import CpuLinear, PackedWeight
from .scoring import score

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. ``rope_type`` is ``"llama3"`` (all fields) or ``"linear"`` (``factor`` only)."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    ``attention_bias`` puts a bias on the q, k, v projections; ``output_bias`` on the o projection (Llama's
    ``attention_bias=True`` sets both; Qwen2 has q/k/v bias and no o bias). ``qk_norm`` normalises each head of q
    and k (RMSNorm over ``head_dim``, a weight each for q and k) before the rotary embedding, as Qwen3 does.
    ``nope_layers``: the layers whose q and k take no rotary embedding (SmolLM3's every fourth), ascending.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    nope_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, RopeScaling):
                raise ValueError(f"ModelConfig.rope_scaling must be None or a RopeScaling, "
                                 f"got {type(self.rope_scaling).__name__}")
            if self.rope_scaling.rope_type not in ("llama3", "linear"):
                raise ValueError(f"unsupported rope type {self.rope_scaling.rope_type!r}; "
                                 f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        nope = tuple(self.nope_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) for i in nope) or list(nope) != sorted(set(nope)) \
                or (nope and not 0 <= nope[0] <= nope[-1] < self.num_layers):
            raise ValueError(f"ModelConfig.nope_layers must be ascending distinct layer indices in [0, "
                             f"{self.num_layers}), got {self.nope_layers!r}")
        object.__setattr__(self, "nope_layers", nope)
        if isinstance(self.eos_token_id, int):  # a single id is kept as a 1-tuple
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        else:
            object.__setattr__(self, "eos_token_id", tuple(int(t) for t in self.eos_token_id))

    # transformers' names of three fields, for code written against its configs (``model.config.num_hidden_layers``).
    @property
    def num_hidden_layers(self) -> int:
        return self.num_layers

    @property
    def num_attention_heads(self) -> int:
        return self.num_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.num_kv_heads

    @property
    def hf_eos_token_id(self) -> int | list[int] | None:
        """The EOS ids as transformers' configs write them: ``None``, one int, or a list."""
        eos = self.eos_token_id
        return None if not eos else eos[0] if len(eos) == 1 else list(eos)

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        """Translate a transformers ``LlamaConfig`` / ``MistralConfig`` / ``Qwen2Config`` / ``Qwen3Config`` /
        ``SmolLM3Config``.

        Raises ``ValueError`` for other model types, sliding-window attention, unsupported rope types or
        activations.
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU MLP) is supported")
        max_pos = int(hf_config.max_position_embeddings)
        _check_no_sliding_window(hf_config, model_type, max_pos)

        rope_theta, rope_scaling = _rope_from_hf(hf_config, max_pos)
        num_heads = int(hf_config.num_attention_heads)
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        if model_type == "qwen2":
            attention_bias, output_bias, mlp_bias = True, False, False
        elif model_type == "mistral":
            attention_bias = output_bias = mlp_bias = False
        else:  # Llama's, Qwen3's and SmolLM3's attention_bias is on q, k, v and o alike (Qwen3: no mlp_bias)
            attention_bias = output_bias = bool(getattr(hf_config, "attention_bias", False))
            mlp_bias = bool(getattr(hf_config, "mlp_bias", False))
        eos = getattr(hf_config, "eos_token_id", None)
        eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        pad = getattr(hf_config, "pad_token_id", None)
        uses_rope = getattr(hf_config, "no_rope_layers", None) if model_type == "smollm3" else None
        return cls(
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            output_bias=output_bias,
            mlp_bias=mlp_bias,
            qk_norm=model_type == "qwen3",
            nope_layers=tuple(i for i, rope in enumerate(uses_rope or ()) if not rope),  # SmolLM3: 1 = RoPE
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_id=eos,
            pad_token_id=pad if isinstance(pad, int) and not isinstance(pad, bool) else None,
        )


def _check_no_sliding_window(hf_config, model_type: str, max_pos: int) -> None:
    window = getattr(hf_config, "sliding_window", None)
    if model_type in ("qwen2", "qwen3", "smollm3"):
        uses = getattr(hf_config, "use_sliding_window", False) and "sliding_attention" in (
            getattr(hf_config, "layer_types", None) or ["sliding_attention"])
    else:
        uses = window is not None
    if uses and window is not None and window < max_pos:
        raise ValueError(f"sliding-window attention is unsupported ({model_type} sliding_window={window} < "
                         f"max_position_embeddings={max_pos}); set sliding_window=None (or use_sliding_window="
                         f"False for qwen2, qwen3 and smollm3) if the model does not need it")


def _rope_from_hf(hf_config, max_pos: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are unsupported; expected one rope configuration")
    if not isinstance(params, dict) or "rope_theta" not in params:
        old = getattr(hf_config, "rope_scaling", None)
        params = dict(old or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if rope_type == "llama3":
        try:
            return theta, RopeScaling(
                "llama3", float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"]),
                int(params.get("original_max_position_embeddings") or max_pos))
        except KeyError as err:
            raise ValueError(f"llama3 rope scaling is missing {err.args[0]!r}") from None
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """FloatTensor ``[head_dim // 2]`` (float32, CPU): rotary inverse frequencies with the config's scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


# ---------------------------------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------------------------------
def _as_row_starts(value, batch_size: int, device: torch.device, name: str) -> torch.Tensor | int:
    """An int, or an integer tensor ``[B]`` (0-d broadcast) on ``device``; anything else is a ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int or an integer tensor [B], got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, torch.Tensor) and not value.is_floating_point() and not value.is_complex() \
            and value.dtype != torch.bool:
        if value.dim() == 0:
            value = value.reshape(1).expand(batch_size)
        if value.shape != (batch_size,):
            raise ValueError(f"{name} tensor must have shape [B={batch_size}], got {tuple(value.shape)}")
        return value.to(device=device, dtype=torch.int64)
    raise ValueError(f"{name} must be an int or an integer tensor [B], got {value!r}")


def _check_row_range(starts, length: int, max_len: int, name: str) -> None:
    """Rows ``starts .. starts+length-1`` must lie in ``[0, max_len)``; device tensors are not checked (no sync)."""
    if isinstance(starts, int):
        lo, hi = starts, starts
    elif starts.device.type == "cpu":
        lo, hi = int(starts.min()), int(starts.max())
    else:
        return
    if lo < 0:
        raise ValueError(f"{name} must be >= 0, got {starts if isinstance(starts, int) else starts.tolist()}")
    if hi + length > max_len:
        raise ValueError(f"KV cache too short: {name} {hi} + {length} rows > max_len {max_len}")


class KVCache:
    """Preallocated keys and values of every layer.

    Attributes:
        k, v: ``[num_layers, B, S, Hkv, D]`` in the model's dtype and device; row ``s`` of sequence ``b`` holds
            the key/value of the token at cache slot ``s`` (for committed tokens, slot == position).
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device | str):
        for name, value in (("num_layers", num_layers), ("batch_size", batch_size), ("max_len", max_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCache {name} must be a positive int, got {value!r}")
        shape = (num_layers, batch_size, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._whole = (self.k, self.v)  # as allocated: remove_rows narrows k and v

    def renewed(self) -> "KVCache":
        """A cache over this one's whole storage as allocated (every batch row, whatever :meth:`remove_rows` left),
        for a later call. Its rows hold what earlier steps wrote: a step reads only its sequence's committed rows and
        the rows it writes itself, so leftovers are never read."""
        fresh = object.__new__(KVCache)
        fresh.k, fresh.v = self._whole
        fresh._whole = self._whole
        return fresh

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        """Rows per sequence (``S``)."""
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def write(self, layer: int, cache_len: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a step's keys/values ``k, v [B, T, Hkv, D]`` of ``layer`` at rows ``cache_len .. cache_len+T-1``.

        ``cache_len`` is an int (same for all sequences) or a LongTensor ``[B]``.
        """
        B, T = k.shape[0], k.shape[1]
        if k.shape != v.shape or k.shape[0] != self.batch_size or k.shape[2:] != self.k.shape[3:]:
            raise ValueError(f"k and v must both be [B={self.batch_size}, T, Hkv={self.k.shape[3]}, "
                             f"D={self.k.shape[4]}], got {tuple(k.shape)} and {tuple(v.shape)}")
        starts = _as_row_starts(cache_len, B, self.device, "cache_len")
        _check_row_range(starts, T, self.max_len, "cache_len")
        write_rows(self.k[layer], starts, k)
        write_rows(self.v[layer], starts, v)

    def compact(self, cache_len: torch.Tensor, offset: int, accept_len: torch.Tensor, path: torch.Tensor) -> None:
        """KV compaction after verification: per sequence ``b``, the rows of its accepted tree nodes,
        ``cache_len[b] + offset + path[b, j]`` for ``j < accept_len[b]``, move to ``cache_len[b] + 1 + j`` in every
        layer. Arguments on the cache's device (int64 ``[B]``, ``[B]``, ``[B, A]``), read there: on CUDA one kernel
        launch without synchronisation (:func:`lookahead_kernels.kv_compact.compact_kv`), on a CPU with the C++ ops
        loaded a row copy each (``csrc/kv_compact_cpu.cpp``; the torch reference took 0.12-0.15 ms of a SmolLM2 tree
        step), elsewhere the reference."""
        if self.k.is_cuda:
            from lookahead_kernels import compact_kv
        else:
            from lookahead_kernels.cpu_ops import cpu_ops_available

            if self.k.device.type == "cpu" and cpu_ops_available(build=False):
                compact_kv = torch.ops.lookahead_cpu.compact_kv
            else:
                from lookahead_kernels import compact_kv_reference as compact_kv
        compact_kv(self.k, self.v, cache_len, offset, accept_len, path)

    def sequence(self, b: int) -> "KVCache":
        """A cache of batch 1 sharing sequence ``b``'s storage (writes land in this cache), e.g. for a prefill."""
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < self.batch_size:
            raise ValueError(f"sequence index must be an int in [0, {self.batch_size}), got {b!r}")
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, b:b + 1], self.v[:, b:b + 1]
        view._whole = (view.k, view.v)
        return view

    def load_rows(self, source: "KVCache", rows: list[int], length: int) -> None:
        """Sequences ``0 .. len(rows) - 1`` of this cache take ``source``'s sequences ``rows``, slots ``[0, length)``
        (a padded batch moving to a runner of fewer rows); the rest is left as it is."""
        if source.k.shape[0] != self.k.shape[0] or source.k.shape[3:] != self.k.shape[3:] \
                or not 0 <= length <= min(self.max_len, source.max_len) or len(rows) > self.batch_size:
            raise ValueError(f"load_rows: {len(rows)} rows of {length} slots do not fit from a cache of shape "
                             f"{tuple(source.k.shape)} into one of {tuple(self.k.shape)}")
        # A row's copy each, as remove_rows moves rows: a gather by an index tensor built the whole [layers, rows,
        # length, ...] block as a temporary first (76 ms against 10 for 8 SmolLM2 rows of 600 slots on a CPU).
        for i, r in enumerate(rows):
            self.k[:, i, :length].copy_(source.k[:, r, :length])
            self.v[:, i, :length].copy_(source.v[:, r, :length])

    def remove_rows(self, rows: list[int]) -> list[int]:
        """Drop batch rows ``rows`` (e.g. finished sequences leaving the batch); returns, per remaining row, its
        old index. The last remaining rows move into the freed slots (one row's copy each) and the batch
        dimension is narrowed as a view, so a leaving sequence never costs a copy of the whole cache."""
        B = self.batch_size
        if any(isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < B for r in rows) \
                or len(set(rows)) != len(rows) or len(rows) >= B:
            raise ValueError(f"rows must be distinct ints in [0, {B}) leaving at least one row, got {rows!r}")
        gone = set(rows)
        n = B - len(gone)
        order = list(range(n))
        movers = [i for i in range(n, B) if i not in gone]
        for hole, mover in zip(sorted(i for i in gone if i < n), movers):
            self.k[:, hole] = self.k[:, mover]
            self.v[:, hole] = self.v[:, mover]
            order[hole] = mover
        self.k, self.v = self.k[:, :n], self.v[:, :n]
        return order


# ---------------------------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------------------------
def _layer_ops():
    """The element-wise Triton kernels (:mod:`lookahead_kernels.layer_ops`): the CUDA path; imported on first use."""
    from lookahead_kernels import layer_ops
    return layer_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            return _layer_ops().rms_norm(x, self.weight, self.eps)
        return rms_norm_reference(x, self.weight, self.eps)


AttentionFn = Callable[..., torch.Tensor]


class Attention(nn.Module):
    """GQA self-attention; q, k, v are one fused projection (one matmul per step instead of three)."""

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.rotate = layer not in config.nope_layers  # SmolLM3: no rotary embedding in some layers
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = CpuLinear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = CpuLinear(q_size, config.hidden_size, bias=config.output_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x, cos, sin, cache: KVCache, layer: int, cache_len, layout: StepLayout,
                attend: AttentionFn) -> torch.Tensor:
        B, T, _ = x.shape
        Hq, Hkv = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(B, T, Hq + 2 * Hkv, self.head_dim)
        norms = () if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        if qkv.is_cuda:  # one kernel (each q and k head's norm too)
            q = _layer_ops().rotary_cache_write(qkv, cos, sin, cache.k[layer], cache.v[layer], cache_len, Hq, Hkv,
                                                *norms, rotate=self.rotate)
        else:
            if norms:  # each head of q and k normalised (Qwen3), v as it is
                qkv = head_norms(qkv, Hq, Hkv, *norms)
            qk = qkv[:, :, :Hq + Hkv]
            if self.rotate:
                qk = apply_rotary(qk, cos, sin)  # q and k heads rotated together: one op chain
            q, k = qk.split((Hq, Hkv), dim=2)
            cache.write(layer, cache_len, k, qkv[:, :, Hq + Hkv:])
        out = attend(q, cache.k[layer], cache.v[layer], cache_len=cache_len, layout=layout)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate and up are one fused projection."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = CpuLinear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = CpuLinear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(_layer_ops().silu_mul(gate_up) if x.is_cuda else silu_mul_reference(gate_up))


class GenerationLock:
    """Held by each ``generate`` call on a model (:func:`lookahead.generate.generate`): the step runners' buffers
    are handed out one call at a time, but the prefill graphs' scratch cache and the fused stack's looked-up weights
    are the model's own, so two threads decoding on one model at once gave wrong tokens on the static step path
    (CUDA graphs' path). Calls from other threads wait; the same thread may call again (from a streamer, a stopping
    criterion or a processor), as before. Copies and pickles get a lock of their own."""

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = threading.RLock()

    def __enter__(self) -> "GenerationLock":
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def __reduce__(self):
        return GenerationLock, ()


class _PackedAnswer:
    """:meth:`DecoderLayer._packed_weights`' last answer and what it was for. Copies and pickles start empty, as
    the packed weights themselves do (:class:`~lookahead.cpu_linear.PackedWeight`)."""

    __slots__ = ("weights", "key", "packed")

    def __init__(self, weights: tuple = (), key=None, packed: tuple | None = None):
        self.weights, self.key, self.packed = weights, key, packed

    def __reduce__(self):
        return _PackedAnswer, ()


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)
        # Plain tuples (not registered submodules): reading them skips nn.Module's attribute lookup, ~2 us each.
        self._linears = (self.attn.qkv_proj, self.attn.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        self._norms = (self.attn_norm, self.mlp_norm)
        self._packed = _PackedAnswer()

    def forward(self, x, cos, sin, cache, layer, cache_len, layout, attend) -> torch.Tensor:
        # (float32 on the CPU, the model runs every layer in one C++ op instead: LlamaForCausalLM._fused_stack)
        attn = self.attn(self.attn_norm(x), cos, sin, cache, layer, cache_len, layout, attend)
        if x.is_cuda:  # the residual add and the next norm in one kernel
            x, h = _layer_ops().add_rms_norm(x, attn, self.mlp_norm.weight, self.mlp_norm.eps)
        else:
            x = x + attn
            h = self.mlp_norm(x)
        return x + self.mlp(h)

    def _packed_weights(self, x, attend) -> tuple | None:
        """The four linear layers' weights packed for our GEMM, or None where the fused C++ layer does not apply
        (another device, dtype or attention, a linear mode other than "packed", gradients, no built ops).

        Asked once per layer and step, so the answer is kept with the weights it was made for and reused while
        they are the same tensors at the same version (an in-place update or a replaced parameter repacks):
        checked in full, the question cost 31 us a layer, 0.9 ms of a 17 ms forward; this check costs ~3 us
        (measured)."""
        if not isinstance(attend, CpuStepAttention) or x.dtype != torch.float32:
            return None
        # Spelled out for the four layers (no generators): asked 30 times a step, this check is on its hot path.
        q, o, g, d = self._linears
        weights = wq, wo, wg, wd = (q._parameters["weight"], o._parameters["weight"], g._parameters["weight"],
                                    d._parameters["weight"])
        key = (wq.data_ptr(), wq._version, wo.data_ptr(), wo._version, wg.data_ptr(), wg._version, wd.data_ptr(),
               wd._version, q.mode, o.mode, g.mode, d.mode,
               torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights)))
        kept = self._packed
        if kept.key == key and kept.weights[0] is wq and kept.weights[1] is wo and kept.weights[2] is wg \
                and kept.weights[3] is wd:
            return kept.packed
        packed = []
        for lin, w in zip(self._linears, weights):
            if lin.mode != "packed" or not cpu_linear.packed_applies(x, w) \
                    or (lin.bias is not None and lin.bias.dtype != torch.float32):
                packed = None
                break
            backend, p = lin.pack.get(w)
            if backend != "gemm":
                packed = None
                break
            packed.append(p)
        packed = None if packed is None else tuple(packed)
        self._packed = _PackedAnswer(weights, key, packed)
        return packed


# ---------------------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------------------
def _cpu_ops_built() -> bool:
    """Whether the C++ CPU ops are (or can be) loaded; the first call may build them."""
    from lookahead_kernels.cpu_ops import cpu_ops_available

    return cpu_ops_available()


def _torch_attention() -> AttentionFn:
    from lookahead_kernels import attention_torch
    return attention_torch


def _kernel_attention() -> AttentionFn:
    from lookahead_kernels import lookahead_attention
    return lookahead_attention


def _cpu_attention(model, layout: StepLayout, cache_len, batch_size: int) -> AttentionFn:
    """The step's attention on the CPU: our C++ op where it applies (float32, a supported head size), else
    :class:`~lookahead_kernels.attention_ref.StepAttention` (torch's SDPA, the reference)."""
    from lookahead_kernels.cpu_attention import CpuStepAttention, cpu_attention_applies

    if cpu_attention_applies(model.device, model.dtype, model.config.head_dim):
        return CpuStepAttention(layout, cache_len, batch_size)
    from lookahead_kernels.attention_ref import StepAttention

    return StepAttention(layout, cache_len, batch_size, model.device)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM that runs one lookahead step per :meth:`forward`.

    Parameter names (ours; :mod:`lookahead.loading` maps Hugging Face names onto them):
    ``embed.weight [V, H]``; ``layers.{i}.attn_norm.weight``; ``layers.{i}.attn.qkv_proj.{weight,bias}``
    (rows: q heads, then k heads, then v heads); ``layers.{i}.attn.o_proj``; ``layers.{i}.mlp_norm.weight``;
    ``layers.{i}.attn.q_norm.weight`` and ``layers.{i}.attn.k_norm.weight`` (``[head_dim]``, with ``qk_norm``);
    ``layers.{i}.mlp.gate_up_proj`` (rows: gate, then up); ``layers.{i}.mlp.down_proj``; ``norm.weight``;
    ``lm_head.weight [V, H]`` (absent when tied to ``embed``).
    """

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype (float32, bfloat16, float16), got {dtype}")
        self.config = config
        device = torch.device(device) if device is not None else torch.device("cpu")
        with torch.device(device):
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = None if config.tie_word_embeddings else \
                CpuLinear(config.hidden_size, config.vocab_size, bias=False)
        # A tied head is the embedding matrix used as a linear layer; its packed copy lives here.
        self._tied_head_pack = PackedWeight() if config.tie_word_embeddings else None
        self._cpu_linear_mode = "packed"
        self._fixed_stack = None  # within weights_fixed(): the fused stack's arguments, looked up once
        self._generation_config = None  # made on first use (importing transformers is slow)
        self.generation_lock = GenerationLock()  # one generate call at a time (threads wait)
        self.to(dtype)
        # The inverse frequencies must stay float32 whatever dtype the model is cast to, so they are stored
        # as their int32 bit pattern: `Module.to(dtype)` moves integer buffers but never casts them. On a
        # meta device (weights assigned later by the loader) they live on the CPU until the model is moved.
        bits = rope_inv_freq(config).view(torch.int32)
        self.register_buffer("rope_inv_freq_bits", bits.to("cpu" if device.type == "meta" else device),
                             persistent=False)

    # ---- properties -------------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def generation_config(self):
        """generate's defaults, a transformers ``GenerationConfig`` as transformers' models have one: the
        checkpoint's ``generation_config.json`` where it had one (fields generate cannot honour left out, with a
        warning), else the config's BOS, EOS and pad ids. Its set fields are defaults beneath a call's
        ``generation_config`` and keywords; edit it or assign another to change them."""
        if self._generation_config is None:
            from .arguments import model_generation_config
            self._generation_config = model_generation_config(self.config)
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        from transformers import GenerationConfig
        if not isinstance(value, GenerationConfig):
            raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(value).__name__}")
        self._generation_config = value

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """The number of parameters (a tied head counted once), as transformers' ``num_parameters``."""
        skip = {id(self.embed.weight)} if exclude_embeddings else set()
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def compute_transition_scores(self, sequences, scores, beam_indices=None, normalize_logits: bool = False):
        """Each new token's score ``[B, new]`` from ``generate(..., output_scores=True)``'s output, as transformers'
        method gives it (see :func:`lookahead.scoring.transition_scores`)."""
        from .scoring import transition_scores

        return transition_scores(sequences, scores, beam_indices, normalize_logits)

    # ---- construction helpers (implemented in lookahead.loading) ------------------------------------------------
    @classmethod
    def from_hf(cls, model) -> "LlamaForCausalLM":
        """Copy a loaded transformers ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` /
        ``Qwen3ForCausalLM`` / ``SmolLM3ForCausalLM``.

        The result has the source's dtype and device.
        """
        from .loading import from_hf
        return from_hf(model)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | str | None = None, device=None,
                        gguf_file: str | None = None, *, torch_dtype=None, device_map=None,
                        **kwargs) -> "LlamaForCausalLM":
        """Load a Hugging Face directory (config.json + safetensors), a GGUF file or a Hub id; see
        :func:`lookahead.loading.from_pretrained`. transformers' ``torch_dtype``, ``dtype="auto"`` and
        ``device_map`` (one device) are taken too; any other keyword is a ``ValueError`` naming it."""
        from .loading import from_pretrained
        if kwargs:
            raise ValueError(f"from_pretrained does not take {', '.join(sorted(kwargs))}; it takes path, dtype (or "
                             f"torch_dtype), device (or device_map) and gguf_file")
        return from_pretrained(path, dtype=dtype, device=device, gguf_file=gguf_file, torch_dtype=torch_dtype,
                               device_map=device_map)

    def save_pretrained(self, directory):
        """Write the model as a Hugging Face directory (``config.json`` + ``model.safetensors``) that transformers
        and :meth:`from_pretrained` load; see :mod:`lookahead.saving`. Returns the directory's ``Path``."""
        from .saving import save_pretrained
        return save_pretrained(self, directory)

    def set_cpu_linear(self, mode: str) -> None:
        """How linear layers run on the CPU in float32: ``"packed"`` (default: our small-M GEMM on weights packed at
        first use, oneDNN where it cannot be built; see :mod:`lookahead.cpu_linear`), ``"onednn"`` (oneDNN on
        packed weights) or ``"torch"`` (plain ``F.linear``; frees the packed copies)."""
        if mode not in cpu_linear.CPU_LINEAR_MODES:
            raise ValueError(f"CPU linear mode must be one of {cpu_linear.CPU_LINEAR_MODES}, got {mode!r}")
        for module in self.modules():
            if isinstance(module, CpuLinear):
                module.set_mode(mode)
        if self._tied_head_pack is not None:
            if mode == "torch":
                self._tied_head_pack.clear()
            else:
                self._tied_head_pack.mode = mode
        self._cpu_linear_mode = mode
        if self._fixed_stack is not None:  # the packed weights looked up so far may be another mode's
            self._fixed_stack.clear()

    @property
    def cpu_linear_mode(self) -> str:
        return self._cpu_linear_mode

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty :class:`KVCache` for ``batch_size`` sequences of up to ``max_len`` rows (model dtype/device)."""
        c = self.config
        return KVCache(c.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim, dtype=self.dtype,
                       device=self.device)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, T, head_dim]`` in the model dtype for LongTensor ``positions [B, T]``.

        Computed from the positions each step (B*T*D/2 products), so no table bounds the positions. In float32 on
        the CPU by the C++ op ``lookahead_cpu::rotary_tables`` (the cosines and sines in double, rounded), which
        :meth:`forward`'s fused CPU step computes too: whichever computes a position's keys, they are the same.
        """
        inv_freq = self.rope_inv_freq_bits.view(torch.float32)
        if positions.device.type == "cpu" and self.dtype == torch.float32 and _cpu_ops_built():
            return torch.ops.lookahead_cpu.rotary_tables(positions.to(torch.int64), inv_freq)
        freqs = positions[..., None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    # ---- forward ----------------------------------------------------------------------------------------------
    def _check_inputs(self, input_ids, positions, cache, layout, logits_rows, values: bool = True) -> None:
        """ValueError unless the step's arguments fit the model; ``values=False`` leaves the token ids', positions'
        and logits rows' ranges to the caller (the fused CPU step checks them in C++)."""
        if not isinstance(layout, StepLayout):
            raise ValueError(f"layout must be a StepLayout, got {type(layout).__name__}")
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            desc = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an integer tensor [B, T], got {desc}")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must have an integer dtype (int64 or int32), got {input_ids.dtype}")
        B, T = input_ids.shape
        if T != layout.T:
            raise ValueError(f"input_ids has T={T} tokens but the layout {layout} has T={layout.T}")
        if input_ids.device != self.device:
            raise ValueError(f"input_ids is on {input_ids.device} but the model is on {self.device}")
        if not isinstance(positions, torch.Tensor) or positions.shape != (B, T) or positions.is_floating_point() \
                or positions.dtype == torch.bool:
            desc = (positions.dtype, tuple(positions.shape)) if isinstance(positions, torch.Tensor) \
                else type(positions).__name__
            raise ValueError(f"positions must be an integer tensor [B={B}, T={T}], got {desc}")
        if positions.device != input_ids.device:
            raise ValueError(f"positions is on {positions.device} but input_ids is on {input_ids.device}")
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a KVCache (see new_cache), got {type(cache).__name__}")
        if cache.batch_size != B or cache.num_layers != self.config.num_layers \
                or cache.k.shape[3:] != (self.config.num_kv_heads, self.config.head_dim):
            raise ValueError(f"cache of shape {tuple(cache.k.shape)} does not fit this model and batch; "
                             f"expected [{self.config.num_layers}, {B}, S, {self.config.num_kv_heads}, "
                             f"{self.config.head_dim}]")
        if cache.dtype != self.dtype or cache.device != self.device:
            raise ValueError(f"cache is {cache.dtype} on {cache.device} but the model is {self.dtype} on {self.device}")
        if logits_rows is not None:
            if not isinstance(logits_rows, torch.Tensor) or logits_rows.dim() != 1 \
                    or logits_rows.is_floating_point() or logits_rows.dtype == torch.bool:
                raise ValueError(f"logits_rows must be None or an integer tensor [R], got {logits_rows!r}")
            if values and logits_rows.device.type == "cpu" and logits_rows.numel() and \
                    (int(logits_rows.min()) < -T or int(logits_rows.max()) >= T):
                raise ValueError(f"logits_rows must index the step's T={T} tokens, got {logits_rows.tolist()}")
        # Value checks need the data on the host; on an accelerator they would cost a sync per step.
        if values and input_ids.device.type == "cpu":
            if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
                raise ValueError(f"input_ids must lie in [0, vocab_size={self.config.vocab_size}), got "
                                 f"min {int(input_ids.min())} max {int(input_ids.max())}")
            if positions.numel() and (int(positions.min()) < 0
                                      or int(positions.max()) >= self.config.max_position_embeddings):
                raise ValueError(f"positions must lie in [0, max_position_embeddings="
                                 f"{self.config.max_position_embeddings}), got min {int(positions.min())} "
                                 f"max {int(positions.max())}")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, cache: KVCache | None = None,
                cache_len: int | torch.Tensor | None = None, layout: StepLayout | None = None,
                logits_rows: torch.Tensor | None = None, *, attention: AttentionFn | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                use_cache: bool | None = None, return_dict: bool | None = None):
        """Run one step and return its logits; or, called as transformers' model is, score whole sequences.

        ``model(input_ids[, attention_mask=..., labels=...])`` (no positions, cache, cache_len, layout or
        logits_rows) returns a :class:`~lookahead.scoring.CausalLMOutput` with ``.logits [B, L, vocab_size]`` and
        ``.loss``: see :func:`lookahead.scoring.score`. ``return_dict=False`` gives its tuple (``(loss, logits)``
        or ``(logits,)``) instead; ``use_cache`` is accepted and changes nothing (no ``past_key_values`` are
        returned: continue a sequence with :meth:`generate`). Otherwise it is one decoding step:

        Args:
            input_ids: LongTensor ``[B, T]``, the step's tokens in ``layout`` order (``T == layout.T``).
            positions: LongTensor ``[B, T]``, each token's absolute position (rotary embedding only; the
                tree structure comes from ``layout``), e.g. ``p + layout.position_offsets()``.
            cache: the :class:`KVCache` from :meth:`new_cache`; this step's keys/values are written to rows
                ``cache_len .. cache_len+T-1`` of every layer.
            cache_len: int or LongTensor ``[B]``: committed rows per sequence (all visible to every token).
            layout: the step's :class:`StepLayout`.
            logits_rows: optional LongTensor ``[R]`` of step indices; only those rows get the final norm and
                vocabulary projection.
            attention: optional attention function with :func:`lookahead_kernels.attention_torch`'s signature;
                default: the Triton kernel ``lookahead_attention`` on CUDA; on the CPU our C++ step attention in
                float32 (:mod:`lookahead_kernels.cpu_attention`), ``attention_torch`` otherwise.
        Returns:
            FloatTensor ``[B, R or T, vocab_size]`` (float32).
        """
        step_args = {"positions": positions, "cache": cache, "cache_len": cache_len, "layout": layout}
        if all(v is None for v in step_args.values()) and logits_rows is None and attention is None:
            for name, value in (("use_cache", use_cache), ("return_dict", return_dict)):
                if value is not None and not isinstance(value, bool):
                    raise ValueError(f"{name} must be a bool or None, got {value!r}")
            out = score(self, input_ids, attention_mask=attention_mask, labels=labels)
            return out.to_tuple() if return_dict is False else out
        given = [name for name, value in (("attention_mask", attention_mask), ("labels", labels),
                                          ("use_cache", use_cache), ("return_dict", return_dict)) if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with transformers' call "
                             f"model(input_ids, attention_mask=..., labels=...), not with a decoding step's "
                             f"positions, cache and layout")
        missing = [name for name, v in step_args.items() if v is None]
        if missing:
            raise ValueError(f"a decoding step needs positions, cache, cache_len and layout; missing {missing} "
                             f"(or call model(input_ids) alone to score whole sequences)")
        if attention is None and input_ids.device.type == "cpu" and self.dtype == torch.float32:
            logits = self._fused_step(input_ids, positions, cache, cache_len, layout, logits_rows)
            if logits is not None:
                return logits
        return self.logits(self.hidden(input_ids, positions, cache, cache_len, layout, logits_rows,
                                       attention=attention))

    def _fused_step(self, input_ids, positions, cache, cache_len, layout, logits_rows) -> torch.Tensor | None:
        """:meth:`forward`'s logits in one C++ op, ``lookahead_cpu::forward_step`` (float32 on the CPU, every layer
        fused, the head packed for our GEMM): the embedding, rotary tables, decoder stack, final norm and
        vocabulary projection; None where it does not apply (then the step runs as :meth:`hidden` and
        :meth:`logits`). Why: after a step has streamed the weights through the caches, each torch op called from
        Python costs 15-150 us instead of 2-20 (session 33); the ~20 between the two large ops cost a SmolLM2 step
        2-5% (session 35)."""
        from lookahead_kernels.cpu_attention import cpu_attention_applies

        # First what does not depend on the step (contiguous embedding rows, our attention, a packed head): where the
        # op does not apply, the split path then checks the step once, not twice.
        if self.embed.weight.stride(-1) != 1 \
                or not cpu_attention_applies(self.device, self.dtype, self.config.head_dim):
            return None
        head = self._packed_head()
        if head is None:
            return None
        self._check_inputs(input_ids, positions, cache, layout, logits_rows, values=False)
        starts = _as_row_starts(cache_len, input_ids.shape[0], input_ids.device, "cache_len")
        _check_row_range(starts, layout.T, cache.max_len, "cache_len")
        attend = CpuStepAttention(layout, starts, input_ids.shape[0])  # it applies (above)
        # The embedding's output has the embedding weight's dtype, device and need of gradients.
        stack = self._fused_stack(self.embed.weight, attend)
        if stack is None:
            return None
        return forward_step_cpu(input_ids, positions, self.config.max_position_embeddings,
                                self.rope_inv_freq_bits.view(torch.float32), self.embed.weight, cache.k, cache.v,
                                attend, stack, self.norm.weight, self.norm.eps, head, logits_rows)

    def _packed_head(self) -> torch.Tensor | None:
        """The vocabulary projection's weight packed for our GEMM, or None where :meth:`logits` takes another path
        (the "torch" or oneDNN linear mode, gradients)."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if not cpu_linear.packed_applies(self.norm.weight, weight):
            return None
        if self.lm_head is None:
            pack = self._tied_head_pack if self._cpu_linear_mode != "torch" else None
        else:
            pack = self.lm_head.pack if self.lm_head.mode != "torch" and self.lm_head.bias is None else None
        if pack is None:
            return None
        backend, packed = pack.get(weight)
        return packed if backend == "gemm" else None

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               cache_len: int | torch.Tensor, layout: StepLayout, logits_rows: torch.Tensor | None = None,
               *, attention: AttentionFn | None = None) -> torch.Tensor:
        """:meth:`forward` up to the final norm: the last layer's output ``[B, R or T, hidden_size]`` (model
        dtype), whose :meth:`logits` are :meth:`forward`'s. Kept where the projection may never be needed."""
        self._check_inputs(input_ids, positions, cache, layout, logits_rows)
        cache_len = _as_row_starts(cache_len, input_ids.shape[0], input_ids.device, "cache_len")
        _check_row_range(cache_len, layout.T, cache.max_len, "cache_len")
        if attention is None:
            if input_ids.device.type == "cuda":
                attention = _kernel_attention()
            else:  # the C++ step attention in float32, else attention_torch; either built once for all layers
                attention = _cpu_attention(self, layout, cache_len, input_ids.shape[0])
        x = self.embed(input_ids)
        cos, sin = self.rotary(positions)
        stack = self._fused_stack(x, attention)
        if stack is not None:  # float32 on the CPU: every layer in one C++ op
            x = decoder_stack_cpu(x, cos, sin, cache.k, cache.v, attention, **stack)
        else:
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, cache, i, cache_len, layout, attention)
        return x if logits_rows is None else x[:, logits_rows]

    @contextlib.contextmanager
    def weights_fixed(self):
        """Within this context the weights are taken as fixed: the CPU forward looks its packed weights up once
        and reuses them, where it otherwise checks every layer's weights each step for a replaced or updated one
        (0.5 ms of a 16 ms SmolLM2 step here). :meth:`generate` runs its steps within it; a weight changed in
        place or replaced inside it goes unseen until it ends."""
        outer = self._fixed_stack
        self._fixed_stack = {}
        try:
            yield self
        finally:
            self._fixed_stack = outer

    def _fused_stack(self, x, attend) -> dict | None:
        """:func:`decoder_stack_cpu`'s per-layer arguments, or None where a layer's fused op does not apply (see
        :meth:`DecoderLayer._packed_weights`): then every layer runs in Python. Norm weights and biases are read
        afresh each step (a replaced one is used at once); they are not packed. Within :meth:`weights_fixed`,
        looked up once for each kind of input."""
        fixed = self._fixed_stack
        if fixed is None:
            return self._lookup_stack(x, attend)
        key = (isinstance(attend, CpuStepAttention), x.dtype, x.device,
               torch.is_grad_enabled() and x.requires_grad)
        if key not in fixed:
            fixed[key] = self._lookup_stack(x, attend)
        return fixed[key]

    def _lookup_stack(self, x, attend) -> dict | None:
        layers = []
        for layer in self.layers:
            packed = layer._packed_weights(x, attend)
            if packed is None:
                return None
            layers.append((layer, packed))
        first = self.layers[0]
        names = ("qkv", "o", "gate_up", "down")
        stack = dict(num_heads=first.attn.num_heads, num_kv_heads=first.attn.num_kv_heads,
                     intermediate_size=first.mlp.intermediate_size, eps=first.attn_norm.eps,
                     attn_norm=[layer._norms[0]._parameters["weight"] for layer, _ in layers],
                     mlp_norm=[layer._norms[1]._parameters["weight"] for layer, _ in layers],
                     q_norm=[None if layer.attn.q_norm is None else layer.attn.q_norm._parameters["weight"]
                             for layer, _ in layers],
                     k_norm=[None if layer.attn.k_norm is None else layer.attn.k_norm._parameters["weight"]
                             for layer, _ in layers],
                     nope_layers=list(self.config.nope_layers))
        for i, name in enumerate(names):
            stack[name] = [packed[i] for _, packed in layers]
            stack[name + "_bias"] = [layer._linears[i]._parameters["bias"] for layer, _ in layers]
        return stack

    def prepare_cpu_weights(self) -> None:
        """Pack the linear layers' weights for the CPU forward now rather than in the first forward (0.6-0.8 s for
        SmolLM2 on a 2-core CPU): ``generate`` calls it before its clock starts, so ``stats.seconds`` leaves the
        packing out. Each weight is packed once and kept while it is the same tensor at the same version; a no-op
        off the CPU, outside float32 and in the ``"torch"`` linear mode."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or self._cpu_linear_mode == "torch":
            return
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, CpuLinear) and module.mode != "torch":
                    module.pack.get(module.weight)
            if self._tied_head_pack is not None:
                self._tied_head_pack.get(self.embed.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and vocabulary projection of :meth:`hidden`'s rows ``[..., hidden_size]``: float32
        ``[..., vocab_size]``."""
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden)).float()
        pack = self._tied_head_pack if self._cpu_linear_mode != "torch" else None
        return cpu_linear.linear(self.norm(hidden), self.embed.weight, None, pack).float()

    def generate(self, input_ids=None, max_new_tokens: int | None = None, **kwargs):
        """Decode with lookahead decoding (automatic step size unless ``lookahead=`` says otherwise; ``None``:
        plain decoding); see :func:`lookahead.generate.generate`. Returns a
        :class:`~lookahead.outputs.GenerateOutput`: the token ids ``[B, L + new]`` as transformers returns them,
        with ``.stats`` (and ``.scores``/``.logits`` when asked)."""
        from .generate import generate
        return generate(self, input_ids, max_new_tokens=max_new_tokens, **kwargs)
