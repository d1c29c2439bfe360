"""ACPO's token signal and weights of one response, with plain transformers, for the heatmap; why CoDaPO has none.

ACPO (``core.acpo``): training reads the surrogate entropy H~_t of every response token from verl's old-log-prob
pass (``integration.modal_signal``; ``engines.fsdp.modal`` adds the top-1 log-prob to that pass). Here, from one
forward of prompt + response, logits at the positions predicting the response tokens divided by the temperature
(verl's pass divides by the rollout's), in float64:

* ``modal``: H~_t = -log p_max,t = logsumexp(z/T) - max(z/T)   (what ``top1_log_probs`` computes, in float32);
* ``sampled``: -log p(y_t);   ``shannon``: the entropy of softmax(z/T) (verl's ``entropy``).

The weights w_t are ``core.acpo.acpo_weights`` of H~ for one response whose GRPO advantage is ``advantage``
(only its sign matters: > 0 success, < 0 failure, 0 gives weight 1 everywhere), over every response token (ACPO
reweights the whole response, not only OAR's reasoning tokens).

CoDaPO's credit is a per-question value v_q = c_q * V_d + offset from the *group*: its accuracy (how many of the
question's responses were right) and its confidence (the mean old log-prob over all of them). One response does
not determine it, so the recompute mode refuses ``codapo`` (:data:`CODAPO_NEEDS_GROUP`); a dump of a CoDaPO run
(``--dump``) shows the value the run applied.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verl_oar.core.acpo import ACPOConfig, acpo_advantages

__all__ = ["CODAPO_NEEDS_GROUP", "acpo_signal", "response_logits"]

CODAPO_NEEDS_GROUP = (
    "codapo cannot be recomputed from one response: its value v_q = c_q * V_d + weight_offset is one number per "
    "question, from the accuracy and mean old log-prob of the question's whole group of responses, and it scales "
    "every token alike (no per-token signal). Draw what a CoDaPO run applied from its dump: "
    "--dump <dump_dir>/step_N.pt --tokenizer <model path> (the run needs +algorithm.oar.dump_dir=DIR)"
)


def response_logits(model, prompt_ids: list[int], response_ids: list[int], temperature: float) -> Tensor:
    """(T, V) float64 logits / temperature at the positions predicting the T response tokens."""
    if not prompt_ids:
        raise ValueError("an empty prompt: the first response token has no predicting position")
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor([prompt_ids + response_ids], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]
    return logits.double().cpu() / temperature


def acpo_signal(model, sample, temperature: float, advantage: float, cfg: ACPOConfig | None = None
                ) -> tuple[Tensor, Tensor]:
    """(surrogate H~ (T,) float32 nats, weights w (T,) float32) of ``sample``'s response (module docstring)."""
    cfg = cfg or ACPOConfig()
    z = response_logits(model, sample.prompt_ids, sample.response_ids, temperature)
    log_probs = torch.log_softmax(z, dim=-1)
    if cfg.surrogate == "modal":
        surrogate = -log_probs.max(dim=-1).values
    elif cfg.surrogate == "sampled":
        surrogate = -log_probs.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]
    else:
        surrogate = -(log_probs.exp() * log_probs).sum(-1)
    mask = torch.ones(1, len(surrogate), dtype=torch.bool)
    result = acpo_advantages(surrogate[None], torch.tensor([float(advantage)]), mask, cfg)
    return surrogate.float(), result.weights[0]
