"""GPU-only checks of the Triton kernels at the shapes that matter (7B/8B heads, long contexts, 120-token steps)
and under CUDA-graph capture, which the static-buffer runner relies on. Skipped without CUDA (``-m gpu``).

Inputs are fresh random draws (never zeros); outputs are poisoned before the kernel writes them.
"""

from __future__ import annotations

import pytest
import torch

from lookahead_kernels import StepLayout, attention_dense_reference
from lookahead_kernels.tree import TreeShape

pytestmark = pytest.mark.gpu

# (query heads, key/value heads, head dim): Llama-2-7B and Llama-3-8B.
SHAPES = [(32, 32, 128), (32, 8, 128)]


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def random_tree(nodes: int, seed: int) -> TreeShape:
    gen = torch.Generator().manual_seed(seed)
    parents, path = [], []
    for i in range(nodes):
        if torch.rand((), generator=gen) >= 0.6:
            path = path[:int(torch.randint(0, len(path) + 1, (), generator=gen))]
        parents.append(path[-1] if path else -1)
        path.append(i)
    return TreeShape.from_parents(parents)


def layouts():
    return {"15-5-15": StepLayout.linear(15, 4, 15, 4, device="cuda"),
            "tree-60": StepLayout(15, 4, random_tree(60, 1).to("cuda")),
            "plain": StepLayout(1, 1)}


def inputs(layout, context, hq, hkv, d, dtype, seed, batch=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = layout.T
    S = context + T + 7  # rows past the step hold NaN: the kernel must never read them
    q = torch.randn(batch, T, hq, d, device="cuda", generator=gen).to(dtype)
    k = torch.randn(batch, S, hkv, d, device="cuda", generator=gen).to(dtype)
    v = torch.randn(batch, S, hkv, d, device="cuda", generator=gen).to(dtype)
    k[:, context + T:] = float("nan")
    v[:, context + T:] = float("nan")
    return q, k, v


@pytest.mark.parametrize("shape", SHAPES, ids=["7b", "8b"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
@pytest.mark.parametrize("name", ["15-5-15", "tree-60", "plain"])
@pytest.mark.parametrize("context", [4096, 16384])
def test_attention_at_model_shape_matches_float64_oracle(shape, dtype, tol, name, context):
    from lookahead_kernels import lookahead_attention

    hq, hkv, d = shape
    layout = layouts()[name]
    q, k, v = inputs(layout, context, hq, hkv, d, dtype, seed=context + hkv)
    ref = attention_dense_reference(q, k, v, cache_len=context, layout=layout)
    for splits in (None, 1):
        out = torch.full_like(q, float("nan"))
        lookahead_attention(q, k, v, cache_len=context, layout=layout, num_splits=splits, out=out)
        assert not out.isnan().any(), (name, splits)
        assert rel_err(out, ref) < tol, (name, splits, rel_err(out, ref))


def test_attention_with_device_cache_len_replays_in_a_cuda_graph():
    """A graph captured once serves every context: cache_len lives in a device buffer updated in place."""
    from lookahead_kernels import lookahead_attention

    hq, hkv, d = 32, 8, 128
    layout = layouts()["tree-60"]
    q, k, v = inputs(layout, 3000, hq, hkv, d, torch.bfloat16, seed=5)
    k, v = k.nan_to_num(0.5), v.nan_to_num(0.5)
    lens = torch.full((1,), 1000, dtype=torch.long, device="cuda")
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            lookahead_attention(q, k, v, cache_len=lens, layout=layout, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lookahead_attention(q, k, v, cache_len=lens, layout=layout, out=out)
    for context in (1000, 2500, 17):
        lens.fill_(context)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = attention_dense_reference(q, k, v, cache_len=context, layout=layout)
        assert rel_err(out, ref) < 2e-2, context


def _greedy_case(vocab: int, tree: TreeShape, seed: int):
    """Logits where each node's token is its parent's argmax half the time, so walks have real lengths."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    V = tree.size
    x = torch.randn(1, vocab, device="cuda", generator=gen)
    nodes = torch.randn(1, V, vocab, device="cuda", generator=gen)
    parents = tree.parents().tolist()
    tokens = torch.randint(0, vocab, (1, V), device="cuda", generator=gen)
    coin = torch.rand(V, generator=torch.Generator().manual_seed(seed)) < 0.5
    for i, p in enumerate(parents):
        if coin[i]:
            row = x[0] if p < 0 else nodes[0, p]
            tokens[0, i] = row.argmax()
    return x, nodes, tokens, tree.end.to("cuda")


@pytest.mark.parametrize("vocab", [32000, 49152, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_greedy_at_model_vocab_matches_reference(vocab, dtype):
    from lookahead_kernels import verify_tree_greedy, verify_tree_greedy_reference

    for seed in range(3):
        tree = random_tree(120, seed)
        x, nodes, tokens, end = _greedy_case(vocab, tree, seed)
        x, nodes = x.to(dtype), nodes.to(dtype)
        depth = int(tree.depth.max())
        ref = verify_tree_greedy_reference(x, nodes, tokens, end, None, depth)
        got = verify_tree_greedy(x, nodes, tokens, end, None, depth)
        for a, b in zip(ref, got):
            assert torch.equal(a, b), (vocab, dtype, seed)


def test_verify_greedy_replays_in_a_cuda_graph():
    """Static outputs, inputs rewritten in place between replays: the verify step of a captured decode loop."""
    from lookahead_kernels import verify_tree_greedy, verify_tree_greedy_reference

    vocab, tree = 49152, random_tree(120, 7)
    depth = int(tree.depth.max())
    x, nodes, tokens, end = _greedy_case(vocab, tree, 0)
    outs = (torch.empty(1, dtype=torch.long, device="cuda"), torch.empty(1, depth, dtype=torch.long, device="cuda"),
            torch.empty(1, depth + 1, dtype=torch.long, device="cuda"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        verify_tree_greedy(x, nodes, tokens, end, None, depth, out=outs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        verify_tree_greedy(x, nodes, tokens, end, None, depth, out=outs)
    for seed in (1, 2, 3):
        nx, nn_, nt, _ = _greedy_case(vocab, tree, seed)
        x.copy_(nx)
        nodes.copy_(nn_)
        tokens.copy_(nt)
        for o in outs:
            o.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        ref = verify_tree_greedy_reference(x, nodes, tokens, end, None, depth)
        for a, b in zip(ref, outs):
            assert torch.equal(a, b), seed
