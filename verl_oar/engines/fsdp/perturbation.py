"""OAR-P on one micro-batch of verl's FSDP / FSDP2 engine.

Each sample is scored as its own unpadded sequence (``verl_oar.core.perturbation``): each
distinct prompt once, each sample's clean pass continuing it and keeping its KV cache, then occluded
copies continuing that cache from their span on, copies of different samples in the same model
calls (``core.hf.HFRowsModel``: per-row caches under a padding mask). A sample's importance does
not depend on the rest of the batch or on ``use_remove_padding``. verl extension points:
``engine.module`` (called with transformers' ``past_key_values`` / ``attention_mask`` /
``logits_to_keep``; FSDP passes keyword arguments through) and the engine's
autocast dtype; checked against verl 0.9.1. Every pass is no-grad. The number of model calls depends
on the data: with several FSDP2 ranks each call first passes ``peers`` (``engines.fsdp.lockstep``), and
the pass pads the ranks' counts to equal at its end (``engines.fsdp.importance_pass``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl_oar.core.config import OARConfig
from verl_oar.core.hf import HFRowsModel
from verl_oar.core.perturbation import PerturbationCost
from verl_oar.engines.fsdp.lockstep import LockstepModule
from verl_oar.engines.inputs import autocast_context
from verl_oar.engines.perturbation_batch import score_micro_batch


def perturbation_micro_batch(
    engine, micro_batch: TensorDict, cfg: OARConfig, neutral_id: int, token_budget: int | None, rows_budget: int,
    peers=None,
) -> tuple[torch.Tensor, list[PerturbationCost]]:
    """Importance of one micro-batch: nested (bs, seq_len) float32, 0 outside reasoning tokens, and
    each sample's cost.

    Args:
        engine: verl's FSDP engine (``engine.module`` is the causal LM).
        micro_batch: verl's rows (nested ``input_ids`` / ``position_ids``) plus the masks of
            ``verl_oar.engines.inputs``.
        neutral_id: the token an occluded token becomes.
        token_budget: padded tokens per model call (rows x (longest prefix + longest new part)), verl's
            ``max_token_len_per_gpu`` under dynamic batch size; ``None`` to use ``rows_budget``.
        rows_budget: verl's micro-batch size: without ``token_budget``, calls of that many of the
            micro-batch's longest sequence.
        peers: an ``engines.fsdp.lockstep.Lockstep`` every model call first passes (several FSDP2 ranks),
            or None.
    """
    from verl.utils.device import get_device_id

    micro_batch = micro_batch.to(get_device_id())
    module = engine.module if peers is None else LockstepModule(engine.module, peers)
    model = HFRowsModel(module, context=lambda: autocast_context(engine), pad_id=neutral_id)
    pcfg = cfg.perturbation_config(share_prefix=model.shares_cache)
    return score_micro_batch(model, micro_batch, pcfg, neutral_id, token_budget, rows_budget)
