"""What a CUDA graph captures with a step's forward must not synchronise with the host.

On a GPU, ``StepRunner`` captures each step's finish (the logits processors, the warps, the choice or the tree's
verification, the window's guesses, the successor tops, KV compaction) in the step's graph. A capture refuses any
operation that waits for the device (``.item()``, ``bool(tensor)``, ``nonzero``, a boolean-mask index...) or copies
from pageable host memory (``torch.tensor(list)``), and the ``gpu`` tests that capture it run only where a GPU is
lent. On the CPU the static path runs the same finish eagerly, so here it runs under :class:`HostSyncGuard`, a
``TorchFunctionMode`` that records every such operation with its call site. Inside the finish the C++ ops count as
absent, so the CPU takes the torch warps and draws a graph holds; the branches it takes where CUDA launches a
kernel of its own (``CPU_ONLY``: the verification and compaction references; a sync on the line of a
``device.type == "cpu"`` test) are allowed. Everything else a finish calls is the code a graph holds, and must
record nothing.

A replay also reads its inputs and state where its capture did: a processor that replaces a state tensor (rather
than writing it in place) leaves the graph reading the old one. So each finish's reads of tensors it did not make
are kept per graph (runner, shape, finish), with the processors started as on the graph path (every rule every
step); a later run of the same graph must read nothing its earlier runs did not.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from lookahead import LlamaForCausalLM, LookaheadConfig
from lookahead.processors import LogitsProcessors
from lookahead.runner import StepRunner
from lookahead_kernels import cpu_ops

from .test_generate import tiny_hf_model

# Operations that wait for the device, or bring host data to it, in a capture.
_SYNCING = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
            torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
            torch.Tensor.nonzero, torch.nonzero, torch.argwhere, torch.masked_select, torch.Tensor.masked_select,
            torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.bincount, torch.Tensor.bincount,
            torch.equal, torch.allclose, torch.Tensor.allclose, torch.tensor, torch.as_tensor}

# (file name, function) of the code the CPU runs where CUDA launches a kernel of its own (each checked by the
# kernel's own tests, and the kernels' graph captures by the `gpu` tests of tests/test_kv_compact.py,
# test_runner.py and test_verify.py): whatever they call is theirs. A sync on the same line as a
# `device.type == "cpu"` test is the CPU's too.
CPU_ONLY = {
    ("verify_ref.py", "verify_tree_greedy_reference"),  # CUDA: verify_tree_greedy
    ("verify_ref.py", "verify_tree_sample_reference"),  # CUDA: verify_tree_sample
    ("kv_compact_ref.py", "compact_kv_reference"),  # CUDA: compact_kv
}


def _is_bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _syncs(func, args, kwargs) -> bool:
    if func in (torch.tensor, torch.as_tensor):
        return not isinstance(args[0] if args else kwargs.get("data"), torch.Tensor)  # host data
    if func in _SYNCING:
        return True
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
        return _is_bool_index(args[1])
    if func in (torch.where,):
        return len(args) + len(kwargs) == 1  # where(condition) is nonzero
    if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
        return isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) \
            and kwargs.get("output_size") is None
    return False


def _allowed_or_site():
    """``None`` where the operation runs in CPU-only code, else its call site ``(file, function, line)``: the
    innermost frame in the project's code (``None`` too when there is none: torch's own)."""
    frames = []
    for frame in traceback.extract_stack()[:-2]:  # without this function and the mode's __torch_function__
        parts = frame.filename.replace(os.sep, "/").split("/")
        if len(parts) >= 2 and parts[-2] in ("lookahead", "lookahead_kernels"):
            frames.append((parts[-1], frame.name, frame.lineno, frame.line or ""))
    if not frames or any((f, n) in CPU_ONLY for f, n, _, _ in frames):
        return None
    file, name, line, text = frames[-1]
    return None if 'device.type == "cpu"' in text else (file, name, line)


def _storages(value):
    """The data pointers of the tensors in ``value`` (nested lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage().data_ptr()]
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _storages(v)]
    if isinstance(value, dict):
        return [p for v in value.values() for p in _storages(v)]
    return []


class HostSyncGuard(TorchFunctionMode):
    """Records ``(file, function, line, operation)`` for every operation of ``_SYNCING`` (and boolean-mask
    indexing, ``torch.where(cond)``, ``repeat_interleave`` without its output size) called from the
    project's code outside ``CPU_ONLY``.

    Also keeps, per use, the storages its operations read that they did not make (``outside``): a graph's state
    and buffers; a replay reads them where its capture did."""

    def __init__(self):
        super().__init__()
        self.found = []
        self.made: set = set()
        self.outside: set = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            site = _allowed_or_site()
            if site is not None:
                self.found.append((*site, getattr(func, "__name__", str(func))))
        self.outside.update(p for p in _storages((args, kwargs)) if p not in self.made)
        out = func(*args, **kwargs)
        self.made.update(_storages(out))
        return out


@pytest.fixture
def guarded(monkeypatch):
    """Runs every static step's finish under one :class:`HostSyncGuard` (the forward before it unguarded: on CUDA it
    is the model's own kernels) and returns it; ``guard.finishes`` lists the finishes run, ``guard.moved`` the
    finishes that read state at other addresses than the first finish of their graph did (which a replay would
    not see)."""
    guard = HostSyncGuard()
    guard.finishes = []  # (the finish's kind, its tree's size)
    guard.moved = []
    guard.advanced = False  # whether a step wrote its successor's inputs (lookahead.overlap)

    def step(self, buf, finish):
        guard.made, guard.outside = set(), set()
        if finish is not None and hasattr(finish, "prepare"):  # the inputs a graph makes before its forward
            with guard:
                finish.prepare(self._inputs(buf))
        logits = self._forward(buf)
        if finish is None:
            return logits
        shape = getattr(finish, "shape", None)
        guard.finishes.append((type(finish).__name__, shape.tree_budget if shape is not None else 0))
        # Inside the finish the C++ ops count as absent: a CPU then takes the torch code a GPU's graph holds (the
        # warps and draws) where it would take its own C++ walk and draw.
        guard.made.update(_storages(logits))  # a replay writes its logits where its capture did
        with guard, monkeypatch.context() as m:
            m.setattr(cpu_ops, "cpu_ops_available", lambda build=True: False)
            out = finish(logits, self._inputs(buf))
            if buf.advance:  # the next step's inputs, written in the graph (overlapped steps)
                guard.advanced = True
                self._advance(buf, *finish.next_inputs(out))
        # Per runner (its graphs), per graph as StepRunner keys them: nothing that graph's earlier runs did not
        # read (a tensor replaced rather than written in place shows up at a new address).
        read = self.__dict__.setdefault("_reads_seen_by_test", {})
        key = (buf.shape, None if buf.inputs.rows is None else buf.inputs.rows.numel(), finish.key)
        if key in read and not guard.outside <= read[key]:
            guard.moved.append((key, sorted(guard.outside - read[key])))
        read.setdefault(key, set()).update(guard.outside)
        return out

    monkeypatch.setattr(StepRunner, "_step", step)
    # The processors as a graph runs them: every rule on every step (an eager step skips those no row needs).
    start = LogitsProcessors.start
    monkeypatch.setattr(LogitsProcessors, "start", lambda self, state, sequences, counts, replayed, capacity, **kw:
                        start(self, state, sequences, counts, True, capacity, **kw))
    return guard


def test_the_guard_sees_what_a_capture_refuses():
    """The guard records a sync in the project's code, and not in CPU_ONLY's or on a CPU test's line."""
    from lookahead import sampling
    from lookahead_kernels.verify_ref import inverse_cdf_sample

    with HostSyncGuard() as guard:
        sampling.warp_logits(torch.randn(3, 5), sampling.SamplingParams(temperature=0.5, top_p=0.9))
        inverse_cdf_sample(torch.rand(2, 5), torch.rand(2, dtype=torch.float64))  # its CPU-only shortcut
    assert guard.found == []
    with HostSyncGuard() as guard:
        # a CPU branch whose sync is not on its device test's line: recorded (the static path's tests keep the
        # vocabulary under sampling.NUCLEUS_CANDIDATES, so that it never runs there)
        sampling.warp_logits(torch.randn(2, 2 * sampling.NUCLEUS_CANDIDATES), sampling.SamplingParams(top_p=0.9))
    assert [(f, n, op) for f, n, _, op in guard.found] == [("sampling.py", "_nucleus", "__bool__")]


@pytest.fixture(scope="module")
def tiny():
    return LlamaForCausalLM.from_hf(tiny_hf_model(max_position_embeddings=512))


STATIC = dict(cuda_graphs=False, _static_steps=True)
# a flat, GPU-like cost table: the automatic mode takes windows and trees
GPU_LIKE = LookaheadConfig(step_costs=((1, 0.010), (16, 0.0101), (64, 0.0102)))
SAMPLED = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
CALLS = {
    "greedy": {},
    "sampled": SAMPLED,
    "min_p, top_h, typical, eta": dict(do_sample=True, temperature=0.9, min_p=0.02, top_h=0.9, typical_p=0.9,
                                       eta_cutoff=0.01),
    "epsilon": dict(SAMPLED, epsilon_cutoff=0.001),
    "repetition penalties": dict(repetition_penalty=1.3, encoder_repetition_penalty=1.1),
    "n-gram rules": dict(no_repeat_ngram_size=3, encoder_no_repeat_ngram_size=4),
    "sequence bias, bad words": dict(sequence_bias={(5, 6): -2.0, (7,): 1.5}, bad_words_ids=[[8, 9], [10]]),
    "length rules": dict(min_new_tokens=6, suppress_tokens=[11, 12], begin_suppress_tokens=[13], forced_eos_token_id=1,
                         eos_token_id=1, exponential_decay_length_penalty=(4, 1.2), remove_invalid_values=True),
    "outputs": dict(SAMPLED, output_scores=True, output_logits=True, renormalize_logits=True,
                    return_dict_in_generate=True),
    "everything greedy": dict(repetition_penalty=1.2, no_repeat_ngram_size=4, sequence_bias={(3, 4): 1.0},
                              min_new_tokens=4, eos_token_id=1, output_scores=True, return_dict_in_generate=True),
}


@pytest.mark.parametrize("name", list(CALLS))
@pytest.mark.parametrize("la", [None, GPU_LIKE, LookaheadConfig(window=4, ngram=3, guess=4),
                                LookaheadConfig(device_tree=4)], ids=["plain", "auto", "fixed", "device-tree"])
def test_a_step_s_finish_holds_no_host_sync(tiny, guarded, name, la):
    """Every finish a static step runs, plain or lookahead, with each of generate's processors, warps and outputs,
    calls nothing a CUDA graph capture refuses, outside the CPU's own branches."""
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    ids = torch.cat([ids, ids], 1)  # repeats: the drafts find candidates, so tree steps run
    kwargs = dict(CALLS[name])
    if kwargs.get("do_sample"):
        kwargs["generator"] = torch.Generator().manual_seed(0)
    tiny.generate(ids, max_new_tokens=16, lookahead=la, pad_token_id=0, **STATIC, **kwargs)
    tiny.generate(ids[:, 1:], max_new_tokens=12, lookahead=la, pad_token_id=0, **STATIC, **kwargs)  # a later call
    assert guarded.finishes
    if la is None or la.device_tree:  # plain and device-tree steps overlap where nothing needs each step's result
        overlapped = "outputs" not in name and not any(k in CALLS[name] for k in (
            "repetition_penalty", "no_repeat_ngram_size", "sequence_bias", "min_new_tokens"))
        assert guarded.advanced == overlapped
    assert not guarded.moved, f"a finish read state its graph's capture did not: {guarded.moved[:3]}"
    if la is not None:
        assert any(kind in ("StepVerifier", "DeviceTreeFinish") and nodes for kind, nodes in guarded.finishes), \
            "no tree step ran"
    assert not guarded.found, "\n".join(f"{f}:{line} in {fn}: {op}" for f, fn, line, op in sorted(set(guarded.found)))
