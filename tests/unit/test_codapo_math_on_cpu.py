"""CoDaPO's question value and CoDaSampling's selection (verl_oar.core.codapo): docs/algo/codapo.md's hand example
and oracles (limits, bounds, sign, reduction to GRPO, the 16-question sampler case), random batches against
a plain per-group loop, bad inputs."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_oar.core.codapo import CoDaPOConfig, question_values, refocused_order, select_questions


def test_hand_example():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])
    lp = torch.full((4, 3), math.log(0.8), dtype=torch.float64)
    v, parts = question_values(rewards, lp, torch.ones(4, 3), torch.zeros(4, dtype=torch.long), 0.1)
    assert parts["accuracy"].tolist() == [0.25] * 4 and parts["difficulty_value"].tolist() == [0.75] * 4
    torch.testing.assert_close(parts["confidence"], torch.full((4,), 0.8, dtype=torch.float64))
    torch.testing.assert_close(v, torch.full((4,), 0.70, dtype=torch.float64))
    grpo = torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=torch.float64)   # unbiased std 0.5
    torch.testing.assert_close(v * grpo, torch.tensor([1.05, -0.35, -0.35, -0.35], dtype=torch.float64))


def _loop(rewards, lp, mask, groups, offset):
    out = {}
    for g in set(groups.tolist()):
        rows = [i for i in range(len(rewards)) if int(groups[i]) == g]
        acc = sum(1.0 for i in rows if float(rewards[i]) == 1.0) / len(rows)
        means = []
        for i in rows:
            ts = [float(lp[i, t]) for t in range(lp.shape[1]) if mask[i, t]]
            means.append(sum(ts) / len(ts) if ts else 0.0)
        out[g] = math.exp(sum(means) / len(rows)) * (1 - 4 * ((1 - acc) - 0.5) ** 2) + offset
    return torch.tensor([out[int(g)] for g in groups], dtype=torch.float64)


@given(st.integers(0, 10_000), st.sampled_from([0.0, 0.1, 0.5]))
@settings(max_examples=40, deadline=None)
def test_random_batches_match_a_per_group_loop_and_stay_in_bounds(seed, offset):
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 4, (12,), generator=g)
    rewards = (torch.rand(12, generator=g) > 0.5).double()
    lp = -torch.rand(12, 7, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(12, 7, generator=g) > 0.2
    v, _ = question_values(rewards, lp, mask, groups, offset)
    torch.testing.assert_close(v, _loop(rewards, lp, mask, groups, offset))
    assert (v >= offset - 1e-12).all() and (v <= 1 + offset + 1e-12).all()
    for q in groups.unique():                                     # one value per question
        assert v[groups == q].unique().numel() == 1


def test_solved_or_failed_questions_get_the_offset_alone():
    lp = torch.full((4, 2), -0.1, dtype=torch.float64)
    for rewards in (torch.ones(4), torch.zeros(4)):
        v, _ = question_values(rewards, lp, torch.ones(4, 2), torch.zeros(4, dtype=torch.long), 0.1)
        torch.testing.assert_close(v, torch.full((4,), 0.1, dtype=torch.float64))
    v, _ = question_values(torch.tensor([1.0, 0.0]), lp[:2], torch.zeros(2, 2), torch.zeros(2, dtype=torch.long), 0.0)
    torch.testing.assert_close(v, torch.ones(2, dtype=torch.float64))  # no valid tokens: mean log-prob 0, c = 1


def test_sampler_selects_the_top_quarter_four_times_each():
    values = torch.randperm(16, generator=torch.Generator().manual_seed(3)).double().tolist()   # 16 distinct values
    selected = select_questions(values, 0.75)
    top4 = sorted(range(16), key=lambda i: values[i])[-4:]
    assert sorted(selected) == sorted(top4)
    order = refocused_order(selected, 4, 16)
    assert len(order) == 16 and all(order.count(q) == 4 for q in top4)
    assert order == [q for q in selected for _ in range(4)]
    assert refocused_order([2, 5, 7], 4, 10) == [2, 2, 2, 2, 5, 5, 5, 5, 7, 7]      # truncated at the batch size
    assert refocused_order([1], 2, 5) == [1, 1, 1, 1, 1]                              # cycled
    assert select_questions([1.0, 1.0, 1.0, 0.5], 0.75) == [0, 1, 2]                  # ties select more


def test_bad_inputs_are_refused_with_the_key():
    with pytest.raises(ValueError, match="percentile"):
        CoDaPOConfig(percentile=1.0)
    with pytest.raises(ValueError, match="repeat_count"):
        CoDaPOConfig(repeat_count=0)
    with pytest.raises(ValueError, match="weight_offset"):
        CoDaPOConfig(weight_offset=-0.1)
    with pytest.raises(ValueError, match=r"Unknown key\(s\) algorithm.codapo.percentil.*Valid keys"):
        CoDaPOConfig.from_algorithm({"codapo": {"percentil": 0.5}})
    with pytest.raises(ValueError, match="not finite"):
        question_values(torch.ones(1), torch.tensor([[float("-inf")]]), torch.ones(1, 1), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="no question selected"):
        refocused_order([], 4, 16)
