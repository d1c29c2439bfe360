"""CSCR's and OPPO's privileged re-scoring pass through verl's real FSDP2 engine (in-process worker,
one-rank gloo group; engine_privileged_check.py) equals a per-sequence plain-transformers reference:
the rewritten prompts rendered by ``tokenizer.apply_chat_template`` (the pass uses verl's rollout token
builder), the response appended, log-softmax at the rollout temperature (0.7), with packing on and
off, micro-batch sizes 6, 2 and 3, dynamic batch size with parameter offload; four templates (identity,
CSCR's two conditions, OPPO's oracle with the answer) in one call of 24 rows; under a context limit (the
longest rollout row + 40 tokens) 4 rows get their question shortened from the middle
(``core.privileged_prompt.fit_question``, the reference with apply_chat_template's rendering gives the same
prompts) and 6 that do not fit even with an empty question are skipped (scored on their rollout prompt, as
the reference does); with the identity template the rows are
the rollout's and their log-probs those of the rollout rows scored alone. OPPO's teacher oracle: the
worker builds a second, frozen model from ``actor_rollout_ref.oar_teacher`` (integration.teacher) with
the reference model's engine settings, and ``compute_teacher_log_prob`` equals plain transformers on the
teacher's weights, not the actor's (micro-batches of 2; dynamic batch size with offload)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def all_cases(engine_cases):
    return engine_cases["privileged"]  # the interpreter shared with the other engine checks (conftest.py)


@pytest.fixture(scope="module")
def cases(all_cases):
    return [c for c in all_cases if not c.get("teacher")]


def _name(case):
    return f"rmpad={case['use_remove_padding']},dyn={case['use_dynamic_bsz']},mb={case['micro_bsz']},offload={case['param_offload']}"


def test_every_engine_setting_is_checked(cases):
    assert {(c["use_remove_padding"], c["use_dynamic_bsz"], c["param_offload"]) for c in cases} == {
        (True, False, False), (False, False, False), (True, True, True)}
    assert {c["micro_bsz"] for c in cases if not c["use_dynamic_bsz"]} == {6, 2, 3}


def test_privileged_log_probs_equal_plain_transformers(cases):
    for case in cases:
        for part in ("full", "truncated"):
            assert case[f"{part}_rows"] == 24, _name(case)
            assert case[f"{part}_max_abs_err"] <= 1e-5, (_name(case), part, case)
            assert case[f"{part}_prompts_equal"], (_name(case), part)  # verl's builder == apply_chat_template


def test_templates_add_prompt_tokens_and_the_context_limit_shortens_or_skips(cases):
    for case in cases:
        added = case["full_prompt_tokens_added"]
        assert added[:6] == [0] * 6 and min(added[6:]) > 0, case   # identity adds nothing; the others add text
        assert (case["full_truncated_rows"], case["full_skipped_rows"], case["full_scored_rows"]) == (0, 0, 24), case
        assert (case["truncated_truncated_rows"], case["truncated_skipped_rows"], case["truncated_scored_rows"]) == (
            4, 6, 18), case


def test_identity_template_gives_the_rollouts_prompt_and_log_probs(cases):
    for case in cases:
        assert case["identity_prompt_equal"], _name(case)
        assert case["identity_vs_rollout_max_abs_err"] <= 1e-6, (_name(case), case)


def test_teacher_log_probs_equal_plain_transformers_on_the_teachers_weights(all_cases):
    teacher = [c for c in all_cases if c.get("teacher")]
    assert {c["use_dynamic_bsz"] for c in teacher} == {False, True}
    for case in teacher:
        assert case["separate_engine"], case
        assert case["full_max_abs_err"] <= 1e-5, case
        assert case["teacher_vs_actor_min_max_diff"] > 0.1, case  # it really is another model
