"""verl's legacy trainer (``trainer.use_v1=false``, ``RayPPOTrainer``) in CPU mode: 2 GRPO steps through
the launcher (``python -m verl_oar.cpu.launch --legacy``). The v1 trainer's runs are the other tests
here; OAR refuses the legacy trainer (tests/unit/test_trainer_hook_on_cpu.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _run_launcher(workspace: Path, log: Path, experiment: str, *extra: str) -> list[dict]:
    """Run ``python -m verl_oar.cpu.launch`` for 2 GRPO steps; assert success; return the step records."""
    from verl_oar.cpu.launch import read_metrics
    from verl_oar.cpu.overrides import metrics_file

    with open(log, "w") as fp:
        proc = subprocess.run(
            [
                sys.executable, "-m", "verl_oar.cpu.launch",
                "--workdir", str(workspace),
                "--steps", "2",
                "--adv-estimator", "grpo",
                "--experiment-name", experiment,
                "--timeout", "330",
                *extra,
            ],
            check=False, stdout=fp, stderr=subprocess.STDOUT, timeout=360,
        )  # fmt: skip
    tail = log.read_text()[-6000:]
    assert proc.returncode == 0, tail
    records = read_metrics(metrics_file(workspace, experiment))
    assert [r["step"] for r in records] == [1, 2], tail
    return records


@pytest.mark.slow
def test_grpo_two_steps_with_verls_legacy_trainer_on_cpu(cpu_workspace_dir: Path, tmp_path: Path):
    records = _run_launcher(cpu_workspace_dir, tmp_path / "trainer.log", "e2e_test_grpo_legacy", "--legacy")
    for record in records:
        assert {"critic/score/mean", "actor/pg_loss"} <= set(record["data"])
