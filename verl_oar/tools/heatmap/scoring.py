"""The credit of one response, per estimator, with plain transformers: each a (T,) row over its response tokens.

1. OAR-G (:func:`oar_g_importance`: ``core.hf.hf_importance`` with ``OARConfig.gradient_config()``: by default
   AS-MEAN, noisy KL, grad x input; noise drawn from a generator seeded with the settings' seed; clean logits from a
   no-grad forward) and OAR-P (:func:`oar_p_importance`: ``core.hf.hf_importance`` with
   ``OARConfig.perturbation_config()``, prefix sharing where the model allows it), logits divided by the temperature
   as the worker divides by the rollout's.
2. OAR weights (:func:`oar_weights`: ``reshape.importance_to_weights`` with that ``OARConfig``'s reshaping) of each
   estimator's importance: what training would multiply the response's GRPO advantage by.
3. CSCR and OPPO (``privileged``): their token signal (sensitivity, evidence) as a score row and their weights as a
   w~ row, from re-scoring the response under the rewritten prompt; ACPO (``modal``): the surrogate entropy as a
   score row, its weights for a response of GRPO advantage ``advantage`` as a w~ row.
4. An oracle (:data:`Oracle`): known causal tokens per response, drawn under the scores.

:func:`score_sample` runs the estimators asked for on one :class:`~verl_oar.tools.heatmap.inputs.Sample` with the
settings ``settings.resolve_settings`` chose.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from verl_oar.core.answer_span import line_break_tokens, token_texts
from verl_oar.core.config import OARConfig
from verl_oar.core.gradient import GradientConfig
from verl_oar.core.hf import can_share_prefix, hf_importance
from verl_oar.core.perturbation import PerturbationConfig
from verl_oar.core.reshape import Fallback, importance_to_weights
from verl_oar.tools.heatmap.inputs import HeatmapInputError, Sample
from verl_oar.tools.heatmap.settings import Settings
from verl_oar.tools.heatmap.modal import acpo_signal
from verl_oar.tools.heatmap.privileged import PRIVILEGED, cscr_signal, oppo_signal

__all__ = ["DEFAULT_ESTIMATORS", "ESTIMATORS", "Oracle", "neutral_id", "oar_g_importance", "oar_p_importance",
           "oar_weights", "parse_estimators", "run_estimators", "score_sample"]

ESTIMATORS = ("oar_g", "oar_p", *PRIVILEGED, "acpo", "codapo")
"""every registered estimator; ``codapo`` only from a dump (``--dump``): it needs the whole group"""
DEFAULT_ESTIMATORS = "oar_g,oar_p"
"""--estimators without the flag when no --config names a run of one of :data:`ESTIMATORS` (:func:`run_estimators`)"""

Oracle = Callable[[list[int], Any], "dict[str, list[bool]] | None"]
"""``oracle(response_ids, tokenizer)``: named (T,) masks of known causal tokens of one response
(drawn as "oracle <name>" under the scores), or None when it has none for this response."""


def run_estimators(given: str | None, run_estimator: str | None, default: str) -> tuple[list[str], str]:
    """The estimators a recompute scores and where they came from: ``--estimators`` when given; else the run's
    ``algorithm.adv_estimator`` (``--config``) when it is one of :data:`ESTIMATORS`, so that a heatmap shows the
    credit the run used; else ``default`` (a GRPO run, or no --config). CoDaPO reweights whole groups: a run of it
    is refused here with the fix (draw its dump)."""
    if given is not None:
        return parse_estimators(given), "--estimators"
    if run_estimator == "codapo":
        raise HeatmapInputError("the --config run trains codapo, whose weights need the whole group: draw a dump of "
                                "the run (--dump), or name the estimators to recompute (--estimators oar_g,...)")
    if run_estimator in ESTIMATORS:
        return [run_estimator], "--config's algorithm.adv_estimator"
    why = f"--config's algorithm.adv_estimator is {run_estimator}" if run_estimator else "no --config"
    return parse_estimators(default), f"tool default ({why})"


def parse_estimators(text: str) -> list[str]:
    """``--estimators oar_g,oar_p``: the names, each once, in order."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in ESTIMATORS]
    if unknown or not names:
        raise HeatmapInputError(f"--estimators {text!r}: choose from {', '.join(ESTIMATORS)} (comma-separated)")
    return list(dict.fromkeys(names))


def neutral_id(tokenizer, choice: str) -> int:
    """The OAR-P occlusion token: ``pad`` (the worker's default: pad, else eos), ``space`` or an id."""
    if choice == "pad":
        from verl_oar.core.config import neutral_token_id

        return neutral_token_id(OARConfig(), tokenizer)
    if choice == "space":
        ids = tokenizer.encode(" ", add_special_tokens=False)
        if len(ids) != 1:
            raise HeatmapInputError(f"--neutral space: a space is {len(ids)} tokens for this tokenizer; give an id")
        return ids[0]
    if choice.isdigit() and int(choice) < len(tokenizer):
        return int(choice)
    raise HeatmapInputError(f"--neutral {choice!r}: use pad, space or a token id below {len(tokenizer)}")


def oar_g_importance(model, sample: Sample, cfg: GradientConfig, seed: int, temperature: float = 1.0) -> Tensor:
    """OAR-G importance (T,) float32 of the response tokens, 0 off the reasoning tokens (one sequence,
    noise from a CPU generator seeded with ``seed``)."""
    device = model.get_input_embeddings().weight.device
    ids = sample.ids.to(device)[None]
    reasoning, answer = (m.to(device)[None] for m in sample.full_masks())
    full = hf_importance(model, ids, reasoning, answer, cfg, attention_mask=torch.ones_like(ids),
                         temperature=temperature, generator=torch.Generator().manual_seed(seed))
    return full[0, len(sample.prompt_ids):].cpu()


def oar_p_importance(
    model, sample: Sample, cfg: PerturbationConfig, neutral_id: int, max_tokens: int, tokenizer,
    temperature: float = 1.0,
) -> Tensor:
    """OAR-P importance (T,) float32 of the response tokens, 0 off the reasoning tokens."""
    device = model.get_input_embeddings().weight.device
    ids = sample.ids.to(device)[None]
    reasoning, answer = (m.to(device)[None] for m in sample.full_masks())
    line_end = None
    if cfg.mode == "line":
        line_end = torch.tensor([[False] * len(sample.prompt_ids) + line_break_tokens(sample.response_ids, tokenizer)])
    full = hf_importance(model, ids, reasoning, answer, cfg, temperature=temperature, neutral_id=neutral_id,
                         max_tokens=max_tokens, line_end=None if line_end is None else line_end.to(device))
    return full[0, len(sample.prompt_ids):].cpu()


def oar_weights(importance: Tensor, reasoning: Sequence[bool], cfg: OARConfig) -> tuple[list[float], str]:
    """OAR token weights (T,) of one response (1.0 off the reasoning tokens) and the fallback's
    name (``NONE`` when the row is reshaped)."""
    result = importance_to_weights(
        importance[None].float(), torch.tensor([list(reasoning)]), cfg.reshape_config(),
        answer_found=torch.tensor([True]),
    )
    return result.weights[0].tolist(), Fallback(int(result.fallback[0])).name


def score_sample(model, tokenizer, sample: Sample, estimators: Sequence[str], settings: Settings,
                 neutral: int | None, *, oracle: Oracle | None = None, answer: str | None = None,
                 reward: float = 1.0, advantage: float = 1.0) -> dict:
    """Everything the JSON holds about one sample: ids, tokens, masks, and per estimator its ``scores`` (T,),
    ``weights`` (T,) and ``fallback``. ``neutral``: OAR-P's occlusion token id; ``oracle``: its masks go into
    ``record["oracle"]``; ``answer`` and ``reward``: OPPO's reference answer and the response's reward;
    ``advantage``: ACPO's GRPO advantage of the response."""
    oar = settings.oar
    record: dict[str, Any] = {
        "row": sample.row, "prompt": sample.prompt_text, "response": sample.response_text,
        "chat_template": sample.chat_template, "prompt_ids": sample.prompt_ids, "response_ids": sample.response_ids,
        "tokens": token_texts(sample.response_ids, tokenizer), "reasoning": sample.reasoning, "answer": sample.answer,
        "answer_text": tokenizer.decode([t for t, a in zip(sample.response_ids, sample.answer) if a],
                                        skip_special_tokens=True),
        "scores": {}, "weights": {}, "fallback": {}, "notes": list(sample.notes),
    }
    for name in estimators:
        if name in PRIVILEGED:
            if name == "cscr":
                signal, weights = cscr_signal(model, tokenizer, sample, settings.temperature, settings.cscr)
            else:
                signal, weights = oppo_signal(model, tokenizer, sample, answer, reward, settings.temperature,
                                              settings.oppo)
            # the heat row shows positive values: OPPO's evidence by magnitude (its sign is the w~ row's colour)
            record["scores"][name] = signal.abs().tolist()
            record["signed_scores"] = {**record.get("signed_scores", {}), name: signal.tolist()}
            record["weights"][name], record["fallback"][name] = weights.tolist(), "NONE"
            continue
        if name == "acpo":
            surrogate, weights = acpo_signal(model, sample, settings.temperature, advantage, settings.acpo)
            record["scores"][name], record["weights"][name] = surrogate.tolist(), weights.tolist()
            record["fallback"][name] = "NONE"
            continue
        if name == "oar_g":
            importance = oar_g_importance(model, sample, oar.gradient_config(), settings.seed, settings.temperature)
        else:
            pcfg = oar.perturbation_config(share_prefix=can_share_prefix(model))
            importance = oar_p_importance(model, sample, pcfg, neutral, settings.max_tokens, tokenizer,
                                          settings.temperature)
        record["scores"][name] = importance.tolist()
        record["weights"][name], record["fallback"][name] = oar_weights(importance, sample.reasoning, oar)
    if oracle is not None:
        masks = oracle(sample.response_ids, tokenizer)
        record["oracle"] = None if masks is None else {name: [bool(v) for v in m] for name, m in masks.items()}
        if masks is None:
            record["notes"].append("oracle: none for this response")
    return record
