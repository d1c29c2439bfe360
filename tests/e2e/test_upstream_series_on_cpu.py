"""The upstream patch series (``upstream/verl-0.9.1/``, docs/upstream.md) against the installed verl.

One module-scoped copy of the installed verl (package + the tests its wheel ships) with the series
applied by ``upstream/apply.sh``; then, against that copy (first on ``PYTHONPATH``):
1. a subset of verl's own CPU tests and the series' new tests pass;
2. CPU mode needs no monkeypatch of it (each patch sees verl's public fix and is skipped), and verl's
   ``oar`` estimator (patch 0006) gives verl-oar's own reshaping weights, bit for bit;
3. a 2-step ``oar_g`` CPU training runs through verl's advantage hooks: the plugin does not install
   its trainer subclass, the hooks run in verl's own ``PPOTrainerSync``, and the OAR metrics are logged.
Marked slow: about 2-3 minutes on 2 cores (mostly the training).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _e2e import OAR_KEYS

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file

ROOT = Path(__file__).resolve().parents[2]
SERIES = ROOT / "upstream" / "verl-0.9.1"
VERL_CPU_TESTS = (
    "tests/trainer/ppo/test_core_algos_on_cpu.py",
    "tests/trainer/test_multi_trajectories_advantage_on_cpu.py",
    "tests/test_protocol_on_cpu.py",
)
"""verl's own wheel tests that pass on this CPU machine and cover the code the series touches"""
SERIES_TESTS = (
    "tests/trainer/ppo/test_adv_estimator_extra_fields_on_cpu.py",
    "tests/trainer/ppo/test_advantage_hooks_on_cpu.py",
    "tests/utils/test_process_group_backend_on_cpu.py",
    "tests/workers/rollout/test_rollout_registration_on_cpu.py",
    "tests/workers/engine/test_fsdp2_offload_pin_memory_on_cpu.py",
    "tests/trainer/ppo/test_oar_advantage_on_cpu.py",
    "tests/trainer/ppo/test_train_batch_hooks_on_cpu.py",
    "tests/workers/engine/test_logits_reducers_on_cpu.py",
)
HOOK_LINE = "[verl-oar] token signals through verl's advantage hooks in verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync"
"""printed by verl_oar.integration.upstream_hook at the first step, naming the trainer's class"""


def _env(patched: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(patched), *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def patched_verl(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("verl_patched")
    proc = subprocess.run(
        ["bash", str(ROOT / "upstream" / "apply.sh"), str(dest)], env={**os.environ, "PYTHON": sys.executable},
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, f"the upstream series does not apply to the installed verl:\n{proc.stderr}"
    patches = sorted(p.name for p in SERIES.glob("*.patch"))
    log = subprocess.run(["git", "-C", str(dest), "log", "--format=%s"], capture_output=True, text=True, check=True)
    assert len(patches) == 8 and len(log.stdout.splitlines()) == len(patches) + 1, (patches, log.stdout)
    return dest


@pytest.mark.slow
def test_verl_cpu_tests_and_the_series_tests_pass_on_the_patched_verl(patched_verl):
    # plugins off: these are verl's tests of verl alone (verl-oar would otherwise load on `import verl`)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *VERL_CPU_TESTS, *SERIES_TESTS],
        cwd=patched_verl, env=_env(patched_verl, VERL_USE_EXTERNAL_PLUGINS="none"),
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


@pytest.mark.slow
def test_cpu_mode_applies_no_monkeypatch_to_the_patched_verl(patched_verl):
    code = (
        "import verl\n"
        "from verl_oar.integration import plugin, upstream_hook\n"
        "from verl_oar.cpu.verl_patches import patches_applied, upstream_fixes\n"
        "from verl.workers.rollout import get_rollout_class\n"
        "from verl.trainer.ppo.v1 import trainer_base\n"
        "from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync\n"
        "assert plugin.LOAD_ERROR is None, plugin.LOAD_ERROR\n"
        "assert verl.__file__.startswith(PATCHED), verl.__file__\n"
        "assert upstream_hook.available()\n"
        "assert all(upstream_fixes().values()), upstream_fixes()\n"
        "assert not any(patches_applied().values()), patches_applied()\n"
        "assert get_rollout_class('hf', 'async').__name__ == 'HFServerAdapter'\n"
        "assert trainer_base.TRAINER_REGISTRY['sync'] is PPOTrainerSync\n"
        "import torch\n"
        "from verl.trainer.ppo.oar import oar_token_weights\n"
        "from verl_oar.core.reshape import ReshapeConfig, importance_to_weights\n"
        "torch.manual_seed(0)\n"
        "for trial in range(20):\n"
        "    imp, mask = torch.randn(6, 20) * 3, torch.rand(6, 20) < 0.6\n"
        "    imp[0, 3] = float('nan')\n"
        "    found = torch.rand(6) < 0.8\n"
        "    kw = dict(tau=trial / 19, beta=0.5 + trial % 3, floor=0.1, amplify=trial % 2 == 0,\n"
        "              suppress=trial % 3 != 0, preserve_mass=trial % 4 != 0)\n"
        "    ours = importance_to_weights(imp, mask, ReshapeConfig(**kw), answer_found=found).weights\n"
        "    assert torch.equal(oar_token_weights(imp, mask, found, **kw), ours), trial\n"
        "print('OK')\n"
    ).replace("PATCHED", repr(str(patched_verl)))
    proc = subprocess.run([sys.executable, "-c", code], env=_env(patched_verl, VERL_PLATFORM="cpu"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_oar_g_trains_through_verls_advantage_hooks(patched_verl, cpu_workspace_dir, tmp_path):
    experiment = "e2e_upstream_series"
    log = tmp_path / "log"
    with open(log, "w") as fp:
        proc = subprocess.run(
            [sys.executable, "-m", "verl_oar.cpu.launch", "--workdir", str(cpu_workspace_dir), "--steps", "2",
             "--adv-estimator", "oar_g", "--experiment-name", experiment, "--timeout", "330"],
            env=_env(patched_verl), stdout=fp, stderr=subprocess.STDOUT, timeout=360, check=False,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    assert HOOK_LINE in text, text[-6000:]
    assert "OARTrainerSync" not in text
    records = read_metrics(metrics_file(cpu_workspace_dir, experiment))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        missing = [k for k in OAR_KEYS if k not in record["data"]]
        assert not missing, missing
        assert record["data"]["oar/fused_log_prob"] == 1.0  # the signal came with verl's old-log-prob pass
        assert record["data"]["oar/weight/max"] > 1.0  # something was amplified: the estimator got the fields
