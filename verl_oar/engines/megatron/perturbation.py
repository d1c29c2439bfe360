"""OAR-P on one micro-batch of verl's Megatron engine: copies of all samples batched, without prefix sharing.

The same importance as ``engines.fsdp.perturbation`` (FSDP), through ``core.perturbation.score_samples``: a clean
row per sample and one row per occluded copy, rows of different samples and lengths packed into the same
calls in verl's own layout (THD: no padding at all; BSHD padded), every row stopping at its last predicting
position, logits kept only there. What Megatron does not allow: reusing a KV cache. Its GPTModel has no
transformers-style ``past_key_values`` (its inference contexts are a separate serving API), so every row
starts at position 0 (``MegatronRowsModel.shares_cache = False``): no shared prompts and no copies fed from
their span on, which is what the FSDP path saves; ``chunk`` / ``line`` modes bound the cost by K either way.

Every TP rank of a data-parallel group holds the same micro-batch, so all of them make the same
sequence of model calls (the tensor-parallel collectives inside stay matched); data-parallel
ranks make different numbers of calls, which Megatron's forward does not synchronise (its DDP
forward hooks only wait for parameter all-gathers an optimizer step started; Megatron-FSDP, whose
forward does gather over data-parallel ranks, is refused at start-up). All passes
are no-grad; logits are full-vocabulary, gathered over the TP group (``engines.megatron.forward``).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor

from verl_oar.core.config import OARConfig
from verl_oar.engines.inputs import nested
from verl_oar.engines.megatron.forward import MegatronLogits
from verl_oar.core.perturbation import PerturbationCost, Row
from verl_oar.engines.perturbation_batch import score_micro_batch


class MegatronRowsModel:
    """verl's Megatron model as OAR-P's ``RowsModel`` (``core.perturbation``): rows of any lengths,
    each from position 0, packed into one call in verl's own layout (THD, or BSHD padded); no cache."""

    shares_cache = False

    def __init__(self, forward: MegatronLogits):
        self.forward = forward

    def prefix(self, cache: Any, length: int) -> Any:
        raise RuntimeError("the Megatron OAR-P model has no KV cache: run it with PerturbationConfig(share_prefix=False)")

    def __call__(self, rows: list[Row]) -> tuple[list[Tensor | None], list[None]]:
        """Per row, (keep, V) logits of its last ``keep`` positions."""
        for r in rows:
            if r.past is not None or r.past_len or r.cache:
                raise RuntimeError(
                    "the Megatron OAR-P model has no KV cache: run it with PerturbationConfig(share_prefix=False)"
                )
            if not torch.equal(r.positions, torch.arange(r.ids.numel(), device=r.positions.device)):
                raise ValueError(
                    "OAR-P on Megatron supports text rows whose position ids are 0..n-1 (Megatron derives RoPE "
                    "positions from the packing); use algorithm.adv_estimator=grpo for this model."
                )
        lengths = [r.ids.numel() for r in rows]
        layout = self.forward.layout(lengths)
        select = torch.cat([start + torch.arange(n - r.keep, n) for start, n, r in zip(layout.starts, lengths, rows)])
        with torch.no_grad():
            logits, _ = self.forward(nested([r.ids for r in rows]), layout, select.to(rows[0].ids.device))
        return list(logits.split([r.keep for r in rows])), [None] * len(rows)


def megatron_perturbation_micro_batch(
    engine, micro_batch: TensorDict, cfg: OARConfig, neutral_id: int, token_budget: int | None, rows_budget: int
) -> tuple[Tensor, list[PerturbationCost]]:
    """Importance of one micro-batch: nested (bs, seq_len) float32, 0 outside reasoning tokens, and
    each sample's cost. Arguments as ``engines.fsdp.perturbation.perturbation_micro_batch``."""
    from verl.utils.device import get_device_id

    micro_batch = micro_batch.to(get_device_id())
    model = MegatronRowsModel(MegatronLogits(engine))
    pcfg = cfg.perturbation_config(share_prefix=False)
    return score_micro_batch(model, micro_batch, pcfg, neutral_id, token_budget, rows_budget)

