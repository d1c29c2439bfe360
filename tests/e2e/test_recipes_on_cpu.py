"""The OAR-P recipe's CPU copy through its own launch script (``python -m verl_oar.cpu.recipe``): the
end-to-end test of OAR-P as a recipe runs it. The OAR-G recipe's copy trains (4 steps, then resumed) in
test_resume_on_cpu.py. What the recipes are (composition, verl's validation, the published settings, the
launch scripts, that these copies cover every FSDP2 OAR recipe's settings) is checked in
tests/unit/test_recipe_configs_on_cpu.py; Megatron recipes cannot run without CUDA. A GRPO recipe differs
from its OAR twin only in ``algorithm.*``; GRPO itself trains end to end in test_testbed_demo_on_cpu.py.
Marked slow: minutes on 2 cores."""

from __future__ import annotations

import pytest
import torch
from _e2e import RECIPE_PERTURB_BUDGET, check_recipe_records, check_reshaped_exactly_where_importance_varies, launch_recipe

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file

NAME = "qwen2_5_math_1_5b_oar_p"


@pytest.mark.slow
def test_cpu_copy_of_the_oar_p_recipe_trains_through_its_own_launch_script(cpu_workspace_dir, tmp_path):
    """2 steps of ``python -m verl.trainer.main_ppo algorithm.adv_estimator=oar_p`` as the recipe sets it,
    in CPU mode (verl's v1 trainer, FSDP2 engine with dynamic batch size, Ray, hf rollout), tensors dumped."""
    dump = tmp_path / "dump"
    rc, text = launch_recipe(cpu_workspace_dir, tmp_path / "log", NAME, 2, f"cpu_{NAME}", f"algorithm.oar.dump_dir={dump}")
    assert rc == 0, text[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, f"cpu_{NAME}"))
    assert [r["step"] for r in records] == [1, 2], text[-3000:]
    check_recipe_records(records, "oar_p")
    assert check_reshaped_exactly_where_importance_varies(dump, steps=(1, 2)) > 0, "no response had varying importance"
    # every token of a chunk carries its chunk's importance: at most K values per row
    for step in (1, 2):
        d = torch.load(dump / f"step_{step}.pt")
        for row, reasoning in zip(d["oar_importance"], d["oar_reasoning_mask"].bool(), strict=True):
            assert row[reasoning].unique().numel() <= RECIPE_PERTURB_BUDGET
            assert torch.all(row[~reasoning] == 0)
