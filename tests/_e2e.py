"""Shared by the end-to-end tests: launch verl's trainer in CPU mode, check a dumped step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

OAR_KEYS = (
    "oar/timing_s/token_importance", "oar/weight/min", "oar/weight/max", "oar/weight/frac_suppressed",
    "oar/weight/frac_amplified", "oar/mass_error/max_abs", "oar/fallback/frac_any",
    "oar/fallback/frac_no_answer", "oar/importance/mean",
)


def launch(workspace: Path, log: Path, experiment: str, *extra: str, estimator: str = "oar_g") -> tuple[int, str]:
    with open(log, "w") as fp:
        proc = subprocess.run(
            [sys.executable, "-m", "verl_oar.cpu.launch", "--workdir", str(workspace), "--steps", "2",
             "--adv-estimator", estimator, "--experiment-name", experiment, "--timeout", "330", *extra],
            check=False, stdout=fp, stderr=subprocess.STDOUT, timeout=360,
        )
    return proc.returncode, log.read_text()


def check_reshaped_exactly_where_importance_varies(dump: Path, steps=(1, 2)) -> int:
    """Per row of each dumped step: advantages differ from GRPO's exactly on the reasoning tokens of
    rows whose importance varies, keep their sign and their sum; other rows keep GRPO's credit.
    Returns the number of reshaped rows."""
    reshaped_rows = 0
    for step in steps:
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
    return reshaped_rows
