"""OAR-P (``verl_oar.core.perturbation``) on one sequence: prefix sharing, the call budget and budgeted spans
against the naive loop (one whole-sequence forward per occluded copy, ``tests/_oar_p_reference.py``), on a tiny
float64 Qwen2 and fresh random inputs. Batches of several samples: test_batched_perturbation_on_cpu.py."""

from __future__ import annotations

import pytest
import torch
from _oar_p_reference import naive_perturbation_importance
from _tiny_models import tiny_qwen2

from verl_oar.core.config import OARConfig
from verl_oar.core.hf import HFRowsModel, can_share_prefix
from verl_oar.core.outcome import OUTCOMES
from verl_oar.core.perturbation import PerturbationConfig, Sample, batched_perturbation_importance, occlusion_spans

VOCAB = 97
NEUTRAL = 0


@pytest.fixture(scope="module")
def model():
    return tiny_qwen2(VOCAB)


def _sequence(seed: int, length: int = 48, prompt: int = 10, answer: int = 3):
    """Random ids; reasoning = response before the answer; predict = positions before answer tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (length,), generator=g)
    reasoning = torch.zeros(length, dtype=torch.bool)
    reasoning[prompt : length - answer - 2] = True
    predict = torch.zeros(length, dtype=torch.bool)
    predict[length - answer - 3 : length - 3] = True  # two tokens (e.g. "}" and eos) follow the answer
    return ids, reasoning, predict


def _naive(model, ids, span, predict, outcome, temperature=1.0):
    return naive_perturbation_importance(lambda x: model(input_ids=x).logits, ids, span, predict, NEUTRAL, outcome,
                                         temperature)


def _ours(model, ids, span, predict, outcome, max_tokens, share_prefix=True, temperature=1.0, positions=None):
    """The production path on a batch of this one sequence: (L,) importance and the batch's cost."""
    cfg = PerturbationConfig(outcome=outcome, share_prefix=share_prefix)
    positions = torch.arange(len(ids)) if positions is None else positions
    sample = Sample(ids, positions, span, predict, temperature)
    (importance,), _, cost = batched_perturbation_importance(HFRowsModel(model), [sample], NEUTRAL, cfg, max_tokens)
    return importance, cost


@pytest.mark.parametrize("outcome", OUTCOMES)
@pytest.mark.parametrize("max_tokens", [1, 200, 10_000])  # one copy per call, a few, all at once
def test_exact_mode_equals_the_naive_loop(model, outcome, max_tokens):
    for seed in range(2):
        ids, reasoning, predict = _sequence(seed)
        span = occlusion_spans(reasoning, "exact", budget=1)
        want = _naive(model, ids, span, predict, outcome, temperature=0.7)
        for share in (True, False):
            got, cost = _ours(model, ids, span, predict, outcome, max_tokens, share, temperature=0.7)
            assert cost.copies == int(reasoning.sum())
            assert float(want.abs().max()) > 1e-8  # not trivially zero
            torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-10)
            assert torch.all(got[~reasoning] == 0)


def test_prefix_sharing_feeds_fewer_tokens_and_respects_the_token_budget(model):
    ids, reasoning, predict = _sequence(3, length=64)
    span = occlusion_spans(reasoning, "exact", budget=1)
    end = int(predict.nonzero()[-1]) + 1
    shared, cost = _ours(model, ids, span, predict, "mean", max_tokens=4 * end)
    full, full_cost = _ours(model, ids, span, predict, "mean", max_tokens=4 * end, share_prefix=False)
    torch.testing.assert_close(shared, full, rtol=1e-6, atol=1e-12)
    r = int(reasoning.sum())
    assert cost.peak_call_tokens <= 4 * end and full_cost.peak_call_tokens <= 4 * end
    assert cost.copies == full_cost.copies == r
    assert full_cost.forwards == 1 + -(-r // 4)  # whole copies of `end` tokens: four to a call
    assert cost.forwards < full_cost.forwards  # copies fed from their span on: more of them to a call
    assert cost.tokens < 0.7 * full_cost.tokens
    assert full_cost.tokens == end * (1 + r)  # nothing after the answer is fed


def test_budgeted_chunks_with_k_at_least_r_equal_exact_mode(model):
    ids, reasoning, predict = _sequence(4)
    r = int(reasoning.sum())
    exact = occlusion_spans(reasoning, "exact", budget=1)
    for k in (r, r + 5):
        chunk = occlusion_spans(reasoning, "chunk", budget=k)
        assert torch.equal(chunk, exact)
        assert torch.equal(_ours(model, ids, chunk, predict, "mean", 500)[0],
                           _ours(model, ids, exact, predict, "mean", 500)[0])


@pytest.mark.parametrize("mode", ["chunk", "line"])
def test_budgeted_modes_score_whole_spans_like_the_naive_loop(model, mode):
    ids, reasoning, predict = _sequence(5, length=60)
    line_end = torch.zeros_like(reasoning)
    line_end[[14, 15, 22, 30, 41, 47]] = True
    span = occlusion_spans(reasoning, mode, budget=4, line_end=line_end)
    got, cost = _ours(model, ids, span, predict, "joint", max_tokens=300)
    want = _naive(model, ids, span, predict, "joint")
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-10)
    assert cost.copies == int(span.max()) + 1 <= 4
    for s in range(int(span.max()) + 1):  # every token of a span carries the span's importance
        assert torch.unique(got[span == s]).numel() == 1


def test_occlusion_spans_exact_chunk_and_line():
    reasoning = torch.zeros(20, dtype=torch.bool)
    reasoning[5:15] = True
    exact = occlusion_spans(reasoning, "exact", budget=3)
    assert exact[5:15].tolist() == list(range(10)) and torch.all(exact[~reasoning] == -1)
    chunk = occlusion_spans(reasoning, "chunk", budget=3)
    assert chunk[5:15].tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2] and torch.all(chunk[~reasoning] == -1)
    line_end = torch.zeros(20, dtype=torch.bool)
    line_end[[6, 8, 9, 12]] = True  # steps: 5-6, 7-8, 9, 10-12, 13-14
    assert occlusion_spans(reasoning, "line", 10, line_end)[5:15].tolist() == [0, 0, 1, 1, 2, 3, 3, 3, 4, 4]
    assert occlusion_spans(reasoning, "line", 2, line_end)[5:15].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    no_reasoning = torch.zeros(20, dtype=torch.bool)
    assert torch.all(occlusion_spans(no_reasoning, "chunk", 4) == -1)
    with pytest.raises(ValueError, match="line_end"):
        occlusion_spans(reasoning, "line", 4)


def test_no_answer_no_reasoning_and_spans_after_the_answer_cost_nothing(model):
    ids, reasoning, predict = _sequence(6)
    span = occlusion_spans(reasoning, "exact", 1)
    for args in ((span, torch.zeros_like(predict)), (torch.full_like(span, -1), predict)):
        got, cost = _ours(model, ids, *args, "mean", 500)
        assert torch.all(got == 0) and cost.forwards == 0
    after = torch.full_like(span, -1)
    after[-2:] = torch.tensor([0, 1])  # tokens after the last answer token cannot move the outcome
    got, cost = _ours(model, ids, after, predict, "mean", 500)
    assert torch.all(got == 0) and cost.copies == 0


def test_no_gradient_and_model_untouched(model):
    ids, reasoning, predict = _sequence(7)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got, _ = _ours(model, ids, occlusion_spans(reasoning, "exact", 1), predict, "mean", 500)
    assert not got.requires_grad
    assert all(p.grad is None and torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_position_ids_are_taken_from_the_caller(model):
    """A left-padded prompt in verl keeps position ids that start later: the copies must use them."""
    ids, reasoning, predict = _sequence(8)
    span = occlusion_spans(reasoning, "exact", 1)
    shifted = torch.arange(len(ids)) + 5
    got, _ = _ours(model, ids, span, predict, "mean", 500, positions=shifted)
    want = naive_perturbation_importance(
        lambda x: model(input_ids=x, position_ids=shifted[None]).logits, ids, span, predict, NEUTRAL, "mean"
    )
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=1e-10)


def test_sliding_window_models_do_not_share_prefixes():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=0)
    assert not can_share_prefix(Qwen2ForCausalLM(config))


def test_bad_perturbation_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="perturb_mode"):
        OARConfig(perturb_mode="tokens")
    with pytest.raises(ValueError, match="perturb_budget"):
        OARConfig(perturb_budget=0)
    with pytest.raises(ValueError, match="perturb_token_id"):
        OARConfig(perturb_token_id=-5)
    with pytest.raises(ValueError, match="perturb_max_tokens"):
        OARConfig(perturb_max_tokens=-1)
