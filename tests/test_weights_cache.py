"""lookahead.weights_cache through the device trees' prior: kept on disk for the next load of the same file (a GGUF
by its bytes, a Hugging Face directory by its files), per dtype and ``k``; nothing kept for weights of no file or
changed since they were read; an unusable entry computed again."""

import os
import warnings

import pytest
import torch

from lookahead import device_tree, loading
from lookahead.device_tree import token_prior
from lookahead.loading import from_hf, from_pretrained

from .test_generate import tiny_hf_model
from .test_loading_cache import write_tiny_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory, and ``cache.computed``: the priors computed (not read)."""
    directory = tmp_path / "cache"
    monkeypatch.setenv(loading.CACHE_DIR_ENV, str(directory))
    computed = []
    tops = device_tree.prior_tops

    def counting(model, context, k, tokens=None, progress=False):
        computed.append(k)
        return tops(model, context, k, tokens, progress)

    monkeypatch.setattr(device_tree, "prior_tops", counting)
    return directory, computed


def kept(directory):
    return sorted(directory.glob("prior-*.safetensors")) if directory.is_dir() else []


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    pytest.importorskip("gguf")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_prior_is_kept_for_the_next_load_of_the_same_gguf(gguf_file, cache):
    directory, computed = cache
    model = from_pretrained(gguf_file)
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4)  # decoding leaves the weights as read
    prior = token_prior(model, 4)
    assert computed == [4] and len(kept(directory)) == 1
    again = from_pretrained(gguf_file)  # as another process loads it
    assert torch.equal(token_prior(again, 4), prior) and computed == [4]
    token_prior(again, 3)  # another k: its own entry
    token_prior(from_pretrained(gguf_file, dtype=torch.bfloat16), 4)  # another dtype: its own entry
    assert computed == [4, 3, 4] and len(kept(directory)) == 3


def test_nothing_is_kept_for_weights_changed_or_of_no_file(gguf_file, cache):
    directory, computed = cache
    model = from_pretrained(gguf_file)
    with torch.no_grad():
        model.embed.weight.mul_(2)  # changed in place after the load
    token_prior(model, 4)
    token_prior(from_hf(tiny_hf_model()), 4)  # copied from transformers: read from no file
    token_prior(from_pretrained(gguf_file, cache=False), 4)  # not hashed: no key
    assert computed == [4, 4, 4] and kept(directory) == []


@pytest.mark.parametrize("damage", ["garbage", "another key", "out of range"])
def test_an_unusable_entry_is_computed_again(gguf_file, cache, damage):
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory, computed = cache
    prior = token_prior(from_pretrained(gguf_file), 4)
    (entry,) = kept(directory)
    with safe_open(str(entry), framework="pt") as f:
        key = f.metadata()["key"]
    if damage == "garbage":
        entry.write_bytes(b"not a safetensors file")
    else:
        value = prior.clone() if damage == "another key" else torch.full_like(prior, 10 ** 6)
        save_file({"value": value}, str(entry), metadata={"key": key + " " if damage == "another key" else key})
    with pytest.warns(RuntimeWarning, match="unusable"):
        again = token_prior(from_pretrained(gguf_file), 4)
    assert torch.equal(again, prior) and computed == [4, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # written again, and read back cleanly
        assert torch.equal(token_prior(from_pretrained(gguf_file), 4), prior) and computed == [4, 4]


def test_a_directory_is_keyed_by_its_files(tmp_path, cache):
    directory, computed = cache
    checkpoint = tmp_path / "tiny"
    tiny_hf_model().save_pretrained(checkpoint, safe_serialization=True)
    prior = token_prior(from_pretrained(checkpoint), 4)
    assert torch.equal(token_prior(from_pretrained(checkpoint), 4), prior) and computed == [4]
    (weights,) = checkpoint.glob("*.safetensors")
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))  # rewritten, as far as its time says
    token_prior(from_pretrained(checkpoint), 4)
    assert computed == [4, 4] and len(kept(directory)) == 2


def test_a_failed_write_is_said_and_the_prior_still_given(gguf_file, cache, monkeypatch):
    directory, computed = cache
    model = from_pretrained(gguf_file)
    directory.rename(directory.with_name("moved"))
    directory.write_text("a file where the cache directory should be")
    with pytest.warns(RuntimeWarning, match="could not keep"):
        prior = token_prior(model, 4)
    assert computed == [4] and prior.shape == (model.config.vocab_size, 4)
