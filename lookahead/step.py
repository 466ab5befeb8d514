"""Building one packed lookahead step for a batch of rows: tokens, positions, layout and the logit rows read back."""

from __future__ import annotations

import dataclasses

import torch

from lookahead_kernels import StepLayout
from lookahead_kernels.tree import TreeShape

from .draft import DraftTree


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's inputs, for ``B`` rows of one shape.

    Attributes:
        tokens: LongTensor ``[B, T]`` in layout order (``x``, lookahead levels, tree nodes).
        positions: LongTensor ``[B, T]``, absolute positions (``p + layout.position_offsets()`` per row).
        layout: the :class:`StepLayout` (its tree shared ``[V]`` for one row, ``[B, V]`` for several).
        logits_rows: LongTensor ``[R]``: step rows whose logits are computed, in this order: ``x``, the last
            lookahead level (``W`` rows, minus ``x`` when there is a single level), then every tree node.
        logits_tokens: LongTensor ``[B, R]`` on the host: the token fed at each of those rows.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    layout: StepLayout
    logits_rows: torch.Tensor
    logits_tokens: torch.Tensor

    @property
    def window_rows(self) -> slice:
        """Slice of the returned logits holding the last level, column 0 first."""
        # With one level, column 0 of the last level is x itself (returned logits row 0).
        start = 0 if self.layout.levels == 1 else 1
        return slice(start, start + self.layout.window)

    @property
    def node_rows(self) -> slice:
        """Slice of the returned logits holding the tree nodes, in node order."""
        start = self.layout.window + (0 if self.layout.levels == 1 else 1)
        return slice(start, start + self.layout.tree_size)


def build_step(positions: list[int], lookahead_tokens: torch.Tensor, levels: int, window: int,
               trees: list[DraftTree] | None, device) -> Step:
    """Pack each row's window (``levels x window`` tokens, ``x`` first) and tree nodes into one step.

    Args:
        positions: per row, the position ``p`` of its ``x``.
        lookahead_tokens: LongTensor ``[B, levels * window]``, ``x`` at column 0.
        trees: per row its :class:`DraftTree`, all of one size ``V`` (padded); ``None`` or ``V == 0``: no
            verification branch.
    """
    B = len(positions)
    shape = None
    if trees is not None and trees[0].size:
        if B == 1:
            shape = trees[0].shape.to(device)
        else:
            shape = TreeShape(torch.stack([t.shape.depth for t in trees]),
                              torch.stack([t.shape.end for t in trees])).to(device)
    layout = StepLayout(window, levels, shape)
    tokens = lookahead_tokens.reshape(B, -1)
    if shape is not None:
        tokens = torch.cat([tokens, torch.stack([t.tokens for t in trees])], dim=1)
    last = list(layout.last_level_rows())
    rows = ([] if levels == 1 else [0]) + last + list(range(layout.lookahead_len, layout.T))
    p = torch.tensor(positions, dtype=torch.long)[:, None]
    rows = torch.tensor(rows, dtype=torch.long)
    return Step(
        tokens=tokens.to(device),
        positions=(p + layout.position_offsets()).to(device).expand(B, layout.T),
        layout=layout,
        logits_rows=rows.to(device),
        logits_tokens=tokens[:, rows],
    )
