"""The small base every token-level estimator wrapper stands on: a method is one core file plus a subclass of
:class:`TokenEstimator` with two hooks (prime-rl's idea), registered in verl's advantage registry by
:func:`register_estimator`.

verl calls a registered estimator with ``token_level_rewards``, ``response_mask``, ``index`` (the rollout uids),
``config`` (the ``algorithm`` node) and, with the upstream hooks, the signal fields as keyword arguments. What
every method repeats is done once here: the current token signals (``signals``), the method's typed config
(``TokenEstimator.config``), GRPO's base advantage and each row's sequence advantage, the reward per row, the
group ids (``core.groups``: each of verl's synthetic padding rows a group of its own), metrics over the real rows
only (:meth:`EstimatorBatch.real`), the advantages masked to the response, and the artifacts a dump keeps
(``algorithm.oar.dump_dir``: ``grpo_advantages`` when the method read it, ``advantages``, and what the method
:meth:`EstimatorBatch.keep`\\ s).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import numpy as np
import torch

from verl_oar.core.groups import group_ids
from verl_oar.integration.signals import TokenSignals, keyword_signals, register_token_estimator

__all__ = ["EstimatorBatch", "TokenEstimator", "grpo_advantage", "register_estimator", "sequence_values"]


def grpo_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float,
    norm_adv_by_std_in_grpo: bool,
    session_final: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO's token advantages (bs, response_len), 0 on padding: verl's ``compute_grpo_outcome_advantage``.

    With ``session_final`` ((bs,) long: the row of each row's agent-loop session's final output), the
    groups are formed by the final outputs only and every output of a session gets its final output's
    advantage on each of its response tokens, as verl's v1 trainer does for GRPO
    (``compute_advantage_for_multi_trajectories``)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    if session_final is None:
        advantages, _ = compute_grpo_outcome_advantage(
            token_level_rewards=token_level_rewards, response_mask=response_mask, index=index, epsilon=epsilon,
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        )
        return advantages
    finals, local = torch.unique(session_final, sorted=True, return_inverse=True)
    rows = finals.tolist()
    final_adv, _ = compute_grpo_outcome_advantage(
        token_level_rewards=token_level_rewards[rows], response_mask=response_mask[rows], index=np.asarray(index)[rows],
        epsilon=epsilon, norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
    )
    first = response_mask[rows].argmax(dim=1)
    scores = final_adv[torch.arange(len(rows)), first]                 # one scalar per session
    return scores[local].unsqueeze(-1) * response_mask


def sequence_values(token_advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(bs,) each row's sequence advantage, read at its first valid token of the (bs, response_len)
    ``token_advantages`` (constant over the row under GRPO); 0 for a row with no valid token."""
    first = mask.float().argmax(dim=1)
    picked = token_advantages[torch.arange(len(token_advantages)), first]
    return torch.where(mask.any(1), picked, torch.zeros_like(picked))


@dataclass
class EstimatorBatch:
    """One estimator call: what verl handed it and what every method derives from that (computed on first use).
    Every per-token tensor is (bs, response_len), rows in the order of verl's batch."""

    name: str
    """the registered estimator name (``cscr``, ...)"""
    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    index: Any
    """(bs,) verl's rollout uids"""
    algorithm: Any
    """verl's ``algorithm`` config (DictConfig or dict)"""
    epsilon: float
    signals: TokenSignals
    cfg: Any = None
    """the method's typed config (``TokenEstimator.config.from_algorithm(algorithm)``), or None"""
    advantages: torch.Tensor | None = None
    """the method's advantages, masked to the response (set before :meth:`TokenEstimator.stats`)"""
    artifacts: dict[str, torch.Tensor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        """A token signal field (``signals``)."""
        return self.signals[name]

    @cached_property
    def mask(self) -> torch.Tensor:
        """(bs, T) bool: the response tokens."""
        return self.response_mask.bool()

    @cached_property
    def grpo(self) -> torch.Tensor:
        """(bs, T) GRPO's token advantages (:func:`grpo_advantage`; grouped by each agent-loop session's final
        output when a session has several outputs)."""
        norm_by_std = bool((self.algorithm or {}).get("norm_adv_by_std_in_grpo", True))
        return grpo_advantage(self.token_level_rewards, self.response_mask, self.index, self.epsilon, norm_by_std,
                              self.signals.session_final)

    @cached_property
    def sequence(self) -> torch.Tensor:
        """(bs,) GRPO's sequence advantage A_i of every row (:func:`sequence_values`)."""
        return sequence_values(self.grpo, self.mask)

    @cached_property
    def rewards(self) -> torch.Tensor:
        """(bs,) each row's reward R_i (``token_level_rewards`` summed over the response)."""
        return self.token_level_rewards.sum(dim=-1)

    @cached_property
    def groups(self) -> torch.Tensor:
        """(bs,) int64 group ids (``core.groups.group_ids``: verl's padding rows each a group of its own)."""
        return group_ids(list(self.index), self.signals.real_rows)

    def real(self, *values):
        """``values`` restricted to the real rows (metrics skip verl's synthetic padding rows): a tensor whose first
        dimension is the batch's is indexed, a dataclass (a core result) or a dict gets each such tensor indexed,
        anything else is passed through. One value in, one out; several in, a tuple out."""
        rows = self.signals.real_rows
        out = tuple(_real_rows(v, rows) for v in values)
        return out[0] if len(out) == 1 else out

    def keep(self, **artifacts: torch.Tensor) -> None:
        """Per-token results worth dumping (``algorithm.oar.dump_dir``) besides ``advantages`` and ``grpo_advantages``."""
        self.artifacts.update(artifacts)


def _real_rows(value, rows: torch.Tensor | None):
    if rows is None:
        return value
    if torch.is_tensor(value):
        return value[rows] if value.dim() > 0 and value.shape[0] == len(rows) else value
    if isinstance(value, dict):
        return {k: _real_rows(v, rows) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _real_rows(getattr(value, f.name), rows)
                                             for f in dataclasses.fields(value) if torch.is_tensor(getattr(value, f.name))})
    return value


class TokenEstimator:
    """A token-level advantage estimator: subclass, set the class attributes, fill the two hooks, and register it
    with :func:`register_estimator` (the wrapper of a method is about twenty lines; its math lives in ``core``)."""

    name: ClassVar[str] = ""
    """the name in verl's advantage registry (``algorithm.adv_estimator``)"""
    needs: ClassVar[tuple[str, ...]] = ()
    """the token signals it reads (``signals.register_token_signal`` names)"""
    config: ClassVar[type | None] = None
    """its typed config class (``from_algorithm(algorithm)``), parsed once per call into ``batch.cfg``"""
    sessions: ClassVar[bool] = True
    """False: refuse a batch of agent-loop sessions with several outputs (multi-turn) instead of grouping them"""

    def advantages(self, batch: EstimatorBatch) -> tuple[torch.Tensor, Any]:
        """(advantages (bs, T), state for :meth:`stats`); the base masks them to the response."""
        raise NotImplementedError

    def stats(self, batch: EstimatorBatch, state: Any) -> dict[str, float]:
        """The step's metrics (named ``<method>/...``), over the real rows (``batch.real``)."""
        return {}


def register_estimator(cls: type[TokenEstimator], name: str | None = None):
    """Register ``cls`` (under ``name``, default ``cls.name``) in verl's advantage registry through
    ``signals.register_token_estimator`` (composers, idempotent registration); returns the registered function,
    verl's estimator signature ``(token_level_rewards, response_mask, index, config=None, epsilon=1e-6, **kwargs)
    -> (advantages, returns)``, both (bs, response_len), 0 on padding."""
    name = name or cls.name
    method = cls()

    def estimator(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: np.ndarray, config=None,
                  epsilon: float = 1e-6, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        signals = keyword_signals(name, response_mask, kwargs)
        if not cls.sessions and signals.session_final is not None:
            raise RuntimeError(f"algorithm.adv_estimator={name} scores one response per row; this batch has agent-loop "
                               "sessions with several outputs (multi-turn), which it does not support yet. Use grpo or "
                               "oar_g for multi-output sessions.")
        batch = EstimatorBatch(name, token_level_rewards, response_mask, index, config, epsilon, signals,
                               cfg=None if cls.config is None else cls.config.from_algorithm(config))
        advantages, state = method.advantages(batch)
        batch.advantages = advantages * response_mask
        signals.metrics.update(method.stats(batch, state))
        if "grpo" in batch.__dict__:  # the method read GRPO's advantage
            signals.artifacts["grpo_advantages"] = batch.grpo
        signals.artifacts.update(advantages=batch.advantages, **batch.artifacts)
        return batch.advantages, batch.advantages

    estimator.__qualname__ = estimator.__name__ = f"compute_{name}_advantage"
    estimator.__doc__ = f"``{name}``: (advantages, returns), both (bs, response_len), 0 on padding. {cls.__doc__ or ''}"
    return register_token_estimator(name, needs=cls.needs)(estimator)
