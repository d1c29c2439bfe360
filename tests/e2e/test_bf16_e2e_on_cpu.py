"""bf16 end to end: OAR-G through ``main_ppo`` in CPU mode with the dtype real runs use (FSDP2
``param_dtype=bf16`` for actor and reference, a bf16 hf rollout), 2 steps, with importance from the
reference model offloaded between passes as the 7B recipes have it, and with the other objective and
saliency (``REF_MODEL_RUN``, _e2e.py). Marked slow: minutes on 2 cores.

The fused path in bf16 (verl's old-log-prob pass that also yields OAR-G's importance) is checked
bit-identical to verl's own pass, in-process on the real FSDP2 engine, in
tests/engine/test_engine_importance_on_cpu.py; the OAR-G recipe's copy trains it end to end in fp32
(test_resume_on_cpu.py)."""

from __future__ import annotations

import pytest
from _e2e import OAR_KEYS, REF_MODEL_RUN, launch

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file

BF16 = (
    "++actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}",
    "++actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}",
    "actor_rollout_ref.rollout.dtype=bfloat16",
)
AGREEMENT = "training/rollout_probs_diff_mean"


@pytest.mark.slow
def test_oar_g_in_bf16_from_the_offloaded_reference_model(cpu_workspace_dir, tmp_path):
    """The reference model's parameters leave the device between passes: OAR's importance pass on it must
    bring them back (tests/unit/test_recipe_configs_on_cpu.py counts this run as the 7B recipes' CPU copy
    for that setting)."""
    rc, log = launch(cpu_workspace_dir, tmp_path / "log", "e2e_bf16_oar_g_ref", *BF16, *REF_MODEL_RUN)
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_bf16_oar_g_ref"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        data = record["data"]
        assert all(k in data for k in OAR_KEYS), [k for k in OAR_KEYS if k not in data]
        assert "oar/fused_log_prob" not in data  # the reference model needs its own pass
        assert data["oar/weight/max"] > 1.0  # something was amplified, in bf16
        assert data["oar/mass_error/max_abs"] < 1e-3
        assert data["actor/pg_loss"] == data["actor/pg_loss"]  # not NaN
        # it really ran in bf16: fp32 rollout and trainer agree to < 1e-6 here (test_recipes_on_cpu.py,
        # test_resume_on_cpu.py), bf16 to ~1e-3
        assert 1e-4 < data[AGREEMENT] < 5e-2, data[AGREEMENT]
