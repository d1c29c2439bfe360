"""End to end: ``python -m verl.trainer.main_ppo algorithm.adv_estimator=oar_g`` in CPU mode (verl's real
v1 trainer, FSDP2 engine, Ray, hf rollout), and the start-up refusals. Marked slow: minutes on 2 cores."""

from __future__ import annotations

import pytest
from _e2e import OAR_KEYS, check_reshaped_exactly_where_importance_varies, launch

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file


@pytest.mark.slow
def test_oar_g_trains_two_steps_and_reshapes_exactly_where_importance_varies(cpu_workspace_dir, tmp_path):
    dump = tmp_path / "dump"
    rc, log = launch(cpu_workspace_dir, tmp_path / "log", "e2e_oar_g", f"+algorithm.oar.dump_dir={dump}")
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_oar_g"))
    assert [r["step"] for r in records] == [1, 2], log[-3000:]
    for record in records:
        missing = [k for k in OAR_KEYS if k not in record["data"]]
        assert not missing, missing
        assert record["data"]["oar/mass_error/max_abs"] < 1e-4
        # by default importance rides on verl's old-log-prob pass; its log-probs must stay verl's
        assert record["data"]["oar/fused_log_prob"] == 1.0
        assert record["data"]["training/rollout_probs_diff_mean"] < 1e-4

    reshaped_rows = check_reshaped_exactly_where_importance_varies(dump)
    assert reshaped_rows > 0, "no response had varying importance: the test batch exercised nothing"


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra, expected",
    [
        (("--legacy",), "Set trainer.use_v1=true"),
        (("+algorithm.oar.tua=0.5",), "Unknown key(s) algorithm.oar.tua"),
    ],
    ids=["legacy-trainer", "mistyped-key"],
)
def test_oar_g_refuses_at_startup_with_cause_and_fix(cpu_workspace_dir, tmp_path, extra, expected):
    rc, log = launch(cpu_workspace_dir, tmp_path / "log", "e2e_oar_g_refused", *extra)
    assert rc != 0
    assert expected in log, log[-6000:]
    assert read_metrics(metrics_file(cpu_workspace_dir, "e2e_oar_g_refused")) == []  # not a single step ran


@pytest.mark.slow
def test_oar_g_with_reference_model_importance_and_the_other_objective_and_saliency(cpu_workspace_dir, tmp_path):
    extra = ("+algorithm.oar.importance_model=ref", "+algorithm.oar.objective=loglik", "+algorithm.oar.saliency=grad_norm")
    rc, log = launch(cpu_workspace_dir, tmp_path / "log", "e2e_oar_g_ref", *extra)
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_oar_g_ref"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert all(k in record["data"] for k in OAR_KEYS)
        assert "oar/fused_log_prob" not in record["data"]  # the reference model needs its own pass
        assert record["data"]["oar/weight/max"] > 1.0  # something was amplified
