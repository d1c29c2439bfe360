"""End to end: ``python -m verl.trainer.main_ppo algorithm.adv_estimator=oar_g`` in CPU mode (verl's real
v1 trainer, FSDP2 engine, Ray, hf rollout), and the start-up refusals. Marked slow: minutes on 2 cores."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file

OAR_KEYS = (
    "oar/timing_s/token_importance", "oar/weight/min", "oar/weight/max", "oar/weight/frac_suppressed",
    "oar/weight/frac_amplified", "oar/mass_error/max_abs", "oar/fallback/frac_any",
    "oar/fallback/frac_no_answer", "oar/importance/mean",
)


def _launch(workspace: Path, log: Path, experiment: str, *extra: str, estimator: str = "oar_g") -> tuple[int, str]:
    with open(log, "w") as fp:
        proc = subprocess.run(
            [sys.executable, "-m", "verl_oar.cpu.launch", "--workdir", str(workspace), "--steps", "2",
             "--adv-estimator", estimator, "--experiment-name", experiment, "--timeout", "330", *extra],
            check=False, stdout=fp, stderr=subprocess.STDOUT, timeout=360,
        )
    return proc.returncode, log.read_text()


@pytest.mark.slow
def test_oar_g_trains_two_steps_and_reshapes_exactly_where_importance_varies(cpu_workspace_dir, tmp_path):
    dump = tmp_path / "dump"
    rc, log = _launch(cpu_workspace_dir, tmp_path / "log", "e2e_oar_g", f"+algorithm.oar.dump_dir={dump}")
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

    reshaped_rows = 0
    for step in (1, 2):
        d = torch.load(dump / f"step_{step}.pt")
        grpo, adv, importance = d["grpo_advantages"], d["advantages"], d["oar_importance"]
        reasoning = d["oar_reasoning_mask"].bool()
        mask = grpo != 0  # rows with a zero group advantage stay zero under both
        varies = torch.tensor([
            bool(reasoning[i].any()) and importance[i][reasoning[i]].unique().numel() > 1 for i in range(len(grpo))
        ])
        reshaped = varies & (d["fallback"] == 0) & mask.any(dim=1)
        for i in range(len(grpo)):
            if reshaped[i]:
                reshaped_rows += 1
                assert not torch.allclose(adv[i][reasoning[i]], grpo[i][reasoning[i]])
                torch.testing.assert_close(adv[i][~reasoning[i]], grpo[i][~reasoning[i]])  # outside: weight 1
                torch.testing.assert_close(adv[i].sum(), grpo[i].sum(), rtol=1e-4, atol=1e-4)
                assert torch.all(torch.sign(adv[i]) == torch.sign(grpo[i]))
            else:
                torch.testing.assert_close(adv[i], grpo[i])  # no variation or a fallback: GRPO credit
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
    rc, log = _launch(cpu_workspace_dir, tmp_path / "log", "e2e_oar_g_refused", *extra)
    assert rc != 0
    assert expected in log, log[-6000:]
    assert read_metrics(metrics_file(cpu_workspace_dir, "e2e_oar_g_refused")) == []  # not a single step ran


@pytest.mark.slow
def test_oar_g_with_reference_model_importance_and_the_other_objective_and_saliency(cpu_workspace_dir, tmp_path):
    extra = ("+algorithm.oar.importance_model=ref", "+algorithm.oar.objective=loglik", "+algorithm.oar.saliency=grad_norm")
    rc, log = _launch(cpu_workspace_dir, tmp_path / "log", "e2e_oar_g_ref", *extra)
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_oar_g_ref"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert all(k in record["data"] for k in OAR_KEYS)
        assert "oar/fused_log_prob" not in record["data"]  # the reference model needs its own pass
        assert record["data"]["oar/weight/max"] > 1.0  # something was amplified
