"""OPPO's advantage (verl_oar.core.oppo): docs/algo/oppo.md's hand examples and invariants, a plain
per-token loop as reference on random batches, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_oar.core.oppo import OPPOConfig, group_ids, oppo_advantages, oppo_stats

LITERAL = dict(anchor="none", zero_uniform_groups=False)


def _one(e, cfg, reward=1.0):
    e = torch.tensor([e], dtype=torch.float64)
    return oppo_advantages(e, torch.tensor([reward]), torch.zeros(1, dtype=torch.long), torch.ones_like(e), cfg)


def test_hand_example_exact_and_first_order():
    e = [math.log(3), 0.0, -math.log(3)]
    out = _one(e, OPPOConfig(prior="half", clip=0, **LITERAL))
    torch.testing.assert_close(out.values[0].double(), torch.tensor([0.5, 0.75, 0.75, 0.5], dtype=torch.float64))
    torch.testing.assert_close(out.advantages[0].double(), torch.tensor([0.25, 0, -0.25], dtype=torch.float64))
    first = _one(e, OPPOConfig(prior="half", clip=0, form="first_order", **LITERAL))
    torch.testing.assert_close(first.advantages[0].double(), torch.tensor([0.2747, 0, -0.2060], dtype=torch.float64),
                               atol=1e-4, rtol=0)


def test_clipped_hand_example():
    # V_0 = 0.25 from a group with one success in four; c = 1
    e = torch.tensor([[2.0, -0.5, 1.0]] * 4, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    out = oppo_advantages(e, rewards, torch.zeros(4, dtype=torch.long), torch.ones_like(e),
                          OPPOConfig(clip=1.0, **LITERAL))
    torch.testing.assert_close(out.values[0].double(), torch.tensor([0.25, 0.4754, 0.3547, 0.5990], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(out.advantages[0].double(), torch.tensor([0.2254, -0.1207, 0.2444], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    assert out.advantages[0].sum().item() == pytest.approx(0.3490, abs=1e-4)
    assert out.clipped[0].tolist() == [True, False, False]


def _batch(seed: int, groups: int = 3, n: int = 4, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    bs = groups * n
    e = torch.randn(bs, t, generator=g, dtype=torch.float64) * 2
    rewards = (torch.rand(bs, generator=g) < 0.5).double()
    rewards[:n] = 1.0  # group 0: all right (uniform)
    lengths = torch.randint(1, t + 1, (bs,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).double()
    index = [f"uid{i // n}" for i in range(bs)]
    return e, rewards, index, mask


def _reference(e, rewards, index, mask, cfg):
    """Per-token loop over docs/algo/oppo.md steps 1-8, float64."""
    bs, t = mask.shape
    out = torch.zeros(bs, t, dtype=torch.float64)
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    for b in range(bs):
        mates = [float(rewards[j]) for j in range(bs) if index[j] == index[b]]
        p = sum(mates) / len(mates)
        std = (sum((x - p) ** 2 for x in mates) / (len(mates) - 1)) ** 0.5 if len(mates) > 1 else 0.0
        v0 = min(max(p, cfg.prior_eps), 1 - cfg.prior_eps) if cfg.prior == "group" else 0.5
        ell = math.log(v0 / (1 - v0))
        r = float(rewards[b])
        idx = [i for i in range(t) if mask[b, i]]
        for i in idx:
            x = float(e[b, i])
            x = min(max(x, -cfg.clip), cfg.clip) if cfg.clip > 0 else x
            state = ell if cfg.state_weight == "tracked" else 0.0
            out[b, i] = sig(state + x) - sig(state) if cfg.form == "exact" else sig(state) * (1 - sig(state)) * x
            ell += x
        if cfg.terminal == "last_token" and idx:
            out[b, idx[-1]] += (r - v0) - out[b].sum()
        d = (r > v0) - (r < v0)
        for i in idx:
            if cfg.anchor == "clamp":
                out[b, i] = d * max(0.0, d * out[b, i])
            elif cfg.anchor == "abs":
                out[b, i] = d * abs(out[b, i])
            if cfg.scale == "group_std":
                out[b, i] /= std + 1e-6
            if cfg.zero_uniform_groups and len(set(mates)) == 1:
                out[b, i] = 0.0
    return out


CONFIGS = [OPPOConfig(), OPPOConfig(form="first_order", terminal="last_token"), OPPOConfig(anchor="abs", scale="group_std"),
           OPPOConfig(prior="half", state_weight="constant", anchor="none", clip=0), OPPOConfig(clip=0.5, terminal="last_token")]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("seed", range(3))
def test_equals_a_per_token_loop_on_random_batches(cfg, seed):
    e, rewards, index, mask = _batch(seed)
    out = oppo_advantages(e, rewards, group_ids(index), mask, cfg)
    torch.testing.assert_close(out.advantages.double(), _reference(e, rewards, index, mask, cfg), atol=1e-6, rtol=1e-5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), clip=st.floats(0, 4), prior=st.sampled_from(["group", "half"]))
def test_telescoping_terminal_and_anchoring_on_random_inputs(seed, clip, prior):
    e, rewards, index, mask = _batch(seed)
    groups = group_ids(index)
    base = dict(clip=clip, prior=prior, zero_uniform_groups=False)
    exact = oppo_advantages(e, rewards, groups, mask, OPPOConfig(anchor="none", **base))
    v0, v_end = exact.prior.double(), exact.values.double()[:, -1]
    torch.testing.assert_close(exact.advantages.double().sum(-1), v_end - v0, atol=1e-5, rtol=0)  # sum = V_T - V_0
    term = oppo_advantages(e, rewards, groups, mask, OPPOConfig(anchor="none", terminal="last_token", **base))
    torch.testing.assert_close(term.advantages.double().sum(-1), rewards.double() - v0, atol=1e-5, rtol=0)  # = R - V_0
    anchored = oppo_advantages(e, rewards, groups, mask, OPPOConfig(**base))
    assert (anchored.advantages.double() * (rewards.double() - v0)[:, None] >= 0).all()
    assert (anchored.advantages[~mask.bool()] == 0).all()
    assert oppo_stats(anchored, e, rewards, mask)["oppo/sign_violations"] == 0


def test_opd_special_case():
    e, rewards, index, mask = _batch(1)
    out = oppo_advantages(e, rewards, group_ids(index), mask, OPPOConfig(state_weight="constant", form="first_order",
                                                                         anchor="none", clip=0, zero_uniform_groups=False))
    torch.testing.assert_close(out.advantages.double(), 0.25 * e * mask, atol=1e-6, rtol=0)


def test_zero_evidence():
    e, rewards, index, mask = _batch(2)
    groups = group_ids(index)
    zero = torch.zeros_like(e)
    assert (oppo_advantages(zero, rewards, groups, mask, OPPOConfig()).advantages == 0).all()
    out = oppo_advantages(zero, rewards, groups, mask, OPPOConfig(terminal="last_token", zero_uniform_groups=False))
    last = mask.sum(-1).long() - 1
    expected = torch.zeros_like(e)
    expected[torch.arange(len(e)), last] = (rewards.double() - out.prior.double())
    torch.testing.assert_close(out.advantages.double(), expected, atol=1e-6, rtol=0)


def test_uniform_groups_get_zero_and_padding_side_does_not_matter():
    e, rewards, index, mask = _batch(3)
    out = oppo_advantages(e, rewards, group_ids(index), mask, OPPOConfig())
    assert out.uniform[:4].all() and (out.advantages[:4] == 0).all()
    # the same tokens at the end of the row (left padding) give the same per-token advantages
    flipped_e, flipped_mask = torch.zeros_like(e), torch.zeros_like(mask)
    for b in range(len(e)):
        n = int(mask[b].sum())
        flipped_e[b, -n:], flipped_mask[b, -n:] = e[b, :n], 1
    left = oppo_advantages(flipped_e, rewards, group_ids(index), flipped_mask, OPPOConfig())
    for b in range(len(e)):
        n = int(mask[b].sum())
        torch.testing.assert_close(left.advantages[b, -n:], out.advantages[b, :n])


def test_bad_inputs_and_keys_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="Valid keys: anchor, clip"):
        OPPOConfig.from_algorithm({"oppo": {"anchr": "abs"}})
    with pytest.raises(ValueError, match="one of"):
        OPPOConfig(form="second_order")
    e, rewards, index, mask = _batch(0)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        oppo_advantages(e, rewards * 5, group_ids(index), mask, OPPOConfig())
    e[2, 0] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        oppo_advantages(e, rewards, group_ids(index), mask, OPPOConfig())
