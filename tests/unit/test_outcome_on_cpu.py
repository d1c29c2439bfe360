"""Outcome objectives (verl_oar.core.outcome): AS-SINGLE / AS-MEAN / AS-JOINT against per-segment loops,
layout independence (interleaved segments as in packed batches), empty segments, bf16 inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from verl_oar.core.outcome import (
    OUTCOMES,
    answer_log_likelihood,
    outcome_divergence,
    outcome_log_probs,
    outcome_statistic,
    padded_predicting_positions,
)

VOCAB = 11


def random_positions(seed: int, num_segments: int = 4, n: int = 13):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, VOCAB, generator=g, dtype=torch.float64) * 3
    segment = torch.randint(0, num_segments - 1, (n,), generator=g)       # last segment stays empty
    targets = torch.randint(0, VOCAB, (n,), generator=g)
    return logits, segment, targets


def per_segment(logits, segment, targets, num_segments):
    """Plain loop: (single, mean, phi) per segment; None for empty segments."""
    out = []
    for s in range(num_segments):
        idx = (segment == s).nonzero().squeeze(1)
        if idx.numel() == 0:
            out.append(None)
            continue
        z = logits[idx]
        single = torch.log_softmax(z[0], -1)
        mean = torch.log_softmax(z.mean(0), -1)
        phi = torch.log_softmax(z, -1)[torch.arange(len(idx)), targets[idx]].mean()
        out.append((single, mean, phi))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_against_per_segment_loop(seed):
    logits, segment, targets = random_positions(seed)
    ref = per_segment(logits, segment, targets, 4)
    single = outcome_log_probs(logits, segment, 4, "single")
    mean = outcome_log_probs(logits, segment, 4, "mean")
    phi = answer_log_likelihood(logits, targets, segment, 4)
    for name, value in (("single", single), ("mean", mean), ("phi", phi)):
        assert value.dtype == torch.float64, name                       # float64 logits stay float64
        assert outcome_statistic(logits.float(), targets, segment, 4, "mean").dtype == torch.float32
    for s, r in enumerate(ref):
        if r is None:
            continue
        torch.testing.assert_close(single[s], r[0])
        torch.testing.assert_close(mean[s], r[1])
        torch.testing.assert_close(phi[s], r[2])
    # the statistic dispatches to the same functions
    torch.testing.assert_close(outcome_statistic(logits, targets, segment, 4, "mean"), mean)
    torch.testing.assert_close(outcome_statistic(logits, targets, segment, 4, "joint"), phi)


def test_empty_segments_are_uniform_and_zero_never_nan():
    logits, segment, targets = random_positions(0)
    for outcome in ("single", "mean"):
        lp = outcome_log_probs(logits, segment, 4, outcome)
        torch.testing.assert_close(lp[3], torch.full((VOCAB,), -torch.log(torch.tensor(float(VOCAB))).item(),
                                                     dtype=lp.dtype))
    assert answer_log_likelihood(logits, targets, segment, 4)[3] == 0.0
    # nothing at all
    empty = torch.zeros(0, VOCAB)
    none = torch.zeros(0, dtype=torch.long)
    for outcome in OUTCOMES:
        stat = outcome_statistic(empty, none, none, 3, outcome)
        assert torch.isfinite(stat).all()
        assert (outcome_divergence(stat, stat, outcome) == 0).all()


def test_single_uses_the_first_position_of_each_segment_in_the_given_order():
    # packed layouts interleave nothing, but segments need not be sorted nor contiguous
    logits, segment, targets = random_positions(1)
    order = torch.randperm(len(segment), generator=torch.Generator().manual_seed(3))
    shuffled = outcome_log_probs(logits[order], segment[order], 4, "single")
    for s in range(3):
        first = order[(segment[order] == s).nonzero()[0, 0]]
        torch.testing.assert_close(shuffled[s], torch.log_softmax(logits[first], -1))
    # mean and phi do not depend on order
    torch.testing.assert_close(outcome_log_probs(logits[order], segment[order], 4, "mean"),
                               outcome_log_probs(logits, segment, 4, "mean"))
    torch.testing.assert_close(answer_log_likelihood(logits[order], targets[order], segment[order], 4),
                               answer_log_likelihood(logits, targets, segment, 4))


def test_divergence():
    logits, segment, targets = random_positions(2)
    noisy = logits + 0.3 * torch.randn_like(logits)
    for outcome in ("single", "mean"):
        p = outcome_statistic(logits, targets, segment, 4, outcome)
        q = outcome_statistic(noisy, targets, segment, 4, outcome)
        kl = outcome_divergence(p, q, outcome)
        ref = F.kl_div(q, p, log_target=True, reduction="none").sum(-1)
        torch.testing.assert_close(kl, ref)
        assert (kl[:3] > 0).all() and kl[3] == 0
        assert (outcome_divergence(p, p, outcome) == 0).all()
    phi = outcome_statistic(logits, targets, segment, 4, "joint")
    phi_noisy = outcome_statistic(noisy, targets, segment, 4, "joint")
    torch.testing.assert_close(outcome_divergence(phi, phi_noisy, "joint"), phi - phi_noisy)   # signed
    # zero-probability clean terms contribute 0, not NaN
    p = torch.log_softmax(torch.tensor([[0.0, -torch.inf, 1.0]]), -1)
    q = torch.log_softmax(torch.tensor([[0.0, 2.0, 1.0]]), -1)
    assert torch.isfinite(outcome_divergence(p, q, "mean")).all()


def test_bf16_logits_are_computed_in_float32():
    logits, segment, targets = random_positions(4)
    low = logits.to(torch.bfloat16)
    for outcome in OUTCOMES:
        got = outcome_statistic(low, targets, segment, 4, outcome)
        ref = outcome_statistic(low.float(), targets, segment, 4, outcome)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref)


def test_gradient_flows_through_every_outcome():
    logits, segment, targets = random_positions(5)
    logits = logits.float().requires_grad_(True)
    for outcome in OUTCOMES:
        (g,) = torch.autograd.grad(outcome_statistic(logits, targets, segment, 4, outcome).sum(), logits)
        assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_invalid_outcome():
    logits, segment, targets = random_positions(0)
    with pytest.raises(ValueError, match="outcome='median'"):
        outcome_statistic(logits, targets, segment, 4, "median")
    with pytest.raises(ValueError, match="joint"):
        outcome_log_probs(logits, segment, 4, "joint")


def test_padded_predicting_positions():
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]])
    answer = torch.tensor([[0, 0, 0, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.bool)
    predict, targets, segment = padded_predicting_positions(ids, answer)
    assert predict.tolist() == [[False, False, True, True, False], [True, True, False, False, False]]
    assert targets[predict].tolist() == [8, 9, 2, 3]
    assert segment[predict].tolist() == [0, 0, 1, 1]
