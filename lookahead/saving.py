"""Our model written as a Hugging Face directory: ``model.save_pretrained(path)``.

The directory holds ``config.json`` (transformers' ``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config`` or
``SmolLM3Config``) and ``model.safetensors`` under transformers' parameter names (the fused q/k/v and gate/up
projections split back), in the model's dtype. transformers' ``AutoModelForCausalLM.from_pretrained`` and our
:func:`lookahead.loading.from_pretrained` both load it: so a GGUF, once loaded here, can be kept as a directory
that every tool reads. The tokenizer is the caller's to save (``tokenizer.save_pretrained(path)``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .loading import _LAYER_FUSED, _LAYER_RENAMES
from .model import LlamaForCausalLM, ModelConfig

WEIGHTS_NAME = "model.safetensors"


def _model_type(config: ModelConfig) -> str:
    """The transformers model type whose config says what ours does (Mistral without a window is Llama)."""
    if config.nope_layers:
        if not config.qk_norm and config.attention_bias == config.output_bias:
            return "smollm3"  # layers without rotary embedding: only SmolLM3's config says that
        raise ValueError(f"no transformers config describes this model: layers without rotary embedding with "
                         f"qk_norm={config.qk_norm}, attention_bias={config.attention_bias}, output_bias="
                         f"{config.output_bias}")
    if config.qk_norm:
        if config.attention_bias == config.output_bias and not config.mlp_bias:
            return "qwen3"  # per-head norms of q and k: only Qwen3's config says that
        raise ValueError(f"no transformers config describes this model: norms of q and k with attention_bias="
                         f"{config.attention_bias}, output_bias={config.output_bias}, mlp_bias={config.mlp_bias}")
    if config.attention_bias and not config.output_bias and not config.mlp_bias:
        return "qwen2"  # q/k/v biases without an o bias: only Qwen2's config says that
    if config.attention_bias == config.output_bias:
        return "llama"  # Llama's attention_bias puts a bias on q, k, v and o alike
    raise ValueError(f"no transformers config describes this model's biases (attention_bias="
                     f"{config.attention_bias}, output_bias={config.output_bias}, mlp_bias={config.mlp_bias})")


def _rope_parameters(config: ModelConfig) -> dict:
    params = {"rope_type": "default", "rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    if scaling is not None:
        params.update(rope_type=scaling.rope_type, factor=scaling.factor)
        if scaling.rope_type == "llama3":
            params.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                          original_max_position_embeddings=scaling.original_max_position_embeddings)
    return params


def hf_config(config: ModelConfig, dtype: torch.dtype = torch.float32):
    """transformers' config (``LlamaConfig``, ``Qwen2Config``, ``Qwen3Config`` or ``SmolLM3Config``) of a model with
    ``config``;
    ``ValueError`` where none describes it."""
    import transformers

    model_type = _model_type(config)
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, hidden_act="silu",
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, rope_parameters=_rope_parameters(config),
        bos_token_id=config.bos_token_id, eos_token_id=config.hf_eos_token_id,
        pad_token_id=config.pad_token_id, dtype=dtype,
    )
    if model_type == "qwen2":
        hf = transformers.Qwen2Config(use_sliding_window=False, sliding_window=None, **fields)
    elif model_type == "qwen3":
        hf = transformers.Qwen3Config(attention_bias=config.attention_bias, use_sliding_window=False,
                                      sliding_window=None, **fields)
    elif model_type == "smollm3":
        hf = transformers.SmolLM3Config(
            attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, use_sliding_window=False,
            sliding_window=None, no_rope_layers=[int(i not in config.nope_layers) for i in range(config.num_layers)],
            **fields)
    else:
        hf = transformers.LlamaConfig(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias, **fields)
    names = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM"}
    hf.architectures = [names.get(model_type, "LlamaForCausalLM")]
    return hf


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters under transformers' names, on the CPU, contiguous, sharing no storage."""
    config = model.config
    ours = {name: p.detach() for name, p in model.state_dict().items()}
    out = {"model.embed_tokens.weight": ours["embed.weight"], "model.norm.weight": ours["norm.weight"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = ours["lm_head.weight"]
    kv = config.num_kv_heads * config.head_dim
    sizes = {"attn.qkv_proj": [config.num_heads * config.head_dim, kv, kv],
             "mlp.gate_up_proj": [config.intermediate_size, config.intermediate_size]}
    for i in range(config.num_layers):
        pre = f"layers.{i}."
        for hf_name, our_name in _LAYER_RENAMES.items():
            if pre + our_name in ours:
                out[f"model.{pre}{hf_name}"] = ours[pre + our_name]
        for our_name, parts in _LAYER_FUSED.items():
            for kind in ("weight", "bias"):
                fused = ours.get(f"{pre}{our_name}.{kind}")
                if fused is None:
                    continue
                for part, piece in zip(parts, torch.split(fused, sizes[our_name], dim=0)):
                    out[f"model.{pre}{part}.{kind}"] = piece
    return {name: t.to("cpu", copy=True, memory_format=torch.contiguous_format) for name, t in out.items()}


def save_pretrained(model: LlamaForCausalLM, directory) -> Path:
    """Write ``config.json``, ``generation_config.json`` (``model.generation_config``) and ``model.safetensors``
    into ``directory`` (made if missing; files of those names replaced). Returns the directory."""
    from safetensors.torch import save_file

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"save_pretrained takes a lookahead LlamaForCausalLM, got {type(model).__name__}")
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"save_pretrained: {directory} exists and is not a directory")
    if model.device.type == "meta":
        raise ValueError("save_pretrained: the model's weights are on the meta device (not loaded)")
    config = hf_config(model.config, model.dtype)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{WEIGHTS_NAME}.{os.getpid()}.tmp"
    save_file(hf_state_dict(model), str(tmp), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # as a file opened for writing would be, not the temporary's 0600
    os.replace(tmp, directory / WEIGHTS_NAME)  # a reader never sees half a file
    config.save_pretrained(str(directory))
    model.generation_config.save_pretrained(str(directory))  # generation_config.json, as transformers writes it
    return directory


__all__ = ["hf_config", "hf_state_dict", "save_pretrained", "WEIGHTS_NAME"]
