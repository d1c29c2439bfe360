"""The in-process engine checks of OAR-G (engine_importance_check.py), OAR-P
(engine_perturbation_check.py), CSCR/OPPO's privileged pass (engine_privileged_check.py) and ACPO's
top-1 log-probs (engine_modal_check.py) run one
after the other in one fresh interpreter: torch.distributed's
process group is process-global, and sharing the interpreter saves one start of verl's worker stack
(~12 s of imports on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
IMPORTANCE_CASES, PERTURBATION_CASES, PRIVILEGED_CASES, MODAL_CASES = 6, 5, 6, 6
SCRIPT = """
import sys
import engine_importance_check, engine_perturbation_check, engine_privileged_check, engine_modal_check
engine_importance_check.main(sys.argv[1])
print("IMPORTANCE-DONE", flush=True)
engine_perturbation_check.main(sys.argv[2])
print("PERTURBATION-DONE", flush=True)
engine_privileged_check.main(sys.argv[3])
print("PRIVILEGED-DONE", flush=True)
engine_modal_check.main(sys.argv[4])
"""


@pytest.fixture(scope="session")
def engine_cases(tmp_path_factory) -> dict[str, list[dict]]:
    """``{"importance": [case, ...], "perturbation": [...], "privileged": [...]}``, one JSON line per case as each
    script printed it."""
    out = tmp_path_factory.mktemp("engine")
    names = ("importance", "perturbation", "privileged", "modal")
    for name in names:
        (out / name).mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *(str(out / name) for name in names)],
        capture_output=True, text=True, timeout=1500, env={**os.environ, "VERL_PLATFORM": "cpu"}, cwd=HERE,
    )
    lines = proc.stdout.splitlines()
    first = lines.index("IMPORTANCE-DONE") if "IMPORTANCE-DONE" in lines else len(lines)
    second = lines.index("PERTURBATION-DONE") if "PERTURBATION-DONE" in lines else len(lines)
    third = lines.index("PRIVILEGED-DONE") if "PRIVILEGED-DONE" in lines else len(lines)
    parse = lambda part: [json.loads(line[5:]) for line in part if line.startswith("CASE ")]  # noqa: E731
    cases = {"importance": parse(lines[:first]), "perturbation": parse(lines[first:second]),
             "privileged": parse(lines[second:third]), "modal": parse(lines[third:])}
    counts = tuple(len(cases[name]) for name in names)
    assert proc.returncode == 0 and counts == (IMPORTANCE_CASES, PERTURBATION_CASES, PRIVILEGED_CASES, MODAL_CASES), (
        counts, proc.stdout[-3000:], proc.stderr[-5000:])
    return cases
