"""The trainer hook: compute token signals after old-log-probs, hand them to the estimator.

verl extension point: the v1 trainer registry (``verl.trainer.ppo.v1.trainer_base``,
``register_trainer`` / ``get_trainer_cls``). ``python -m verl.trainer.main_ppo`` looks the trainer up
by ``trainer.v1.trainer_mode`` (default ``sync``); so that ``algorithm.adv_estimator=oar_g`` works
with no other flag, the hook replaces the ``sync`` entry with ``OARTrainerSync``, a subclass that
overrides three methods and calls ``super()`` in each. With any estimator that needs no token
signal (grpo, gae, ...) it behaves exactly like verl's ``PPOTrainerSync``. The other registered
modes, and the legacy ``RayPPOTrainer`` (``trainer.use_v1=false``), are wrapped so that an OAR
estimator is refused at start-up instead of failing mid-run. These rebindings are verl-oar's only
patch of verl outside CPU mode; the hook checks the verl version and that the registry still looks
as expected (tests/unit/test_trainer_hook_on_cpu.py). Checked against verl 0.9.1.
"""

from __future__ import annotations

import time

SUPPORTED_VERL = ("0.9.",)
LEGACY = "legacy"
"""trainer mode name used here for verl's deprecated ``RayPPOTrainer`` (``trainer.use_v1=false``)"""


def _estimator_name(config) -> str:
    est = config.algorithm.adv_estimator
    return str(getattr(est, "value", est))


def check_token_signals_supported(config, trainer_mode: str) -> tuple:
    """Start-up checks for an estimator that needs token signals; returns its providers.

    Raises ValueError naming the cause and the fix (unsupported trainer mode, bad
    ``algorithm.oar`` keys, unsupported engine settings).
    """
    from verl_oar.integration.signals import needed_signals

    providers = needed_signals(config.algorithm.adv_estimator)
    if not providers:
        return ()
    name = _estimator_name(config)
    if trainer_mode == LEGACY:
        raise ValueError(
            f"algorithm.adv_estimator={name} needs per-token signals, which verl-oar computes in verl's "
            "v1 trainer only, not in the deprecated legacy trainer (trainer.use_v1=false). "
            "Set trainer.use_v1=true (verl's default)."
        )
    if trainer_mode != "sync":
        raise ValueError(
            f"algorithm.adv_estimator={name} needs per-token signals, which verl-oar computes in verl's "
            f"synchronous v1 trainer only, not trainer.v1.trainer_mode={trainer_mode!r}. "
            "Set trainer.v1.trainer_mode=sync."
        )
    for provider in providers:
        if provider.validate is not None:
            provider.validate(config)
    return providers


def install_trainer_hook() -> None:
    """Point verl's v1 trainer registry at the OAR-aware trainers. Idempotent."""
    import verl

    if not verl.__version__.startswith(SUPPORTED_VERL):
        raise RuntimeError(
            f"verl-oar supports verl {', '.join(v + 'x' for v in SUPPORTED_VERL)}; found verl {verl.__version__}. "
            "Install verl==0.9.1 or a verl-oar release made for your verl."
        )
    from verl.trainer.ppo.v1 import trainer_base
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    registry = getattr(trainer_base, "TRAINER_REGISTRY", None)
    if not isinstance(registry, dict) or registry.get("sync") not in (PPOTrainerSync, _CLASSES.get("sync")):
        raise RuntimeError(
            "verl's v1 trainer registry (verl.trainer.ppo.v1.trainer_base.TRAINER_REGISTRY['sync']) is not "
            "what verl-oar expects; this verl is not supported. Install verl==0.9.1."
        )
    for mode, cls in list(registry.items()):
        if getattr(cls, "_verl_oar_hooked", False):
            continue
        registry[mode] = _oar_trainer_sync(cls) if mode == "sync" else _guarded(cls, mode)
    # The legacy trainer has no registry: main_ppo_v0 does `from ray_trainer import RayPPOTrainer`
    # when the TaskRunner imports it, which is after this plugin ran, so rebinding the name suffices.
    from verl.trainer.ppo import ray_trainer

    if not getattr(ray_trainer.RayPPOTrainer, "_verl_oar_hooked", False):
        ray_trainer.RayPPOTrainer = _guarded(ray_trainer.RayPPOTrainer, LEGACY)


_CLASSES: dict = {}
"""trainer mode -> the OAR-aware class installed for it (lets a second install recognise its own)"""


def _guarded(cls, mode: str):
    """``cls`` that refuses token-signal estimators at start-up (they need the sync trainer)."""

    def __init__(self, config, *args, **kwargs):
        check_token_signals_supported(config, mode)
        cls.__init__(self, config, *args, **kwargs)

    guarded = type(cls.__name__, (cls,), {"__init__": __init__, "_verl_oar_hooked": True, "__module__": __name__})
    _CLASSES[mode] = guarded
    return guarded


def _oar_trainer_sync(base):
    """Build ``OARTrainerSync`` over verl's ``PPOTrainerSync`` (imported lazily: it is heavy)."""
    import transfer_queue as tq

    from verl_oar.integration.signals import TokenSignals, provide, real_rows, session_final_rows

    class OARTrainerSync(base):
        """verl's sync trainer, plus token signals for estimators that declare them."""

        _verl_oar_hooked = True

        def __init__(self, config, *args, **kwargs):
            self._token_signals = check_token_signals_supported(config, "sync")
            self._guards = [p.guard(config) for p in self._token_signals if p.guard is not None]
            super().__init__(config, *args, **kwargs)

        def _init_resource_pool_mgr(self):
            super()._init_resource_pool_mgr()
            if self._token_signals:
                from verl_oar.integration.worker import with_oar_worker

                ref_scores = (self.config.algorithm.get("oar", None) or {}).get("importance_model", "actor") == "ref"
                with_oar_worker(self.role_worker_mapping, _estimator_name(self.config), ref_scores=ref_scores)

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
            metrics.update({f"oar/{k}": v for k, v in signals.metrics.items()})
            for guard in self._guards:
                metrics.update(guard.observe(int(self.global_steps), signals.metrics))
            dump_dir = self.config.algorithm.get("oar", {}).get("dump_dir", "")
            if dump_dir:
                _dump(dump_dir, int(self.global_steps), list(batch.keys), signals)
            return batch

    OARTrainerSync.__module__ = __name__
    _CLASSES["sync"] = OARTrainerSync
    return OARTrainerSync


def _dump(dump_dir: str, step: int, keys: list, signals) -> None:
    """Save a step's token-level tensors (``algorithm.oar.dump_dir``): padded (bs, response_len) each."""
    import os

    import torch

    os.makedirs(dump_dir, exist_ok=True)
    payload = {"step": step, "keys": keys, **signals.tensors, **signals.artifacts}
    if signals.real_rows is not None:
        payload["real_rows"] = signals.real_rows
    torch.save({k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in payload.items()},
               os.path.join(dump_dir, f"step_{step}.pt"))
