"""GRPO groups: which rows of a batch are rollouts of one prompt.

verl hands an estimator ``index``, the rollout ``uid`` of every row (the rollouts of one prompt share it). verl's
v1 trainer may append synthetic padding rows to make a batch divisible (tag ``is_padding``; in verl 0.9.1 they
share one ``pad...`` uid of their own): each of those gets a group of its own here, so that no padding row ever
takes part in a real group's statistics (success rate, reward std, confidence).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

__all__ = ["group_ids"]


def group_ids(index: Sequence[Hashable], real_rows: Tensor | None = None) -> Tensor:
    """(bs,) int64 group number of every row, numbered in order of first appearance, from verl's ``index``.
    ``real_rows``: (bs,) bool, False on verl's synthetic padding rows (each then a group of its own); None: every
    row is real."""
    numbers: dict[Hashable, int] = {}
    out = []
    for i, key in enumerate(index):
        own = real_rows is not None and not bool(real_rows[i])
        out.append(numbers.setdefault(("verl_oar_padding", i) if own else ("uid", key), len(numbers)))
    return torch.tensor(out, dtype=torch.long)
