"""OAR-P scored one sample at a time, engine-agnostic: the loop the FSDP and Megatron paths share.

Each sample is scored on its own, unpadded (``verl_oar.core.perturbation``), through a
``PrefixModel`` that the engine path builds (``engines/fsdp/perturbation.py`` wraps the HF module,
``engines/megatron/perturbation.py`` Megatron's GPTModel), so a sample's importance is independent
of the rest of the batch and of the engine's packing.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl_oar.core.perturbation import PerturbationCost, occlusion_spans, perturbation_importance
from verl_oar.engines.inputs import LINE_END, PREDICT, REASONING, nested, rollout_temperature


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
    temperature = rollout_temperature(micro_batch)
    temperatures = ([float(t) for t in temperature[: len(ids_rows)]] if isinstance(temperature, torch.Tensor)
                    else [temperature] * len(ids_rows))
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
