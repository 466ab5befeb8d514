"""Steps launched before the last one is read: the host's work on one step's result runs while the device runs
the next step (issue 11's "one read-back per step, overlapped").

Why: a graph-replayed step of a small model is about a millisecond of device time (SmolLM2 on the H200), and the
host's work around it (reading the result back, committing each row's tokens, packing the next step's inputs:
87-160 us a 16-row plain step on this project's CPU, 183-246 us a device-tree step, about twice that on the H200's
host) is time the device sits idle through when each step waits for the last one's read-back
(``bench/MEASUREMENTS.md``, "Overlapped steps"). Where the
next step's inputs follow from this step's result alone, on the device, the host need not wait: a plain step
feeds each row's chosen token next, a device-tree step (:mod:`lookahead.device_tree`) its last emitted token, at
a cache length grown by what it emitted. The step runner writes them (:meth:`StepRunner.run`'s ``advance``), so
the host launches step ``k + 1`` and only then reads step ``k``'s result, copied out without waiting into one of
two pinned host buffers.

What it costs: when the host learns that a row has stopped, the step after has already run for it; that step's
tokens for the row are dropped (its keys and values lie past the row's end, where nothing reads them; the cache
holds one step more for it), and a sampled call's later draws differ from a step-by-step call's (the same
distribution). No step is launched when every row ends with the one in flight (``generate``). Anything
the host must change (a row refilled, parked or moved) waits for the step in flight (:meth:`OverlappedSteps.drain`)
and then writes every row's inputs anew (:attr:`OverlappedSteps.stale`).
"""

from __future__ import annotations

import time

import torch


class _ReadBack:
    """A step's result on its way to the host: on CUDA copied without waiting into a pinned buffer (two of them,
    so that one step's copy never overwrites the buffer the host is reading), with an event marking its arrival;
    elsewhere the result itself (an eager step's result is a tensor of its own, already on the host)."""

    def __init__(self):
        self._buffers: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Event]]] = {}  # per result: two (buffer, event)
        self._turn = 0

    def start(self, out: torch.Tensor):
        if out.device.type != "cuda":
            return out, None
        key = (tuple(out.shape), out.dtype)
        if key not in self._buffers:
            self._buffers[key] = [(torch.empty(out.shape, dtype=out.dtype, pin_memory=True), torch.cuda.Event())
                                  for _ in range(2)]
        self._turn ^= 1
        host, arrived = self._buffers[key][self._turn]
        host.copy_(out, non_blocking=True)
        arrived.record()
        return host, arrived

    @staticmethod
    def wait(copy) -> torch.Tensor:
        host, arrived = copy
        if arrived is not None:
            arrived.synchronize()
        return host


class OverlappedSteps:
    """A ``generate`` call's steps that advance on the device (plain, or device-tree steps), launched one step ahead
    of the host's reading of them.

    Args:
        runner: the call's :class:`lookahead.runner.StepRunner` (:meth:`moved` when the call takes another).
        shape: the step's :class:`lookahead.config.StepShape` (``x`` alone, or ``x`` before a tree).
        finish: the step's finish (a :class:`lookahead.verification.PlainChoice` or
            :class:`lookahead.device_tree.DeviceTreeFinish`), which gives ``next_inputs`` on the device and
            ``read(result) -> (emitted, kept)`` on the host; its result's first tensor is what is read back.
        pack: ``pack(rows) -> dict``: the step's inputs from the rows' ``x`` and cache lengths, as keyword arguments
            of :meth:`StepRunner.run` (``packed`` and those that pick the buffers): written when :attr:`stale`.
    """

    def __init__(self, runner, shape, finish, pack):
        self.runner, self.shape, self.finish = runner, shape, finish
        self._pack = pack
        self._rows = None  # the logits rows the step runs with (its buffers' key)
        self._read = _ReadBack()
        self._in_flight = None  # (rows, read-back) of the step launched and not yet read
        # Seconds in the runner's calls and in read-back waits: the step's own time (on a CPU its forward runs in
        # the call), which the loop's host clock leaves out, as it leaves out a step-by-step step's run.
        self.device_seconds = 0.0
        self.stale = True  # the device's inputs no longer follow from the last step: write them from the rows

    @property
    def pending(self) -> bool:
        """Whether a step runs whose result the host has not read."""
        return self._in_flight is not None

    def launch(self, rows: list, live: list[bool]):
        """Launch a step of ``rows`` (``live``: which of them move on; parked rows stay where they are), then read
        the step launched before it. Returns ``(rows, emitted)`` of that step, or ``None`` when none was in
        flight."""
        if self.stale:
            inputs = self._pack(rows)
            self._rows = inputs.get("logits_rows")
            self.runner.set_live(live)
            started = time.perf_counter()
            out = self.runner.run(self.shape, finish=self.finish, advance=True, **inputs)
            self.stale = False
        else:
            started = time.perf_counter()
            out = self.runner.replay(self.shape, self.finish, self._rows)
        self.device_seconds += time.perf_counter() - started
        result = out[0] if isinstance(out, tuple) else out
        previous, self._in_flight = self._in_flight, (list(rows), self._read.start(result))
        return None if previous is None else self._result(previous)

    def drain(self):
        """Wait for the step in flight: its ``(rows, emitted)``, or ``None`` when none is. The next launch writes
        every row's inputs anew."""
        previous, self._in_flight = self._in_flight, None
        self.stale = True
        return None if previous is None else self._result(previous)

    def moved(self, runner, finish) -> None:
        """The call moved to ``runner``, where its steps finish with ``finish`` (nothing may be in flight)."""
        if self._in_flight is not None:
            raise ValueError("OverlappedSteps.moved needs no step in flight: drain() first")
        self.runner, self.finish, self.stale = runner, finish, True

    def _result(self, in_flight):
        rows, copy = in_flight
        started = time.perf_counter()
        host = self._read.wait(copy)
        self.device_seconds += time.perf_counter() - started
        return rows, self.finish.read(host)[0]
