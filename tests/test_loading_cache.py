"""Start-up: the GGUF cache (converted weights and tokenizer in the user's cache directory, on a tiny GGUF written
here) and the pool extension's build message."""

import os
import warnings
from pathlib import Path

import pytest
import torch

from lookahead import loading
from lookahead.loading import cache_dir, file_sha256, from_pretrained, load_tokenizer

VOCAB = 64


def write_tiny_gguf(path, seed=0, hidden=32, inter=64, layers=2, heads=4, kv=2, arch="llama", head=True,
                    types=None, rope_freqs=None):
    """A float32 GGUF of architecture ``arch`` (``"llama"``, ``"qwen2"`` with q/k/v biases, or ``"qwen3"`` with norms
    of each q and k head) with a byte-level BPE
    tokenizer of ``VOCAB`` tokens; ``head=False``: no output projection (tied to the embeddings); ``types``: a
    ``gguf.GGMLQuantizationType`` per tensor kind (``"attn_q"``, ``"token_embd"``...) stored that way instead;
    ``rope_freqs``: the float32 per-frequency factors stored as ``rope_freqs.weight`` (llama.cpp's Llama 3 scaling)."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_context_length(128)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_embedding_length(hidden)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    tokens = ["<unk>", "<s>", "</s>", "ab", "bc"] + [chr(ord("a") + i) for i in range(26)] + \
             [chr(ord("A") + i) for i in range(26)]
    tokens += [f"<t{i}>" for i in range(len(tokens), VOCAB)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    # Two merges, not one: transformers 5.17 (the GPU machines') reads a one-element array as its element.
    w.add_token_merges(["a b", "b c"])
    w.add_token_types([3 if i < 3 else 1 for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    hd = hidden // heads
    if arch == "qwen3":  # as Qwen3's files say it (transformers' loader otherwise takes its config's 128)
        w.add_key_length(hd)
        w.add_value_length(hd)

    def t(name, *shape):
        values = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        qtype = (types or {}).get(name.split(".")[-2])  # e.g. "attn_q", "token_embd"
        if qtype is None:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    t("token_embd.weight", VOCAB, hidden)
    for i in range(layers):
        t(f"blk.{i}.attn_norm.weight", hidden)
        t(f"blk.{i}.ffn_norm.weight", hidden)
        t(f"blk.{i}.attn_q.weight", heads * hd, hidden)
        t(f"blk.{i}.attn_k.weight", kv * hd, hidden)
        t(f"blk.{i}.attn_v.weight", kv * hd, hidden)
        if arch == "qwen2":
            t(f"blk.{i}.attn_q.bias", heads * hd)
            t(f"blk.{i}.attn_k.bias", kv * hd)
            t(f"blk.{i}.attn_v.bias", kv * hd)
        if arch == "qwen3":
            t(f"blk.{i}.attn_q_norm.weight", hd)
            t(f"blk.{i}.attn_k_norm.weight", hd)
        t(f"blk.{i}.attn_output.weight", hidden, heads * hd)
        t(f"blk.{i}.ffn_gate.weight", inter, hidden)
        t(f"blk.{i}.ffn_up.weight", inter, hidden)
        t(f"blk.{i}.ffn_down.weight", hidden, inter)
    t("output_norm.weight", hidden)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    if head:
        t("output.weight", VOCAB, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    pytest.importorskip("gguf")
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def reference(gguf_file):
    """The model converted without the cache."""
    return from_pretrained(gguf_file, cache=False)


class Cache(type(Path())):
    conversions: list


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory (a Path), with ``.conversions``: the GGUF conversions made."""
    pytest.importorskip("gguf")
    directory = Cache(tmp_path / "cache")
    monkeypatch.setenv(loading.CACHE_DIR_ENV, str(directory))
    calls = []
    convert = loading._convert_gguf

    def counting(path):
        calls.append(path)
        return convert(path)

    monkeypatch.setattr(loading, "_convert_gguf", counting)
    directory.conversions = calls
    return directory


def same_model(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa) and a.config == b.config


def entries(directory, suffix):
    return sorted(p for p in directory.iterdir() if p.name.endswith(suffix))


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(loading.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "lookahead"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "lookahead"
    monkeypatch.setenv(loading.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_second_load_reads_the_cache_and_gives_the_same_model(gguf_file, reference, cache, capsys):
    first = from_pretrained(gguf_file)
    assert "converting tiny.gguf" in capsys.readouterr().err
    assert len(cache.conversions) == 1 and same_model(first, reference)
    [entry] = entries(cache, ".safetensors")
    assert file_sha256(gguf_file)[:40] in entry.name
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]  # no temporary left behind
    second = from_pretrained(gguf_file)
    assert len(cache.conversions) == 1 and same_model(second, reference)
    ids = torch.tensor([[1, 5, 9, 3]])
    assert torch.equal(second.generate(ids, max_new_tokens=8).sequences,
                       reference.generate(ids, max_new_tokens=8).sequences)
    # a dtype is applied on load, from the same float32 entry
    half = from_pretrained(gguf_file, dtype=torch.bfloat16)
    assert len(cache.conversions) == 1 and half.dtype == torch.bfloat16
    # cache=False neither reads nor writes it
    assert same_model(half, from_pretrained(gguf_file, dtype=torch.bfloat16, cache=False))
    assert len(cache.conversions) == 2 and len(entries(cache, ".safetensors")) == 1


def test_a_new_entry_removes_the_older_versions_of_its_file(gguf_file, cache):
    """Entries an earlier version of the conversion wrote are never read again: writing the current one deletes
    them (the same file's only, and weights only: the tokenizer's entry has its own version)."""
    digest = file_sha256(gguf_file)[:40]
    cache.mkdir(parents=True)
    old = [cache / f"gguf-{digest}-v1.safetensors", cache / f"gguf-{digest}-v0.safetensors"]
    kept = [cache / f"gguf-{'0' * 40}-v1.safetensors", cache / f"gguf-{digest}-v1.tokenizer",
            cache / f"gguf-{digest}-vx.safetensors"]
    for path in old + kept:
        path.write_bytes(b"old")
    from_pretrained(gguf_file)
    current = cache / f"gguf-{digest}-v{loading.CACHE_VERSIONS['safetensors']}.safetensors"
    assert current.is_file() and not any(p.exists() for p in old) and all(p.exists() for p in kept)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "empty"])
def test_a_corrupt_entry_is_detected_and_rebuilt(gguf_file, reference, cache, damage):
    from_pretrained(gguf_file)
    [entry] = entries(cache, ".safetensors")
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[-100] ^= 0x01  # one bit of one weight: only the checksum can tell
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "garbage":
        data = bytearray(b"not a safetensors file" * 10)
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        model = from_pretrained(gguf_file)
    assert len(cache.conversions) == 2 and same_model(model, reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry is sound
        assert same_model(from_pretrained(gguf_file), reference)
    assert len(cache.conversions) == 2


def test_the_key_is_the_content_not_size_and_mtime(tmp_path, cache):
    path = write_tiny_gguf(tmp_path / "m.gguf", seed=1)
    first = from_pretrained(path)
    stat = os.stat(path)
    write_tiny_gguf(path, seed=2)  # same size, other weights; the old mtime put back
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(path).st_size == stat.st_size
    second = from_pretrained(path)
    assert len(cache.conversions) == 2 and not same_model(first, second)
    assert len(entries(cache, ".safetensors")) == 2


def test_a_gguf_is_hashed_once_while_its_file_is_unchanged(gguf_file, reference, cache, monkeypatch):
    """Its SHA-256 is recorded against the file's status: later loads (weights and tokenizer) read the record; a
    rewrite (even of the same bytes), a record that cannot be trusted or a record of another file hashes it again."""
    hashed = []
    monkeypatch.setattr(loading, "file_sha256", lambda path: hashed.append(path) or file_sha256(path))
    assert same_model(from_pretrained(gguf_file), reference) and len(hashed) == 1
    load_tokenizer(gguf_file)
    from_pretrained(gguf_file, dtype=torch.bfloat16)
    assert len(hashed) == 1 and len(cache.conversions) == 1
    [record] = (cache / "sha256").iterdir()
    for damage in (b"not json", b'{"path": 1}', record.read_bytes().replace(b'"sha256": "', b'"sha256": "x')):
        record.write_bytes(damage)
        assert same_model(from_pretrained(gguf_file), reference)
    assert len(hashed) == 4 and len(cache.conversions) == 1  # the garbled digest is not trusted either
    from_pretrained(gguf_file)
    assert len(hashed) == 4
    gguf_file.write_bytes(gguf_file.read_bytes())  # the same bytes: the change time moves, the digest is the same
    assert same_model(from_pretrained(gguf_file), reference)
    assert len(hashed) == 5 and len(cache.conversions) == 1
    other = write_tiny_gguf(gguf_file.parent / "other.gguf", seed=3)
    from_pretrained(other)
    assert len(hashed) == 6 and len(list((cache / "sha256").iterdir())) == 2
    assert not [p for p in (cache / "sha256").iterdir() if p.name.startswith(".tmp-")]
    # a temporary a killed writer left there is deleted by a later write once it is old
    leftover = cache / "sha256" / ".tmp-killed.json"
    leftover.write_text("{")
    os.utime(leftover, (0, 0))
    write_tiny_gguf(other, seed=4)
    from_pretrained(other)
    assert len(hashed) == 7 and not leftover.exists()


def test_a_failed_write_leaves_nothing_and_still_returns_the_model(gguf_file, reference, cache, monkeypatch):
    import safetensors.torch

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.warns(RuntimeWarning, match="could not cache"):
        model = from_pretrained(gguf_file)
    assert same_model(model, reference)
    # neither an entry nor the temporary (the file's recorded SHA-256 is not an entry)
    assert [p.name for p in cache.iterdir()] == ["sha256"]


def test_tokenizer_is_cached_and_a_corrupt_one_rebuilt(gguf_file, cache, monkeypatch):
    from transformers import AutoTokenizer

    direct = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    first = load_tokenizer(gguf_file)
    [entry] = entries(cache, ".tokenizer")
    assert (entry / "tokenizer.json").is_file() and (entry / "manifest.json").is_file()
    calls = []
    original = AutoTokenizer.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        calls.append(kwargs.get("gguf_file"))
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counting))
    second = load_tokenizer(gguf_file)
    assert calls == []  # read from the cache directory by the fast tokenizer's class, not from the GGUF
    text = "abc XYZ ab"
    for tok in (first, second):
        assert tok(text)["input_ids"] == direct(text)["input_ids"] and tok.eos_token == direct.eos_token
        assert tok.decode(direct(text)["input_ids"]) == direct.decode(direct(text)["input_ids"])
        assert (tok.bos_token, tok.pad_token, tok.unk_token) == (direct.bos_token, direct.pad_token, direct.unk_token)
    tokenizer_json = entry / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text().replace('"ab"', '"ba"', 1))
    with pytest.warns(RuntimeWarning, match="corrupt"):
        third = load_tokenizer(gguf_file)
    assert calls[-1] == gguf_file.name and third(text)["input_ids"] == direct(text)["input_ids"]


def test_loading_errors_are_value_errors(tmp_path, cache):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF but not really")
    with pytest.raises(ValueError, match="bad.gguf is not a GGUF file .19 bytes, shorter than a GGUF header"):
        from_pretrained(bad)


def test_pool_extension_announces_a_build_but_not_a_load(tmp_path, monkeypatch, capsys):
    from torch.utils import cpp_extension

    from lookahead_kernels import pool_ext

    built = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: built.append(kwargs["name"]))
    sources = [pool_ext._CSRC / "ngram_pool.cpp"]
    pool_ext._build("lookahead_pool_cpu", sources, verbose=False)
    assert "building the n-gram pool extension" in capsys.readouterr().err  # no library yet
    library = tmp_path / "lookahead_pool_cpu.so"
    library.write_bytes(b"")
    inputs = pool_ext._with_local_includes(sources)
    assert {p.name for p in inputs} == {"ngram_pool.cpp", "ngram_pool.h", "ngram_pool_torch.h"}
    newest = max(p.stat().st_mtime for p in inputs)  # the pool's inputs
    os.utime(library, (newest + 10, newest + 10))
    pool_ext._build("lookahead_pool_cpu", sources, verbose=False)
    assert capsys.readouterr().err == ""  # an up-to-date library is only loaded
    os.utime(library, (newest - 10, newest - 10))
    pool_ext._build("lookahead_pool_cpu", sources, verbose=False)
    assert "building" in capsys.readouterr().err  # sources newer than the library: a rebuild
    assert built == ["lookahead_pool_cpu"] * 3


def test_pool_extension_build_reads_only_the_headers_its_sources_include(tmp_path):
    """Another header of csrc/ changing (the CPU ops' cpu_ops.h) leaves the pool's library as it is, so no build
    is announced: the announcement once printed on every run after such a change, while ninja rebuilt nothing."""
    from lookahead_kernels import pool_ext

    (tmp_path / "a.cpp").write_text('#include "b.h"\n  #  include "c.h"\n#include <vector>\n#include "gone.h"\n')
    (tmp_path / "b.h").write_text('#include "c.h"\n')
    (tmp_path / "c.h").write_text('#include "b.h"\n')  # a cycle is read once
    (tmp_path / "unrelated.h").write_text("")
    assert sorted(p.name for p in pool_ext._with_local_includes([tmp_path / "a.cpp"])) == ["a.cpp", "b.h", "c.h"]


def test_load_default_reads_the_gguf_once_for_both_cache_keys(tmp_path, monkeypatch):
    """The weights' and the tokenizer's cache entries share the file's SHA-256: load_default hashes it once."""
    from lookahead import loading

    hashed = []
    monkeypatch.setattr(loading, "file_sha256", lambda path: hashed.append(path) or "ab" * 32)
    monkeypatch.setattr(loading, "default_gguf_path", lambda: tmp_path / "model.gguf")
    monkeypatch.setattr(loading, "_load_gguf", lambda directory, name, dtype, device, cache=True, digest=None:
                        ("model", digest, dtype, device))
    monkeypatch.setattr(loading, "_load_gguf_tokenizer", lambda path, cache, digest=None: ("tokenizer", digest))
    model, tokenizer = loading.load_default()
    assert model == ("model", "ab" * 32, torch.float32, torch.device("cpu")) and tokenizer == ("tokenizer", "ab" * 32)
    assert hashed == [tmp_path / "model.gguf"]
    with pytest.raises(ValueError, match="dtype"):
        loading.load_default(dtype=torch.int8)
