"""The fast runner against ``python -m verl.trainer.main_ppo`` on fill32, where the study's headline comes from, both
run here and now on this machine (so on any CPU: no committed fixture whose rounding belongs to another CPU).

main_ppo trains fill32's warm start one step for OAR-G (seed 0, the study's settings) and dumps the step; a fresh
process then replays it through the runner (``verl_oar.testbed.fast_check``): the runner samples its own step-1
rollouts, and computes importance, masks, GRPO and OAR advantages on main_ppo's rows, then takes OAR-G's update.

GRPO's step has no launch of its own here (it had one): its advantages are compared bit for bit on OAR-G's rows
above, and its update against main_ppo's GRPO run -- the same update code as OAR-G's, on GRPO's advantages -- at the
same tolerances (1e-6) on the committed fixture's step, on the start testbed (tests/unit/test_fast_runner_on_cpu.py::
test_replayed_step_matches_main_ppo, in the fast tier).

Tolerance: none where both sides run the same kernels on the same rows in the same order on one CPU (rollouts,
masks, GRPO advantages, rewards): bit for bit. The importance is a gradient norm per token computed by verl's actor
in each process: the same code on the same CPU, so bit for bit as well; OAR-G's advantages follow from it and the
masks by comparisons and quantiles, so they are bit-identical too. The actor metrics come from one update on the
same rows: equal within 1e-6 (relative for the gradient norm) as float32 sums of a few thousand terms allow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILL32 = ROOT / "verl_oar" / "testbed" / "variants" / "fill32"


@pytest.mark.slow
def test_fast_runner_step_one_equals_main_ppos_on_fill32(tmp_path, shared_ray_cluster):
    from verl_oar.testbed.fast_check import make_fixture

    fixture = make_fixture(tmp_path / "fixture", FILL32, ("oar_g",))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("VERL_PLATFORM", None)
    done = subprocess.run([sys.executable, "-m", "verl_oar.testbed.fast_check", "replay", str(fixture)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads(next(x for x in done.stdout.splitlines() if x.startswith("REPLAY "))[len("REPLAY "):])
    assert set(report) == {"oar_g"}
    oar = report["oar_g"]
    assert oar["rows"] == 64, oar
    assert oar["rollouts_identical"], "the runner's step-1 rollouts differ from main_ppo's"
    assert oar["score_mean"] == oar["logged_score_mean"], oar
    assert oar["grpo_advantages_identical"], oar  # GRPO's advantages of the same rows, bit for bit
    assert oar["actor/pg_loss"]["abs_diff"] <= 1e-6, oar
    assert oar["actor/entropy"]["abs_diff"] <= 1e-6, oar
    assert oar["actor/grad_norm"]["abs_diff"] <= 1e-6 * oar["actor/grad_norm"]["main_ppo"], oar
    for name in ("oar_reasoning_mask", "oar_answer_mask", "oar_importance"):
        assert oar[f"{name}_identical"], (name, oar)
    assert oar["advantages_identical"], oar  # OAR-G's reshaped advantages, bit for bit
    assert oar["oar_importance_max_abs"] > 0  # a real signal was compared, not an all-zero one
