"""End to end: ``python -m verl.trainer.main_ppo algorithm.adv_estimator=oar_p`` in CPU mode (verl's real
v1 trainer, FSDP2 engine, Ray, hf rollout). Marked slow: minutes on 2 cores."""

from __future__ import annotations

import pytest
import torch
from _e2e import OAR_KEYS, check_reshaped_exactly_where_importance_varies, launch

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file

PERTURB_KEYS = ("oar/perturb/copies_mean", "oar/perturb/copies_max", "oar/perturb/cost_passes_mean",
                "oar/perturb/peak_call_tokens")


@pytest.mark.slow
def test_oar_p_trains_two_steps_with_budgeted_chunks(cpu_workspace_dir, tmp_path):
    dump = tmp_path / "dump"
    budget = 6
    rc, log = launch(cpu_workspace_dir, tmp_path / "log", "e2e_oar_p", f"+algorithm.oar.dump_dir={dump}",
                     "+algorithm.oar.perturb_mode=chunk", f"+algorithm.oar.perturb_budget={budget}",
                     estimator="oar_p")
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_oar_p"))
    assert [r["step"] for r in records] == [1, 2], log[-3000:]
    for record in records:
        data = record["data"]
        missing = [k for k in OAR_KEYS + PERTURB_KEYS if k not in data]
        assert not missing, missing
        assert "oar/fused_log_prob" not in data  # OAR-P runs in passes of its own
        assert data["oar/mass_error/max_abs"] < 1e-4
        assert 0 < data["oar/perturb/copies_max"] <= budget
        assert data["oar/perturb/cost_passes_mean"] <= budget + 1

    assert check_reshaped_exactly_where_importance_varies(dump) > 0, "nothing was reshaped: the run exercised nothing"
    for step in (1, 2):  # every token of a chunk carries its chunk's importance: at most K values per row
        d = torch.load(dump / f"step_{step}.pt")
        for row, reasoning in zip(d["oar_importance"], d["oar_reasoning_mask"].bool()):
            assert row[reasoning].unique().numel() <= budget
            assert torch.all(row[~reasoning] == 0)
