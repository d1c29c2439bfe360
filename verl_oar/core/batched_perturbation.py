"""OAR-P for a batch of sequences: occluded copies of different samples share model calls.

The importance is exactly :func:`verl_oar.core.perturbation.perturbation_importance`'s, sample by sample
(``I_s = KL(P_final || P_final^(s))``, or ``phi - phi^(s)`` for AS-JOINT); what changes is how the passes
are laid out. A pass is a list of :class:`Row` (new tokens that continue a row's own cached prefix) and a
:class:`RowsModel` runs rows of different samples, prefix lengths and lengths in one call. Three stages:

1. **prompts** (with prefix sharing): every distinct prompt once, keeping its KV cache: the ``n``
   responses of a prompt share it;
2. **clean**: each sample's tokens after its prompt up to ``end`` (the last position that predicts an
   answer token, + 1), continuing the prompt's cache; keeps the sample's clean cache and its clean outcome;
3. **copies**: for each span ``s`` starting at ``p_s``, the occluded tokens ``x^(s)[p_s:end]`` continuing
   the sample's clean cache of ``[0, p_s)``: a copy feeds only the tokens from its own span on.

Rows are ordered by length and packed into calls while ``rows x longest new part <= max_tokens`` (tokens through
the model, padded: the caller passes verl's log-prob token budget), ``rows x longest prefix <= CACHE_FACTOR x
max_tokens`` (cached tokens gathered for the call) and the padding stays within ``WASTE_FRACTION`` of the rows'
own work (:func:`plan_calls`); a row alone over the budget is called alone. Without prefix sharing (``share_prefix=False``: a model
whose cache cannot be reused, or Megatron) every row starts at position 0 and the three stages become
one clean row and one full copy per span, still batched across samples.

Only the positions that predict an answer token are read, so each row asks for its last ``keep`` logits. A
span that starts after the first predicting position starts its copy there instead (clean tokens recomputed,
rare: reasoning precedes the answer). No gradient is computed; the model is not modified.

Memory is one call's, not one per copy: each call's logits are reduced before the next call starts (a clean row
to its sample's outcome statistic, a copy to its one divergence), so the live logits are at most one call's
(rows x keep <= ``max_tokens`` positions x V, what verl's log-prob pass of the same budget holds); a copy's
occluded ids and cache prefix are built only for its call, and a sample's clean statistic and cache are dropped
after its last copy. Exact mode on a 4k-token response (~2,500 copies) thus needs no more logits memory than
chunk mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from verl_oar.core.hierarchical import hierarchical_importance
from verl_oar.core.outcome import outcome_divergence, outcome_statistic
from verl_oar.core.perturbation import PerturbationConfig, PerturbationCost, occlusion_spans

__all__ = ["CACHE_FACTOR", "WASTE_FRACTION", "Row", "RowsModel", "Sample", "batched_perturbation_importance", "cached_tokens",
           "call_tokens", "plan_calls", "score_samples"]


@dataclass
class Sample:
    """One sequence to score."""

    ids: Tensor
    """(L,) long, prompt + response tokens"""
    positions: Tensor
    """(L,) long, their position ids"""
    span: Tensor
    """(L,) long, the occlusion of each token (``occlusion_spans``), -1 if none"""
    predict: Tensor
    """(L,) bool, positions whose logits predict an answer token"""
    temperature: float = 1.0
    """the rollout temperature; logits are divided by it"""
    prompt_len: int = 0
    """leading tokens that samples with the same tokens there share (0: none shared)"""


@dataclass
class Row:
    """One row of a model call: ``ids`` continue a cached prefix of ``past_len`` tokens (``past``)."""

    ids: Tensor
    """(n,) long, the new tokens"""
    positions: Tensor
    """(n,) long, their position ids"""
    past: Any = None
    """the model's cache of this row's first ``past_len`` tokens (from an earlier row's ``cache=True``), or None"""
    past_len: int = 0
    keep: int = 0
    """how many of the last positions' logits to return (0: none)"""
    cache: bool = False
    """return this row's cache of all its ``past_len + n`` tokens"""


class RowsModel(Protocol):
    """A causal LM that runs rows with prefixes of their own in one call."""

    shares_cache: bool
    """whether a row's cache can be continued (False: every row must start at position 0)"""

    def __call__(self, rows: list[Row]) -> tuple[list[Tensor | None], list[Any]]:
        """Per row: (keep, V) logits of its last ``keep`` positions (None if ``keep`` is 0) and its cache (None
        unless ``cache``). The lists are the caller's: the model keeps no reference to the logits, which the
        caller frees (it empties the list) before its next call."""
        ...

    def prefix(self, cache: Any, length: int) -> Any:
        """The cache of the first ``length`` tokens of a row's cache."""
        ...


CACHE_FACTOR = 4
"""Cached prefix tokens a call may gather, per token of its budget. A cached token holds 2 x layers x kv_heads x
head_dim values (28 KB in bf16 for Qwen2.5-Math-1.5B, 57 KB for 7B), a token of verl's log-prob pass at least its
float32 logits (600 KB at a 152k vocabulary): 4x the budget in cached tokens stays under a fifth of that pass's
logits memory."""


def call_tokens(rows: list[Row]) -> int:
    """Tokens a call feeds through the model, padded: rows x longest new part."""
    return len(rows) * max(r.ids.numel() for r in rows)


def cached_tokens(rows: list[Row]) -> int:
    """Cached tokens a call gathers, padded: rows x longest prefix."""
    return len(rows) * max(r.past_len for r in rows)


WASTE_FRACTION = 0.25
"""The padding a call may add: its padded new tokens (rows x longest new part, what the linear layers compute)
and its padded attention area (rows x longest new part x (longest prefix + longest new part)) each stay within
this fraction above the rows' own."""


class _Call:
    """A call being filled: its rows and the running sums :func:`plan_calls` checks."""

    def __init__(self, i: int, row: Row):
        n = row.ids.numel()
        self.rows, self.new, self.past = [i], n, row.past_len
        self.new_sum, self.area_sum = n, n * (row.past_len + n)

    def admits(self, row: Row, max_tokens: int) -> bool:
        n = row.ids.numel()
        count, new, past = len(self.rows) + 1, max(self.new, n), max(self.past, row.past_len)
        return (count * new <= max_tokens and count * past <= CACHE_FACTOR * max_tokens
                and count * new <= (1 + WASTE_FRACTION) * (self.new_sum + n)
                and count * new * (past + new) <= (1 + WASTE_FRACTION) * (self.area_sum + n * (row.past_len + n)))

    def add(self, i: int, row: Row) -> None:
        n = row.ids.numel()
        self.rows.append(i)
        self.new, self.past = max(self.new, n), max(self.past, row.past_len)
        self.new_sum += n
        self.area_sum += n * (row.past_len + n)


def plan_calls(rows: list[Row], max_tokens: int) -> list[list[int]]:
    """Indices of ``rows`` per model call. Rows are ordered by total length (prefix + new), then new part,
    longest first, so rows of one sample and of samples of similar length are neighbours; a call takes the
    next row while it stays within ``max_tokens`` fed, ``CACHE_FACTOR x max_tokens`` cached (padded, see
    :func:`call_tokens`, :func:`cached_tokens`) and ``WASTE_FRACTION`` of padding; a single row always fits."""
    order = sorted(range(len(rows)), key=lambda i: (-(rows[i].past_len + rows[i].ids.numel()),
                                                    -rows[i].ids.numel(), i))
    calls: list[_Call] = []
    for i in order:
        if calls and calls[-1].admits(rows[i], max_tokens):
            calls[-1].add(i, rows[i])
        else:
            calls.append(_Call(i, rows[i]))
    return [call.rows for call in calls]


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


def score_samples(
    model: RowsModel,
    samples: list[Sample],
    reasoning: list[Tensor],
    neutral_id: int,
    cfg: PerturbationConfig,
    max_tokens: int,
    line_end: list[Tensor | None] | None = None,
) -> tuple[list[Tensor], list[PerturbationCost], PerturbationCost]:
    """OAR-P importance of ``samples`` in ``cfg.mode``: the spans of ``occlusion_spans``, or both rounds of
    ``hierarchical`` (``core.hierarchical``), each round one :func:`batched_perturbation_importance`.

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
