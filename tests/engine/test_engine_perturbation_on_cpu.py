"""OAR-P importance through verl's real FSDP2 engine (in-process worker, one-rank gloo group) equals
the naive loop -- one whole-sequence plain-transformers forward per occluded copy -- for each outcome
definition, with packing on and off, several micro-batch sizes, dynamic batch size, parameter
offload and the chunk and line modes; a sample's importance does not depend on the rest of its batch;
the call leaves parameters, grads and optimizer state as it found them. The engine runs in a
subprocess (tests/engine/conftest.py): torch.distributed's process group is process-global.

Tolerance: the engine runs in fp32 (verl has no fp64 engine) and a KL between two nearly equal
distributions cancels catastrophically in fp32: differences of ~1e-6 in the logits (another batch
shape, a cached prefix, rows of other samples in the call) move I_t by ~5e-7 to 1e-6 on a scale of 1e-4.
The fp64 comparisons at 1e-10 are in test_batched_perturbation_on_cpu.py and
test_perturbation_importance_on_cpu.py.
"""

from __future__ import annotations


import pytest


@pytest.fixture(scope="module")
def cases(engine_cases):
    return engine_cases["perturbation"]  # run in the interpreter shared with the other engine check (conftest.py)


def _name(case):
    return (f"rmpad={case['use_remove_padding']},dyn={case['use_dynamic_bsz']},mb={case['micro_bsz']},"
            f"{case['outcome']},{case['mode']}")


def _tolerance(case):
    # 1% of the largest importance, and never below 2e-6: fp32 KL cancellation alone moves I_t by ~1e-6 when
    # copies of several samples share a padded call (the 1e-10 float64 check is the exactness proof)
    return max(1e-2 * case["scale"], 2e-6)


def test_engine_perturbation_equals_the_naive_loop(cases):
    for case in cases:
        assert case["scale"] > 0, _name(case)
        assert case["max_abs_err"] <= _tolerance(case), (_name(case), case)


def test_importance_does_not_depend_on_batch_composition_or_micro_batch_size(cases):
    for case in cases:
        assert case["alone_err"] <= _tolerance(case), (_name(case), case)
        assert case["reordered_err"] <= _tolerance(case), (_name(case), case)


def test_engine_perturbation_leaves_params_grads_and_optimizer_state_untouched(cases):
    for case in cases:
        assert case["state_unchanged"], _name(case)


def test_one_copy_per_span_and_one_value_per_span(cases):
    # 8 responses, 7 with an answer; "\\boxed{2}" has no reasoning token and one has no answer:
    # both get no copy and zero importance (the reshaping then counts their fallback)
    for case in cases:
        assert case["answers_found"] == 7 and case["nonzero_rows"] == 6, case
        assert case["copies"][2] == case["copies"][3] == 0, case
        assert case["distinct_values"] == [int(c) for c in case["copies"]], case
        if case["mode"] == "chunk":  # K = 3
            assert max(case["copies"]) == 3, case
        if case["mode"] == "line":  # one step per line: only the last response has three lines
            assert case["copies"][-1] == 3 and max(case["copies"][:-1]) == 1, case
        if case["mode"] == "exact":  # prefix sharing: far fewer tokens than one pass per copy
            assert all(p < 0.7 * c for p, c in zip(case["passes"], case["copies"]) if c > 10), case


def test_copies_stay_within_verls_log_prob_token_budget(cases):
    # dynamic batch size: log_prob_max_token_len_per_gpu=96 padded tokens per call; otherwise the
    # micro-batch size, in sequences of its longest sample (at most the batch's longest)
    for case in cases:
        for peak, length in zip(case["peak_tokens"], case["lengths"]):
            budget = 96 if case["use_dynamic_bsz"] else case["micro_bsz"] * max(case["lengths"])
            assert peak <= max(budget, length), (_name(case), peak, budget)
    # that rows of several samples share calls is checked on the core (test_batched_perturbation_on_cpu.py)
