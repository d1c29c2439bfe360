"""Per-token signals for token-level advantage estimators: the plumbing verl 0.9 lacks.

verl's ``compute_advantage`` calls a registered estimator with ``token_level_rewards``,
``response_mask``, ``config`` and ``index`` only; there is no way to hand it a per-token tensor
such as OAR's importance. This module is that channel, in three parts:

- a *signal provider* (``@register_token_signal``) runs in the trainer right after the old-log-prob
  step and writes per-token fields, each a nested ``(bs, response_len)`` tensor, into TransferQueue;
- a *token estimator* (``@register_token_estimator``) registers a function in verl's advantage
  registry and declares which signals it needs;
- the trainer reads those fields for the batch, pads them exactly like ``token_level_rewards``
  and exposes them for the duration of the estimator call (``provide`` / ``current_signals``).

A new estimator that needs a new per-token signal (entropy, log-probs under another prompt, ...)
adds one provider file and one estimator file; the trainer does not change.
"""

from __future__ import annotations

import contextvars
import functools
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


@dataclass(frozen=True)
class SignalProvider:
    """One per-token signal: how the trainer computes it and which TransferQueue fields it fills."""

    name: str
    """registry key, e.g. ``token_importance``"""
    fields: tuple[str, ...]
    """TransferQueue fields written by ``compute``; each a nested (bs, response_len) tensor"""
    compute: Callable[[Any, Any, dict], None]
    """``compute(trainer, batch: KVBatchMeta, metrics: dict)``: fill ``fields`` for every sample"""
    validate: Callable[[Any], None] | None = None
    """``validate(config)``: raise at start-up if this signal cannot be computed under ``config``"""
    fuse: Callable[[Any, Any], bool] | None = None
    """``fuse(trainer, batch) -> bool``, called right before the old-log-prob pass: True if it
    arranged for that pass to produce ``fields`` itself (then ``compute`` is skipped this step)"""
    prepare: Callable[[Any, Any], None] | None = None
    """``prepare(trainer, batch)``, called right before the old-log-prob pass (before ``fuse``): put
    what the workers will need into TransferQueue"""
    report: Callable[[Any, Any], dict] | None = None
    """``report(trainer, batch) -> metrics``, called once ``fields`` are in TransferQueue (fused or
    not): per-step metrics of the signal's computation (logged as they are named)"""
    guard: Callable[[Any], Any] | None = None
    """``guard(config) -> object with observe(step, estimator_metrics) -> metrics``, built at start-up
    and fed every step's estimator metrics: it raises to stop a run in which the signal cannot take
    effect (e.g. OAR with no locatable answers: GRPO under another name)"""
    attach: Callable[[Any], None] | None = None
    """``attach(config)``, called at start-up right before verl builds the workers from ``config``: add
    what the workers need to ``config.actor_rollout_ref`` (e.g. OPPO's teacher model to load)"""


@dataclass(frozen=True)
class AdvantageComposer:
    """A factor applied to every token estimator's advantages when its config asks (CoDaPO's question value)."""

    name: str
    active: Callable[[Any], bool]
    """``active(algorithm config) -> bool``: whether this run composes"""
    needs: tuple[str, ...]
    """signals it reads (fetched for the run's estimator too)"""
    apply: Callable[..., torch.Tensor]
    """``apply(estimator, advantages, token_level_rewards, response_mask, index, config, signals) -> advantages``"""


PLUGIN_LOAD_ERROR: str | None = None
"""set by ``plugin`` when loading failed (verl hides a plugin's exception); estimators then refuse"""

SIGNALS: dict[str, SignalProvider] = {}
ESTIMATOR_NEEDS: dict[str, tuple[str, ...]] = {}
COMPOSERS: dict[str, AdvantageComposer] = {}


def register_advantage_composer(name: str, active: Callable[[Any], bool], needs: tuple[str, ...] = ()):
    """Decorator: ``apply(...)`` multiplies into every token estimator's advantages where ``active(config)``."""

    def decorator(apply):
        COMPOSERS[name] = AdvantageComposer(name=name, active=active, needs=tuple(needs), apply=apply)
        return apply

    return decorator


def active_composers(config) -> tuple[AdvantageComposer, ...]:
    """The composers this run's ``algorithm`` config turns on."""
    return tuple(c for c in COMPOSERS.values() if c.active(config))


def register_token_signal(
    name: str,
    fields: tuple[str, ...],
    validate: Callable[[Any], None] | None = None,
    fuse: Callable[[Any, Any], bool] | None = None,
    prepare: Callable[[Any, Any], None] | None = None,
    report: Callable[[Any, Any], dict] | None = None,
    guard: Callable[[Any], Any] | None = None,
    attach: Callable[[Any], None] | None = None,
):
    """Decorator: register ``compute(trainer, batch, metrics)`` as the provider of signal ``name``."""

    def decorator(compute):
        SIGNALS[name] = SignalProvider(name=name, fields=tuple(fields), compute=compute, validate=validate, fuse=fuse,
                                       prepare=prepare, report=report, guard=guard, attach=attach)
        return compute

    return decorator


def register_token_estimator(name: str, needs: tuple[str, ...]):
    """Decorator: register an advantage estimator in verl's registry, needing signals ``needs``; the
    registered (and returned) function applies the run's active composers (``register_advantage_composer``)
    to the estimator's advantages.

    Idempotent: registering a function from the same source file and name again (a module imported twice,
    or by file path) keeps the first registration instead of raising like verl's decorator does.
    A *different* function already registered under ``name`` is an error.
    """

    def decorator(fn):
        from verl.trainer.ppo import core_algos

        existing = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
        identity = f"{os.path.realpath(fn.__code__.co_filename)}:{fn.__qualname__}"

        @functools.wraps(fn)
        def composed(token_level_rewards, response_mask, index=None, config=None, *args, **kwargs):
            advantages, _ = fn(token_level_rewards, response_mask, index, config, *args, **kwargs)
            for composer in active_composers(config):
                signals = current_signals(name, response_mask)
                advantages = composer.apply(name, advantages, token_level_rewards, response_mask, index, config, signals)
            return advantages, advantages

        # identity by source file, not module name: the same file imported under another name is the same
        composed._verl_oar_id = fn._verl_oar_id = identity
        if existing is None:
            core_algos.register_adv_est(name)(composed)
        elif getattr(existing, "_verl_oar_id", None) != identity:
            raise ValueError(
                f"Advantage estimator {name!r} is already registered to {existing!r}; verl-oar cannot "
                "register its own under the same name. Remove the other plugin or rename one of them."
            )
        ESTIMATOR_NEEDS[name] = tuple(needs)
        return composed if existing is None else existing

    return decorator


def needed_signals(adv_estimator: Any, algorithm=None) -> tuple[SignalProvider, ...]:
    """Providers the configured estimator needs, in order (and, with the run's ``algorithm`` config, those
    of the composers it turns on); empty for every non-token estimator."""
    name = str(getattr(adv_estimator, "value", adv_estimator))
    if name not in ESTIMATOR_NEEDS:
        return ()
    needs = list(ESTIMATOR_NEEDS[name])
    for composer in active_composers(algorithm) if algorithm is not None else ():
        needs += [s for s in composer.needs if s not in needs]
    missing = [s for s in needs if s not in SIGNALS]
    if missing:
        raise RuntimeError(f"Estimator {name!r} needs token signal(s) {missing} that no provider registered.")
    return tuple(SIGNALS[s] for s in needs)


@dataclass
class TokenSignals:
    """The signals of the batch being processed, padded like ``token_level_rewards``."""

    tensors: dict[str, torch.Tensor]
    """field name -> (bs, response_len) tensor, rows in the order of the estimator's batch"""
    metrics: dict[str, float] = field(default_factory=dict)
    """filled by the estimator; the trainer logs them under ``oar/``"""
    step: int = 0
    """global training step (for seeding)"""
    artifacts: dict[str, torch.Tensor] = field(default_factory=dict)
    """filled by the estimator with per-token results worth saving (see ``algorithm.oar.dump_dir``)"""
    real_rows: torch.Tensor | None = None
    """(bs,) bool: False on the synthetic rows verl appends to make the batch divisible (their tag
    ``is_padding``); metrics count real rows only. None: every row is real."""
    session_final: torch.Tensor | None = None
    """(bs,) long: the row of each row's agent-loop session's final output (keys
    ``{uid}_{session}_{index}``, the largest index); a session's outputs share its final output's
    group advantage, as verl's v1 GRPO does. None: every row is its own session's final output."""

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


_CURRENT: contextvars.ContextVar[TokenSignals | None] = contextvars.ContextVar("verl_oar_signals", default=None)


@contextmanager
def provide(signals: TokenSignals) -> Iterator[TokenSignals]:
    """Expose ``signals`` to estimators called inside this block."""
    token = _CURRENT.set(signals)
    try:
        yield signals
    finally:
        _CURRENT.reset(token)


def current_signals(estimator: str, response_mask: torch.Tensor) -> TokenSignals:
    """The signals of the current batch, checked against the estimator's ``response_mask``.

    Raises a RuntimeError naming the cause and the fix when the trainer did not provide them
    (plugin half-loaded, unsupported trainer) or when they do not line up with the batch.
    """
    signals = _CURRENT.get()
    if signals is None:
        cause = (
            f"the verl-oar plugin failed to load:\n{PLUGIN_LOAD_ERROR}"
            if PLUGIN_LOAD_ERROR
            else "this trainer does not compute OAR's token signals (only verl's v1 trainer in "
            "trainer.v1.trainer_mode=sync is supported: set trainer.use_v1=true trainer.v1.trainer_mode=sync)"
        )
        raise RuntimeError(f"algorithm.adv_estimator={estimator} cannot take effect: {cause}")
    for name, tensor in signals.tensors.items():
        if tensor.shape != response_mask.shape:
            raise RuntimeError(
                f"Token signal {name!r} has shape {tuple(tensor.shape)} but the estimator's batch has "
                f"response shape {tuple(response_mask.shape)}; rows or padding do not line up."
            )
    check_rows_line_up(signals, response_mask)
    return signals


ROW_MASKS = ("oar_reasoning_mask", "oar_answer_mask")
"""signals marking tokens of the row they were computed for: they must end where that row's response ends"""


def check_rows_line_up(signals: TokenSignals, response_mask: torch.Tensor) -> None:
    """RuntimeError when a row's ``ROW_MASKS`` reach past the last valid token of the response being reshaped: the
    signal was computed for another row (rows resampled or reordered between the old-log-prob pass and the
    advantage). A row-identity check: a mask the workers built from a row's own tokens ends within it."""
    if response_mask.dim() != 2:
        return
    valid = response_mask.bool()
    positions = torch.arange(valid.shape[1], device=valid.device)
    ends = torch.where(valid.any(1), (positions * valid).amax(1) + 1, torch.zeros_like(valid[:, 0], dtype=torch.long))
    past = positions[None, :] >= ends[:, None]
    for name in ROW_MASKS:
        tensor = signals.tensors.get(name, None)
        if tensor is None or tensor.shape != valid.shape:
            continue
        bad = (tensor.bool() & past).any(1).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(
                f"Token signal {name!r} of rows {bad[:5]} reaches past the end of the response being reshaped: the "
                "signals were computed for other rows than the ones whose advantages are being computed (rows "
                "resampled or reordered after the old-log-prob pass). Training on them would pair one response with "
                "another's credit. Turn off whatever moves rows between the two (e.g. algorithm.use_pf_ppo=false).")


def keyword_signals(name: str, response_mask: torch.Tensor, kwargs: dict) -> TokenSignals:
    """The current signals (``current_signals``), updated with the estimator's token fields found in ``kwargs``:
    a verl with the upstream advantage hooks (docs/upstream.md) passes them as keyword arguments."""
    signals = current_signals(name, response_mask)
    signals.tensors.update({f: kwargs[f] for provider in needed_signals(name) for f in provider.fields if f in kwargs})
    return signals


def real_rows(tags: list[dict]):
    """(bs,) bool: False on the synthetic rows verl appends to make a batch divisible (tag ``is_padding``,
    ``verl.trainer.ppo.padding_utils.upsample_batch_to_divisible_size``); None when there are none."""
    padding = [bool((tag or {}).get("is_padding", False)) for tag in tags]
    return torch.tensor([not p for p in padding]) if any(padding) else None


def session_final_rows(keys: list[str]):
    """(bs,) long: for each row, the row of its agent-loop session's final output, read from the
    TransferQueue keys ``{uid}_{session_id}_{index}`` exactly as verl's v1 GRPO
    (``compute_advantage_for_multi_trajectories``) reads them; None when every session has one output."""
    final: dict[str, tuple[int, int]] = {}
    sessions = []
    for row, key in enumerate(keys):
        parts = str(key).rsplit("_", 2)
        if len(parts) != 3 or not parts[2].isdigit():
            raise RuntimeError(f"TransferQueue key {key!r} is not of verl's form {{uid}}_{{session_id}}_{{index}}")
        session, index = f"{parts[0]}_{parts[1]}", int(parts[2])
        sessions.append(session)
        if session not in final or final[session][0] < index:
            final[session] = (index, row)
    rows = torch.tensor([final[s][1] for s in sessions], dtype=torch.long)
    return None if bool((rows == torch.arange(len(keys))).all()) else rows
