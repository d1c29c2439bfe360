"""Outcome objectives: what "the model's prediction of the final answer" is (paper's AS-* ablation).

A *predicting position* p is one whose logits predict an answer token (the token at p + 1 is an
answer token). Everything here takes the logits of the N predicting positions of a batch,
flattened, with a segment id saying which of the S sequences each belongs to, so the same code
serves padded (B, T) batches (segment = row) and packed (1, total_nnz) ones (segment from cu_seqlens).

With a_1..a_K the answer tokens of a sequence and z_k the logits at the position predicting a_k:

* AS-SINGLE: P_final = softmax(z_1)                    (the position just before the answer)
* AS-MEAN:   P_final = softmax((1/K) sum_k z_k)        (the paper's best, our default)
* AS-JOINT:  phi = (1/K) sum_k log softmax(z_k)[a_k]   (mean answer log-likelihood)

and the divergence between a clean and a perturbed pass is, for importance I_t:

* SINGLE / MEAN: D = KL(P_final || P_final^(t))        (>= 0)
* JOINT:         D = phi - phi^(t)                     (signed; reshaping clamps it at 0)

All results are float32 whatever the logits' dtype (bf16 and fp16 are upcast), float64 for float64
logits. A segment with no predicting position gets the
uniform distribution (log-probs -log V) and phi = 0, so its divergence is exactly 0, never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "OUTCOMES",
    "answer_log_likelihood",
    "kl_to_logits",
    "outcome_divergence",
    "outcome_log_probs",
    "outcome_statistic",
    "padded_predicting_positions",
    "pooled_outcome_logits",
]

OUTCOMES = ("single", "mean", "joint")
"""Outcome definitions: AS-SINGLE, AS-MEAN, AS-JOINT."""


def _check_outcome(outcome: str) -> None:
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome={outcome!r} is invalid: must be one of {OUTCOMES}")


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _segment_counts(segment: Tensor, num_segments: int) -> Tensor:
    return torch.bincount(segment, minlength=num_segments)[:num_segments]


def pooled_outcome_logits(logits: Tensor, segment: Tensor, num_segments: int, outcome: str) -> Tensor:
    """The logits whose softmax is P_final, per segment, for AS-SINGLE and AS-MEAN.

    Args:
        logits: (N, V) any float dtype, logits at the predicting positions.
        segment: (N,) long in [0, S): the sequence of each position.
        num_segments: S.
        outcome: "single" (the first position of each segment in the given order, i.e. its lowest
            index in ``logits``) or "mean" (the mean logits of the segment).

    Returns:
        (S, V) float32 (float64 for float64 logits); 0 for a segment with no position. The sums are
        taken in a fixed order (no atomics), so equal inputs give bit-equal outputs on any device.
    """
    _check_outcome(outcome)
    if outcome == "joint":
        raise ValueError("outcome='joint' has no distribution: use answer_log_likelihood (or outcome_statistic)")
    n, vocab = logits.shape
    z = logits.to(_compute_dtype(logits))
    counts = _segment_counts(segment, num_segments)
    if outcome == "mean":
        if n and bool((segment[1:] >= segment[:-1]).all()):   # sorted (every caller here): contiguous sums
            summed = torch.stack([part.sum(dim=0) for part in z.split(counts.tolist())])
        else:
            summed = torch.zeros(num_segments, vocab, dtype=z.dtype, device=z.device).index_add(0, segment, z)
        pooled = summed / counts.clamp(min=1).unsqueeze(1).to(z.dtype)
    else:
        first = torch.full((num_segments,), n, dtype=torch.long, device=z.device)
        first = first.scatter_reduce(0, segment, torch.arange(n, device=z.device), reduce="amin")
        pooled = z[first.clamp(max=n - 1)] if n else z.new_zeros(num_segments, vocab)
    return torch.where((counts > 0).unsqueeze(1), pooled, 0.0)


def outcome_log_probs(logits: Tensor, segment: Tensor, num_segments: int, outcome: str) -> Tensor:
    """log P_final of each segment, for AS-SINGLE and AS-MEAN: log_softmax of
    :func:`pooled_outcome_logits` (same arguments).

    Returns:
        (S, V) float32 (float64 for float64 logits) log-probabilities; -log V everywhere for a
        segment with no position.
    """
    return torch.log_softmax(pooled_outcome_logits(logits, segment, num_segments, outcome), dim=-1)


class _KLToLogits(torch.autograd.Function):
    """KL(P || softmax(z)) per row, with the gradient w.r.t. z written as softmax(z) - P.

    Autograd's own backward of log_softmax gives softmax(z) * sum(P) - P, which is not exactly 0
    when z reproduces P because sum(P) is 1 only up to rounding; this one is exactly 0 then."""

    @staticmethod
    def forward(ctx, clean: Tensor, z: Tensor) -> Tensor:
        lq = torch.log_softmax(z, dim=-1)
        ctx.save_for_backward(clean, lq)
        p = clean.exp()
        return torch.where(p > 0, p * (clean - lq), 0.0).sum(dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        clean, lq = ctx.saved_tensors
        return None, (lq.exp() - clean.exp()) * grad.unsqueeze(-1)


def kl_to_logits(clean: Tensor, z: Tensor) -> Tensor:
    """KL(P_clean || softmax(z)) per segment, differentiable in ``z``.

    Args:
        clean: (S, V) float log P_clean (:func:`outcome_log_probs` of the clean pass), no gradient.
        z: (S, V) float pooled logits of the perturbed pass (:func:`pooled_outcome_logits`).

    Returns:
        (S,) float: the value of ``outcome_divergence(clean, log_softmax(z))``; its gradient w.r.t.
        ``z`` is softmax(z) - P_clean, exactly 0 when ``z`` equals the clean pass's pooled logits.
    """
    return _KLToLogits.apply(clean.detach(), z)


def answer_log_likelihood(logits: Tensor, targets: Tensor, segment: Tensor, num_segments: int) -> Tensor:
    """phi: mean log-likelihood of the answer tokens of each segment (AS-JOINT).

    Args:
        logits: (N, V) any float dtype, logits at the predicting positions.
        targets: (N,) long, the answer token each position predicts.
        segment: (N,) long in [0, S).
        num_segments: S.

    Returns:
        (S,) float32 (float64 for float64 logits); 0 for a segment with no position.
    """
    z = logits.to(_compute_dtype(logits))
    token_lp = z.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(z, dim=-1)   # (N,)
    summed = torch.zeros(num_segments, dtype=z.dtype, device=z.device).index_add(0, segment, token_lp)
    return summed / _segment_counts(segment, num_segments).clamp(min=1).to(z.dtype)


def outcome_statistic(
    logits: Tensor, targets: Tensor, segment: Tensor, num_segments: int, outcome: str
) -> Tensor:
    """The outcome of each segment: (S, V) log P_final for "single"/"mean" (see
    :func:`outcome_log_probs`), (S,) phi for "joint" (see :func:`answer_log_likelihood`); float32,
    or float64 for float64 logits.
    Shapes of the arguments as in those functions."""
    _check_outcome(outcome)
    if outcome == "joint":
        return answer_log_likelihood(logits, targets, segment, num_segments)
    return outcome_log_probs(logits, segment, num_segments, outcome)


def outcome_divergence(clean: Tensor, perturbed: Tensor, outcome: str) -> Tensor:
    """How much the outcome moved between a clean and a perturbed pass, per segment.

    Args:
        clean, perturbed: (S, V) float log-probabilities for "single"/"mean"; (S,) float phi for
            "joint" (outputs of :func:`outcome_statistic`).
        outcome: one of :data:`OUTCOMES`.

    Returns:
        (S,) float32 (float64 if an input is float64): KL(P_clean || P_perturbed) >= 0 for
        "single"/"mean" (terms where P_clean is 0 count 0); phi_clean - phi_perturbed (signed) for "joint".
    """
    _check_outcome(outcome)
    dtype = torch.promote_types(torch.promote_types(clean.dtype, perturbed.dtype), torch.float32)
    lp, lq = clean.to(dtype), perturbed.to(dtype)
    if outcome == "joint":
        return lp - lq
    p = lp.exp()
    terms = torch.where(p > 0, p * (lp - lq), 0.0)
    return terms.sum(dim=-1)



def padded_predicting_positions(input_ids: Tensor, answer_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Predicting positions of a padded (B, T) batch of full sequences (prompt + response).

    Args:
        input_ids: (B, T) long.
        answer_mask: (B, T) bool, true on the answer tokens (as input tokens).

    Returns:
        predict_mask: (B, T) bool, true at p where answer_mask[p + 1] (the last column is False);
        targets: (B, T) long, input_ids[p + 1] (0 in the last column);
        segment: (B, T) long, the row index.
    """
    answer = answer_mask.to(torch.bool)
    predict = torch.zeros_like(answer)
    predict[:, :-1] = answer[:, 1:]
    targets = torch.zeros_like(input_ids, dtype=torch.long)
    targets[:, :-1] = input_ids[:, 1:]
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    return predict, targets, rows.unsqueeze(1).expand_as(input_ids).contiguous()
