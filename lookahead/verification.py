"""The "verify" part of a decoding step (``shared/design/decode-loop.md``, part 4) and the device half of part 5's
KV compaction, as one function of the step's logits run where they are.

:class:`StepVerifier` takes a step's logits and inputs and, on their device: verifies the tree (greedy or by
rejection sampling), picks the window's next guesses, takes the successor table's top next tokens, and moves
the accepted nodes' keys and values beside ``x`` (a function of the accepted path alone: no host decision is
needed). Everything the host needs from the step then comes back in one int32 tensor, read back once
(:meth:`StepVerifier.read`). Its shapes depend only on the step's shape, so a CUDA graph holds it with the
forward (:class:`lookahead.runner.StepRunner`): a replayed lookahead step launches nothing from Python between
the step's inputs and its read-back. Sampling reads its random numbers from an input buffer that one
``torch.rand`` fills before the step (:func:`step_uniforms`): a random op inside a graph would need
the generator's state registered with it, and would draw new numbers in each warm-up run that compacts the
cache before the capture.

Why compaction moved here from the commit part: it had to wait for the read-back and then launched about ten
copies and index tensors from Python between two replays (the H100 run of record measured verification alone,
launched from Python, at 110-250 us against 14-16 us of device time).
"""

from __future__ import annotations

import dataclasses

import torch

from .config import StepShape
from .step import logits_slices


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """What verification reads of a step besides its logits (device tensors; static buffers under a runner).

    Attributes:
        tokens: int64 ``[B, T]``, the step's tokens in layout order (tree nodes last).
        end: int64 ``[V]`` or ``[B, V]``, the tree's subtree ends (``TreeShape.end``); ``None`` without a tree.
        num_nodes: int64 ``[B]``, real (not padding) nodes per row.
        cache: the :class:`lookahead.model.KVCache` the step wrote.
        cache_len: int64 ``[B]``, each row's committed length (the slot of its ``x``).
        uniforms: float64 ``[B, U]`` in ``[0, 1)``, the step's random numbers (``U``: the finish's
            ``uniforms_per_row``); ``None`` for greedy decoding.
        depth: int64 ``[V]`` or ``[B, V]``, the tree's node depths (``TreeShape.depth``); ``None`` without a tree.
    """

    tokens: torch.Tensor
    end: torch.Tensor | None
    num_nodes: torch.Tensor
    cache: object
    cache_len: torch.Tensor
    uniforms: torch.Tensor | None = None
    depth: torch.Tensor | None = None


class Sampler:
    """Greedy or sampled choice of tokens from logits rows; holds the sampling parameters and generator.

    In a batch every row draws from the one generator, in row order: a row's samples differ from what the same
    seed gives it alone, but each row keeps exactly the model's distribution."""

    def __init__(self, do_sample: bool, temperature, top_k, top_p, generator, processors=None, outputs=(),
                 min_p=None, typical_p=None, epsilon_cutoff=None, eta_cutoff=None, top_h=None,
                 renormalize: bool = False):
        self.params = None
        self.generator = generator
        self._cpu_walk = None  # the greedy walk for float32 CPU logits, once looked up (_cpu_greedy_walk)
        # a lookahead.processors.LogitsProcessors, or None: applied to the rows a step's tokens are chosen from
        self.processors = processors if processors else None
        # which rows each emitted token's choice came from a step returns: "logits" (raw), "scores" (processed)
        self.outputs = tuple(outputs)
        self.renormalize = renormalize  # transformers' renormalize_logits: the scores reported are log-softmaxed
        if do_sample:
            from .sampling import SamplingParams  # sampling utilities live beside the verifier's reference

            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                    min_p=0.0 if min_p is None else min_p,
                                    typical_p=1.0 if typical_p is None else typical_p,
                                    epsilon_cutoff=0.0 if epsilon_cutoff is None else epsilon_cutoff,
                                    eta_cutoff=0.0 if eta_cutoff is None else eta_cutoff,
                                    top_h=0.0 if top_h is None else top_h)
            self.params = None if params.is_greedy else params

    @property
    def greedy(self) -> bool:
        return self.params is None

    @property
    def key(self):
        """What a captured graph of a finish depends on of the sampler: its parameters (``None``: greedy) and its
        logits processors' constants."""
        return (self.params, None if self.processors is None else self.processors.key, self.outputs,
                self.renormalize)

    def kept_rows(self, raw: torch.Tensor, processed: torch.Tensor) -> torch.Tensor | None:
        """float32 ``[B, K, R, vocab]``: of the rows ``[B, R, vocab]`` tokens were chosen from, those
        :attr:`outputs` names, in its order: ``raw`` logits, and the scores transformers reports (``processed``,
        then warped when sampling: :func:`lookahead.sampling.warp_scores`, then log-softmaxed with
        ``renormalize``); ``None`` when none is wanted."""
        if not self.outputs:
            return None
        kept = []
        for name in self.outputs:
            if name == "logits":
                kept.append(raw.float())
            else:
                from .sampling import warp_scores

                scores = processed.float() if self.greedy else warp_scores(processed, self.params)
                kept.append(torch.log_softmax(scores, dim=-1) if self.renormalize else scores)
        return torch.stack(kept, 1)

    def draw(self, out: torch.Tensor) -> torch.Tensor:
        """Fill float64 ``out`` with uniforms in ``[0, 1)`` from the generator, in place (one ``torch.rand``)."""
        return torch.rand(out.shape, dtype=out.dtype, device=out.device, generator=self.generator, out=out)

    def choose(self, logits: torch.Tensor, uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """LongTensor ``[...]``: one token per row of ``logits [..., V]``; sampling draws each row's token with
        ``uniforms [...]`` (float64) where given, else from the generator."""
        lead = logits.shape[:-1]
        logits = logits.reshape(-1, logits.shape[-1])
        if self.greedy:
            if logits.device.type == "cuda":
                from lookahead_kernels import row_argmax

                return row_argmax(logits).reshape(lead)
            return logits.argmax(-1).reshape(lead)
        from .sampling import sample_logits

        u = None if uniforms is None else uniforms.reshape(-1)
        return sample_logits(logits, self.params, self.generator, uniforms=u).reshape(lead)

    def _cpu_greedy_walk(self, dtype: torch.dtype):
        """The greedy walk for CPU logits of ``dtype``: in C++ where the ops are loaded (float64 rows, which
        float32 could tie, excepted), else the torch reference. Resolved once a call: looked up each tree step it
        cost tens of microseconds of cold Python."""
        from lookahead_kernels import verify_tree_greedy_reference

        if dtype == torch.float64:
            return verify_tree_greedy_reference
        if self._cpu_walk is None:
            from lookahead_kernels.cpu_ops import cpu_ops_available

            if cpu_ops_available(build=False):
                from lookahead_kernels import verify_tree_greedy_cpu as walk
            else:
                walk = verify_tree_greedy_reference
            self._cpu_walk = walk
        return self._cpu_walk

    def verify_tree(self, x_logits, node_logits, tokens, end, num_nodes, max_accept: int, uniforms=None):
        """Verification of a batch's trees: ``(accept_len [B], path [B, max_accept], emitted [B, max_accept+1])``.

        ``x_logits [B, vocab]``, ``node_logits [B, V, vocab]``, ``tokens [B, V]``, ``end`` ``[V]`` or ``[B, V]``
        on the logits' device; ``num_nodes``: int64 ``[B]`` real nodes per row (the rest padding); ``uniforms``
        (sampling): float64 ``[B, V + 1]`` as ``draw_tree_uniforms`` lays them out, else drawn here."""
        device = x_logits.device
        cuda = device.type == "cuda"
        if self.greedy:
            if cuda:
                from lookahead_kernels import verify_tree_greedy as verify
            else:
                verify = self._cpu_greedy_walk(x_logits.dtype)
            return verify(x_logits, node_logits, tokens, end, num_nodes, max_accept)
        from lookahead_kernels import draw_tree_uniforms

        from .sampling import warp_logits

        if uniforms is None:
            uniforms = draw_tree_uniforms(tokens.shape[0], tokens.shape[1], device, self.generator)
        if cuda:
            from lookahead_kernels import verify_tree_sample as verify

            x_probs, node_probs = warp_logits(x_logits, self.params), warp_logits(node_logits, self.params)
        else:
            from lookahead_kernels.cpu_ops import cpu_ops_available

            if self.params.native and cpu_ops_available(build=False):  # the walk in C++, warping the rows it reads
                from lookahead_kernels import verify_tree_sample_cpu

                p = self.params
                return verify_tree_sample_cpu(x_logits, node_logits, tokens, end, num_nodes, max_accept,
                                              p.temperature, p.top_k, p.top_p, uniforms=uniforms, min_p=p.min_p)
            from lookahead_kernels import verify_tree_sample_reference as verify

            # One warp for every row: each torch op of it costs tens of microseconds on the CPU.
            rows = warp_logits(torch.cat([x_logits.unsqueeze(1), node_logits], 1), self.params)
            x_probs, node_probs = rows[:, 0], rows[:, 1:]
        return verify(x_probs, node_probs, tokens, end, num_nodes, max_accept, uniforms=uniforms)


@dataclasses.dataclass(frozen=True)
class StepReadBack:
    """A lookahead step's results on the host, per row of the batch.

    Attributes:
        accept_len: accepted tree nodes per row.
        nodes: per row, the accepted nodes' indices in the tree, root first.
        emitted: per row, the tokens emitted: the accepted nodes' tokens and the bonus token.
        guesses: per row, the window's next guesses (``W`` tokens).
        tops: int32 ``[B, 2, R, k]``, a view of the read-back: the top next tokens of the step's first ``R``
            logits rows, then their probabilities among the ``k`` as float32 bits (``None`` when the step took
            none; :func:`lookahead.successors.record_step` takes them as they are); rows past a row's real nodes
            are padding.
        kept: float32 ``[B, K, max_accept + 1, vocab]`` on the host, the rows each emitted token was chosen from
            (``Sampler.outputs``; rows past a row's emitted tokens are meaningless), or ``None``.
    """

    accept_len: list
    nodes: list
    emitted: list
    guesses: list
    tops: torch.Tensor | None
    kept: torch.Tensor | None = None


class StepVerifier:
    """Verification, the window's guesses, successor tops and KV compaction of one lookahead step shape.

    Args:
        sampler: the call's :class:`Sampler`.
        shape: the step's shape (``tree_budget``: its tree size, padding included; 0 for a step without a tree).
        max_accept: the most nodes a row may accept (at least its tree's depth; the tree size on a CUDA graph,
            whose shapes cannot follow each step's depth).
        successor_k: the successor table's ``k`` (0: none wanted).
        successor_rows: the logits rows whose tops are wanted (the first ``successor_rows``).

    The logits a step returns are ordered as :func:`lookahead.step.logits_slices` says (``x``, the window's last
    level, the tree's nodes).
    """

    def __init__(self, sampler: Sampler, shape: StepShape, max_accept: int, successor_k: int = 0,
                 successor_rows: int = 0):
        self.sampler = sampler
        self.shape = shape
        self.max_accept = max_accept if shape.tree_budget else 0
        self.successor_k = successor_k
        self.successor_rows = successor_rows if successor_k else 0
        self.window_rows, self.node_rows = logits_slices(shape.window, shape.levels, shape.tree_budget)
        self.lookahead_len = shape.window * shape.levels
        self._x_alone = shape.window == 1 and shape.levels == 1
        self.width = 2 + 2 * self.max_accept + shape.window

    @property
    def key(self) -> tuple:
        """What a captured graph of this verifier depends on besides the step shape."""
        return ("verify", self.max_accept, self.successor_k, self.successor_rows, self.sampler.key)

    @property
    def uniforms_per_row(self) -> int:
        """Random numbers a sampled step consumes per row: the tree's (``V + 1``, ``draw_tree_uniforms``'s layout;
        1 for the token after ``x`` without a tree), then one per window guess (none for a window of ``x`` alone,
        whose guess is the token chosen after it); 0 for greedy decoding."""
        if self.sampler.greedy:
            return 0
        return self.shape.tree_budget + 1 + (0 if self._x_alone else self.shape.window)

    def __call__(self, logits: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        """int32 ``[B, width + 2 R k]`` on the logits' device: per row its accepted length, path (``max_accept``,
        then -1), emitted tokens (``max_accept + 1``), the window's guesses (``W``), then the successor tops' ids
        and their float32 probabilities' bits. Compacts ``inputs.cache`` in place. Sampling reads
        ``inputs.uniforms`` (laid out as :attr:`uniforms_per_row` says)."""
        B, V = logits.shape[0], self.shape.tree_budget
        u = inputs.uniforms
        if not self.sampler.greedy and (u is None or tuple(u.shape) != (B, self.uniforms_per_row)):
            raise ValueError(f"a sampled step of shape {self.shape} needs uniforms [B={B}, {self.uniforms_per_row}], "
                             f"got {None if u is None else tuple(u.shape)}")
        la = self.lookahead_len
        x_logits, node_logits, node_tokens = logits[:, 0], logits[:, self.node_rows], inputs.tokens[:, la: la + V]
        processors = self.sampler.processors
        if processors is not None:  # the rows tokens are chosen from; the window's guesses need no exactness
            x_logits = processors.rows(x_logits)
            node_logits = processors.tree(node_logits, node_tokens, inputs.end, inputs.depth) if V else node_logits
        if V:
            accept_len, path, emitted = self.sampler.verify_tree(
                x_logits, node_logits, node_tokens, inputs.end, inputs.num_nodes, self.max_accept,
                None if u is None else u[:, : V + 1])
            inputs.cache.compact(inputs.cache_len, la, accept_len, path)
            kept = self._kept(logits, x_logits, node_logits, path)
        else:
            accept_len = torch.zeros(B, dtype=torch.long, device=logits.device)
            path = torch.empty(B, 0, dtype=torch.long, device=logits.device)
            emitted = self.sampler.choose(x_logits, None if u is None else u[:, 0])[:, None]
            kept = self.sampler.kept_rows(logits[:, :1], x_logits[:, None])
        if self._x_alone:
            # The one guess of a window that is x alone is a token after x: the one just chosen serves (greedy: the
            # same argmax; sampled: a draw of x's distribution, without warping its row a second time).
            guesses = emitted[:, :1]
        else:
            guesses = self.sampler.choose(logits[:, self.window_rows], None if u is None else u[:, V + 1:])
        parts = [accept_len[:, None], path, emitted, guesses]
        if self.successor_k:
            from .successors import SuccessorTable

            ids, probs = SuccessorTable.top(logits[:, : self.successor_rows], self.successor_k)
            parts.append(ids.reshape(B, -1))
        out = torch.cat(parts, dim=1).to(torch.int32)
        if self.successor_k:
            out = torch.cat([out, probs.reshape(B, -1).view(torch.int32)], dim=1)
        return out if kept is None else (out, kept)

    def next_inputs(self, out) -> tuple[torch.Tensor, torch.Tensor]:
        """From :meth:`__call__`'s result, on the device: each row's next ``x`` (its last emitted token) and how many
        tokens it emitted, int64 ``[B]`` each (a step runner's ``advance``)."""
        out = out[0] if isinstance(out, tuple) else out
        emitted = out[:, :1].long() + 1
        return out.gather(1, emitted + self.max_accept)[:, 0].long(), emitted[:, 0]

    def _kept(self, logits, x_logits, node_logits, path) -> torch.Tensor | None:
        """The rows the emitted tokens were chosen from: ``x``'s, then each accepted node's (``path``, ``-1``
        past the accepted ones: ``x``'s row again, ignored), as :meth:`Sampler.kept_rows` keeps them."""
        if not self.sampler.outputs:
            return None
        vocab = logits.shape[-1]
        taken = path.clamp_min(0)[..., None].expand(-1, -1, vocab)
        raw = torch.cat([logits[:, :1], logits[:, self.node_rows].gather(1, taken)], 1)
        processed = torch.cat([x_logits[:, None], node_logits.gather(1, taken)], 1)
        return self.sampler.kept_rows(raw, processed)

    def read_emitted(self, out) -> tuple[list[list[int]], torch.Tensor | None]:
        """``(emitted, kept)`` of :meth:`read` alone, for a step whose host learns nothing else from it (a device
        tree's, :mod:`lookahead.device_tree`): half :meth:`read`'s time. One copy to the host."""
        out, kept = out if isinstance(out, tuple) else (out, None)
        A = self.max_accept
        rows = out.cpu()[:, : 2 + 2 * A].tolist()
        return [r[1 + A: 2 + A + r[0]] for r in rows], None if kept is None else kept.cpu()

    def read(self, out: torch.Tensor) -> StepReadBack:
        """The host's view of ``out`` (:meth:`__call__`'s result): one copy to the host, the only sync of a step."""
        out, kept = out if isinstance(out, tuple) else (out, None)
        out = out.cpu()
        A, width = self.max_accept, self.width
        rows = out[:, :width].tolist()
        accept = [r[0] for r in rows]
        # The tops: ids, then as many float32 probabilities' bits (k may exceed a tiny vocabulary), read in place.
        tops = out[:, width:].view(out.shape[0], 2, self.successor_rows, -1) if self.successor_k else None
        return StepReadBack(accept_len=accept, nodes=[r[1: 1 + a] for r, a in zip(rows, accept)],
                            emitted=[r[1 + A: 2 + A + a] for r, a in zip(rows, accept)],
                            guesses=[r[2 + 2 * A: width] for r in rows], tops=tops,
                            kept=None if kept is None else kept.cpu())


class PlainChoice:
    """The "verify" part of a plain step: each row's next token from ``x``'s logits, int64 ``[B]``; with
    ``successor_k``, also the top ``successor_k`` of those logits for a successor table, ``(chosen [B], tops [B, 2,
    1, k] int32)`` (as :func:`lookahead.successors.pack_tops` packs them; the eager loop's plain steps within
    lookahead decoding; not in a graph);
    with the sampler's ``outputs``, the rows kept last (``[B, K, 1, vocab]``: :meth:`Sampler.kept_rows`)."""

    def __init__(self, sampler: Sampler, successor_k: int = 0):
        self.sampler = sampler
        self.successor_k = successor_k

    @property
    def key(self) -> tuple:
        return ("plain", self.successor_k, self.sampler.key)

    @property
    def uniforms_per_row(self) -> int:
        return 0 if self.sampler.greedy else 1

    def __call__(self, logits: torch.Tensor, inputs: StepInputs):
        u = inputs.uniforms
        processors = self.sampler.processors
        x_logits = logits[:, 0] if processors is None else processors.rows(logits[:, 0])
        chosen = self.sampler.choose(x_logits, None if u is None else u[:, 0])
        kept = self.sampler.kept_rows(logits[:, :1], x_logits[:, None])
        if not self.successor_k:
            return chosen if kept is None else (chosen, kept)
        from .successors import SuccessorTable, pack_tops

        tops = pack_tops(*SuccessorTable.top(logits[:, :1], self.successor_k))
        return (chosen, tops) if kept is None else (chosen, tops, kept)

    @staticmethod
    def next_inputs(out) -> tuple[torch.Tensor, torch.Tensor]:
        """From :meth:`__call__`'s result: each row's next ``x`` (the token chosen) and how many it emitted (1),
        int64 ``[B]`` each (a step runner's ``advance``)."""
        chosen = out[0] if isinstance(out, tuple) else out
        return chosen, torch.ones_like(chosen)

    def read(self, out) -> tuple[list[list[int]], torch.Tensor | None]:
        """``(emitted, kept)`` from :meth:`__call__`'s result: per row its one token, and with the sampler's
        ``outputs`` the rows it was chosen from (host)."""
        parts = out if isinstance(out, tuple) else (out,)  # chosen, [tops], [kept]
        return [[y] for y in parts[0].tolist()], parts[-1].cpu() if self.sampler.outputs else None


def step_uniforms(finish, batch_size: int, device, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """A step's random numbers for ``finish`` (a :class:`StepVerifier` or :class:`PlainChoice`), drawn now from its
    sampler's generator: float64 ``[batch_size, finish.uniforms_per_row]``, written into ``out`` when it has that
    shape (a runner's buffer, whose address a graph holds), else new; ``None`` for a finish that takes none."""
    count = finish.uniforms_per_row
    if not count:
        return None
    if out is None or tuple(out.shape) != (batch_size, count):
        out = torch.empty(batch_size, count, dtype=torch.float64, device=device)
    return finish.sampler.draw(out)
