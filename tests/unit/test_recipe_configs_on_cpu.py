"""The recipes (recipes/config, recipes/run_*.sh): each composes with Hydra against verl's config, passes
verl's validation and the estimator's start-up checks, mirrors the published GRPO settings, and every
method's recipe differs from GRPO's only in ``algorithm.*``; the launch scripts pass their arguments; a Megatron recipe's CPU
copy is refused. The CPU copies' trainer runs are listed in tests/_e2e.py (``RECIPE_CPU_COPIES``)."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
from pathlib import Path

import pytest
from _verl_config import compose_recipe
from omegaconf import OmegaConf

from verl_oar.cpu.recipe import RECIPES_DIR, recipe_names

RECIPES = recipe_names()
_composed = functools.lru_cache(maxsize=None)(compose_recipe)
"""read-only uses: each recipe composed once (about a second each)"""
MODELS = {"1_5b": "Qwen/Qwen2.5-Math-1.5B", "7b": "Qwen/Qwen2.5-Math-7B"}
ESTIMATORS = ("grpo", "oar_g", "oar_p", "cscr", "oppo", "acpo", "codapo")
TOKEN_ESTIMATORS = ESTIMATORS[1:]
ENGINES = ("", "_megatron")
EXTRA_RECIPES = ("qwen2_5_math_1_5b_oppo_teacher",)
"""beyond the model x estimator x engine grid: OPPO's teacher oracle (1.5B actor, 7B-Instruct teacher; FSDP2)"""
TEACHER_ENGINE_KEYS = {"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "actor_rollout_ref.ref.fsdp_config.param_offload"}
"""the teacher is built with the reference model's engine settings: the teacher recipe sets these for a 7B teacher"""


def test_there_is_a_recipe_per_model_estimator_and_engine_each_with_a_script():
    expected = sorted([f"qwen2_5_math_{m}_{e}{g}" for m in MODELS for e in ESTIMATORS for g in ENGINES] + list(EXTRA_RECIPES))
    assert RECIPES == expected
    for name in RECIPES:
        assert os.access(RECIPES_DIR / f"run_{name}.sh", os.X_OK), name


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_passes_verls_validation_and_oars_startup_checks(name, monkeypatch):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from verl_oar.integration import acpo_estimator, codapo_estimator, estimators, privileged_estimators  # noqa: F401
    from verl_oar.integration.validate import check_token_signals_supported

    config = copy.deepcopy(_composed(name))  # composed once for this module's tests; the checks may write to it
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # what the workers build
    omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    teachers = []
    if config.algorithm.get("oppo", {}).get("oracle", "self") == "teacher":
        # the teacher's tokenizer check loads both models' files from the hub, which tests cannot reach;
        # the check itself runs on local files in test_privileged_on_cpu.py
        from verl_oar.integration import privileged_signal

        monkeypatch.setattr(privileged_signal, "check_teacher", lambda config, path: teachers.append(path))
    providers = check_token_signals_supported(config, "sync")  # every start-up check of the estimator's signals
    assert teachers == ([config.algorithm.oppo.teacher.path] if "teacher" in name else [])
    assert bool(providers) == (config.algorithm.adv_estimator != "grpo")
    assert need_reference_policy(config) and not need_critic(config)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_mirrors_deepseek_r1_style_grpo_as_verl_runs_it(name):
    c = _composed(name)
    actor, rollout = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout
    assert actor.optim.lr == 1e-6
    assert actor.use_kl_loss and actor.kl_loss_coef == 0.001 and actor.kl_loss_type == "low_var_kl"
    assert not c.algorithm.use_kl_in_reward
    assert actor.entropy_coeff == 0
    assert actor.clip_ratio == actor.clip_ratio_low == actor.clip_ratio_high == 0.2
    assert actor.loss_agg_mode == "token-mean"
    assert rollout.name == "vllm" and rollout.temperature == 1.0 and rollout.n == 8
    assert c.data.max_prompt_length + c.data.max_response_length <= 4096  # Qwen2.5-Math's context
    assert actor.use_dynamic_bsz and rollout.log_prob_use_dynamic_bsz and c.actor_rollout_ref.ref.log_prob_use_dynamic_bsz
    assert c.reward.custom_reward_function.path == "pkg://verl_oar.rewards.math_reward"
    model = next(m for m in MODELS if f"_{m}_" in name)
    assert c.actor_rollout_ref.model.path == MODELS[model]
    megatron = name.endswith("_megatron")
    assert (c.model_engine, actor.strategy) == (("megatron", "megatron") if megatron else ("dp", "fsdp2"))
    if megatron:
        assert actor.megatron.pipeline_model_parallel_size == 1
        assert actor.megatron.tensor_model_parallel_size == (2 if model == "7b" else 1)
    if c.algorithm.adv_estimator in ("oar_g", "oar_p"):
        assert c.algorithm.oar.tau == 0.5 and c.algorithm.oar.outcome == "mean"  # the paper's best
        from verl_oar.core.config import OARConfig

        # OAR-P: chunk mode, K=16, the plugin's own default too (a run without the recipe gets the same)
        assert (c.algorithm.oar.perturb_mode, c.algorithm.oar.perturb_budget) == ("chunk", 16)
        assert (OARConfig().perturb_mode, OARConfig().perturb_budget) == ("chunk", 16)
    if c.algorithm.adv_estimator in ("cscr", "oppo", "acpo", "codapo"):  # the shared YAML: every key at its default
        from verl_oar.core.acpo import ACPOConfig
        from verl_oar.core.codapo import CoDaPOConfig
        from verl_oar.core.cscr import CSCRConfig
        from verl_oar.core.oppo import OPPOConfig

        default = {"cscr": CSCRConfig, "oppo": OPPOConfig, "acpo": ACPOConfig, "codapo": CoDaPOConfig}[c.algorithm.adv_estimator]()
        if name.endswith("_oppo_teacher"):
            default = OPPOConfig(oracle="teacher", teacher={"path": "Qwen/Qwen2.5-Math-7B-Instruct"})
        if name.endswith("_acpo_megatron"):  # the modal surrogate is FSDP-only: its value under modal alignment
            default = ACPOConfig(surrogate="sampled")
        assert OmegaConf.to_container(c.algorithm[c.algorithm.adv_estimator]) == default.to_dict()


def _flat(config) -> dict:
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}{k}.")
        else:
            out[prefix[:-1]] = node

    walk(OmegaConf.to_container(config, resolve=True), "")
    return out


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("engine", ENGINES, ids=["fsdp2", "megatron"])
def test_every_methods_recipe_differs_from_grpos_only_in_algorithm(model, engine):
    grpo = _flat(_composed(f"qwen2_5_math_{model}_grpo{engine}"))
    for estimator in TOKEN_ESTIMATORS:
        oar = _flat(_composed(f"qwen2_5_math_{model}_{estimator}{engine}"))
        changed = {k for k in grpo.keys() | oar.keys() if grpo.get(k, "<absent>") != oar.get(k, "<absent>")}
        # values derived from the experiment name (checkpoint folder, trace name) follow it
        derived = {k for k in changed if grpo["trainer.experiment_name"] in str(grpo.get(k))}
        assert {k for k in changed - derived if not k.startswith(f"algorithm.{estimator.split('_')[0]}.")} == {
            "algorithm.adv_estimator"}
        assert "trainer.experiment_name" in derived
        assert oar["algorithm.adv_estimator"] == estimator
    for name in (n for n in EXTRA_RECIPES if f"_{model}_" in n and n.endswith(engine or "teacher")):
        other = _flat(_composed(name))
        changed = {k for k in grpo.keys() | other.keys() if grpo.get(k, "<absent>") != other.get(k, "<absent>")}
        derived = {k for k in changed if grpo["trainer.experiment_name"] in str(grpo.get(k))}
        assert {k for k in changed - derived if not k.startswith("algorithm.oppo.")} == {
            "algorithm.adv_estimator", *TEACHER_ENGINE_KEYS}


def test_recipe_overrides_on_the_command_line_need_no_plus():
    c = compose_recipe("qwen2_5_math_1_5b_oar_g", ["algorithm.oar.tau=0.3", "algorithm.oar.outcome=joint"])
    assert c.algorithm.oar.tau == 0.3 and c.algorithm.oar.outcome == "joint"


def _fake_python(tmp_path: Path) -> Path:
    """An interpreter stand-in that prints the arguments launch.sh passes, one per line."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\n")
    fake.chmod(0o755)
    return fake


def test_launch_script_passes_data_cluster_model_and_user_overrides_last(tmp_path):
    env = dict(os.environ, PYTHON=str(_fake_python(tmp_path)), DATA_DIR="/data/x", NNODES="2", GPUS_PER_NODE="4",
               MODEL_PATH="/ckpt/m")
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(["bash", str(RECIPES_DIR / "run_qwen2_5_math_7b_oar_p.sh"), "trainer.nnodes=3"],
                         env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[:4] == ["-m", "verl.trainer.main_ppo", f"--config-path={RECIPES_DIR / 'config'}",
                       "--config-name=qwen2_5_math_7b_oar_p"]
    assert "data.train_files=/data/x/train.parquet" in out
    assert any(a.startswith("data.val_files=") and "/data/x/aime24.parquet" in a for a in out)
    assert "trainer.nnodes=2" in out and "trainer.n_gpus_per_node=4" in out
    assert "actor_rollout_ref.model.path=/ckpt/m" in out
    assert out[-1] == "trainer.nnodes=3"  # the user's override comes last, so it wins


def test_launch_script_names_the_recipes_when_given_an_unknown_one(tmp_path):
    env = dict(os.environ, PYTHON=str(_fake_python(tmp_path)))
    proc = subprocess.run(["bash", str(RECIPES_DIR / "launch.sh"), "qwen2_5_math_3b_oar_g"], env=env,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    assert "no recipe 'qwen2_5_math_3b_oar_g'" in proc.stderr and "qwen2_5_math_7b_oar_g" in proc.stderr


def test_a_megatron_recipes_cpu_copy_is_refused_naming_its_fsdp2_twin(tmp_path):
    from verl_oar.cpu import recipe

    with pytest.raises(SystemExit, match="needs CUDA.*verl_oar.cpu.recipe qwen2_5_math_7b_oar_g$"):
        recipe.run("qwen2_5_math_7b_oar_g_megatron", tmp_path / "never_built")
    assert not (tmp_path / "never_built").exists()


TOKEN_BUDGETS = ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                 "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu")


def test_the_cpu_copies_cover_every_fsdp2_oar_recipes_settings():
    """The FSDP2 OAR recipes whose CPU copies do not train (``RECIPE_CPU_COPIES``, _e2e.py) would run
    nothing the e2e tier does not: shrunk, each differs from a trained copy of the same estimator only in
    token budgets that a CPU step never reaches (one micro-batch per pass in every copy) and in values
    that the reference-model run (``REF_MODEL_RUN``, test_bf16_e2e_on_cpu.py) sets."""
    from _e2e import RECIPE_CPU_COPIES, REF_MODEL_RUN

    from verl_oar.cpu.recipe import has_teacher, recipe_cpu_overrides

    names = [n for n in RECIPES if not n.endswith(("_megatron", "_grpo"))]
    copies = {n: _flat(compose_recipe(n, recipe_cpu_overrides("/ws", steps=2, experiment_name="x", teacher=has_teacher(n))))
              for n in names}
    assert [n for n in names if has_teacher(n)] == ["qwen2_5_math_1_5b_oppo_teacher"]
    assert copies["qwen2_5_math_1_5b_oppo_teacher"]["algorithm.oppo.teacher.path"] == "/ws/model"
    assert set(RECIPE_CPU_COPIES) <= set(copies)
    for name, c in copies.items():
        step_tokens = c["data.train_batch_size"] * c["actor_rollout_ref.rollout.n"] * (
            c["data.max_prompt_length"] + c["data.max_response_length"])
        assert all(c[k] >= step_tokens for k in TOKEN_BUDGETS), name
    for name in set(names) - set(RECIPE_CPU_COPIES):
        c = copies[name]
        twins = [t for t in RECIPE_CPU_COPIES if copies[t]["algorithm.adv_estimator"] == c["algorithm.adv_estimator"]]
        assert twins, f"no {c['algorithm.adv_estimator']} recipe's copy trains"
        for twin in twins:
            diff = {k for k in c.keys() | copies[twin].keys() if c.get(k, "<absent>") != copies[twin].get(k, "<absent>")}
            uncovered = {k for k in diff - set(TOKEN_BUDGETS) if f"{k}={c.get(k)}" not in REF_MODEL_RUN}
            if not uncovered:
                break
        else:
            raise AssertionError(f"{name}'s copy would run settings no trained copy has: {uncovered}")


def test_launch_script_submits_a_ray_job_with_the_given_runtime_env_and_submission_id(tmp_path):
    """``$RAY_ADDRESS``: ``ray job submit --no-wait`` to it, with ``$RUNTIME_ENV_JSON`` and ``$SUBMISSION_ID`` when set
    (a stand-in ``ray`` on PATH prints its arguments)."""
    fake_ray = tmp_path / "ray"
    fake_ray.write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\n")
    fake_ray.chmod(0o755)
    runtime_env = '{"env_vars": {"A": "1 2"}}'
    env = dict(os.environ, PYTHON="python3", RAY_ADDRESS="http://10.0.0.1:8265", RUNTIME_ENV_JSON=runtime_env,
               SUBMISSION_ID="sub_1", PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", str(RECIPES_DIR / "run_qwen2_5_math_7b_oar_g.sh"), "trainer.nnodes=2"], env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[:6] == ["job", "submit", "--address=http://10.0.0.1:8265", "--no-wait",
                       f"--runtime-env-json={runtime_env}", "--submission-id=sub_1"]
    assert out[6:9] == ["--", "python3", "-m"] and out[-1] == "trainer.nnodes=2"
    env.pop("RUNTIME_ENV_JSON"), env.pop("SUBMISSION_ID")
    out = subprocess.run(["bash", str(RECIPES_DIR / "launch.sh"), "qwen2_5_math_7b_oar_g"], env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[:5] == ["job", "submit", "--address=http://10.0.0.1:8265", "--no-wait", "--"]
