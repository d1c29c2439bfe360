"""CoDaSampling: every training batch is used twice, the second time rebuilt from its most valuable questions.

verl extension point: the plugin's trainer (``trainer.OARTrainerSync``, a subclass of verl 0.9.1's
``PPOTrainerSync``) carries this mixin; each override calls ``super()`` and does nothing unless the run's
``algorithm.codapo.sampling`` is on (``codapo``, or a token estimator with ``codapo.compose=true``). Checked
against verl 0.9.1 ``trainer/ppo/v1/trainer_base.py``.

- Odd steps (1, 3, ...): a fresh batch from verl's dataloader, trained as usual. After the step
  (:meth:`step`, while its data are still in TransferQueue), every question's value ``v_q`` is computed
  from the step's rewards (``rm_scores``) and ``old_log_probs`` (``core.codapo.question_values``), the
  questions at or above the ``percentile``-quantile are selected, and the next batch is built from them
  (``core.codapo.refocused_order``: each ``repeat_count`` times, cycled to the batch size).
- Even steps: that refocused batch instead of a dataloader fetch (:meth:`_next_train_batch`); every copy
  gets a uid of its own, so each copy's ``n`` responses are a GRPO group of their own.
- Step counts (:meth:`_init_dataloader`): an epoch is ``2 x len(dataset) // train_batch_size`` trainer steps;
  without ``trainer.total_training_steps`` the total doubles with it (and the optimizer's schedule horizon);
  ``trainer.total_training_steps`` set by the user counts trainer steps, i.e. policy updates (each
  dataloader batch gives two). Every step logs ``codapo/sampling/{pass, rollouts, response_tokens, ...}``
  so that runs can be compared with GRPO at equal rollouts or tokens.
- Resume (:meth:`_save_checkpoint` / :meth:`_load_checkpoint`): the pending refocused batch is saved beside
  verl's ``data.pt`` (``SIDECAR``); resuming after an odd step without it stops with the cause.
- DAPO's group filter (``algorithm.filter_groups.enable=true``): verl's replay buffer evicts groups whose rewards
  are all equal and refills with fresh prompts (``_next_train_batch(num_prompts)``), so a first-use step can train
  on few or none of the dataloader batch's questions. The refills of a first-use step are kept beside it (the
  *pool*), and the next batch is refocused on the pool's questions that were trained (every trained group has a
  value); a refill at a second-use step draws fresh prompts, as verl does (``codapo/sampling/refocused_frac``: the
  share of the second pass's trained groups that are refocused copies). When no question can be refocused (none
  of the pool was trained: a custom sampler), the next step draws a fresh batch instead
  (``codapo/sampling/refocus_skipped`` 1) rather than stopping the run.
"""

from __future__ import annotations

import os
import uuid

import torch

from verl_oar.core.codapo import CoDaPOConfig, question_values, refocused_order, select_questions

SIDECAR = "codapo_sampling.pt"
"""the pending refocused batch, in verl's checkpoint folder ``global_step_<n>/``"""
FRESH = "fresh"
"""pending in place of a refocused batch: nothing could be refocused, the next step draws a fresh batch"""


def sampling_config(config) -> CoDaPOConfig | None:
    """The run's CoDaPO config when CoDaSampling is on, else None."""
    from verl_oar.integration.validate import estimator_name

    node = config.algorithm.get("codapo", None)
    if estimator_name(config) != "codapo" and not (node and node.get("compose", False)):
        return None
    cfg = CoDaPOConfig.from_algorithm(config.algorithm)
    return cfg if cfg.sampling else None


class CoDaSamplingMixin:
    """The overrides of CoDaSampling (module docstring); inert unless ``_coda_setup`` found it on."""

    _coda: CoDaPOConfig | None = None
    _coda_pool: list | None = None
    """first-use step: the dataloader batch, then every refill of evicted groups (TensorDicts of prompt rows)"""
    _coda_rows = None
    """pending for the next (second-use) step: the refocused rows, ``FRESH``, or None"""
    _coda_copies: frozenset = frozenset()
    """uids given to the refocused copies of the current second-use step"""

    def _coda_setup(self, config) -> None:
        self._coda = sampling_config(config)

    def _first_use(self) -> bool:
        return self.global_steps % 2 == 1

    def _init_dataloader(self, *args, **kwargs):
        super()._init_dataloader(*args, **kwargs)
        if self._coda is None:
            return
        from omegaconf import OmegaConf, open_dict

        self.steps_per_epoch *= 2
        if self.config.trainer.total_training_steps is None:
            self.total_training_steps *= 2
            horizon = self.total_training_steps * self.parameter_sync_step
            with open_dict(self.config):
                for node in ("actor_rollout_ref.actor.optim", "critic.optim"):
                    if OmegaConf.select(self.config, node):
                        OmegaConf.select(self.config, node).total_training_steps = horizon

    def _next_train_batch(self, num_prompts: int | None = None):
        if self._coda is None:
            return super()._next_train_batch(num_prompts)
        if num_prompts is not None:  # a refill of evicted or failed groups draws fresh rows, as verl
            rows = super()._next_train_batch(num_prompts)
            if self._first_use() and self._coda_pool is not None:
                self._coda_pool.append(rows)  # its trained groups can be refocused too
            return rows
        if self._first_use():
            source = super()._next_train_batch()
            self._coda_pool = [source]
            return source
        from verl.utils import tensordict_utils as tu

        if self._coda_rows is None:
            raise RuntimeError(
                f"CoDaSampling: step {self.global_steps} is a batch's second use but no refocused batch is pending "
                f"(a resume from a checkpoint without {SIDECAR}?). Resume from a checkpoint saved by verl-oar at an "
                "even step, or set +algorithm.codapo.sampling=false.")
        rows, self._coda_rows = self._coda_rows, None
        if isinstance(rows, str) and rows == FRESH:
            self._coda_copies = frozenset()
            return super()._next_train_batch()
        uids = [str(uuid.uuid4()) for _ in range(len(rows))]
        tu.assign_non_tensor_stack(rows, "uid", uids)  # each copy its own group; no "_" (verl's key separator)
        tu.assign_non_tensor_data(rows, "global_steps", self.global_steps)
        self._coda_copies = frozenset(uids)
        return rows

    def step(self, metrics: dict, timing_raw: dict):
        batch = super().step(metrics, timing_raw)
        if self._coda is None:
            return batch
        first = self._first_use()
        values, usage = self._read_step(batch)
        metrics.update({"codapo/sampling/pass": 1.0 if first else 2.0, "codapo/sampling/policy_updates": 1.0, **usage})
        metrics[f"codapo/sampling/{'first' if first else 'second'}_pass_reward"] = metrics.pop("codapo/sampling/reward")
        if first:
            metrics.update(self._refocus(values))
        else:
            metrics["codapo/sampling/refocused_frac"] = sum(u in self._coda_copies for u in values) / max(1, len(values))
        return batch

    def _read_step(self, batch) -> tuple[dict[str, float], dict[str, float]]:
        """(uid -> v_q of this step's trained questions, its rollouts / response tokens / mean reward for the
        equal-compute metrics), from one TransferQueue read; verl's synthetic padding rows left out."""
        import transfer_queue as tq

        from verl_oar.core.groups import group_ids

        keys = [k for k, tag in zip(batch.keys, batch.tags) if not (tag or {}).get("is_padding", False)]
        data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id,
                               select_fields=["rm_scores", "old_log_probs", "response_mask"]).to_padded_tensor()
        uids = [str(k).split("_")[0] for k in keys]  # verl's key {uid}_{session}_{index}
        mask = data["response_mask"].bool()
        rewards = (data["rm_scores"].float() * mask).sum(-1)
        value, _ = question_values(rewards, data["old_log_probs"], mask, group_ids(uids), self._coda.weight_offset)
        usage = {"codapo/sampling/rollouts": float(len(keys)), "codapo/sampling/response_tokens": float(mask.sum()),
                 "codapo/sampling/reward": float(rewards.mean()) if len(rewards) else 0.0}
        return {u: float(v) for u, v in zip(uids, value.tolist())}, usage

    def _refocus(self, values: dict[str, float]) -> dict[str, float]:
        """Select the top questions among this step's trained ones (``values``: uid -> v_q) and keep the refocused
        batch (the size of the dataloader batch) for the next step, or ``FRESH`` when none was trained."""
        from verl.utils import tensordict_utils as tu

        pool, self._coda_pool = self._coda_pool or [], None
        size = len(pool[0]) if pool else 0
        rows = pool[0] if len(pool) == 1 else (tu.concat_tensordict(pool) if pool else None)
        uids = list(rows["uid"]) if rows is not None else []
        trained = [i for i, u in enumerate(uids) if u in values]  # evicted, discarded or unfinished: no value
        if not trained:
            self._coda_rows = FRESH
            return {"codapo/sampling/selected_frac": 0.0, "codapo/sampling/selected_questions": 0.0,
                    "codapo/sampling/repeats_mean": 0.0, "codapo/sampling/refocus_skipped": 1.0}
        chosen = [trained[j] for j in select_questions([values[uids[i]] for i in trained], self._coda.percentile)]
        order = refocused_order(chosen, self._coda.repeat_count, size)
        self._coda_rows = tu.index_select_tensor_dict(rows, order)
        return {"codapo/sampling/selected_frac": len(chosen) / len(trained),
                "codapo/sampling/selected_questions": float(len(chosen)),
                "codapo/sampling/repeats_mean": len(order) / max(1, len(set(order))),
                "codapo/sampling/refocus_skipped": 0.0}

    def _save_checkpoint(self, *args, **kwargs):
        super()._save_checkpoint(*args, **kwargs)
        if self._coda is not None:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            fresh = isinstance(self._coda_rows, str) and self._coda_rows == FRESH
            torch.save({"global_steps": self.global_steps, "rows": None if fresh else self._coda_rows, "fresh": fresh},
                       os.path.join(folder, SIDECAR))

    def _load_checkpoint(self, *args, **kwargs):
        result = super()._load_checkpoint(*args, **kwargs)
        if self._coda is None or self.global_steps == 0:
            return result
        path = self._coda_sidecar_path()
        if path is not None and os.path.exists(path):
            saved = torch.load(path, weights_only=False)
            self._coda_rows = FRESH if saved.get("fresh", False) else saved["rows"]
        elif self.global_steps % 2 == 1:
            raise RuntimeError(f"CoDaSampling: resuming after step {self.global_steps} (a batch's first use) needs the "
                               f"refocused batch saved beside the checkpoint ({SIDECAR}), which is missing. Resume from "
                               "an even step's checkpoint, or set +algorithm.codapo.sampling=false.")
        return result

    def _coda_sidecar_path(self) -> str | None:
        folder = self.config.trainer.default_local_dir
        if self.config.trainer.resume_mode == "resume_path":
            return os.path.join(str(self.config.trainer.resume_from_path), SIDECAR)
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
        return os.path.join(folder, f"global_step_{self.global_steps}", SIDECAR)
