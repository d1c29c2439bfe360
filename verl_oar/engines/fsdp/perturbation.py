"""OAR-P on one micro-batch of verl's FSDP / FSDP2 engine.

Each sample is scored on its own, unpadded (``verl_oar.core.perturbation``): a clean pass
that keeps its KV cache, then batches of occluded copies that continue from it. The copies of one
sample share its prompt and everything before their span, which packing the micro-batch cannot
exploit; scoring per sample also makes a sample's importance independent of the rest of the batch
and of ``use_remove_padding``. verl extension points: ``engine.module`` (called with transformers'
``past_key_values`` / ``logits_to_keep``; FSDP passes keyword arguments through) and the engine's
autocast dtype; checked against verl 0.9.1. Every pass is no-grad. The number of model calls depends
on the data; the driver runs this on unsharded FSDP2 parameters (``engines.fsdp.unshard``), so the
calls issue no collective and ranks may differ in how many they make.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl_oar.core.config import OARConfig
from verl_oar.engines.inputs import autocast_context
from verl_oar.core.hf import HFPrefixModel, can_share_prefix
from verl_oar.core.perturbation import PerturbationCost
from verl_oar.engines.per_sample import score_samples


def perturbation_micro_batch(
    engine, micro_batch: TensorDict, cfg: OARConfig, neutral_id: int, token_budget: int | None, rows_budget: int
) -> tuple[torch.Tensor, list[PerturbationCost]]:
    """Importance of one micro-batch: nested (bs, seq_len) float32, 0 outside reasoning tokens, and
    each sample's cost.

    Args:
        engine: verl's FSDP engine (``engine.module`` is the causal LM).
        micro_batch: verl's rows (nested ``input_ids`` / ``position_ids``) plus the masks of
            ``verl_oar.engines.inputs``.
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
