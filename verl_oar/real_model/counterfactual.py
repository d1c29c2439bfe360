"""The counterfactual test of a token ranking on a real model's text: remove a ranking's top reasoning tokens and
measure how much less likely the response's own answer becomes.

Per response (prompt + response ids, its reasoning and answer tokens as training locates them,
``tools.heatmap.make_sample``):

1. rankings (:data:`RANKINGS`), each a (T,) score over the response tokens, higher = more important: OAR-P exact
   and chunk (K=16, training's default), OAR-G (training's default: AS-MEAN noisy KL, grad x input) and OAR-G
   log-likelihood (``objective=loglik``), the entropy of the next-token distribution that produced each token, and
   a random score (a generator seeded per response);
2. edits: the top ``frac`` of the reasoning tokens (``core.token_ranking.top_fraction_mask``, ties broken by a
   seeded generator) deleted, or replaced by OAR-P's neutral token;
3. the change in the answer's log-probability, teacher-forced: ``sum over answer tokens t of log p(x_t | x_<t)``
   on the edited sequence minus the same on the original (nats; negative = the answer became less likely). The
   answer tokens stay in place (after a deletion they move up with everything after the deleted tokens).

:func:`token_categories` says what each response token is (a number of the problem, another number: an
intermediate result, the answer or any other number, an operator, a word, anything else), :func:`top_overlap` and
:func:`spearman` how two rankings of one response agree (bf16 against fp32), and :func:`labelled_tokens` which
tokens of a worked solution (``data.worked_solutions``) hold its results, whose recall in a ranking's top fraction
is ``core.token_ranking.recall_at``. The aggregation over responses,
with intervals, is the benchmark's (``benchmarks/real_model_counterfactual.py``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from verl_oar.core.answer_span import decode_with_offsets
from verl_oar.core.config import OARConfig
from verl_oar.core.token_ranking import delete, entropy_scores, occlude, random_scores, top_count, top_fraction_mask
from verl_oar.tools.heatmap.inputs import Sample
from verl_oar.tools.heatmap.scoring import oar_g_importance, oar_p_importance

__all__ = ["CATEGORIES", "EDITS", "FRACS", "RANKINGS", "answer_change", "answer_log_prob", "edited_sequence",
           "labelled_tokens", "rankings", "spearman", "token_categories", "top_overlap"]

RANKINGS = ("oar_p_exact", "oar_p_chunk", "oar_g", "oar_g_loglik", "entropy", "random")
IMPORTANCE_RANKINGS = RANKINGS[:4]
"""the rankings a model computes by OAR (compared in bf16 against fp32)"""
FRACS = (0.05, 0.10, 0.20)
EDITS = ("delete", "replace")
CATEGORIES = ("problem number", "other number", "operator", "word", "other")
OPERATORS = set("+-*/=×÷−")
MAX_TOKENS = 8192
"""OAR-P's padded token budget per model call"""


def rankings(model, sample: Sample, *, neutral_id: int, seed: int, names: Sequence[str] = RANKINGS,
             tokenizer=None) -> dict[str, Tensor]:
    """{ranking: (T,) float32 scores over the response tokens} of one response (0 off the reasoning tokens for the
    OAR rankings). ``model``: a transformers causal LM in the dtype to measure (its device holds the pass);
    ``seed``: OAR-G's noise and the random ranking's draws."""
    cfg = OARConfig()
    out: dict[str, Tensor] = {}
    for name in names:
        if name == "oar_p_exact":
            out[name] = oar_p_importance(model, sample, replace(cfg.perturbation_config(), mode="exact"), neutral_id,
                                         MAX_TOKENS, tokenizer)
        elif name == "oar_p_chunk":
            out[name] = oar_p_importance(model, sample, cfg.perturbation_config(), neutral_id, MAX_TOKENS, tokenizer)
        elif name == "oar_g":
            out[name] = oar_g_importance(model, sample, cfg.gradient_config(), seed)
        elif name == "oar_g_loglik":
            out[name] = oar_g_importance(model, sample, replace(cfg.gradient_config(), objective="loglik"), seed)
        elif name == "entropy":
            device = model.get_input_embeddings().weight.device
            with torch.no_grad():
                logits = model(sample.ids.to(device)[None]).logits[0]
            out[name] = entropy_scores(logits)[len(sample.prompt_ids):].cpu()
        elif name == "random":
            out[name] = random_scores((len(sample.response_ids),), torch.Generator().manual_seed(seed))
        else:
            raise ValueError(f"unknown ranking {name!r}; one of {', '.join(RANKINGS)}")
        out[name] = out[name].float()
    return out


def edited_sequence(sample: Sample, remove: Tensor, edit: str, neutral_id: int) -> tuple[Tensor, Tensor]:
    """(ids (L',) long, answer (L',) bool) of prompt + response with the response tokens ``remove`` ((T,) bool)
    deleted (``edit="delete"``: L' = L - remove.sum()) or replaced by ``neutral_id`` (``"replace"``: L' = L)."""
    if edit not in EDITS:
        raise ValueError(f"edit={edit!r} must be one of {EDITS}")
    ids = sample.ids
    full_remove = torch.cat([torch.zeros(len(sample.prompt_ids), dtype=torch.bool), remove.to(torch.bool)])
    _, answer = sample.full_masks()
    if bool((full_remove & answer).any()):
        raise ValueError("edited_sequence: the tokens to remove include answer tokens; remove reasoning tokens only")
    if edit == "replace":
        return occlude(ids, full_remove, neutral_id), answer
    return delete(ids, full_remove), answer[~full_remove]


@torch.no_grad()
def answer_log_prob(model, sequences: Sequence[tuple[Tensor, Tensor]]) -> list[float]:
    """Teacher-forced log-probability (nats, float64 sum in fp32 softmax) of each sequence's answer tokens:
    ``sum_{t: answer[t]} log p(ids[t] | ids[:t])``. ``sequences``: (ids (L,) long, answer (L,) bool) pairs, right
    padded into one batch with an attention mask (a token's position id is its index: padding only follows)."""
    if not sequences:
        return []
    device = model.get_input_embeddings().weight.device
    length = max(len(ids) for ids, _ in sequences)
    batch = torch.zeros(len(sequences), length, dtype=torch.long)
    mask = torch.zeros(len(sequences), length, dtype=torch.long)
    answer = torch.zeros(len(sequences), length, dtype=torch.bool)
    for b, (ids, ans) in enumerate(sequences):
        if bool(ans[0]):
            raise ValueError("answer_log_prob: the first token is an answer token; nothing predicts it")
        batch[b, : len(ids)], mask[b, : len(ids)], answer[b, : len(ids)] = ids, 1, ans
    logits = model(input_ids=batch.to(device), attention_mask=mask.to(device)).logits
    out = []
    for b in range(len(sequences)):  # only the positions that predict an answer token go through the softmax
        targets = answer[b].nonzero().squeeze(1)
        logp = torch.log_softmax(logits[b, targets - 1].float().cpu(), dim=-1)
        out.append(float(logp.gather(-1, batch[b, targets, None]).double().sum()))
    return out


def answer_change(model, sample: Sample, scores: dict[str, Tensor], *, neutral_id: int, seed: int,
                  fracs: Sequence[float] = FRACS, edits: Sequence[str] = EDITS,
                  batch_size: int = 16) -> dict[str, dict[str, dict[float, float]]]:
    """{ranking: {edit: {frac: change in the answer's log-probability}}} of one response: each ranking's top
    ``frac`` of the reasoning tokens removed by each edit (ties broken by ``torch.Generator().manual_seed(seed)``
    afresh per ranking, so one ranking's tops are nested over ``fracs``)."""
    reasoning = torch.tensor(sample.reasoning, dtype=torch.bool)
    if not bool(reasoning.any()):
        raise ValueError("answer_change: the response has no reasoning token before its answer")
    jobs: list[tuple[str, str, float]] = []
    sequences = []
    for name, row in scores.items():
        for frac in fracs:
            remove = top_fraction_mask(row, reasoning, frac, torch.Generator().manual_seed(seed))
            for edit in edits:
                jobs.append((name, edit, frac))
                sequences.append(edited_sequence(sample, remove, edit, neutral_id))
    ids, answer = sample.ids, sample.full_masks()[1]
    original = answer_log_prob(model, [(ids, answer)])[0]
    values: list[float] = []
    for start in range(0, len(sequences), batch_size):
        values.extend(answer_log_prob(model, sequences[start:start + batch_size]))
    out: dict[str, dict[str, dict[float, float]]] = {}
    for (name, edit, frac), value in zip(jobs, values, strict=True):
        out.setdefault(name, {}).setdefault(edit, {})[frac] = value - original
    return out


def token_categories(response_ids: Sequence[int], tokenizer, problem_numbers: Sequence[int]) -> list[str]:
    """One of :data:`CATEGORIES` per response token: a token inside a number (a digit run of the decoded text) is a
    *problem number* when that number is one of ``problem_numbers``, else an *other number* (an intermediate result,
    the answer, or a number from elsewhere such as the prompt's worked example); a token of operator characters only (``+ - * / = × ÷``, spaces around) an *operator*; a token
    with a letter a *word*; anything else (spaces, punctuation, LaTeX, line breaks) *other*."""
    text, offsets = decode_with_offsets(response_ids, tokenizer, skip_special_tokens=True)
    number_at = [None] * len(text)
    for match in re.finditer(r"\d+", text):
        for i in range(match.start(), match.end()):
            number_at[i] = int(match.group())
    given = {int(n) for n in problem_numbers}
    out = []
    for start, end in offsets:
        piece = text[start:end]
        numbers = {number_at[i] for i in range(start, end) if number_at[i] is not None}
        if numbers:
            out.append("problem number" if numbers <= given else "other number")
        elif piece.strip() and set(piece.strip()) <= OPERATORS:
            out.append("operator")
        elif any(c.isalpha() for c in piece):
            out.append("word")
        else:
            out.append("other")
    return out


def _top(scores: Tensor, candidates: Tensor, frac: float, seed: int) -> Tensor:
    return top_fraction_mask(scores, candidates, frac, torch.Generator().manual_seed(seed))


def top_overlap(a: Tensor, b: Tensor, candidates: Tensor, frac: float = 0.10, seed: int = 0) -> float:
    """|top_frac(a) ∩ top_frac(b)| / k over the candidates ((T,) each; the same tie-breaking for both)."""
    k = top_count(frac, int(candidates.sum()))
    return float((_top(a, candidates, frac, seed) & _top(b, candidates, frac, seed)).sum()) / k


def spearman(a: Tensor, b: Tensor, candidates: Tensor) -> float:
    """Spearman's rank correlation of two scores over the candidates (average ranks for ties); NaN when either is
    constant there."""
    x, y = a[candidates].double(), b[candidates].double()
    if x.numel() < 2:
        return float("nan")

    def ranks(v: Tensor) -> Tensor:
        order = torch.argsort(v, stable=True)
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=v.dtype)
        for value in torch.unique(v):  # average rank over ties
            tied = v == value
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(x), ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = float((rx.square().sum() * ry.square().sum()).sqrt())
    return float((rx * ry).sum()) / denominator if denominator > 0 else float("nan")


def labelled_tokens(response_ids: Sequence[int], tokenizer, spans: Sequence[tuple[int, int]], text: str) -> Tensor:
    """(T,) bool: the response tokens overlapping any of the character ``spans`` of ``text`` (which the tokens
    must decode to; ValueError otherwise)."""
    decoded, offsets = decode_with_offsets(response_ids, tokenizer, skip_special_tokens=True)
    if decoded != text:
        raise ValueError("labelled_tokens: the response ids do not decode to the text the spans index")
    return torch.tensor([any(start < e and s < end for s, e in spans) for start, end in offsets], dtype=torch.bool)
