"""ACPO's advantage (verl_oar.core.acpo): docs/algo/acpo.md's bound check and hand example, its invariants
(sign, per-sequence budget before clipping, reduction to GRPO, monotonicity) on random batches against a
plain per-token loop, and bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_oar.core.acpo import ACPOConfig, acpo_advantages, acpo_stats, acpo_weights, entropy_bounds

NO_CLIP = dict(w_min=1e-9, w_max=1e9)


def test_bound_check():
    h_tilde, shannon, upper = entropy_bounds(torch.tensor([0.7, 0.2, 0.1], dtype=torch.float64))
    assert float(h_tilde) == pytest.approx(-math.log(0.7), abs=1e-12) == pytest.approx(0.3567, abs=1e-4)
    assert float(shannon) == pytest.approx(0.8018, abs=1e-4) and float(upper) == pytest.approx(0.8188, abs=1e-4)
    assert h_tilde <= shannon <= upper


@given(st.integers(2, 50), st.integers(0, 10_000))
@settings(max_examples=50, deadline=None)
def test_bounds_hold_on_random_distributions(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(8, vocab, generator=g, dtype=torch.float64) * 3, -1)
    h_tilde, shannon, upper = entropy_bounds(probs)
    assert (h_tilde <= shannon + 1e-12).all() and (shannon <= upper + 1e-12).all()


def test_hand_example_success_and_failure():
    h = torch.tensor([[0.1, 0.1, 1.0, 0.2]] * 2, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0])
    out = acpo_advantages(h, adv, torch.ones_like(h), ACPOConfig(beta=0.5, **NO_CLIP))
    torch.testing.assert_close(out.weights[0].double(), torch.tensor([0.6429, 0.6429, 1.9286, 0.7857], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(out.weights[1].double(), torch.tensor([1.1040, 1.1040, 0.7456, 1.0465], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    assert float(out.weights[0].sum()) == pytest.approx(4.0, abs=1e-6) == float(out.weights[1].sum())
    torch.testing.assert_close(out.advantages, adv[:, None].float() * out.weights)
    # the defaults' clip [0.5, 2] leaves this example alone
    torch.testing.assert_close(acpo_advantages(h, adv, torch.ones_like(h), ACPOConfig()).weights, out.weights)


def _loop(h, a, mask, cfg):
    """Plain per-row, per-token reference of docs/algo/acpo.md."""
    out = torch.zeros_like(h)
    for i in range(h.shape[0]):
        ts = [t for t in range(h.shape[1]) if mask[i, t]]
        if not ts:
            continue
        if a[i] == 0:
            continue
        g = {t: (max(float(h[i, t]), 0.0) if a[i] > 0 else math.exp(-max(float(h[i, t]), 0.0))) for t in ts}
        mean = sum(g.values()) / len(ts)
        w = {t: (1 - cfg.beta) + cfg.beta * (g[t] / mean if mean > 0 else 1.0) for t in ts}
        w = {t: min(max(v, cfg.w_min), cfg.w_max) for t, v in w.items()}
        if cfg.renormalize:
            total = sum(w.values())
            w = {t: v * len(ts) / total for t, v in w.items()}
        for t in ts:
            out[i, t] = float(a[i]) * w[t]
    return out


@given(st.integers(0, 10_000), st.sampled_from([0.0, 0.3, 0.5, 1.0]), st.booleans(), st.booleans())
@settings(max_examples=40, deadline=None)
def test_random_batches_match_a_per_token_loop_and_keep_sign_and_budget(seed, beta, clip, renormalize):
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(6, 9, generator=g, dtype=torch.float64) * 4
    mask = torch.rand(6, 9, generator=g) > 0.3
    a = torch.randn(6, generator=g, dtype=torch.float64)
    a[0] = 0.0
    cfg = ACPOConfig(beta=beta, renormalize=renormalize, **({} if clip else NO_CLIP))
    out = acpo_advantages(h, a, mask, cfg)
    torch.testing.assert_close(out.advantages.double(), _loop(h, a, mask, cfg), atol=1e-5, rtol=1e-5)
    assert (out.advantages[~mask] == 0).all() and (out.advantages[0] == 0).all()
    assert ((out.advantages.double() * a[:, None]) >= 0).all()                          # the verifier's sign
    if not clip or renormalize:                                                        # budget: sum_t A_t = T A
        torch.testing.assert_close((out.advantages.double() * mask).sum(-1), mask.sum(-1) * a, atol=1e-5, rtol=1e-5)
    stats = acpo_stats(out, h, a, mask, shannon=h + 0.1)
    assert stats["acpo/sign_violations"] == 0 and stats["acpo/entropy_gap/mean"] == pytest.approx(0.1, abs=1e-9)


def test_reduces_to_grpo_for_beta_zero_or_a_constant_surrogate():
    h = torch.rand(4, 5, dtype=torch.float64)
    a = torch.tensor([1.0, -0.5, 2.0, -1.0])
    mask = torch.ones_like(h, dtype=torch.bool)
    grpo = a[:, None].float().expand(4, 5)
    torch.testing.assert_close(acpo_advantages(h, a, mask, ACPOConfig(beta=0.0)).advantages, grpo)
    torch.testing.assert_close(acpo_advantages(torch.full_like(h, 0.7), a, mask, ACPOConfig(beta=1.0)).advantages, grpo)


def test_monotonic_in_the_surrogate_by_outcome():
    h = torch.tensor([[0.1, 0.4, 0.9, 1.5]] * 2, dtype=torch.float64)
    w, _ = acpo_weights(h, torch.tensor([1.0, -1.0]), torch.ones_like(h), ACPOConfig(**NO_CLIP))
    assert (w[0].diff() > 0).all() and (w[1].diff() < 0).all()  # success: up with H~; failure: down


def test_bad_inputs_are_refused_with_the_key():
    with pytest.raises(ValueError, match="surrogate"):
        ACPOConfig(surrogate="topk")
    with pytest.raises(ValueError, match="beta"):
        ACPOConfig(beta=1.5)
    with pytest.raises(ValueError, match="w_min"):
        ACPOConfig(w_min=0.0)
    with pytest.raises(ValueError, match=r"Unknown key\(s\) algorithm.acpo.betta.*Valid keys"):
        ACPOConfig.from_algorithm({"acpo": {"betta": 0.2}})
    h = torch.tensor([[0.1, float("inf")]])
    with pytest.raises(ValueError, match="not finite"):
        acpo_weights(h, torch.tensor([1.0]), torch.ones_like(h), ACPOConfig())
    with pytest.raises(ValueError, match=r"\(bs, T\)"):
        acpo_weights(torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), ACPOConfig())
