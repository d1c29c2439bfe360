"""OAR-G importance through verl's real FSDP2 engine (in-process worker, one-rank gloo group) equals a
per-sequence plain-transformers reference, with packing on and off, several micro-batch sizes, dynamic
batch size and parameter offload; the call leaves parameters, grads and optimizer state as it found
them; the fused path (verl's old-log-prob pass that also yields importance) returns log-probs and
entropy bit-identical to verl's own pass and bit-identical importance, in fp32 and in bf16 mixed
precision (FSDP2 ``param_dtype=bf16``, as real runs); and with the noise set to zero, the noisy KL
and its gradient are exactly 0 (the clean and the noisy outcome are the same computation). Every case
runs with verl's default gradient checkpointing, which OAR-G's pass applies in eval mode (its backward
recomputes the FSDP2 layers), and gives the same bits with it switched off. The
engine runs in a subprocess (tests/engine/conftest.py): torch.distributed's process group is process-global."""

from __future__ import annotations


import pytest


@pytest.fixture(scope="module")
def cases(engine_cases):
    return engine_cases["importance"]  # run in the interpreter shared with the other engine check (conftest.py)


def _name(case):
    return (f"rmpad={case['use_remove_padding']},dyn={case['use_dynamic_bsz']},mb={case['micro_bsz']},"
            f"{case['objective']},{case.get('param_dtype', 'fp32')}")


def test_engine_importance_equals_plain_transformers(cases):
    fp32 = [case for case in cases if case.get("param_dtype", "fp32") == "fp32"]
    assert len(fp32) == 4
    for case in fp32:
        assert case["scale"] > 0, _name(case)
        assert case["max_abs_err"] <= 1e-3 * case["scale"], (_name(case), case)


def test_engine_importance_leaves_params_grads_and_optimizer_state_untouched(cases):
    for case in cases:
        assert case["state_unchanged"], _name(case)


def test_engine_importance_reports_answer_and_reasoning_masks(cases):
    for case in cases:
        # 6 responses: 5 with a locatable answer; one of them has no reasoning tokens before it
        assert case["answers_found"] == 5 and case["nonzero_rows"] == 4 and case["reasoning_tokens"] > 0, case


def test_fused_log_prob_pass_is_bit_identical_to_verls_and_to_the_separate_importance_pass(cases):
    assert {case.get("param_dtype", "fp32") for case in cases} == {"fp32", "bf16"}
    for case in cases:
        assert case["fused_log_prob_identical"] and case["fused_entropy_identical"], (_name(case), case)
        assert case["fused_importance_identical"], (_name(case), case)
        if case.get("param_dtype") == "bf16":
            assert case["log_prob_dtype"] == "torch.bfloat16", case  # the pass really ran in bf16


def test_autocast_dtype_from_the_public_config_equals_the_engines_own(cases):
    assert {case["verl_autocast_dtype"] for case in cases} == {"torch.float32", "torch.bfloat16"}
    for case in cases:
        assert case["autocast_dtype"] == case["verl_autocast_dtype"], (_name(case), case)


def test_zero_noise_gives_exactly_zero_objective_and_gradient(cases):
    checked = [case for case in cases if "zero_noise_max_importance" in case]
    assert {case.get("param_dtype", "fp32") for case in checked} == {"fp32", "bf16"}
    for case in checked:
        assert case["zero_noise_max_importance"] == 0.0, (_name(case), case)


def test_gradient_checkpointing_is_on_and_changes_no_bit(cases):
    """verl's ``enable_gradient_checkpointing=true`` (its default, kept by these workers): OAR-G's pass recomputes
    the decoder layers in its backward, sharded FSDP2 layers included, and the importance is bit-identical to the
    pass with checkpointing off, in fp32 and bf16, packed and padded; the other tests above ran checkpointed."""
    for case in cases:
        assert case["gradient_checkpointing"] and case["checkpointed_importance_identical"], (_name(case), case)
