"""Checkpoint and resume: the OAR-G recipe's CPU copy, resumed from its step-2 checkpoint, trains steps 3-4
exactly as the uninterrupted run did (same rollouts, importance, masks, GRPO and OAR advantages). The
uninterrupted run is also the end-to-end test of OAR-G as the recipe runs it (through its own launch
script, ``python -m verl_oar.cpu.recipe``; test_recipes_on_cpu.py has OAR-P's).

The hf rollout's sampling is what makes this possible (its module docstring: seeded per request from
the weights' step, the prompt and the request's rank among identical prompts);
tests/engine/test_hf_rollout_sampling_on_cpu.py checks that property directly, this test the whole
trainer (two launches, minutes).
"""

from __future__ import annotations

import shutil

import pytest

# ---------------------------------------------------------------------------------------------------
# end to end: verl's trainer, 4 steps straight vs 2 + resume to 4
# ---------------------------------------------------------------------------------------------------

NAME = "qwen2_5_math_1_5b_oar_g"

COMPARED = ("oar_importance", "oar_reasoning_mask", "oar_answer_mask", "grpo_advantages", "advantages", "weights")
"""dumped per-token fields that must agree between the two runs (all (bs, response_len), padded)"""


@pytest.mark.slow
def test_oar_g_recipe_copy_trains_and_resumed_trains_steps_3_and_4_like_the_uninterrupted_run(
    cpu_workspace_dir, tmp_path
):
    """The recipe's copy (verl's v1 trainer, FSDP2 with dynamic batch size, importance fused into the
    log-prob pass) 4 steps straight (checkpoints after steps 2 and 4) vs the same run resumed from its step-2
    checkpoint: steps 3 and 4 must roll out the same responses and dump bit-equal importance, masks,
    GRPO advantages, OAR weights and advantages (CPU, fp32, same seeds). verl restores the actor's
    weights, optimizer and lr scheduler, the dataloader position and the step number; the hf rollout
    seeds its sampling from the step; OAR's noise depends on (seed, step, tokens).

    Both runs use ``CONTENT_ORDERED_SAMPLER`` (_e2e.py): verl orders a training batch by the order in
    which rollouts finished, which differs between any two runs, and that order alone changes
    OAR-G's importance by ~3e-5 relative and, through the quantile weights, advantages by ~1e-2 by
    step 4."""
    from _e2e import (
        CONTENT_ORDERED_SAMPLER,
        check_recipe_records,
        check_reshaped_exactly_where_importance_varies,
        compare_dumped_steps,
        launch_recipe,
    )

    from verl_oar.cpu.launch import read_metrics
    from verl_oar.cpu.overrides import metrics_file

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # run A: 4 steps straight, checkpoints after steps 2 and 4
    rc, log = launch_recipe(
        cpu_workspace_dir, tmp_path / "a.log", NAME, 4, "resume_a", *CONTENT_ORDERED_SAMPLER,
        "trainer.save_freq=2", f"trainer.default_local_dir={straight / 'ckpt'}",
        f"algorithm.oar.dump_dir={straight / 'dump'}", f"trainer.rollout_data_dir={straight / 'rollouts'}",
    )  # fmt: skip
    assert rc == 0, log[-6000:]
    records = read_metrics(metrics_file(cpu_workspace_dir, "resume_a"))
    assert [r["step"] for r in records] == [1, 2, 3, 4], log[-3000:]
    check_recipe_records(records, "oar_g")
    assert check_reshaped_exactly_where_importance_varies(straight / "dump", steps=(1, 2)) > 0
    checkpoint = straight / "ckpt" / "global_step_2"
    assert (checkpoint / "data.pt").exists(), sorted(p.name for p in checkpoint.parent.iterdir())
    # run B: from A's step-2 checkpoint (a copy: B writes its own step-4 checkpoint next to it) to step 4
    shutil.copytree(checkpoint, resumed / "ckpt" / "global_step_2")
    rc, log = launch_recipe(
        cpu_workspace_dir, tmp_path / "b.log", NAME, 4, "resume_b", *CONTENT_ORDERED_SAMPLER,
        "trainer.save_freq=2", f"trainer.default_local_dir={resumed / 'ckpt'}",
        "trainer.resume_mode=resume_path", f"trainer.resume_from_path={resumed / 'ckpt' / 'global_step_2'}",
        f"algorithm.oar.dump_dir={resumed / 'dump'}", f"trainer.rollout_data_dir={resumed / 'rollouts'}",
    )  # fmt: skip
    assert rc == 0, log[-6000:]
    # B resumed at step 3 (verl restored the step) and trained steps 3 and 4 only
    assert [r["step"] for r in read_metrics(metrics_file(cpu_workspace_dir, "resume_b"))] == [3, 4], log[-6000:]
    assert sorted(p.name for p in (resumed / "dump").iterdir()) == ["step_3.pt", "step_4.pt"], log[-6000:]

    # not vacuous: OAR reshaped GRPO's credit in each compared step
    for step in (3, 4):
        assert check_reshaped_exactly_where_importance_varies(resumed / "dump", steps=(step,)) > 0, step
    diffs = compare_dumped_steps(straight, resumed, steps=(3, 4), fields=COMPARED)  # bit-equal
    print("max |difference| per step and field, uninterrupted vs resumed:", diffs)
