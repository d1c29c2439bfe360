"""Bad and degenerate inputs take a clear error or the documented, counted fallback (uniform GRPO
credit, counted under oar/fallback/*) -- never a NaN, a stack trace from deep inside torch, or lost data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from verl_oar.cpu.workspace import build_tokenizer
from verl_oar.engines.inputs import PREDICT as _PREDICT, REASONING as _REASONING, add_outcome_masks
from verl_oar.integration.estimators import compute_oar_g_advantage
from verl_oar.integration.estimators import compute_oar_p_advantage
from verl_oar.integration.signals import TokenSignals, provide


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _worker_batch(tokenizer, prompts: list[list[int]], responses: list[list[int]]) -> TensorDict:
    p = [torch.tensor(x, dtype=torch.long) for x in prompts]
    r = [torch.tensor(x, dtype=torch.long) for x in responses]
    return TensorDict(
        {"prompts": _nested(p), "responses": _nested(r), "response_mask": _nested([torch.ones_like(x) for x in r])},
        batch_size=[len(p)],
    )


def test_outcome_masks_for_empty_length_one_truncated_and_left_padded(tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    enc = tokenizer.encode
    prompts = [enc("What is 2+2?"), [pad, pad, pad] + enc("What is 2+2?"), enc("Q?"), enc("Q?"), enc("What?")]
    responses = [
        enc("2 and 2 make 4 so \\boxed{4}") + [eos],  # normal
        enc("2 and 2 make 4 so \\boxed{4}") + [eos],  # same response after a left-padded prompt
        [],  # empty response
        [eos],  # length 1
        enc("2 and 2 make 4 so \\boxed{1"),  # truncated inside the box
    ]
    data = _worker_batch(tokenizer, prompts, responses)
    reasoning, answer, _ = add_outcome_masks(data, tokenizer)
    assert reasoning.shape == answer.shape == (5, max(len(r) for r in responses))
    found = answer.bool().any(dim=1).tolist()
    assert found == [True, True, False, False, False]
    # identical responses get identical masks whatever the prompt (padding included) looks like
    assert torch.equal(reasoning[0], reasoning[1]) and torch.equal(answer[0], answer[1])
    # full-sequence masks: the logits at t-1 predict answer token t; reasoning sits in the response
    for i, (p, r) in enumerate(zip(prompts, responses)):
        full_reasoning, full_predict = data[_REASONING][i], data[_PREDICT][i]
        assert len(full_reasoning) == len(full_predict) == len(p) + len(r)
        answer_positions = torch.nonzero(answer[i, : len(r)]).flatten() + len(p)
        assert torch.equal(torch.nonzero(full_predict).flatten(), answer_positions - 1)
        assert int(full_reasoning[: len(p)].sum()) == 0
    assert tokenizer.decode([responses[0][t] for t in torch.nonzero(answer[0]).flatten()]) == "4"


def _run_estimator(rewards, importance, reasoning, answer, length, estimator=compute_oar_g_advantage, mask=None):
    bs = len(rewards)
    token_level_rewards = torch.zeros(bs, length)
    token_level_rewards[:, -1] = torch.tensor(rewards)
    mask = torch.ones(bs, length) if mask is None else mask
    index = np.array(["g"] * bs, dtype=object)
    signals = TokenSignals(tensors={"oar_importance": importance, "oar_reasoning_mask": reasoning, "oar_answer_mask": answer})
    with provide(signals):
        adv, _ = estimator(token_level_rewards=token_level_rewards, response_mask=mask, index=index, config={})
    return adv, signals.metrics


def test_non_finite_importance_falls_back_to_grpo_credit_and_is_counted():
    length = 6
    importance = torch.rand(4, length)
    importance[0, 1] = float("nan")
    importance[1, 2] = float("inf")
    importance[2, 0] = float("-inf")
    reasoning = torch.zeros(4, length, dtype=torch.long)
    reasoning[:, :4] = 1
    answer = torch.zeros(4, length, dtype=torch.long)
    answer[:, 4] = 1
    adv, metrics = _run_estimator([1.0, 0.0, 1.0, 0.0], importance, reasoning, answer, length)
    assert torch.isfinite(adv).all()
    for row in (0, 1, 2):
        assert torch.allclose(adv[row], adv[row, 0].expand(length))  # uniform: GRPO's credit
    assert metrics["fallback/frac_non_finite"] == pytest.approx(0.75)
    assert all(np.isfinite(v) for v in metrics.values())


def test_all_rewards_equal_gives_zero_advantages_without_nan():
    length = 5
    reasoning = torch.ones(4, length, dtype=torch.long)
    reasoning[:, -2:] = 0
    answer = torch.zeros(4, length, dtype=torch.long)
    answer[:, -2] = 1
    adv, metrics = _run_estimator([0.5] * 4, torch.rand(4, length), reasoning, answer, length)
    assert torch.equal(adv, torch.zeros_like(adv))
    assert all(np.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("estimator", [compute_oar_g_advantage, compute_oar_p_advantage], ids=["oar_g", "oar_p"])
def test_no_answer_and_no_reasoning_fall_back_and_are_counted_separately(estimator):
    length = 5
    reasoning = torch.zeros(3, length, dtype=torch.long)
    answer = torch.zeros(3, length, dtype=torch.long)
    reasoning[0, :3] = 1
    answer[0, 3] = 1  # normal
    answer[1, 0] = 1  # answer first: nothing to reshape
    # row 2: truncated, no answer
    adv, metrics = _run_estimator([1.0, 0.0, 0.5], torch.rand(3, length), reasoning, answer, length, estimator)
    for row in (1, 2):
        assert torch.allclose(adv[row], adv[row, 0].expand(length))
    assert metrics["fallback/frac_no_answer"] == pytest.approx(1 / 3)
    assert metrics["fallback/frac_no_reasoning"] == pytest.approx(1 / 3)


def test_signals_that_do_not_line_up_with_the_batch_are_refused():
    signals = TokenSignals(tensors={"oar_importance": torch.zeros(2, 3), "oar_reasoning_mask": torch.zeros(2, 3),
                                    "oar_answer_mask": torch.zeros(2, 3)})
    with provide(signals), pytest.raises(RuntimeError, match="do not line up"):
        compute_oar_g_advantage(token_level_rewards=torch.zeros(2, 4), response_mask=torch.ones(2, 4),
                                index=np.array(["a", "a"], dtype=object), config={})


def test_oar_p_short_response_after_a_long_padded_prompt_keeps_its_own_tokens():
    """The reference code wrote weights to ``[:len]`` of the padded row; here a 2-token response with
    no answer, next to a long one, takes the counted fallback on exactly its own tokens."""
    length = 8
    mask = torch.ones(2, length)
    mask[1, 2:] = 0  # the short response: 2 tokens, then padding
    reasoning = torch.zeros(2, length, dtype=torch.long)
    answer = torch.zeros(2, length, dtype=torch.long)
    reasoning[0, :6] = 1
    answer[0, 6] = 1
    importance = torch.rand(2, length) * reasoning
    adv, metrics = _run_estimator([1.0, 0.0], importance, reasoning, answer, length, compute_oar_p_advantage, mask)
    assert metrics["fallback/frac_no_answer"] == pytest.approx(0.5)
    assert torch.all(adv[1, 2:] == 0) and torch.allclose(adv[1, :2], adv[1, 0].expand(2)) and adv[1, 0] < 0
    assert not torch.allclose(adv[0, :6], adv[0, 0].expand(6))  # the long one is reshaped
    torch.testing.assert_close(adv[0].sum(), adv[0, 7] * length, rtol=1e-5, atol=1e-5)  # mass preserved


def test_oar_p_without_a_neutral_token_asks_for_one():
    from types import SimpleNamespace

    from verl_oar.core.config import OARConfig
    from verl_oar.core.config import neutral_token_id

    bare = SimpleNamespace(pad_token_id=None, eos_token_id=None)
    with pytest.raises(ValueError, match="Set algorithm.oar.perturb_token_id"):
        neutral_token_id(OARConfig(), bare)
    assert neutral_token_id(OARConfig(), SimpleNamespace(pad_token_id=None, eos_token_id=7)) == 7
    assert neutral_token_id(OARConfig(perturb_token_id=3), bare) == 3


def test_oar_p_refuses_multimodal_position_ids_with_the_fix(tokenizer):
    """Multimodal rope gives each token several position ids; OAR-P's prefix cache assumes one."""
    from verl_oar.engines.inputs import PREDICT, REASONING
    from verl_oar.engines.perturbation_batch import score_micro_batch
    from verl_oar.core.perturbation import PerturbationConfig

    ids = torch.arange(10)
    data = TensorDict({"input_ids": _nested([ids]), "position_ids": _nested([torch.arange(30).reshape(10, 3)]),
                       REASONING: _nested([torch.ones(10, dtype=torch.long)]),
                       PREDICT: _nested([torch.ones(10, dtype=torch.long)])}, batch_size=[1])
    data["temperature"] = torch.ones(1)
    with pytest.raises(ValueError, match="1-D position ids.*multimodal rope.*adv_estimator=grpo"):
        score_micro_batch(None, data, PerturbationConfig(), 0, None, 1)


def test_signals_of_other_rows_are_refused_rather_than_trained_on():
    """Rows that moved between the importance pass and the advantage (verl #7956: pf-ppo resampling after the
    advantage): the masks the workers built for a long row now sit on a shorter one and reach past its end."""
    length = 6
    reasoning = torch.zeros(2, length, dtype=torch.long)
    answer = torch.zeros(2, length, dtype=torch.long)
    reasoning[:, :4] = 1
    answer[:, 4] = 1
    mask = torch.ones(2, length)
    _run_estimator([1.0, 0.0], torch.rand(2, length), reasoning, answer, length, mask=mask)   # lined up: fine
    mask[1, 3:] = 0          # row 1 is really 3 tokens long: its signals belong to another row
    with pytest.raises(RuntimeError, match=r"rows \[1\] reaches past the end .*use_pf_ppo=false"):
        _run_estimator([1.0, 0.0], torch.rand(2, length), reasoning, answer, length, mask=mask)


@pytest.mark.parametrize("estimator", ["oar_g", "oar_p", "codapo"])
def test_pf_ppo_is_refused_for_the_plugins_estimators(estimator):
    from _verl_config import compose_ppo_config

    from verl_oar.integration.validate import check_token_signals_supported

    config = compose_ppo_config([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.actor.strategy=fsdp2",
                                 "algorithm.use_pf_ppo=true"])
    with pytest.raises(ValueError, match="use_pf_ppo=true cannot be combined .*#7956"):
        check_token_signals_supported(config, "sync")
    check_token_signals_supported(compose_ppo_config(["algorithm.adv_estimator=grpo", "algorithm.use_pf_ppo=true"]),
                                  "sync")                                                   # verl's own: untouched
