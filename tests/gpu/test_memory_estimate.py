"""GPU only: the start-up memory estimate (``core.memory_estimate``) against ``torch.cuda.max_memory_allocated`` of
the real passes, on a small random Qwen2 in bf16, with plain transformers and ``verl_oar.core`` (no verl).

    python -m pytest tests/gpu/test_memory_estimate.py -q -rs      # the test; skips cleanly without CUDA
    python tests/gpu/test_memory_estimate.py [OUT.json]             # the same cases, one JSON report, no pytest

``benchmarks/gpu_acceptance.py`` calls :func:`run_cases` (after :func:`configure` for its CPU smoke run at tiny sizes,
where the peak is the live tensor bytes of ``benchmarks/oar_g_checkpointing.LiveBytes`` and the band is not judged).

About a minute on one GPU. Each case measures the peak above what was allocated before it (model weights,
inputs) and compares it with the estimate of the same pass:

* ``kv_logits``: the KV cache and logits a call returns (exact);
* ``oar_g_<objective>``: OAR-G as ``engines/fsdp/gradient.py`` runs it (``core.hf.OutcomeHead`` +
  ``core.gradient.gradient_importance_in_forward``, the parameters requiring grad as the actor's), not fused,
  unmasked SDPA (it keeps what flash-attention keeps: the estimate's ``flash_attention_2``);
* ``oar_p_<mode>``: ``core.perturbation.score_samples`` over ``core.hf.HFRowsModel`` (SDPA with padding
  masks: the estimate's ``sdpa``), chunk K=16, exact, hierarchical;
* ``acpo_blocks``: ``engines.fsdp.modal.top1_log_probs`` on CUDA (``DEFAULT_BLOCK_BYTES`` blocks).

What this adds to the CPU test (tests/unit/test_memory_estimate_on_cpu.py): CUDA's kernels (SDPA's flash and
memory-efficient kernels and their saved tensors, cuBLAS workspaces) and the caching allocator's rounding.
The accepted band, ``BAND``, is a first guess; tighten it once a run has reported its ratios. verl's own
old-log-prob pass (flash-attention cross-entropy, compiled entropy, FSDP's gathers) needs verl on a GPU: not here.
"""

from __future__ import annotations

import json
import os
import sys

import torch

try:
    import pytest
except ImportError:  # run as a script on a machine without pytest
    pytest = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # run as a script, or by pytest on a machine where verl_oar is not installed
    sys.path.insert(0, ROOT)

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=4096)
"""~0.3B parameters: every term of the estimate in the hundreds of MiB at these lengths"""
VOCAB = SHAPE["vocab_size"]
PROMPT, RESPONSE, EXACT_RESPONSE, ROWS = 256, 1792, 384, 4
"""OAR-G: ROWS sequences of PROMPT + RESPONSE tokens; OAR-P: a micro-batch of as many, exact mode shorter"""
BAND = (0.8, 1.35)
"""estimate / measured accepted; the estimate is meant to err high (module docstring)"""
DEVICE = "cuda"
KV_LENGTH, ACPO_ROWS = 1000, 8192


def configure(device: str = "cuda", tiny: bool = False) -> None:
    """Where the cases run and at which sizes: the defaults above, or (``tiny``) a 2-layer model and short rows
    (the CPU smoke run of ``benchmarks/gpu_acceptance.py --tiny``)."""
    global DEVICE, SHAPE, VOCAB, PROMPT, RESPONSE, EXACT_RESPONSE, ROWS, KV_LENGTH, ACPO_ROWS
    DEVICE = device
    if tiny:
        SHAPE = dict(SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
        VOCAB, PROMPT, RESPONSE, EXACT_RESPONSE, ROWS, KV_LENGTH, ACPO_ROWS = 512, 16, 64, 32, 2, 40, 256


def _model(attention: str = "sdpa"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE)
    config._attn_implementation = attention
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()  # parameters require grad, as verl's actor's
    return model, config


def _peak(fn) -> int:
    """Peak bytes allocated by ``fn`` above what was allocated before it (CPU: live tensor bytes it created)."""
    if DEVICE != "cuda":
        from benchmarks.oar_g_checkpointing import LiveBytes

        with LiveBytes() as live:
            result = fn()
        del result
        return live.peak
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak


def case_kv_logits() -> dict:
    from verl_oar.core.memory_estimate import ModelShape

    model, config = _model()
    rows, length, keep = 4, KV_LENGTH, 8
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, VOCAB, (rows, length), device=DEVICE), use_cache=True,
                    logits_to_keep=keep)
    shape = ModelShape.from_hf_config(config)
    layers = out.past_key_values.layers
    cache = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    logits = out.logits.numel() * out.logits.element_size()
    estimated = rows * length * shape.kv_cache_per_token(2) + rows * keep * shape.vocab * 2
    return {"measured": cache + logits, "estimated": estimated, "exact": True}


def case_oar_g(objective: str, checkpointing: bool = False) -> dict:
    from verl_oar.core.gradient import GradientConfig, gradient_importance_in_forward
    from verl_oar.core.hf import OutcomeHead
    from verl_oar.core.memory_estimate import EstimatorSettings, ModelShape, RunShape, estimate

    model, config = _model()
    if checkpointing:  # what verl does for actor_rollout_ref.model.enable_gradient_checkpointing=true
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows, prompt, response, answer = ROWS, PROMPT, RESPONSE, 8
    length = prompt + response
    run = RunShape(rows * length, prompt, response, dtype_bytes=2, answer_tokens=answer, fsdp=False,
                   attention="flash_attention_2")
    est = estimate(ModelShape.from_hf_config(config), run,
                   EstimatorSettings("oar_g", objective=objective, fuse_log_prob=False,
                                     gradient_checkpointing=checkpointing))
    ids = torch.randint(1, VOCAB, (rows, length), device=DEVICE)
    reasoning = torch.zeros(rows, length, dtype=torch.bool, device=DEVICE)
    reasoning[:, prompt : length - answer - 2] = True
    predict = torch.zeros_like(reasoning)
    predict[:, length - answer - 1 : length - 1] = True
    segment = torch.arange(rows, device=DEVICE).unsqueeze(1).expand(rows, length).contiguous()
    head = OutcomeHead(model, predict, 1.0, torch.autocast(DEVICE, dtype=torch.bfloat16))

    def run_pass():
        return gradient_importance_in_forward(
            lambda transform: head.run({"input_ids": ids}, transform, full_logits=False)[1], reasoning, predict,
            torch.roll(ids, -1, 1), segment, rows, GradientConfig(objective=objective),
            generator=torch.Generator(device=DEVICE).manual_seed(0))

    run_pass()  # warm-up: cuBLAS / kernel workspaces are not the pass's
    return {"measured": _peak(run_pass), "estimated": est.pass_bytes,
            "terms": {t.name: t.bytes for t in est.pass_terms}}


def case_oar_p(mode: str) -> dict:
    from verl_oar.core.hf import HFRowsModel
    from verl_oar.core.memory_estimate import MARKER_TOKENS, EstimatorSettings, ModelShape, RunShape, estimate
    from verl_oar.core.perturbation import PerturbationConfig, Sample, score_samples

    model, config = _model()
    prompt, response, answer = PROMPT, EXACT_RESPONSE if mode == "exact" else RESPONSE, 8
    length = prompt + response
    run = RunShape(ROWS * length, prompt, response, dtype_bytes=2, answer_tokens=answer, fsdp=False, attention="sdpa")
    settings = EstimatorSettings("oar_p", perturb_mode=mode, perturb_budget=16)
    est = estimate(ModelShape.from_hf_config(config), run, settings)
    reasoning_len = response - answer - MARKER_TOKENS
    g = torch.Generator().manual_seed(1)
    samples, reasoning = [], []
    for _ in range(run.samples):
        ids = torch.randint(1, VOCAB, (length,), generator=g).to(DEVICE)
        predict = torch.zeros(length, dtype=torch.bool, device=DEVICE)
        first = prompt + reasoning_len + MARKER_TOKENS - 1
        predict[first : first + answer] = True
        mask = torch.zeros(length, dtype=torch.bool, device=DEVICE)
        mask[prompt : prompt + reasoning_len] = True
        samples.append(Sample(ids, torch.arange(length, device=DEVICE), torch.full((length,), -1, device=DEVICE),
                              predict, 1.0, prompt_len=prompt))
        reasoning.append(mask)
    rows_model = HFRowsModel(model, pad_id=0)

    def run_pass():
        with torch.no_grad():
            return score_samples(rows_model, samples, reasoning, 0, PerturbationConfig(mode=mode, budget=16),
                                 run.tokens)

    run_pass()
    return {"measured": _peak(run_pass), "estimated": est.pass_bytes,
            "terms": {t.name: t.bytes for t in est.pass_terms}}


def case_acpo_blocks() -> dict:
    from verl_oar.core.memory_estimate import EstimatorSettings, ModelShape, RunShape, estimate
    from verl_oar.engines.fsdp.modal import BLOCK_BYTES, DEFAULT_BLOCK_BYTES, top1_log_probs

    logits = torch.randn(ACPO_ROWS, VOCAB, device=DEVICE, dtype=torch.bfloat16)
    block = BLOCK_BYTES.get(logits.device.type, DEFAULT_BLOCK_BYTES)
    model = ModelShape(1024, 8, 16, 4, 64, 2816, VOCAB, False)
    est = estimate(model, RunShape(ACPO_ROWS, 0, ACPO_ROWS, dtype_bytes=2, fsdp=False),
                   EstimatorSettings("acpo", acpo_block_bytes=block))
    top1_log_probs(logits, 1.0)
    out_bytes = ACPO_ROWS * 4
    return {"measured": _peak(lambda: top1_log_probs(logits, 1.0)) - out_bytes, "estimated": est.extra_bytes,
            "block_bytes": block}


CASES = {
    "kv_logits": case_kv_logits,
    "oar_g_noisy_kl": lambda: case_oar_g("noisy_kl"),
    "oar_g_loglik": lambda: case_oar_g("loglik"),
    "oar_g_noisy_kl_checkpointed": lambda: case_oar_g("noisy_kl", checkpointing=True),
    "oar_p_chunk": lambda: case_oar_p("chunk"),
    "oar_p_exact": lambda: case_oar_p("exact"),
    "oar_p_hierarchical": lambda: case_oar_p("hierarchical"),
    "acpo_blocks": case_acpo_blocks,
}


def _verdict(result: dict) -> dict:
    result["ratio"] = round(result["estimated"] / max(result["measured"], 1), 3)
    if result.get("exact"):
        result["ok"] = result["estimated"] == result["measured"]
    else:
        result["ok"] = BAND[0] <= result["ratio"] <= BAND[1]
    return result


if pytest is not None:
    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

    @pytest.mark.parametrize("name", list(CASES))
    def test_estimate_against_the_measured_peak(name):
        result = _verdict(CASES[name]())
        print(name, json.dumps(result))
        assert result["ok"], f"{name}: {json.dumps(result)}"


def run_cases(names=None) -> dict:
    """Every case (or ``names``), each judged by :func:`_verdict` or holding its error: the JSON report."""
    import transformers

    cuda = DEVICE == "cuda"
    report = {"device": torch.cuda.get_device_name() if cuda else DEVICE, "torch": torch.__version__,
              "transformers": transformers.__version__, "band": BAND, "cases": {}}
    for name in names or CASES:
        try:
            report["cases"][name] = _verdict(CASES[name]())
        except Exception as err:  # report every case, then fail
            report["cases"][name] = {"error": repr(err), "ok": False}
        print(name, json.dumps(report["cases"][name]), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    return report


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("test_memory_estimate: no CUDA device", file=sys.stderr)
        return 2
    report = run_cases()
    text = json.dumps(report, indent=1)
    if len(argv) > 1:
        with open(argv[1], "w") as f:
            f.write(text)
    print(text)
    return 0 if all(c["ok"] for c in report["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
