"""README stays short and true: its numbers are rendered from the committed results, its estimator table
lists exactly the estimators the plugin registers in verl, its recipe count is the recipes', and the long
tables it used to hold live in docs/testbed.md, rendered from the same results."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
LONG_RUN = ROOT / "benchmarks" / "results_testbed_long_run_cpu.json"


def test_readme_is_short_and_opens_with_the_demo_and_the_tests():
    lines = README.splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail to docs/"
    assert max(len(line) for line in lines) <= 400, "a README line over 400 characters: break it or move it to docs/"
    block = README[README.index("```bash"):README.index("```", README.index("```bash") + 3)]
    commands = [line.split("#")[0].strip() for line in block.splitlines()[1:]]
    assert commands[:2] == ["bash scripts/demo.sh", "bash scripts/test.sh"]


def test_readme_estimator_table_is_what_the_plugin_registers():
    from verl.trainer.ppo import core_algos

    import verl_oar.integration.plugin  # noqa: F401  (registers the estimators, as verl's plugin loading does)

    native = {e.value for e in core_algos.AdvantageEstimator}
    ours = set(core_algos.ADV_ESTIMATOR_REGISTRY) - native
    table = set(re.findall(r"^\| `([a-z_0-9]+)` \|", README, flags=re.M)) - {"adv_estimator"}  # the header
    assert table == ours, f"README's estimator table {sorted(table)} != registered {sorted(ours)}"


def test_readme_recipe_count_is_the_recipes():
    recipes = sorted((ROOT / "recipes").glob("run_*.sh"))
    assert f"{len(recipes)} recipes" in README


def test_readme_testbed_numbers_are_the_committed_long_run():
    results = json.loads(LONG_RUN.read_text())
    vs = {m: results["comparison"]["methods"][m]["vs_baseline"]["steps_to_threshold"] for m in ("oar_g", "oar_p")}
    conc = {m: results["concentration_quartiles"][m]["median"] for m in ("oar_g", "oar_p")}
    fmt = lambda i: f"{i['estimate']:.1f} [{i['low']:.1f}, {i['high']:+.1f}]"
    assert f"OAR-G minus GRPO in steps to the reward\nthreshold is {fmt(vs['oar_g'])}" in README, fmt(vs["oar_g"])
    assert f"OAR-P {fmt(vs['oar_p'])}" in README, fmt(vs["oar_p"])
    assert f"{conc['oar_g']:.1f}x and {conc['oar_p']:.1f}x" in README
    assert f"({len(results['seeds'])} seeds, {len(results['runs']['grpo'][0]['reward'])} steps" in README


def test_docs_testbed_holds_the_long_runs_tables_rendered_from_the_results():
    from verl_oar.testbed.report import readme_section

    page = (ROOT / "docs" / "testbed.md").read_text()
    for part in readme_section(json.loads(LONG_RUN.read_text())).split("\n\n"):
        assert part in page, ("docs/testbed.md's results are stale: render them with "
                              "python -m verl_oar.testbed.report --readme benchmarks/results_testbed_long_run_cpu.json")
