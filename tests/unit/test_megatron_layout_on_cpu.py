"""The pure parts of OAR on verl's Megatron engine (``verl_oar.engines.megatron.layout``), on hand-built tensors.

Known answers first; then equivalence with straightforward loops that restate verl's packing
(``preprocess_thd_engine`` / ``preprocess_bshd_engine`` at context parallel size 1, verl 0.9.1) and
a per-token loop for the scores, over fresh random inputs, with tensor-parallel sequence
parallelism simulated by slicing the sequence-first tensor into TP = 1, 2, 4 shards.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_oar.engines.megatron.layout import (
    bshd_fp8_align,
    bshd_layout,
    gather_sequence_shards,
    sequence_shard,
    thd_layout,
    token_scores,
)

# -- known answers ------------------------------------------------------------------------------


def test_thd_layout_hand_built():
    layout = thd_layout([3, 5, 1], align=4)
    assert layout.starts == (0, 4, 12) and layout.shape == (1, 16)
    sample, token = layout.owners()
    assert sample.tolist() == [[0, 0, 0, -1, 1, 1, 1, 1, 1, -1, -1, -1, 2, -1, -1, -1]]
    assert token.tolist() == [[0, 1, 2, -1, 0, 1, 2, 3, 4, -1, -1, -1, 0, -1, -1, -1]]
    assert thd_layout([3, 5, 1], align=4, total_align=32).shape == (1, 32)  # extra padding at the end only
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8]), torch.tensor([9])]
    assert layout.to_layout(rows, fill=0).tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 8, 0, 0, 0, 9, 0, 0, 0]]


def test_bshd_layout_hand_built():
    layout = bshd_layout([3, 5], align=4)
    assert layout.shape == (2, 8) and layout.starts == (0, 8)
    grid = layout.to_layout([torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7, 8])], fill=-1)
    assert grid.tolist() == [[1, 2, 3, -1, -1, -1, -1, -1], [4, 5, 6, 7, 8, -1, -1, -1]]
    assert bshd_layout([3, 5], align=4, min_cols=9).shape == (2, 12)  # verl's forced_max_seqlen, then aligned


def test_sequence_shards_hand_built():
    x = torch.arange(8).reshape(8, 1)
    assert sequence_shard(x, 0, 2).flatten().tolist() == [0, 1, 2, 3]
    assert sequence_shard(x, 1, 2).flatten().tolist() == [4, 5, 6, 7]
    assert sequence_shard(x, 3, 4).flatten().tolist() == [6, 7]
    assert torch.equal(gather_sequence_shards([sequence_shard(x, r, 4) for r in range(4)]), x)
    with pytest.raises(ValueError, match="does not split over 3"):
        sequence_shard(x, 0, 3)
    with pytest.raises(ValueError, match="shard 1 has shape"):
        gather_sequence_shards([x[:4], x[:3]])


def test_token_scores_hand_built():
    g = torch.tensor([[[1.0, 2.0]], [[0.0, 3.0]]])  # [S=2, B=1, H=2]
    e = torch.tensor([[[3.0, -4.0]], [[5.0, 1.0]]])
    assert token_scores(g, e, "grad_x_input").tolist() == [[5.0], [3.0]]   # |3 - 8|, |0 + 3|
    torch.testing.assert_close(token_scores(g, e, "grad_norm"), torch.tensor([[math.sqrt(5.0)], [3.0]]))
    assert token_scores(g.bfloat16(), e.bfloat16(), "grad_x_input").dtype == torch.float32
    assert token_scores(g.double(), e.double(), "grad_norm").dtype == torch.float64
    with pytest.raises(ValueError, match="saliency"):
        token_scores(g, e, "grad_squared")


def test_layout_refuses_rows_that_do_not_fit():
    layout = thd_layout([3, 2], align=2)
    with pytest.raises(ValueError, match="row 1 has 3 positions"):
        layout.to_layout([torch.zeros(3), torch.zeros(3)])
    with pytest.raises(ValueError, match="grid has shape"):
        layout.from_layout(torch.zeros(2, 6))


# -- equivalence with loops, fresh random inputs ------------------------------------------------


def verl_thd_pack_loop(rows, tp, fp8=False, bucket=None):
    """verl's THD packing restated as a loop (preprocess_thd_engine, CP = 1): returns the packed
    (1, T) ids and, per packed position, (sample, token) or (-1, -1)."""
    align = tp
    lengths = [len(r) for r in rows]
    if fp8:
        per_seq, total_align = math.lcm(16, align), align * 128
        align = per_seq
    padded = [n + (align - n % align) % align for n in lengths]
    cu = [0]
    for p in padded:
        cu.append(cu[-1] + p)
    if fp8:
        cu[-1] += (total_align - cu[-1] % total_align) % total_align
    if bucket is not None:
        alignment = math.lcm(bucket, 1) if not fp8 else math.lcm(bucket, total_align)
        cu[-1] += (-cu[-1]) % alignment
    packed = torch.zeros(cu[-1], dtype=torch.long)
    owner = [(-1, -1)] * cu[-1]
    for i, r in enumerate(rows):
        packed[cu[i] : cu[i] + len(r)] = r
        for t in range(len(r)):
            owner[cu[i] + t] = (i, t)
    return packed.unsqueeze(0), owner


def verl_bshd_pack_loop(rows, tp, forced=None, fp8=False):
    """verl's BSHD packing restated (preprocess_bshd_engine, CP = 1): (bs, S) ids."""
    max_len = forced if forced is not None else max(len(r) for r in rows)
    max_len += (tp - max_len % tp) % tp
    if fp8:
        total = 128 * tp
        seq_align = math.lcm(total // math.gcd(len(rows), total), tp)
        max_len = -(-max_len // seq_align) * seq_align
    out = torch.zeros(len(rows), max_len, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def random_rows(generator, count, low=1, high=23):
    lengths = torch.randint(low, high, (count,), generator=generator).tolist()
    return [torch.randint(1, 1000, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_thd_layout_equals_verls_packing_loop(tp, fp8):
    generator = torch.Generator().manual_seed(1000 * tp + fp8)
    for trial in range(20):
        rows = random_rows(generator, int(torch.randint(1, 7, (1,), generator=generator)))
        bucket = 64 if trial % 3 == 0 else None
        want, owner = verl_thd_pack_loop(rows, tp, fp8=fp8, bucket=bucket)
        align, total_align = (math.lcm(16, tp), 128 * tp) if fp8 else (tp, 1)
        if bucket is not None:
            total_align = math.lcm(total_align, bucket)
        layout = thd_layout([len(r) for r in rows], align, total_align)
        assert torch.equal(layout.to_layout(rows, fill=0), want)
        sample, token = layout.owners()
        assert list(zip(sample[0].tolist(), token[0].tolist())) == owner
        assert all(torch.equal(a, b) for a, b in zip(layout.from_layout(want), rows))
        assert layout.cols % tp == 0  # every TP rank gets whole rows under sequence parallelism


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("fp8", [False, True])
def test_bshd_layout_equals_verls_padding_loop(tp, fp8):
    generator = torch.Generator().manual_seed(7 + tp + 10 * fp8)
    for trial in range(20):
        rows = random_rows(generator, int(torch.randint(1, 7, (1,), generator=generator)))
        forced = max(len(r) for r in rows) + trial % 5 if trial % 2 else None
        align = bshd_fp8_align(len(rows), tp) if fp8 else tp
        layout = bshd_layout([len(r) for r in rows], align, forced)
        assert torch.equal(layout.to_layout(rows, fill=0), verl_bshd_pack_loop(rows, tp, forced, fp8))
        assert all(torch.equal(a, b) for a, b in zip(layout.from_layout(layout.to_layout(rows)), rows))


def _layouts(lengths, tp):
    return {"thd": thd_layout(lengths, tp), "bshd": bshd_layout(lengths, tp)}


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("saliency", ["grad_x_input", "grad_norm"])
def test_sharded_scores_gathered_equal_a_per_token_loop(tp, saliency):
    """Per-sample gradient and embedding rows -> sequence-first grid -> TP shards (as each rank's
    embedding hook sees them under sequence parallelism) -> local scores -> all-gathered in rank
    order -> back to rows: each token's score equals the plain per-token formula."""
    generator = torch.Generator().manual_seed(tp * 31 + len(saliency))
    hidden = 5
    for _ in range(10):
        lengths = torch.randint(1, 19, (int(torch.randint(1, 6, (1,), generator=generator)),), generator=generator).tolist()
        grads = [torch.randn(n, hidden, generator=generator, dtype=torch.float64) for n in lengths]
        embeds = [torch.randn(n, hidden, generator=generator, dtype=torch.float64) for n in lengths]
        want = []
        for g, e in zip(grads, embeds):
            per_token = []
            for t in range(g.shape[0]):
                dot = sum(float(g[t, h]) * float(e[t, h]) for h in range(hidden))
                norm = math.sqrt(sum(float(g[t, h]) ** 2 for h in range(hidden)))
                per_token.append(abs(dot) if saliency == "grad_x_input" else norm)
            want.append(torch.tensor(per_token, dtype=torch.float64))
        for name, layout in _layouts(lengths, tp).items():
            g_sb = layout.to_layout(grads, 0.0).transpose(0, 1)   # [S, B, H], as GPTModel's embedding output
            e_sb = layout.to_layout(embeds, 0.0).transpose(0, 1)
            local = [token_scores(sequence_shard(g_sb, r, tp), sequence_shard(e_sb, r, tp), saliency) for r in range(tp)]
            full = gather_sequence_shards(local)                  # [S, B]
            got = layout.from_layout(full.transpose(0, 1))
            for i, (a, b) in enumerate(zip(got, want)):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{name} tp={tp} sample {i}")
            # without sequence parallelism every rank holds all rows: the same scores, no gather
            torch.testing.assert_close(token_scores(g_sb, e_sb, saliency), full)


@pytest.mark.parametrize("tp", [2, 4])
def test_noise_slice_of_a_rank_is_what_a_per_position_loop_expects(tp):
    """The per-sequence noise a TP rank adds to its local embedding rows: row l of rank r is packed
    position r * S / tp + l, which holds token t of sample i (noise_i[t]) or padding (0)."""
    generator = torch.Generator().manual_seed(tp)
    hidden = 3
    lengths = torch.randint(1, 15, (5,), generator=generator).tolist()
    noise = [torch.randn(n, hidden, generator=generator) for n in lengths]
    rows = [torch.randint(1, 99, (n,), generator=generator) for n in lengths]
    _, owner = verl_thd_pack_loop(rows, tp)
    layout = thd_layout(lengths, tp)
    grid = layout.to_layout(noise, 0.0).transpose(0, 1)  # [S, 1, H]
    per_rank = layout.cols // tp
    for r in range(tp):
        local = sequence_shard(grid, r, tp)
        for row in range(per_rank):
            i, t = owner[r * per_rank + row]
            expected = noise[i][t] if i >= 0 else torch.zeros(hidden)
            assert torch.equal(local[row, 0], expected), (r, row)
