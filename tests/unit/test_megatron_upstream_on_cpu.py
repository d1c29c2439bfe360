"""megatron-core's upstream series (``upstream/megatron-core-0.16.1/``, docs/upstream.md): the fix is still needed
and works.

``01-causal-mask-device``: its ``repro.py`` must fail on the installed megatron-core exactly as its PR.md shows (so
``verl_oar/cpu/megatron_patches.py``'s ``causal_mask_on_cpu`` is still needed; when a release fixes the bug this
fails, saying to drop both), and pass on a copy of the installed ``megatron/core`` with the PR's patch applied by
``git apply``. The copy is the whole package (a regular package cannot be shadowed module by module on
``sys.path``), bytecode included so that it imports as fast as the installed one. Both repros run side by side in
fresh interpreters without the plugin, whose CPU patches would hide the bug: about one megatron-core import of
wall time (~7 s CPU each).
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERIES_VERSION = "0.16.1"
SERIES = ROOT / "upstream" / f"megatron-core-{SERIES_VERSION}"
PR = SERIES / "01-causal-mask-device"
REPRO = PR / "repro.py"
INSTALLED = Path(md.distribution("megatron-core").locate_file("megatron/core"))
CASE_LINE = re.compile(r"^(?:causal|sliding-window): .*$", re.M)
"""the repro's per-case lines (``causal: ok``, ``sliding-window: FAIL ...``), in its output and in PR.md's console"""


def _pr_md_console() -> tuple[list[str], list[str]]:
    """PR.md's reproduction: the case lines it shows without the patch, and with it."""
    console = re.search(r"```console\n(.*?)```", (PR / "PR.md").read_text(encoding="utf-8"), re.S).group(1)
    unpatched, patched = console.split("PYTHONPATH=", 1)
    return CASE_LINE.findall(unpatched), CASE_LINE.findall(patched)


def _start_repro(pythonpath: Path | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # never this checkout: no plugin
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.Popen([sys.executable, str(REPRO)], cwd=pythonpath or PR, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=300)
    return proc.returncode, out


@pytest.fixture(scope="module")
def repro_runs(tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    """``installed`` / ``patched``: (exit status, output, the megatron/core the run should import)."""
    copy = tmp_path_factory.mktemp("megatron_core_patched")
    shutil.copytree(INSTALLED, copy / "megatron" / "core", copy_function=shutil.copy2)   # mtimes kept: .pyc valid
    installed = _start_repro(None)   # the installed one starts while the copy is patched
    patches = sorted(PR.glob("*.patch"))
    subprocess.run(["git", "init", "-q"], cwd=copy, check=True)
    applied = subprocess.run(["git", "apply", *map(str, patches)], cwd=copy, capture_output=True, text=True)
    if applied.returncode != 0:
        installed.kill()
        pytest.fail(f"{PR.name}'s patches do not apply to the installed megatron-core {md.version('megatron-core')} "
                    f"({INSTALLED}):\n{applied.stderr}")
    patched = _start_repro(copy)
    return {"installed": (*_finish(installed), INSTALLED), "patched": (*_finish(patched), copy / "megatron" / "core")}


def test_the_series_is_for_the_installed_megatron_core():
    assert md.version("megatron-core") == SERIES_VERSION, (
        f"megatron-core {md.version('megatron-core')} is installed; {SERIES.name} was made against {SERIES_VERSION}: "
        "rerun its repro there and rebase the patch (docs/upstream.md)")
    assert (PR / "PR.md").is_file() and list(PR.glob("*.patch")) and REPRO.is_file()


@pytest.mark.slow  # two fresh megatron-core imports side by side: 22-54 s on 2 busy cores
def test_the_repro_fails_on_the_installed_megatron_core_as_pr_md_says(repro_runs):
    code, out, core = repro_runs["installed"]
    assert f"from {core / '__init__.py'} " in out, out
    said, _ = _pr_md_console()
    assert said and all(": FAIL " in line for line in said), said
    if code == 0:
        pytest.fail(f"{REPRO.relative_to(ROOT)} passes on the installed megatron-core {md.version('megatron-core')}: "
                    f"it builds the causal mask on the scores' device now. Drop {PR.relative_to(ROOT)} (and its "
                    "paragraph in docs/upstream.md) and verl_oar/cpu/megatron_patches.py's causal_mask_on_cpu.\n"
                    + out)
    assert code == 1 and CASE_LINE.findall(out) == said, (
        f"the repro fails otherwise than {PR.relative_to(ROOT)}/PR.md shows:\n{out}")


@pytest.mark.slow  # two fresh megatron-core imports side by side: 22-54 s on 2 busy cores
def test_the_repro_passes_with_the_patch_applied(repro_runs):
    code, out, core = repro_runs["patched"]
    assert f"from {core / '__init__.py'} " in out, out
    _, said = _pr_md_console()
    assert said and all(line.endswith(": ok") for line in said), said
    assert code == 0 and CASE_LINE.findall(out) == said, out
