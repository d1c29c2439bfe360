"""Grading under load and bad input (verl_oar.rewards.math_reward, .verify_pool, .prescreen): a right answer is
never scored a plain 0 because other answers were slow; every result says whether it was graded; bad input gets a
clear error or a defined result; random and adversarial strings never raise, stay bounded, run no code."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_oar.rewards import math_reward, verify_pool
from verl_oar.rewards.math_reward import GRADED, NOT_GRADED, compute_score
from verl_oar.rewards.prescreen import screen, tower_height

RIGHT = ("1/2 is \\boxed{\\frac{1}{2}}", "0.5")          # needs math-verify: not an exact match
TOWER = "so \\boxed{9^{9^{9^{9}}}}"                      # math-verify spends its 5 s parse limit on it


def _never_a_plain_zero_for_a_right_answer(results):
    for result in results:
        assert result["score"] == 1.0 or (result["graded"] == 0.0 and result["grade"] in NOT_GRADED), result


@pytest.fixture
def two_workers():
    verify_pool.configure(2)      # this machine's 2 cores: the setting the load was reported on
    yield
    verify_pool.configure(verify_pool.VERIFY_WORKERS)


def test_eight_right_answers_among_24_towers_are_all_scored_1(two_workers):
    """The reported case: 8 right answers mixed with 24 exponent towers, from 8 threads as verl's reward manager
    calls. Before: 5 of the 8 scored 0 after waiting 30 s for a worker. Now the towers are screened out."""
    jobs = [RIGHT] * 8 + [(TOWER, "0.5")] * 24
    order = np.random.default_rng(0).permutation(len(jobs))
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: compute_score("math500", *jobs[i]), order))
    right = [r for i, r in zip(order, results, strict=True) if jobs[i] == RIGHT]
    towers = [r for i, r in zip(order, results, strict=True) if jobs[i] != RIGHT]
    assert [r["score"] for r in right] == [1.0] * 8 and {r["grade"] for r in right} == {"verified"}
    assert {r["grade"] for r in towers} == {"prescreened"} and {r["graded"] for r in towers} == {0.0}
    assert time.monotonic() - started < 30


def test_unscreened_slow_answers_leave_right_ones_scored_or_marked_not_graded(two_workers, monkeypatch):
    """With the screen off, slow answers hold both workers; a right answer waiting past the queue's bound is
    ``no_worker`` (not graded, counted), never a plain 0, and those that get a worker are scored 1."""
    monkeypatch.setattr(math_reward, "screen", lambda pred, truths: None)
    jobs = [(TOWER, "0.5")] * 4 + [RIGHT] * 6
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda job: compute_score("math500", *job, queue_timeout_s=3.0), jobs))
    right = results[4:]
    _never_a_plain_zero_for_a_right_answer(right)
    assert any(r["grade"] == "no_worker" for r in right)     # the bound did act
    assert all(r["grade"] in ("refuted", "no_worker") for r in results[:4])


def test_the_wait_for_a_worker_does_not_use_the_answers_own_budget(monkeypatch):
    """One worker, held ~5 s by a tower; a right answer queued behind it with a 3 s budget of its own is still
    verified, because its budget starts when the worker takes it (it used to time out while waiting)."""
    monkeypatch.setattr(math_reward, "screen", lambda pred, truths: None)
    verify_pool.configure(1)
    try:
        compute_score("math500", *RIGHT)                  # the worker is up: its start-up is not the point here
        with ThreadPoolExecutor(2) as pool:
            slow = pool.submit(compute_score, "math500", TOWER, "0.5", timeout_s=20)
            time.sleep(0.5)
            waited = time.monotonic()
            right = pool.submit(compute_score, "math500", *RIGHT, timeout_s=3).result()
            waited = time.monotonic() - waited
            slow.result()
    finally:
        verify_pool.configure(verify_pool.VERIFY_WORKERS)
    assert waited > 3.0                                   # it waited longer than its own budget ...
    assert right["grade"] == "verified" and right["score"] == 1.0   # ... and was graded all the same


def test_every_result_says_how_it_was_graded():
    cases = {
        ("\\boxed{0.5}", "0.5"): "exact",
        ("\\boxed{0.5}", "\\frac{1}{2}"): "verified",
        ("\\boxed{3}", "4"): "refuted",
        ("no answer here", "4"): "no_answer",
        (TOWER, "4"): "prescreened",
        ("\\boxed{4}", ""): "no_ground_truth",
        ("\\boxed{4}", None): "no_ground_truth",
    }
    for (response, truth), grade in cases.items():
        result = compute_score("math500", response, truth)
        assert result["grade"] == grade
        assert result["graded"] == (1.0 if grade in GRADED else 0.0)
        assert result["score"] == (1.0 if grade in ("exact", "verified") else 0.0)
    assert set(GRADED).isdisjoint(NOT_GRADED)


# ---------------------------------------------------------------------------------------------
# bad input: a clear error naming the argument, or a defined result
# ---------------------------------------------------------------------------------------------


def test_a_list_of_ground_truths_accepts_any_of_them():
    assert compute_score("x", "\\boxed{1}", ["1", "2"])["score"] == 1.0
    assert compute_score("x", "\\boxed{2}", ("1", "2"))["score"] == 1.0
    assert compute_score("x", "\\boxed{0.5}", np.array(["7", "\\frac{1}{2}"]))["grade"] == "verified"
    assert compute_score("x", "\\boxed{3}", ["1", "2"])["grade"] == "refuted"
    assert compute_score("x", "\\boxed{12}", [np.int64(12)])["score"] == 1.0
    assert compute_score("x", "\\boxed{12}", 12)["score"] == 1.0
    assert compute_score("x", "\\boxed{12}", [])["grade"] == "no_ground_truth"


@pytest.mark.parametrize("response", [None, b"\\boxed{1}", [1, 2, 3], 7])
def test_a_response_that_is_not_a_string_is_refused_by_name(response):
    with pytest.raises(TypeError, match="solution_str must be the decoded response"):
        compute_score("x", response, "1")


@pytest.mark.parametrize("truth", [{"answer": "1"}, [["1"]], True, [None]])
def test_a_ground_truth_of_another_type_is_refused_by_name(truth):
    with pytest.raises(TypeError, match="ground_truth"):
        compute_score("x", "\\boxed{1}", truth)


def test_a_bad_worker_count_is_refused_by_name():
    with pytest.raises(ValueError, match="verify_workers"):
        compute_score("x", "\\boxed{1}", "2", verify_workers=0)


# ---------------------------------------------------------------------------------------------
# the screens: sound (never fire on what the ground truth itself contains) and cheap
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "height"), [
    ("x", 0), ("2^{10}", 1), ("x^{2^n}", 2), ("e^{x}+e^{y}", 1), ("a^b^c", 2), ("9^9^9^9", 3),
    ("9^{9^{9^{9}}}", 3), ("2 ** 3 ** 4 ** 5", 3), ("{2^{3}}^{4}", 1),
])
def test_tower_height_by_hand(text, height):
    assert tower_height(text) == height


@pytest.mark.parametrize(("pred", "reason"), [
    ("9^{9^{9^{9}}}", "tower"), ("10^{10^{10}}", "huge_exponent"), ("7^{12345678}", "huge_exponent"),
    ("99999!", "huge_factorial"), ("1" * 401, "too_long"),
    ("2^{2^{5}}", None), ("x^{2^n}+1", None), ("123!", None), ("10^{6}", None), ("\\frac{\\sqrt{3}}{2}", None),
])
def test_screen_by_hand(pred, reason):
    assert screen(pred, ["0.5"]) == reason
    assert screen(pred, [pred]) is None                   # the ground truth trips it too: graded as usual


def test_a_right_answer_is_never_screened():
    """A ground truth and an answer equal to it never trip a screen the truth does not trip."""
    for truth in ["2^{2^{2^{2}}}", "10^{10^{10}}", "100000!", "x" * 300, "\\frac{1}{2}"]:
        assert screen(truth, [truth]) is None
        assert compute_score("x", f"\\boxed{{{truth}}}", truth)["score"] == 1.0


# ---------------------------------------------------------------------------------------------
# fuzz: random and adversarial strings
# ---------------------------------------------------------------------------------------------

ADVERSARIAL = st.sampled_from([
    "\\boxed{", "}", "{", "\\fbox{", "####", "Answer:", "The answer is", "\x00", "\ud800", "\udfff", "\\", "$",
    "^{", "9^9^9", "99999999999999999999", "!", "__import__('os').system('touch /tmp/verl_oar_pwned')",
    "eval(", "exec(", "lambda: 0", "\\frac{", "\\sqrt{", "1e308", "-0", "∞", "é", "\n", " ",
])
TEXTS = st.lists(st.one_of(ADVERSARIAL, st.text(max_size=6)), max_size=20).map("".join)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(response=TEXTS, truth=st.one_of(TEXTS, st.sampled_from(["12", "\\frac{1}{2}", "x^2"])))
def test_random_and_adversarial_strings_are_graded_without_error_in_bounded_time(response, truth):
    started = time.monotonic()
    result = compute_score("x", response, truth)
    assert time.monotonic() - started < verify_pool.ANSWER_TIMEOUT_S + 5
    assert result["grade"] in GRADED + NOT_GRADED
    assert result["score"] in (0.0, 1.0) and result["graded"] in (0.0, 1.0)


def test_code_in_an_answer_is_never_run(tmp_path):
    marker = tmp_path / "pwned"
    for payload in [f"__import__('os').system('touch {marker}')", f"open('{marker}', 'w')",
                    f"exec(\"open('{marker}','w')\")"]:
        result = compute_score("x", f"\\boxed{{{payload}}}", "1")
        assert result["score"] == 0.0 and result["grade"] in GRADED + NOT_GRADED
        assert result["grade"] != "verified"
    assert not marker.exists()


def test_validation_averages_the_graded_flag_per_data_source():
    """verl's validation metrics (``process_validation_metrics``, what ``trainer_base._validate`` turns into
    ``val-aux/{data_source}/{key}/mean@N``) read the reward's ``graded`` as a number: the share of graded answers."""
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    results = [compute_score("math500", *RIGHT), compute_score("math500", TOWER, "0.5"),
               compute_score("math500", "\\boxed{3}", "4"), compute_score("math500", TOWER, "0.5")]
    infos = {key: [r[key] for r in results] for key in ("score", "acc", "graded", "grade", "pred")}
    metrics = process_validation_metrics(["math500"] * 4, ["q0", "q0", "q1", "q1"], infos)
    graded = metrics["math500"]["graded"]
    assert graded["mean@2"] == pytest.approx(0.5)             # two of four answers graded
    assert "grade" not in metrics["math500"]                  # strings are not averaged
