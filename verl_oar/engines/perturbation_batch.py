"""OAR-P on one engine micro-batch, engine-agnostic: the samples handed to ``core.perturbation.score_samples``.

Each sample is scored unpadded as its own sequence, so its importance does not depend on the rest of the batch
or on the engine's packing; its occluded copies share model calls with other samples' copies (the model is a
``RowsModel`` the engine path builds: ``core.hf.HFRowsModel`` over the FSDP module, or
``engines.megatron.perturbation.MegatronRowsModel``). Samples of the micro-batch with the same prompt share the
prompt's pass. ``perturb_mode=hierarchical`` runs the batch twice (``score_samples``): coarse chunks, then the top
ones refined.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl_oar.core.perturbation import PerturbationConfig, PerturbationCost, Sample, score_samples
from verl_oar.engines.inputs import LINE_END, PREDICT, REASONING, nested, rollout_temperature


def micro_batch_samples(micro_batch: TensorDict) -> tuple[list[Sample], list[torch.Tensor], list]:
    """The micro-batch's rows as :class:`Sample` (spans not yet set), their reasoning masks and line ends."""
    ids_rows = micro_batch["input_ids"].unbind()
    positions = micro_batch["position_ids"].unbind()
    reasoning = [r.bool() for r in micro_batch[REASONING].unbind()]
    predict = micro_batch[PREDICT].unbind()
    line_end = ([x.bool() for x in micro_batch[LINE_END].unbind()] if LINE_END in micro_batch.keys()
                else [None] * len(ids_rows))
    prompt_lens = (micro_batch["prompts"].offsets().diff().tolist() if "prompts" in micro_batch.keys()
                   else [0] * len(ids_rows))
    temperature = rollout_temperature(micro_batch)
    temperatures = ([float(t) for t in temperature[: len(ids_rows)]] if isinstance(temperature, torch.Tensor)
                    else [temperature] * len(ids_rows))
    samples = []
    for ids, pos, pred, temp, prompt_len in zip(ids_rows, positions, predict, temperatures, prompt_lens, strict=True):
        if pos.dim() != 1:
            raise ValueError(
                f"OAR-P supports text models with 1-D position ids; got position_ids of shape {tuple(pos.shape)} "
                "per sample (multimodal rope). Use algorithm.adv_estimator=grpo for this model."
            )
        samples.append(Sample(ids, pos, torch.full_like(ids, -1), pred.bool(), temp, prompt_len))
    return samples, reasoning, line_end


def score_micro_batch(
    model, micro_batch: TensorDict, pcfg: PerturbationConfig, neutral_id: int, token_budget: int | None,
    rows_budget: int,
) -> tuple[torch.Tensor, list[PerturbationCost]]:
    """Importance of one micro-batch: nested (bs, seq_len) float32, 0 outside reasoning tokens, and each sample's
    cost (tokens fed, its share of a shared prompt included; copies; its largest call).

    Args:
        model: a ``RowsModel`` on the micro-batch's device.
        micro_batch: verl's rows (nested ``input_ids`` / ``position_ids``, ``prompts`` when present) plus the
            masks of ``verl_oar.engines.inputs``.
        pcfg: the ``PerturbationConfig``.
        neutral_id: the token an occluded token becomes.
        token_budget: padded tokens per model call (verl's ``max_token_len_per_gpu`` under dynamic batch size);
            None: ``rows_budget`` rows of the micro-batch's longest sample.
        rows_budget: verl's log-prob micro-batch size, in sequences.
    """
    samples, reasoning, line_end = micro_batch_samples(micro_batch)
    budget = token_budget if token_budget is not None else rows_budget * max(s.ids.numel() for s in samples)
    importance, costs, _ = score_samples(model, samples, reasoning, neutral_id, pcfg, budget, line_end)
    return nested([x.cpu() for x in importance]), costs
