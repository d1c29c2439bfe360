"""CSCR's and OPPO's token signals and weights of one response, with plain transformers, for the heatmap.

What training computes per response (``integration.privileged_signal`` + ``core.cscr`` / ``core.oppo``),
on one sequence at a time:

* log-probs of the response tokens (T,) under the rollout prompt and under each rewritten prompt
  (``core.privileged_prompt.rewrite_messages`` on the prompt's chat messages, the chat template applied
  with ``add_generation_prompt=True``), logits divided by the temperature; the shift is their difference;
* CSCR: sensitivity ``max(|shift+|, |shift-|)`` and its weights ``w~`` (``core.cscr`` with the run's ``algorithm.cscr``
  from ``--config``, else its defaults; OPPO likewise reads ``algorithm.oppo``);
  departure: the quantile threshold is taken over this response's tokens (training: over the batch's);
* OPPO: evidence (the shift under the oracle prompt with the reference answer) and the token advantages
  of the response for reward ``reward`` from the prior 1/2, shown as ``w~ = A_t * T / (R - V_0)``: the
  credit relative to spreading the response's outcome evenly over its tokens (1 = even, as GRPO; 0 = none).
  One response is a group of one, so the group keys are set for the picture whatever the config says:
  ``prior=half`` (the group's success rate is unknown), ``zero_uniform_groups=False`` (a group of one is
  "uniform" and training would zero it) and ``scale=none`` (its reward std is 0; ``group_std`` divides every
  advantage of a group by the same number, which changes the credit's size, not its shape over the tokens,
  and w~ shows the shape). The config's other keys (form, state_weight, terminal, anchor, clip, template)
  are used as given.

Every response token counts (training's response mask), not only the reasoning tokens OAR scores.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from verl_oar.core.cscr import CSCRConfig, cscr_advantages
from verl_oar.core.oppo import OPPOConfig, oppo_advantages
from verl_oar.core.privileged_prompt import rewrite_messages

__all__ = ["PRIVILEGED", "cscr_signal", "oppo_signal", "response_log_probs", "rewritten_prompt_ids"]

PRIVILEGED = ("cscr", "oppo")
"""the heatmap's estimators that re-score the response under a rewritten prompt"""


def rewritten_prompt_ids(tokenizer, messages: list[dict] | None, text: str, template: str, answer: str = "") -> list[int]:
    """Prompt ids with the last user turn rewritten from ``template``: through the chat template when the
    prompt was a message list (``messages``), else the raw ``text`` rewritten and encoded with the
    tokenizer's own special tokens (as the heatmap encodes a raw prompt)."""
    if messages is None:
        (rewritten,) = rewrite_messages([{"role": "user", "content": text}], template, answer)
        return tokenizer.encode(rewritten["content"], add_special_tokens=True)
    rendered = tokenizer.apply_chat_template(rewrite_messages(messages, template, answer), add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def response_log_probs(model, prompt_ids: list[int], response_ids: list[int], temperature: float) -> Tensor:
    """(T,) float64 log-probs of the response tokens after ``prompt_ids`` at ``temperature``; the
    first response token needs a prompt token before it."""
    if not prompt_ids:
        raise ValueError("an empty prompt: the first response token has no predicting position")
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([prompt_ids + response_ids], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt_ids):, None])[:, 0].cpu()


def _shift(model, tokenizer, sample: Any, template: str, answer: str, temperature: float, base: Tensor) -> Tensor:
    ids = rewritten_prompt_ids(tokenizer, sample.messages, sample.prompt_source, template, answer)
    return response_log_probs(model, ids, sample.response_ids, temperature) - base


def cscr_signal(model, tokenizer, sample: Any, temperature: float, cfg: CSCRConfig | None = None) -> tuple[Tensor, Tensor]:
    """(sensitivity, weights), each (T,) float32: CSCR's token signal (nats) and its weights w~."""
    cfg = cfg or CSCRConfig()
    base = response_log_probs(model, sample.prompt_ids, sample.response_ids, temperature)
    pos = _shift(model, tokenizer, sample, cfg.pos_template, "", temperature, base)
    neg = _shift(model, tokenizer, sample, cfg.neg_template, "", temperature, base)
    mask = torch.ones(1, len(base), dtype=torch.bool)
    result = cscr_advantages(torch.ones(1), pos[None], neg[None], mask, cfg)
    return result.sensitivity[0], result.weights[0]


def oppo_signal(model, tokenizer, sample: Any, answer: str, reward: float, temperature: float,
                cfg: OPPOConfig | None = None) -> tuple[Tensor, Tensor]:
    """(evidence, weights), each (T,) float32: OPPO's oracle evidence (nats) and ``A_t T / (R - V_0)``
    for reward ``reward`` from the prior 1/2 (0 everywhere when ``reward`` is 1/2: no direction). Any valid
    ``cfg``; its group keys are overridden for a group of one (module docstring)."""
    cfg = replace(cfg or OPPOConfig(), prior="half", zero_uniform_groups=False, scale="none")
    base = response_log_probs(model, sample.prompt_ids, sample.response_ids, temperature)
    evidence = _shift(model, tokenizer, sample, cfg.template, answer, temperature, base)
    t = len(base)
    result = oppo_advantages(evidence[None], torch.tensor([float(reward)]), torch.zeros(1, dtype=torch.long),
                             torch.ones(1, t, dtype=torch.bool), cfg)
    gap = float(reward) - 0.5
    weights = result.advantages[0] * t / gap if gap != 0 else torch.zeros(t)
    return evidence.float(), weights.float()
