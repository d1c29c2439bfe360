"""Where each token of a Megatron micro-batch sits, and how per-token values move in and out (pure torch).

verl's Megatron engine feeds GPTModel token ids in one of two layouts, a grid of (B, S) positions
(``verl/models/mcore/util.py``: ``preprocess_thd_engine`` / ``preprocess_bshd_engine``, verl 0.9.1,
context parallel size 1):

* THD (``use_remove_padding=True``): the samples are packed back to back into one row, B = 1.
  Sample i starts at ``cu_padded[i] = sum_{j<i} ceil(len_j / align) * align``; ``align`` is the
  tensor-parallel size (so that every sequence splits evenly over the TP ranks under sequence
  parallelism; larger with FP8). The positions between a sample's last token and the next start
  are padding (token id 0), and the buffer may end with extra padding (``total_align``).
* BSHD: one row per sample, B = bs, S = ``ceil(max_len / align) * align``, padding at the end of each row.

GPTModel turns this into sequence-first tensors: the embedding output is [S, B, H], and under
tensor-parallel *sequence parallelism* TP rank r holds only its rows [r S/tp, (r+1) S/tp)
(:func:`sequence_shard`; the scatter happens inside the embedding module). The logits come back
batch-first and full-length, [B, S, V/tp], with the vocabulary split over the TP ranks in rank
order. :class:`MegatronLayout` maps per-sample rows (prompt + response
tokens, as verl keeps them) into that grid and back; the score functions reduce an [S, B, H]
gradient to one number per position with the same definitions as ``verl_oar.core.gradient``.
No verl or megatron import: everything here is tested on the CPU with hand-built tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "MegatronLayout",
    "bshd_fp8_align",
    "bshd_layout",
    "gather_sequence_shards",
    "sequence_shard",
    "thd_layout",
    "token_scores",
]


@dataclass(frozen=True)
class MegatronLayout:
    """Positions of a micro-batch's tokens in the (B, S) grid the model sees.

    Token t of sample i sits at flat position ``starts[i] + t`` of the row-major grid, i.e. at
    (row, column) = divmod(starts[i] + t, cols). Every other position is padding.
    """

    lengths: tuple[int, ...]
    """tokens of each sample (prompt + response), in micro-batch order"""
    starts: tuple[int, ...]
    """flat (row-major) grid position of each sample's first token"""
    rows: int
    """B: 1 for THD, the number of samples for BSHD"""
    cols: int
    """S: the sequence length the model sees, padding included"""

    def __post_init__(self) -> None:
        if len(self.lengths) != len(self.starts):
            raise ValueError(f"{len(self.lengths)} lengths but {len(self.starts)} starts")
        ends = [s + n for s, n in zip(self.starts, self.lengths)]
        if any(n < 0 for n in self.lengths) or any(e > self.rows * self.cols for e in ends):
            raise ValueError(f"samples {self.lengths} at {self.starts} do not fit a ({self.rows}, {self.cols}) grid")

    @property
    def shape(self) -> tuple[int, int]:
        """(B, S)"""
        return self.rows, self.cols

    def flat_index(self, device: torch.device | str | None = None) -> Tensor:
        """(sum of lengths,) long: the flat grid position of every token, sample after sample."""
        parts = [torch.arange(s, s + n, dtype=torch.long) for s, n in zip(self.starts, self.lengths)]
        flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        return flat.to(device) if device is not None else flat

    def to_layout(self, rows: Sequence[Tensor], fill: float = 0) -> Tensor:
        """Per-sample rows -> the grid.

        Args:
            rows: one (len_i, *D) tensor per sample, same dtype and device, trailing dims D shared.
            fill: the value of padding positions.

        Returns:
            (B, S, *D) tensor on the rows' device.
        """
        if len(rows) != len(self.lengths):
            raise ValueError(f"{len(rows)} rows for a layout of {len(self.lengths)} samples")
        for i, (row, n) in enumerate(zip(rows, self.lengths)):
            if row.shape[0] != n:
                raise ValueError(f"row {i} has {row.shape[0]} positions, the layout expects {n}")
        first = rows[0]
        trailing = tuple(first.shape[1:])
        out = torch.full((self.rows * self.cols, *trailing), fill, dtype=first.dtype, device=first.device)
        out[self.flat_index(first.device)] = torch.cat(list(rows))
        return out.reshape(self.rows, self.cols, *trailing)

    def from_layout(self, grid: Tensor) -> list[Tensor]:
        """The grid -> per-sample rows: (B, S, *D) -> one (len_i, *D) tensor per sample."""
        if tuple(grid.shape[:2]) != self.shape:
            raise ValueError(f"grid has shape {tuple(grid.shape)}, the layout is {self.shape} + (...)")
        flat = grid.reshape(self.rows * self.cols, *grid.shape[2:])
        picked = flat[self.flat_index(grid.device)]
        return list(picked.split(list(self.lengths)))

    def owners(self) -> tuple[Tensor, Tensor]:
        """(sample, token): two (B, S) long grids, the sample and the token index within it of
        every position; -1 on padding."""
        sample = torch.full((self.rows * self.cols,), -1, dtype=torch.long)
        token = torch.full((self.rows * self.cols,), -1, dtype=torch.long)
        if self.lengths:
            flat = self.flat_index()
            counts = torch.tensor(self.lengths, dtype=torch.long)
            sample[flat] = torch.repeat_interleave(torch.arange(len(self.lengths)), counts)
            token[flat] = torch.cat([torch.arange(n) for n in self.lengths])
        return sample.reshape(self.shape), token.reshape(self.shape)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def thd_layout(lengths: Sequence[int], align: int = 1, total_align: int = 1) -> MegatronLayout:
    """The packed (THD) layout: one row, each sample padded to a multiple of ``align``.

    Args:
        lengths: tokens of each sample.
        align: every sample's slot is a multiple of this (verl: the TP size; ``lcm(16, TP)`` with FP8).
        total_align: the whole row is padded at its end to a multiple of this (verl: FP8's
            ``128 * TP``, or ``pad_to_length_bucket``; 1 for neither).
    """
    if align < 1 or total_align < 1:
        raise ValueError(f"align={align} and total_align={total_align} must be >= 1")
    slots = [_round_up(int(n), align) for n in lengths]
    starts = [0]
    for slot in slots[:-1]:
        starts.append(starts[-1] + slot)
    total = _round_up(sum(slots), total_align)
    return MegatronLayout(tuple(int(n) for n in lengths), tuple(starts[: len(slots)]), 1, total)


def bshd_layout(lengths: Sequence[int], align: int = 1, min_cols: int | None = None) -> MegatronLayout:
    """The padded (BSHD) layout: one row per sample, every row as long as the longest sample (or
    ``min_cols``, verl's ``forced_max_seqlen``), rounded up to a multiple of ``align`` (TP size)."""
    if align < 1:
        raise ValueError(f"align={align} must be >= 1")
    longest = max([int(n) for n in lengths], default=0)
    if min_cols is not None:
        longest = max(longest, int(min_cols))
    cols = _round_up(longest, align)
    starts = tuple(i * cols for i in range(len(lengths)))
    return MegatronLayout(tuple(int(n) for n in lengths), starts, len(lengths), cols)


def bshd_fp8_align(batch_size: int, tp_size: int) -> int:
    """The row alignment verl's BSHD packing uses with FP8 (``preprocess_bshd_engine``, CP = 1):
    ``batch_size * S`` must be a multiple of ``128 * TP`` and S one of TP."""
    total = 128 * tp_size
    return math.lcm(total // math.gcd(batch_size, total), tp_size)


def sequence_shard(x: Tensor, rank: int, world: int) -> Tensor:
    """The rows of a sequence-first tensor that TP rank ``rank`` holds under sequence parallelism.

    Args:
        x: [S, ...], S divisible by ``world``.

    Returns:
        x[rank * S / world : (rank + 1) * S / world] (a view).
    """
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank={rank} is not in a group of {world}")
    if x.shape[0] % world:
        raise ValueError(f"sequence length {x.shape[0]} does not split over {world} tensor-parallel ranks")
    size = x.shape[0] // world
    return x[rank * size : (rank + 1) * size]


def gather_sequence_shards(shards: Sequence[Tensor]) -> Tensor:
    """Inverse of :func:`sequence_shard`: the per-rank [S / tp, ...] shards, in TP-rank order
    (as ``torch.distributed.all_gather`` returns them), concatenated along the sequence -> [S, ...]."""
    if not shards:
        raise ValueError("no shards to gather")
    shape = tuple(shards[0].shape)
    for r, s in enumerate(shards):
        if tuple(s.shape) != shape:
            raise ValueError(f"shard {r} has shape {tuple(s.shape)}, shard 0 has {shape}")
    return torch.cat(list(shards), dim=0)


def token_scores(grad: Tensor, embeds: Tensor, saliency: str) -> Tensor:
    """One saliency per position from the gradient w.r.t. the input embeddings (OAR-G's step 3).

    Same definitions as ``verl_oar.core.gradient``: ``grad_x_input`` |<g_t, e_t>|,
    ``grad_norm`` ||g_t||_2, computed in float32 (float64 for float64 inputs).

    Args:
        grad: [S, B, H] (any layout whose last dim is the hidden size), dJ/de.
        embeds: same shape, the clean embeddings e.
        saliency: "grad_x_input" or "grad_norm".

    Returns:
        [S, B] scores >= 0, float32 (float64 for float64 inputs).
    """
    if tuple(grad.shape) != tuple(embeds.shape):
        raise ValueError(f"grad has shape {tuple(grad.shape)}, embeddings {tuple(embeds.shape)}")
    dtype = torch.promote_types(torch.promote_types(grad.dtype, embeds.dtype), torch.float32)
    g = grad.to(dtype)
    if saliency == "grad_x_input":
        return (g * embeds.to(dtype)).sum(dim=-1).abs()
    if saliency == "grad_norm":
        return torch.linalg.vector_norm(g, dim=-1)
    raise ValueError(f"saliency={saliency!r} is invalid: must be 'grad_x_input' or 'grad_norm'")
