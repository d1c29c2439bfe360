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
