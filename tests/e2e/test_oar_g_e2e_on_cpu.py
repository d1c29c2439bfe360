"""End to end through ``python -m verl_oar.cpu.launch`` (CPU mode's own overrides, static micro-batches):
OAR-G from the (offloaded) reference model with the other objective and saliency, and a start-up refusal.
The default OAR-G and OAR-P runs (2 steps, dumped tensors checked) are the recipes' CPU copies in
test_recipes_on_cpu.py. Marked slow: minutes on 2 cores."""

from __future__ import annotations

import pytest
from _e2e import OAR_KEYS, REF_MODEL_RUN, launch

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file


@pytest.mark.slow
def test_oar_g_on_verls_legacy_trainer_refuses_at_startup_with_cause_and_fix(cpu_workspace_dir, tmp_path):
    """One refusal through the real trainer process: verl's legacy TaskRunner, in its Ray actor, imports
    ``main_ppo_v0``, where the plugin's post-import hook made ``RayPPOTrainer`` a dispatcher; it refuses
    OAR when the trainer is constructed, before any worker trains. Every refusal, and that a GRPO run
    gets verl's own legacy ``RayPPOTrainer``, is checked in-process in tests/unit/test_trainer_hook_on_cpu.py."""
    rc, log = launch(cpu_workspace_dir, tmp_path / "log", "e2e_oar_g_refused", "--legacy")
    assert rc != 0
    assert "trainer.use_v1=true" in log, log[-6000:]
    assert read_metrics(metrics_file(cpu_workspace_dir, "e2e_oar_g_refused")) == []  # not a single step ran


@pytest.mark.slow
def test_oar_g_with_reference_model_importance_and_the_other_objective_and_saliency(cpu_workspace_dir, tmp_path):
    """The reference model is offloaded (its parameters leave the device between passes), as the 7B
    recipes have it: OAR's importance pass on it must bring them back (tests/unit/test_recipe_configs_on_cpu.py
    counts this run as the 7B recipes' CPU copy for that setting)."""
    rc, log = launch(cpu_workspace_dir, tmp_path / "log", "e2e_oar_g_ref", *REF_MODEL_RUN)
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_oar_g_ref"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert all(k in record["data"] for k in OAR_KEYS)
        assert "oar/fused_log_prob" not in record["data"]  # the reference model needs its own pass
        assert record["data"]["oar/weight/max"] > 1.0  # something was amplified
