"""OPPO (self- and teacher-oracle) end to end: its 1.5B FSDP2 recipes' CPU copies (``main_ppo`` in CPU mode
through the recipes' own launch scripts, the math reward), 2 steps each, the privileged re-scoring pass
through verl's real FSDP2 engine, and every dumped row's advantages checked against the estimator's
formula (verl_oar.core.oppo) from the dumped signals.

The teacher-oracle run's teacher is the workspace's model itself, i.e. the actor's starting weights: at
step 1 (before any update) its evidence must equal the self-oracle run's, whose rollout is the same; at
step 2 the actor has moved and the frozen teacher has not.

CSCR's recipe copy trains in tests/e2e/test_upstream_series_on_cpu.py, on verl with the upstream series (its
checks moved there whole: the identity template for c+, 2 steps, its metrics and formula). It had a launch of
its own here too, on plain verl; CSCR and OPPO share the re-scoring pass and its batch balancing
(``privileged_signal``), which on plain verl -- verl's private ``_balance_batch`` -- these two OPPO launches run."""

from __future__ import annotations

import pytest
import torch
from _e2e import launch_recipe

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file

OPPO_KEYS = ("oppo/evidence/mean", "oppo/frac_clipped", "oppo/prior/mean", "oppo/sign_violations",
             "oppo/rescore/seconds", "oppo/rescore/truncated", "oar/timing_s/oppo_evidence")


@pytest.mark.slow
def test_oppo_and_its_teacher_train_and_their_dumps_follow_the_formula(cpu_workspace_dir, tmp_path):
    from verl_oar.core.oppo import OPPOConfig, oppo_advantages

    oppo_dump = tmp_path / "oppo_dump"
    rc, log = launch_recipe(cpu_workspace_dir, tmp_path / "oppo.log", "qwen2_5_math_1_5b_oppo", 2, "e2e_oppo",
                            f"+algorithm.oar.dump_dir={oppo_dump}")
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_oppo"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert all(k in record["data"] for k in OPPO_KEYS), [k for k in OPPO_KEYS if k not in record["data"]]
        assert record["data"]["oppo/sign_violations"] == 0
    for step in (1, 2):
        d = torch.load(oppo_dump / f"step_{step}.pt")
        mask, scored = d["response_mask"].bool(), d["oppo_scored"].bool().any(1)  # unscored rows: broadcast credit
        assert d["oppo_evidence"][mask & scored[:, None]].abs().max() > 1e-2  # the reference answer moves the log-probs
        expected = oppo_advantages(d["oppo_evidence"], d["rewards"], d["groups"], mask, OPPOConfig(), scored).advantages
        torch.testing.assert_close(d["advantages"], expected, atol=1e-6, rtol=1e-5)

    teacher_dump = tmp_path / "teacher_dump"
    rc, log = launch_recipe(cpu_workspace_dir, tmp_path / "teacher.log", "qwen2_5_math_1_5b_oppo_teacher", 2,
                            "e2e_oppo_teacher", f"+algorithm.oar.dump_dir={teacher_dump}")  # teacher: the workspace model
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_oppo_teacher"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert all(k in record["data"] for k in OPPO_KEYS), [k for k in OPPO_KEYS if k not in record["data"]]
        assert record["data"]["oppo/sign_violations"] == 0
    for step in (1, 2):
        d = torch.load(teacher_dump / f"step_{step}.pt")
        mask, scored = d["response_mask"].bool(), d["oppo_scored"].bool().any(1)
        expected = oppo_advantages(d["oppo_evidence"], d["rewards"], d["groups"], mask, OPPOConfig(), scored).advantages
        torch.testing.assert_close(d["advantages"], expected, atol=1e-6, rtol=1e-5)
    # teacher = the actor at step 1: a response both runs sampled gets the same evidence (the runs' rows
    # come in another order, and a row or two are sampled differently)
    own, taught = torch.load(oppo_dump / "step_1.pt"), torch.load(teacher_dump / "step_1.pt")

    def rows(d):
        return [(tuple(d["responses"][i][d["response_mask"][i].bool()].tolist()),
                 d["oppo_evidence"][i][d["response_mask"][i].bool()]) for i in range(len(d["responses"]))]

    theirs = rows(taught)
    matched = [any(r == r2 and (e - e2).abs().max() < 1e-4 for r2, e2 in theirs) for r, e in rows(own)]
    assert sum(matched) >= 0.75 * len(matched), matched
    assert max(float(e.abs().max()) for _, e in theirs) > 1e-2  # and the evidence is not trivially 0
    # step 2: the actor has moved, the frozen teacher has not: the same responses get other evidence
    own, theirs = rows(torch.load(oppo_dump / "step_2.pt")), rows(torch.load(teacher_dump / "step_2.pt"))
    common = [(e, e2) for r, e in own for r2, e2 in theirs if r == r2]
    assert common and all((e - e2).abs().max() > 1e-4 for e, e2 in common)

