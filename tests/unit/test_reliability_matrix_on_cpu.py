"""docs/reliability.md: every row names at least one test, and every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "docs" / "reliability.md"
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def rows() -> list[str]:
    return [line for line in MATRIX.read_text().splitlines() if re.match(r"\|\s*\d+\s*\|", line)]


def test_every_row_names_a_test_that_exists():
    table = rows()
    assert len(table) >= 40
    numbers = [int(line.split("|")[1]) for line in table]
    assert numbers == list(range(1, len(table) + 1)), "rows are numbered 1..N in order"
    for line in table:
        refs = TEST_REF.findall(line.split("|")[-2])
        assert refs, f"row without a test: {line[:80]}"
        for path, name in refs:
            source = ROOT / path
            assert source.exists(), f"{path} (row {line.split('|')[1].strip()}) does not exist"
            assert re.search(rf"^def {name}\(", source.read_text(), re.M), f"{path}::{name} does not exist"


def test_a_missing_test_would_be_caught(tmp_path):
    line = "| 1 | x | y | CPU | `tests/unit/test_reliability_matrix_on_cpu.py::test_that_does_not_exist` |"
    (path, name), = TEST_REF.findall(line.split("|")[-2])
    assert not re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M)
