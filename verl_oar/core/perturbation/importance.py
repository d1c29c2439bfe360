"""OAR-P: token importance by occlusion, for a batch of sequences whose occluded copies share model calls.

For a sequence x (prompt + response, positions 0..L-1) and an occlusion span s (a set of reasoning positions,
``spans.py``), the copy x^(s) replaces every token of s by a neutral id. Every token of s gets how much the
outcome moved (``verl_oar.core.outcome``):

    I_s = KL(P_final || P_final^(s))   (AS-SINGLE, AS-MEAN)      I_s = phi - phi^(s)   (AS-JOINT)

:func:`score_samples` is the entry point (the engines, ``core.hf.hf_importance``): it builds each sample's spans
for ``cfg.mode`` and scores them with :func:`batched_perturbation_importance`, once, or for ``hierarchical`` twice
(:func:`hierarchical_importance`: the coarse chunks, then the most important ones refined). Every sample is scored
as its own sequence, so its importance does not depend on the rest of the batch (up to float rounding). What is
batched is the passes (``calls.py``: each a list of rows, packed into calls by ``plan_calls``), in three stages:

1. **prompts** (with prefix sharing): every distinct prompt once, keeping its KV cache: the ``n``
   responses of a prompt share it;
2. **clean**: each sample's tokens after its prompt up to ``end`` (the last position that predicts an
   answer token, + 1: nothing after it can move the outcome), continuing the prompt's cache; keeps the sample's
   clean cache and its clean outcome;
3. **copies**: for each span ``s`` starting at ``p_s``, the occluded tokens ``x^(s)[p_s:end]`` continuing
   the sample's clean cache of ``[0, p_s)``: a copy feeds only the tokens from its own span on.

Without prefix sharing (``share_prefix=False``: a model whose cache cannot be reused, or Megatron) every row starts
at position 0 and the three stages become one clean row and one full copy per span, still batched across samples.
Only the positions that predict an answer token are read, so each row asks for its last ``keep`` logits. A span
that starts after the first predicting position starts its copy there instead (clean tokens recomputed, rare:
reasoning precedes the answer). No gradient is computed; the model is not modified.

Memory is one call's, not one per copy: each call's logits are reduced before the next call starts (a clean row
to its sample's outcome statistic, a copy to its one divergence), so the live logits are at most one call's
(rows x keep <= ``max_tokens`` positions x V, what verl's log-prob pass of the same budget holds); a copy's
occluded ids and cache prefix are built only for its call, and a sample's clean statistic and cache are dropped
after its last copy. Exact mode on a 4k-token response (~2,500 copies) thus needs no more logits memory than
chunk mode.

The model is a :class:`~verl_oar.core.perturbation.calls.RowsModel`, so this file has no transformers or verl import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from verl_oar.core.outcome import outcome_divergence, outcome_statistic
from verl_oar.core.perturbation.calls import Row, RowsModel, call_tokens, plan_calls
from verl_oar.core.perturbation.config import PerturbationConfig, PerturbationCost
from verl_oar.core.perturbation.spans import (
    FILLS,
    coarse_spans,
    combine,
    occlusion_spans,
    refined_spans,
    select_refined,
    span_values,
)

__all__ = ["HierarchicalStats", "Sample", "ScoreSpans", "batched_perturbation_importance", "hierarchical_importance",
           "score_samples"]


# ---------------------------------------------------------------------------------------------------
# one round: every sample's spans, copies of all samples sharing calls
# ---------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One sequence to score."""

    ids: Tensor
    """(L,) long, prompt + response tokens"""
    positions: Tensor
    """(L,) long, their position ids"""
    span: Tensor
    """(L,) long, the occlusion of each token (``spans.occlusion_spans``; :func:`score_samples` sets it), -1 if none"""
    predict: Tensor
    """(L,) bool, positions whose logits predict an answer token"""
    temperature: float = 1.0
    """the rollout temperature; logits are divided by it"""
    prompt_len: int = 0
    """leading tokens that samples with the same tokens there share (0: none shared)"""


@dataclass
class _Plan:
    """What the three stages need per sample."""

    keep: Tensor          # (k,) predicting positions
    end: int              # the last predicting position + 1
    targets: Tensor       # (k,) the answer tokens they predict
    spans: list[int] = field(default_factory=list)    # live spans (start < end), in id order
    starts: list[int] = field(default_factory=list)   # each live span's copy start


def _plan(sample: Sample) -> _Plan | None:
    keep = sample.predict.to(torch.bool).nonzero().squeeze(1)
    occluded = (sample.span >= 0).nonzero().squeeze(1)
    if keep.numel() == 0 or occluded.numel() == 0:
        return None
    end = int(keep[-1]) + 1
    num = int(sample.span.max()) + 1
    first = torch.full((num,), sample.ids.numel(), dtype=torch.long, device=sample.ids.device)
    first = first.scatter_reduce(0, sample.span[occluded], occluded, "amin").tolist()
    plan = _Plan(keep=keep, end=end, targets=sample.ids[keep + 1])
    for s in range(num):
        if first[s] < end:  # a span after the answer moves nothing
            plan.spans.append(s)
            plan.starts.append(min(first[s], int(keep[0])))  # keep's logits must come from the copy's call
    return plan


def _run(model: RowsModel, rows: list[Row], max_tokens: int, cost: PerturbationCost,
         sample_costs: list[PerturbationCost], owners: list[list[int]],
         reduce: Callable[[list[int], list[Tensor | None]], None] | None = None,
         build: Callable[[int], Row] | None = None) -> list:
    """Run ``rows`` in planned calls and return each row's cache (None unless it asked for one).

    ``owners[i]``: the samples row i's tokens are charged to (shared evenly). ``reduce(call, logits)`` gets each
    call's row indices and their (keep, V) logits right after the call, and nothing else keeps them: no logits
    tensor outlives its call. ``build(i)``: the row actually fed for ``rows[i]`` (same lengths; ``rows`` are only
    planned), so a copy's occluded ids and prefix exist only while its call runs."""
    caches: list = [None] * len(rows)
    for call in plan_calls(rows, max_tokens):
        batch = [build(i) if build is not None else rows[i] for i in call]
        logits, new_caches = model(batch)
        if reduce is not None:
            reduce(call, logits)
        del logits  # before the next call: this call's logits are reduced
        padded = call_tokens(batch)
        cost.add(PerturbationCost(forwards=1, tokens=sum(r.ids.numel() for r in batch), peak_call_tokens=padded))
        del batch
        touched = set()
        for i, ch in zip(call, new_caches, strict=True):
            caches[i] = ch
            for s in owners[i]:
                sample_costs[s].tokens += rows[i].ids.numel() / len(owners[i])
                touched.add(s)
        for s in touched:
            sample_costs[s].forwards += 1
            sample_costs[s].peak_call_tokens = max(sample_costs[s].peak_call_tokens, padded)
    return caches


def _picked(lg: Tensor, plan: _Plan, temperature: float) -> Tensor:
    """(k, V) float32 logits at the sample's predicting positions / temperature, from a row's (keep, V) logits."""
    return lg[(plan.keep - (plan.end - lg.shape[0])).to(lg.device)].float() / temperature  # last rows: end - keep


def _outcomes(logits: list[Tensor], plans: list[_Plan], samples: list[Sample], which: list[int], outcome: str):
    """Outcome statistic of each row (its logits at its sample's predicting positions), batched: (rows, V) log
    P_final, or (rows,) phi for "joint" (``outcome_statistic``); row j belongs to sample ``which[j]``. Empties
    ``logits`` (the call's, referenced nowhere else) once the predicting positions are picked, so the statistic
    is computed without the call's logits alive."""
    rows = [_picked(lg, plans[s], samples[s].temperature) for lg, s in zip(logits, which, strict=True)]
    logits.clear()
    device = rows[0].device
    targets = torch.cat([plans[s].targets.to(device) for s in which])
    segment = torch.cat([torch.full((r.shape[0],), j, dtype=torch.long, device=device) for j, r in enumerate(rows)])
    z = torch.cat(rows)
    rows.clear()
    return outcome_statistic(z, targets, segment, len(which), outcome)


def batched_perturbation_importance(
    model: RowsModel,
    samples: list[Sample],
    neutral_id: int,
    cfg: PerturbationConfig,
    max_tokens: int,
) -> tuple[list[Tensor], list[PerturbationCost], PerturbationCost]:
    """OAR-P importance of every sample, copies of different samples sharing model calls (module docstring).

    Memory: each call's logits are reduced before the next call (clean rows to their sample's outcome
    statistic, copies to one divergence each), so live logits never exceed one call's, (rows, keep, V) with
    rows x keep <= ``max_tokens``, whatever the number of copies; beyond that only each sample's clean statistic
    ((V,) float32, kept until its last copy is scored) and its clean KV cache (likewise) are held.

    Args:
        model: a :class:`RowsModel`; with ``cfg.share_prefix`` and ``model.shares_cache`` caches are reused.
        samples: the sequences (:class:`Sample`), on the model's device.
        neutral_id: the token an occluded token becomes.
        cfg: the outcome, and whether to share prefixes (``mode`` / ``budget`` were used to build the spans).
        max_tokens: the padded token budget of one model call (:func:`call_tokens`; cached tokens up to
            ``CACHE_FACTOR`` times it).

    Returns:
        per sample (L,) float32 importance (every token of a span gets the span's; 0 off spans, and everywhere
        without a predicting position), per sample its cost (tokens fed, shared rows split evenly; the calls
        it took part in; the largest of them; its copies) and the whole batch's cost (calls, tokens fed).
    """
    share = cfg.share_prefix and getattr(model, "shares_cache", False)
    plans = [_plan(s) for s in samples]
    live = [i for i, p in enumerate(plans) if p is not None]
    out = [torch.zeros(s.ids.numel(), dtype=torch.float32, device=s.ids.device) for s in samples]
    sample_costs = [PerturbationCost() for _ in samples]
    cost = PerturbationCost()
    if not live:
        return out, sample_costs, cost

    with torch.no_grad():
        # 1. prompts: each distinct prompt once (a prompt is cut before the first position the sample needs fed)
        prompt_of: dict[int, int] = {}
        prompt_rows: list[Row] = []
        prompt_owners: list[list[int]] = []
        if share:
            seen: dict[tuple, int] = {}
            for i in live:
                s, plan = samples[i], plans[i]
                cut = min(s.prompt_len, int(plan.keep[0]))
                if cut < 1:
                    continue
                key = (tuple(s.ids[:cut].tolist()), tuple(s.positions[:cut].tolist()))
                if key not in seen:
                    seen[key] = len(prompt_rows)
                    prompt_rows.append(Row(s.ids[:cut], s.positions[:cut], cache=True))
                    prompt_owners.append([])
                prompt_of[i] = seen[key]
                prompt_owners[seen[key]].append(i)
        prompt_caches = _run(model, prompt_rows, max_tokens, cost, sample_costs, prompt_owners)

        # 2. clean rows, continuing the prompt's cache; each call reduced to its samples' outcome statistics
        clean_rows = []
        for i in live:
            s, plan = samples[i], plans[i]
            cut = prompt_rows[prompt_of[i]].ids.numel() if i in prompt_of else 0
            past = prompt_caches[prompt_of[i]] if i in prompt_of else None
            clean_rows.append(Row(s.ids[cut : plan.end], s.positions[cut : plan.end], past=past, past_len=cut,
                                  keep=plan.end - int(plan.keep[0]), cache=share))
        clean: dict[int, Tensor] = {}  # sample -> (V,) log P_final or () phi

        def keep_clean(call: list[int], logits: list[Tensor | None]) -> None:
            which = [live[j] for j in call]
            for i, stat in zip(which, _outcomes(logits, plans, samples, which, cfg.outcome).unbind(0), strict=True):
                clean[i] = stat.clone()  # its own storage: freed with its sample, not with its call's

        caches = _run(model, clean_rows, max_tokens, cost, sample_costs, [[i] for i in live], keep_clean)
        clean_cache = dict(zip(live, caches, strict=True))
        del prompt_caches, clean_rows, caches

        # 3. copies: from the span's first position on, continuing the clean cache; planned as views, occluded
        # ids and cache prefix built only for the call that runs them, each call reduced to one divergence a copy
        copy_rows, copy_of = [], []
        remaining = dict.fromkeys(live, 0)
        for i in live:
            s, plan = samples[i], plans[i]
            for span_id, start in zip(plan.spans, plan.starts, strict=True):
                p0 = start if share else 0
                copy_rows.append(Row(s.ids[p0 : plan.end], s.positions[p0 : plan.end], past_len=p0,
                                     keep=plan.end - int(plan.keep[0])))
                copy_of.append((i, span_id))
            sample_costs[i].copies += len(plan.spans)
            remaining[i] = len(plan.spans)
            if not plan.spans:
                del clean[i], clean_cache[i]
        cost.copies = len(copy_rows)

        def build(j: int) -> Row:
            (i, span_id), planned = copy_of[j], copy_rows[j]
            p0, s = planned.past_len, samples[i]
            ids = planned.ids.clone()
            ids[s.span[p0 : p0 + ids.numel()] == span_id] = neutral_id
            past = model.prefix(clean_cache[i], p0) if p0 > 0 else None
            return Row(ids, planned.positions, past=past, past_len=p0, keep=planned.keep)

        def score(call: list[int], logits: list[Tensor | None]) -> None:
            owners = [copy_of[j][0] for j in call]
            perturbed = _outcomes(logits, plans, samples, owners, cfg.outcome)
            reference = torch.stack([clean[i] for i in owners])
            divergence = outcome_divergence(reference, perturbed, cfg.outcome).float()
            for (i, span_id), d in zip((copy_of[j] for j in call), divergence.tolist(), strict=True):
                out[i][samples[i].span == span_id] = d
                remaining[i] -= 1
                if not remaining[i]:  # its last copy: its clean cache and statistic are no longer needed
                    del clean[i], clean_cache[i]

        _run(model, copy_rows, max_tokens, cost, sample_costs, [[i] for i, _ in copy_of], score, build)
    return out, sample_costs, cost


# ---------------------------------------------------------------------------------------------------
# hierarchical mode: two rounds of spans over a scorer (spans.py, module docstring)
# ---------------------------------------------------------------------------------------------------

ScoreSpans = Callable[[list[Tensor]], list[Tensor]]
"""one (L_i,) long span-id tensor per sequence (-1 = not occluded, ids 0..S_i-1 in position order) -> one (L_i,)
float32 importance per sequence, every token of a span carrying the span's (0 where the span id is -1)"""


@dataclass
class HierarchicalStats:
    """What one :func:`hierarchical_importance` call did, per sequence (lists in input order)."""

    reasoning: list[int] = field(default_factory=list)
    """R, reasoning tokens"""
    coarse: list[int] = field(default_factory=list)
    """K' = min(K, R), coarse chunks scored"""
    refined_chunks: list[int] = field(default_factory=list)
    """m' = min(m, K'), chunks selected for refinement (those with n <= u included)"""
    refined_units: list[int] = field(default_factory=list)
    """units scored in the refined round"""
    calls: int = 0
    """``score_spans`` calls (0, 1 or 2)"""

    @property
    def occlusions(self) -> list[int]:
        """occluded copies per sequence: coarse chunks + refined units (the stated cost)"""
        return [c + u for c, u in zip(self.coarse, self.refined_units)]


def hierarchical_importance(
    score_spans: ScoreSpans, reasoning: Sequence[Tensor], cfg: PerturbationConfig, *, fill: str = "share"
) -> tuple[list[Tensor], HierarchicalStats]:
    """OAR-P importance in ``hierarchical`` mode for a batch of sequences (``spans.py``'s module docstring).

    Args:
        score_spans: the occlusion scorer (:data:`ScoreSpans`; :func:`score_samples` passes one
            :func:`batched_perturbation_importance` per call); called at most twice, each time for all sequences:
            the coarse round, then the refined round unless no sequence has a chunk to split.
        reasoning: one (L_i,) bool per sequence, its reasoning tokens.
        cfg: ``budget`` (K), ``refine_top`` (m), ``refine_unit`` (u); ``outcome`` etc. are the scorer's.
        fill: how unrefined chunks' tokens are scored (``spans.FILLS``; ``share``: ``I_c / n``).

    Returns:
        one (L_i,) float32 importance per sequence (0 off reasoning), and what it cost.
    """
    if fill not in FILLS:
        raise ValueError(f"fill={fill!r} is invalid: must be one of {FILLS}")
    stats = HierarchicalStats()
    coarse = [coarse_spans(r.to(torch.bool), cfg.budget) for r in reasoning]
    for r, c in zip(reasoning, coarse):
        stats.reasoning.append(int(r.to(torch.bool).sum()))
        stats.coarse.append(int(c.max()) + 1 if c.numel() else 0)
    if not any(stats.coarse):
        stats.refined_chunks = [0] * len(coarse)
        stats.refined_units = [0] * len(coarse)
        return [torch.zeros(c.shape, dtype=torch.float32, device=c.device) for c in coarse], stats

    coarse_importance = _checked(score_spans(coarse), coarse)
    stats.calls += 1
    chosen, refined = [], []
    for c, imp in zip(coarse, coarse_importance):
        value, _ = span_values(imp, c)
        pick = select_refined(value, cfg.refine_top)
        units, count = refined_spans(c, pick, cfg.refine_unit)
        chosen.append(pick)
        refined.append(units)
        stats.refined_chunks.append(int(pick.sum()))
        stats.refined_units.append(count)
    if any(stats.refined_units):
        refined_importance = _checked(score_spans(refined), refined)
        stats.calls += 1
    else:
        refined_importance = [torch.zeros(c.shape, dtype=torch.float32, device=c.device) for c in coarse]
    out = [combine(ci, c, pick, ri, units, fill)
           for ci, c, pick, ri, units in zip(coarse_importance, coarse, chosen, refined_importance, refined)]
    return out, stats


def _checked(result: Sequence[Tensor], spans: Sequence[Tensor]) -> list[Tensor]:
    result = list(result)
    if len(result) != len(spans) or any(r.shape != s.shape for r, s in zip(result, spans)):
        raise ValueError("score_spans must return one importance tensor per sequence, shaped like its span tensor")
    return result


# ---------------------------------------------------------------------------------------------------
# the entry point
# ---------------------------------------------------------------------------------------------------


def score_samples(
    model: RowsModel,
    samples: list[Sample],
    reasoning: list[Tensor],
    neutral_id: int,
    cfg: PerturbationConfig,
    max_tokens: int,
    line_end: list[Tensor | None] | None = None,
) -> tuple[list[Tensor], list[PerturbationCost], PerturbationCost]:
    """OAR-P importance of ``samples`` in ``cfg.mode``: one :func:`batched_perturbation_importance` over the spans
    of ``spans.occlusion_spans`` (``exact``, ``chunk``, ``line``), or two for ``hierarchical``
    (:func:`hierarchical_importance`: the coarse chunks, then the refined units).

    Args:
        reasoning: per sample (L,) bool, the tokens scored; ``samples``' ``span`` fields are overwritten.
        line_end: per sample (L,) bool tokens holding a line break (``line`` mode only).
        model, neutral_id, cfg, max_tokens: as :func:`batched_perturbation_importance`.

    Returns:
        as :func:`batched_perturbation_importance`, costs summed over the rounds.
    """
    sample_costs = [PerturbationCost() for _ in samples]
    cost = PerturbationCost()

    def score_spans(spans: list[Tensor]) -> list[Tensor]:
        for sample, span in zip(samples, spans, strict=True):
            sample.span = span
        importance, round_costs, round_cost = batched_perturbation_importance(model, samples, neutral_id, cfg,
                                                                              max_tokens)
        for total, c in zip(sample_costs, round_costs, strict=True):
            total.add(c)
        cost.add(round_cost)
        return importance

    if cfg.mode == "hierarchical":
        importance, _ = hierarchical_importance(score_spans, reasoning, cfg)
    else:
        ends = line_end if line_end is not None else [None] * len(samples)
        importance = score_spans([occlusion_spans(r, cfg.mode, cfg.budget, e) for r, e in zip(reasoning, ends,
                                                                                                strict=True)])
    return importance, sample_costs, cost
