"""ACPO's top-1 log-probs from verl's real FSDP2 engine (in-process worker, one-rank gloo group;
engine_modal_check.py): the worker's own ``compute_log_prob`` marked ``oar_acpo_modal`` returns them beside
verl's ``log_probs`` and ``entropy``, which stay bit-identical to the unmarked pass; they equal a per-sequence
plain-transformers reference (fp32: 1e-5; bf16 parameters: 0.05 nats), never fall below the sampled token's
log-prob, and -log p_max never exceeds verl's entropy; packing on and off, micro-batches of 6, 2 and 3,
dynamic batch size with offload; the engine's method is restored after the call."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def cases(engine_cases):
    return engine_cases["modal"]  # the interpreter shared with the other engine checks (conftest.py)


def test_every_engine_setting_and_dtype_is_checked(cases):
    assert {(c["use_remove_padding"], c["use_dynamic_bsz"], c["param_offload"], c["param_dtype"]) for c in cases} == {
        (True, False, False, "fp32"), (False, False, False, "fp32"), (True, True, True, "fp32"),
        (True, False, False, "bf16"), (False, False, False, "bf16")}
    assert all(c["rows"] == 6 and c["has_modal"] and not c["plain_has_modal"] for c in cases)


def test_verls_log_probs_and_entropy_keep_their_bits(cases):
    for case in cases:
        assert case["log_probs_bit_identical"] and case["entropy_bit_identical"], case
        assert case["engine_restored"], case


def test_modal_log_probs_equal_plain_transformers(cases):
    for case in cases:
        tolerance = 1e-5 if case["param_dtype"] == "fp32" else 5e-2
        assert case["modal_max_abs_err"] <= tolerance, case
        assert case["modal_minus_sampled_min"] >= -1e-6 and case["entropy_minus_surrogate_min"] >= -1e-5, case
