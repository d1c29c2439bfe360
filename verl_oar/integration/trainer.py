"""The trainer hook: compute token signals after old-log-probs, hand them to the estimator.

verl extension point: the v1 trainer registry (``verl.trainer.ppo.v1.trainer_base.TRAINER_REGISTRY``,
read by ``get_trainer_cls``). ``python -m verl.trainer.main_ppo`` builds ``TRAINER_REGISTRY[mode](config=...)``
(``mode = trainer.v1.trainer_mode``, default ``sync``). So that ``algorithm.adv_estimator=oar_g`` works with
no other flag, each registry entry becomes a *dispatcher*: a class whose construction looks at the
configuration and returns

- for an estimator that needs no token signal (grpo, gae, ...): an instance of verl's own class,
  built exactly as verl would (``type(trainer) is PPOTrainerSync``); when the run grades with verl-oar's math
  reward, verl's class plus ``grading.GradingMixin`` (ungraded answers counted and left out of the update);
- for a token-level estimator under ``sync``: ``OARTrainerSync``, verl's ``PPOTrainerSync`` plus three
  overridden methods that call ``super()`` (and CoDaSampling's, ``codapo_sampling``, inert unless on; and ``fit``,
  which names lost ranks and nodes when a run fails after losing them, ``lost_workers``);
- for a token-level estimator under any other mode: a start-up refusal (``validate``).

verl's legacy trainer (``trainer.use_v1=false``) has no registry: ``main_ppo_v0`` builds
``RayPPOTrainer(...)`` by the name it imported. That name, in ``main_ppo_v0`` only, becomes the same
kind of dispatcher (mode ``legacy``): verl's ``RayPPOTrainer`` object for every non-token run, a
start-up refusal for a token-level estimator; ``verl.trainer.ppo.ray_trainer.RayPPOTrainer`` itself is
untouched. The dispatchers are installed when verl imports ``verl.trainer.ppo.v1`` or
``verl.trainer.main_ppo_v0`` (``plugin``), checked against verl 0.9.1 (``compat``).
"""

from __future__ import annotations

import time

from verl_oar.integration.grading import GradingMixin, grades_answers, max_ungraded_frac
from verl_oar.integration.validate import LEGACY, check_token_signals_supported, estimator_name

__all__ = ["LEGACY", "OAR_TRAINERS", "check_token_signals_supported", "install_legacy_guard", "install_trainer_hook"]

OAR_TRAINERS: dict = {}
GRADED_TRAINERS: dict = {}
"""trainer mode -> verl's class plus ``grading.GradingMixin``, for a non-token estimator graded by verl-oar's
math reward (any v1 mode)"""
OWN_PREFIXES = ("cscr/", "oppo/", "acpo/", "codapo/")
"""estimator metrics logged under their method's own prefix; every other key goes under ``oar/``"""
"""trainer mode -> the class built for a token-level estimator (only ``sync``)"""


def install_trainer_hook() -> None:
    """Replace each entry of verl's v1 trainer registry by a dispatcher on the config. Idempotent."""
    from verl_oar.integration import compat

    registry = compat.trainer_registry()
    for mode, cls in list(registry.items()):
        if getattr(cls, "_verl_oar_dispatch", False):
            continue
        registry[mode] = _dispatcher(cls, mode)


def install_legacy_guard(main_ppo_v0) -> None:
    """Make ``main_ppo_v0.RayPPOTrainer`` (the name its TaskRunner constructs) a dispatcher. Idempotent."""
    cls = main_ppo_v0.RayPPOTrainer
    if not getattr(cls, "_verl_oar_dispatch", False):
        main_ppo_v0.RayPPOTrainer = _dispatcher(cls, LEGACY)


def verl_trainer_cls(mode: str):
    """verl's own class for trainer mode ``mode`` (behind the dispatcher, if installed)."""
    from verl_oar.integration import compat

    cls = compat.trainer_registry()[mode]
    return getattr(cls, "_verl_cls", cls)


def _dispatcher(cls, mode: str):
    """A registry entry standing for verl's ``cls``: constructing it returns verl's ``cls`` instance for
    non-token estimators and the OAR trainer (or a refusal) for token-level ones.

    It subclasses ``cls`` only so that registry checks (``issubclass(.., PPOTrainer)``) and class
    attributes still see verl's class; no instance of it is ever made: ``__new__`` returns an object
    of another class, so Python does not call ``__init__`` on it again."""

    def __new__(klass, *args, **kwargs):
        config = kwargs["config"] if "config" in kwargs else args[0]
        if not check_token_signals_supported(config, mode):
            if mode == LEGACY or not grades_answers(config):
                return cls(*args, **kwargs)
            max_ungraded_frac(config)    # a bad limit stops the run here, before any worker is built
            if mode not in GRADED_TRAINERS:
                GRADED_TRAINERS[mode] = type(cls.__name__, (GradingMixin, cls), {"__module__": __name__})
            return GRADED_TRAINERS[mode](*args, **kwargs)
        if mode not in OAR_TRAINERS:
            OAR_TRAINERS[mode] = _oar_trainer_sync(cls)
        return OAR_TRAINERS[mode](*args, **kwargs)

    return type(cls.__name__, (cls,), {
        "__new__": __new__, "__module__": __name__, "__doc__": _dispatcher.__doc__,
        "_verl_oar_dispatch": True, "_verl_cls": cls,
    })


def _oar_trainer_sync(base):
    """Build ``OARTrainerSync`` over verl's ``PPOTrainerSync`` (imported lazily: it is heavy)."""
    import transfer_queue as tq

    from verl_oar.integration.codapo_sampling import CoDaSamplingMixin
    from verl_oar.integration.dump import dump_step
    from verl_oar.integration.lost_workers import LostWorkerMixin
    from verl_oar.integration.signals import TokenSignals, provide, real_rows, session_final_rows

    class OARTrainerSync(LostWorkerMixin, GradingMixin, CoDaSamplingMixin, base):
        """verl's sync trainer, plus token signals for estimators that declare them (and CoDaSampling); a run that
        fails after losing a rank's worker or node names them (``lost_workers``)."""

        def __init__(self, config, *args, **kwargs):
            self._token_signals = check_token_signals_supported(config, "sync")
            if grades_answers(config):
                max_ungraded_frac(config)
            if self._token_signals:  # the pass's memory per GPU (memory_check); a bad VERL_OAR_MEMORY_CHECK stops
                from verl_oar.integration.memory_check import check_action, log_startup_estimate

                check_action()
                log_startup_estimate(config)
            self._coda_setup(config)
            self._guards = [p.guard(config) for p in self._token_signals if p.guard is not None]
            super().__init__(config, *args, **kwargs)

        def _init_resource_pool_mgr(self):
            super()._init_resource_pool_mgr()
            if self._token_signals:
                from verl_oar.integration.worker import with_oar_worker

                ref_scores = (self.config.algorithm.get("oar", None) or {}).get("importance_model", "actor") == "ref"
                with_oar_worker(self.role_worker_mapping, estimator_name(self.config), ref_scores=ref_scores)
                from verl_oar.integration.memory_check import attach_memory_check

                attach_memory_check(self.config)  # what each worker compares with its GPU once its models are built
                for provider in self._token_signals:
                    if provider.attach is not None:
                        provider.attach(self.config)

        def _compute_old_log_prob(self, batch, metrics):
            for provider in self._token_signals:
                if provider.prepare is not None:
                    provider.prepare(self, batch)
            fused = {p.name for p in self._token_signals if p.fuse is not None and p.fuse(self, batch)}
            started = time.perf_counter()
            try:
                batch = super()._compute_old_log_prob(batch, metrics)
            finally:
                for key in [k for k in batch.extra_info if str(k).startswith("oar_")]:
                    batch.extra_info.pop(key, None)
            if fused:  # the signals came with the log-prob pass: report that pass's time
                metrics["oar/fused_log_prob"] = 1.0
                for name in fused:
                    metrics[f"oar/timing_s/{name}"] = time.perf_counter() - started
            for provider in self._token_signals:
                if provider.name in fused:
                    continue
                started = time.perf_counter()
                provider.compute(self, batch, metrics)
                metrics[f"oar/timing_s/{provider.name}"] = time.perf_counter() - started
            for provider in self._token_signals:
                if provider.report is not None:
                    metrics.update(provider.report(self, batch))
            return batch

        def _compute_advantage(self, batch, metrics):
            if not self._token_signals:
                return super()._compute_advantage(batch, metrics)
            fields = [f for p in self._token_signals for f in p.fields]
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            padded = data.to_padded_tensor()
            signals = TokenSignals(
                tensors={f: padded[f] for f in fields}, step=int(self.global_steps),
                real_rows=real_rows(batch.tags), session_final=session_final_rows(batch.keys),
            )
            with provide(signals):
                batch = super()._compute_advantage(batch, metrics)
            metrics.update({k if k.startswith(OWN_PREFIXES) else f"oar/{k}": v for k, v in signals.metrics.items()})
            for guard in self._guards:
                metrics.update(guard.observe(int(self.global_steps), signals.metrics))
            dump_dir = self.config.algorithm.get("oar", {}).get("dump_dir", "")
            if dump_dir:
                dump_step(dump_dir, int(self.global_steps), batch, signals)
            return batch

    OARTrainerSync.__module__ = __name__
    OARTrainerSync.__qualname__ = "OARTrainerSync"
    return OARTrainerSync
