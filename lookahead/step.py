"""Building one packed lookahead step: its tokens, positions, layout and the logit rows read back."""

from __future__ import annotations

import dataclasses

import torch

from lookahead_kernels import StepLayout

from .draft import DraftTree


@dataclasses.dataclass(frozen=True)
class Step:
    """One step's inputs.

    Attributes:
        tokens: LongTensor ``[T]`` in layout order (``x``, lookahead levels, tree nodes).
        positions: LongTensor ``[T]``, absolute positions (``p + layout.position_offsets()``).
        layout: the :class:`StepLayout`.
        logits_rows: LongTensor ``[R]``: step rows whose logits are computed, in this order: ``x``, the last
            lookahead level (``W`` rows, minus ``x`` when there is a single level), then every tree node.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    layout: StepLayout
    logits_rows: torch.Tensor

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


def build_step(x: int, position: int, lookahead_tokens: torch.Tensor, levels: int, window: int,
               tree: DraftTree | None, device) -> Step:
    """Pack ``x``, the window's ``levels x window`` tokens (``x`` first) and the tree's nodes into one step.

    Args:
        x: the last committed token, fed at ``position``.
        lookahead_tokens: LongTensor ``[levels * window]`` with ``x`` at index 0.
        tree: the step's :class:`DraftTree` (``None`` or empty: no verification branch).
    """
    shape = tree.shape.to(device) if tree is not None and tree.size else None
    layout = StepLayout(window, levels, shape)
    parts = [lookahead_tokens.reshape(-1)]
    if shape is not None:
        parts.append(tree.tokens)
    tokens = torch.cat(parts).to(device)
    last = list(layout.last_level_rows())
    rows = ([] if levels == 1 else [0]) + last + list(range(layout.lookahead_len, layout.T))
    return Step(
        tokens=tokens,
        positions=(position + layout.position_offsets(device)).to(device),
        layout=layout,
        logits_rows=torch.tensor(rows, dtype=torch.long, device=device),
    )
