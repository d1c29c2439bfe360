"""CSCR's advantage (verl_oar.core.cscr): docs/algo/cscr.md's hand example and invariants, a plain
per-token loop as reference on random batches, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_oar.core.cscr import CSCRConfig, cscr_advantages, cscr_stats

HAND = CSCRConfig(threshold_mode="absolute", threshold=1.0, alpha=1.0, floor=0.0)


def _hand(adv: float):
    s = torch.tensor([[0.0, 0.0, 2.0, 0.0]])
    return cscr_advantages(torch.tensor([adv]), s, torch.zeros_like(s), torch.ones_like(s), HAND)


def test_methods_md_hand_example_exact_values():
    # s = [0, 0, 2, 0], tau = 1, alpha = 1, no floor -> w = [1, 1, e^-1, 1], w~ = w * 4 / sum w
    out = _hand(1.0)
    expected = torch.tensor([1.1877, 1.1877, 0.4369, 1.1877])
    torch.testing.assert_close(out.weights[0], expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.advantages[0], expected, atol=1e-4, rtol=0)
    exact = 4 / (3 + math.exp(-1))
    assert out.weights[0, 0].item() == pytest.approx(exact, abs=1e-6)
    assert out.weights[0, 2].item() == pytest.approx(math.exp(-1) * exact, abs=1e-6)
    torch.testing.assert_close(_hand(-0.5).advantages[0], torch.tensor([-0.5938, -0.5938, -0.2185, -0.5938]),
                               atol=1e-4, rtol=0)


def _reference(adv, pos, neg, mask, cfg):
    """Per-token loop over docs/algo/cscr.md (abs_max sensitivity), float64."""
    bs, t = mask.shape
    sens = [[max(abs(float(pos[b, i])), abs(float(neg[b, i]))) for i in range(t)] for b in range(bs)]
    flat = sorted(sens[b][i] for b in range(bs) for i in range(t) if mask[b, i])
    if cfg.threshold_mode == "absolute":
        tau = cfg.threshold
    else:  # linear interpolation between order statistics, as torch.quantile
        pos_q = cfg.threshold * (len(flat) - 1)
        lo = math.floor(pos_q)
        hi = min(lo + 1, len(flat) - 1)
        tau = flat[lo] + (flat[hi] - flat[lo]) * (pos_q - lo)
    out = torch.zeros(bs, t, dtype=torch.float64)
    for b in range(bs):
        idx = [i for i in range(t) if mask[b, i]]
        w = {i: 1.0 if sens[b][i] <= tau else max(math.exp(-cfg.alpha * (sens[b][i] - tau)), cfg.floor) for i in idx}
        total = sum(w.values())
        for i in idx:
            out[b, i] = float(adv[b]) * w[i] * len(idx) / total
    return out


def _batch(seed: int, bs: int = 6, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randn(bs, t, generator=g) * 1.5
    neg = torch.randn(bs, t, generator=g) * 1.5
    lengths = torch.randint(1, t + 1, (bs,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    adv = torch.randn(bs, generator=g)
    adv[0] = 0.0
    return adv, pos, neg, mask


@pytest.mark.parametrize("cfg", [CSCRConfig(), CSCRConfig(floor=0.0, alpha=2.0),
                                 CSCRConfig(threshold_mode="absolute", threshold=0.7, floor=0.1)])
@pytest.mark.parametrize("seed", range(4))
def test_equals_a_per_token_loop_on_random_batches(cfg, seed):
    adv, pos, neg, mask = _batch(seed)
    out = cscr_advantages(adv, pos, neg, mask, cfg)
    torch.testing.assert_close(out.advantages.double(), _reference(adv, pos, neg, mask, cfg), atol=1e-5, rtol=1e-5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), alpha=st.floats(0, 5), floor=st.floats(0, 1), level=st.floats(0, 1))
def test_budget_sign_and_padding_on_random_inputs(seed, alpha, floor, level):
    adv, pos, neg, mask = _batch(seed)
    cfg = CSCRConfig(threshold=level, alpha=alpha, floor=floor)
    out = cscr_advantages(adv, pos, neg, mask, cfg)
    a = out.advantages.double()
    torch.testing.assert_close(a.sum(-1), adv.double() * mask.sum(-1).double(), atol=1e-4, rtol=1e-5)  # budget
    valid = mask.bool()
    sign = torch.sign(adv)[:, None].expand_as(a)
    assert (torch.sign(a)[valid] == sign[valid]).all()  # the verifier sets every sign; A = 0 -> 0
    assert (a[~valid] == 0).all() and (out.weights[~valid] == 0).all()
    stats = cscr_stats(out, adv, mask)
    assert stats["cscr/sign_violations"] == 0 and stats["cscr/budget_error"] < 1e-4


@pytest.mark.parametrize("seed", range(3))
def test_reduces_to_grpo_when_nothing_is_attenuated(seed):
    adv, pos, neg, mask = _batch(seed)
    grpo = adv[:, None] * mask
    for cfg, p, n in ((CSCRConfig(alpha=0.0), pos, neg),  # alpha = 0
                      (CSCRConfig(threshold_mode="absolute", threshold=100.0), pos, neg),  # all s <= tau
                      (CSCRConfig(threshold_mode="absolute", threshold=0.0), 0 * pos, 0 * neg)):  # no shift
        assert torch.equal(cscr_advantages(adv, p, n, mask, cfg).advantages, grpo)


@pytest.mark.parametrize("seed", range(3))
def test_swapping_the_two_conditions_changes_nothing(seed):
    adv, pos, neg, mask = _batch(seed)
    assert torch.equal(cscr_advantages(adv, pos, neg, mask, CSCRConfig()).advantages,
                       cscr_advantages(adv, neg, pos, mask, CSCRConfig()).advantages)


@pytest.mark.parametrize("seed", range(5))
def test_raising_one_tokens_sensitivity_never_raises_its_weight(seed):
    adv, pos, neg, mask = _batch(seed, bs=1, t=8)
    mask[:] = 1
    cfg = CSCRConfig(threshold_mode="absolute", threshold=0.5, floor=0.2)
    before = cscr_advantages(adv, pos, neg, mask, cfg).weights[0, 3]
    for bump in (0.1, 0.5, 2.0, 10.0):
        raised = pos.clone()
        raised[0, 3] = max(pos[0, 3].abs(), neg[0, 3].abs()) + bump
        after = cscr_advantages(adv, raised, neg, mask, cfg).weights[0, 3]
        assert after <= before + 1e-7
        before = after


def test_bad_inputs_and_keys_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="Valid keys: alpha, floor, neg_template, overflow, pos_template, sensitivity, threshold, threshold_mode"):
        CSCRConfig.from_algorithm({"cscr": {"alpah": 1.0}})
    with pytest.raises(ValueError, match="quantile level in"):
        CSCRConfig(threshold=2.0)
    with pytest.raises(ValueError, match="0 = plain GRPO"):
        CSCRConfig(alpha=-1.0)
    assert CSCRConfig.from_algorithm({"cscr": {"alpha": 0.5}}).alpha == 0.5
    adv, pos, neg, mask = _batch(0)
    pos[1, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        cscr_advantages(adv, pos, neg, mask, CSCRConfig())
    with pytest.raises(ValueError, match=r"must be \(bs,\)"):
        cscr_advantages(adv[:2], neg, neg, mask, CSCRConfig())
