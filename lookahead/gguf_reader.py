"""A GGUF file read directly: its metadata, its tensors dequantised, and the Llama / Qwen2 / Qwen3 model they
describe.

transformers' GGUF loader took ~26 s for SmolLM2-135M on this project's 2-core CPU, nearly all of it outside
the dequantisation: parsing every metadata field (the tokenizer's 100k strings) into numpy views, twice, and
building a name map per tensor. Here the metadata is read in one pass that skips over string arrays, and each
tensor is dequantised by the ``gguf`` package's own ``dequantize`` (the function transformers calls), so the
weights are the very floats transformers gives, bit for bit (``tests/test_gguf_reader.py`` checks that).

The file layout (llama.cpp's ``gguf`` format, versions 2 and 3, little-endian): a header (magic, version, tensor
and key counts), the key-value metadata, the tensor infos (name, dims with the fastest first, ggml type, offset),
then the tensor data from the first multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import struct
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .model import ModelConfig, RopeScaling, rope_inv_freq

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Per-layer tensor names in llama.cpp's convention and the Hugging Face names they stand for.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms of q and k
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


@dataclasses.dataclass(frozen=True)
class StringArray:
    """A metadata array of strings (the tokenizer's vocabulary, its merges), skipped over: only its length."""

    length: int


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: the fastest-varying dimension last
    ggml_type: int
    offset: int  # from the start of the file
    nbytes: int


@dataclasses.dataclass
class GGUFFile:
    path: Path
    metadata: dict
    tensors: dict[str, TensorInfo]
    _bytes: np.ndarray | None = dataclasses.field(default=None, repr=False)

    def array(self, info: TensorInfo) -> np.ndarray:
        """The tensor dequantised to float32, in numpy order (a fresh array)."""
        from gguf import GGMLQuantizationType, dequantize

        if self._bytes is None:  # a plain ndarray over the mapping: memmap's subclass costs 0.4 s in gguf's splits
            self._bytes = np.memmap(self.path, dtype=np.uint8, mode="r").view(np.ndarray)
        raw = self._bytes[info.offset:info.offset + info.nbytes]
        rows = raw.reshape(*info.shape[:-1], -1) if len(info.shape) > 1 else raw
        out = dequantize(rows, GGMLQuantizationType(info.ggml_type))
        return np.require(out, np.float32, ["C", "W", "O"])  # copies only a view of the file (F32 tensors)


class _Cursor:
    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.pos)
        except struct.error:
            raise ValueError(f"{self.path} ends early (truncated GGUF?)") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise ValueError(f"{self.path} ends early (truncated GGUF?)")
        raw = bytes(self.data[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if item == _STRING:
                for _ in range(count):  # skipped: 100k strings cost ~0.05 s this way
                    n = self.take("<Q")  # (not `self.pos += self.take(...)`: that loses take's own advance)
                    self.pos += n
                return StringArray(count)
            if item not in _NUMPY:
                raise ValueError(f"{self.path}: unsupported metadata array type {item}")
            dtype = np.dtype(_NUMPY[item])
            end = self.pos + count * dtype.itemsize
            if end > len(self.data):
                raise ValueError(f"{self.path} ends early (truncated GGUF?)")
            values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos).tolist()
            self.pos = end
            return [bool(v) for v in values] if item == 7 else values
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: unsupported metadata value type {kind}")
        return self.take(_SCALARS[kind])


def read_gguf(path) -> GGUFFile:
    """Parse a GGUF file's metadata and tensor infos (the data stays on disk). ``ValueError`` on anything that is
    not a little-endian GGUF of version 2 or 3, or that ends early."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        if len(head) < 24:
            raise ValueError(f"{path} is not a GGUF file ({len(head)} bytes, shorter than a GGUF header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(path, data)


def _parse(path: Path, data: mmap.mmap) -> GGUFFile:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    size = len(data)
    cur = _Cursor(data, path)
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is unsupported (2 or 3, little-endian)")
    n_tensors, n_keys = cur.take("<Q"), cur.take("<Q")
    metadata = {}
    for _ in range(n_keys):
        key = cur.string()
        metadata[key] = cur.value(cur.take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.take("<Q") for _ in range(cur.take("<I"))]
        ggml_type, offset = cur.take("<I"), cur.take("<Q")
        infos.append((name, dims, ggml_type, offset))
    alignment = metadata.get("general.alignment", 32)
    start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, ggml_type, offset in infos:
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has ggml type {ggml_type}, unknown to the gguf package") from None
        if not dims or dims[0] % block:
            raise ValueError(f"{path}: tensor {name} has dims {dims}, not whole blocks of {block}")
        nbytes = int(np.prod(dims[1:], dtype=np.int64)) * (dims[0] // block) * block_bytes
        if start + offset + nbytes > size:
            raise ValueError(f"{path} ends early: tensor {name} lies beyond its end (truncated GGUF?)")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, start + offset, nbytes)
    return GGUFFile(path, metadata, tensors)


def _reverse_rotary_permutation(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows (weights or bias) from the halves layout of Hugging
    Face's rotary to interleaved pairs; this puts them back."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model_config(gguf: GGUFFile) -> ModelConfig:
    """Our :class:`ModelConfig` from a GGUF's metadata. ``ValueError`` for an architecture other than
    ``llama`` (which covers Llama 2/3 and Mistral files), ``qwen2`` or ``qwen3``, for rope scaling other than
    linear or Llama 3's (:func:`llama3_scaling`), or missing keys."""
    meta, names = gguf.metadata, gguf.tensors
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gguf.path.name}: GGUF architecture {arch!r} is unsupported; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"{gguf.path.name}: the GGUF metadata lacks {arch}.{name}")
        return value

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"{gguf.path.name}: rope scaling in a GGUF ({scaling}) is unsupported (supported: linear, "
                         f"and Llama 3's per-frequency factors); load the model's Hugging Face directory instead")
    if scaling == "linear" and "rope_freqs.weight" in names:
        raise ValueError(f"{gguf.path.name}: a GGUF with both linear rope scaling and rope_freqs is unsupported")
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = meta.get(f"{arch}.rope.dimension_count") if arch == "llama" else None
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = tokens.length if isinstance(tokens, StringArray) else names["token_embd.weight"].shape[0]

    def has(suffix: str) -> bool:
        return any(n.startswith("blk.") and n.endswith(suffix) for n in names)

    eos = meta.get("tokenizer.ggml.eos_token_id")
    if arch == "qwen2":
        attention_bias, output_bias, mlp_bias = True, False, False
    else:  # Llama's (and Qwen3's) attention_bias puts a bias on q, k, v and o alike
        attention_bias = output_bias = has(".attn_q.bias")
        mlp_bias = has(".ffn_up.bias")
    config = ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")), num_heads=heads, num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(head_dim or hidden // heads), rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(key("rope.freq_base", 10000.0)), max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in names, attention_bias=attention_bias, output_bias=output_bias,
        mlp_bias=mlp_bias, qk_norm=arch == "qwen3", bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=() if eos is None else (int(eos),), pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
        rope_scaling=RopeScaling("linear", float(key("rope.scaling.factor"))) if scaling == "linear" else None)
    if "rope_freqs.weight" in names:
        factors = gguf.array(names["rope_freqs.weight"]).astype(np.float64).reshape(-1)
        config = dataclasses.replace(config, rope_scaling=llama3_scaling(factors, config, gguf.path.name))
    return config


def llama3_scaling(factors: np.ndarray, config: ModelConfig, name: str) -> RopeScaling | None:
    """The Llama 3 rope scaling whose per-frequency factors a GGUF stores as ``rope_freqs.weight``.

    llama.cpp keeps Llama 3.1-3.3's scaling as one factor a frequency (each inverse frequency divided by it) and
    drops the four numbers it came from; transformers' GGUF loader ignores the tensor. The numbers come back from
    the factors: the shortest wavelengths keep factor 1, the longest take ``factor``, and between them ``1 /
    factor_i`` blends linearly in ``1 / wavelength``, a line whose slope and intercept give the band's edges
    (``original_max_position_embeddings / high_freq_factor`` and ``/ low_freq_factor``). Only those edges act,
    so ``low_freq_factor`` is taken as 1 (every Llama 3's). ``ValueError`` where the factors are not such a curve
    (checked by recomputing them), or where fewer than two lie between the bands (the edges not determined).

    Args:
        factors: float64 ``[head_dim // 2]``, lowest wavelength first, as the GGUF stores them.
        config: the model's config without scaling (``rope_theta``, ``head_dim``).
        name: the file's name, for the messages."""
    if factors.shape != (config.head_dim // 2,) or not np.all(np.isfinite(factors)) or factors.min() < 1 - 1e-6:
        raise ValueError(f"{name}: rope_freqs.weight must hold head_dim / 2 = {config.head_dim // 2} finite factors "
                         f"of at least 1, got shape {tuple(factors.shape)}")
    if factors.max() <= 1 + 1e-6:
        return None  # every factor 1: no scaling
    base = rope_inv_freq(config).double().numpy()
    factor = float(factors.max())
    between = (factors > 1 + 1e-5) & (factors < factor * (1 - 1e-5))
    if between.sum() < 2:
        raise ValueError(f"{name}: rope_freqs.weight has {int(between.sum())} factors between 1 and {factor:g}; "
                         f"Llama 3's scaling needs two to be read back")
    smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)  # 1 at the short edge, 0 at the long one
    slope, intercept = np.polyfit(base[between] / (2 * math.pi), smooth, 1)
    # smooth = (L / wavelength - low) / (high - low) with low = 1: intercept = -1 / (high - 1), slope = L / (high - 1)
    high, original = 1 - 1 / intercept, -slope / intercept
    for candidate in ((round(high, 4), round(original)), (high, original)):
        scaling = RopeScaling("llama3", factor, 1.0, float(candidate[0]), int(round(candidate[1])))
        scaled = rope_inv_freq(dataclasses.replace(config, rope_scaling=scaling)).double().numpy()
        if np.max(np.abs(scaled * factors / base - 1)) < 1e-5:
            return scaling
    raise ValueError(f"{name}: rope_freqs.weight is not Llama 3's rope scaling (factor {factor:g}); other "
                     f"per-frequency factors are unsupported")


def hf_name(name: str) -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name (``ValueError`` for one we do not know)."""
    stem, _, kind = name.rpartition(".")
    if kind in ("weight", "bias"):
        if stem in _GLOBAL_TENSORS:
            prefix = "" if stem == "output" else "model."
            return f"{prefix}{_GLOBAL_TENSORS[stem]}.{kind}"
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
            return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} is not part of a Llama / Qwen2 / Qwen3 decoder")


def hf_tensors(gguf: GGUFFile, config: ModelConfig) -> tuple[list[str], Callable[[str], torch.Tensor]]:
    """``(names, get)``: every tensor's Hugging Face name, and a function that dequantises one (float32, CPU),
    with llama's q/k rotary permutation undone, as :func:`lookahead.loading.convert_hf_state_dict` takes them."""
    # rope_freqs.weight is the config's rope scaling (model_config), not a parameter.
    by_hf = {hf_name(n): info for n, info in gguf.tensors.items() if n != "rope_freqs.weight"}
    permute = gguf.metadata.get("general.architecture") == "llama"

    def get(name: str) -> torch.Tensor:
        info = by_hf[name]
        w = gguf.array(info)
        if permute and ".self_attn.q_proj." in name:
            w = _reverse_rotary_permutation(w, config.num_heads)
        elif permute and ".self_attn.k_proj." in name:
            w = _reverse_rotary_permutation(w, config.num_kv_heads)
        return torch.from_numpy(np.ascontiguousarray(w))

    return list(by_hf), get
