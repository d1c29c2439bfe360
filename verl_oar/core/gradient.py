"""OAR-G: token importance from one gradient of the outcome w.r.t. the input embeddings.

With e_t the input embedding of token t and an outcome objective J (``verl_oar.core.outcome``):

1. objective, either
   * ``noisy_kl`` (reference semantics): e~_t = e_t + eps_t on reasoning tokens, eps_t ~ N(0, sigma_t^2 I)
     with sigma_t = sigma (``noise_relative=False``, the reference's 1e-3) or sigma * rms(e_t)
     (``noise_relative=True``: sigma is a noise-to-signal ratio per token, the same for every model);
     J = sum_i D_i(clean || noisy), with D = KL(P_final || P~_final) (AS-SINGLE / AS-MEAN) or
     D = phi - phi~ (AS-JOINT). The noise is what makes the gradient non-zero: at e~ = e the KL is
     at its minimum and its gradient vanishes.
   * ``loglik``: J = sum_i phi_i, the answer log-likelihood itself; no noise, no clean pass.
2. one backward:  g_t = dJ / de_t   (``torch.autograd.grad`` w.r.t. the embeddings only)
3. saliency, either
   * ``grad_x_input`` (default, the reference code's): I_t = |<g_t, e_t>|, the first-order change
     of J when the token's embedding is scaled to 0 -- the same question OAR-P asks by deleting it;
   * ``grad_norm`` (the paper's summary): I_t = ||g_t||_2.

J is summed over sequences; attention does not cross sequences, so g_t only carries its own
sequence's objective. Nothing is left behind: no ``.backward()``, parameters' ``.grad`` and
``requires_grad`` are not touched, no hooks. Deliberate departures from the reference code: the
gradient is taken w.r.t. the embeddings only (the reference's ``J.backward()`` accumulated into the
policy's parameter gradients), and the whole batch (padded or packed) is done in one pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from verl_oar.core.outcome import (
    OUTCOMES,
    answer_log_likelihood,
    kl_to_logits,
    outcome_divergence,
    outcome_statistic,
    pooled_outcome_logits,
)

__all__ = [
    "OBJECTIVES",
    "SALIENCIES",
    "GradientConfig",
    "gradient_importance",
    "embedding_noise",
    "gradient_importance_in_forward",
]

OBJECTIVES = ("noisy_kl", "loglik")
"""What J is: the divergence of a noisy pass from the clean one, or the answer log-likelihood."""
SALIENCIES = ("grad_x_input", "grad_norm")
"""How g_t becomes a number: |<g_t, e_t>| or ||g_t||_2."""


@dataclass(frozen=True)
class GradientConfig:
    """OAR-G settings."""

    outcome: str = "mean"
    """Outcome definition for ``noisy_kl``: "single" | "mean" | "joint" (paper's AS-*; AS-MEAN was best).
    Not used by ``loglik``, whose J is always phi."""

    objective: str = "noisy_kl"
    """"noisy_kl": J = D(clean || noisy) with Gaussian noise on the reasoning embeddings (reference
    semantics; one extra no-grad forward unless ``clean_logits`` is passed). "loglik": J = phi."""

    saliency: str = "grad_x_input"
    """"grad_x_input": |<dJ/de_t, e_t>| (reference code; default because it estimates the effect of
    removing the token, as OAR-P measures). "grad_norm": ||dJ/de_t||_2 (paper's summary)."""

    noise_std: float = 0.2
    """sigma, the scale of the embedding noise of ``noisy_kl`` (> 0): its ratio to each token's
    embedding RMS (``noise_relative=True``, the default) or its standard deviation
    (``noise_relative=False``; the reference code's 1e-3). The noise is added in the embeddings'
    dtype (bf16 in real runs)."""

    noise_relative: bool = True
    """Scale each token's noise by the RMS of its own embedding, sqrt(mean_h e_{t,h}^2), so that
    sigma is a noise-to-signal ratio: the same value means the same perturbation on any model and
    dtype (an absolute 1e-3 is 5% of a 0.02-RMS embedding but 0.1% of a 1.0-RMS one). The default
    (relative, 0.2) was chosen by measurement: on the first testbed's warm-started models, 2 and 4 layers,
    3 seeds each, it is the smallest of the relative scales 0.01 / 0.05 / 0.1 / 0.2 whose bf16
    importance meets the agreement target with fp32 on every seed (top-10% overlap >= 0.8, recall@10%
    within 0.05), where the reference's absolute 1e-3 misses it at 4 layers (overlap 0.79);
    ``benchmarks/bf16_agreement.py``, docs/configuration.md."""

    def __post_init__(self) -> None:
        for name, valid in (("outcome", OUTCOMES), ("objective", OBJECTIVES), ("saliency", SALIENCIES)):
            if getattr(self, name) not in valid:
                raise ValueError(f"GradientConfig.{name}={getattr(self, name)!r} is invalid: must be one of {valid}")
        if not isinstance(self.noise_relative, bool):
            raise ValueError(f"GradientConfig.noise_relative={self.noise_relative!r} is invalid: must be true or false")
        std = self.noise_std
        if isinstance(std, bool) or not isinstance(std, (int, float)) or not 0.0 <= std < math.inf:
            raise ValueError(f"GradientConfig.noise_std={std!r} is invalid: must be a finite number >= 0")
        if self.objective == "noisy_kl" and std == 0:
            raise ValueError(
                "GradientConfig.noise_std=0 is invalid with objective='noisy_kl': must be > 0 "
                "(without noise the KL gradient is exactly zero)"
            )


def gradient_importance(
    logits_fn: Callable[[Tensor], Tensor],
    embeds: Tensor,
    reasoning_mask: Tensor,
    predict_mask: Tensor,
    targets: Tensor,
    segment: Tensor,
    num_segments: int,
    cfg: GradientConfig,
    generator: torch.Generator | None = None,
    clean_logits: Tensor | None = None,
    noise: Tensor | None = None,
) -> Tensor:
    """OAR-G token importance of a batch whose input embeddings the caller computes.

    Args:
        logits_fn: inputs_embeds (B, T, H) -> logits (B, T, V); a model forward closing over its
            attention mask / position ids (see :func:`verl_oar.core.hf.make_hf_logits_fn`).
        embeds: (B, T, H) float, the clean input embeddings (detached here). Padded layout: (B, T)
            rows; packed layout: (1, total_nnz). Padding positions may hold anything finite.
        Everything else as in :func:`gradient_importance_in_forward`.

    Returns:
        (B, T) float32 importance, as :func:`gradient_importance_in_forward`.
    """
    clean = embeds.detach()

    def forward(transform: Callable[[Tensor], Tensor]) -> Tensor:
        return logits_fn(transform(clean))

    return gradient_importance_in_forward(
        forward, reasoning_mask, predict_mask, targets, segment, num_segments, cfg,
        generator=generator, clean_logits=clean_logits, noise=noise,
    )


def gradient_importance_in_forward(
    forward: Callable[[Callable[[Tensor], Tensor]], Tensor],
    reasoning_mask: Tensor,
    predict_mask: Tensor,
    targets: Tensor,
    segment: Tensor,
    num_segments: int,
    cfg: GradientConfig,
    generator: torch.Generator | None = None,
    clean_logits: Tensor | None = None,
    noise: Tensor | None = None,
) -> Tensor:
    """OAR-G token importance of a batch, with the embeddings produced inside the model's forward.

    For models whose embedding layer must run inside their own forward (FSDP shards it): the gradient
    is taken w.r.t. the embedding *output*, which ``forward`` hands to ``transform``.

    Args:
        forward: ``forward(transform)`` runs the model once with its input embeddings e (B, T, H)
            replaced by ``transform(e)`` (e.g. a forward hook on the embedding module returning
            ``transform(output)``) and returns logits, either (B, T, V) or only those at the
            predicting positions, (N, V) in the row-major order of ``predict_mask.nonzero()`` (lets
            the model skip its output layer elsewhere, e.g. with transformers' ``logits_to_keep``). Called once with grad and, for
            ``noisy_kl`` without ``clean_logits``, once under no_grad with an identity transform.
            ``transform`` must be applied exactly once per call.
        reasoning_mask: (B, T) bool, positions that get noise and an importance.
        predict_mask: (B, T) bool, predicting positions (their logits predict an answer token).
        targets: (B, T) long, the token predicted at each position (the next input id); read only
            at predicting positions.
        segment: (B, T) long, the sequence of each position in [0, S) (row index when padded; from
            cu_seqlens when packed); read only at predicting positions (may be -1 elsewhere).
        num_segments: S.
        cfg: objective, outcome, saliency and noise.
        generator: draws the noise ``noise_std * randn(e.shape)`` (float64 if e is float64, else
            float32, on the generator's device, then cast to e's dtype and device) and zeroes it off
            the reasoning positions; None uses the global RNG of e's device. Unused by ``loglik``.
        clean_logits: optional (B, T, V) logits of the clean pass, reused instead of a second forward.
        noise: optional (B, T, H) standard-normal draws used instead of ``generator`` (e.g. drawn per
            sequence by :func:`verl_oar.core.noise.sequence_noise`, so that importance does not
            depend on how sequences are batched, packed or split into micro-batches).

    Returns:
        (B, T) float32 importance >= 0 on the masks' device; exactly 0 outside ``reasoning_mask``, and
        everywhere when there is no predicting position. Non-finite model outputs propagate (reshaping
        then falls back). Works inside ``torch.no_grad`` (grad is re-enabled locally), not inside
        ``torch.inference_mode``.
    """
    shape = tuple(reasoning_mask.shape)
    for name, tensor in (("predict_mask", predict_mask), ("targets", targets), ("segment", segment)):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape} like reasoning_mask")
    reasoning = reasoning_mask.to(torch.bool)
    predict = predict_mask.to(torch.bool)
    zeros = torch.zeros(shape, dtype=torch.float32, device=reasoning.device)
    if not bool(predict.any()) or not bool(reasoning.any()):
        return zeros
    seg, tgt = segment[predict].long(), targets[predict].long()

    clean = None
    if cfg.objective == "noisy_kl":                       # clean outcome first: only (S, V) is kept
        with torch.no_grad():
            logits = clean_logits if clean_logits is not None else forward(lambda e: e)
            picked = _at_predicting_positions(logits.detach(), predict)
            del logits
            clean = outcome_statistic(picked, tgt, seg, num_segments, cfg.outcome)
            del picked

    seen: dict[str, Tensor] = {}

    def perturb(e: Tensor) -> Tensor:
        if tuple(e.shape[:2]) != shape:
            raise ValueError(f"embeddings have shape {tuple(e.shape)}, expected {shape} + (H,)")
        base = e.detach()
        leaf = base.detach().requires_grad_(True)
        seen["base"], seen["leaf"] = base, leaf
        if cfg.objective != "noisy_kl":
            return leaf
        if noise is not None:
            if tuple(noise.shape) != tuple(base.shape):
                raise ValueError(f"noise has shape {tuple(noise.shape)}, expected {tuple(base.shape)}")
            draws = noise
        else:
            draw_dtype = torch.float64 if base.dtype == torch.float64 else torch.float32
            draw_device = generator.device if generator is not None else base.device
            draws = torch.randn(base.shape, generator=generator, device=draw_device, dtype=draw_dtype)
        return leaf + embedding_noise(base, draws.to(base.device), reasoning.to(base.device), cfg)

    with torch.enable_grad():
        picked = _at_predicting_positions(forward(perturb), predict)  # (N, V): only these are kept
        if "leaf" not in seen:
            raise RuntimeError("forward(transform) returned without applying transform to the embeddings")
        if cfg.objective == "loglik":
            objective = answer_log_likelihood(picked, tgt, seg, num_segments).sum()
        elif cfg.outcome == "joint":
            noisy = outcome_statistic(picked, tgt, seg, num_segments, cfg.outcome)
            objective = outcome_divergence(clean, noisy, cfg.outcome).sum()
        else:  # KL with the exact gradient softmax(z) - P: exactly 0 when the noise is 0
            objective = kl_to_logits(clean, pooled_outcome_logits(picked, seg, num_segments, cfg.outcome)).sum()
        del picked
        grad = None
        if objective.requires_grad:
            (grad,) = torch.autograd.grad(objective, [seen["leaf"]], allow_unused=True)
    if grad is None:
        return zeros

    base = seen["base"]
    dtype = torch.promote_types(base.dtype, torch.float32)
    g = grad.to(dtype)
    if cfg.saliency == "grad_x_input":
        score = (g * base.to(dtype)).sum(dim=-1).abs()
    else:
        score = torch.linalg.vector_norm(g, dim=-1)
    score = score.to(reasoning.device)
    return torch.where(reasoning, score, 0.0).to(torch.float32)


def embedding_noise(base: Tensor, draws: Tensor, mask: Tensor, cfg: GradientConfig) -> Tensor:
    """The noise eps added to the input embeddings, in ``base``'s dtype: 0 off ``mask``.

    Args:
        base: (..., H) the clean embeddings e (any float dtype).
        draws: (..., H) standard-normal draws z (float32 or float64), same shape and device.
        mask: (...) bool, the positions that get noise.
        cfg: ``noise_std`` sigma and ``noise_relative``.

    Returns:
        sigma * z (absolute) or sigma * rms(e_t) * z (relative), computed in float32 (float64 for
        float64 draws) and cast once to ``base.dtype``; exactly 0 where ``mask`` is False.
    """
    if tuple(draws.shape) != tuple(base.shape):
        raise ValueError(f"noise has shape {tuple(draws.shape)}, expected {tuple(base.shape)}")
    scale = draws * cfg.noise_std
    if cfg.noise_relative:
        rms = base.detach().to(draws.dtype).pow(2).mean(dim=-1, keepdim=True).sqrt()
        scale = scale * rms
    return torch.where(mask.unsqueeze(-1), scale, 0.0).to(base.dtype)


def _at_predicting_positions(logits: Tensor, predict: Tensor) -> Tensor:
    """(B, T, V) logits -> (N, V) at ``predict``; (N, V) logits are taken as already selected."""
    if logits.dim() == 3:
        return logits[predict]
    n = int(predict.sum())
    if logits.dim() != 2 or logits.shape[0] != n:
        raise ValueError(
            f"forward returned logits of shape {tuple(logits.shape)}; expected (B, T, V) = "
            f"{tuple(predict.shape)} + (V,) or ({n}, V) at the predicting positions"
        )
    return logits
