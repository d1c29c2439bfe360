"""The start-up memory estimate (``core.memory_estimate``) against what a real transformers Qwen2 allocates, the
worker's decision on given numbers, and the driver's log block (``integration.memory_check``).

Exact checks: the parameter count, the KV cache and logits a Qwen2 returns, the bytes autograd keeps for OAR-G's
backward (fp32 and bf16), and with gradient checkpointing the per-layer slope of OAR-G's peak (each layer's input).
Whole passes: OAR-G (``core.hf.OutcomeHead`` + ``core.gradient``, with and without checkpointing), OAR-P
(``core.perturbation`` over ``core.hf.HFRowsModel``) and ACPO's top-1 blocks (``engines.fsdp.modal``) are
run under a ``TorchDispatchMode`` that tracks every storage an op creates while any tensor on it lives (the CPU has
no ``max_memory_allocated``): their peak above the model's weights is compared with the estimate. What only a GPU
can check (CUDA kernels' workspaces, the caching allocator, flash-attention) is tests/gpu/test_memory_estimate.py.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
from _benchmarks import load_benchmark
from _verl_config import compose_ppo_config, compose_recipe

from verl_oar.core.memory_estimate import (
    MARKER_TOKENS,
    RESERVE_BYTES,
    EstimatorSettings,
    ModelShape,
    RunShape,
    decide_fit,
    estimate,
    oar_p_cost_passes,
    training_state_bytes,
)

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
QWEN_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
"""Qwen2.5-Math-1.5B / -7B config.json (architecture only; -7B-Instruct, OPPO's teacher, has the 7B's)"""


LiveBytes = load_benchmark("oar_g_checkpointing").LiveBytes
"""the ``TorchDispatchMode`` that benchmarks/oar_g_checkpointing.py measures with (and tests/gpu on the CPU): the peak
bytes of the storages torch ops create inside it, each counted while any tensor on it lives"""


def _qwen2(dtype=torch.float32, attention="sdpa", **shape):
    """A random Qwen2 in eval mode (verl's importance passes run in eval mode); parameters require grad, as the
    actor's do in verl."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    defaults = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False, max_position_embeddings=512)
    config = Qwen2Config(**{**defaults, **shape})
    config._attn_implementation = attention
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(dtype).eval(), config


def _bytes(dtype) -> int:
    return torch.finfo(dtype).bits // 8


# --- the formulas against the tensors a real Qwen2 allocates -------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_is_the_models(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    model, config = _qwen2(tie_word_embeddings=tied, head_dim=24)
    assert ModelShape.from_hf_config(config).parameters() == sum(p.numel() for p in model.parameters())
    llama = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tied)  # no q/k/v biases
    assert ModelShape.from_hf_config(llama).parameters() == sum(p.numel() for p in LlamaForCausalLM(llama).parameters())


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_and_logits_bytes_are_what_the_model_returns(dtype):
    model, config = _qwen2(dtype, head_dim=24)
    shape, b = ModelShape.from_hf_config(config), _bytes(dtype)
    rows, length, keep = 3, 37, 5
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 128, (rows, length)), use_cache=True, logits_to_keep=keep)
    layers = out.past_key_values.layers
    cache = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    assert cache == rows * length * shape.kv_cache_per_token(b)
    assert out.logits.numel() * out.logits.element_size() == rows * keep * shape.vocab * b


def _saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for a backward to the input embeddings (each storage once; parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs_embeds=embeds, use_cache=False, logits_to_keep=1)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_per_token_and_layer_are_what_autograd_keeps(dtype):
    """Per token per layer: the difference between 2 and 1 layers and between 96 and 64 tokens, so that what is
    outside the layers (embeddings, final norm, rotary tables) drops out; head_dim 24 keeps q apart from h."""
    saved = {}
    for layers in (1, 2):
        model, config = _qwen2(dtype, num_hidden_layers=layers, head_dim=24)
        for tokens in (64, 96):
            saved[layers, tokens] = _saved_bytes(model, torch.randint(0, 128, (1, tokens)))
    per_token_layer = ((saved[2, 96] - saved[1, 96]) - (saved[2, 64] - saved[1, 64])) // 32
    assert per_token_layer == ModelShape.from_hf_config(config).saved_per_token_layer(_bytes(dtype))


def test_transformers_does_not_checkpoint_in_eval_mode():
    """verl's engines run the importance pass in eval mode, where transformers' own checkpointing does nothing (in
    training mode it would keep far less): why OAR-G's head checkpoints the layers itself (next tests)."""
    ids = torch.randint(0, 128, (1, 64))
    plain, _ = _qwen2()
    checkpointed, _ = _qwen2()
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert _saved_bytes(checkpointed, ids) == _saved_bytes(plain, ids)
    assert _saved_bytes(checkpointed.train(), ids) < _saved_bytes(plain, ids) / 4


# --- whole passes, measured ---------------------------------------------------------------------------------------


def _oar_g_measured(dtype, objective: str = "noisy_kl", checkpointing: bool = False, rows: int = 2, length: int = 96,
                    layers: int = 2, answer: int = 4, vocab: int = 256) -> tuple[int, torch.Tensor, object, RunShape]:
    """Peak bytes of the importance pass as engines/fsdp/gradient.py runs it (not fused: ``core.hf.OutcomeHead`` +
    ``core.gradient``) on plain transformers, its importance, the model's config and the run's shape."""
    from verl_oar.core.gradient import GradientConfig, gradient_importance_in_forward
    from verl_oar.core.hf import OutcomeHead

    model, config = _qwen2(dtype, intermediate_size=256, vocab_size=vocab, num_hidden_layers=layers)
    if checkpointing:  # what verl does for actor_rollout_ref.model.enable_gradient_checkpointing=true
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    run = RunShape(rows * length, 16, length - 16, dtype_bytes=_bytes(dtype), answer_tokens=answer, fsdp=False)
    ids = torch.randint(1, vocab, (rows, length), generator=torch.Generator().manual_seed(length))
    reasoning = torch.zeros(rows, length, dtype=torch.bool)
    reasoning[:, 16 : length - answer - 2] = True
    predict = torch.zeros_like(reasoning)
    predict[:, length - answer - 1 : length - 1] = True
    segment = torch.arange(rows).unsqueeze(1).expand(rows, length).contiguous()
    head = OutcomeHead(model, predict, 1.0, nullcontext())
    with LiveBytes() as tracked:
        importance = gradient_importance_in_forward(
            lambda transform: head.run({"input_ids": ids}, transform, full_logits=False)[1], reasoning, predict,
            torch.roll(ids, -1, 1), segment, rows, GradientConfig(objective=objective),
            generator=torch.Generator().manual_seed(0))
    return tracked.peak, importance, config, run


@pytest.mark.parametrize("vocab", [256, 151936], ids=["small-vocab", "qwen-vocab"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("objective", ["noisy_kl", "loglik"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_oar_g_pass_peak(dtype, objective, checkpointing, vocab):
    """The importance pass as engines/fsdp/gradient.py runs it (not fused), with plain transformers, with and
    without verl's gradient checkpointing: the estimate is at most 15% above the measured peak and never below it.
    Qwen's vocabulary makes the outcome logits' math the largest part (``OUTCOME_BYTES``, one constant for fp32 and
    bf16 models: up to 20% above there)."""
    measured, _, config, run = _oar_g_measured(dtype, objective, checkpointing, vocab=vocab)
    settings = EstimatorSettings("oar_g", objective=objective, fuse_log_prob=False,
                                 gradient_checkpointing=checkpointing)
    predicted = estimate(ModelShape.from_hf_config(config), run, settings).pass_bytes
    assert measured <= predicted <= (1.15 if vocab == 256 else 1.2) * measured, (predicted, measured)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_checkpointing_keeps_each_layers_input_only(dtype):
    """With ``enable_gradient_checkpointing`` (verl's default) OAR-G's pass keeps, per token and layer, the layer's
    input (h b bytes) instead of its activations: the measured peak's slope in layers x tokens is exactly h b, as
    the estimate's, where the plain pass's is the activations' (``saved_per_token_layer``, 14x more here)."""
    peaks = {(c, layers, length): _oar_g_measured(dtype, checkpointing=c, layers=layers, length=length)[0]
             for c in (False, True) for layers in (2, 4) for length in (64, 128)}

    def slope(c: bool) -> float:  # bytes per token per layer: 2 rows x 64 more tokens, 2 more layers
        return ((peaks[c, 4, 128] - peaks[c, 2, 128]) - (peaks[c, 4, 64] - peaks[c, 2, 64])) / (2 * 64 * 2)

    _, _, config, _ = _oar_g_measured(dtype, layers=2, length=64)
    shape, b = ModelShape.from_hf_config(config), _bytes(dtype)
    assert slope(True) == shape.hidden * b
    assert slope(False) >= 0.9 * shape.saved_per_token_layer(b) > 10 * shape.hidden * b
    for length in (64, 128):
        assert peaks[True, 4, length] < 0.5 * peaks[False, 4, length], peaks
    run = RunShape(2 * 128, 16, 112, dtype_bytes=b, answer_tokens=4, fsdp=False)  # the estimate's slope in layers
    checkpointed = EstimatorSettings("oar_g", fuse_log_prob=False, gradient_checkpointing=True)
    est = {n: estimate(replace(shape, layers=n), run, checkpointed).pass_bytes for n in (2, 4)}
    assert (est[4] - est[2]) / (2 * 2 * 128) == shape.hidden * b


def test_gradient_checkpointing_estimate_at_the_recipes_budgets():
    """Qwen2.5-Math 1.5B / 7B, bf16, 16k-token log-prob micro-batches: checkpointing takes OAR-G's pass (noisy KL)
    from tens of GiB to a few, below verl's own old-log-prob pass (its (T, V) logits): nothing extra."""
    gib = 1 << 30
    for shape, plain_above, checkpointed_below in ((QWEN_1_5B, 40, 5), (QWEN_7B, 90, 12)):
        model = ModelShape.from_hf_config(_config(shape))
        run = RunShape(16384, 1024, 3072)
        plain = estimate(model, run, EstimatorSettings("oar_g"))
        kept = estimate(model, run, EstimatorSettings("oar_g", gradient_checkpointing=True))
        assert plain.pass_bytes > plain_above * gib > checkpointed_below * gib > kept.pass_bytes, (plain, kept)
        assert kept.extra_bytes == 0 < plain.extra_bytes
        assert "with gradient checkpointing" in kept.notes[0] and "without gradient checkpointing" in plain.notes[0]


def _oar_p_measured(dtype, mode: str, response: int, samples: int = 3, answer: int = 4, budget: int = 16):
    """Peak bytes of ``core.perturbation.score_samples`` on full-length samples laid out as the estimate
    assumes, the estimate, the tokens fed per sample and the estimate's count of them."""
    from verl_oar.core.hf import HFRowsModel
    from verl_oar.core.perturbation import PerturbationConfig, Sample, score_samples

    model, config = _qwen2(dtype, intermediate_size=256, vocab_size=128)
    prompt, length = 16, 16 + response
    run = RunShape(samples * length, prompt, response, dtype_bytes=_bytes(dtype), answer_tokens=answer, fsdp=False,
                   attention="sdpa")
    settings = EstimatorSettings("oar_p", perturb_mode=mode, perturb_budget=budget)
    reasoning_len = response - answer - MARKER_TOKENS
    batch, reasoning = [], []
    g = torch.Generator().manual_seed(1)
    for _ in range(run.samples):
        ids = torch.randint(1, 128, (length,), generator=g)
        predict = torch.zeros(length, dtype=torch.bool)
        predict[prompt + reasoning_len + MARKER_TOKENS - 1 : prompt + reasoning_len + MARKER_TOKENS - 1 + answer] = True
        mask = torch.zeros(length, dtype=torch.bool)
        mask[prompt : prompt + reasoning_len] = True
        batch.append(Sample(ids, torch.arange(length), torch.full((length,), -1), predict, 1.0, prompt_len=prompt))
        reasoning.append(mask)
    with torch.no_grad(), LiveBytes() as tracked:
        _, _, cost = score_samples(HFRowsModel(model, pad_id=0), batch, reasoning, 0,
                                   PerturbationConfig(mode=mode, budget=budget), run.tokens)
    predicted = estimate(ModelShape.from_hf_config(config), run, settings)
    return tracked.peak, predicted.pass_bytes, cost.tokens / run.samples / length, oar_p_cost_passes(run, settings)


@pytest.mark.parametrize("mode, response", [("chunk", 96), ("exact", 40), ("hierarchical", 96)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_oar_p_pass_peak_and_tokens(dtype, mode, response):
    """Within 10% of the measured peak (the caches, a call's forward transient, SDPA's mask and repeated KV heads),
    and exactly the tokens the planner feeds (``chunk`` / ``exact``; ``hierarchical`` refines data-dependent chunks,
    the estimate assumes evenly spread ones)."""
    measured, predicted, fed, counted = _oar_p_measured(dtype, mode, response, budget=4)
    assert measured <= predicted <= 1.25 * measured, (predicted, measured)   # never under: GPUs are sized by it
    if mode != "hierarchical":
        assert counted == pytest.approx(fed, rel=1e-9)
    else:
        assert counted == pytest.approx(fed, rel=0.25)


def test_oar_p_cost_matches_the_batching_benchmarks_count_and_the_closed_form():
    """benchmarks/results_oar_p_batching_cpu.json counted 38,375 tokens per 4,096-token sample (chunk K=16, a
    64-token prompt shared by 2 samples, an 8-token answer); the estimate counts each sample's prompt (+32)."""
    run = RunShape(4096, 64, 4032, answer_tokens=8)
    assert oar_p_cost_passes(run, EstimatorSettings("oar_p")) * 4096 == pytest.approx(38375 + 32, rel=2e-3)
    recipe = RunShape(16384, 1024, 3072)
    reasoning = 3072 - recipe.answer_tokens - MARKER_TOKENS
    closed = 1 + reasoning * 17 / 2 / 4096  # prompt + clean + copies ~ R (K + 1) / 2
    assert oar_p_cost_passes(recipe, EstimatorSettings("oar_p")) == pytest.approx(closed, rel=0.02)


@pytest.mark.parametrize("per_row", [False, True], ids=["one-temperature", "per-row-temperatures"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_acpo_holds_one_block_and_the_estimate_is_what_top1_log_probs_holds(dtype, per_row):
    """``engines.fsdp.modal.top1_log_probs`` on CPU blocks (float32 and bfloat16 logits): beyond its (N,) result (and,
    with one temperature per row, their (N,) reciprocals) it holds one float32 block and one (rows,) row statistic,
    never a second block; the estimate is that, exactly with per-row temperatures (verl's packed pass)."""
    from verl_oar.engines.fsdp.modal import BLOCK_BYTES, top1_log_probs

    n, vocab = 3000, 1000
    rows = BLOCK_BYTES["cpu"] // (4 * vocab)
    block = rows * vocab * 4
    logits = torch.randn(n, vocab).to(dtype)
    temperature = torch.rand(n) + 0.5 if per_row else 0.7
    with LiveBytes() as tracked:
        out = top1_log_probs(logits, temperature)
    results = out.numel() * out.element_size() * (2 if per_row else 1)  # the result, the reciprocal temperatures
    assert tracked.peak - results <= block + 4 * rows + 4, (tracked.peak - results, block)  # + a 0-dim temperature
    model = ModelShape(64, 2, 4, 2, 16, 128, vocab, True)
    est = estimate(model, RunShape(n, 0, n, dtype_bytes=_bytes(dtype), fsdp=False),
                   EstimatorSettings("acpo", acpo_block_bytes=BLOCK_BYTES["cpu"]))
    assert tracked.peak <= est.extra_bytes <= tracked.peak + (0 if per_row else 4 * n), (est.extra_bytes, tracked.peak)


# --- the decision, on given numbers ------------------------------------------------------------------------------


def _plan(estimator: str = "oar_g", tokens: int = 16384, dynamic: bool = True, prompt: int = 1024,
          response: int = 3072, **settings) -> dict:
    """What ``memory_check.run_plan`` makes of a recipe-like config (1 node x 8 GPUs, bf16)."""
    from dataclasses import asdict

    return {"settings": asdict(EstimatorSettings(estimator, **settings)),
            "run": asdict(RunShape(tokens, prompt, response)), "dtype": "bf16",
            "budget_knob": "actor_rollout_ref.rollout." + ("log_prob_max_token_len_per_gpu" if dynamic
                                                           else "log_prob_micro_batch_size_per_gpu"),
            "budget_value": tokens if dynamic else tokens // (prompt + response),
            "teacher_path": None, "teacher_knob": None,
            "strategy": "fsdp2", "importance_role": "actor", "data_parallel": 8, "param_offload": False,
            "optimizer_offload": False, "free_cache_engine": True, "gpu_memory_utilization": 0.6,
            "model_path": "Qwen/Qwen2.5-Math-1.5B", "trust_remote_code": False}


def test_decide_fit_refuses_only_when_the_estimators_pass_does_not_fit():
    model = ModelShape.from_hf_config(_config(QWEN_1_5B))
    run = RunShape(16384, 1024, 3072)
    oar_g = estimate(model, run, EstimatorSettings("oar_g"))
    oar_p = estimate(model, run, EstimatorSettings("oar_p"))
    gib = 1 << 30
    roomy = decide_fit(oar_g, total=141 * gib, resident=3 * gib)
    assert not roomy.refuse and roomy.verl_fits
    assert roomy.usable == 141 * gib - 3 * gib - max(RESERVE_BYTES, int(0.05 * 141 * gib))
    tight = decide_fit(oar_g, total=40 * gib, resident=3 * gib)
    assert tight.refuse and oar_g.pass_bytes > tight.usable >= oar_g.verl_bytes
    # verl's own pass too large, OAR-P's smaller: not OAR-P's to refuse
    small = decide_fit(oar_p, total=int(oar_p.verl_bytes * 0.9), resident=0)
    assert not small.refuse and not small.verl_fits
    # a rollout engine that keeps its share through training (free_cache_engine=false) counts
    assert decide_fit(oar_g, 80 * gib, 3 * gib, rollout_held=int(0.6 * 80 * gib)).refuse
    assert not decide_fit(oar_g, 80 * gib, 3 * gib).refuse


def _config(shape: dict):
    from transformers import Qwen2Config

    return Qwen2Config(**shape, max_position_embeddings=4096)


def _fits_with(plan: dict, model: ModelShape, usable: int, **changes) -> bool:
    settings = EstimatorSettings(**{**plan["settings"], **changes.pop("settings", {})})
    run = replace(RunShape(**plan["run"]), **changes)
    return estimate(model, run, settings).pass_bytes <= usable


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_refusal_names_the_knob_and_a_value_that_fits(dynamic):
    from verl_oar.core.memory_estimate import FitDecision
    from verl_oar.integration.memory_check import fit_report

    model = ModelShape.from_hf_config(_config(QWEN_1_5B))
    plan = _plan("oar_g", dynamic=dynamic)
    est = estimate(model, RunShape(**plan["run"]), EstimatorSettings(**plan["settings"]))
    gib = 1 << 30
    decision = decide_fit(est, total=40 * gib, resident=2 * gib)
    assert decision.refuse
    report = fit_report(plan, model, decision, est, 40 * gib, 2 * gib, 0)
    assert "oar_g cannot fit this GPU" in report and "enable_gradient_checkpointing=true" in report
    key = plan["budget_knob"] + "="
    value = int(report.split(key)[1].split()[0])
    tokens = value if dynamic else value * 4096
    assert value < plan["budget_value"] and _fits_with(plan, model, decision.usable, micro_batch_tokens=tokens)
    assert "algorithm.adv_estimator=oar_p" in report
    fits = FitDecision(usable=100 * gib, pass_bytes=est.pass_bytes, verl_bytes=est.verl_bytes, reserve=RESERVE_BYTES)
    assert "memory check: oar_g fits" in fit_report(plan, model, fits, est, 141 * gib, 2 * gib, 0)


def test_oar_p_refusal_names_perturb_max_tokens_the_mode_and_gather_params():
    from verl_oar.integration.memory_check import knobs

    model = ModelShape.from_hf_config(_config(QWEN_7B))
    short = dict(tokens=4096, prompt=256, response=768)  # exact mode's thousands of copies, fewer
    plan = _plan("oar_p", perturb_mode="exact", gather_params=True, **short)
    est = estimate(model, RunShape(**plan["run"]), EstimatorSettings(**plan["settings"]))
    usable = est.pass_bytes - model.parameters() * 2 // 2  # half the whole-model copy too little
    assert any(f.startswith("algorithm.oar.gather_params=false") for f in knobs(plan, model, usable))
    run = RunShape(**plan["run"])
    exact = estimate(model, run, EstimatorSettings("oar_p", perturb_mode="exact")).pass_bytes
    chunk = estimate(model, run, EstimatorSettings("oar_p", perturb_mode="chunk")).pass_bytes
    tight = (exact + chunk) // 2
    fixes = knobs(_plan("oar_p", perturb_mode="exact", **short), model, tight)
    assert any(f.startswith("algorithm.oar.perturb_mode=chunk") for f in fixes)
    value = int(next(f for f in fixes if f.startswith("algorithm.oar.perturb_max_tokens=")).split("=")[1].split()[0])
    assert _fits_with(_plan("oar_p", perturb_mode="exact", **short), model, tight,
                      settings={"perturb_max_tokens": value})
    assert not _fits_with(_plan("oar_p", perturb_mode="exact", **short), model, tight,
                          settings={"perturb_max_tokens": value + 256})


def test_acpo_and_teacher_refusals_name_their_settings():
    from verl_oar.integration.memory_check import knobs

    model = ModelShape.from_hf_config(_config(QWEN_1_5B))
    acpo = _plan("acpo")
    est = estimate(model, RunShape(**acpo["run"]), EstimatorSettings("acpo"))
    assert any("acpo.surrogate=sampled" in f for f in knobs(acpo, model, est.verl_bytes))
    teacher = ModelShape.from_hf_config(_config(QWEN_7B))
    oppo = {**_plan("oppo", rescore_copies=2, teacher_micro_batch_tokens=32768),
            "teacher_path": "Qwen/Qwen2.5-Math-7B-Instruct",
            "teacher_knob": "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"}
    est = estimate(model, RunShape(**oppo["run"]), EstimatorSettings(**{**oppo["settings"], "teacher": teacher}))
    fixes = knobs(oppo, model, int(est.pass_bytes * 0.7), teacher)
    assert any(f.startswith("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu") for f in fixes)
    assert "+algorithm.oppo.oracle=self (no teacher)" in fixes


def test_training_state_is_the_sharded_fp32_parameters_and_adam():
    model = ModelShape.from_hf_config(_config(QWEN_7B))
    params, adam = training_state_bytes(model, 8)
    assert params == -(-model.parameters() // 8) * 4 and adam == 2 * params


@pytest.mark.parametrize("recipe", [f"qwen2_5_math_{size}_{method}" for size in ("1_5b", "7b")
                                    for method in ("oar_g", "oar_p", "acpo", "cscr", "oppo", "codapo")]
                         + ["qwen2_5_math_1_5b_oppo_teacher"])
def test_every_fsdp2_recipe_fits_its_80_gb_gpus(recipe):
    """The recipes are written for 8 x 80 GB (recipes/config/base_*_fsdp2.yaml): by the estimate, with the
    training state (fp32 shard + Adam) and the reserve, each estimator's pass fits."""
    from verl_oar.integration.memory_check import run_plan

    plan = run_plan(compose_recipe(recipe))
    model = ModelShape.from_hf_config(_config(QWEN_1_5B if "1_5b" in recipe else QWEN_7B))
    teacher = ModelShape.from_hf_config(_config(QWEN_7B)) if plan["teacher_path"] else None
    est = estimate(model, RunShape(**plan["run"]), EstimatorSettings(**{**plan["settings"], "teacher": teacher}))
    params, adam = training_state_bytes(model, plan["data_parallel"])
    decision = decide_fit(est, total=80 * 10**9, resident=params + adam)
    assert not decision.refuse and decision.verl_fits, (recipe, est.pass_bytes, decision.usable)


# --- the driver's block ------------------------------------------------------------------------------------------


ESTIMATOR_OVERRIDES = {
    "oar_g": [], "oar_p": ["+algorithm.oar.perturb_mode=chunk", "+algorithm.oar.perturb_budget=16"],
    "acpo": [], "cscr": [], "oppo": [], "codapo": [],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A local model directory with a Qwen2.5-Math-1.5B-shaped config.json (no weights: the driver reads only it)."""
    path = tmp_path_factory.mktemp("model")
    _config(QWEN_1_5B).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("estimator", list(ESTIMATOR_OVERRIDES))
def test_startup_block_for_every_estimator(estimator, model_dir):
    from verl_oar.integration.memory_check import startup_block

    config = compose_ppo_config([f"algorithm.adv_estimator={estimator}", "actor_rollout_ref.actor.strategy=fsdp2",
                                 f"actor_rollout_ref.model.path={model_dir}",
                                 "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
                                 "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                 *ESTIMATOR_OVERRIDES[estimator]])
    block = startup_block(config)
    assert block.startswith("[verl-oar] memory estimate per GPU") and f"estimator    {estimator}:" in block
    assert "1.54B parameters: hidden 1536, 28 layers, 12/2 heads x 128" in block
    assert "verl's old-log-prob pass" in block and "extra over verl's pass" in block
    assert "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384" in block
    if estimator == "oar_p":
        assert "perturb_mode=chunk, K=16: ~" in block and "log-prob passes of tokens per response" in block
    if estimator == "oar_g":
        assert "oar_g pass" in block and "gradient checkpointing:" in block


def test_startup_block_says_why_when_the_model_config_cannot_be_read(tmp_path, capsys):
    from verl_oar.integration.memory_check import log_startup_estimate

    missing = tmp_path / "no_model_here"
    config = compose_ppo_config(["algorithm.adv_estimator=oar_p", f"actor_rollout_ref.model.path={missing}"])
    block = log_startup_estimate(config)
    assert "estimate     unavailable: the model config at" in block and str(missing) in block
    assert "perturb_mode=" in block  # the mode is still logged
    assert block in capsys.readouterr().out


def test_a_wrong_check_action_is_refused(monkeypatch):
    from verl_oar.integration.memory_check import ACTION_ENV, check_action

    monkeypatch.setenv(ACTION_ENV, "maybe")
    with pytest.raises(ValueError, match=f"{ACTION_ENV}='maybe' is invalid: one of error, warn, off"):
        check_action()
    monkeypatch.setenv(ACTION_ENV, "warn")
    assert check_action() == "warn"


def test_the_oar_trainer_logs_the_block_at_construction(model_dir, capsys):
    """``trainer.OARTrainerSync.__init__`` (what ``main_ppo`` builds for a token estimator) prints the block."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose_ppo_config(["algorithm.adv_estimator=oar_g", "actor_rollout_ref.actor.strategy=fsdp2",
                                 f"actor_rollout_ref.model.path={model_dir}"])
    trainer = get_trainer_cls("sync")(config=config)
    out = capsys.readouterr().out
    assert type(trainer).__name__ == "OARTrainerSync"
    assert "[verl-oar] memory estimate per GPU" in out and "oar_g pass" in out


def test_the_workers_plan_is_attached_and_the_check_needs_a_gpu(model_dir):
    """``attach_memory_check`` gives the workers (``actor_rollout_ref.oar_memory``) what the estimate needs; a worker
    without CUDA checks nothing (the comparison with the device is tests/gpu's)."""
    from types import SimpleNamespace

    from verl_oar.integration.memory_check import CONFIG_NODE, attach_memory_check, check_worker_memory

    config = compose_ppo_config(["algorithm.adv_estimator=oar_p", "actor_rollout_ref.actor.strategy=fsdp2",
                                 f"actor_rollout_ref.model.path={model_dir}", "+algorithm.oar.perturb_mode=exact"])
    attach_memory_check(config)
    plan = config.actor_rollout_ref[CONFIG_NODE]
    assert plan.settings.name == "oar_p" and plan.settings.perturb_mode == "exact" and plan.action == "error"
    # verl's defaults: no dynamic batch size, 512 + 512 tokens, a log-prob micro-batch of one sequence (unset: 1)
    assert plan.run.micro_batch_tokens == 1024 and plan.budget_knob.endswith("log_prob_micro_batch_size_per_gpu")
    assert plan.importance_role == "actor" and plan.strategy == "fsdp2"
    if not torch.cuda.is_available():
        worker = SimpleNamespace(config=config.actor_rollout_ref, role="actor_rollout", rank=0)
        assert check_worker_memory(worker) is None


def test_the_workers_verdict_on_given_numbers():
    """What ``check_worker_memory`` decides once CUDA has given it the device's total and this process's allocated
    bytes: Adam's state (allocated by the first optimizer step) and an offloaded parameter shard are added; a
    rollout engine that keeps its memory through training (``free_cache_engine=false``) is subtracted."""
    from verl_oar.integration.memory_check import worker_verdict

    model = ModelShape.from_hf_config(_config(QWEN_1_5B))
    gib = 1 << 30
    plan = _plan("oar_g")
    params, adam = training_state_bytes(model, 8)
    decision, report = worker_verdict(plan, model, None, 80 * gib, params, 8, "actor_rollout_ref")
    assert not decision.refuse and "memory check: oar_g fits" in report
    assert decision.usable == 80 * gib - params - adam - max(RESERVE_BYTES, int(0.05 * 80 * gib))
    offloaded, _ = worker_verdict({**plan, "param_offload": True, "optimizer_offload": True}, model, None, 80 * gib, 0,
                                  8, "actor_rollout_ref")
    assert offloaded.usable == decision.usable + adam
    kept = {**plan, "free_cache_engine": False, "gpu_memory_utilization": 0.6}
    refused, report = worker_verdict(kept, model, None, 80 * gib, params, 8, "actor_rollout_ref")
    assert refused.refuse and refused.usable == decision.usable - int(0.6 * 80 * gib)
    assert "rollout engine" in report and "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=" in report
    separate, _ = worker_verdict(kept, model, None, 80 * gib, params, 8, "actor")  # rollout on other GPUs
    assert not separate.refuse


@pytest.mark.parametrize("overrides, checkpointing", [
    ([], True),  # verl's default enable_gradient_checkpointing=true
    (["actor_rollout_ref.model.enable_gradient_checkpointing=false"], False),
    (["actor_rollout_ref.model.enable_activation_offload=true"], False),  # verl then switches checkpointing off
])
def test_the_plan_reads_verls_gradient_checkpointing(overrides, checkpointing):
    from _verl_config import compose_ppo_config

    from verl_oar.integration.memory_check import estimator_settings

    config = compose_ppo_config(["algorithm.adv_estimator=oar_g", *overrides])
    settings, _, _ = estimator_settings(config)
    assert settings.gradient_checkpointing is checkpointing
