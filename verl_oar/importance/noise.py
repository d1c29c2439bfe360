"""Embedding noise for OAR-G's ``noisy_kl`` objective, drawn per sequence.

The noise eps_t ~ N(0, I) of a sequence is a function of (seed, step, the sequence's token ids)
only, so a sequence gets the same noise -- and therefore the same importance -- whether it is scored
alone or in a batch, packed or padded, in any micro-batch. Two identical sequences share noise.
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
    sequences: Sequence[Tensor], hidden_size: int, seed: int, step: int, dtype: torch.dtype = torch.float32
) -> list[Tensor]:
    """Standard-normal draws for each sequence.

    Args:
        sequences: token ids of each sequence, 1-D long tensors (the whole prompt + response).
        hidden_size: H, the embedding width.
        seed, step: mixed into every sequence's seed (fresh noise each training step).
        dtype: float32 or float64.

    Returns:
        one (len(sequence), H) tensor per sequence, on the CPU.
    """
    out = []
    for ids in sequences:
        generator = torch.Generator().manual_seed(sequence_seed(ids, seed, step))
        out.append(torch.randn(len(ids), hidden_size, generator=generator, dtype=dtype))
    return out
