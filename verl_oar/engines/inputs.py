"""What OAR's engine passes add to verl's worker batch before micro-batching, and share.

verl keeps each sample as one unpadded row of prompt + response tokens (nested, jagged). The masks
below are full-sequence rows in that same form, so the engine's own micro-batching (and dynamic
batch size reordering) splits them together with ``input_ids``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from tensordict import TensorDict

from verl_oar.core.answer_span import line_break_tokens

REASONING = "oar_reasoning_full"
"""(bs, seq_len) nested int64: 1 on reasoning tokens"""
PREDICT = "oar_predict_full"
"""(bs, seq_len) nested int64: 1 where the logits predict an answer token"""
LINE_END = "oar_line_end_full"
"""(bs, seq_len) nested int64: 1 on response tokens containing a line break (OAR-P ``line`` mode)"""
ANSWER_SPAN = "oar_answer_span"
"""(bs, 3) int64, optional, set by the trainer: the reward's graded answer span (marker_start, start,
end) in characters of the decoded response; -1 where the reward gave none"""
SOURCE_NONE, SOURCE_LOCATOR, SOURCE_REWARD, SOURCE_REWARD_REJECTED = 0, 1, 2, 3
"""where an answer came from (``oar_answer_source``; see ``importance_signal.ANSWER_SOURCES``)"""


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def padded(rows: torch.Tensor, pad: int = 0) -> torch.Tensor:
    return torch.nested.to_padded_tensor(rows, padding=pad)


def rollout_temperature(micro_batch: TensorDict) -> torch.Tensor | float:
    """The rollout temperature verl put in the batch: (bs,) float32 when it varies per sample (a
    tensor of several values), else one float. Each engine path spreads it over its own layout."""
    temperature = micro_batch["temperature"]
    if isinstance(temperature, torch.Tensor) and temperature.numel() > 1:
        return temperature.to(torch.float32).reshape(-1)
    return float(temperature.item() if isinstance(temperature, torch.Tensor) else temperature)


def add_outcome_masks(
    data: TensorDict, tokenizer, locator=None, line_ends: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Locate each response's final answer and add full-sequence masks to ``data``.

    Reads ``prompts``, ``responses`` and ``response_mask`` (nested (bs, len)), and the optional
    ``ANSWER_SPAN`` (bs, 3) the trainer adds when the reward graded a known span. The answer is
    located in the response's text as verl's reward managers decode it (every response token,
    ``skip_special_tokens=True``): by the reward's span where given and it fits that text, else by
    ``locator`` (default ``answer_span.find_answer_span``). Reasoning and answer tokens are then
    restricted to ``response_mask`` (the model's own tokens: a multi-turn response's tool outputs
    are context, never reshaped). Adds ``REASONING`` and ``PREDICT`` (and ``LINE_END`` if
    ``line_ends``), nested (bs, prompt_len + response_len) int64 0/1.

    Returns:
        (reasoning, answer, source): padded (bs, max_response_len) int64 response-level masks, and
        (bs,) int64 where each answer came from: 0 none, 1 the locator, 2 the reward's span, 3 the
        reward's span did not fit the text (the locator was used; counted in ``oar/answer/*``).
    """
    from verl_oar.core.answer_span import AnswerSpan, answer_token_masks

    responses, response_mask = data["responses"], data["response_mask"]
    prompt_lens = data["prompts"].offsets().diff().tolist()
    response_lens = responses.offsets().diff().tolist()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    resp_mask = padded(response_mask).bool()
    ids = padded(responses, pad_id)
    whole = torch.arange(ids.shape[1])[None, :] < torch.tensor(response_lens)[:, None]
    given = data[ANSWER_SPAN].cpu() if ANSWER_SPAN in data.keys() else None
    reasoning = torch.zeros(ids.shape, dtype=torch.bool)
    answer = torch.zeros(ids.shape, dtype=torch.bool)
    source = torch.zeros(len(response_lens), dtype=torch.int64)
    for row in range(len(response_lens)):  # one text pass per row; a span that does not fit is counted
        span = None if given is None or int(given[row, 0]) < 0 else AnswerSpan(*map(int, given[row].tolist()))
        args = (ids[row : row + 1], whole[row : row + 1], tokenizer, locator)
        if span is not None:
            try:
                r, a, found = answer_token_masks(*args, spans=[span])
                code = SOURCE_REWARD
            except ValueError:
                span = None
                code = SOURCE_REWARD_REJECTED
        if span is None:
            r, a, found = answer_token_masks(*args)
            code = SOURCE_LOCATOR if given is None or int(given[row, 0]) < 0 else SOURCE_REWARD_REJECTED
        reasoning[row], answer[row] = r[0] & resp_mask[row], a[0] & resp_mask[row]
        source[row] = code if bool(found[0]) and bool(answer[row].any()) else SOURCE_NONE
    reasoning, answer = reasoning.long(), answer.long()
    reasoning_rows, predict_rows, line_rows = [], [], []
    for i, (p, r, row_ids) in enumerate(zip(prompt_lens, response_lens, responses.unbind(), strict=True)):
        full_reasoning = torch.zeros(p + r, dtype=torch.int64)
        full_reasoning[p:] = reasoning[i, :r]
        full_predict = torch.zeros(p + r, dtype=torch.int64)
        full_predict[p - 1 : p + r - 1] = answer[i, :r]  # the logits at t-1 predict token t
        reasoning_rows.append(full_reasoning)
        predict_rows.append(full_predict)
        if line_ends:
            full_line = torch.zeros(p + r, dtype=torch.int64)
            full_line[p:] = torch.tensor(line_break_tokens(row_ids.tolist(), tokenizer), dtype=torch.int64)
            line_rows.append(full_line)
    data[REASONING] = nested(reasoning_rows)
    data[PREDICT] = nested(predict_rows)
    if line_ends:
        data[LINE_END] = nested(line_rows)
    return reasoning, answer, source


def remove_masks(data: TensorDict) -> None:
    """Remove what :func:`add_outcome_masks` added."""
    for key in (REASONING, PREDICT, LINE_END):
        if key in data.keys():
            del data[key]


def autocast_dtype(engine) -> torch.dtype:
    """The dtype verl's FSDP engine autocasts its forward to, from the engine's public config as verl derives it in
    ``FSDPEngine._build_fsdp_module``: ``engine_config.mixed_precision["param_dtype"]`` (default bf16), bf16 when
    the config has no mixed-precision section (verl's default too). Mirrored, not read from the engine's private
    attribute; the fused pass's bit-identity tests compare the two paths in fp32 and bf16."""
    from verl.utils.torch_dtypes import PrecisionType

    mixed_precision = getattr(getattr(engine, "engine_config", None), "mixed_precision", None)
    if not mixed_precision:
        return torch.bfloat16
    return PrecisionType.to_dtype(mixed_precision.get("param_dtype", "bf16"))


def autocast_context(engine) -> AbstractContextManager:
    """The mixed-precision context the engine runs its forward under (none for fp32)."""
    from verl.utils.device import get_device_name

    dtype = autocast_dtype(engine)
    return nullcontext() if dtype == torch.float32 else torch.autocast(device_type=get_device_name(), dtype=dtype)
