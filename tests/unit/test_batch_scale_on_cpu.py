"""Every batch-wide statistic of the estimators at cluster batch sizes: 2^25 valid tokens (8192 responses of 4096
tokens: e.g. 512 prompts x 16 responses of 4k), float32 inputs as verl hands them, one shared batch.

torch.quantile refuses inputs over 2^24 elements; the estimators' batch-wide quantiles use
``core.reshape.linear_quantile`` instead, which must equal torch.quantile bit for bit where torch's runs.
The 2^25-token run is marked slow (tens of seconds): the full suite runs it, ``-m "not slow"`` does not."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from verl_oar.core.reshape import linear_quantile

BS, T = 8192, 4096  # 2^13 x 2^12 = 2^25 valid tokens
GROUP = 16


def test_linear_quantile_equals_torch_quantile_bit_for_bit_on_small_inputs():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    for trial in range(600):
        n = rng.randint(1, 300)
        dtype = (torch.float32, torch.float64)[trial % 2]
        x = torch.randn(n, generator=g, dtype=dtype) if trial % 3 else torch.randint(0, 4, (n,), generator=g).to(dtype)
        level = rng.choice([0.0, 1.0, 0.5, 0.75, 0.8, 1 / 3, rng.random()])
        got = linear_quantile(x, level)
        assert got.dtype == dtype and torch.equal(got, torch.quantile(x, level)), (n, dtype, level)
    assert math.isnan(float(linear_quantile(torch.tensor([1.0, float("nan")]), 0.5)))
    with pytest.raises(ValueError, match="non-empty 1-D"):
        linear_quantile(torch.zeros(0), 0.5)


def test_torch_quantile_refuses_a_cluster_batch_which_is_why_it_is_not_used():
    with pytest.raises(RuntimeError, match="too large"):
        torch.quantile(torch.zeros(2**24 + 1), 0.5)


@pytest.fixture(scope="module")
def batch():
    """(x, mask, groups, rewards): x (BS, T) float32 uniform in [0, 1) (one tensor for every per-token input),
    every token valid, groups of 16 responses, 0/1 rewards with both outcomes in most groups."""
    g = torch.Generator().manual_seed(0)
    x = torch.rand(BS, T, generator=g)
    mask = torch.ones(BS, T, dtype=torch.bool)
    groups = torch.arange(BS) // GROUP
    rewards = (torch.rand(BS, generator=g) < 0.5).float()
    assert int(mask.sum()) == 2**25
    return x, mask, groups, rewards


def _timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


@pytest.mark.slow  # ~41 s alone on 2 cores (the estimators' core calls ~31 s, their stats ~10 s)
def test_every_estimators_batch_statistics_run_at_two_to_the_25_valid_tokens(batch):
    from verl_oar.core.acpo import ACPOConfig, acpo_advantages, acpo_stats
    from verl_oar.core.codapo import codapo_stats, question_values
    from verl_oar.core.cscr import CSCRConfig, cscr_advantages, cscr_stats
    from verl_oar.core.oppo import OPPOConfig, oppo_advantages, oppo_stats
    from verl_oar.core.reshape import ReshapeConfig, importance_to_weights, reshape_advantages, reshape_stats

    x, mask, groups, rewards = batch
    sequence = rewards - 0.5  # a GRPO-like sequence advantage per row
    seconds = {}

    result, seconds["cscr"] = _timed(lambda: cscr_advantages(sequence, x, x, mask, CSCRConfig()))
    stats = cscr_stats(result, sequence, mask)
    assert abs(result.threshold - 0.8) < 1e-3 and stats["cscr/valid_tokens"] == 2**25  # |x| ~ U[0, 1)
    assert stats["cscr/sign_violations"] == 0 and stats["cscr/budget_error"] < 1e-3
    assert abs(stats["cscr/frac_attenuated"] - 0.2) < 1e-3
    del result

    cfg = ReshapeConfig()
    weights, seconds["oar_reshape"] = _timed(lambda: importance_to_weights(x, mask, cfg))
    before = sequence[:, None] * mask
    after = reshape_advantages(before, weights)
    stats = reshape_stats(weights, mask, mask, before, after, cfg, importance=x, rows=torch.ones(BS, dtype=torch.bool))
    assert stats["fallback/frac_any"] == 0 and stats["mass_error/max_abs"] < 1e-2
    assert abs(stats["weight/frac_suppressed"] - 0.5) < 1e-3
    del weights, before, after

    out, seconds["oppo"] = _timed(lambda: oppo_advantages(x - 0.5, rewards, groups, mask, OPPOConfig()))
    stats = oppo_stats(out, x - 0.5, rewards, mask)
    assert stats["oppo/valid_tokens"] == 2**25 and stats["oppo/sign_violations"] == 0
    assert math.isfinite(stats["oppo/advantage/abs_mean"]) and torch.isfinite(out.advantages).all()
    del out

    out, seconds["acpo"] = _timed(lambda: acpo_advantages(x, sequence, mask, ACPOConfig()))
    stats = acpo_stats(out, x, sequence, mask, shannon=x)
    assert stats["acpo/sign_violations"] == 0 and math.isfinite(stats["acpo/budget_error/mean"])
    del out

    (value, parts), seconds["codapo"] = _timed(lambda: question_values(rewards, -x, mask, groups, 0.1))
    stats = codapo_stats(value, parts)
    assert 0.1 <= stats["codapo/value/min"] <= stats["codapo/value/max"] <= 1.1
    print("seconds at 2^25 valid tokens:", {k: round(v, 2) for k, v in seconds.items()})
