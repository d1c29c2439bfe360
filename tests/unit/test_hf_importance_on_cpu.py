"""core.hf.hf_importance, the importance of plain HF sequences (heatmap, testbed, benchmarks), against OAR-G's core
function called directly and OAR-P's reference loop: a right-padded batch, temperature, and bad arguments."""

from __future__ import annotations

import pytest
import torch
from _oar_p_reference import naive_perturbation_importance
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl_oar.core.gradient import GradientConfig, gradient_importance
from verl_oar.core.hf import hf_importance
from verl_oar.core.perturbation import PerturbationConfig, occlusion_spans

VOCAB, PAD = 64, 0


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def batch():
    """Two rows of 20 and 14 tokens, right-padded to 20: prompt 4, reasoning, then a 3-token answer."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 20), generator=g)
    attention = torch.ones(2, 20, dtype=torch.long)
    attention[1, 14:] = 0
    ids[1, 14:] = PAD
    reasoning = torch.zeros(2, 20, dtype=torch.bool)
    answer = torch.zeros(2, 20, dtype=torch.bool)
    for row, length in enumerate((20, 14)):
        reasoning[row, 4 : length - 3] = True
        answer[row, length - 3 : length] = True
    return ids, attention, reasoning, answer


def test_oar_p_is_the_reference_loop_row_by_row(model, batch):
    """The rows share model calls (core.perturbation): equal to the naive loop on each row alone (its unpadded
    tokens, the spans of ``cfg.mode``, the temperature) up to fp32 rounding; exactness in float64 is
    test_batched_perturbation_on_cpu.py's."""
    ids, attention, reasoning, answer = batch
    cfg = PerturbationConfig(mode="chunk", budget=4)
    got = hf_importance(model, ids, reasoning, answer, cfg, attention_mask=attention, neutral_id=PAD,
                        max_tokens=50, temperature=0.7)
    for row, length in enumerate((20, 14)):
        predict = torch.zeros(length, dtype=torch.bool)
        predict[:-1] = answer[row, 1:length]
        want = naive_perturbation_importance(lambda x: model(input_ids=x).logits, ids[row, :length],
                                             occlusion_spans(reasoning[row, :length], "chunk", 4), predict, PAD,
                                             cfg.outcome, temperature=0.7)
        assert torch.allclose(got[row, :length], want, rtol=1e-3, atol=1e-8), (got[row, :length] - want).abs().max()
        assert (got[row, length:] == 0).all()
    assert (got[reasoning] > 0).all() and (got[~reasoning] == 0).all()


def test_oar_g_divides_the_logits_by_the_temperature(model, batch):
    ids, attention, reasoning, answer = batch
    cfg = GradientConfig()
    got = hf_importance(model, ids, reasoning, answer, cfg, attention_mask=attention, temperature=0.5,
                        generator=torch.Generator().manual_seed(2))
    predict = torch.zeros_like(answer)
    predict[:, :-1] = answer[:, 1:]

    def logits_fn(embeds):
        return model(inputs_embeds=embeds, attention_mask=attention, use_cache=False).logits.float() / 0.5

    want = gradient_importance(
        logits_fn, model.get_input_embeddings()(ids).detach(), reasoning, predict, torch.roll(ids, -1, 1),
        torch.arange(2)[:, None].expand(2, 20), 2, cfg, generator=torch.Generator().manual_seed(2))
    assert torch.equal(got, want)
    assert (got[~reasoning] == 0).all() and (got[reasoning] > 0).any()


def test_bad_arguments(model, batch):
    ids, _, reasoning, answer = batch
    with pytest.raises(ValueError, match="neutral_id"):
        hf_importance(model, ids, reasoning, answer, PerturbationConfig())
    with pytest.raises(TypeError, match="GradientConfig or a PerturbationConfig"):
        hf_importance(model, ids, reasoning, answer, object())
