"""OAR-G's per-sequence embedding noise (verl_oar.core.noise): drawn only at the masked
(reasoning) positions, a function of (seed, step, tokens, mask) alone, so batching cannot change it."""

from __future__ import annotations

import torch

from verl_oar.core.noise import layout_noise, sequence_noise, sequence_seed


def _sequences():
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 1000, (n,), generator=g) for n in (12, 7, 12)]
    ids[2] = ids[0].clone()                                     # a duplicate sequence
    masks = [torch.zeros(len(x), dtype=torch.bool) for x in ids]
    for mask, (a, b) in zip(masks, [(3, 9), (2, 5), (3, 9)]):
        mask[a:b] = True
    return ids, masks


def test_noise_is_drawn_only_at_masked_positions_from_the_sequences_own_generator():
    ids, masks = _sequences()
    rows = sequence_noise(ids, 16, seed=4, step=2, where=masks)
    for x, mask, row in zip(ids, masks, rows):
        assert row.shape == (len(x), 16) and row.dtype == torch.float32
        assert (row[~mask] == 0).all()
        g = torch.Generator().manual_seed(sequence_seed(x, 4, 2))
        assert torch.equal(row[mask], torch.randn(int(mask.sum()), 16, generator=g))  # plain reference


def test_noise_does_not_depend_on_the_batch_and_changes_with_seed_and_step():
    ids, masks = _sequences()
    together = sequence_noise(ids, 8, seed=1, step=5, where=masks)
    alone = [sequence_noise([x], 8, seed=1, step=5, where=[m])[0] for x, m in zip(ids, masks)]
    reordered = sequence_noise(ids[::-1], 8, seed=1, step=5, where=masks[::-1])[::-1]
    for a, b, c in zip(together, alone, reordered):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(together[0], together[2])                 # identical sequences share noise
    assert not torch.equal(together[0], sequence_noise(ids[:1], 8, seed=2, step=5, where=masks[:1])[0])
    assert not torch.equal(together[0], sequence_noise(ids[:1], 8, seed=1, step=6, where=masks[:1])[0])


def test_no_mask_draws_every_position_and_float64_is_supported():
    ids, _ = _sequences()
    full = sequence_noise(ids[:1], 4, seed=0, step=0, dtype=torch.float64)[0]
    g = torch.Generator().manual_seed(sequence_seed(ids[0], 0, 0))
    assert torch.equal(full, torch.randn(len(ids[0]), 4, generator=g, dtype=torch.float64))
    empty = sequence_noise(ids[:1], 4, seed=0, step=0, where=[torch.zeros(len(ids[0]), dtype=torch.bool)])[0]
    assert (empty == 0).all()


def test_layout_noise_equals_the_rows_laid_out_packed_or_padded():
    ids, masks = _sequences()
    masks[1] = torch.tensor([0, 1, 0, 1, 1, 0, 1], dtype=torch.bool)       # holes (multi-turn): scattered
    rows = sequence_noise(ids, 6, seed=2, step=3, where=masks)
    packed_mask = torch.cat(masks)[None]
    packed = layout_noise(ids, masks, packed_mask, 6, seed=2, step=3)
    assert torch.equal(packed[0], torch.cat(rows))
    padded_mask = torch.nn.utils.rnn.pad_sequence(masks, batch_first=True)
    padded = layout_noise(ids, masks, padded_mask, 6, seed=2, step=3)
    assert torch.equal(padded, torch.nn.utils.rnn.pad_sequence(rows, batch_first=True))
    try:
        layout_noise(ids, masks, padded_mask[:1], 6, seed=2, step=3)
    except ValueError as error:
        assert "positions" in str(error)
    else:
        raise AssertionError("a layout that does not hold the masked positions must be refused")
