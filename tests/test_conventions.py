"""transformers' calling conventions in ``model.generate``: attention_mask, streamers, eos/pad ids, None for
unset, GenerationConfig, and clear errors for what is not supported. On a tiny random Llama and a word-level
tokenizer over its vocabulary."""

import threading
import time

import pytest
import torch
import transformers
from transformers import GenerationConfig, TextIteratorStreamer, TextStreamer

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.generate import generate

VOCAB = 97
LA = LookaheadConfig(window=3, ngram=3, guess=3)
MODES = {"plain": None, "lookahead": LA}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                                   tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    return hf, LlamaForCausalLM.from_hf(hf)


@pytest.fixture(scope="module")
def tokenizer():
    """Token ``i >= 2`` is the word ``w{i}``; 0 is ``<pad>``, 1 ``<unk>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])


def new_tokens(out, prompt_len):
    return out.sequences[0, prompt_len:].tolist()


@pytest.mark.parametrize("mode", MODES)
def test_tokenizer_output_as_keywords(tiny, tokenizer, mode):
    _, model = tiny
    inputs = tokenizer("w5 w6 w7 w8 w9 w10", return_tensors="pt")
    assert set(inputs) == {"input_ids", "attention_mask"}
    out = model.generate(**inputs, max_new_tokens=12, lookahead=MODES[mode])
    assert torch.equal(out.sequences, model.generate(PROMPT, max_new_tokens=12, lookahead=None).sequences)


@pytest.mark.parametrize("mode", MODES)
def test_left_padding_is_stripped_and_kept_in_front_as_transformers_does(tiny, mode):
    hf, model = tiny
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), PROMPT], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(PROMPT)], dim=1)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, lookahead=MODES[mode], pad_token_id=0)
    reference = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, reference)
    assert out.sequences.shape[1] == ids.shape[1] + out.stats.new_tokens
    # the same with a 1-D prompt and mask
    assert torch.equal(model.generate(ids[0], attention_mask=mask[0], max_new_tokens=12).sequences, reference)


@pytest.mark.parametrize("mask,message", [
    ([1, 1, 1, 0], "left padding"),            # right padding
    ([0, 1, 0, 1], "left padding"),            # a gap
    ([0, 0, 0, 0], "all zeros"),
    ([1, 2, 1, 1], "only 0"),
    ([1, 1, 1], "shape"),
])
def test_unsupported_attention_masks_are_clear_errors(tiny, mask, message):
    _, model = tiny
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[3, 4, 5, 6]]), attention_mask=torch.tensor([mask]), max_new_tokens=2)


def test_a_streamer_with_a_batch_is_refused(tiny):
    _, model = tiny
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="streamer follows one sequence"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, streamer=lambda t: None)


class Recorder:
    """A transformers-style streamer that records every put() and end()."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        assert self.ended == 0
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("mode", MODES)
def test_put_end_streamer_gets_the_prompt_then_the_new_tokens(tiny, mode):
    _, model = tiny
    rec = Recorder()
    out = model.generate(PROMPT, max_new_tokens=15, lookahead=MODES[mode], streamer=rec)
    assert rec.ended == 1 and torch.equal(rec.puts[0], PROMPT)
    steps = rec.puts[1:]
    if mode == "plain":  # one [1] tensor per token, as transformers' sampling loop
        assert all(p.shape == (1,) for p in steps)
        streamed = [int(p[0]) for p in steps]
    else:  # [1, n] per step, as transformers' assisted decoding
        assert all(p.dim() == 2 and p.shape[0] == 1 for p in steps)
        streamed = [t for p in steps for t in p[0].tolist()]
    assert len(steps) == out.stats.steps and streamed == new_tokens(out, PROMPT.shape[1])


def test_callable_streamer_still_gets_lists(tiny):
    _, model = tiny
    got = []
    out = model.generate(PROMPT, max_new_tokens=10, lookahead=LA, streamer=got.append)
    assert all(isinstance(chunk, list) for chunk in got)
    assert [t for chunk in got for t in chunk] == new_tokens(out, PROMPT.shape[1])
    with pytest.raises(ValueError, match="streamer"):
        model.generate(PROMPT, max_new_tokens=2, streamer=object())


@pytest.mark.parametrize("skip_prompt", [True, False])
def test_text_streamer_prints_what_generate_returns(tiny, tokenizer, capsys, skip_prompt):
    _, model = tiny
    out = model.generate(PROMPT, max_new_tokens=10, lookahead=LA, streamer=TextStreamer(tokenizer, skip_prompt))
    printed = capsys.readouterr().out
    expected = tokenizer.decode(new_tokens(out, PROMPT.shape[1]) if skip_prompt else out.sequences[0])
    assert printed.split() == expected.split() and printed.endswith("\n")


def test_text_iterator_streamer_from_a_thread(tiny, tokenizer):
    _, model = tiny
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=60)
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        out=model.generate(PROMPT, max_new_tokens=10, lookahead=LA, streamer=streamer)))
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text.split() == tokenizer.decode(new_tokens(result["out"], PROMPT.shape[1])).split()


@pytest.mark.parametrize("mode", MODES)
def test_eos_token_id_as_int_or_list(tiny, mode):
    _, model = tiny
    full = new_tokens(model.generate(PROMPT, max_new_tokens=20, lookahead=None), PROMPT.shape[1])
    eos = full[6]
    stop = full.index(eos) + 1
    for given in (eos, [96 if eos != 96 else 95, eos], torch.tensor([eos])):
        out = model.generate(PROMPT, max_new_tokens=20, lookahead=MODES[mode], eos_token_id=given, pad_token_id=0)
        assert new_tokens(out, PROMPT.shape[1]) == full[:stop]
    with pytest.raises(ValueError, match="eos_token_id"):
        model.generate(PROMPT, max_new_tokens=2, eos_token_id="2")
    with pytest.raises(ValueError, match="pad_token_id"):
        model.generate(PROMPT, max_new_tokens=2, pad_token_id=[0])


def test_none_means_unset(tiny):
    _, model = tiny
    greedy = model.generate(PROMPT, max_new_tokens=8, lookahead=LA).sequences
    same = model.generate(PROMPT, max_new_tokens=8, lookahead=LA, do_sample=None, temperature=None, top_k=None,
                          top_p=None, eos_token_id=None, pad_token_id=None, generation_config=None)
    assert torch.equal(same.sequences, greedy)
    # Unset sampling parameters take transformers' values: top-k 50 (not off), top-p 1.
    sampled = [model.generate(PROMPT, max_new_tokens=8, lookahead=LA, do_sample=True, top_k=k, top_p=p,
                              temperature=0.8, generator=torch.Generator().manual_seed(3)).sequences
               for k, p in ((None, None), (50, 1.0))]
    assert torch.equal(*sampled)
    # model.generate without max_new_tokens: the default, 128 (the tiny model has no EOS)
    assert model.generate(PROMPT, lookahead=None).stats.new_tokens == 128


def test_generation_config_and_keyword_overrides(tiny):
    _, model = tiny
    n = PROMPT.shape[1]
    assert model.generate(PROMPT, generation_config=GenerationConfig(max_new_tokens=7)).stats.new_tokens == 7
    assert model.generate(PROMPT, generation_config=GenerationConfig(max_new_tokens=7),
                          max_new_tokens=3).stats.new_tokens == 3
    assert model.generate(PROMPT, generation_config=GenerationConfig(max_length=n + 5)).sequences.shape[1] == n + 5
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=9)

    def run(**kwargs):
        return model.generate(PROMPT, lookahead=LA, generator=torch.Generator().manual_seed(11), **kwargs).sequences

    assert torch.equal(run(generation_config=config),
                       run(do_sample=True, temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=9))
    assert torch.equal(run(generation_config=config, do_sample=False), run(max_new_tokens=9))
    # EOS from the config, and the function form of generate
    full = new_tokens(model.generate(PROMPT, max_new_tokens=12, lookahead=None), n)
    out = generate(model, PROMPT, generation_config=GenerationConfig(eos_token_id=full[4], max_new_tokens=12))
    assert new_tokens(out, n) == full[:full.index(full[4]) + 1]
    # transformers' own defaults and harmless fields are accepted
    model.generate(PROMPT, max_new_tokens=2, num_beams=1, repetition_penalty=1.0, use_cache=True,
                   generation_config=GenerationConfig(bos_token_id=1, num_return_sequences=1))
    # and so are the fields that choose how transformers computes, not what: our cache, steps and drafts serve them
    neutral = dict(cache_implementation="static", prompt_lookup_num_tokens=10, max_matching_ngram_size=2,
                   disable_compile=True, prefill_chunk_size=4, max_cache_len=64)
    assert new_tokens(model.generate(PROMPT, max_new_tokens=12, lookahead=LA, **neutral), n) == full


@pytest.mark.parametrize("mode", MODES)
def test_a_tokenizer_output_as_input_ids(tiny, tokenizer, mode):
    """transformers 5's apply_chat_template(..., return_tensors="pt") returns a BatchEncoding, which users pass
    as generate's first argument."""
    _, model = tiny
    inputs = tokenizer(["w5 w6 w7 w8 w9 w10"], return_tensors="pt")
    out = model.generate(inputs, max_new_tokens=12, lookahead=MODES[mode])
    assert torch.equal(out.sequences, model.generate(**inputs, max_new_tokens=12, lookahead=None).sequences)
    assert torch.equal(model.generate({"input_ids": PROMPT}, max_new_tokens=4).sequences,
                       model.generate(PROMPT, max_new_tokens=4).sequences)
    with pytest.raises(ValueError, match=r"got keys \['input_ids', 'token_type_ids'\]"):
        model.generate({"input_ids": PROMPT, "token_type_ids": PROMPT * 0}, max_new_tokens=2)
    with pytest.raises(ValueError, match="attention_mask given twice"):
        model.generate(inputs, attention_mask=inputs["attention_mask"], max_new_tokens=2)


def fresh_copy(tiny):
    """A model of its own (its generation_config is edited)."""
    return LlamaForCausalLM.from_hf(tiny[0])


def test_the_models_generation_config_gives_the_defaults(tiny):
    model = fresh_copy(tiny)
    assert isinstance(model.generation_config, GenerationConfig) and model.generation_config.eos_token_id is None
    n = PROMPT.shape[1]
    full = new_tokens(model.generate(PROMPT, max_new_tokens=12, lookahead=None), n)
    model.generation_config.eos_token_id = [full[3]]
    model.generation_config.max_new_tokens = 10
    assert new_tokens(model.generate(PROMPT, lookahead=LA), n) == full[:full.index(full[3]) + 1]
    model.generation_config.eos_token_id = None
    assert model.generate(PROMPT, lookahead=LA).stats.new_tokens == 10

    def run(**kwargs):
        return model.generate(PROMPT, lookahead=LA, generator=torch.Generator().manual_seed(5), **kwargs).sequences

    model.generation_config.do_sample, model.generation_config.temperature = True, 0.7
    model.generation_config.top_k = 5
    assert torch.equal(run(), run(do_sample=True, temperature=0.7, top_k=5, max_new_tokens=10))
    # a call's generation_config overrides the model's fields it sets; keywords override both
    assert torch.equal(run(generation_config=GenerationConfig(top_k=3)),
                       run(do_sample=True, temperature=0.7, top_k=3, max_new_tokens=10))
    greedy = fresh_copy(tiny).generate(PROMPT, max_new_tokens=10, lookahead=None).sequences
    assert torch.equal(run(do_sample=False), greedy)
    model.generation_config.guidance_scale = 1.5
    with pytest.raises(ValueError, match=r"guidance_scale=1.5 \(in model.generation_config\)"):
        model.generate(PROMPT, max_new_tokens=2)
    with pytest.raises(ValueError, match="must be a transformers GenerationConfig"):
        model.generation_config = {"max_new_tokens": 3}


def test_generation_config_json_is_loaded_saved_and_copied(tiny, tmp_path):
    import json

    hf, _ = tiny
    hf.generation_config = GenerationConfig(eos_token_id=[3, 4], do_sample=True, temperature=0.6, top_p=0.9)
    try:
        model = LlamaForCausalLM.from_hf(hf)
    finally:
        hf.generation_config = GenerationConfig()
    assert model.generation_config.eos_token_id == [3, 4] and model.generation_config.temperature == 0.6
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "generation_config.json").read_text())
    assert written["eos_token_id"] == [3, 4] and written["top_p"] == 0.9
    assert transformers.GenerationConfig.from_pretrained(tmp_path).do_sample is True
    # A checkpoint's field generate cannot honour is left out, with a warning naming it.
    written["guidance_scale"] = 3.0
    (tmp_path / "generation_config.json").write_text(json.dumps(written))
    with pytest.warns(UserWarning, match=r"sets guidance_scale=3.0, which lookahead's generate does not"):
        loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    assert loaded.generation_config.guidance_scale is None and loaded.generation_config.temperature == 0.6
    assert loaded.generate(PROMPT, max_new_tokens=3, do_sample=False).stats.new_tokens <= 3
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json as a transformers generation config"):
        LlamaForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert LlamaForCausalLM.from_pretrained(tmp_path).generation_config.do_sample is None


def test_from_pretrained_takes_transformers_spellings(tiny, tmp_path):
    """``torch_dtype``, a dtype's name or ``"auto"``, ``device_map`` on one device; the same weights either way."""
    _, model = tiny
    model.save_pretrained(tmp_path)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    for kwargs, dtype, device in [
        (dict(torch_dtype=torch.bfloat16), torch.bfloat16, "cpu"),
        (dict(dtype="float16"), torch.float16, "cpu"),
        (dict(dtype="auto", device_map="cpu"), torch.float32, "cpu"),
        (dict(device_map={"": "cpu"}), torch.float32, "cpu"),
        (dict(device_map="auto"), torch.float32, auto),
    ]:
        loaded = LlamaForCausalLM.from_pretrained(tmp_path, **kwargs)
        assert loaded.dtype == dtype and loaded.device.type == device, kwargs
        assert torch.equal(loaded.embed.weight.float().cpu(), model.embed.weight.to(dtype).float())


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype=torch.float16, torch_dtype=torch.bfloat16), "dtype or torch_dtype"),
    (dict(dtype="int8"), "dtype 'int8' is not one we load"),
    (dict(torch_dtype=torch.int8), "floating torch.dtype"),
    (dict(device_map={"model.layers.0": 0, "lm_head": 1}), "splits the model over several devices"),
    (dict(device="cpu", device_map="cpu"), "device or device_map"),
    (dict(device="gpu7"), "not a torch device"),
    (dict(low_cpu_mem_usage=True, trust_remote_code=True), "does not take low_cpu_mem_usage, trust_remote_code"),
])
def test_from_pretrained_refuses_what_it_cannot_honour(tiny, tmp_path, kwargs, message):
    _, model = tiny
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        LlamaForCausalLM.from_pretrained(tmp_path, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_num_return_sequences_draws_each_prompt_n_times(tiny, mode):
    _, model = tiny
    prompts = [[5, 6, 7, 8], [9, 10]]

    def run(ids, **kwargs):
        return model.generate(ids, max_new_tokens=6, lookahead=MODES[mode], do_sample=True, temperature=1.5,
                              generator=torch.Generator().manual_seed(2), **kwargs).sequences

    out = run(prompts, num_return_sequences=3)
    assert out.shape[0] == 6
    # the same draws as the batch of each prompt repeated, in transformers' order
    assert torch.equal(out, run([p for p in prompts for _ in range(3)]))
    assert len({tuple(r) for r in out[:3, -6:].tolist()}) > 1, "three draws of one prompt all alike"
    assert torch.equal(run(prompts, generation_config=GenerationConfig(do_sample=True, num_return_sequences=2)),
                       run([p for p in prompts for _ in range(2)]))
    with pytest.raises(ValueError, match="needs do_sample=True"):
        model.generate(PROMPT, max_new_tokens=2, num_return_sequences=2)
    with pytest.raises(ValueError, match="num_return_sequences must be an int >= 1"):
        model.generate(PROMPT, max_new_tokens=2, do_sample=True, num_return_sequences=0)


def test_parameter_counts_as_transformers_gives_them(tiny):
    hf, model = tiny
    assert model.num_parameters() == hf.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == hf.num_parameters(exclude_embeddings=True)
    assert model.get_input_embeddings() is model.embed
    for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "vocab_size",
                 "intermediate_size", "max_position_embeddings", "head_dim"):
        assert getattr(model.config, name) == getattr(hf.config, name), name


@pytest.mark.parametrize("mode", MODES)
def test_the_output_is_the_sequences_tensor_as_transformers_returns_it(tiny, tokenizer, mode):
    """``tokenizer.decode(out[0])``, ``batch_decode(out)``, ``out[0, L:]``: the habits of transformers' default
    ``return_dict_in_generate=False``; the statistics stay attributes, and torch ops give plain tensors."""
    _, model = tiny
    inputs = tokenizer(["w5 w6 w7 w8 w9 w10", "w11 w12 w13"], return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**inputs, max_new_tokens=10, lookahead=MODES[mode], pad_token_id=0)
    seq = out.sequences
    assert type(seq) is torch.Tensor and seq.dtype == torch.long and torch.equal(out, seq)
    assert out.shape == seq.shape == (2, 16) and len(out) == 2 and out.tolist() == seq.tolist()
    assert torch.equal(out[0], seq[0]) and torch.equal(out[1, 6:], seq[1, 6:]) and type(out[0]) is torch.Tensor
    assert tokenizer.decode(out[0], skip_special_tokens=True) == tokenizer.decode(seq[0].tolist(),
                                                                                  skip_special_tokens=True)
    assert tokenizer.batch_decode(out) == [tokenizer.decode(row.tolist()) for row in seq]
    assert type(out + 1) is torch.Tensor and type(out.clone()) is torch.Tensor
    assert out["sequences"] is not None and torch.equal(out["sequences"], seq) and out["stats"] is out.stats
    assert out.stats.new_tokens == 20 and out.scores is None and out.logits is None
    with pytest.raises(KeyError, match="sequences, stats"):
        out["scores"]


def test_the_output_survives_pickle_and_deepcopy(tiny):
    import copy
    import pickle

    _, model = tiny
    out = model.generate(PROMPT, max_new_tokens=6, lookahead=LA, output_scores=True)
    for copied in (pickle.loads(pickle.dumps(out)), copy.deepcopy(out)):
        assert type(copied) is type(out) and torch.equal(copied, out)
        assert copied.stats.steps == out.stats.steps and len(copied.scores) == 6
        assert torch.equal(copied.scores[0], out.scores[0])


@pytest.mark.parametrize("where", ["keyword", "generation_config"])
def test_return_dict_in_generate_indexes_as_transformers_output_object(tiny, where):
    """transformers returns a ``ModelOutput`` there: ``out[0]`` is ``sequences``, then the scores and logits asked
    for; the attributes work either way."""
    _, model = tiny
    kwargs = dict(output_scores=True, output_logits=True)
    if where == "keyword":
        kwargs["return_dict_in_generate"] = True
    else:
        kwargs["generation_config"] = GenerationConfig(return_dict_in_generate=True, max_new_tokens=5)
    out = model.generate(PROMPT, max_new_tokens=5, **kwargs)
    assert torch.equal(out[0], out.sequences) and out[1] is out.scores and out[2] is out.logits
    assert out[-1] is out.logits and len(out.to_tuple()) == 3 and out["logits"] is out.logits
    assert torch.equal(out[0, 0], out.sequences[0, 0])  # a tuple index reads the tokens
    plain = model.generate(PROMPT, max_new_tokens=5, return_dict_in_generate=False)
    assert torch.equal(plain[0], plain.sequences[0])
    with pytest.raises(ValueError, match="return_dict_in_generate must be a bool"):
        model.generate(PROMPT, max_new_tokens=5, return_dict_in_generate="yes")


@pytest.mark.parametrize("kwargs,named", [
    (dict(num_beams=4), "num_beams=4"),
    (dict(cache_implementation="quantized"), "cache_implementation='quantized' (only 'dynamic'"),
    (dict(output_attentions=True), "output_attentions=True"),
    (dict(diversity_penalty=0.5), "diversity_penalty=0.5"),
    (dict(generation_config=GenerationConfig(penalty_alpha=0.6)), "penalty_alpha=0.6"),
    (dict(generation_config=GenerationConfig(num_beams=2, length_penalty=0.5)), "length_penalty=0.5"),
    (dict(assistant_model=object()), "assistant_model"),
    (dict(foo=1), "foo"),
    (dict(generation_config={"max_new_tokens": 3}), "GenerationConfig"),
    (dict(max_length=3), "max_length=3"),
])
def test_unsupported_arguments_are_named(tiny, kwargs, named):
    _, model = tiny
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        model.generate(PROMPT, **kwargs)


def test_pool_extension_load_is_not_timed(tiny, monkeypatch):
    """A first-use build/load of the C++ pool happens before generate's clock starts."""
    from lookahead_kernels import pool_ext

    real = pool_ext.load_pool_extension
    try:
        real()
    except pool_ext.PoolExtensionError:
        pytest.skip("the C++ pool does not build here")
    calls = []

    def slow_first(verbose=False):
        calls.append(verbose)
        if len(calls) == 1:
            time.sleep(1.5)  # the build
        return real(verbose)

    monkeypatch.setattr(pool_ext, "load_pool_extension", slow_first)
    _, model = tiny
    out = model.generate(PROMPT, max_new_tokens=4, lookahead=LookaheadConfig(window=3, ngram=3, guess=3,
                                                                             pool_backend="cpp"))
    assert calls and out.stats.seconds < 1.5
