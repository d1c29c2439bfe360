"""Embedding noise for OAR-G's ``noisy_kl`` objective, drawn per sequence on the model's device.

The noise eps_t ~ N(0, I) of a sequence is a function of (seed, step, the sequence's token ids,
which of its positions get noise) and of the device type only (CPU and CUDA generators differ), so
a sequence gets the same noise -- and therefore the same importance -- whether it is scored alone or
in a batch, packed or padded, in any micro-batch. Two identical sequences share noise.

Only the positions that get noise (the reasoning tokens) are drawn, on the device the model runs
on: at the 7B recipe's shape (hidden 3584, 4k-token sequences, ~128 sequences per rank per step)
drawing whole sequences on the CPU and copying them was gigabytes of normals per step
(``benchmarks/noise_cost.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor


def sequence_seed(token_ids: Tensor | Sequence[int], seed: int, step: int) -> int:
    """A 63-bit seed from (seed, step, token ids): stable across processes and Python versions."""
    ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu().contiguous()
    digest = hashlib.blake2b(ids.numpy().tobytes(), digest_size=8, key=f"{seed}:{step}".encode()).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def sequence_noise(
    sequences: Sequence[Tensor],
    hidden_size: int,
    seed: int,
    step: int,
    where: Sequence[Tensor] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[Tensor]:
    """Standard-normal draws for each sequence, at the positions that get noise, zeros elsewhere.

    Args:
        sequences: token ids of each sequence, 1-D long tensors (the whole prompt + response).
        hidden_size: H, the embedding width.
        seed, step: mixed into every sequence's seed (fresh noise each training step).
        where: per sequence, a (len,) bool/0-1 mask of the positions to draw for (the reasoning
            tokens); None draws every position.
        device: where to draw (the model's device); None: the sequence's device.
        dtype: float32 or float64.

    Returns:
        one (len(sequence), H) tensor per sequence on ``device``: the k-th masked position holds
        the k-th row of ``randn(R, H)`` from a generator seeded by :func:`sequence_seed`; unmasked
        positions are 0.
    """
    out = []
    masks = where if where is not None else [None] * len(sequences)
    if len(masks) != len(sequences):
        raise ValueError(f"where has {len(masks)} masks for {len(sequences)} sequences")
    for ids, mask in zip(sequences, masks):
        dev = torch.device(device) if device is not None else ids.device
        generator = torch.Generator(device=dev).manual_seed(sequence_seed(ids, seed, step))
        if mask is None:
            out.append(torch.randn(len(ids), hidden_size, generator=generator, device=dev, dtype=dtype))
            continue
        if mask.shape != ids.shape:
            raise ValueError(f"noise mask has shape {tuple(mask.shape)}, expected {tuple(ids.shape)} like its sequence")
        positions = mask.to(device=dev, dtype=torch.bool)
        row = torch.zeros(len(ids), hidden_size, device=dev, dtype=dtype)
        count = int(positions.sum())
        if count:
            row[positions] = torch.randn(count, hidden_size, generator=generator, device=dev, dtype=dtype)
        out.append(row)
    return out


def layout_noise(
    sequences: Sequence[Tensor],
    where: Sequence[Tensor],
    layout_mask: Tensor,
    hidden_size: int,
    seed: int,
    step: int,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """The draws of :func:`sequence_noise`, placed straight into a batch layout (no per-sequence rows).

    Args:
        sequences, where: as in :func:`sequence_noise` (``where`` required).
        layout_mask: (rows, cols) bool, the same positions as ``where`` in the layout the model is fed
            (packed (1, total) or padded (B, T)), with the sequences in order: its row-major order lists
            sequence 0's masked positions first, in position order, then sequence 1's, and so on.
        hidden_size, seed, step, dtype: as in :func:`sequence_noise`.

    Returns:
        (rows, cols, H) on ``layout_mask``'s device: each sequence's draws at its masked positions,
        0 elsewhere. Equal to laying out :func:`sequence_noise`'s rows, with one buffer and one copy.
    """
    device = layout_mask.device
    out = torch.zeros(*layout_mask.shape, hidden_size, device=device, dtype=dtype)
    flat = out.view(-1, hidden_size)
    positions = layout_mask.reshape(-1).nonzero().squeeze(1).cpu()   # row-major: sequence by sequence
    cursor = 0
    for ids, mask in zip(sequences, where, strict=True):
        count = int(mask.sum())
        if not count:
            continue
        if cursor + count > positions.numel():
            raise ValueError(f"layout_mask has {positions.numel()} positions, fewer than the sequences' masks")
        first, last = int(positions[cursor]), int(positions[cursor + count - 1])
        generator = torch.Generator(device=device).manual_seed(sequence_seed(ids, seed, step))
        if last - first + 1 == count:   # contiguous (the usual reasoning span): drawn in place, no copy
            torch.randn(count, hidden_size, generator=generator, device=device, dtype=dtype, out=flat[first : last + 1])
        else:
            flat[positions[cursor : cursor + count].to(device)] = torch.randn(
                count, hidden_size, generator=generator, device=device, dtype=dtype
            )
        cursor += count
    if cursor != positions.numel():
        raise ValueError(f"layout_mask has {positions.numel()} positions but the sequences' masks have {cursor}")
    return out
