"""The upstream pull requests (``upstream/verl-0.9.1/NN-name/``, docs/upstream.md), each on its own.

One module-scoped ``upstream/apply.sh`` run copies the installed verl 0.9.1 (package + the tests its
wheel ships) and builds one branch per PR: the PR's patches on plain verl, or on the one PR its ``BASE``
names. Per PR, a worktree of that branch (first on ``PYTHONPATH``, plugins off) passes the PR's own tests
(the test files its patches add) plus a few of verl's own CPU tests that cover the files it touches; in the
same process, verl-oar (this checkout) detects exactly that PR's seam (``upstream_hook.seams()``) and takes the
public route where it has one (``test_upstream_seam_routes_on_cpu.route_report``); with all PRs applied, every
seam and every public route. Then the script itself: subsets pull in their base, an unknown name is refused with
the names there are, and ``--regenerate`` round-trips the patches byte for byte.
Marked slow: about 3 minutes on 2 cores (one Python process per PR, mostly imports).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl_oar.cpu.verl_patches import vllm_cpu_installed

ROOT = Path(__file__).resolve().parents[2]
APPLY = ROOT / "upstream" / "apply.sh"
SERIES = ROOT / "upstream" / "verl-0.9.1"
VERL_TESTS = {
    "cpu-fixes": ("tests/test_protocol_on_cpu.py",),
    "rollout-registry": ("tests/checkpoint_engine/test_sglang_fusion_bucketing_on_cpu.py",),
    "advantage-hooks": (
        "tests/trainer/ppo/test_core_algos_on_cpu.py",
        "tests/trainer/test_multi_trajectories_advantage_on_cpu.py",
        "tests/trainer/ppo/test_spec_decode_metrics_on_cpu.py",
    ),
    "train-batch-hooks": ("tests/trainer/test_multi_trajectories_advantage_on_cpu.py",),
    "logits-reducers": (),
    "replica-servers": ("tests/experimental/agent_loop/test_tool_call_id_on_cpu.py",),
    "balance-batch": ("tests/trainer/test_multi_trajectories_advantage_on_cpu.py",),
    "oar": ("tests/trainer/ppo/test_core_algos_on_cpu.py",),
    "vllm-cpu": (),
}
"""per PR, verl 0.9.1's own wheel tests that import the modules it touches and pass on this CPU machine
(no wheel test imports verl/workers/engine/fsdp, which logits-reducers changes: its own tests build the
engine's forward on CPU; for replica-servers, test_tool_call_id_on_cpu.py imports replica.py and, through the agent
loop, llm_server.py; test_agent_loop_extra_fields_schema_on_cpu.py imports them too but 4 of its 7 tests are async
ones that need pytest-asyncio, which is not installed here; no wheel test imports verl's vLLM modules, which vllm-cpu
changes: its own tests import them, and start vLLM's CPU build, when vllm-cpu is installed)"""
SEAMS = {"advantage-hooks": "advantage_hooks", "train-batch-hooks": "train_batch_hooks",
         "logits-reducers": "logits_reducers", "replica-servers": "replica_servers", "balance-batch": "balance_batch"}
"""PR -> the key of ``verl_oar.integration.upstream_hook.seams()`` that detects it (cpu-fixes, rollout-registry and
vllm-cpu are detected by ``cpu/verl_patches.py``: CPU_FIXES; oar by nothing yet)"""
CPU_FIXES = {"cpu-fixes": {"process_group_backend", "fsdp2_offload_without_pinning"},
             "rollout-registry": {"hf_rollout_adapter"}, "vllm-cpu": {"vllm_cpu_distribution", "vllm_cpu_replica"}}
"""PR -> the CPU-mode patches (``verl_patches.upstream_fixes()``) its verl fix makes CPU mode skip"""
NEEDS_VLLM_CPU = {"vllm-cpu"}
"""PRs whose own tests need PyPI's CPU build of vLLM: without it they skip (counted), with it none may"""
ROUTES = ROOT / "tests" / "unit" / "test_upstream_seam_routes_on_cpu.py"
"""``route_report`` / ``check_routes``: the plugin's route at the replica-servers and balance-batch seams"""
PRS = tuple(sorted(SERIES.glob("[0-9][0-9]-*")))


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def _apply(dest: Path, *args: str, series: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    if series is not None:
        env["SERIES"] = str(series)
    return subprocess.run(["bash", str(APPLY), str(dest), *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def _name(pr: Path) -> str:
    return pr.name[3:]


def _load_routes():
    spec = importlib.util.spec_from_file_location("upstream_seam_routes", ROUTES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _own_tests(pr: Path) -> list[str]:
    """The test files the PR's patches add or change, e.g. tests/trainer/ppo/test_x_on_cpu.py."""
    found = set()
    for patch in pr.glob("*.patch"):
        found.update(re.findall(r"^diff --git a/(tests/\S+/test_\S+\.py) b/", patch.read_text(), re.M))
    return sorted(found)


@pytest.fixture(scope="module")
def applied(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("verl_prs") / "verl"
    proc = _apply(dest)
    assert proc.returncode == 0, f"the upstream PRs do not apply to the installed verl:\n{proc.stderr}"
    return dest


def test_the_layout_names_every_pr_and_its_tests():
    assert [_name(p) for p in PRS] == list(VERL_TESTS), "a PR was added or renamed: give it its verl tests here"
    assert set(SEAMS) | set(CPU_FIXES) | NEEDS_VLLM_CPU <= set(VERL_TESTS)
    for pr in PRS:
        assert (pr / "PR.md").is_file() and list(pr.glob("*.patch")), pr
        assert _own_tests(pr), f"{pr.name} adds no test"
        base = (pr / "BASE").read_text().strip() if (pr / "BASE").exists() else None
        if base is not None:
            assert base in [_name(p) for p in PRS if p.name < pr.name], (pr.name, base)


@pytest.mark.slow
@pytest.mark.parametrize("pr", PRS, ids=[_name(p) for p in PRS])
def test_each_pr_alone_passes_its_tests_and_verls(applied, pr, tmp_path):
    name = _name(pr)
    tree = tmp_path / name
    _git(applied, "worktree", "add", "-q", "--detach", str(tree), f"pr/{name}")
    base = (pr / "BASE").read_text().strip() if (pr / "BASE").exists() else None
    expected = len(list(pr.glob("*.patch"))) + (len(list(next(SERIES.glob(f"??-{base}")).glob("*.patch"))) if base else 0)
    log = _git(tree, "log", "--format=%s", "verl-0.9.1-wheel..HEAD").splitlines()
    assert len(log) == expected, log  # the PR (and its base), nothing else
    tests = [*_own_tests(pr), *VERL_TESTS[name]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "VERL_USE_EXTERNAL_PLUGINS": "none"}  # verl's tests of verl alone (verl-oar loads on `import verl`)
    report = tmp_path / "routes.json"
    run = (  # one process: check that verl comes from the PR's copy, run the tests there, then the plugin's routes
        "import importlib.util, json, sys, pytest, verl\n"
        "assert verl.__file__.startswith(sys.argv[1]), verl.__file__\n"
        "rc = pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:xdist', *sys.argv[4:]])\n"
        "spec = importlib.util.spec_from_file_location('routes', sys.argv[2])\n"
        "routes = importlib.util.module_from_spec(spec); spec.loader.exec_module(routes)\n"
        "open(sys.argv[3], 'w').write(json.dumps(routes.route_report()))\n"
        "sys.exit(rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", run, str(tree), str(ROUTES), str(report), *tests], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    summary = [line for line in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    skips_allowed = name in NEEDS_VLLM_CPU and not vllm_cpu_installed()
    assert summary and " passed" in summary[-1] and "error" not in summary[-1], proc.stdout[-2000:]
    assert skips_allowed or "skipped" not in summary[-1], proc.stdout[-2000:]
    # the plugin (verl_oar from this checkout) on the PR's verl: exactly this PR's seams (and its base's) detected,
    # and at replica-servers / balance-batch the public route taken (else the private one, logged)
    routes = _load_routes()
    got = json.loads(report.read_text())
    assert {k for k, v in got["seams"].items() if v} == {SEAMS[n] for n in (name, base) if n in SEAMS}, got["seams"]
    assert set(got["cpu_fixes"]) == set().union(*(CPU_FIXES.get(n, set()) for n in (name, base))), got["cpu_fixes"]
    routes.check_routes(got)


@pytest.mark.slow
def test_all_prs_together_give_the_plugin_every_seam_and_public_route(applied, tmp_path):
    tree = tmp_path / "all"
    _git(applied, "worktree", "add", "-q", "--detach", str(tree), "main")
    report = tmp_path / "routes.json"
    run = ("import importlib.util, json, sys, verl\n"
           "assert verl.__file__.startswith(sys.argv[1]), verl.__file__\n"
           "spec = importlib.util.spec_from_file_location('routes', sys.argv[2])\n"
           "routes = importlib.util.module_from_spec(spec); spec.loader.exec_module(routes)\n"
           "open(sys.argv[3], 'w').write(json.dumps(routes.route_report()))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "VERL_USE_EXTERNAL_PLUGINS": "none"}
    proc = subprocess.run([sys.executable, "-c", run, str(tree), str(ROUTES), str(report)], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(report.read_text())
    assert got["seams"] == dict.fromkeys(SEAMS.values(), True), got["seams"]
    assert set(got["cpu_fixes"]) == set().union(*CPU_FIXES.values()), got["cpu_fixes"]
    assert got["balance_logged"] == [] and got["hf_replica_uses_setters"], got
    _load_routes().check_routes(got)


@pytest.mark.slow
def test_a_subset_pulls_in_its_base_and_an_unknown_name_is_refused(tmp_path):
    proc = _apply(tmp_path / "a", "--prs", "cpu-fixes,oar")
    assert proc.returncode == 0, proc.stderr
    assert "oar builds on advantage-hooks: applying advantage-hooks too" in proc.stderr
    branches = _git(tmp_path / "a", "branch", "--format=%(refname:short)").split()
    assert sorted(branches) == ["main", "pr/advantage-hooks", "pr/cpu-fixes", "pr/oar"]
    subjects = _git(tmp_path / "a", "log", "--reverse", "--format=%s", "verl-0.9.1-wheel..main").splitlines()
    assert [s.split("]")[0] + "]" for s in subjects] == ["[misc]", "[fsdp]", "[algo]", "[trainer]", "[algo]"], subjects

    proc = _apply(tmp_path / "c", "--prs", "replica-servers,balance-batch,oar")  # the last three, oar's base pulled in
    assert proc.returncode == 0, proc.stderr
    assert "oar builds on advantage-hooks: applying advantage-hooks too" in proc.stderr
    branches = _git(tmp_path / "c", "branch", "--format=%(refname:short)").split()
    assert sorted(branches) == ["main", "pr/advantage-hooks", "pr/balance-batch", "pr/oar", "pr/replica-servers"]
    subjects = _git(tmp_path / "c", "log", "--reverse", "--format=%s", "verl-0.9.1-wheel..main").splitlines()
    assert [s.split("]")[0] + "]" for s in subjects] == ["[algo]", "[trainer]", "[rollout]", "[trainer]", "[algo]"], (
        subjects)

    proc = _apply(tmp_path / "b", "--prs", "cpu-fixes,no-such-pr")
    assert proc.returncode == 2 and "no PR named 'no-such-pr'" in proc.stderr and "rollout-registry" in proc.stderr
    assert not (tmp_path / "b").exists()  # refused before copying anything


@pytest.mark.slow
def test_regenerate_round_trips_every_pr(tmp_path):
    series = tmp_path / "series"
    shutil.copytree(SERIES, series)
    dest = tmp_path / "verl"
    assert _apply(dest, series=series).returncode == 0
    for patch in series.rglob("*.patch"):
        patch.unlink()
    proc = subprocess.run(["bash", str(APPLY), "--regenerate", str(dest)], env={**os.environ, "SERIES": str(series)},
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    ours = sorted(p.relative_to(SERIES) for p in SERIES.rglob("*.patch"))
    assert sorted(p.relative_to(series) for p in series.rglob("*.patch")) == ours
    for rel in ours:
        assert (series / rel).read_bytes() == (SERIES / rel).read_bytes(), rel
