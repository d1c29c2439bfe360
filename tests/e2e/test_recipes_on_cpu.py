"""The recipes (recipes/config, recipes/run_*.sh): each composes with Hydra against verl's config, passes
verl's validation and OAR's start-up checks, mirrors the published GRPO settings, and GRPO / OAR-G /
OAR-P differ only in the estimator. The slow tests run a shrunk CPU copy of every FSDP2 OAR recipe through
its own launch script (``python -m verl_oar.cpu.recipe``); Megatron recipes cannot run without CUDA."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _e2e import OAR_KEYS, check_reshaped_exactly_where_importance_varies
from _verl_config import compose_recipe
from omegaconf import OmegaConf

from verl_oar.cpu.launch import read_metrics
from verl_oar.cpu.overrides import metrics_file
from verl_oar.cpu.recipe import RECIPES_DIR, recipe_names

RECIPES = recipe_names()
_composed = functools.lru_cache(maxsize=None)(compose_recipe)
"""read-only uses: each recipe composed once (about a second each)"""
MODELS = {"1_5b": "Qwen/Qwen2.5-Math-1.5B", "7b": "Qwen/Qwen2.5-Math-7B"}
ESTIMATORS = ("grpo", "oar_g", "oar_p")
ENGINES = ("", "_megatron")


def test_there_is_a_recipe_per_model_estimator_and_engine_each_with_a_script():
    expected = sorted(f"qwen2_5_math_{m}_{e}{g}" for m in MODELS for e in ESTIMATORS for g in ENGINES)
    assert RECIPES == expected
    for name in RECIPES:
        assert os.access(RECIPES_DIR / f"run_{name}.sh", os.X_OK), name


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_composes_and_passes_verls_validation_and_oars_startup_checks(name):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from verl_oar.integration.importance_signal import validate_importance_config

    config = compose_recipe(name)
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # what the workers build
    omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    if config.algorithm.adv_estimator != "grpo":
        validate_importance_config(config)
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
    if c.algorithm.adv_estimator != "grpo":
        assert c.algorithm.oar.tau == 0.5 and c.algorithm.oar.outcome == "mean"  # the paper's best


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
def test_grpo_oar_g_and_oar_p_recipes_differ_only_in_the_estimator(model, engine):
    grpo = _flat(_composed(f"qwen2_5_math_{model}_grpo{engine}"))
    for estimator in ("oar_g", "oar_p"):
        oar = _flat(_composed(f"qwen2_5_math_{model}_{estimator}{engine}"))
        changed = {k for k in grpo.keys() | oar.keys() if grpo.get(k, "<absent>") != oar.get(k, "<absent>")}
        # values derived from the experiment name (checkpoint folder, trace name) follow it
        derived = {k for k in changed if grpo["trainer.experiment_name"] in str(grpo.get(k))}
        assert {k for k in changed - derived if not k.startswith("algorithm.oar.")} == {"algorithm.adv_estimator"}
        assert "trainer.experiment_name" in derived
        assert oar["algorithm.adv_estimator"] == estimator


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


CPU_COPIES = [n for n in RECIPES if not n.endswith(("_megatron", "_grpo"))]
"""the FSDP2 OAR-G and OAR-P recipes of both models; a GRPO recipe differs from its OAR-G twin only in
``algorithm.*`` (test_grpo_oar_g_and_oar_p_recipes_differ_only_in_the_estimator), so its copy would run
the same configuration minus OAR (GRPO itself trains end to end in test_testbed_demo_on_cpu.py)"""
PERTURB_KEYS = ("oar/perturb/copies_mean", "oar/perturb/copies_max", "oar/perturb/cost_passes_mean",
                "oar/perturb/peak_call_tokens")
BUDGET = 16


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_COPIES)
def test_cpu_copy_of_the_recipe_trains_through_its_own_launch_script(name, cpu_workspace_dir, tmp_path):
    """1.5B copies run 2 steps and dump their tensors: these are the end-to-end tests of OAR-G and OAR-P
    (``python -m verl.trainer.main_ppo algorithm.adv_estimator=oar_g|oar_p`` in CPU mode, verl's v1
    trainer, FSDP2 engine with dynamic batch size, Ray, hf rollout); 7B copies run 1 step."""
    steps = 2 if "_1_5b_" in name else 1
    estimator = next(e for e in ESTIMATORS if name.endswith(e))
    dump = tmp_path / "dump"
    extra = [f"algorithm.oar.dump_dir={dump}"] if estimator != "grpo" and steps == 2 else []
    log = tmp_path / "log"
    with open(log, "w") as fp:
        proc = subprocess.run(
            [sys.executable, "-m", "verl_oar.cpu.recipe", name, "--workdir", str(cpu_workspace_dir),
             "--steps", str(steps), "--timeout", "400", *extra],
            stdout=fp, stderr=subprocess.STDOUT, timeout=430, check=False,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    assert f"bash {RECIPES_DIR / f'run_{name}.sh'}" in text  # through the recipe's own script
    records = read_metrics(metrics_file(cpu_workspace_dir, f"cpu_{name}"))
    assert [r["step"] for r in records] == list(range(1, steps + 1)), text[-3000:]
    for record in records:
        data = record["data"]
        assert data["training/rollout_probs_diff_mean"] < 1e-4  # fp32 rollout and trainer agree
        assert data["actor/pg_loss"] == data["actor/pg_loss"]  # not NaN
        assert 0.0 <= data["critic/score/mean"] <= 1.0  # math-verify scores 0 or 1
        if estimator == "grpo":
            assert not any(k.startswith("oar/") for k in data)
            continue
        assert all(k in data for k in OAR_KEYS), [k for k in OAR_KEYS if k not in data]
        assert data["oar/mass_error/max_abs"] < 1e-4
        # the math reward returns the span it graded, and OAR grounds on exactly that span
        sources = {k: data[f"oar/answer/frac_{k}"] for k in ("none", "locator", "reward", "reward_rejected")}
        assert sources["reward"] > 0 and sources["locator"] == 0 and sources["reward_rejected"] == 0, sources
        assert abs(sum(sources.values()) - 1.0) < 1e-9
        assert data["oar/fallback/frac_no_answer"] == pytest.approx(sources["none"])
        assert data["oar/fallback/no_answer_streak"] in (0.0, 1.0, 2.0)
        if estimator == "oar_g":
            assert data["oar/fused_log_prob"] == 1.0  # the recipe fuses importance into the log-prob pass
        else:
            assert all(k in data for k in PERTURB_KEYS), [k for k in PERTURB_KEYS if k not in data]
            assert "oar/fused_log_prob" not in data  # OAR-P runs in passes of its own
            assert 0 < data["oar/perturb/copies_max"] <= BUDGET  # chunk mode, perturb_budget 16
            assert data["oar/perturb/cost_passes_mean"] <= BUDGET + 1
    if not extra:
        return
    reshaped = check_reshaped_exactly_where_importance_varies(dump, steps=range(1, steps + 1))
    assert reshaped > 0, "no response had varying importance: the run exercised nothing"
    if estimator == "oar_p":  # every token of a chunk carries its chunk's importance: at most K values per row
        for step in range(1, steps + 1):
            d = torch.load(dump / f"step_{step}.pt")
            for row, reasoning in zip(d["oar_importance"], d["oar_reasoning_mask"].bool(), strict=True):
                assert row[reasoning].unique().numel() <= BUDGET
                assert torch.all(row[~reasoning] == 0)
