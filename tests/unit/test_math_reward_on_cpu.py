"""The math reward (verl_oar.rewards.math_reward): hand-checked grades, the extracted answer is exactly the
span OAR grounds importance on, the timeout, calls from threads, and verl 0.9.1 loading and running
it as a custom reward function (``pkg://`` path, ``NaiveRewardManager`` in its executor thread)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_oar.core.answer_span import find_answer_span, parse_answer_span
from verl_oar.rewards.math_reward import compute_score

# (response, ground truth, expected score, expected pred): checked by hand
CASES = [
    # equivalent forms: the verifier, not string equality
    ("so \\boxed{0.5}", "\\frac{1}{2}", 1.0, "0.5"),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, "\\frac{1}{2}"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0, "x^2+2x+1"),
    ("\\boxed{(3, \\pi/2)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0, "(3, \\pi/2)"),
    ("\\boxed{ 12 }", "12", 1.0, "12"),
    ("\\fbox{7}", "7", 1.0, "7"),
    # GSM8K: thousands separators, #### responses, "The answer is"
    ("48/2 = 24\n#### 1,000", "1000", 1.0, "1,000"),
    ("So the answer is 1,000.", "1000", 1.0, "1,000"),
    ("The final answer is $\\frac{3}{4}$. I hope it is correct.", "0.75", 1.0, "\\frac{3}{4}"),
    # nested braces
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt 3}{2}", 1.0, "\\frac{\\sqrt{3}}{2}"),
    # wrong answers
    ("\\boxed{3}", "4", 0.0, "3"),
    ("first \\boxed{2}, no wait: \\boxed{3}", "2", 0.0, "3"),      # only the last box counts
    ("first \\boxed{2}, no wait: \\boxed{3}", "3", 1.0, "3"),
    ("#### 5\nso \\boxed{6}", "5", 0.0, "6"),                       # a box beats ####
    ("We get 4 apples, so it is \\boxed{5}", "4", 0.0, "5"),        # a number in the reasoning is not read
    # no answer
    ("I think it's 4", "4", 0.0, ""),
    ("so \\boxed{4", "4", 0.0, ""),                                 # truncated: unclosed box
    ("\\boxed{} oops\n#### 7", "7", 1.0, "7"),                      # an empty box falls through to ####
    # answers math-verify does not parse are still graded by exact match
    ("\\boxed{yes}", "yes", 1.0, "yes"),
    # no ground truth: never correct
    ("\\boxed{12}", "", 0.0, "12"),
    ("\\boxed{12}", None, 0.0, "12"),
    # the answer formats of other math RL data
    ("6 * 7 = 42\nAnswer: 42", "42", 1.0, "42"),                                      # DAPO-Math
    ("so 41? no\n**Answer:** $\\frac{1}{2}$", "0.5", 1.0, "\\frac{1}{2}"),
    ("## Final Answer\n\n$$\\frac{\\pi}{4}$$", "\\frac{\\pi}{4}", 1.0, "\\frac{\\pi}{4}"),
    ("Final Answer: The final answer is $7$. I hope it is correct.", "7", 1.0, "7"),  # Minerva
    ("Answer: 8\n#### 9", "8", 0.0, "9"),                                             # the later marker
    ("The answer is 3, since 3 is odd.", "3", 1.0, "3"),                               # justification cut
    ("The answer is x = 3, y = 4.", "x=3, y=4", 1.0, "x = 3, y = 4"),
    ("The answer is (1, 2), which is the only pair.", "(1,2)", 1.0, "(1, 2)"),
    ("Thus \\[ \\boxed{42} \\]", "42", 1.0, "42"),
]

# (response, answer_span): offsets checked by hand
SPANS = [
    ("so \\boxed{0.5}", "3:10:13"),
    ("48/2 = 24\n#### 1,000", "10:15:20"),
    ("x\nAnswer: 42", "2:10:12"),
    ("The answer is $7$.", "0:15:16"),
    ("I think it's 4", ""),
    ("so \\boxed{4", ""),
]


def _without_span(result):
    return {key: result[key] for key in ("score", "acc", "pred")}


@pytest.mark.parametrize(("response", "ground_truth", "score", "pred"), CASES)
def test_hand_checked(response, ground_truth, score, pred):
    result = compute_score("math500", response, ground_truth)
    assert _without_span(result) == {"score": score, "acc": score, "pred": pred}
    assert result["graded"] == (1.0 if ground_truth else 0.0)   # every case here is graded but "no ground truth"
    span = parse_answer_span(result["answer_span"])
    assert (span is None) == (pred == "")
    if span is not None:
        assert response[span.start:span.end] == pred and span.marker_start < span.start


@pytest.mark.parametrize(("response", "answer_span"), SPANS)
def test_answer_span_by_hand(response, answer_span):
    assert compute_score("math500", response, "")["answer_span"] == answer_span


def test_same_keys_every_call():
    """verl builds one array per key of the first result, so every result must have the same keys."""
    results = [compute_score("gsm8k", r, g) for r, g, _, _ in CASES]
    keys = {"score", "acc", "pred", "answer_span", "graded", "grade"}
    assert {frozenset(result) for result in results} == {frozenset(keys)}
    assert all(isinstance(result["answer_span"], str) for result in results)   # never averaged by verl


# ---------------------------------------------------------------------------------------------
# pred is exactly OAR's answer span
# ---------------------------------------------------------------------------------------------

FRAGMENTS = st.sampled_from([
    "\\boxed{", "\\fbox{", "\\boxed ", "{", "}", "\\{", "\\}", "####", "The answer is", "the final answer is:",
    "$", ".", ". ", "\n", " ", "12", "-3", "1,000", "\\frac{1}{2}", "x", "so", "é", "∞",
    "Answer:", "**Final Answer**", "\n## Final Answer\n", ", since", "; and", "(", ")", "\\[", "\\]", "\\(", "$$",
])
RESPONSES = st.lists(st.one_of(FRAGMENTS, st.text(max_size=4)), max_size=14).map("".join)


def _span_text(text: str) -> str:
    span = find_answer_span(text)
    return "" if span is None else text[span.start:span.end]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(RESPONSES)
def test_pred_is_the_answer_span(text):
    # an empty ground truth is never verified: this checks extraction alone, quickly
    result = compute_score("math500", text, "")
    assert result["pred"] == _span_text(text)
    span = parse_answer_span(result["answer_span"])
    assert span == find_answer_span(text)
    assert result["pred"] == ("" if span is None else text[span.start:span.end])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(RESPONSES)
def test_random_responses_are_graded_without_error(text):
    result = compute_score("math500", text, "12")
    assert result["pred"] == _span_text(text)
    assert result["score"] in (0.0, 1.0) and result["acc"] == result["score"]


# ---------------------------------------------------------------------------------------------
# threads and the timeout
# ---------------------------------------------------------------------------------------------


def test_threads():
    """math-verify's signal timeouts fail outside a main thread; the workers make that irrelevant."""
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: compute_score("gsm8k", f"#### {i},000", f"{i}000"), range(1, 17)))
    assert [r["score"] for r in results] == [1.0] * 16


def test_timeout_is_not_graded_and_recovers(caplog):
    compute_score("math500", "\\boxed{0.5}", "\\frac{1}{2}")        # a worker is up
    with caplog.at_level("WARNING", logger="verl_oar.rewards.math_reward"):
        result = compute_score("math500", "\\boxed{3/4}", "0.75", timeout_s=0.0)
    assert result == {"score": 0.0, "acc": 0.0, "pred": "3/4", "answer_span": "0:7:10", "graded": 0.0,
                      "grade": "timed_out"}
    assert "did not answer" in caplog.text
    assert compute_score("math500", "\\boxed{3/4}", "0.75")["score"] == 1.0   # a fresh worker answers


def test_workers_do_not_import_torch():
    """The worker module must stay light: ``python -m verl_oar.rewards.verify_pool`` imports no torch."""
    import subprocess
    import sys

    code = "import sys, verl_oar.rewards.verify_pool, verl_oar.rewards.math_reward; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


# ---------------------------------------------------------------------------------------------
# verl 0.9.1 loads and runs it
# ---------------------------------------------------------------------------------------------


def _reward_config():
    from omegaconf import OmegaConf

    return OmegaConf.create({"reward": {
        "custom_reward_function": {"path": "pkg://verl_oar.rewards.math_reward", "name": "compute_score",
                                   "reward_kwargs": {"timeout_s": 20}},
        "reward_manager": {"source": "register", "name": "naive"},
    }})


def test_verl_loads_it_by_pkg_path():
    from verl.trainer.ppo.reward import get_custom_reward_fn

    reward_fn = get_custom_reward_fn(_reward_config())
    result = reward_fn(data_source="aime24", solution_str="\\boxed{033}", ground_truth="33", extra_info={})
    assert result == {"score": 1.0, "acc": 1.0, "pred": "033", "answer_span": "0:7:10", "graded": 1.0,
                      "grade": "verified"}


def test_verl_naive_reward_manager_runs_it():
    """verl's NaiveRewardManager calls it in its event loop's executor thread and reports every key."""
    from verl import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    from verl_oar.cpu.workspace import build_tokenizer

    tokenizer = build_tokenizer()
    manager = load_reward_manager(_reward_config(), tokenizer)
    prompt = tokenizer.encode("What is 1/2 as a decimal?")
    response = tokenizer.encode("1/2 = 0.5, so \\boxed{0.5}") + [tokenizer.eos_token_id]
    pad = 3
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([prompt]),
            "responses": torch.tensor([response + [tokenizer.pad_token_id] * pad]),
            "attention_mask": torch.tensor([[1] * (len(prompt) + len(response)) + [0] * pad]),
        },
        non_tensors={
            "data_source": np.array(["math500"], dtype=object),
            "reward_model": np.array([{"ground_truth": "\\frac{1}{2}"}], dtype=object),
            "extra_info": np.array([{}], dtype=object),
        },
    )
    out = manager.loop.run_until_complete(manager.run_single(data))
    assert out == {"reward_score": 1.0,
                   "reward_extra_info": {"score": 1.0, "acc": 1.0, "pred": "0.5", "answer_span": "14:21:24",
                                         "graded": 1.0, "grade": "verified"}}
    rm_scores = type(manager).assemble_rm_scores(data, [out["reward_score"]])
    assert rm_scores.sum().item() == 1.0 and rm_scores[0, len(response) - 1].item() == 1.0
