"""Per-call time of attention for one lookahead step: the Triton kernel against SDPA and FlexAttention.

Shapes: Llama-2-7B (32 heads x 128, MHA) and Llama-3-8B (32 query / 8 key-value heads x 128), float16, B=1,
warm steps of (W, N, G) = (15, 5, 15) and (7, 5, 7) (levels N-1, G linear guesses of N-1 tokens) and a step
(15, 5, tree 60) whose verification branch is a random pre-ordered token tree of 60 nodes (the same token count
as G=15 guesses of 4), committed prefix ``cache_len`` in 512, 2048, 8192, 32768. Per configuration:

* ``ours``: ``lookahead_kernels.lookahead_attention`` (mask evaluated in the kernel, split-KV chosen by it);
* ``sdpa``: ``scaled_dot_product_attention`` with a dense boolean ``[T, cache_len + T]`` mask, with the mask
  build timed (``+mask``) and prebuilt;
* ``flex``: compiled ``flex_attention`` with ``layout.mask_mod``, with ``create_block_mask`` timed (``+mask``)
  and prebuilt.

Times are ``triton.testing.do_bench`` medians (ms, shown in µs). Achieved GB/s counts the bytes that must be
read or written at least once: K and V rows ``0 .. cache_len + T - 1`` of every key/value head, plus q and the
output; "% copy" compares with the bandwidth of a large device-to-device copy (read + write bytes) measured in
the same run. Results go to ``bench/results/attention-<device>.{json,md}``.

    python bench/bench_attention.py              # full sweep (GPU)
    python bench/bench_attention.py --quick      # smaller sweep
    python bench/bench_attention.py --dry-run --out-dir /tmp/x   # tiny CPU run of the non-timing logic

Without CUDA (and without ``--dry-run``) it prints that it needs a GPU and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from _common import command_line, device_label, device_slug, machine_info, write_results  # noqa: E402

# (name, query heads, key/value heads, head dim)
MODELS = [("llama2-7b", 32, 32, 128), ("llama3-8b", 32, 8, 128)]
# (W, N, G) warm with G linear guesses of N-1 tokens, or (W, N, V, "tree"): a random token tree of V nodes.
STEPS = [(15, 5, 15), (7, 5, 7), (15, 5, 60, "tree")]
CACHE_LENS = [512, 2048, 8192, 32768]
QUICK = dict(models=MODELS, steps=[STEPS[0], STEPS[2]], cache_lens=[512, 8192])
# --dry-run: tiny shapes that the CPU (Triton interpreter) runs in seconds.
DRY = dict(models=[("tiny-mha", 2, 2, 64), ("tiny-gqa", 4, 2, 64)], steps=[(3, 3, 2), (3, 3, 7, "tree")],
           cache_lens=[16, 70])


def bench_tree(nodes: int, seed: int = 0):
    """A random pre-ordered tree of ``nodes`` nodes (a TreeShape): each node hangs under a node of the path from a
    root to the previous node, extending that path with probability 0.6 (a few long branches, many short ones)."""
    import random

    from lookahead_kernels.tree import TreeShape

    rng = random.Random(seed)
    parents, path = [], []
    for i in range(nodes):
        path = path if rng.random() < 0.6 else path[:rng.randint(0, len(path))]
        parents.append(path[-1] if path else -1)
        path.append(i)
    return TreeShape.from_parents(parents)


def step_layout(window: int, ngram: int, guesses: int, kind: str = "linear", device=None):
    """Layout of a warm step: ``guesses`` linear candidates of ``ngram - 1`` tokens, or with ``kind="tree"`` a
    :func:`bench_tree` of ``guesses`` nodes (on ``device``, where the kernel reads it)."""
    from lookahead_kernels.layout import StepLayout

    if kind == "tree":
        return StepLayout(window, ngram - 1, bench_tree(guesses).to(device or "cpu"))
    return StepLayout.linear(window, ngram - 1, guesses, ngram - 1, device=device)


def step_name(wng) -> str:
    """``(15, 5, 15)`` for linear guesses, ``(15, 5, tree 60)`` for a tree step."""
    if len(wng) == 4:
        return f"({wng[0]}, {wng[1]}, {wng[3]} {wng[2]})"
    return str(tuple(wng))


def bytes_needed(cache_len: int, T: int, hq: int, hkv: int, d: int, elem: int) -> int:
    """K and V rows of prefix + step once per key/value head, plus q read and the output written."""
    return 2 * (cache_len + T) * hkv * d * elem + 2 * T * hq * d * elem


def make_inputs(cache_len, layout, hq, hkv, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T = layout.T
    S = cache_len + T
    q = torch.randn(1, T, hq, d, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(1, S, hkv, d, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(1, S, hkv, d, generator=gen).to(device=device, dtype=dtype)
    return q, k, v


def sdpa_dense(q, k, v, mask):
    """SDPA over all cache rows with a dense ``[T, kv]`` boolean mask (heads-first views)."""
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        enable_gqa=q.shape[2] != k.shape[2])
    return o.transpose(1, 2)


def copy_bandwidth_gbs(device, timer) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


def cuda_timer(fn) -> float:
    """Device milliseconds of ``fn``: captured in a CUDA graph and replayed (do_bench_cudagraph median), as a
    step replayed from a graph runs it. ``do_bench`` (``cuda_launch_timer``) would time the host's launch
    instead: 206-368 us for our kernel at 7B shape and 4k context, whose device time is 38 us (H100)."""
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def cuda_launch_timer(fn) -> float:
    """Milliseconds per call launched from Python, host overhead included (do_bench median)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def cpu_timer(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def _capturable(timer, fn, row, name):
    """``timer(fn)``; where ``fn`` cannot be captured in a CUDA graph (building a mask may copy from the host),
    the launched time instead, noted in ``row["launched"]``."""
    try:
        return timer(fn)
    except Exception:  # noqa: BLE001
        if timer is not cuda_timer:
            raise
        row.setdefault("launched", []).append(name)
        return cuda_launch_timer(fn)


def run_config(model, wng, cache_len, device, dtype, timer, flex_fn):
    """Time every method on one configuration; returns one result row."""
    from torch.nn.attention.flex_attention import create_block_mask

    from lookahead_kernels import attention as attn
    from lookahead_kernels.attention_ref import attention_torch, dense_mask

    name, hq, hkv, d = model
    layout = step_layout(*wng, device=device)
    T = layout.T
    kv = cache_len + T
    q, k, v = make_inputs(cache_len, layout, hq, hkv, d, dtype, device)
    row = {"model": name, "hq": hq, "hkv": hkv, "d": d, "W_N_G": list(wng), "T": T, "cache_len": cache_len,
           "bytes": bytes_needed(cache_len, T, hq, hkv, d, q.element_size()), "ms": {}, "errors": {}}

    # cache_len on the kernel's device, as the decoding loop keeps it: a host int is copied in on every call, which
    # a CUDA graph cannot capture (and which the graph timer would refuse).
    lens = torch.tensor([cache_len], device=device)
    ours = lambda: attn.lookahead_attention(q, k, v, cache_len=lens, layout=layout)  # noqa: E731
    ref = attention_torch(q, k, v, cache_len=cache_len, layout=layout)
    row["rel_err_vs_torch"] = rel_err(ours(), ref)
    programs = math.ceil(hq // hkv * T / attn._tile_config(hq // hkv * T, d, dtype)[0]) * hkv
    row["num_splits"] = attn.choose_num_splits(programs, kv, attn._num_sms(device))
    row["ms"]["ours"] = timer(ours)
    if timer is cuda_timer:
        row["ms"]["ours launched"] = cuda_launch_timer(ours)

    mask = dense_mask(layout, cache_len, kv, device=device)
    row["ms"]["sdpa+mask"] = _capturable(timer, lambda: sdpa_dense(q, k, v, dense_mask(layout, cache_len, kv,
                                                                                      device=device)),
                                         row, "sdpa+mask")
    row["ms"]["sdpa"] = timer(lambda: sdpa_dense(q, k, v, mask))
    row["rel_err_sdpa_vs_torch"] = rel_err(sdpa_dense(q, k, v, mask), ref)

    try:
        mod = layout.mask_mod(torch.tensor([cache_len], device=device))
        bm = create_block_mask(mod, 1, None, T, kv, device=device)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = hq != hkv

        try:
            out = flex_fn(qh, kh, vh, block_mask=bm, enable_gqa=gqa)
        except Exception as exc:  # noqa: BLE001
            if not gqa:
                raise
            # Inductor found no kernel for grouped heads here (torch 2.11, T = 120): give flex the key and value
            # heads repeated per query head, which it compiles (it then reads G times the keys, as SDPA does).
            row["errors"]["flex gqa"] = f"{type(exc).__name__}: {exc}"[:200]
            kh, vh, gqa = kh.repeat_interleave(hq // hkv, 1), vh.repeat_interleave(hq // hkv, 1), False
            out = flex_fn(qh, kh, vh, block_mask=bm, enable_gqa=False)

        def flex_with_mask():
            m = create_block_mask(mod, 1, None, T, kv, device=device)
            return flex_fn(qh, kh, vh, block_mask=m, enable_gqa=gqa)

        row["rel_err_flex_vs_torch"] = rel_err(out.transpose(1, 2), ref)
        # eager flex (the dry run's) copies from the host inside a capture: then timed as launched
        row["ms"]["flex"] = _capturable(timer, lambda: flex_fn(qh, kh, vh, block_mask=bm, enable_gqa=gqa), row, "flex")
        row["ms"]["flex+mask"] = _capturable(timer, flex_with_mask, row, "flex+mask")
    except Exception as exc:  # a peer failing to compile must not hide the other rows
        row["errors"]["flex"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def _fmt_us(ms) -> str:
    return "—" if ms is None else f"{ms * 1e3:.1f}"


def render_markdown(result: dict) -> str:
    m = result["machine"]
    copy = result["copy_gbs"]
    lines = [
        "# Lookahead attention: per-call time",
        "",
        f"Device: {device_label(m)}; torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, Python {m['python']}; "
        f"git {m['git']}. dtype {result['dtype']}, B=1.",
        f"Command: `{result['command']}`",
        f"Device-to-device copy bandwidth (read + write): {copy:.0f} GB/s.",
        "",
        "Times in µs (do_bench median). `+mask`: the mask (dense bool for SDPA, block mask for flex) is built "
        "inside the timed call. GB/s: bytes that must move (K, V rows of prefix + step, q, out) / our time.",
        "",
        "| model | (W,N,G) | T | cache_len | splits | ours | sdpa+mask | sdpa | flex+mask | flex | MB | ours GB/s "
        "| % copy | × sdpa | × flex |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        t = r["ms"]
        gbs = r["bytes"] / (t["ours"] * 1e-3) / 1e9
        x_sdpa = t["sdpa"] / t["ours"]
        x_flex = f"{t['flex'] / t['ours']:.2f}" if "flex" in t else "—"
        lines.append(
            f"| {r['model']} | {step_name(r['W_N_G'])} | {r['T']} | {r['cache_len']} | {r['num_splits']} | "
            f"{_fmt_us(t['ours'])} | {_fmt_us(t['sdpa+mask'])} | {_fmt_us(t['sdpa'])} | "
            f"{_fmt_us(t.get('flex+mask'))} | {_fmt_us(t.get('flex'))} | {r['bytes'] / 1e6:.2f} | {gbs:.0f} | "
            f"{100 * gbs / copy:.0f} | {x_sdpa:.2f} | {x_flex} |")
    lines += ["", *(f"- {note}" for note in result["notes"])]
    for r in result["rows"]:
        for what, msg in r["errors"].items():
            lines.append(f"- {r['model']} {step_name(r['W_N_G'])} cache_len {r['cache_len']}: {what} failed: {msg}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sweep")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on CPU (Triton interpreter), perf_counter timings: checks the bench itself")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)

    has_cuda = torch.cuda.is_available()
    if args.dry_run:
        if not has_cuda:
            # Must precede the kernels' definition (the import below); a script may set it, a library may not.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        device, sweep = torch.device("cuda" if has_cuda else "cpu"), DRY
        timer = cuda_timer if has_cuda else cpu_timer
    elif not has_cuda:
        print("bench_attention needs a CUDA GPU; skipping")
        return 0
    else:
        device, timer, sweep = torch.device("cuda"), cuda_timer, (QUICK if args.quick else
                                                                   dict(models=MODELS, steps=STEPS,
                                                                        cache_lens=CACHE_LENS))
    from torch.nn.attention.flex_attention import flex_attention

    dtype = torch.float16
    info = machine_info(str(device))
    device_name = device_label(info)
    result = {
        "machine": info,
        "command": command_line(__file__, argv if argv is not None else sys.argv[1:]),
        "dtype": str(dtype).replace("torch.", ""), "rows": [], "notes": [],
    }
    if args.dry_run:
        result["notes"].append("dry run: tiny shapes, CPU perf_counter medians (Triton interpreter); "
                               "checks the bench's logic only, the times mean nothing.")
        flex_fn = flex_attention  # eager: compiling flex on CPU is slow and beside the point here
    else:
        # One compiled flex kernel per shape: allow more recompiles than dynamo's default of 8.
        import torch._dynamo as dynamo  # binds only `dynamo`: `torch` stays the module-level name

        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)
        flex_fn = torch.compile(flex_attention, dynamic=False)
    result["copy_gbs"] = copy_bandwidth_gbs(device, timer)
    print(f"{device_name}: copy bandwidth {result['copy_gbs']:.0f} GB/s")

    import warnings

    for model in sweep["models"]:
        for wng in sweep["steps"]:
            for cache_len in sweep["cache_lens"]:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # flex's eager-mode warning in dry runs
                    row = run_config(model, wng, cache_len, device, dtype, timer, flex_fn)
                result["rows"].append(row)
                t = row["ms"]
                print(f"{row['model']:10s} {step_name(wng)} T={row['T']:4d} cache_len={cache_len:6d} "
                      f"splits={row['num_splits']:2d}  ours {_fmt_us(t['ours'])} us  sdpa {_fmt_us(t['sdpa'])} us  "
                      f"flex {_fmt_us(t.get('flex'))} us  err {row['rel_err_vs_torch']:.1e}")
                if row["rel_err_vs_torch"] > 1e-2:
                    result["notes"].append(f"WARNING: {row['model']} {step_name(wng)} cache_len {cache_len}: ours "
                                           f"differs from attention_torch by {row['rel_err_vs_torch']:.2e}")

    stem = f"attention-{device_slug(info)}" + ("-dry-run" if args.dry_run else "")
    write_results(args.out_dir, stem, result, render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
