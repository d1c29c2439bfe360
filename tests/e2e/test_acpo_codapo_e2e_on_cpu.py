"""ACPO and CoDaPO end to end: the 1.5B FSDP2 recipes' CPU copies (``main_ppo`` in CPU mode through the recipes'
own launch scripts, the math reward), 2 steps each, every dumped row's advantages checked against the formulas
(verl_oar.core.acpo / core.codapo) from the dumped signals.

ACPO: the modal surrogate comes from verl's own old-log-prob pass (``engines.fsdp.modal``); it never exceeds
verl's entropy (H~ <= H) nor -old_log_prob (p_max >= the sampled token's probability). CoDaPO: step 1 is the
batch's first use, step 2 its second: the prompts of step 2 are exactly step 1's top-valued questions
(recomputed from step 1's dump), each copy a group of its own.

OAR-G x CoDaPO (``codapo.compose``, CoDaSampling on) trains in tests/e2e/test_upstream_series_on_cpu.py
(``compose_run``, 3 steps: advantages = question value x OAR-G's, passes 1, 2, 1, OAR's and CoDaPO's metrics).
It had a launch of its own here on plain verl; that launch checked nothing the series launch does not: the
composition is the registered estimator function in both routes (``signals.register_token_estimator``, verl's
``compute_advantage`` calls it), and what differs on plain verl -- the plugin trainer gathering the fields an
estimator needs and running CoDaSampling -- is what the CoDaPO launch here trains, and OAR-G through the plugin
trainer is test_resume_on_cpu.py's run."""

from __future__ import annotations

import pytest
import torch
from _e2e import launch_recipe

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file

ACPO_KEYS = ("acpo/weight/success/mean", "acpo/frac_clipped", "acpo/budget_error/mean", "acpo/sign_violations",
             "acpo/surrogate/mean", "acpo/entropy_gap/mean", "oar/timing_s/acpo_surrogate")
RIGHT_THRESHOLD = "algorithm.codapo.right_threshold=1.0"
"""the tiny workspace's reward scores a right answer 1.1 and a boxed wrong one 0.1 (its format bonus)"""
CODAPO_KEYS = ("codapo/value/mean", "codapo/confidence/mean", "codapo/accuracy/mean", "codapo/sampling/pass",
               "codapo/sampling/rollouts", "codapo/sampling/response_tokens", "codapo/sampling/policy_updates")


def _uids(keys):
    return [str(k).split("_")[0] for k in keys]


def _prompts(dump):
    return [tuple(p) for p in dump["prompts"]]


@pytest.mark.slow
def test_acpo_trains_and_its_dumps_follow_the_formula(cpu_workspace_dir, tmp_path):
    from verl_oar.core.acpo import ACPOConfig, acpo_advantages
    from verl_oar.integration.estimators import sequence_values

    dump = tmp_path / "acpo_dump"
    rc, log = launch_recipe(cpu_workspace_dir, tmp_path / "acpo.log", "qwen2_5_math_1_5b_acpo", 2, "e2e_acpo",
                            f"+algorithm.oar.dump_dir={dump}")
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_acpo"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        data = record["data"]
        assert all(k in data for k in ACPO_KEYS), [k for k in ACPO_KEYS if k not in data]
        assert data["acpo/sign_violations"] == 0 and data["acpo/entropy_gap/mean"] >= 0
    for step in (1, 2):
        d = torch.load(dump / f"step_{step}.pt")
        mask = d["response_mask"].bool()
        h = d["acpo_surrogate"]
        assert (h[mask] >= -1e-5).all() and (h[mask] <= d["acpo_entropy"][mask] + 1e-4).all()  # -log p_max <= H
        grpo = d["grpo_advantages"]
        sequence = sequence_values(grpo, mask)
        expected = acpo_advantages(h, sequence, mask, ACPOConfig()).advantages
        torch.testing.assert_close(d["advantages"], expected * mask, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_codapo_uses_each_batch_twice_the_second_time_on_its_top_questions(cpu_workspace_dir, tmp_path):
    from verl_oar.core.codapo import question_values, select_questions
    from verl_oar.core.oppo import group_ids

    dump = tmp_path / "codapo_dump"
    rc, log = launch_recipe(cpu_workspace_dir, tmp_path / "codapo.log", "qwen2_5_math_1_5b_codapo", 2, "e2e_codapo",
                            f"+algorithm.oar.dump_dir={dump}", RIGHT_THRESHOLD)
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_codapo"))
    assert [r["step"] for r in records] == [1, 2]
    assert [r["data"]["codapo/sampling/pass"] for r in records] == [1.0, 2.0]
    for record in records:
        assert all(k in record["data"] for k in CODAPO_KEYS), [k for k in CODAPO_KEYS if k not in record["data"]]
        assert record["data"]["codapo/sampling/rollouts"] == 16.0   # 2 prompts x 8, both uses
    first, second = (torch.load(dump / f"step_{s}.pt") for s in (1, 2))
    for d in (first, second):  # A = v x GRPO, v recomputed from the dumped rewards and old log-probs
        mask = d["response_mask"].bool()
        uids = _uids(d["keys"])
        assert len(set(uids)) == 2                                   # two groups of 8, each its own uid
        value, _ = question_values(d["rewards"], d["old_log_probs"], mask, group_ids(uids), 0.1, 1.0)
        torch.testing.assert_close(d["codapo_value"], value.float(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(d["advantages"], d["codapo_value"][:, None] * d["grpo_advantages"] * mask,
                                   atol=1e-6, rtol=1e-5)
    # step 2 = the top-valued questions of step 1 (percentile 0.75 of 2 values: the larger, or both if tied)
    uids1, prompts1 = _uids(first["keys"]), _prompts(first)
    by_uid = {u: (float(v), p) for u, v, p in zip(uids1, first["codapo_value"], prompts1)}
    order = list(dict.fromkeys(uids1))
    chosen = {by_uid[order[i]][1] for i in select_questions([by_uid[u][0] for u in order], 0.75)}
    assert set(_prompts(second)) == chosen
    assert not set(_uids(second["keys"])) & set(uids1)               # new groups, not step 1's
