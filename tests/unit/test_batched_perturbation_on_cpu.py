"""OAR-P with copies of different samples in one model call (``verl_oar.core.perturbation`` through
``core.hf.HFRowsModel``) against the naive loop (one whole-sequence forward per occluded copy), on a tiny
float64 Qwen2 and fresh random batches: mixed lengths, prompts shared by several responses, samples without
an answer or without reasoning, every outcome, every span mode, tight and loose call budgets."""

from __future__ import annotations

import pytest
import torch
from _oar_p_reference import naive_perturbation_importance
from _tiny_models import tiny_qwen2

from verl_oar.core.hf import HFRowsModel
from verl_oar.core.outcome import OUTCOMES
from verl_oar.core.perturbation import (
    CACHE_FACTOR,
    WASTE_FRACTION,
    PerturbationConfig,
    Row,
    Sample,
    batched_perturbation_importance,
    cached_tokens,
    call_tokens,
    occlusion_spans,
    plan_calls,
)

VOCAB = 97
NEUTRAL = 0


def _model(sliding: bool = False):
    return tiny_qwen2(VOCAB, max_positions=512, sliding=sliding)


@pytest.fixture(scope="module")
def model():
    return _model()


def _batch(seed: int, mode: str = "exact", budget: int = 16) -> list[Sample]:
    """Prompts of 3-12 tokens, each answered by 1-3 responses of 0-40 tokens; the answer is 1-3 tokens followed by
    two more; sample 0 has no answer, and one response has no reasoning token."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    samples = []
    for p in range(4):
        prompt = torch.randint(1, VOCAB, (rnd(3, 12),), generator=g)
        for r in range(rnd(1, 3)):
            reasoning_len = 0 if (p, r) == (1, 0) else rnd(1, 40)
            answer = rnd(1, 3)
            response = torch.randint(1, VOCAB, (reasoning_len + answer + 2,), generator=g)
            ids = torch.cat([prompt, response])
            n = ids.numel()
            reasoning = torch.zeros(n, dtype=torch.bool)
            reasoning[prompt.numel() : prompt.numel() + reasoning_len] = True
            predict = torch.zeros(n, dtype=torch.bool)
            if len(samples) > 0:
                predict[n - answer - 3 : n - 3] = True
            line_end = torch.rand(n, generator=g) < 0.2
            span = occlusion_spans(reasoning, "line" if mode == "line" else mode, budget, line_end)
            samples.append(Sample(ids, torch.arange(n), span, predict, temperature=0.5 + rnd(0, 10) / 10,
                                  prompt_len=prompt.numel()))
    return samples


def _naive(model, sample: Sample, outcome: str) -> torch.Tensor:
    return naive_perturbation_importance(lambda x: model(input_ids=x).logits, sample.ids, sample.span, sample.predict,
                                         NEUTRAL, outcome, sample.temperature)


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("max_tokens", [1, 120, 100_000])
def test_equals_the_naive_loop(model, outcome, seed, max_tokens):
    samples = _batch(seed)
    got, costs, total = batched_perturbation_importance(
        HFRowsModel(model), samples, NEUTRAL, PerturbationConfig(outcome=outcome), max_tokens)
    for sample, importance in zip(samples, got, strict=True):
        want = _naive(model, sample, outcome)
        assert importance.dtype == torch.float32
        assert torch.allclose(importance.double(), want.double(), atol=1e-10, rtol=0), (importance - want).abs().max()
    assert (got[0] == 0).all() and costs[0].tokens == 0  # no answer: nothing scored
    assert total.copies == sum(c.copies for c in costs) == sum(
        int(s.span[: int(s.predict.nonzero().max()) + 1].max()) + 1 for s in samples[1:] if (s.span >= 0).any())
    assert total.peak_call_tokens <= max(max_tokens, max(s.ids.numel() for s in samples))
    rows = sum(1 for s in samples[1:] if (s.span >= 0).any()) + total.copies + 4  # + at most 4 prompt rows
    if max_tokens == 1:
        assert total.forwards >= rows - 4  # one row per call
    elif max_tokens == 100_000:
        assert total.forwards < rows / 3  # rows of several samples share calls


@pytest.mark.parametrize("mode", ["chunk", "line"])
def test_budgeted_modes_equal_the_naive_loop(model, mode):
    samples = _batch(5, mode=mode, budget=4)
    got, _, _ = batched_perturbation_importance(HFRowsModel(model), samples, NEUTRAL, PerturbationConfig(), 300)
    for sample, importance in zip(samples, got, strict=True):
        assert torch.allclose(importance.double(), _naive(model, sample, "mean").double(), atol=1e-10, rtol=0)


def test_without_prefix_sharing_the_same_importance_and_every_row_from_position_0(model):
    samples = _batch(2)
    seen = []

    class Spy(HFRowsModel):
        def __call__(self, rows):
            seen.extend(r.past_len for r in rows)
            return super().__call__(rows)

    shared, _, _ = batched_perturbation_importance(Spy(model), samples, NEUTRAL, PerturbationConfig(), 400)
    assert any(seen)
    seen.clear()
    plain, _, _ = batched_perturbation_importance(
        Spy(model), samples, NEUTRAL, PerturbationConfig(share_prefix=False), 400)
    assert not any(seen)
    for a, b in zip(shared, plain, strict=True):
        assert torch.allclose(a.double(), b.double(), atol=1e-10, rtol=0)


def test_a_sliding_window_model_recomputes_prefixes_and_stays_exact():
    model = _model(sliding=True)
    rows_model = HFRowsModel(model)
    assert not rows_model.shares_cache
    samples = _batch(3)
    got, _, _ = batched_perturbation_importance(rows_model, samples, NEUTRAL, PerturbationConfig(), 400)
    for sample, importance in zip(samples, got, strict=True):
        assert torch.allclose(importance.double(), _naive(model, sample, "mean").double(), atol=1e-10, rtol=0)


def test_copies_feed_only_their_own_span_on_and_prompts_are_fed_once(model):
    """Tokens fed = distinct prompts once + each sample's clean continuation + each copy from its span to ``end``."""
    samples = _batch(4)
    _, costs, total = batched_perturbation_importance(HFRowsModel(model), samples, NEUTRAL, PerturbationConfig(),
                                                      10_000)
    prompts, clean, copies = {}, 0, 0
    for s in samples[1:]:
        if not (s.span >= 0).any():
            continue  # nothing to score: no pass at all
        keep = s.predict.nonzero().squeeze(1)
        end = int(keep[-1]) + 1
        cut = min(s.prompt_len, int(keep[0]))
        prompts[tuple(s.ids[:cut].tolist())] = cut
        clean += end - cut
        for span_id in range(int(s.span.max()) + 1 if (s.span >= 0).any() else 0):
            start = int((s.span == span_id).nonzero().min())
            copies += end - min(start, int(keep[0])) if start < end else 0
    assert total.tokens == sum(prompts.values()) + clean + copies
    assert abs(sum(c.tokens for c in costs) - total.tokens) < 1e-6
    assert len(prompts) < len(samples) - 1  # some prompts are shared


def test_model_state_untouched(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batched_perturbation_importance(HFRowsModel(model), _batch(6), NEUTRAL, PerturbationConfig(), 200)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_calls_stay_within_the_budget():
    g = torch.Generator().manual_seed(0)
    rows = [Row(torch.zeros(int(torch.randint(1, 50, (1,), generator=g)), dtype=torch.long), torch.zeros(1),
                past_len=int(torch.randint(0, 80, (1,), generator=g))) for _ in range(200)]
    for budget in (1, 64, 500, 4000):
        calls = plan_calls(rows, budget)
        assert sorted(i for c in calls for i in c) == list(range(200))
        assert all(len(c) == 1 or call_tokens([rows[i] for i in c]) <= budget for c in calls)
        assert all(len(c) == 1 or cached_tokens([rows[i] for i in c]) <= CACHE_FACTOR * budget for c in calls)
        for c in calls:  # padding bounded: tokens fed and attention area within WASTE_FRACTION of the rows' own
            call = [rows[i] for i in c]
            news = [r.ids.numel() for r in call]
            width = max(r.past_len for r in call) + max(news)
            assert len(c) * max(news) <= (1 + WASTE_FRACTION) * sum(news)
            assert len(c) * max(news) * width <= (1 + WASTE_FRACTION) * sum(n * (r.past_len + n) for r, n in zip(call, news))
    # rows of the same shape (copies of one span across samples) fill calls up to the budget
    same = [Row(torch.zeros(10, dtype=torch.long), torch.zeros(1), past_len=30) for _ in range(40)]
    assert [len(c) for c in plan_calls(same, 100)] == [10] * 4


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("outcome", ["mean", "joint"])
def test_fp32_and_bf16_models_stay_close_to_float64(model, dtype, tolerance, outcome):
    """The same weights in fp32 / bf16 (the dtype real runs use): within ``tolerance`` of the largest importance
    (bf16 rounds every logit to ~3 significant digits; AS-JOINT's differences of log-likelihoods feel it most)."""
    samples = _batch(0)
    low = _model().to(dtype)
    got, _, _ = batched_perturbation_importance(HFRowsModel(low), samples, NEUTRAL, PerturbationConfig(outcome=outcome),
                                                400)
    want = [_naive(model, s, outcome) for s in samples]
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0 and all(torch.isfinite(g).all() for g in got)
    assert max(float((g.double() - w.double()).abs().max()) for g, w in zip(got, want)) <= tolerance * scale
