"""The verl-facing layer without Ray: plugin loading, registries, start-up checks, the estimator."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import torch
from _verl_config import compose_ppo_config


def test_registry_entries_dispatch_to_verls_own_classes_and_leave_the_legacy_trainer_alone():
    import verl
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from verl_oar.integration import compat
    from verl_oar.integration.trainer import install_trainer_hook, verl_trainer_cls

    assert verl.__version__.startswith(compat.SUPPORTED_VERL)
    install_trainer_hook()  # idempotent: a second install changes nothing
    expected = {"sync": PPOTrainerSync, "colocate_async": PPOTrainerColocateAsync,
                "separate_async": PPOTrainerSeparateAsync}
    assert set(trainer_base.TRAINER_REGISTRY) == set(expected)
    for mode, cls in expected.items():
        entry = trainer_base.TRAINER_REGISTRY[mode]
        assert entry._verl_cls is cls and verl_trainer_cls(mode) is cls
        assert issubclass(entry, cls) and entry._verl_oar_dispatch
    for name in ("_compute_old_log_prob", "_compute_advantage", "_init_resource_pool_mgr"):
        assert hasattr(PPOTrainerSync, name), f"verl no longer has PPOTrainer.{name}: the hook is stale"
    assert "_verl_oar" not in " ".join(vars(ray_trainer.RayPPOTrainer)), "the legacy trainer must be verl's"


def test_the_legacy_trainer_refuses_a_token_estimator_at_construction_and_is_otherwise_verls():
    """verl's legacy TaskRunner builds ``main_ppo_v0.RayPPOTrainer(config=..., ...)``; only that name is a
    dispatcher. (Each e2e run's Ray workers load the plugin the same way, through ``import verl``.)"""
    from verl.trainer import main_ppo_v0
    from verl.trainer.ppo import ray_trainer

    entry = main_ppo_v0.RayPPOTrainer
    assert entry._verl_oar_dispatch and entry._verl_cls is ray_trainer.RayPPOTrainer
    config = compose_ppo_config(["algorithm.adv_estimator=oar_g", "trainer.use_v1=false"])
    with pytest.raises(ValueError, match="trainer.use_v1=true"):
        entry(config=config, tokenizer=None, role_worker_mapping={}, resource_pool_manager=None)


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
@pytest.mark.parametrize("estimator", ["grpo", "gae", "rloo"])
def test_a_non_token_estimator_gets_verls_own_trainer_object(estimator, mode):
    """What main_ppo does: ``get_trainer_cls(mode)(config=config)``; the object is verl's class, not a subclass."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_oar.integration.trainer import verl_trainer_cls

    config = compose_ppo_config([f"algorithm.adv_estimator={estimator}", f"trainer.v1.trainer_mode={mode}"])
    trainer = get_trainer_cls(mode)(config=config)
    assert type(trainer) is verl_trainer_cls(mode)
    assert type(trainer).__module__.startswith("verl.trainer.ppo.v1.")


MATH_REWARD = ["reward.custom_reward_function.path=pkg://verl_oar.rewards.math_reward",
               "reward.custom_reward_function.name=compute_score"]


@pytest.mark.parametrize("mode", ["sync", "colocate_async"])
def test_a_run_graded_by_the_math_reward_gets_the_ungraded_answers_rule_for_every_estimator(mode):
    """GRPO graded by verl-oar's math reward: verl's class plus ``GradingMixin`` (ungraded answers counted and left
    out of the update); OAR-G's trainer has it too; a limit outside [0, 1] stops the run at construction."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_oar.integration.grading import GradingMixin
    from verl_oar.integration.trainer import verl_trainer_cls

    config = compose_ppo_config(["algorithm.adv_estimator=grpo", f"trainer.v1.trainer_mode={mode}", *MATH_REWARD])
    trainer = get_trainer_cls(mode)(config=config)
    assert isinstance(trainer, GradingMixin) and isinstance(trainer, verl_trainer_cls(mode))
    oar = compose_ppo_config(["algorithm.adv_estimator=oar_g", "actor_rollout_ref.actor.strategy=fsdp2", *MATH_REWARD])
    assert isinstance(get_trainer_cls("sync")(config=oar), GradingMixin)
    bad = compose_ppo_config(["algorithm.adv_estimator=grpo", f"trainer.v1.trainer_mode={mode}", *MATH_REWARD,
                              "+reward.custom_reward_function.reward_kwargs.max_ungraded_frac=5"])
    with pytest.raises(ValueError, match="max_ungraded_frac=5"):
        get_trainer_cls(mode)(config=bad)


def test_a_token_estimator_gets_the_oar_trainer_under_sync_and_a_refusal_elsewhere():
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    config = compose_ppo_config(["algorithm.adv_estimator=oar_g", "actor_rollout_ref.actor.strategy=fsdp2"])
    trainer = get_trainer_cls("sync")(config=config)
    assert type(trainer).__name__ == "OARTrainerSync" and isinstance(trainer, PPOTrainerSync)
    assert [p.name for p in trainer._token_signals] == ["token_importance"]
    async_config = compose_ppo_config(["algorithm.adv_estimator=oar_p", "trainer.v1.trainer_mode=colocate_async"])
    with pytest.raises(ValueError, match="trainer.v1.trainer_mode=sync"):
        get_trainer_cls("colocate_async")(config=async_config)


def test_estimator_registration_is_idempotent_when_imported_by_file_path():
    import verl_oar.integration.estimators as mod
    from verl.trainer.ppo import core_algos

    spec = importlib.util.spec_from_file_location("oar_g_again", mod.__file__)
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)  # must not raise ValueError like verl's own decorator would
    assert core_algos.ADV_ESTIMATOR_REGISTRY["oar_g"] is mod.compute_oar_g_advantage


def test_a_different_function_under_an_oar_name_is_refused():
    from verl_oar.integration.signals import register_token_estimator

    with pytest.raises(ValueError, match="already registered"):
        register_token_estimator("oar_g", needs=())(lambda **kw: None)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["trainer.v1.trainer_mode=colocate_async"], "trainer_mode=sync"),
        (["trainer.use_v1=false"], "trainer.use_v1=true"),
        (["actor_rollout_ref.actor.strategy=megatron"], "model_engine=megatron"),  # FSDP config, no megatron node
        (["actor_rollout_ref.actor.strategy=torchtitan"], "model_engine=megatron"),
        (["+algorithm.oar.tua=0.5"], r"Unknown key\(s\) algorithm.oar.tua"),
        (["+algorithm.oar.tau=1.5"], "tau"),
        (["+algorithm.oar.outcome=median"], "outcome"),
        (["+algorithm.oar.importance_model=ref", "actor_rollout_ref.actor.use_kl_loss=false"], "reference model"),
        (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"], "ulysses"),
        (["actor_rollout_ref.actor.strategy=fsdp", "trainer.n_gpus_per_node=8"],
         r"FSDP1 .*needs one data-parallel rank, but this run has 8.*strategy=fsdp2"),
    ],
)
def test_startup_checks_name_cause_and_fix(overrides, match):
    from verl_oar.integration.validate import LEGACY, check_token_signals_supported

    config = compose_ppo_config(["algorithm.adv_estimator=oar_g", "actor_rollout_ref.actor.strategy=fsdp2", *overrides])
    mode = config.trainer.v1.trainer_mode if config.trainer.use_v1 else LEGACY
    with pytest.raises(ValueError, match=match):
        check_token_signals_supported(config, mode)


MEGATRON = "actor_rollout_ref.actor.megatron"


@pytest.mark.parametrize(
    "overrides, match",
    [
        ([f"{MEGATRON}.pipeline_model_parallel_size=2"],
         (rf"{MEGATRON}.pipeline_model_parallel_size=2: the input embeddings .* Set {MEGATRON}"
          r".pipeline_model_parallel_size=1; shard the model with tensor_model_parallel_size and sequence_parallel")),
        ([f"{MEGATRON}.virtual_pipeline_model_parallel_size=2"], "virtual_pipeline_model_parallel_size=null"),
        ([f"{MEGATRON}.context_parallel_size=2"], rf"{MEGATRON}.context_parallel_size=2: context parallelism"),
        ([f"{MEGATRON}.dynamic_context_parallel=True"], "dynamic_context_parallel=True"),
        ([f"{MEGATRON}.use_megatron_fsdp=True"], "use_megatron_fsdp=True: its forward gathers parameters"),
        ([f"+{MEGATRON}.override_ddp_config.overlap_param_gather=True"],
         "override_ddp_config.overlap_param_gather=True: the distributed optimizer then gathers"),
        (["+actor_rollout_ref.actor.optim.override_optimizer_config.overlap_param_gather=True"],
         "optim.override_optimizer_config.overlap_param_gather=True"),
        ([f"{MEGATRON}.expert_model_parallel_size=2"],
         rf"{MEGATRON}.expert_model_parallel_size=2: every MoE layer then exchanges tokens \(all-to-all\)"),
        ([f"{MEGATRON}.tensor_model_parallel_size=2", f"{MEGATRON}.expert_tensor_parallel_size=4"],
         "expert_tensor_parallel_size=4 .different from tensor_model_parallel_size=2.: the experts' tensor-parallel group"),
        (["actor_rollout_ref.model.mtp.enable=True"], r"mtp.enable=False"),
        (["actor_rollout_ref.model.use_fused_kernels=True"], "use_fused_kernels=False"),
        (["+algorithm.oar.importance_model=ref", "actor_rollout_ref.actor.use_kl_loss=true",
          "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=4"],
         "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=4"),
    ],
)
@pytest.mark.parametrize("estimator", ["oar_g", "oar_p"])
def test_megatron_startup_checks_name_the_setting_and_what_works(overrides, match, estimator):
    """verl's Megatron config (``model_engine=megatron``): what OAR cannot do there is refused at start-up."""
    from verl_oar.integration.validate import check_token_signals_supported

    config = compose_ppo_config(["model_engine=megatron", f"algorithm.adv_estimator={estimator}", *overrides])
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    with pytest.raises(ValueError, match=match):
        check_token_signals_supported(config, "sync")


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # verl's defaults: TP 1, sequence_parallel on, packing on
        [f"{MEGATRON}.tensor_model_parallel_size=4", f"{MEGATRON}.sequence_parallel=True"],
        [f"{MEGATRON}.tensor_model_parallel_size=2", f"{MEGATRON}.sequence_parallel=False",
         "actor_rollout_ref.model.use_remove_padding=False", f"{MEGATRON}.expert_tensor_parallel_size=2"],
        ["+algorithm.oar.importance_model=ref", "actor_rollout_ref.actor.use_kl_loss=true"],
    ],
)
@pytest.mark.parametrize("estimator", ["oar_g", "oar_p"])
def test_megatron_startup_check_passes_tensor_and_sequence_parallel(overrides, estimator):
    from verl_oar.integration.validate import check_token_signals_supported

    config = compose_ppo_config(["model_engine=megatron", f"algorithm.adv_estimator={estimator}", *overrides])
    assert [p.name for p in check_token_signals_supported(config, "sync")] == ["token_importance"]


@pytest.mark.parametrize(
    "overrides, fused",
    [
        (["model_engine=megatron"], True),
        (["model_engine=megatron", f"{MEGATRON}.router_replay.mode=R2"], False),  # verl records routes there
        (["actor_rollout_ref.actor.strategy=fsdp2"], True),
    ],
)
def test_fused_log_prob_pass_is_off_where_verls_pass_does_more(overrides, fused):
    from types import SimpleNamespace

    from verl_oar.integration.importance_signal import fuse_into_log_prob

    config = compose_ppo_config(["algorithm.adv_estimator=oar_g", *overrides])
    batch = SimpleNamespace(extra_info={})
    assert fuse_into_log_prob(SimpleNamespace(config=config, global_steps=2), batch) is fused
    assert batch.extra_info.get("oar_fused", False) is fused


def test_startup_check_passes_for_a_supported_config_and_ignores_other_estimators():
    from verl_oar.integration.validate import check_token_signals_supported

    ok = compose_ppo_config(["algorithm.adv_estimator=oar_g", "actor_rollout_ref.actor.strategy=fsdp2"])
    assert [p.name for p in check_token_signals_supported(ok, "sync")] == ["token_importance"]
    grpo = compose_ppo_config(["algorithm.adv_estimator=grpo", "trainer.v1.trainer_mode=colocate_async"])
    assert check_token_signals_supported(grpo, "colocate_async") == ()


def _grpo_batch(rewards, length=6):
    bs = len(rewards)
    token_level_rewards = torch.zeros(bs, length)
    token_level_rewards[:, -1] = torch.tensor(rewards, dtype=torch.float32)
    response_mask = torch.ones(bs, length)
    index = np.array(["a"] * (bs // 2) + ["b"] * (bs - bs // 2), dtype=object)
    return token_level_rewards, response_mask, index


def test_estimator_without_signals_refuses_with_cause_and_fix():
    from verl_oar.integration.estimators import compute_oar_g_advantage

    rewards, mask, index = _grpo_batch([1.0, 0.0, 1.0, 0.0])
    with pytest.raises(RuntimeError, match="trainer.v1.trainer_mode=sync"):
        compute_oar_g_advantage(token_level_rewards=rewards, response_mask=mask, index=index, config={})


def test_estimator_reshapes_grpo_exactly_where_importance_varies():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    from verl_oar.integration.estimators import compute_oar_g_advantage
    from verl_oar.integration.signals import TokenSignals, provide

    rewards, mask, index = _grpo_batch([1.0, 0.0, 0.5, 0.0])
    importance = torch.rand(4, 6)
    importance[1] = 0.3  # all-equal: falls back to uniform weights
    reasoning = torch.zeros(4, 6, dtype=torch.long)
    reasoning[:, :4] = 1
    answer = torch.zeros(4, 6, dtype=torch.long)
    answer[:, 4] = 1
    answer[3] = 0  # no answer found: falls back
    signals = TokenSignals(
        tensors={"oar_importance": importance, "oar_reasoning_mask": reasoning, "oar_answer_mask": answer}
    )
    with provide(signals):
        adv, returns = compute_oar_g_advantage(token_level_rewards=rewards, response_mask=mask, index=index, config={})
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index)
    assert torch.equal(adv, returns)
    torch.testing.assert_close(adv.sum(dim=1), grpo.sum(dim=1), rtol=1e-5, atol=1e-5)  # mass preserved
    torch.testing.assert_close(adv[1], grpo[1]) and torch.testing.assert_close(adv[3], grpo[3])
    for row in (0, 2):
        assert not torch.allclose(adv[row, :4], grpo[row, :4])  # reasoning reshaped
        torch.testing.assert_close(adv[row, 4:], grpo[row, 4:])  # answer and later tokens keep weight 1
        assert torch.all(torch.sign(adv[row]) == torch.sign(grpo[row]))
    assert signals.metrics["fallback/frac_any"] == pytest.approx(0.5)


def test_a_half_loaded_plugin_is_named_as_the_cause(monkeypatch):
    from verl_oar.integration import signals
    from verl_oar.integration.estimators import compute_oar_g_advantage

    monkeypatch.setattr(signals, "PLUGIN_LOAD_ERROR", "Traceback ... ImportError: boom")
    rewards, mask, index = _grpo_batch([1.0, 0.0, 1.0, 0.0])
    with pytest.raises(RuntimeError, match="plugin failed to load:\nTraceback ... ImportError: boom"):
        compute_oar_g_advantage(token_level_rewards=rewards, response_mask=mask, index=index, config={})


def test_plugin_failure_is_printed_loudly_not_swallowed():
    # a broken verl_oar.integration.trainer shadows the real one: verl would hide the exception at debug level
    code = (
        "import sys, types\n"
        "import verl_oar\n"
        "broken = types.ModuleType('verl_oar.integration.trainer')\n"
        "def install_trainer_hook():\n"
        "    raise RuntimeError('simulated hook failure')\n"
        "broken.install_trainer_hook = install_trainer_hook\n"
        "sys.modules['verl_oar.integration.trainer'] = broken\n"
        "import verl\n"
        "import verl.trainer.ppo.v1\n"  # the trainer hook installs when verl's v1 trainer is imported
        "from verl_oar.integration import plugin\n"
        "assert plugin.LOAD_ERROR and 'simulated hook failure' in plugin.LOAD_ERROR\n"
        "from verl_oar.integration import signals\n"
        "assert signals.PLUGIN_LOAD_ERROR == plugin.LOAD_ERROR\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
    assert "[verl-oar] ERROR: the verl-oar plugin failed to load" in out.stderr
