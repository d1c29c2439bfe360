"""The recipes' CPU copies through their own launch scripts (``python -m verl_oar.cpu.recipe``): the
end-to-end tests of OAR-G and OAR-P as a recipe runs them. What the recipes are (composition, verl's
validation, the published settings, the launch scripts) is checked in tests/unit/test_recipe_configs_on_cpu.py;
Megatron recipes cannot run without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _e2e import OAR_KEYS, RECIPE_CPU_COPIES, check_reshaped_exactly_where_importance_varies

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file
from verl_oar.cpu.recipe import RECIPES_DIR

ESTIMATORS = ("grpo", "oar_g", "oar_p")
CPU_COPIES = RECIPE_CPU_COPIES
"""the FSDP2 OAR-G and OAR-P recipes of the 1.5B model. A GRPO recipe differs from its OAR-G twin only in
``algorithm.*`` (tests/unit/test_recipe_configs_on_cpu.py), so its copy would run the same configuration
minus OAR (GRPO itself trains end to end in test_testbed_demo_on_cpu.py). Shrunk to the CPU workspace,
a 7B copy differs from its 1.5B twin only in the reference model's ``param_offload=True``, which
test_oar_g_e2e_on_cpu.py's reference-model run has, and in token budgets (6k-24k tokens) that a CPU step
(at most 16 x 112 tokens) never reaches
(tests/unit/test_recipe_configs_on_cpu.py::test_the_cpu_copies_cover_every_fsdp2_oar_recipes_settings)."""
PERTURB_KEYS = ("oar/perturb/copies_mean", "oar/perturb/copies_max", "oar/perturb/cost_passes_mean",
                "oar/perturb/peak_call_tokens")
BUDGET = 16


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_COPIES)
def test_cpu_copy_of_the_recipe_trains_through_its_own_launch_script(name, cpu_workspace_dir, tmp_path):
    """1.5B copies run 2 steps and dump their tensors: these are the end-to-end tests of OAR-G and OAR-P
    (``python -m verl.trainer.main_ppo algorithm.adv_estimator=oar_g|oar_p`` in CPU mode, verl's v1
    trainer, FSDP2 engine with dynamic batch size, Ray, hf rollout); 7B copies (none run now) run 1 step."""
    steps = 2 if "_1_5b_" in name else 1
    estimator = next(e for e in ESTIMATORS if name.endswith(e))
    dump = tmp_path / "dump"
    extra = [f"algorithm.oar.dump_dir={dump}"] if estimator != "grpo" and steps == 2 else []
    log = tmp_path / "log"
    with open(log, "w") as fp:
        proc = subprocess.run(
            [sys.executable, "-m", "verl_oar.cpu.recipe", name, "--workdir", str(cpu_workspace_dir),
             "--steps", str(steps), "--timeout", "400", *extra],
            stdout=fp, stderr=subprocess.STDOUT, timeout=430, check=False,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    assert f"bash {RECIPES_DIR / f'run_{name}.sh'}" in text  # through the recipe's own script
    records = read_metrics(metrics_file(cpu_workspace_dir, f"cpu_{name}"))
    assert [r["step"] for r in records] == list(range(1, steps + 1)), text[-3000:]
    for record in records:
        data = record["data"]
        assert data["training/rollout_probs_diff_mean"] < 1e-4  # fp32 rollout and trainer agree
        assert data["actor/pg_loss"] == data["actor/pg_loss"]  # not NaN
        assert 0.0 <= data["critic/score/mean"] <= 1.0  # math-verify scores 0 or 1
        if estimator == "grpo":
            assert not any(k.startswith("oar/") for k in data)
            continue
        assert all(k in data for k in OAR_KEYS), [k for k in OAR_KEYS if k not in data]
        assert data["oar/mass_error/max_abs"] < 1e-4
        # the math reward returns the span it graded, and OAR grounds on exactly that span
        sources = {k: data[f"oar/answer/frac_{k}"] for k in ("none", "locator", "reward", "reward_rejected")}
        assert sources["reward"] > 0 and sources["locator"] == 0 and sources["reward_rejected"] == 0, sources
        assert abs(sum(sources.values()) - 1.0) < 1e-9
        assert data["oar/fallback/frac_no_answer"] == pytest.approx(sources["none"])
        assert data["oar/fallback/no_answer_streak"] in (0.0, 1.0, 2.0)
        if estimator == "oar_g":
            assert data["oar/fused_log_prob"] == 1.0  # the recipe fuses importance into the log-prob pass
        else:
            assert all(k in data for k in PERTURB_KEYS), [k for k in PERTURB_KEYS if k not in data]
            assert "oar/fused_log_prob" not in data  # OAR-P runs in passes of its own
            assert 0 < data["oar/perturb/copies_max"] <= BUDGET  # chunk mode, perturb_budget 16
            assert data["oar/perturb/cost_passes_mean"] <= BUDGET + 1
    if not extra:
        return
    reshaped = check_reshaped_exactly_where_importance_varies(dump, steps=range(1, steps + 1))
    assert reshaped > 0, "no response had varying importance: the run exercised nothing"
    if estimator == "oar_p":  # every token of a chunk carries its chunk's importance: at most K values per row
        for step in range(1, steps + 1):
            d = torch.load(dump / f"step_{step}.pt")
            for row, reasoning in zip(d["oar_importance"], d["oar_reasoning_mask"].bool(), strict=True):
                assert row[reasoning].unique().numel() <= BUDGET
                assert torch.all(row[~reasoning] == 0)
