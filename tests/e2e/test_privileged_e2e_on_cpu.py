"""CSCR and OPPO (self- and teacher-oracle) end to end: their 1.5B FSDP2 recipes' CPU copies (``main_ppo`` in CPU mode
through the recipes' own launch scripts, the math reward), 2 steps each, the privileged re-scoring pass
through verl's real FSDP2 engine, and every dumped row's advantages checked against the estimator's
formula (verl_oar.core.cscr / core.oppo) from the dumped signals.

The CSCR run uses the identity template for c+ (``{question}``: the rollout's own prompt): its shifts
must be 0 up to float rounding (fp32), which checks that the pass renders the prompt as the agent loop
did and scores the response tokens at the rollout temperature; c- is the default template.

The teacher-oracle run's teacher is the workspace's model itself, i.e. the actor's starting weights: at
step 1 (before any update) its evidence must equal the self-oracle run's, whose rollout is the same; at
step 2 the actor has moved and the frozen teacher has not."""

from __future__ import annotations

import pytest
import torch
from _e2e import launch_recipe

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file

CSCR_KEYS = ("cscr/sensitivity/mean", "cscr/frac_attenuated", "cscr/weight/min", "cscr/weight/max", "cscr/budget_error",
             "cscr/sign_violations", "cscr/rescore/seconds", "cscr/rescore/truncated", "cscr/rescore/skipped",
             "oar/timing_s/cscr_shifts")
OPPO_KEYS = ("oppo/evidence/mean", "oppo/frac_clipped", "oppo/prior/mean", "oppo/sign_violations",
             "oppo/rescore/seconds", "oppo/rescore/truncated", "oar/timing_s/oppo_evidence")


@pytest.mark.slow
def test_cscr_and_oppo_train_and_their_dumps_follow_the_formulas(cpu_workspace_dir, tmp_path):
    from verl_oar.core.cscr import CSCRConfig, cscr_advantages
    from verl_oar.core.oppo import OPPOConfig, oppo_advantages

    cscr_dump = tmp_path / "cscr_dump"
    rc, log = launch_recipe(cpu_workspace_dir, tmp_path / "cscr.log", "qwen2_5_math_1_5b_cscr", 2, "e2e_cscr",
                            "algorithm.cscr.pos_template='{question}'", f"+algorithm.oar.dump_dir={cscr_dump}")
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_cscr"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        data = record["data"]
        assert all(k in data for k in CSCR_KEYS), [k for k in CSCR_KEYS if k not in data]
        assert data["cscr/sign_violations"] == 0 and data["cscr/budget_error"] < 1e-4
        assert data["actor/pg_loss"] == data["actor/pg_loss"]
    cfg = CSCRConfig()
    for step in (1, 2):
        d = torch.load(cscr_dump / f"step_{step}.pt")
        mask = d["response_mask"].bool()
        assert d["cscr_pos_shift"][mask].abs().max() < 1e-4  # identity template: the rollout's own log-probs
        assert d["cscr_neg_shift"][mask].abs().max() > 1e-2  # the "incorrect" condition moves them
        grpo = d["grpo_advantages"]
        sequence = grpo[torch.arange(len(grpo)), mask.float().argmax(1)] * mask.any(1)
        expected = cscr_advantages(sequence, d["cscr_pos_shift"], d["cscr_neg_shift"], mask, cfg).advantages
        torch.testing.assert_close(d["advantages"], expected * mask, atol=1e-6, rtol=1e-5)

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

