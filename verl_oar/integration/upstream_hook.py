"""verl-oar through the seams of verl's upstream patch series (``upstream/verl-0.9.1/``, one folder per pull request, docs/upstream.md),
when the installed verl has them: the plugin then registers its estimators and signal providers through
verl's public API and neither subclasses verl's trainer nor touches its trainer registry.

The seams, each detected on its own (:func:`seams`):

- ``verl.trainer.ppo.core_algos.register_adv_est(name, extra_fields=...)``: the OAR estimators declare
  their providers' TransferQueue fields; verl's ``_compute_advantage`` fetches them, pads them like
  ``token_level_rewards`` and passes them as keyword arguments, which every estimator registered with
  ``token_estimator.register_estimator`` puts into the current signals (``signals.keyword_signals``);
- ``verl.trainer.ppo.advantage_hooks.register_advantage_hooks(name, hooks)``: :class:`_TokenSignalHooks`
  does what ``trainer.OARTrainerSync`` does in its overrides: start-up checks and guards (``validate``,
  which refuses the legacy trainer and the async modes too), the OAR worker class (``configure_workers``),
  the providers around the old-log-prob pass (``before_old_log_prob`` / ``after_old_log_prob``: prepare,
  fuse, compute, report, timing) and the per-step state, metrics, guards and dump around the estimator
  (``advantage_context``), including the fields of an active composer (``codapo.compose``: ``old_log_probs`` and
  ``rm_scores``, read from TransferQueue like the plugin's trainer does);
- ``verl.trainer.ppo.train_batch_hooks.register_train_batch_hooks(name, hooks)`` (PR train-batch-hooks): CoDaSampling
  (``codapo_train_batch_hooks``) for ``codapo`` and every token estimator (composed), inert unless sampling is on;
  without it sampling is refused at start-up (it needs the plugin's trainer);
- ``verl.workers.engine.logits_reducers`` (PR logits-reducers): ACPO's modal surrogate as verl's logits reducer
  (``engines.fsdp.logits_reducer``, requested by ``modal_signal.prepare_acpo``) instead of the worker wrapping the
  engine's method;
- ``RolloutReplica.server_handle`` / ``server_address`` setters (PR replica-servers): CPU mode's hf replica publishes
  its server through them (``cpu/hf_rollout.py``);
- ``PPOTrainer.balance_batch`` (PR balance-batch): CSCR / OPPO balance their re-scoring batch with it
  (``privileged_signal``).

Through these seams the plugin touches no private verl name (``compat.PRIVATE_NAMES``: each is needed only without
one of the patches; ``compat.ACCESS_LOG`` records any that is touched).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

_INSTALLED: dict = {}
"""estimator name -> the hooks object registered for it in this process (install() is idempotent)"""


def available() -> bool:
    """True when the imported verl offers the upstream series' advantage hooks (PR advantage-hooks)."""
    try:
        from verl.trainer.ppo import advantage_hooks, core_algos
    except ImportError:
        return False
    return hasattr(core_algos, "get_adv_estimator_extra_fields") and hasattr(advantage_hooks, "register_advantage_hooks")


def train_batch_hooks_available() -> bool:
    """True when the imported verl has the train batch hooks (PR train-batch-hooks)."""
    try:
        from verl.trainer.ppo import train_batch_hooks
    except ImportError:
        return False
    return hasattr(train_batch_hooks, "register_train_batch_hooks")


def balance_batch_available() -> bool:
    """True when verl's v1 trainer has the public ``balance_batch`` (PR ``balance-batch``)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    return callable(getattr(PPOTrainer, "balance_batch", None))


def replica_setters_available() -> bool:
    """True when verl's ``RolloutReplica.server_handle`` / ``server_address`` have setters (PR ``replica-servers``;
    CPU mode's hf replica checks the same in ``cpu/hf_rollout.py``, which may not import this package)."""
    from verl.workers.rollout.replica import RolloutReplica

    return all(isinstance(getattr(RolloutReplica, name, None), property) and getattr(RolloutReplica, name).fset
               for name in ("server_handle", "server_address"))


def seams() -> dict[str, bool]:
    """Which PRs of the series the imported verl has, by seam: ``advantage_hooks`` (advantage-hooks),
    ``train_batch_hooks``, ``logits_reducers``, ``replica_servers``, ``balance_batch``."""
    from verl_oar.engines.fsdp import logits_reducer

    return {"advantage_hooks": available(), "train_batch_hooks": train_batch_hooks_available(),
            "logits_reducers": logits_reducer.available(), "replica_servers": replica_setters_available(),
            "balance_batch": balance_batch_available()}


def uses_logits_reducers() -> bool:
    """True when runs go through the advantage hooks and verl has logits reducers: ACPO's modal pass is then verl's
    reducer (the plugin's trainer, without PR advantage-hooks, keeps the worker's wrapper)."""
    from verl_oar.engines.fsdp import logits_reducer

    return available() and logits_reducer.available()


def install() -> None:
    """Register OAR through verl's hooks (only called when :func:`available`). Idempotent."""
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.advantage_hooks import get_advantage_hooks, register_advantage_hooks

    from verl_oar.integration.signals import ESTIMATOR_NEEDS, needed_signals

    if train_batch_hooks_available():
        from verl.trainer.ppo.train_batch_hooks import get_train_batch_hooks, register_train_batch_hooks

        from verl_oar.integration.codapo_train_batch_hooks import hooks_class

        shared = next((h for h in map(get_train_batch_hooks, ESTIMATOR_NEEDS)
                       if getattr(h, "verl_oar_codapo_sampling", False)), None) or hooks_class()()
        for name in ESTIMATOR_NEEDS:
            if get_train_batch_hooks(name) is not shared:
                register_train_batch_hooks(name, shared)
    for name in ESTIMATOR_NEEDS:
        fields = tuple(f for provider in needed_signals(name) for f in provider.fields)
        # the same function again, now declaring its fields (verl allows re-registering the same function)
        core_algos.register_adv_est(name, extra_fields=fields)(core_algos.get_adv_estimator_fn(name))
        existing = get_advantage_hooks(name)
        if getattr(existing, "_verl_oar_estimator", None) == name:
            continue  # this module imported twice (or by file path): the first registration stands
        register_advantage_hooks(name, _hooks_class()(name))
        _INSTALLED[name] = get_advantage_hooks(name)


_HOOKS_CLASS: list = []


def _hooks_class():
    """``_TokenSignalHooks`` over verl's ``AdvantageHooks`` (built on first use: verl must have the series)."""
    if _HOOKS_CLASS:
        return _HOOKS_CLASS[0]
    from verl.trainer.ppo.advantage_hooks import AdvantageHooks

    class _TokenSignalHooks(AdvantageHooks):
        """Computes the token signals an OAR estimator needs, at verl's advantage hooks."""

        def __init__(self, estimator: str):
            self._verl_oar_estimator = estimator
            self.providers: tuple = ()
            self.guards: list = []
            self._fused: set = set()
            self._started = 0.0
            self._announced = False

        def validate(self, config, trainer_mode: str) -> None:
            from verl_oar.integration.validate import LEGACY, check_token_signals_supported

            mode = LEGACY if trainer_mode == "legacy" else trainer_mode
            self.providers = check_token_signals_supported(config, mode)
            from verl_oar.integration.codapo_sampling import sampling_config

            if sampling_config(config) is not None and not train_batch_hooks_available():
                raise ValueError("CoDaSampling (algorithm.codapo.sampling) needs verl's train batch hooks (the upstream "
                                 "series' PR train-batch-hooks), which this verl lacks (it has PR advantage-hooks, so "
                                 "verl-oar's own trainer is not used). Apply the whole series (upstream/apply.sh), or set "
                                 "+algorithm.codapo.sampling=false (CoDaPO's weighting alone).")
            if self.providers:  # the pass's memory per GPU (memory_check), as the plugin trainer: a bad value stops
                from verl_oar.integration.memory_check import check_action, log_startup_estimate

                check_action()
                log_startup_estimate(config)
            self.guards = [p.guard(config) for p in self.providers if p.guard is not None]

        def configure_workers(self, role_worker_mapping: dict, config) -> None:
            from verl_oar.integration.worker import with_oar_worker

            ref_scores = (config.algorithm.get("oar", None) or {}).get("importance_model", "actor") == "ref"
            with_oar_worker(role_worker_mapping, self._verl_oar_estimator, ref_scores=ref_scores)
            from verl_oar.integration.memory_check import attach_memory_check

            attach_memory_check(config)  # what each worker compares with its GPU once its models are built
            for provider in self.providers:
                if provider.attach is not None:
                    provider.attach(config)

        def before_old_log_prob(self, trainer, batch, metrics: dict) -> None:
            if not self._announced:  # once per run: which trainer runs the signals (the e2e test reads it)
                cls = type(trainer)
                print(f"[verl-oar] token signals through verl's advantage hooks in {cls.__module__}.{cls.__qualname__}",
                      flush=True)
                self._announced = True
            for provider in self.providers:
                if provider.prepare is not None:
                    provider.prepare(trainer, batch)
            self._fused = {p.name for p in self.providers if p.fuse is not None and p.fuse(trainer, batch)}
            self._started = time.perf_counter()

        def after_old_log_prob(self, trainer, batch, metrics: dict) -> None:
            from verl_oar.engines.fsdp.logits_reducer import MODAL_KEY, REQUEST_KEY

            for key in [k for k in batch.extra_info if str(k).startswith("oar_")]:
                batch.extra_info.pop(key, None)
            if MODAL_KEY in (batch.extra_info.get(REQUEST_KEY) or ()):  # ours (modal_signal.prepare_acpo): this pass only
                batch.extra_info.pop(REQUEST_KEY)
            if self._fused:  # the signals came with the log-prob pass: report that pass's time
                metrics["oar/fused_log_prob"] = 1.0
                for name in self._fused:
                    metrics[f"oar/timing_s/{name}"] = time.perf_counter() - self._started
            for provider in self.providers:
                if provider.name in self._fused:
                    continue
                started = time.perf_counter()
                provider.compute(trainer, batch, metrics)
                metrics[f"oar/timing_s/{provider.name}"] = time.perf_counter() - started
            for provider in self.providers:
                if provider.report is not None:
                    metrics.update(provider.report(trainer, batch))

        @contextmanager
        def advantage_context(self, trainer, batch, metrics: dict):
            from verl_oar.integration.dump import dump_step
            from verl_oar.integration.signals import TokenSignals, provide, real_rows, session_final_rows
            from verl_oar.integration.trainer import OWN_PREFIXES

            # the estimator's own fields arrive as its keyword arguments (token_estimator.register_estimator ->
            # signals.keyword_signals adds them to these signals); an active composer's (codapo.compose) are read here
            signals = TokenSignals(tensors=composer_fields(trainer.config, self._verl_oar_estimator, batch),
                                   step=int(trainer.global_steps), real_rows=real_rows(batch.tags),
                                   session_final=session_final_rows(batch.keys))
            with provide(signals):
                yield signals
            metrics.update({k if k.startswith(OWN_PREFIXES) else f"oar/{k}": v for k, v in signals.metrics.items()})
            for guard in self.guards:
                metrics.update(guard.observe(int(trainer.global_steps), signals.metrics))
            dump_dir = trainer.config.algorithm.get("oar", {}).get("dump_dir", "")
            if dump_dir:
                dump_step(dump_dir, int(trainer.global_steps), batch, signals)

    _TokenSignalHooks.__module__ = __name__
    _HOOKS_CLASS.append(_TokenSignalHooks)
    return _TokenSignalHooks


def composer_fields(config, estimator: str, batch) -> dict:
    """The TransferQueue fields of the run's active composers (``signals.register_advantage_composer``) that the
    estimator itself does not declare, for ``batch`` (verl's ``KVBatchMeta``), padded like ``token_level_rewards``
    (field -> (bs, response_len)); empty when no composer is active."""
    from verl_oar.integration.signals import needed_signals

    own = {f for p in needed_signals(estimator) for f in p.fields}
    fields = [f for p in needed_signals(estimator, config.algorithm) for f in p.fields if f not in own]
    if not fields:
        return {}
    import transfer_queue as tq

    padded = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields).to_padded_tensor()
    return {f: padded[f] for f in fields}
