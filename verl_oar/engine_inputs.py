"""What OAR's engine passes add to verl's worker batch before micro-batching, and share.

verl keeps each sample as one unpadded row of prompt + response tokens (nested, jagged). The masks
below are full-sequence rows in that same form, so the engine's own micro-batching (and dynamic
batch size reordering) splits them together with ``input_ids``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from tensordict import TensorDict

from verl_oar.answer_span import answer_token_masks, line_break_tokens

REASONING = "oar_reasoning_full"
"""(bs, seq_len) nested int64: 1 on reasoning tokens"""
PREDICT = "oar_predict_full"
"""(bs, seq_len) nested int64: 1 where the logits predict an answer token"""
LINE_END = "oar_line_end_full"
"""(bs, seq_len) nested int64: 1 on response tokens containing a line break (OAR-P ``line`` mode)"""


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def padded(rows: torch.Tensor, pad: int = 0) -> torch.Tensor:
    return torch.nested.to_padded_tensor(rows, padding=pad)


def add_outcome_masks(data: TensorDict, tokenizer, line_ends: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Locate each response's final answer and add full-sequence masks to ``data``.

    Reads ``prompts``, ``responses`` and ``response_mask`` (nested (bs, len)). Adds ``REASONING``
    and ``PREDICT`` (and ``LINE_END`` if ``line_ends``), nested (bs, prompt_len + response_len) int64 0/1.

    Returns:
        (reasoning, answer): padded (bs, max_response_len) int64 response-level masks.
    """
    responses, response_mask = data["responses"], data["response_mask"]
    prompt_lens = data["prompts"].offsets().diff().tolist()
    response_lens = responses.offsets().diff().tolist()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    resp_mask = padded(response_mask).bool()
    reasoning, answer, _found = answer_token_masks(padded(responses, pad_id), resp_mask, tokenizer)
    reasoning = (reasoning & resp_mask).long()
    answer = (answer & resp_mask).long()
    reasoning_rows, predict_rows, line_rows = [], [], []
    for i, (p, r, ids) in enumerate(zip(prompt_lens, response_lens, responses.unbind(), strict=True)):
        full_reasoning = torch.zeros(p + r, dtype=torch.int64)
        full_reasoning[p:] = reasoning[i, :r]
        full_predict = torch.zeros(p + r, dtype=torch.int64)
        full_predict[p - 1 : p + r - 1] = answer[i, :r]  # the logits at t-1 predict token t
        reasoning_rows.append(full_reasoning)
        predict_rows.append(full_predict)
        if line_ends:
            full_line = torch.zeros(p + r, dtype=torch.int64)
            full_line[p:] = torch.tensor(line_break_tokens(ids.tolist(), tokenizer), dtype=torch.int64)
            line_rows.append(full_line)
    data[REASONING] = nested(reasoning_rows)
    data[PREDICT] = nested(predict_rows)
    if line_ends:
        data[LINE_END] = nested(line_rows)
    return reasoning, answer


def remove_masks(data: TensorDict) -> None:
    """Remove what :func:`add_outcome_masks` added."""
    for key in (REASONING, PREDICT, LINE_END):
        if key in data.keys():
            del data[key]


def autocast_context(engine) -> AbstractContextManager:
    """The mixed-precision context the engine runs its forward under (none for fp32)."""
    from verl.utils.device import get_device_name

    dtype = getattr(engine, "_autocast_dtype", torch.bfloat16)
    return nullcontext() if dtype == torch.float32 else torch.autocast(device_type=get_device_name(), dtype=dtype)
