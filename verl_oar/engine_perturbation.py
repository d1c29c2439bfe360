"""OAR-P on one micro-batch of verl's FSDP / FSDP2 engine.

Each sample is scored on its own, unpadded (``verl_oar.importance.perturbation``): a clean pass
that keeps its KV cache, then batches of occluded copies that continue from it. The copies of one
sample share its prompt and everything before their span, which packing the micro-batch cannot
exploit; scoring per sample also makes a sample's importance independent of the rest of the batch
and of ``use_remove_padding``. verl extension points: ``engine.module`` (called with transformers'
``past_key_values`` / ``logits_to_keep``; FSDP passes keyword arguments through) and the engine's
autocast dtype; checked against verl 0.9.1. Every pass is no-grad. The number of model calls depends
on the data; the driver runs this on unsharded FSDP2 parameters (``engine_fsdp_unshard``), so the
calls issue no collective and ranks may differ in how many they make.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl_oar.config import OARConfig
from verl_oar.engine_inputs import LINE_END, PREDICT, REASONING, autocast_context, nested
from verl_oar.importance.hf_prefix import HFPrefixModel, can_share_prefix
from verl_oar.importance.perturbation import PerturbationCost, occlusion_spans, perturbation_importance


def _row_temperatures(micro_batch: TensorDict, rows: int) -> list[float]:
    temperature = micro_batch["temperature"]
    if isinstance(temperature, torch.Tensor) and temperature.numel() > 1:
        return [float(t) for t in temperature.reshape(-1)[:rows]]
    value = float(temperature.item() if isinstance(temperature, torch.Tensor) else temperature)
    return [value] * rows


def perturbation_micro_batch(
    engine, micro_batch: TensorDict, cfg: OARConfig, neutral_id: int, token_budget: int | None, rows_budget: int
) -> tuple[torch.Tensor, list[PerturbationCost]]:
    """Importance of one micro-batch: nested (bs, seq_len) float32, 0 outside reasoning tokens, and
    each sample's cost.

    Args:
        engine: verl's FSDP engine (``engine.module`` is the causal LM).
        micro_batch: verl's rows (nested ``input_ids`` / ``position_ids``) plus the masks of
            ``verl_oar.engine_inputs``.
        neutral_id: the token an occluded token becomes.
        token_budget: tokens per model call (copies x sequence length), verl's
            ``max_token_len_per_gpu`` under dynamic batch size; ``None`` to use ``rows_budget``.
        rows_budget: copies per model call when ``token_budget`` is None (verl's micro-batch size).
    """
    from verl.utils.device import get_device_id

    micro_batch = micro_batch.to(get_device_id())
    model = HFPrefixModel(engine.module, context=lambda: autocast_context(engine))
    pcfg = cfg.perturbation_config(share_prefix=can_share_prefix(engine.module))
    return score_samples(model, micro_batch, pcfg, neutral_id, token_budget, rows_budget)


def score_samples(
    model, micro_batch: TensorDict, pcfg, neutral_id: int, token_budget: int | None, rows_budget: int
) -> tuple[torch.Tensor, list[PerturbationCost]]:
    """Score each sample of ``micro_batch`` on its own with ``model`` (a ``PrefixModel``, already on
    the micro-batch's device); shared by the FSDP and Megatron engines. Arguments and return as
    :func:`perturbation_micro_batch`, with ``pcfg`` the ``PerturbationConfig``."""
    ids_rows = micro_batch["input_ids"].unbind()
    positions = micro_batch["position_ids"].unbind()
    reasoning = micro_batch[REASONING].unbind()
    predict = micro_batch[PREDICT].unbind()
    line_end = micro_batch[LINE_END].unbind() if pcfg.mode == "line" else [None] * len(ids_rows)
    temperatures = _row_temperatures(micro_batch, len(ids_rows))
    costs, out = [], []
    for ids, pos, reason, pred, line, temp in zip(ids_rows, positions, reasoning, predict, line_end, temperatures,
                                                  strict=True):
        if pos.dim() != 1:
            raise ValueError(
                f"OAR-P supports text models with 1-D position ids; got position_ids of shape {tuple(pos.shape)} "
                "per sample (multimodal rope). Use algorithm.adv_estimator=grpo for this model."
            )
        span = occlusion_spans(reason.bool(), pcfg.mode, pcfg.budget, None if line is None else line.bool())
        budget = token_budget if token_budget is not None else rows_budget * ids.numel()
        importance, row_cost = perturbation_importance(
            model, ids, pos, span, pred.bool(), neutral_id, pcfg, max_tokens=budget, temperature=temp
        )
        costs.append(row_cost)
        out.append(importance.cpu())
    return nested(out), costs
