"""CoDaSampling (``codapo_sampling``) through the upstream series' train batch hooks (PR train-batch-hooks,
``verl.trainer.ppo.train_batch_hooks``), on verl's own ``PPOTrainerSync``: no trainer subclass, no private method.

One hooks object serves every token estimator of the process (verl keeps one per estimator name, shared by every
trainer), so each run's :class:`~verl_oar.integration.codapo_sampling.CoDaSampler` lives on the trainer object
(attribute ``STATE_ATTR``), made on first use from ``trainer.config``; it is None, and every hook is verl's default,
unless ``algorithm.codapo`` turns sampling on (``codapo``, or a token estimator with ``codapo.compose=true``).

| the mixin on verl 0.9.1 (``CoDaSamplingMixin``) | these hooks |
|---|---|
| ``_init_dataloader``: steps per epoch x2 (total and optimizer horizon x2 when unset) | ``steps_per_epoch`` x2 (verl derives the total and the horizon) |
| ``_next_train_batch`` | ``build_train_batch`` (``trainer.fetch_train_batch`` is the dataloader) |
| ``step``: read the step, refocus, ``codapo/sampling/*`` | ``after_step`` |
| ``_save_checkpoint`` / ``_load_checkpoint``: ``codapo_sampling.pt`` | ``state_dict`` / ``load_state_dict``: verl's ``trainer_state.pt`` |
"""

from __future__ import annotations

from verl_oar.integration.codapo_sampling import CoDaSampler, sampling_config

STATE_ATTR = "verl_oar_codapo_sampler"
"""the trainer attribute holding the run's sampler (None: sampling off)"""
CHECKPOINT_FILE = "trainer_state.pt"
"""where verl saves the hooks' state (``PPOTrainer.state_dict``), named in the resume error"""


def sampler(trainer) -> CoDaSampler | None:
    """The run's sampler, made on first use (None unless sampling is on)."""
    if STATE_ATTR not in vars(trainer):
        cfg = sampling_config(trainer.config)
        setattr(trainer, STATE_ATTR, CoDaSampler(cfg, CHECKPOINT_FILE) if cfg is not None else None)
    return vars(trainer)[STATE_ATTR]


_CLASS: list = []


def hooks_class():
    """:class:`CoDaSamplingHooks` over verl's ``TrainBatchHooks`` (built on first use: verl must have PR train-batch-hooks)."""
    if _CLASS:
        return _CLASS[0]
    from verl.trainer.ppo.train_batch_hooks import TrainBatchHooks

    class CoDaSamplingHooks(TrainBatchHooks):
        """CoDaSampling's schedule at verl's train batch hooks (module docstring); verl's defaults when off."""

        verl_oar_codapo_sampling = True
        """marks the plugin's hooks (``upstream_hook.install`` registers one object, once)"""

        def steps_per_epoch(self, trainer, steps_per_epoch: int) -> int:
            return 2 * steps_per_epoch if sampler(trainer) is not None else steps_per_epoch

        def build_train_batch(self, trainer, num_prompts):
            run = sampler(trainer)
            if run is None:
                return trainer.fetch_train_batch(num_prompts)
            return run.build(int(trainer.global_steps), num_prompts, trainer.fetch_train_batch)

        def after_step(self, trainer, batch, metrics: dict) -> None:
            run = sampler(trainer)
            if run is not None:
                run.after_step(int(trainer.global_steps), batch, metrics)

        def state_dict(self, trainer) -> dict:
            run = sampler(trainer)
            if run is None:
                return {}
            state = run.state(int(trainer.global_steps))
            return state if state["fresh"] or state["rows"] is not None else {}  # after a second use: nothing pending

        def load_state_dict(self, trainer, state: dict) -> None:
            run = sampler(trainer)
            if run is not None:
                run.load(int(trainer.global_steps), state or None)

    CoDaSamplingHooks.__module__ = __name__
    _CLASS.append(CoDaSamplingHooks)
    return CoDaSamplingHooks
