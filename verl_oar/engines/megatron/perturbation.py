"""OAR-P on one micro-batch of verl's Megatron engine: occluded copies, batched, without prefix sharing.

The same importance as ``engines.fsdp.perturbation`` (FSDP) and ``verl_oar.core.perturbation``:
each sample on its own, a clean pass, then batches of occluded copies under the token budget, every
pass stopping at the last predicting position, logits kept only there. One departure: the copies
do not reuse the clean pass's KV cache (``PerturbationConfig(share_prefix=False)``). Megatron's
GPTModel has no transformers-style ``past_key_values``; its inference contexts are a separate
serving API. Batching is kept: on CPU, exact mode without prefix sharing cost 0.46-0.83x the naive
loop (README benchmarks), against 0.28-0.35x with it; ``chunk`` / ``line`` modes bound the cost
by K either way.

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
from verl_oar.engines.per_sample import score_samples
from verl_oar.core.perturbation import PerturbationCost


class MegatronRowsModel:
    """verl's Megatron model as OAR-P's ``PrefixModel``, for calls without a cached prefix."""

    def __init__(self, forward: MegatronLogits):
        self.forward = forward

    def __call__(
        self, ids: Tensor, positions: Tensor, keep: Tensor, past: Any = None, past_len: int = 0, cache: bool = False
    ) -> tuple[Tensor, None]:
        """(m, n) rows from position 0 -> (m, k, V) logits at columns ``keep``; no cache."""
        if past is not None or past_len or cache:
            raise RuntimeError(
                "the Megatron OAR-P model has no KV cache: run it with PerturbationConfig(share_prefix=False)"
            )
        m, n = ids.shape
        if not torch.equal(positions, torch.arange(n, device=positions.device).expand(m, n)):
            raise ValueError(
                "OAR-P on Megatron supports text rows whose position ids are 0..n-1 (Megatron derives RoPE "
                "positions from the packing); use algorithm.adv_estimator=grpo for this model."
            )
        layout = self.forward.layout([n] * m)
        starts = torch.tensor(layout.starts, dtype=torch.long, device=ids.device)
        select = (starts.unsqueeze(1) + keep.to(ids.device).unsqueeze(0)).reshape(-1)  # (m * k,)
        with torch.no_grad():
            logits, _ = self.forward(nested(list(ids.unbind())), layout, select)
        return logits.reshape(m, keep.numel(), -1), None


def megatron_perturbation_micro_batch(
    engine, micro_batch: TensorDict, cfg: OARConfig, neutral_id: int, token_budget: int | None, rows_budget: int
) -> tuple[Tensor, list[PerturbationCost]]:
    """Importance of one micro-batch: nested (bs, seq_len) float32, 0 outside reasoning tokens, and
    each sample's cost. Arguments as ``engines.fsdp.perturbation.perturbation_micro_batch``."""
    from verl.utils.device import get_device_id

    micro_batch = micro_batch.to(get_device_id())
    model = MegatronRowsModel(MegatronLogits(engine))
    pcfg = cfg.perturbation_config(share_prefix=False)
    return score_samples(model, micro_batch, pcfg, neutral_id, token_budget, rows_budget)

