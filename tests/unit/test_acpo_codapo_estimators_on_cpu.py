"""The acpo and codapo estimators as verl calls them (registry entries, signals in, formulas out), CoDaPO's
composition with the other token estimators, the start-up refusals of both methods, and CoDaSampling's
trainer overrides on a stand-in of verl's trainer state (batch selection, own uids, step counts, resume)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_oar.integration import acpo_estimator, codapo_estimator  # noqa: F401  (register acpo, codapo)


def _batch(seed=0, groups=3, n=4, t=6):
    g = torch.Generator().manual_seed(seed)
    bs = groups * n
    lengths = torch.randint(2, t + 1, (bs,), generator=g)
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    rewards = torch.zeros(bs, t)
    score = (torch.rand(bs, generator=g) < 0.5).float()
    score[0], score[1] = 1.0, 0.0
    rewards[torch.arange(bs), lengths - 1] = score
    index = np.array([f"u{i // n}" for i in range(bs)], dtype=object)
    return rewards, mask, index, g


def test_acpo_estimator_is_grpo_times_the_surrogate_weights():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.acpo import ACPOConfig, acpo_advantages
    from verl_oar.integration.estimators import grpo_advantage
    from verl_oar.integration.signals import TokenSignals, provide

    rewards, mask, index, g = _batch()
    surrogate = torch.rand(mask.shape, generator=g) * 2 * mask
    entropy = surrogate + 0.3 * mask
    signals = TokenSignals(tensors={"acpo_surrogate": surrogate, "acpo_entropy": entropy})
    with provide(signals):
        adv, returns = get_adv_estimator_fn("acpo")(rewards, mask, index, config={"acpo": {"beta": 0.8}})
    grpo = grpo_advantage(rewards, mask, index, 1e-6, True)
    expected = acpo_advantages(surrogate, grpo[:, 0], mask.bool(), ACPOConfig(beta=0.8)).advantages * mask
    torch.testing.assert_close(adv, expected)
    assert torch.equal(adv, returns) and ((adv * grpo) >= 0).all()
    assert signals.metrics["acpo/sign_violations"] == 0
    assert signals.metrics["acpo/entropy_gap/mean"] == pytest.approx(0.3, abs=1e-6)
    assert signals.artifacts["weights"].shape == mask.shape


def test_codapo_estimator_is_the_question_value_times_grpo():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.codapo import question_values
    from verl_oar.core.oppo import group_ids
    from verl_oar.integration.estimators import grpo_advantage
    from verl_oar.integration.signals import TokenSignals, provide

    rewards, mask, index, g = _batch(1)
    old = -torch.rand(mask.shape, generator=g) * mask
    signals = TokenSignals(tensors={"old_log_probs": old, "rm_scores": rewards})
    with provide(signals):
        adv, _ = get_adv_estimator_fn("codapo")(rewards, mask, index, config={"codapo": {"weight_offset": 0.2}})
    value, _ = question_values(rewards.sum(1), old, mask, group_ids(list(index)), 0.2)
    grpo = grpo_advantage(rewards, mask, index, 1e-6, True)
    torch.testing.assert_close(adv, (value[:, None] * grpo).float() * mask)
    assert 0.2 <= signals.metrics["codapo/value/min"] <= signals.metrics["codapo/value/max"] <= 1.2


def test_codapo_with_rewards_that_are_not_0_1_stops_naming_the_key_or_follows_the_threshold():
    """A 0/1 reward plus a 0.1 format bonus: under the authors' rule every bonus-carrying answer would count wrong and
    CoDaPO would become a constant times GRPO; the batch is refused naming ``right_threshold``, and with
    ``right_threshold=1.0`` the right answers (1.0, 1.1) count as right."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.codapo import question_values, right_answers
    from verl_oar.core.oppo import group_ids
    from verl_oar.integration.signals import TokenSignals, provide

    rewards, mask, index, g = _batch(2)
    bonus = rewards + 0.1 * (rewards.sum(1, keepdim=True) >= 0) * (rewards != 0).float()   # 1 -> 1.1
    last = mask.long().sum(1) - 1
    bonus[torch.arange(len(last)), last] += 0.1 * (rewards.sum(1) == 0).float()           # 0 -> 0.1 (format ok)
    old = -torch.rand(mask.shape, generator=g) * mask
    signals = TokenSignals(tensors={"old_log_probs": old, "rm_scores": bonus})
    with provide(signals), pytest.raises(ValueError, match="right_threshold"):
        get_adv_estimator_fn("codapo")(bonus, mask, index, config={"codapo": {}})
    with provide(signals):
        get_adv_estimator_fn("codapo")(bonus, mask, index, config={"codapo": {"right_threshold": 1.0}})
    expected, _ = question_values(rewards.sum(1), old, mask, group_ids(list(index)))     # the 0/1 reward's values
    got, _ = question_values(bonus.sum(1), old, mask, group_ids(list(index)), right_threshold=1.0)
    torch.testing.assert_close(got, expected)
    assert signals.metrics["codapo/accuracy/mean"] == pytest.approx(float(right_answers(rewards.sum(1)).mean()))
    assert right_answers(torch.tensor([1.0, 0.0, -1.0])).tolist() == [1.0, 0.0, 0.0]     # 0/1 and -1/1: fine


def test_compose_multiplies_any_token_estimators_advantages_by_the_value():
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    from verl_oar.core.codapo import question_values
    from verl_oar.core.oppo import group_ids
    from verl_oar.integration.signals import TokenSignals, provide

    rewards, mask, index, g = _batch(2)
    surrogate = torch.rand(mask.shape, generator=g) * mask
    old = -torch.rand(mask.shape, generator=g) * mask
    tensors = {"acpo_surrogate": surrogate, "acpo_entropy": surrogate, "old_log_probs": old, "rm_scores": rewards}
    with provide(TokenSignals(tensors=dict(tensors))):
        plain, _ = get_adv_estimator_fn("acpo")(rewards, mask, index, config={})
    signals = TokenSignals(tensors=dict(tensors))
    with provide(signals):
        composed, returns = get_adv_estimator_fn("acpo")(rewards, mask, index, config={"codapo": {"compose": True}})
    value, _ = question_values(rewards.sum(1), old, mask, group_ids(list(index)), 0.1)
    torch.testing.assert_close(composed, value[:, None].float() * plain)
    assert torch.equal(composed, returns) and ((composed * plain) >= 0).all()       # each token keeps its sign
    torch.testing.assert_close(signals.artifacts["advantages"], composed)
    assert "codapo/value/mean" in signals.metrics and "acpo/sign_violations" in signals.metrics


@pytest.mark.parametrize("estimator, extra, needle", [
    ("acpo", ["+algorithm.acpo.betta=0.5"], "Valid keys: beta"),
    ("acpo", ["actor_rollout_ref.model.use_fused_kernels=True"], "use_fused_kernels=False"),
    ("acpo", ["algorithm.rollout_correction.bypass_mode=True"], "surrogate=sampled"),
    ("acpo", ["actor_rollout_ref.actor.strategy=megatron"], "surrogate=sampled"),
    ("codapo", ["+algorithm.codapo.compose=True"], "already applies it"),
    ("codapo", ["+algorithm.codapo.percentil=0.5"], "Valid keys"),
    ("codapo", ["data.gen_batch_size=2"], "gen_batch_size"),
    ("oar_g", ["+algorithm.codapo.percentile=0.5"], "compose=true"),
    ("grpo", ["+algorithm.codapo.compose=True"], "not one of them"),
])
def test_bad_configurations_stop_the_run_at_start_up_with_the_fix(estimator, extra, needle):
    from _verl_config import compose_ppo_config

    from verl_oar.cpu.overrides import cpu_overrides
    from verl_oar.integration import estimators  # noqa: F401
    from verl_oar.integration.validate import check_token_signals_supported

    config = compose_ppo_config(cpu_overrides("/ws", adv_estimator=estimator) + extra)
    with pytest.raises(ValueError, match=needle):
        check_token_signals_supported(config, "sync")


@pytest.mark.parametrize("estimator, extra, providers", [
    ("acpo", [], ["acpo_surrogate"]),
    ("acpo", ["+algorithm.acpo.surrogate=sampled", "algorithm.rollout_correction.bypass_mode=True"], ["acpo_surrogate"]),
    ("codapo", [], ["old_log_probs", "verifier_scores"]),
    ("oar_g", ["+algorithm.codapo.compose=True"], ["token_importance", "old_log_probs", "verifier_scores"]),
    ("grpo", [], []),
])
def test_good_configurations_get_their_signals(estimator, extra, providers):
    from _verl_config import compose_ppo_config

    from verl_oar.cpu.overrides import cpu_overrides
    from verl_oar.integration import estimators  # noqa: F401
    from verl_oar.integration.validate import check_token_signals_supported

    config = compose_ppo_config(cpu_overrides("/ws", adv_estimator=estimator) + extra)
    assert [p.name for p in check_token_signals_supported(config, "sync")] == providers


# --- CoDaSampling's overrides (integration.codapo_sampling), on a stand-in of verl's trainer state ---------------


class _VerlTrainer:
    """What CoDaSampling's overrides call on verl's PPOTrainer: a dataloader fetch (fresh rows and uids each time,
    as verl's ``_fetch_one_gen_batch``; ``input_ids`` numbers the rows drawn so far), a step, checkpoints."""

    def __init__(self, config, batch_size=16):
        self.config, self.batch_size, self.global_steps, self.parameter_sync_step = config, batch_size, 0, 1
        self.drawn, self.saved = 0, []

    def _init_dataloader(self):
        self.steps_per_epoch, self.total_training_steps = 3, 3

    def _next_train_batch(self, num_prompts=None):
        import uuid

        from verl.utils import tensordict_utils as tu

        n = num_prompts or self.batch_size
        rows = tu.get_tensordict({"input_ids": torch.arange(self.drawn, self.drawn + n)[:, None],
                                  "uid": np.array([str(uuid.uuid4()) for _ in range(n)], dtype=object)})
        self.drawn += n
        tu.assign_non_tensor_data(rows, "global_steps", self.global_steps)
        return rows

    def _save_checkpoint(self):
        self.saved.append(self.global_steps)

    def _load_checkpoint(self):
        return None


def _trainer(tmp_path, percentile=0.75, repeat=4):
    from omegaconf import OmegaConf

    from verl_oar.integration.codapo_sampling import CoDaSamplingMixin

    class Trainer(CoDaSamplingMixin, _VerlTrainer):
        pass

    config = OmegaConf.create({"algorithm": {"adv_estimator": "codapo", "codapo": {"percentile": percentile, "repeat_count": repeat}},
                               "trainer": {"total_training_steps": None, "default_local_dir": str(tmp_path), "resume_mode": "auto"},
                               "actor_rollout_ref": {"actor": {"optim": {"total_training_steps": 3}}}})
    trainer = Trainer(config)
    trainer._coda_setup(config)
    return trainer


def test_codasampling_refocuses_the_second_use_on_the_top_quarter_each_its_own_group(tmp_path):
    trainer = _trainer(tmp_path)
    trainer._init_dataloader()
    assert trainer.steps_per_epoch == 6 and trainer.total_training_steps == 6          # each batch used twice
    assert trainer.config.actor_rollout_ref.actor.optim.total_training_steps == 6
    trainer.global_steps = 1
    first = trainer._next_train_batch()
    uids = list(first["uid"])
    values = {u: float(v) for u, v in zip(uids, torch.randperm(16, generator=torch.Generator().manual_seed(0)).tolist())}
    metrics = trainer._refocus(values)
    assert metrics["codapo/sampling/selected_questions"] == 4 and metrics["codapo/sampling/repeats_mean"] == 4
    trainer.global_steps = 2
    second = trainer._next_train_batch()
    top4 = sorted(uids, key=values.get)[-4:]
    picked = [int(x) for x in second["input_ids"][:, 0]]
    assert sorted(set(picked)) == sorted(uids.index(u) for u in top4) and all(picked.count(q) == 4 for q in set(picked))
    assert len(set(second["uid"])) == 16 and not set(second["uid"]) & set(uids)      # every copy its own group
    assert all("_" not in u for u in second["uid"])
    assert trainer._next_train_batch(num_prompts=2) is not None                       # a refill draws fresh rows
    trainer.global_steps = 4
    with pytest.raises(RuntimeError, match="no refocused batch is pending"):
        trainer._next_train_batch()


def test_codasampling_resume_restores_the_pending_batch_or_refuses(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.global_steps = 1
    first = trainer._next_train_batch()
    trainer._refocus({u: float(i) for i, u in enumerate(first["uid"])})
    (tmp_path / "global_step_1").mkdir()
    trainer._save_checkpoint()
    resumed = _trainer(tmp_path)
    resumed.global_steps = 1
    resumed._load_checkpoint()
    assert torch.equal(resumed._coda_rows["input_ids"], trainer._coda_rows["input_ids"])
    (tmp_path / "global_step_1" / "codapo_sampling.pt").unlink()
    lost = _trainer(tmp_path)
    lost.global_steps = 1
    with pytest.raises(RuntimeError, match="codapo_sampling.pt"):
        lost._load_checkpoint()


def test_codasampling_is_inert_without_codapo(tmp_path):
    from omegaconf import OmegaConf

    from verl_oar.integration.codapo_sampling import sampling_config

    trainer = _trainer(tmp_path)
    assert sampling_config(OmegaConf.create({"algorithm": {"adv_estimator": "oar_g"}})) is None
    assert sampling_config(OmegaConf.create({"algorithm": {"adv_estimator": "codapo", "codapo": {"sampling": False}}})) is None
    assert sampling_config(OmegaConf.create({"algorithm": {"adv_estimator": "oar_g", "codapo": {"compose": True}}})) is not None
    trainer._coda = None
    trainer._init_dataloader()
    assert trainer.total_training_steps == 3


# --- CoDaSampling beside DAPO's group filter (verl's v1 replay buffer evicts uniform groups and refills) ----------


def test_codasampling_with_dapo_eviction_refocuses_on_every_trained_question_refills_included(tmp_path):
    """Step 1: DAPO evicts 12 of the dataloader batch's 16 questions and refills 12 (more are drawn than trained:
    the surplus is discarded, no value); the refocused batch is built from the 16 trained questions, refills too."""
    trainer = _trainer(tmp_path)
    trainer.global_steps = 1
    source = trainer._next_train_batch()
    refill = trainer._next_train_batch(num_prompts=14)                  # 12 trained + 2 discarded surplus
    kept = list(source["uid"])[:4]
    trained = kept + list(refill["uid"])[:12]
    values = {u: float(v) for u, v in zip(trained, torch.randperm(16, generator=torch.Generator().manual_seed(1)).tolist())}
    metrics = trainer._refocus(values)
    trainer.global_steps = 2
    second = trainer._next_train_batch()
    ids = {u: int(i) for td in (source, refill) for u, i in zip(td["uid"], td["input_ids"][:, 0])}
    top4 = sorted(trained, key=values.get)[-4:]
    picked = [int(x) for x in second["input_ids"][:, 0]]
    assert len(picked) == 16 and sorted(set(picked)) == sorted(ids[u] for u in top4)
    assert all(picked.count(q) == 4 for q in set(picked))
    assert metrics["codapo/sampling/refocus_skipped"] == 0 and metrics["codapo/sampling/selected_questions"] == 4
    fresh = trainer._next_train_batch(num_prompts=3)                     # a second-use refill: fresh prompts
    assert int(fresh["input_ids"][0, 0]) == 30 and trainer._coda_pool is None


def test_codasampling_draws_a_fresh_batch_when_nothing_could_be_refocused_counted_and_resumable(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.global_steps = 1
    trainer._next_train_batch()
    metrics = trainer._refocus({})                                      # none of the pool was trained
    assert metrics["codapo/sampling/refocus_skipped"] == 1 and metrics["codapo/sampling/selected_questions"] == 0
    (tmp_path / "global_step_1").mkdir()
    trainer._save_checkpoint()
    resumed = _trainer(tmp_path)
    resumed.global_steps = 1
    resumed._load_checkpoint()
    for t in (trainer, resumed):
        t.global_steps = 2
        batch = t._next_train_batch()
        assert len(batch) == 16 and t._coda_copies == frozenset()        # a fresh dataloader batch, no copies
    assert trainer.drawn == 32


def test_codasampling_beside_dapo_passes_start_up_with_verls_gen_batch_size():
    from _verl_config import compose_ppo_config

    from verl_oar.cpu.overrides import cpu_overrides
    from verl_oar.integration.validate import check_token_signals_supported

    dapo = ["algorithm.filter_groups.enable=true"]
    for extra in ([], ["data.gen_batch_size=1"]):  # verl sets gen_batch_size=1 under DAPO (and warns on others)
        config = compose_ppo_config(cpu_overrides("/ws", adv_estimator="codapo") + dapo + extra)
        assert "old_log_probs" in [p.name for p in check_token_signals_supported(config, "sync")]
