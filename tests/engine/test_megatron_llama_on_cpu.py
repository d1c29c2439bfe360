"""A Llama checkpoint in a real megatron-core ``GPTModel`` on the CPU: logits equal transformers', and OAR's
importance on it equals verl's FSDP2 engine's on the same rows.

``verl_oar.cpu.megatron_llama`` maps a ``LlamaForCausalLM`` (tied embeddings, GQA, RMSNorm, SwiGLU, rotary with the
checkpoint's base) onto a local-spec ``GPTModel`` at any TP size, with verl's own config converter. A tiny random
Llama of those features (hidden 96, 6 heads in 2 query groups, 2 layers, rope theta 50000, the CPU workspace's
byte-level tokenizer: vocabulary 259, odd, so TP = 2 pads it) is scored by two gloo ranks
(``tests/engine/megatron_llama_check.py``): on verl's FSDP2 engine through the plugin's worker (parameters sharded
over both, fp32 and bf16), then on the Megatron path at TP = 1, TP = 2 and TP = 2 with sequence parallelism, fp32
and bf16, OAR-G also fused with verl's log-prob pass.
SmolLM2-135M itself (9 heads in 3 groups: TP = 1 or 3) runs the same check once in
``benchmarks/megatron_smollm2.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
LAYOUTS = ("tp1", "tp2", "tp2_sp")
PROMPTS = ["What is 3+4?", "What is 8+5?", "Tom has 9 apples and eats 2. How many are left?", "What is 2*3?"]
RESPONSES = [
    "3 plus 4: count 3, then 4 more, 5, 6, 7. So the sum is \\boxed{7}",
    "We add the units: 8+5=13, carry 1, so \\boxed{13}.",
    "He starts with 9 and eats 2, 9-2=7 left. The answer is \\boxed{7}",
    "I am not sure about this one",   # no answer: nothing to score on either engine
]

# Tolerances. Logits (fp32): the two models differ in how matmuls are split and summed (TP shards, padding of
# shorter rows, megatron's fused QKV and fc1 against transformers' separate projections), i.e. in float32 rounding:
# measured 1.4e-5 on logits up to 10.4 (1.4e-6 of the scale, ~15 float32 ulps there; SmolLM2-135M's 30 layers:
# 2.0e-6), about the same at TP = 1 and 2; bound 1e-5 of the largest logit. A wrong layout moves the logits by
# their own size (measured 13.4; asserted above 100x the bound). bf16: the parameters and every matmul output are
# rounded to 8 significant bits (relative 2^-9), and this wide-initialised model amplifies rounding: transformers'
# own bf16 model is 0.93 from its fp32 logits, megatron's bf16 0.66 (SmolLM2: 1.20 and up to 1.48). Bound: no
# further from fp32 than 2x transformers' own bf16, plus 2 bf16 ulps of the largest logit.
# Importance (fp32), as a fraction of the FSDP engine's largest score: OAR-G is the gradient of a KL between nearly
# equal distributions, OAR-P a divergence of nearly equal log-probs, so float32 rounding of the logits shows up
# magnified: measured 5.9e-6 (OAR-G) and 8.1e-7 (OAR-P chunk) here, 4.2e-5 and 5.1e-6 on SmolLM2 at TP = 3;
# bound 1e-4. bf16 importance: each engine's bf16 scores are as far from the FSDP fp32 scores as rounding makes
# them (measured: FSDP's bf16 0.086 of the scale for OAR-G and 0.018 for OAR-P chunk, megatron's 0.074-0.12 and
# 0.013-0.015); bound: no further than 2x the FSDP engine's own bf16 (a wrong token or shard moves scores by their
# own size). The fused pass: the same scores as the plain one, bit for bit (one forward); its log-probs are a
# log-softmax of the layout's logits (measured 9.5e-7 nats from one computed here, a float32 ulp at |log p| ~ 15;
# bound 1e-5) and, in fp32, at most twice the logits' bound from transformers' (|d log p| <= 2 max |d logit|).
LOGITS_REL_TOL = 1e-5
IMPORTANCE_REL_TOL = 1e-4
BF16_IMPORTANCE_FACTOR = 2.0
OWN_LOG_PROBS_TOL = 1e-5


def build_model_dir(root: Path) -> Path:
    """A random ``LlamaForCausalLM`` with SmolLM2's features, initialised wider than transformers' default (std 0.2,
    not 0.02) so that attention is sharp and a mislaid head changes the logits by their own size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_oar.cpu.workspace import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, rope_theta=50000.0, tie_word_embeddings=True, max_position_embeddings=256,
        initializer_range=0.2, rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():   # random norm gains, so that a norm mapped to the wrong module would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    path = root / "tiny_llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rows = {"prompts": [tokenizer.encode(p) for p in PROMPTS],
            "responses": [tokenizer.encode(r) + [tokenizer.eos_token_id] for r in RESPONSES]}
    (root / "rows.json").write_text(json.dumps(rows))
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _fresh_process import free_port

    out = tmp_path_factory.mktemp("megatron_llama")
    model_dir = build_model_dir(out)
    rows = str(out / "rows.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "", "VERL_PLATFORM": "cpu"}
    script, port = str(HERE / "megatron_llama_check.py"), str(free_port())
    procs = [subprocess.Popen([sys.executable, script, str(r), "2", port, str(model_dir), rows, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    logs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [log[1][-4000:] for log in logs]
    return {**{("fsdp", r): torch.load(out / f"fsdp_rank{r}.pt") for r in range(2)},
            **{("fsdp_bf16", r): torch.load(out / f"fsdp_bf16_rank{r}.pt") for r in range(2)},
            **{(dtype, layout, r): torch.load(out / f"{dtype}_{layout}_rank{r}.pt")
               for dtype in ("fp32", "bf16") for layout in LAYOUTS for r in range(2)}}


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_logits_equal_transformers_in_fp32(results, layout):
    for rank in range(2):
        got = results["fp32", layout, rank]
        assert got["logits_err"] <= LOGITS_REL_TOL * got["logits_scale"], (layout, rank, got["logits_err"])
        assert got["vocab_columns"] == (260 if layout != "tp1" else 259)   # 259 padded to split over 2 ranks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_logits_in_bf16_are_as_close_to_fp32_as_transformers_own_bf16(results, layout):
    for rank in range(2):
        got = results["bf16", layout, rank]
        ulp = 2.0 ** (int(torch.tensor(got["logits_scale"]).log2().floor()) - 7)   # bf16's spacing at the largest logit
        assert got["logits_err"] <= 2 * got["hf_bf16_err"] + 2 * ulp, (layout, rank, got)


def test_a_mislaid_qkv_or_fc1_layout_is_seen_by_the_logits_check(results):
    """The check can fail: the two easiest mistakes move the logits far past the bound."""
    for layout, names in (("tp1", {"qkv_stacked_whole"}), ("tp2", {"qkv_stacked_whole", "fc1_split_as_one_block"})):
        got = results["fp32", layout, 0]
        assert set(got["wrong_layouts"]) == names
        for name, err in got["wrong_layouts"].items():
            assert err > 100 * LOGITS_REL_TOL * got["logits_scale"], (layout, name, err)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["g", "p_chunk"])
def test_megatron_importance_equals_the_fsdp_engines_on_the_same_rows(results, layout, case):
    want = results["fsdp", 0][case]
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    assert [int(r.abs().sum() > 0) for r in want] == [1, 1, 1, 0]   # three answers located, one not
    assert _max_diff(results["fsdp", 1][case], want) == 0   # both FSDP ranks scored all the rows
    for rank in range(2):
        got = results["fp32", layout, rank][case]
        assert _max_diff(got, want) <= IMPORTANCE_REL_TOL * scale, (case, layout, rank, _max_diff(got, want), scale)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", ["g", "p_chunk"])
def test_megatron_bf16_importance_is_as_close_to_fp32_as_the_fsdp_engines_bf16(results, layout, case):
    want = results["fsdp", 0][case]
    scale = max(float(w.abs().max()) for w in want)
    fsdp_bf16 = _max_diff(results["fsdp_bf16", 0][case], want)
    assert 0 < fsdp_bf16 < 0.5 * scale   # bf16 moved the FSDP scores, by rounding, not by their own size
    for rank in range(2):
        got = results["bf16", layout, rank][case]
        assert [int(r.abs().sum() > 0) for r in got] == [1, 1, 1, 0]
        assert _max_diff(got, want) <= BF16_IMPORTANCE_FACTOR * fsdp_bf16, (case, layout, rank, fsdp_bf16)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_fused_pass_scores_as_the_plain_one_and_returns_verls_log_probs(results, dtype, layout):
    for rank in range(2):
        got = results[dtype, layout, rank]
        assert _max_diff(got["g_fused"], got["g"]) == 0, (dtype, layout, rank)
        assert _max_diff(got["g_fused_log_probs"], got["own_log_probs"]) <= OWN_LOG_PROBS_TOL, (dtype, layout, rank)
        if dtype == "fp32":
            bound = 2 * LOGITS_REL_TOL * got["logits_scale"]
            assert _max_diff(got["g_fused_log_probs"], got["hf_log_probs"]) <= bound, (layout, rank)
