"""One training step and one validation of the fast runner, in the order of verl's v1 sync trainer.

:class:`FastTrainer` follows ``PPOTrainer._step_once`` (verl 0.9.1, ``verl/trainer/ppo/v1/trainer_base.py``) with
what CPU mode's ``main_ppo`` runs at each stage, called in-process:

1. rollout (``fast_rollout.Rollout``: the hf server's seeded sampler, the testbed's reward);
2. the batch's row order: by content (prompt ids, response ids), then verl's ``_balance_batch`` reordering
   (``calculate_workload`` / ``get_seqlen_balanced_partitions`` over one data-parallel rank). main_ppo's default
   sampler orders rows as their rollouts finished, which differs between any two main_ppo runs; content order is
   what main_ppo trains with the tests' ``ContentOrderedReplayBuffer`` (tests/_e2e.py);
3. old log-probs and entropy (the actor worker's ``compute_log_prob``; OAR-G's importance fused into it when
   ``importance_signal.fuse_into_log_prob`` says so, as ``OARTrainerSync`` does), ``actor/entropy`` with verl's
   ``agg_loss``; OAR-P's importance pass (``importance_signal.compute_token_importance``) after it;
4. advantages: verl's v1 ``compute_advantage_for_multi_trajectories`` (hence ``ADV_ESTIMATOR_REGISTRY``, the
   plugin's estimators included) inside ``signals.provide`` with the token signals padded like
   ``token_level_rewards``; estimator metrics under ``oar/`` and the start-up guards fed, as ``OARTrainerSync``;
5. the actor update (``update_actor`` with the trainer's ``extra_info``), metrics renamed and reduced as verl;
6. the new weights to the rollout server with the step number (``PPOTrainerSync.on_step_end``).

Per-step metrics pass through verl's ``MetricsAggregator`` and ``compute_data_metrics`` as in ``fit``; validation
metrics come from verl's ``_val_metrics_update`` (names ``val-core/<data_source>/acc/mean@1``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from verl_oar.integration import compat
from verl_oar.testbed.fast_actor import (
    UNSUPPORTED, Actor, TrainerView, compute_advantages, estimator_metrics, importance_report, sample_tensors,
    signal_providers,
)
from verl_oar.testbed.fast_rollout import Rollout, Sample

__all__ = ["FastTrainer"]


def padded(rows: torch.Tensor) -> torch.Tensor:
    """A jagged nested (bs, len_i) tensor as TransferQueue's ``to_padded_tensor`` gives it (zeros after each row)."""
    return torch.nested.to_padded_tensor(rows, 0)


class FastTrainer:
    """verl's sync trainer's step and validation on an in-process actor and rollout (module docstring)."""

    def __init__(self, config) -> None:
        from verl.trainer.ppo.utils import need_critic, need_reference_policy

        self.config = config
        if need_reference_policy(config) or need_critic(config):
            raise NotImplementedError(UNSUPPORTED.format(
                what="a reference model (actor.use_kl_loss, algorithm.use_kl_in_reward) or a critic"))
        self.providers, self.importance, self.guards = signal_providers(config)
        oar = config.algorithm.get("oar", None) or {}
        self.rollout = Rollout(config)
        self.actor = Actor(config)
        self.view = TrainerView(config, self.actor)
        self.temperature = config.actor_rollout_ref.rollout.temperature
        self.n = int(config.actor_rollout_ref.rollout.n)
        self.dump_dir = oar.get("dump_dir", "") if self.providers else ""
        self.last_signals = None
        """the last step's ``TokenSignals`` (tensors and artifacts, for dumps and tests)"""
        self.last_batch: dict[str, Any] = {}
        """the last step's batch in training order: keys, samples, padded tensors (tests read it)"""

    # -------------------------------------------------------------------------------------------
    # weights
    # -------------------------------------------------------------------------------------------

    def sync_weights(self, step: int) -> None:
        """The actor's weights to the rollout server, as verl's sync trainer after start-up (0) and each step."""
        self.rollout.load_weights(self.actor.weights(), step)

    # -------------------------------------------------------------------------------------------
    # validation
    # -------------------------------------------------------------------------------------------

    def validate(self, rows: list[dict]) -> dict[str, float]:
        """Greedy rollouts (``val_kwargs``) of ``rows``, scored; verl's validation metrics."""
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer

        uids = [f"val{i}" for i in range(len(rows))]
        samples = self.rollout.rollout(rows, uids, validate=True)
        infos: dict[str, list] = {"reward": [s.score for s in samples]}
        for sample in samples:
            for key, value in sample.reward_extra_info.items():
                infos.setdefault(key, []).append(value)
        sources = [str(s.row["data_source"]) for s in samples]
        expected = {(str(r["data_source"]), u): self.rollout.val_n for r, u in zip(rows, uids, strict=True)}
        # verl's own (it reads nothing of the trainer)
        update = compat.private_attr(PPOTrainer, "verl.trainer.ppo.v1.trainer_base.PPOTrainer._val_metrics_update")
        return update(None, sources, [s.uid for s in samples], infos, [2] * len(samples), expected_acc_counts=expected)

    # -------------------------------------------------------------------------------------------
    # training
    # -------------------------------------------------------------------------------------------

    def train_order(self, samples: list[Sample]) -> list[Sample]:
        """Content order, then verl's ``_balance_batch`` over one data-parallel rank."""
        from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

        mini = int(self.config.actor_rollout_ref.actor.ppo_mini_batch_size) * self.n
        if len(samples) % mini:
            raise NotImplementedError(UNSUPPORTED.format(
                what=f"a batch of {len(samples)} rows, not a multiple of the PPO mini-batch ({mini} rows: verl "
                     "pads it)"))
        ordered = sorted(samples, key=lambda s: (s.prompt_ids, s.response_ids))
        seqlen = torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in ordered], dtype=torch.int64)
        parts = get_seqlen_balanced_partitions(calculate_workload(seqlen), k_partitions=1, equal_size=True)
        return [ordered[j] for part in parts for j in part]

    def step(self, step: int, rows: list[dict]) -> dict[str, Any]:
        """One training step on the dataloader's ``rows``; returns the step's metrics (without validation)."""
        start = time.perf_counter()
        samples = self.rollout.rollout(rows, [f"s{step}p{i}" for i in range(len(rows))], validate=False)
        timing = {"gen": time.perf_counter() - start}
        return self.train_on(step, self.train_order(samples), timing=timing, start=start)

    def train_on(self, step: int, samples: list[Sample], *, timing: dict | None = None, start: float | None = None,
                 sync: bool = True) -> dict[str, Any]:
        """Steps 3-6 on scored ``samples`` in their training order; the step's metrics (``last_batch`` keeps the
        batch). ``sync=False`` leaves the rollout's weights as they were (a replayed step)."""
        from verl.trainer.ppo.v1.utils import MetricsAggregator

        timing = dict(timing or {})
        start = time.perf_counter() if start is None else start
        self.view.global_steps = step
        if any("answer_span" in s.reward_extra_info for s in samples):
            raise NotImplementedError(UNSUPPORTED.format(what="a reward that returns the graded answer's span"))
        metrics: dict[str, Any] = {}
        data = sample_tensors([s.prompt_ids for s in samples], [s.response_ids for s in samples],
                              [s.response_mask for s in samples])
        mask = padded(data["response_mask"])
        rm_scores = torch.zeros(mask.shape, dtype=torch.float32)
        for row, sample in enumerate(samples):
            rm_scores[row, len(sample.response_ids) - 1] = sample.score
        keys = [s.key for s in samples]

        began = time.perf_counter()
        old_log_probs, signal_tensors = self._old_log_prob(step, data, mask, samples, metrics)
        timing["old_log_prob"] = time.perf_counter() - began

        began = time.perf_counter()
        advantages = self._advantages(step, keys, samples, mask, rm_scores, signal_tensors, metrics)
        timing["adv"] = time.perf_counter() - began

        began = time.perf_counter()
        metrics.update(self._update(data, old_log_probs, advantages))
        timing["update_actor"] = time.perf_counter() - began

        aggregator = MetricsAggregator()  # fit's step(): one local update per step
        aggregator.add_step_metrics(metrics, sample_count=len(samples))
        metrics = aggregator.get_aggregated_metrics()
        if sync:
            began = time.perf_counter()
            self.sync_weights(step)
            timing["update_weights"] = time.perf_counter() - began
        timing["step"] = time.perf_counter() - start
        metrics.update(self._data_metrics(data, mask, rm_scores, advantages))
        metrics.update({f"timing_s/{k}": v for k, v in timing.items()})
        self.last_batch = {"keys": keys, "samples": samples, "response_mask": mask, "rm_scores": rm_scores,
                           "advantages": advantages, "old_log_probs": padded(old_log_probs)}
        return metrics

    def _old_log_prob(self, step, data, mask, samples, metrics):
        """``_compute_old_log_prob`` of ``OARTrainerSync``: (old log-probs nested (bs, response_len), the token
        signals padded (bs, T) by field)."""
        from verl.trainer.ppo.core_algos import agg_loss
        from verl.protocol import DataProto
        from verl.utils.debug.metrics import calculate_debug_metrics
        from verl.workers.utils.padding import response_from_nested

        batch = self.view.batch(data)
        batch.extra_info["temperature"] = self.temperature
        fuse = self.importance.fuse if self.importance is not None else None
        fused = fuse is not None and fuse(self.view, batch)
        batch.extra_info.update(calculate_entropy=True, compute_loss=False, temperature=self.temperature)
        began = time.perf_counter()
        output = self.actor.call("compute_log_prob", data, batch.extra_info)
        for key in [k for k in batch.extra_info if str(k).startswith("oar_")]:
            batch.extra_info.pop(key, None)
        signals: dict[str, torch.Tensor] = {}
        if self.importance is not None:
            if fused:
                metrics["oar/fused_log_prob"] = 1.0
                source = output
            else:
                began = time.perf_counter()
                self.importance.compute(self.view, batch, metrics)
                source = batch.output
            metrics["oar/timing_s/token_importance"] = time.perf_counter() - began
            signals = {f: padded(source[f]) for f in self.importance.fields}
            metrics.update(importance_report(self.config, source))
        old_log_probs = response_from_nested(output["log_probs"], data["response_mask"])
        entropy = response_from_nested(output["entropy"], data["response_mask"])
        actor_cfg = self.config.actor_rollout_ref.actor
        metrics["actor/entropy"] = agg_loss(loss_mat=padded(entropy), loss_mask=mask,
                                            loss_agg_mode=actor_cfg.loss_agg_mode,
                                            loss_scale_factor=actor_cfg.loss_scale_factor).detach().item()
        rollout_lp = [s.rollout_log_probs for s in samples]
        if all(lp is not None for lp in rollout_lp):
            from verl_oar.testbed.fast_actor import nested_rows

            debug = DataProto.from_dict(tensors={
                "responses": padded(data["responses"]), "response_mask": mask,
                "old_log_probs": padded(old_log_probs),
                "rollout_log_probs": padded(nested_rows(rollout_lp, torch.float32)),
            })
            metrics.update(calculate_debug_metrics(debug))
        return old_log_probs, signals

    def _advantages(self, step, keys, samples, mask, rm_scores, signal_tensors, metrics) -> torch.Tensor:
        """``_compute_advantage`` of ``OARTrainerSync``: (bs, T) float32 advantages; metrics, guards, dump."""
        advantages, signals = compute_advantages(self.config, step, keys, [s.uid for s in samples], mask, rm_scores,
                                                 signal_tensors)
        if self.providers:
            metrics.update(estimator_metrics(signals.metrics))
            for guard in self.guards:
                metrics.update(guard.observe(step, signals.metrics))
            if self.dump_dir:
                _dump(self.dump_dir, step, keys, samples, mask, signals, advantages)
        self.last_signals = signals
        return advantages

    def _update(self, data, old_log_probs, advantages) -> dict[str, float]:
        """``_update_actor``: one call of the worker's ``update_actor``; its metrics as verl logs them."""
        from verl.utils.metric import reduce_metrics
        from verl.utils.py_functional import rename_dict
        from verl.workers.utils.padding import response_to_nested

        actor = self.config.actor_rollout_ref.actor
        mini = int(actor.ppo_mini_batch_size) * self.n
        extra = {
            "temperature": self.temperature, "compute_loss": False,
            "calculate_entropy": bool(actor.calculate_entropy or actor.entropy_coeff != 0.0),
            "distillation_use_topk": False, "distillation_only": False,
            "global_batch_size": mini, "mini_batch_size": mini, "epochs": actor.ppo_epochs,
            "seed": actor.data_loader_seed, "dataloader_kwargs": {"shuffle": actor.shuffle},
        }
        train = data.copy()
        train["old_log_probs"] = old_log_probs
        train["advantages"] = response_to_nested(advantages, data["response_mask"])
        output = self.actor.call("update_actor", train, extra)
        metrics = rename_dict(output["metrics"], "actor/")
        mfu = metrics.pop("actor/mfu", None)
        if mfu is not None:
            metrics["perf/mfu/actor"] = mfu
        return reduce_metrics(metrics)

    def _data_metrics(self, data, mask, rm_scores, advantages) -> dict[str, float]:
        """verl's ``compute_data_metrics`` on the step's batch (``critic/score/mean``, ``response_length/*``, ...)."""
        from verl.protocol import DataProto
        from verl.trainer.ppo.metric_utils import compute_data_metrics

        prompt_length = data["prompts"].offsets().diff().float()
        response_length = data["responses"].offsets().diff().float()
        batch = DataProto.from_dict(tensors={
            "prompts": padded(data["prompts"]), "responses": padded(data["responses"]), "response_mask": mask,
            "token_level_scores": rm_scores, "token_level_rewards": rm_scores, "advantages": advantages,
            "returns": advantages, "prompt_length": prompt_length, "response_length": response_length,
        }, non_tensors={"__num_turns__": np.full(len(mask), 2, dtype=np.int32)})
        return compute_data_metrics(batch=batch, use_critic=False)


def _dump(dump_dir: str, step: int, keys, samples, mask, signals, advantages) -> None:
    """``integration.dump.dump_step``'s file, from this process's batch (no TransferQueue)."""
    import os

    os.makedirs(dump_dir, exist_ok=True)
    responses = torch.zeros(mask.shape, dtype=torch.int64)
    for row, sample in enumerate(samples):
        responses[row, : len(sample.response_ids)] = torch.tensor(sample.response_ids)
    payload = {"step": step, "keys": list(keys), **signals.tensors, **signals.artifacts,
               "responses": responses, "response_mask": mask, "advantages": advantages,
               "prompts": [list(s.prompt_ids) for s in samples]}
    torch.save({k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in payload.items()},
               os.path.join(dump_dir, f"step_{step}.pt"))
