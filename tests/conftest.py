"""Shared fixtures. Keep this file small: fixtures used by more than one test module only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items):
    """The trainer launches (marked slow, tests/e2e) run last: every quick test has answered first, and
    the session's shared Ray cluster (tests/e2e/conftest.py) is up only while they run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)  # stable: order kept otherwise


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
    """A small chain_sum testbed (verl_oar.testbed), built once: the demo's configuration check and the
    shortened demo run on it."""
    from verl_oar.testbed.workspace import TestbedSpec, build_testbed

    spec = TestbedSpec(n_train=200, n_val=24, warm_start_steps=150, warm_start_batch_size=8, stats_samples=8)
    return build_testbed(tmp_path_factory.mktemp("demo_testbed"), spec)
