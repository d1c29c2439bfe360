"""CoDaSampling: every training batch is used twice, the second time rebuilt from its most valuable questions.

The schedule itself is :class:`CoDaSampler` (per-run state: the first use's pool, the pending refocused rows, the
copies' uids), driven through one of two verl extension points:

- verl 0.9.1: the plugin's trainer (``trainer.OARTrainerSync``, a subclass of verl's ``PPOTrainerSync``) carries
  :class:`CoDaSamplingMixin`; each override calls ``super()`` and does nothing unless the run's
  ``algorithm.codapo.sampling`` is on (``codapo``, or a token estimator with ``codapo.compose=true``). Checked
  against verl 0.9.1 ``trainer/ppo/v1/trainer_base.py``; the four private methods it overrides are named in
  ``compat.PRIVATE_NAMES`` and reached through ``compat.private_overrides``.
- a verl with the upstream PR train-batch-hooks: ``codapo_train_batch_hooks`` drives the same
  sampler from verl's public ``TrainBatchHooks`` (the pending rows in verl's ``trainer_state.pt``).

- Odd steps (1, 3, ...): a fresh batch from verl's dataloader, trained as usual. After the step
  (:meth:`CoDaSampler.after_step`, while its data are still in TransferQueue), every question's value ``v_q`` is computed
  from the step's rewards (``rm_scores``) and ``old_log_probs`` (``core.codapo.question_values``), the
  questions at or above the ``percentile``-quantile are selected, and the next batch is built from them
  (``core.codapo.refocused_order``: each ``repeat_count`` times, cycled to the batch size).
- Even steps: that refocused batch instead of a dataloader fetch (:meth:`CoDaSampler.build`); every copy
  gets a uid of its own, so each copy's ``n`` responses are a GRPO group of their own.
- Step counts (``steps_per_epoch`` x2): an epoch is ``2 x len(dataset) // train_batch_size`` trainer steps;
  without ``trainer.total_training_steps`` the total doubles with it (and the optimizer's schedule horizon);
  ``trainer.total_training_steps`` set by the user counts trainer steps, i.e. policy updates (each
  dataloader batch gives two). Every step logs ``codapo/sampling/{pass, rollouts, response_tokens, ...}``
  so that runs can be compared with GRPO at equal rollouts or tokens.
- Resume (:meth:`CoDaSampler.state` / :meth:`CoDaSampler.load`): the pending refocused batch is saved beside
  verl's ``data.pt`` (``SIDECAR``, or verl's ``trainer_state.pt`` through the hooks); resuming after an odd step
  without it stops with the cause.
- DAPO's group filter (``algorithm.filter_groups.enable=true``): verl's replay buffer evicts groups whose rewards
  are all equal and refills with fresh prompts (``num_prompts`` set), so a first-use step can train
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


class CoDaSampler:
    """One run's CoDaSampling (module docstring), whatever verl seam drives it.

    ``fetch(num_prompts)`` is verl's dataloader fetch (``num_prompts`` None: a step's batch); ``step`` is verl's
    ``global_steps`` when the batch is built (odd: a batch's first use)."""

    def __init__(self, cfg: CoDaPOConfig, checkpoint_file: str = SIDECAR):
        self.cfg = cfg
        self.checkpoint_file = checkpoint_file
        """where the pending rows are saved (named in the resume error)"""
        self.pool: list | None = None
        """first-use step: the dataloader batch, then every refill of evicted groups (TensorDicts of prompt rows)"""
        self.rows = None
        """pending for the next (second-use) step: the refocused rows, ``FRESH``, or None"""
        self.copies: frozenset = frozenset()
        """uids given to the refocused copies of the current second-use step"""

    def build(self, step: int, num_prompts: int | None, fetch):
        """The prompts of step ``step`` (``num_prompts`` None) or a refill of ``num_prompts`` (TensorDict)."""
        first = step % 2 == 1
        if num_prompts is not None:  # a refill of evicted or failed groups draws fresh rows, as verl
            rows = fetch(num_prompts)
            if first and self.pool is not None:
                self.pool.append(rows)  # its trained groups can be refocused too
            return rows
        if first:
            source = fetch(None)
            self.pool = [source]
            return source
        from verl.utils import tensordict_utils as tu

        if self.rows is None:
            raise RuntimeError(
                f"CoDaSampling: step {step} is a batch's second use but no refocused batch is pending "
                f"(a resume from a checkpoint without {self.checkpoint_file}?). Resume from a checkpoint saved by "
                "verl-oar at an even step, or set +algorithm.codapo.sampling=false.")
        rows, self.rows = self.rows, None
        if isinstance(rows, str) and rows == FRESH:
            self.copies = frozenset()
            return fetch(None)
        uids = [str(uuid.uuid4()) for _ in range(len(rows))]
        tu.assign_non_tensor_stack(rows, "uid", uids)  # each copy its own group; no "_" (verl's key separator)
        tu.assign_non_tensor_data(rows, "global_steps", step)
        self.copies = frozenset(uids)
        return rows

    def after_step(self, step: int, batch, metrics: dict) -> None:
        """At the end of step ``step`` (its rows still in TransferQueue): the ``codapo/sampling/*`` metrics and, after
        a first use, the refocused batch for the next step."""
        first = step % 2 == 1
        values, usage = read_step(batch, self.cfg)
        metrics.update({"codapo/sampling/pass": 1.0 if first else 2.0, "codapo/sampling/policy_updates": 1.0, **usage})
        metrics[f"codapo/sampling/{'first' if first else 'second'}_pass_reward"] = metrics.pop("codapo/sampling/reward")
        if first:
            metrics.update(self.refocus(values))
        else:
            metrics["codapo/sampling/refocused_frac"] = sum(u in self.copies for u in values) / max(1, len(values))

    def refocus(self, values: dict[str, float]) -> dict[str, float]:
        """Select the top questions among this step's trained ones (``values``: uid -> v_q) and keep the refocused
        batch (the size of the dataloader batch) for the next step, or ``FRESH`` when none was trained."""
        from verl.utils import tensordict_utils as tu

        pool, self.pool = self.pool or [], None
        size = len(pool[0]) if pool else 0
        rows = pool[0] if len(pool) == 1 else (tu.concat_tensordict(pool) if pool else None)
        uids = list(rows["uid"]) if rows is not None else []
        trained = [i for i, u in enumerate(uids) if u in values]  # evicted, discarded or unfinished: no value
        if not trained:
            self.rows = FRESH
            return {"codapo/sampling/selected_frac": 0.0, "codapo/sampling/selected_questions": 0.0,
                    "codapo/sampling/repeats_mean": 0.0, "codapo/sampling/refocus_skipped": 1.0}
        chosen = [trained[j] for j in select_questions([values[uids[i]] for i in trained], self.cfg.percentile)]
        order = refocused_order(chosen, self.cfg.repeat_count, size)
        self.rows = tu.index_select_tensor_dict(rows, order)
        return {"codapo/sampling/selected_frac": len(chosen) / len(trained),
                "codapo/sampling/selected_questions": float(len(chosen)),
                "codapo/sampling/repeats_mean": len(order) / max(1, len(set(order))),
                "codapo/sampling/refocus_skipped": 0.0}

    def state(self, step: int) -> dict:
        """What a checkpoint after step ``step`` keeps: the pending rows (None after a second use), or ``fresh``."""
        fresh = isinstance(self.rows, str) and self.rows == FRESH
        return {"global_steps": step, "rows": None if fresh else self.rows, "fresh": fresh}

    def load(self, step: int, saved: dict | None) -> None:
        """Resume after step ``step`` from :meth:`state`'s dict (None: the checkpoint has none; after an odd step
        that stops the run with the cause, after an even step nothing is pending)."""
        if saved:
            self.rows = FRESH if saved.get("fresh", False) else saved["rows"]
        elif step % 2 == 1:
            raise RuntimeError(f"CoDaSampling: resuming after step {step} (a batch's first use) needs the refocused "
                               f"batch saved beside the checkpoint ({self.checkpoint_file}), which is missing. Resume "
                               "from an even step's checkpoint, or set +algorithm.codapo.sampling=false.")


def read_step(batch, cfg: CoDaPOConfig) -> tuple[dict[str, float], dict[str, float]]:
    """(uid -> v_q of this step's trained questions, its rollouts / response tokens / mean reward for the
    equal-compute metrics), from one TransferQueue read of ``batch`` (verl's ``KVBatchMeta``); verl's synthetic
    padding rows left out."""
    import transfer_queue as tq

    from verl_oar.core.groups import group_ids

    keys = [k for k, tag in zip(batch.keys, batch.tags) if not (tag or {}).get("is_padding", False)]
    data = tq.kv_batch_get(keys=keys, partition_id=batch.partition_id,
                           select_fields=["rm_scores", "old_log_probs", "response_mask"]).to_padded_tensor()
    uids = [str(k).split("_")[0] for k in keys]  # verl's key {uid}_{session}_{index}
    mask = data["response_mask"].bool()
    rewards = (data["rm_scores"].float() * mask).sum(-1)
    value, _ = question_values(rewards, data["old_log_probs"], mask, group_ids(uids), cfg.weight_offset,
                               cfg.right_threshold)
    usage = {"codapo/sampling/rollouts": float(len(keys)), "codapo/sampling/response_tokens": float(mask.sum()),
             "codapo/sampling/reward": float(rewards.mean()) if len(rewards) else 0.0}
    return {u: float(v) for u, v in zip(uids, value.tolist())}, usage


def _sampler_attr(name: str):
    """A mixin attribute stored on its :class:`CoDaSampler` (``_coda_rows`` -> ``sampler.rows``)."""

    def get(self):
        sampler = self.__dict__.get("_coda_sampler")
        return getattr(sampler, name) if sampler is not None else (frozenset() if name == "copies" else None)

    def set_(self, value):
        setattr(self._coda_sampler, name, value)

    return property(get, set_)


class _CoDaSamplingOverrides:
    """:class:`CoDaSamplingMixin`'s overrides of verl's trainer, under public names; ``compat.private_overrides``
    binds them to verl's private method names (``compat.PRIVATE_NAMES``: needed only without the series)."""

    _coda: CoDaPOConfig | None = None
    _coda_pool = _sampler_attr("pool")
    _coda_rows = _sampler_attr("rows")
    _coda_copies = _sampler_attr("copies")

    def _coda_setup(self, config) -> None:
        self._coda = sampling_config(config)
        self._coda_sampler = CoDaSampler(self._coda) if self._coda is not None else None

    def _first_use(self) -> bool:
        return self.global_steps % 2 == 1

    def coda_init_dataloader(self, base, *args, **kwargs):
        base(self, *args, **kwargs)
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

    def coda_next_train_batch(self, base, num_prompts: int | None = None):
        if self._coda is None:
            return base(self, num_prompts)
        return self._coda_sampler.build(self.global_steps, num_prompts,
                                        lambda n: base(self, n) if n is not None else base(self))

    def step(self, metrics: dict, timing_raw: dict):
        batch = super().step(metrics, timing_raw)
        if self._coda is not None:
            self._coda_sampler.after_step(self.global_steps, batch, metrics)
        return batch

    def _read_step(self, batch) -> tuple[dict[str, float], dict[str, float]]:
        return read_step(batch, self._coda)

    def _refocus(self, values: dict[str, float]) -> dict[str, float]:
        return self._coda_sampler.refocus(values)

    def coda_save_checkpoint(self, base, *args, **kwargs):
        base(self, *args, **kwargs)
        if self._coda is not None:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            torch.save(self._coda_sampler.state(self.global_steps), os.path.join(folder, SIDECAR))

    def coda_load_checkpoint(self, base, *args, **kwargs):
        result = base(self, *args, **kwargs)
        if self._coda is None or self.global_steps == 0:
            return result
        path = self._coda_sidecar_path()
        saved = torch.load(path, weights_only=False) if path is not None and os.path.exists(path) else None
        self._coda_sampler.load(self.global_steps, saved)
        return result

    def _coda_sidecar_path(self) -> str | None:
        folder = self.config.trainer.default_local_dir
        if self.config.trainer.resume_mode == "resume_path":
            return os.path.join(str(self.config.trainer.resume_from_path), SIDECAR)
        if not os.path.isabs(folder):
            folder = os.path.join(os.getcwd(), folder)
        return os.path.join(folder, f"global_step_{self.global_steps}", SIDECAR)


def _mixin():
    from verl_oar.integration import compat

    return compat.private_overrides(_CoDaSamplingOverrides, "CoDaSamplingMixin", {
        "verl.trainer.ppo.v1.trainer_base.PPOTrainer._init_dataloader": "coda_init_dataloader",
        "verl.trainer.ppo.v1.trainer_base.PPOTrainer._next_train_batch": "coda_next_train_batch",
        "verl.trainer.ppo.v1.trainer_base.PPOTrainer._save_checkpoint": "coda_save_checkpoint",
        "verl.trainer.ppo.v1.trainer_base.PPOTrainer._load_checkpoint": "coda_load_checkpoint",
    })


def __getattr__(name: str):
    # built on first use (trainer.py imports it inside the trainer factory): only a verl without the series needs it
    if name == "CoDaSamplingMixin":
        if "CoDaSamplingMixin" not in _BUILT:
            _BUILT["CoDaSamplingMixin"] = _mixin()
        return _BUILT["CoDaSamplingMixin"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_BUILT: dict = {}
