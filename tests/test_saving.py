"""``model.save_pretrained``: the directory it writes loads in transformers and in our ``from_pretrained`` with every
parameter bit for bit the same, for every tiny config and for SmolLM2 read from its GGUF."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers

from lookahead import LlamaForCausalLM, ModelConfig
from lookahead.loading import load_default

from .test_model import HF_CONFIGS, SMOL_PROMPT, TOL, hf_logits, random_hf_model, rel_err, smollm2


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_a_saved_model_loads_the_same_in_transformers_and_here(tmp_path, name):
    source = random_hf_model(HF_CONFIGS[name]())
    ours = LlamaForCausalLM.from_hf(source)
    assert ours.save_pretrained(tmp_path / "saved") == tmp_path / "saved"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"))
    want, got = source.state_dict(), theirs.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    back = LlamaForCausalLM.from_pretrained(tmp_path / "saved")
    assert back.config == ours.config
    mine = ours.state_dict()
    for key, value in back.state_dict().items():
        assert torch.equal(value, mine[key]), key


def test_a_bfloat16_model_saves_as_bfloat16(tmp_path):
    ours = LlamaForCausalLM.from_hf(random_hf_model(HF_CONFIGS["llama-gqa-tied"]())).to(torch.bfloat16)
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    back = LlamaForCausalLM.from_pretrained(tmp_path, dtype="auto")  # the checkpoint's dtype
    assert back.dtype == torch.bfloat16 and torch.equal(back.embed.weight, ours.embed.weight)
    fast = LlamaForCausalLM.from_pretrained(tmp_path)  # unset, on a CPU: float32, the same numbers widened
    assert fast.dtype == torch.float32 and torch.equal(fast.embed.weight, ours.embed.weight.float())
    ours.save_pretrained(tmp_path)  # a second save replaces the files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]


def test_what_cannot_be_saved_is_a_value_error(tmp_path):
    odd = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, attention_bias=True, output_bias=False, mlp_bias=True)
    with pytest.raises(ValueError, match="no transformers config"):
        LlamaForCausalLM(odd).save_pretrained(tmp_path / "odd")
    normed = dataclasses.replace(odd, output_bias=True, qk_norm=True)  # Qwen3's norms with an MLP bias
    with pytest.raises(ValueError, match="no transformers config describes this model: norms of q and k"):
        LlamaForCausalLM(normed).save_pretrained(tmp_path / "normed")
    both = dataclasses.replace(normed, mlp_bias=False, nope_layers=(0,))  # Qwen3's norms and SmolLM3's layers
    with pytest.raises(ValueError, match="no transformers config describes this model: layers without rotary"):
        LlamaForCausalLM(both).save_pretrained(tmp_path / "both")
    (tmp_path / "file").write_text("")
    tiny = LlamaForCausalLM.from_hf(random_hf_model(HF_CONFIGS["llama-mha"]()))
    with pytest.raises(ValueError, match="not a directory"):
        tiny.save_pretrained(tmp_path / "file")


@smollm2
def test_smollm2_from_its_gguf_saved_is_the_same_model_in_transformers(tmp_path, smollm2_transformers):
    model, _ = load_default()
    model.save_pretrained(tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert rel_err(hf_logits(theirs, SMOL_PROMPT), hf_logits(smollm2_transformers, SMOL_PROMPT)) < TOL
    want = smollm2_transformers.state_dict()
    for key, value in theirs.state_dict().items():
        assert torch.equal(value, want[key]), key
