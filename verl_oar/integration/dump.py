"""``algorithm.oar.dump_dir``: save a step's token-level tensors for heatmaps, the testbed's credit
measures and debugging (one function for both trainer paths: ``trainer.OARTrainerSync`` and the
upstream series' advantage hooks)."""

from __future__ import annotations

import os

__all__ = ["dump_step"]

RESPONSE_FIELDS = ("prompts", "responses", "response_mask")
"""fetched from TransferQueue beside the signals, so that a dump can be read without the run's data"""
ADVANTAGES = "advantages"
"""also fetched where the batch already holds it (the trainer path dumps after the advantage is written back)"""


def dump_step(dump_dir: str, step: int, batch, signals) -> None:
    """Write ``{dump_dir}/step_{step}.pt``: ``step``, ``keys`` (TransferQueue sample keys), the signals'
    tensors and artifacts, ``prompts`` (token ids, a list per row), ``responses`` (token ids), ``response_mask``,
    ``advantages`` (where the batch holds them: the trainer path) and, when verl padded the batch, ``real_rows``;
    every per-token tensor padded to (bs, response_len), on CPU."""
    import torch
    import transfer_queue as tq

    os.makedirs(dump_dir, exist_ok=True)
    payload = {"step": step, "keys": list(batch.keys), **signals.tensors, **signals.artifacts}
    fields = list(RESPONSE_FIELDS)
    if batch.fields is not None and ADVANTAGES in batch.fields:
        fields.append(ADVANTAGES)
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    prompts = [row.tolist() for row in data["prompts"].unbind()]  # unpadded: a prompt's length is its own
    payload.update(data.exclude("prompts").to_padded_tensor())
    payload["prompts"] = prompts
    if signals.real_rows is not None:
        payload["real_rows"] = signals.real_rows
    torch.save({k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in payload.items()},
               os.path.join(dump_dir, f"step_{step}.pt"))
