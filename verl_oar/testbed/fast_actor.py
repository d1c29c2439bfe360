"""The fast runner's actor: verl's own actor worker and OAR's worker passes, in this process, without Ray.

:class:`Actor` is ``verl_oar.integration.worker.OARActorRolloutRefWorker`` (verl's ``ActorRolloutRefWorker``
plus OAR's importance) built with role ``actor`` on a one-rank gloo process group, on the FSDP2 engine as
``main_ppo`` builds it in CPU mode: the old-log-prob pass (``compute_log_prob``), OAR's importance pass
(``compute_token_importance``, or fused into the old-log-prob pass for OAR-G, as the trainer asks), the PPO update
(``update_actor``: verl's ``ppo_loss``, its optimizer, gradient clipping and lr scheduler) and the weights sent to
the rollout (the engine's ``get_per_tensor_param``, verl's "naive" checkpoint engine path). The batch each call
receives is what verl's v1 trainer hands its workers from TransferQueue: nested (jagged) ``prompts``,
``responses``, ``response_mask``, ``loss_mask``, ``input_ids``, ``attention_mask``, ``position_ids`` (one row
per sample, prompt then response, no padding), plus the trainer's ``extra_info`` as non-tensor entries.

The importance provider's own functions (``integration.importance_signal``: ``fuse_into_log_prob`` and
``compute_token_importance``) run against :class:`TrainerView`, the few attributes of verl's trainer they read,
whose worker group calls this process's worker.

torch.distributed's process group is global: :func:`prepare_process` must run before ``import verl`` in a
process of its own (the CLI does); several runs in one process reuse the group (verl initialises it once).
"""

from __future__ import annotations

import os
import socket
from typing import Any

import numpy as np
import torch

__all__ = [
    "UNSUPPORTED", "Actor", "TrainerView", "compute_advantages", "estimator_metrics", "importance_report",
    "nested_rows", "plugin_load_error", "prepare_process", "sample_tensors", "signal_providers",
]

UNSUPPORTED = ("the fast runner carries GRPO and OAR's importance signal (oar_g, oar_p); {what} runs through "
               "python -m verl.trainer.main_ppo (verl_oar.testbed.training_runs, or the demo with --methods)")
"""the refusal of what the runner does not carry; ``{what}`` names it"""

PROCESS_ENV = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}


def prepare_process() -> None:
    """Select verl's CPU platform and a one-rank process group, before verl is imported.

    Raises RuntimeError if verl was already imported without ``VERL_PLATFORM=cpu`` (verl resolves its platform
    once per process)."""
    import sys

    if "verl" in sys.modules and os.environ.get("VERL_PLATFORM", "").strip().lower() != "cpu":
        raise RuntimeError(
            "the fast runner drives verl's actor worker on CPU, which needs VERL_PLATFORM=cpu before verl is "
            "imported; this process imported verl without it. Run it in a fresh process "
            "(python -m verl_oar.testbed.fast_runner ...) or set VERL_PLATFORM=cpu before importing verl.")
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for key, value in PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])


def nested_rows(rows: list[list], dtype: torch.dtype) -> torch.Tensor:
    """A jagged nested tensor (bs, len_i) of ``rows``."""
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def sample_tensors(prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]]):
    """The TensorDict of a batch as verl's v1 trainer stores it (``AgentLoopWorkerTQ._agent_loop_postprocess``):
    nested ``prompts`` / ``responses`` / ``response_mask`` / ``loss_mask`` and the whole sequences' ``input_ids``,
    ``attention_mask`` (ones) and ``position_ids`` (``compute_position_id_with_mask``: 0, 1, ... for text)."""
    from tensordict import TensorDict
    from verl.utils.model import compute_position_id_with_mask

    sequences = [p + r for p, r in zip(prompts, responses, strict=True)]
    positions = [compute_position_id_with_mask(torch.ones(1, len(s), dtype=torch.int64))[0].tolist() for s in sequences]
    return TensorDict({
        "prompts": nested_rows(prompts, torch.int64),
        "responses": nested_rows(responses, torch.int64),
        "response_mask": nested_rows(masks, torch.int64),
        "loss_mask": nested_rows(masks, torch.int64),
        "input_ids": nested_rows(sequences, torch.int64),
        "attention_mask": nested_rows([[1] * len(s) for s in sequences], torch.int64),
        "position_ids": nested_rows(positions, torch.int64),
    }, batch_size=[len(sequences)])


def with_extra(data, extra: dict):
    """A shallow copy of ``data`` carrying ``extra`` as non-tensor entries (a worker call's TransferQueue batch)."""
    from verl.utils import tensordict_utils as tu

    out = data.copy()
    tu.assign_non_tensor(out, **extra)
    return out


class Actor:
    """verl's actor worker (with OAR's passes) built from the run's composed config, on this process's one rank."""

    def __init__(self, config) -> None:
        from verl_oar.integration.worker import OARActorRolloutRefWorker

        self.worker = OARActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
        self.worker.init_model()

    def call(self, method: str, data, extra: dict):
        """``worker.<method>`` on ``data`` with the trainer's ``extra_info``, as the worker group dispatches it."""
        return getattr(self.worker, method)(with_extra(data, extra))

    def weights(self) -> dict[str, torch.Tensor]:
        """The engine's full HF-named parameters, as verl's naive checkpoint engine sends them to the rollout."""
        params, _ = self.worker.actor.engine.get_per_tensor_param(layered_summon=False, base_sync_done=True)
        return {name: tensor.detach().to("cpu").clone() for name, tensor in params}


class _Batch:
    """What the importance provider reads of verl's ``KVBatchMeta``: ``extra_info`` and its length."""

    def __init__(self, data) -> None:
        self.data = data
        self.extra_info: dict[str, Any] = {}
        self.output = None

    def __len__(self) -> int:
        return len(self.data)


class _WorkerGroup:
    """verl's actor worker group for the provider: each call runs on this process's worker."""

    def __init__(self, actor: Actor) -> None:
        self.actor = actor

    def compute_token_importance(self, batch: _Batch):
        batch.output = self.actor.call("compute_token_importance", batch.data, batch.extra_info)
        return batch.output


class TrainerView:
    """The attributes of verl's trainer that ``integration.importance_signal`` reads: ``config``, ``global_steps``,
    ``ref_in_actor`` and ``actor_rollout_wg`` (this process's worker)."""

    def __init__(self, config, actor: Actor) -> None:
        self.config = config
        self.global_steps = 0
        self.ref_in_actor = False
        self.actor_rollout_wg = _WorkerGroup(actor)
        self.ref_policy_wg = None

    def batch(self, data) -> _Batch:
        return _Batch(data)


# -------------------------------------------------------------------------------------------------------------------
# the plugin's trainer-side glue, as ``OARTrainerSync`` uses it
# -------------------------------------------------------------------------------------------------------------------


def plugin_load_error() -> str | None:
    """The traceback of a failed plugin load (verl hides it), or None."""
    from verl_oar.integration import plugin

    return plugin.LOAD_ERROR


def signal_providers(config):
    """OAR's start-up checks of ``config`` (``validate.check_token_signals_supported``, as the trainer dispatcher);
    returns (the estimator's signal providers, the ``token_importance`` provider or None, the providers' guards).
    Raises NotImplementedError naming main_ppo for a signal other than OAR's importance or importance under the
    reference model."""
    from verl.trainer.ppo import core_algos  # the plugin registers its estimators when verl imports this

    from verl_oar.integration.signals import SIGNALS
    from verl_oar.integration.validate import check_token_signals_supported, estimator_name

    name = estimator_name(config)
    if name not in core_algos.ADV_ESTIMATOR_REGISTRY and name != "grpo":
        raise RuntimeError(f"algorithm.adv_estimator={name} is not in verl's advantage registry: the verl-oar plugin "
                           "did not load (pip install -e . registers its entry point)\n"
                           + str(plugin_load_error() or ""))
    providers = check_token_signals_supported(config, "sync")
    others = [p.name for p in providers if p.name != "token_importance"]
    if others:
        raise NotImplementedError(UNSUPPORTED.format(
            what=f"the token signal(s) {others} of algorithm.adv_estimator={name}"))
    oar = config.algorithm.get("oar", None) or {}
    if providers and oar.get("importance_model", "actor") != "actor":
        raise NotImplementedError(UNSUPPORTED.format(what="importance under the reference model"))
    importance = SIGNALS.get("token_importance") if providers else None
    return providers, importance, [p.guard(config) for p in providers if p.guard is not None]


def estimator_metrics(metrics: dict) -> dict:
    """An estimator's metrics under the names ``OARTrainerSync`` logs them (``oar/`` unless a method's own prefix)."""
    from verl_oar.integration.trainer import OWN_PREFIXES

    return {k if k.startswith(OWN_PREFIXES) else f"oar/{k}": v for k, v in metrics.items()}


def compute_advantages(config, step: int, keys: list[str], uids: list[str], response_mask: torch.Tensor,
                       rm_scores: torch.Tensor, signal_tensors: dict[str, torch.Tensor]):
    """The v1 trainer's advantage computation: verl's ``compute_advantage_for_multi_trajectories`` on a batch of
    (bs, T) ``response_mask`` (int64) and ``rm_scores`` (float32, the reward on each response's last token),
    TransferQueue ``keys`` (``{uid}_{session}_{index}``) and ``uids``, with the token signals (``signal_tensors``,
    (bs, T) each) exposed to the estimator for ``step`` as ``OARTrainerSync`` does. Returns ((bs, T) float32
    advantages, the ``TokenSignals``: the estimator's metrics and artifacts)."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    from verl_oar.integration.signals import TokenSignals, provide, real_rows, session_final_rows

    algorithm = config.algorithm
    data = DataProto.from_dict(tensors={"response_mask": response_mask, "token_level_scores": rm_scores,
                                        "token_level_rewards": rm_scores},
                               non_tensors={"uid": np.array(list(uids), dtype=object)})
    signals = TokenSignals(tensors=dict(signal_tensors), step=step, real_rows=real_rows([{} for _ in keys]),
                           session_final=session_final_rows(list(keys)))
    with provide(signals):
        data = compute_advantage_for_multi_trajectories(
            data, batch_keys=list(keys), adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma,
            lam=algorithm.lam, num_repeat=int(config.actor_rollout_ref.rollout.n),
            norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True), config=algorithm,
        )
    return data.batch["advantages"], signals


def importance_report(config, output) -> dict[str, float]:
    """``importance_signal.report_importance`` on the worker's output (it reads TransferQueue there)."""
    from verl_oar.integration.importance_signal import ANSWER_SOURCES, importance_method

    source = output["oar_answer_source"].reshape(-1)
    metrics = {f"oar/answer/frac_{name}": float((source == code).float().mean())
               for code, name in ANSWER_SOURCES.items()}
    if importance_method(config) == "perturbation":
        copies, passes = output["oar_perturb_copies"].float(), output["oar_perturb_passes"].float()
        metrics.update({
            "oar/perturb/copies_mean": float(copies.mean()), "oar/perturb/copies_max": float(copies.max()),
            "oar/perturb/cost_passes_mean": float(passes.mean()),
            "oar/perturb/peak_call_tokens": float(output["oar_perturb_peak_tokens"].float().max()),
        })
    return metrics
