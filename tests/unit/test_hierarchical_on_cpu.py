"""OAR-P hierarchical mode (``verl_oar.core.perturbation.hierarchical_importance`` and ``score_samples``): all
chunks refined into single tokens is exact mode (against the naive loop on a tiny float64 Qwen2 and fresh random
inputs); only the top-m chunks are refined; the occlusions scored are the stated cost; at most two ``score_spans``
calls; R = 0, R < K and m > K."""

from __future__ import annotations

import pytest
import torch
from _oar_p_reference import naive_perturbation_importance
from _tiny_models import tiny_qwen2

from verl_oar.core.hf import HFRowsModel
from verl_oar.core.outcome import OUTCOMES
from verl_oar.core.perturbation import (
    FILLS,
    PerturbationConfig,
    Sample,
    batched_perturbation_importance,
    coarse_spans,
    combine,
    hierarchical_cost,
    hierarchical_importance,
    occlusion_spans,
    refined_spans,
    score_samples,
    select_refined,
    span_values,
)

Tensor = torch.Tensor
VOCAB = 97
NEUTRAL = 0


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2(VOCAB)


def _sequence(seed: int, length: int, prompt: int = 8, answer: int = 3):
    """Random ids; reasoning = response before the answer; predict = positions before answer tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (length,), generator=g)
    reasoning = torch.zeros(length, dtype=torch.bool)
    reasoning[prompt : length - answer - 2] = True
    predict = torch.zeros(length, dtype=torch.bool)
    predict[length - answer - 3 : length - 3] = True
    return ids, reasoning, predict


class Scorer:
    """``score_spans`` over ``batched_perturbation_importance``, all sequences in one batch; records every call."""

    def __init__(self, model, sequences, outcome: str, max_tokens: int = 400):
        self.rows_model = HFRowsModel(model)
        self.sequences = sequences
        self.cfg = PerturbationConfig(outcome=outcome)
        self.max_tokens = max_tokens
        self.calls: list[list[int]] = []  # spans per sequence, per call

    def __call__(self, spans):
        self.calls.append([int(s.max()) + 1 if s.numel() else 0 for s in spans])
        samples = [Sample(ids, torch.arange(len(ids)), span, predict)
                   for (ids, _, predict), span in zip(self.sequences, spans, strict=True)]
        importance, _, _ = batched_perturbation_importance(self.rows_model, samples, NEUTRAL, self.cfg,
                                                           self.max_tokens)
        return importance


class Additive:
    """A model-free scorer: a span's importance is (sum of its tokens' weights)^2 / 10; records calls."""

    def __init__(self, weights):
        self.weights = weights
        self.calls: list[list[Tensor]] = []

    def __call__(self, spans):
        self.calls.append([s.clone() for s in spans])
        out = []
        for w, span in zip(self.weights, spans):
            imp = torch.zeros(span.shape, dtype=torch.float32)
            for s in range(int(span.max()) + 1 if span.numel() else 0):
                imp[span == s] = float(w[span == s].sum()) ** 2 / 10
            out.append(imp)
        return out


@pytest.mark.parametrize("outcome", OUTCOMES)
def test_all_chunks_refined_into_single_tokens_is_exact_mode(model, outcome):
    sequences = [_sequence(seed, length) for seed, length in ((10, 40), (11, 33), (12, 27))]
    for budget, top in ((4, 4), (5, 9)):  # m = K and m > K
        scorer = Scorer(model, sequences, outcome)
        got, stats = hierarchical_importance(scorer, [r for _, r, _ in sequences],
                                             PerturbationConfig(outcome=outcome, mode="hierarchical", budget=budget,
                                                                refine_top=top, refine_unit=1))
        assert len(scorer.calls) == stats.calls == 2
        for (ids, reasoning, predict), imp, r in zip(sequences, got, stats.reasoning):
            want = naive_perturbation_importance(lambda x: model(input_ids=x).logits, ids,
                                                 occlusion_spans(reasoning, "exact", 1), predict, NEUTRAL, outcome)
            assert float(want.abs().max()) > 1e-8 and imp.dtype == torch.float32
            torch.testing.assert_close(imp.double(), want.double(), rtol=0, atol=1e-10)
            assert torch.all(imp[~reasoning] == 0)
        assert stats.occlusions == [k + r for k, r in zip(stats.coarse, stats.reasoning)]


@pytest.mark.parametrize("outcome", ["mean", "joint"])
def test_score_samples_runs_both_rounds_on_the_batch_and_all_refined_is_exact(model, outcome):
    """The production entry (the engines, ``hf_importance``): hierarchical mode is two batched passes over all
    samples; with m = K and u = 1 every token is its own occlusion (exact mode, against the naive loop), and each
    sample's cost is both rounds' copies."""
    sequences = [_sequence(seed, length) for seed, length in ((30, 40), (31, 29))]
    cfg = PerturbationConfig(outcome=outcome, mode="hierarchical", budget=4, refine_top=4, refine_unit=1)
    samples = [Sample(ids, torch.arange(len(ids)), torch.full_like(ids, -1), predict, 0.8, prompt_len=8)
               for ids, _, predict in sequences]
    got, costs, total = score_samples(HFRowsModel(model), samples, [r for _, r, _ in sequences], NEUTRAL, cfg, 400)
    for (ids, reasoning, predict), imp, cost in zip(sequences, got, costs, strict=True):
        want = naive_perturbation_importance(lambda x: model(input_ids=x).logits, ids,
                                             occlusion_spans(reasoning, "exact", 1), predict, NEUTRAL, outcome, 0.8)
        assert float(want.abs().max()) > 1e-8
        torch.testing.assert_close(imp.double(), want.double(), rtol=0, atol=1e-10)
        r = int(reasoning.sum())
        assert cost.copies == min(4, r) + r  # the coarse chunks, then every token of every (multi-token) chunk
    assert total.copies == sum(c.copies for c in costs)


def test_top_m_chunks_are_refined_the_rest_share_their_chunk(model):
    sequences = [_sequence(20, 44), _sequence(21, 38)]
    cfg = PerturbationConfig(outcome="mean", mode="hierarchical", budget=6, refine_top=2, refine_unit=1)
    scorer = Scorer(model, sequences, "mean")
    got, stats = hierarchical_importance(scorer, [r for _, r, _ in sequences], cfg)
    for (ids, reasoning, predict), imp in zip(sequences, got):
        chunks = coarse_spans(reasoning, 6)
        coarse = Scorer(model, [(ids, reasoning, predict)], "mean")([chunks])[0]
        exact = Scorer(model, [(ids, reasoning, predict)], "mean")([occlusion_spans(reasoning, "exact", 1)])[0]
        value, length = span_values(coarse, chunks)
        top = torch.argsort(value, descending=True)[:2].tolist()
        for s in range(6):
            tokens = chunks == s
            if s in top:  # refined: each token its own occlusion
                torch.testing.assert_close(imp[tokens], exact[tokens], rtol=1e-6, atol=1e-12)
            else:  # unrefined: its additive share of the chunk's importance
                torch.testing.assert_close(imp[tokens], (value[s] / length[s]).expand(int(length[s])))
    assert stats.refined_chunks == [2, 2] and stats.calls == 2


def test_selection_ties_go_to_the_earlier_chunk_and_nan_ranks_last():
    assert select_refined(torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0]), 2).tolist() == [False, True, True, False, False]
    assert select_refined(torch.tensor([0.0, 0.0, 0.0]), 2).tolist() == [True, True, False]
    assert select_refined(torch.tensor([float("nan"), -1.0, 0.5]), 2).tolist() == [False, True, True]
    assert select_refined(torch.tensor([0.2, 0.1]), 5).tolist() == [True, True]  # m > K
    assert select_refined(torch.zeros(0), 2).numel() == 0


def test_occlusions_scored_equal_the_stated_cost_and_units_are_consecutive():
    g = torch.Generator().manual_seed(3)
    lengths, rs = [60, 50, 45, 30], [41, 37, 20, 7]
    reasoning = []
    for length, r in zip(lengths, rs):
        mask = torch.zeros(length, dtype=torch.bool)
        mask[5 : 5 + r] = True
        reasoning.append(mask)
    weights = [torch.rand(length, generator=g) for length in lengths]
    for budget, top, unit in ((8, 2, 1), (8, 3, 2), (5, 2, 3), (16, 4, 1), (4, 1, 100)):
        cfg = PerturbationConfig(mode="hierarchical", budget=budget, refine_top=top, refine_unit=unit)
        scorer = Additive(weights)
        got, stats = hierarchical_importance(scorer, reasoning, cfg)
        scored = [sum(int(call[b].max()) + 1 for call in scorer.calls) for b in range(len(rs))]
        assert scored == stats.occlusions and len(scorer.calls) == stats.calls <= 2
        for b, r in enumerate(rs):
            chunks = coarse_spans(reasoning[b], budget)
            value, length = span_values(_coarse(scorer, b), chunks)
            chosen = select_refined(value, top)
            want = min(budget, r) + sum(-(-int(n) // unit) for n in length[chosen] if n > unit)
            assert stats.occlusions[b] == want <= hierarchical_cost(r, cfg)
            assert stats.refined_chunks[b] == min(top, budget, r)
            if len(scorer.calls) == 2:  # units: consecutive ids in position order, at most u tokens, inside chosen
                units = scorer.calls[1][b]
                inside = units >= 0
                assert torch.all(torch.diff(units[inside]) >= 0) and torch.all(chosen[chunks[inside]])
                assert int(torch.bincount(units[inside]).max() if inside.any() else 0) <= unit
        if unit >= 100:  # every chunk is one unit already: no second round
            assert stats.calls == 1


def _coarse(scorer: Additive, b: int) -> Tensor:
    """The coarse round's output for sequence b, recomputed from the recorded span tensor."""
    return Additive(scorer.weights)([scorer.calls[0][i] for i in range(len(scorer.weights))])[b]


def test_edge_cases_r_zero_r_below_k_and_m_above_k():
    cfg = PerturbationConfig(mode="hierarchical", budget=8, refine_top=20, refine_unit=1)
    empty = torch.zeros(12, dtype=torch.bool)
    scorer = Additive([torch.rand(12)])
    got, stats = hierarchical_importance(scorer, [empty], cfg)  # nothing to score: no call at all
    assert stats.calls == 0 and scorer.calls == [] and torch.equal(got[0], torch.zeros(12))
    assert stats.occlusions == [0] and hierarchical_cost(0, cfg) == 0
    assert hierarchical_importance(scorer, [], cfg)[0] == []

    short = torch.zeros(12, dtype=torch.bool)
    short[3:8] = True  # R = 5 < K = 8: five single-token chunks, already exact, one round only
    long = torch.zeros(40, dtype=torch.bool)
    long[2:35] = True
    weights = [torch.rand(12), torch.rand(12), torch.rand(40)]
    scorer = Additive(weights)
    got, stats = hierarchical_importance(scorer, [empty, short, long], cfg)
    assert stats.calls == 2 and stats.coarse == [0, 5, 8] and stats.refined_units == [0, 0, 33]
    assert stats.occlusions == [0, 5, 41] and torch.equal(got[0], torch.zeros(12))
    assert torch.all(scorer.calls[1][0] == -1) and torch.all(scorer.calls[1][1] == -1)
    exact = Additive(weights)([occlusion_spans(r, "exact", 1) for r in (empty, short, long)])
    for g, e in zip(got, exact):  # m > K, u = 1: every token its own occlusion
        torch.testing.assert_close(g, e)

    scorer = Additive([weights[1]])
    got, stats = hierarchical_importance(scorer, [short], cfg)
    assert stats.calls == 1 and stats.refined_units == [0]  # nothing to split: the second round is skipped
    torch.testing.assert_close(got[0], exact[1])


def test_fills_score_unrefined_tokens_and_keep_refined_ones():
    reasoning = torch.zeros(20, dtype=torch.bool)
    reasoning[2:18] = True  # 16 tokens, 4 chunks of 4
    chunks = coarse_spans(reasoning, 4)
    weights = torch.zeros(20)
    weights[[3, 9, 10, 15]] = torch.tensor([1.0, 2.0, 0.5, 0.3])
    coarse = Additive([weights])([chunks])[0]
    value, length = span_values(coarse, chunks)
    chosen = select_refined(value, 1)
    assert chosen.tolist() == [False, True, False, False]  # chunk 1 holds 2.0 + 0.5
    units, count = refined_spans(chunks, chosen, 1)
    assert count == 4 and units[6:10].tolist() == [0, 1, 2, 3] and torch.all(units[:6] == -1)
    refined = Additive([weights])([units])[0]
    for fill in FILLS:
        out = combine(coarse, chunks, chosen, refined, units, fill)
        torch.testing.assert_close(out[6:10], refined[6:10])
        assert torch.all(out[~reasoning] == 0)
    share = combine(coarse, chunks, chosen, refined, units, "share")
    torch.testing.assert_close(share[2:6], (value[0] / 4).expand(4))
    torch.testing.assert_close(combine(coarse, chunks, chosen, refined, units, "span")[2:6], value[0].expand(4))
    ratio = float(refined[6:10].sum()) / float(value[1])
    torch.testing.assert_close(combine(coarse, chunks, chosen, refined, units, "calibrated")[2:6],
                               (value[0] / 4 * ratio).expand(4))
    after = combine(coarse, chunks, chosen, refined, units, "after")
    assert float(after[[2, 3, 4, 5, 10, 11, 12, 13, 14, 15, 16, 17]].max()) < float(after[6:10].min())
    with pytest.raises(ValueError, match="fill"):
        combine(coarse, chunks, chosen, refined, units, "max")
    with pytest.raises(ValueError, match="hierarchical"):
        occlusion_spans(reasoning, "hierarchical", 4)
