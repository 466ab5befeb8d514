"""transformers' ``repetition_penalty`` (and ``encoder_repetition_penalty``, :class:`PromptPenalty`) on a step's
logits rows, for plain and lookahead steps alike.

Each row's scores for the tokens already in its context are penalised as transformers'
``RepetitionPenaltyLogitsProcessor`` does (``s / p`` where ``s > 0``, ``s * p`` otherwise), before temperature,
top-k and top-p. A row's context is the committed sequence (prompt included) for ``x``'s row, and for a tree
node's row also the tokens on the node's path: its ancestors and itself, ``j <= i < end[j]``
(``shared/design/draft-tree.md``), which are what that row's token would follow. The committed tokens are a
boolean ``seen [B, vocab]`` kept on the device beside the step's inputs; the path's are computed from the tree's
``end`` and tokens, so that greedy verification under the penalty accepts exactly what plain decoding under it
would emit, and rejection sampling keeps its distribution.
"""

from __future__ import annotations

import torch

from lookahead_kernels.tree import ancestor_matrix


def penalise(scores: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' penalty of one score (elementwise; float32 as the logits are)."""
    return torch.where(scores < 0, scores * penalty, scores / penalty)


def penalise_rows(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits [B, R, V]`` (or ``[B, V]``) with each row's ``seen [B, V]`` tokens penalised (a new tensor)."""
    mask = seen[:, None, :] if logits.dim() == 3 else seen
    return torch.where(mask, penalise(logits, penalty), logits)


def penalise_tree(node_logits: torch.Tensor, seen: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
                  penalty: float) -> torch.Tensor:
    """``node_logits [B, N, V]`` of a tree's nodes, each row penalised for ``seen [B, V]`` and its path's tokens.

    ``tokens``: int64 ``[B, N]``, the nodes' tokens; ``end``: int64 ``[N]`` or ``[B, N]``, their subtree ends.
    Padding nodes (after the real ones) are never a real node's ancestor; their own rows are ignored later."""
    B, N, _ = node_logits.shape
    out = penalise_rows(node_logits, seen, penalty)
    if N == 0:
        return out
    on_path = ancestor_matrix(end.expand(B, N)).transpose(1, 2)  # [B, i, j]: j on node i's path
    same = tokens[:, :, None] == tokens[:, None, :]  # [B, j', j]
    # Whether node j's token lies on node i's path: the same for every j of one token, so the scatter below
    # writes one value per (row, token) however often the token occurs.
    token_on_path = torch.bmm(on_path.float(), same.float()) > 0
    fresh = ~seen.gather(1, tokens)  # [B, j]: not penalised already
    columns = tokens[:, None, :].expand(B, N, N)
    scores = out.gather(2, columns)
    return out.scatter_(2, columns, torch.where(token_on_path & fresh[:, None, :], penalise(scores, penalty),
                                                scores))


class RepetitionPenalty:
    """A call's penalty and each row's committed tokens, ``seen``: bool ``[B, vocab]`` on the model's device.

    :meth:`start` takes a factory of the tensor ``seen`` is kept in and fills it from the rows' sequences;
    :meth:`add` marks each step's committed tokens; :meth:`keep` follows the eager loop dropping finished rows."""

    def __init__(self, penalty: float, vocab_size: int):
        self.penalty = float(penalty)
        self.vocab_size = vocab_size
        self.seen: torch.Tensor | None = None

    def start(self, state, sequences: list[list[int]], counts: list[int], replayed: bool) -> None:
        """``state(name, shape, dtype)``: the tensor ``seen`` is kept in (a runner's under CUDA graphs, whose
        address a graph holds, or the call's own); filled from the rows' ``sequences`` (the counts of new tokens
        and whether steps are replayed do not matter to it)."""
        self.seen = state("repetition:seen", (len(sequences), self.vocab_size), torch.bool)
        self.seen.zero_()
        self.add(sequences, counts)

    def restart(self, rows: list[int], sequences: list[list[int]], counts: list[int]) -> None:
        """Batch rows ``rows`` hold new ``sequences`` (a finished row's place refilled): their marks from those."""
        _mark_again(self.seen, rows, sequences)

    def add(self, tokens: list[list[int]], counts: list[int]) -> None:
        """Marks ``tokens[b]`` for each row ``b`` (``counts`` do not matter here)."""
        _mark(self.seen, range(len(tokens)), tokens)

    def keep(self, kept: list[int]) -> None:
        self.seen = self.seen[torch.as_tensor(kept, device=self.seen.device)]

    @property
    def key(self) -> tuple:
        return ("repetition", self.penalty)

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        return penalise_rows(logits, self.seen, self.penalty)

    def tree(self, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
             depth: torch.Tensor | None = None) -> torch.Tensor:
        return penalise_tree(node_logits, self.seen, tokens, end, self.penalty)


class PromptPenalty:
    """transformers' ``encoder_repetition_penalty`` (a decoder-only model's encoder ids are its prompt): the scores
    of each row's prompt tokens (the row's own, without a batch's left padding) get the penalty's inverse, which
    favours them: the same for every row a step chooses from, so a tree's nodes need no path."""

    def __init__(self, penalty: float, vocab_size: int):
        self.penalty = float(penalty)
        self.vocab_size = vocab_size
        self.seen: torch.Tensor | None = None

    @property
    def key(self) -> tuple:
        return ("prompt_penalty", self.penalty)

    def start(self, state, sequences: list[list[int]], counts: list[int], replayed: bool) -> None:
        """Marks each row's prompt: its sequence without its ``counts`` new tokens."""
        self.seen = state("prompt_penalty:seen", (len(sequences), self.vocab_size), torch.bool)
        self.seen.zero_()
        _mark(self.seen, range(len(sequences)), _prompts(sequences, counts))

    def restart(self, rows: list[int], sequences: list[list[int]], counts: list[int]) -> None:
        """Batch rows ``rows`` hold new ``sequences`` (a finished row's place refilled): their prompts' marks."""
        _mark_again(self.seen, rows, _prompts(sequences, counts))

    def add(self, tokens, counts) -> None:
        pass

    def keep(self, kept: list[int]) -> None:
        self.seen = self.seen[torch.as_tensor(kept, device=self.seen.device)]

    def rows(self, logits: torch.Tensor) -> torch.Tensor:
        return penalise_rows(logits, self.seen, 1 / self.penalty)

    def tree(self, node_logits: torch.Tensor, tokens: torch.Tensor, end: torch.Tensor,
             depth: torch.Tensor | None = None) -> torch.Tensor:
        return penalise_rows(node_logits, self.seen, 1 / self.penalty)


def _prompts(sequences: list[list[int]], counts: list[int]) -> list[list[int]]:
    """Each row's prompt: its sequence without its ``counts`` new tokens."""
    return [s[:len(s) - c] for s, c in zip(sequences, counts)]


def _mark(seen: torch.Tensor, rows, tokens: list[list[int]]) -> None:
    """Marks ``tokens[i]`` in row ``rows[i]`` of ``seen [B, V]``: one upload of flat indices and one index write."""
    V = seen.shape[1]
    flat = [b * V + v for b, t in zip(rows, tokens) for v in t]
    if flat:
        seen.view(-1)[torch.tensor(flat, device=seen.device)] = True


def _mark_again(seen: torch.Tensor, rows: list[int], tokens: list[list[int]]) -> None:
    """Rows ``rows`` of ``seen`` cleared, then marked with ``tokens`` (rows that now hold other sequences)."""
    seen[torch.as_tensor(rows, device=seen.device)] = False
    _mark(seen, rows, tokens)


def reference_penalised(logits_row: torch.Tensor, context: list[int], penalty: float) -> torch.Tensor:
    """The oracle: one row ``[V]`` penalised for the tokens of ``context``, as transformers does it."""
    ids = torch.tensor(sorted(set(context)), dtype=torch.long, device=logits_row.device)
    out = logits_row.clone()
    out[ids] = penalise(logits_row[ids], penalty)
    return out


__all__ = ["RepetitionPenalty", "PromptPenalty", "penalise", "penalise_rows", "penalise_tree", "reference_penalised"]
