"""Bi-level conservative reshaping (verl_oar.core.reshape): properties over random batches, a plain
per-row reference (torch.quantile per row), fallbacks and edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_oar.core.reshape import (
    Fallback,
    ReshapeConfig,
    TokenWeights,
    importance_to_weights,
    reshape_advantages,
    reshape_stats,
)

# float32 weights against float64 arithmetic
ATOL = 1e-5


def reference_weights(importance, mask, cfg, found):
    """Straightforward per-row loop over docs/method.md's reshaping (section 5). Returns (w~, w, fallback) float64."""
    batch, length = importance.shape
    final = torch.ones(batch, length, dtype=torch.float64)
    raw = torch.ones(batch, length, dtype=torch.float64)
    fallback = torch.zeros(batch, dtype=torch.int8)
    for b in range(batch):
        idx = mask[b].nonzero().squeeze(1)
        values = importance[b, idx].double()
        if not found[b]:
            fallback[b] = Fallback.NO_ANSWER
            continue
        if idx.numel() == 0:
            fallback[b] = Fallback.NO_REASONING
            continue
        if not torch.isfinite(values).all():
            fallback[b] = Fallback.NON_FINITE
            continue
        s = torch.log1p(values.clamp(min=0))
        if s.max() == s.min():
            fallback[b] = Fallback.ALL_EQUAL
            continue
        n = (s - s.min()) / (s.max() - s.min())
        q = torch.quantile(n, cfg.tau).item()
        w = []
        for n_t in n.tolist():
            if n_t < q:
                w.append(max(n_t / q, cfg.floor) if cfg.suppress else 1.0)
            elif not cfg.amplify:
                w.append(1.0)
            elif q == 1:
                w.append(1.0 + cfg.beta)
            else:
                w.append(1.0 + cfg.beta * (n_t - q) / (1 - q))
        w = torch.tensor(w, dtype=torch.float64)
        raw[b, idx] = w
        final[b, idx] = w * len(w) / w.sum() if cfg.preserve_mass else w
    return final, raw, fallback


# --- random batches -----------------------------------------------------------------------------

SPECIAL = [0.0, 1.0, 2.0, -1.5, -7.0, 1e-12, 1e6, math.nan, math.inf, -math.inf]


@st.composite
def batches(draw, allow_non_finite=True):
    batch = draw(st.integers(1, 5))
    length = draw(st.integers(1, 10))
    specials = SPECIAL if allow_non_finite else [x for x in SPECIAL if math.isfinite(x)]
    element = st.one_of(
        st.floats(-3.0, 50.0, allow_nan=False, width=32),
        st.sampled_from(specials),
        st.sampled_from([0.0, 0.5, 3.0]),     # ties
    )
    importance = torch.tensor(draw(st.lists(element, min_size=batch * length, max_size=batch * length)),
                              dtype=torch.float32).reshape(batch, length)
    response_len = draw(st.lists(st.integers(0, length), min_size=batch, max_size=batch))
    response = torch.arange(length)[None, :] < torch.tensor(response_len)[:, None]
    reasoning_bits = torch.tensor(draw(st.lists(st.booleans(), min_size=batch * length, max_size=batch * length)))
    reasoning = reasoning_bits.reshape(batch, length) & response
    found = torch.tensor(draw(st.lists(st.booleans(), min_size=batch, max_size=batch)))
    adv = torch.tensor(draw(st.lists(st.sampled_from([-2.0, -0.7, 0.0, 0.3, 1.5]), min_size=batch,
                                     max_size=batch)))
    advantages = adv[:, None] * response.float()          # GRPO: A_i broadcast, 0 on padding
    return importance, reasoning, response, found, advantages


configs = st.builds(
    ReshapeConfig,
    tau=st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0)),
    beta=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 5.0)),
    floor=st.one_of(st.sampled_from([0.1, 1.0]), st.floats(0.01, 1.0)),
    amplify=st.booleans(),
    suppress=st.booleans(),
    preserve_mass=st.booleans(),
)

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(batches(), configs)
def test_batched_equals_per_row_reference(batch, cfg):
    importance, reasoning, _, found, _ = batch
    out = importance_to_weights(importance, reasoning, cfg, answer_found=found)
    final, raw, fallback = reference_weights(importance, reasoning, cfg, found)
    assert out.weights.dtype == torch.float32 and out.fallback.dtype == torch.int8
    assert torch.equal(out.fallback, fallback)
    torch.testing.assert_close(out.unnormalized.double(), raw, atol=ATOL, rtol=1e-6)
    torch.testing.assert_close(out.weights.double(), final, atol=ATOL, rtol=1e-6)


@FAST
@given(batches(), configs)
def test_invariants(batch, cfg):
    importance, reasoning, response, found, advantages = batch
    out = importance_to_weights(importance, reasoning, cfg, answer_found=found)
    w, raw = out.weights, out.unnormalized
    assert torch.isfinite(w).all() and torch.isfinite(raw).all()

    # untouched: non-reasoning tokens and fallback rows have weight exactly 1
    untouched = ~reasoning | (out.fallback != Fallback.NONE)[:, None]
    assert (w[untouched] == 1.0).all() and (raw[untouched] == 1.0).all()

    # bounds before step 5, and every switch does what it says
    assert (raw >= cfg.floor - 1e-6).all() and (raw <= 1 + cfg.beta + 1e-5).all()
    if not cfg.suppress:
        assert (raw >= 1.0).all()
    if not cfg.amplify:
        assert (raw <= 1.0).all()
    if not cfg.preserve_mass:
        assert torch.equal(w, raw)
    assert (w > 0).all()

    after = reshape_advantages(advantages, out)
    # signs kept, zero rows stay zero, padding untouched
    assert torch.equal(torch.sign(after), torch.sign(advantages))
    assert (after[~response] == advantages[~response]).all()
    if cfg.preserve_mass:
        # the sequence's total token advantage equals GRPO's (mass preservation)
        before_sum = advantages.double().sum(1)
        after_sum = after.double().sum(1)
        scale = advantages.double().abs().sum(1) + 1.0
        assert ((after_sum - before_sum).abs() <= 1e-5 * scale).all()
        l_sum = torch.where(reasoning, w.double(), 0.0).sum(1)
        assert torch.allclose(l_sum, reasoning.sum(1).double(), atol=1e-4)

    stats = reshape_stats(out, reasoning, response, advantages, after, cfg, importance=importance)
    assert all(math.isfinite(v) for v in stats.values())
    if cfg.preserve_mass:
        assert stats["mass_error/max_abs"] < 1e-4


# --- fallbacks and edge cases -----------------------------------------------------------------


def test_fallback_reasons_and_precedence():
    nan, inf = math.nan, math.inf
    importance = torch.tensor([
        [1.0, 2.0, 3.0, 4.0],       # reshaped
        [1.0, nan, 3.0, 4.0],       # non-finite inside reasoning
        [1.0, 2.0, inf, 4.0],       # +inf inside reasoning
        [2.0, 2.0, 2.0, nan],       # all equal (the NaN is outside reasoning)
        [5.0, 6.0, 7.0, 8.0],       # no reasoning token
        [1.0, 2.0, 3.0, 4.0],       # no answer
        [nan, 1.0, 2.0, 3.0],       # single reasoning token -> all equal
    ])
    reasoning = torch.tensor([
        [1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0],
    ], dtype=torch.bool)
    found = torch.tensor([1, 1, 1, 1, 1, 0, 1], dtype=torch.bool)
    out = importance_to_weights(importance, reasoning, ReshapeConfig(), answer_found=found)
    expected = [Fallback.NONE, Fallback.NON_FINITE, Fallback.NON_FINITE, Fallback.ALL_EQUAL,
                Fallback.NO_REASONING, Fallback.NO_ANSWER, Fallback.ALL_EQUAL]
    assert out.fallback.tolist() == [int(x) for x in expected]
    assert (out.weights[1:] == 1.0).all() and torch.isfinite(out.weights).all()
    assert not (out.weights[0] == 1.0).all()

    response = torch.ones_like(reasoning)
    adv = torch.ones(7, 4)
    stats = reshape_stats(out, reasoning, response, adv, reshape_advantages(adv, out), ReshapeConfig(),
                          importance=importance)
    assert stats["fallback/frac_any"] == pytest.approx(6 / 7)
    assert stats["fallback/frac_non_finite"] == pytest.approx(2 / 7)
    assert stats["fallback/frac_all_equal"] == pytest.approx(2 / 7)
    assert stats["fallback/frac_no_reasoning"] == pytest.approx(1 / 7)
    assert stats["fallback/frac_no_answer"] == pytest.approx(1 / 7)
    assert stats["importance/max"] == 4.0      # finite reasoning values only (inf and row 4 excluded)
    assert all(math.isfinite(v) for v in stats.values())


def test_negative_importance_is_clamped_not_nan():
    # AS-JOINT scores are signed; log1p(-2) would be NaN without the clamp
    importance = torch.tensor([[-2.0, -0.5, 0.0, 3.0, -100.0, 1.0]])
    reasoning = torch.ones_like(importance, dtype=torch.bool)
    out = importance_to_weights(importance, reasoning, ReshapeConfig())
    assert out.fallback.item() == Fallback.NONE
    assert torch.isfinite(out.weights).all()
    # every negative or zero score is the minimum n = 0: all get the same weight
    minima = out.weights[0, [0, 1, 2, 4]]
    assert (minima == minima[0]).all() and (out.weights[0, [3, 5]] > minima[0]).all()
    tight = importance_to_weights(importance, reasoning, ReshapeConfig(tau=0.8)).unnormalized[0]
    assert torch.allclose(tight[[0, 1, 2, 4]], torch.full((4,), 0.1))    # q > 0: at the floor
    all_negative = importance_to_weights(-importance.abs() - 1, reasoning, ReshapeConfig())
    assert all_negative.fallback.item() == Fallback.ALL_EQUAL


@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_tau_edges(tau):
    importance = torch.tensor([[0.0, 1.0, 2.0, 3.0, 9.0, 9.0]])
    reasoning = torch.ones_like(importance, dtype=torch.bool)
    cfg = ReshapeConfig(tau=tau, beta=1.0, preserve_mass=False)
    w = importance_to_weights(importance, reasoning, cfg).unnormalized[0]
    if tau == 0.0:   # q = min n = 0: nothing suppressed, linear amplification 1 + n
        assert (w >= 1.0).all() and w[0] == 1.0 and w[-1] == pytest.approx(2.0)
    else:            # q = max n = 1: everything below is suppressed, the maxima get 1 + beta
        assert (w[:4] < 1.0).all() and (w[4:] == 2.0).all()


def test_quantile_is_per_row_with_the_configured_level():
    # the reference code overwrote tau inside its loop; each row must use tau on its own tokens
    torch.manual_seed(0)
    importance = torch.rand(64, 200) * 10
    reasoning = torch.rand(64, 200) < torch.rand(64, 1)
    reasoning[:, 0] = reasoning[:, 1] = True
    cfg = ReshapeConfig(tau=0.3)
    out = importance_to_weights(importance, reasoning, cfg)
    final, _, _ = reference_weights(importance, reasoning, cfg, torch.ones(64, dtype=torch.bool))
    torch.testing.assert_close(out.weights.double(), final, atol=ATOL, rtol=1e-6)


def test_plain_tensor_weights_and_shape_check():
    importance = torch.tensor([[1.0, 2.0, 3.0]])
    out = importance_to_weights(importance, torch.ones(1, 3, dtype=torch.bool), ReshapeConfig())
    adv = torch.full((1, 3), -0.5, dtype=torch.float64)
    assert torch.equal(reshape_advantages(adv, out), reshape_advantages(adv, out.weights))
    assert reshape_advantages(adv, out).dtype == torch.float64
    with pytest.raises(ValueError, match="do not match"):
        reshape_advantages(torch.zeros(1, 4), out)
    assert isinstance(out, TokenWeights)


def test_stats_when_every_row_falls_back_have_no_weight_keys_and_no_nan():
    importance = torch.ones(3, 4)
    reasoning = torch.ones(3, 4, dtype=torch.bool)
    out = importance_to_weights(importance, reasoning, ReshapeConfig())
    adv = torch.ones(3, 4)
    stats = reshape_stats(out, reasoning, reasoning, adv, reshape_advantages(adv, out), ReshapeConfig())
    assert stats["fallback/frac_all_equal"] == 1.0 and stats["mass_error/max_abs"] == 0.0
    assert not any(k.startswith("weight/") for k in stats)
    assert all(math.isfinite(v) for v in stats.values())


def test_stats_keys_on_a_reshaped_batch():
    importance = torch.tensor([[0.0, 1.0, 2.0, 8.0, 0.0]])
    reasoning = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    cfg = ReshapeConfig(tau=0.5)
    out = importance_to_weights(importance, reasoning, cfg)
    adv = torch.ones(1, 5)
    stats = reshape_stats(out, reasoning, torch.ones_like(reasoning), adv, reshape_advantages(adv, out), cfg)
    assert set(stats) == {
        "fallback/frac_any", "fallback/frac_no_answer", "fallback/frac_non_finite", "fallback/frac_all_equal",
        "fallback/frac_no_reasoning", "mass_error/max_abs", "reasoning/frac_of_response", "weight/min",
        "weight/max", "weight/mean", "weight/frac_suppressed", "weight/frac_amplified", "weight/frac_at_floor",
    }
    # n = [0, log 2 / log 9, log 3 / log 9, 1] = [0, .32, .5, 1]; q = median = .41
    assert stats["weight/frac_suppressed"] == 0.5 and stats["weight/frac_amplified"] == 0.5
    assert stats["weight/frac_at_floor"] == 0.25 and stats["weight/mean"] == pytest.approx(1.0)
    assert stats["reasoning/frac_of_response"] == 0.8


@pytest.mark.parametrize(
    ("field", "value"),
    [("tau", -0.1), ("tau", 1.5), ("tau", math.nan), ("beta", -1.0), ("beta", math.inf), ("floor", 0.0),
     ("floor", 1.2), ("tau", "0.5"), ("amplify", 1)],
)
def test_config_validation_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"ReshapeConfig\.{field}="):
        ReshapeConfig(**{field: value})
