"""Shared fixtures. Keep this file small: fixtures used by more than one test module only."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def cpu_workspace_dir(request) -> Path:
    """Directory of the CPU-mode workspace (tiny Qwen2, tokenizer, data, reward), built once and reused.

    Lives in pytest's cache (``.pytest_cache``), or in ``$VERL_OAR_CPU_WORKDIR`` if set; building it
    takes about half a minute on 2 cores (mostly the warm start), reusing it well under a second.
    """
    from verl_oar.cpu.workspace import build_workspace

    directory = os.environ.get("VERL_OAR_CPU_WORKDIR") or request.config.cache.mkdir("verl_oar_cpu_workspace")
    return build_workspace(directory).root
