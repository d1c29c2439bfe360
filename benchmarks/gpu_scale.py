"""OAR importance at the recipes' real shapes on one GPU: time and peak memory against verl's log-prob pass.

    python benchmarks/gpu_scale.py [--models 1.5b,7b] [--out results.json]      # needs CUDA
    python benchmarks/gpu_scale.py --tiny                                        # a CPU smoke run

What the recipes (recipes/config) assume and only a GPU can measure: a Qwen2.5-Math-1.5B / 7B shaped
Qwen2 (random weights, bf16, SDPA attention; the architecture and vocabulary of the real checkpoints,
which cannot be downloaded here), sequences of 1024 prompt + 3072 response tokens (the recipes'
lengths) with an 8-token answer at the end, and the recipes' old-log-prob token budget per GPU
(1.5B: 16384 tokens = 4 sequences, 7B: 8192 = 2). For each model it times, medians of ``--repeats``:

- ``logprob``: verl's old-log-prob pass over the budget (no grad, log-softmax of every position);
- ``oar_g_fused``: OAR-G as the worker runs it by default: that same clean pass (log-probs + clean
  answer logits), then one noisy forward with ``logits_to_keep`` and an input-only backward;
- ``oar_g_loglik_fused``: OAR-G ``objective=loglik``: one forward with grad, log-probs from it;
- ``oar_p_chunk16``: OAR-P chunk mode, K=16 (the recipes' setting), as the engines run it: the prompt fed
  once, copies of all rows sharing calls, each from its own span on (``core.batched_perturbation``), calls
  bounded by the same token budget; ``oar_p_chunk16_per_sample`` the path before (each row on its own, its
  copies grouped within it); ``oar_p_hierarchical``: K=16 chunks, the top 2 refined into single tokens;

and the peak GPU memory of each (``torch.cuda.max_memory_allocated`` above the model's weights).
``--check-exact`` checks OAR-P exact mode (prefix KV cache, batched copies, explicit position ids
through the GPU's attention kernels; per sample and across samples with padding masks) against the naive
loop (one whole forward per copy) on a small random model, in fp32 and bf16. ``--agreement`` also compares OAR-G importance of one sequence in bf16 with fp32 (Spearman rank
correlation and overlap of the top 10% tokens). Random weights make near-uniform predictions, so the
agreement numbers say how much bf16 rounding moves the ranking of a random model only; the timings
and memory do not depend on the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_oar.core.gradient import GradientConfig, gradient_importance_in_forward  # noqa: E402
from verl_oar.core.hf import HFPrefixModel, hf_importance  # noqa: E402
from verl_oar.core.perturbation import (  # noqa: E402
    PerturbationConfig,
    naive_perturbation_importance,
    occlusion_spans,
    perturbation_importance,
)

SHAPES = {
    # Qwen2.5-Math-1.5B / -7B config.json (architecture only)
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, budget=16384),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False, budget=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, budget=512),
}
PROMPT, RESPONSE, ANSWER = 1024, 3072, 8
NEUTRAL_ID = 0


def build(shape: dict, dtype: torch.dtype, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = {k: v for k, v in shape.items() if k != "budget"}
    config = Qwen2Config(**cfg, max_position_embeddings=4096, rope_theta=10000.0)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval().requires_grad_(False)


def batch(rows: int, prompt: int, response: int, vocab: int, device: str):
    length = prompt + response
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (rows, length), generator=g).to(device)
    reasoning = torch.zeros(rows, length, dtype=torch.bool, device=device)
    reasoning[:, prompt : length - ANSWER - 2] = True
    predict = torch.zeros_like(reasoning)
    predict[:, length - ANSWER - 1 : length - 1] = True
    targets = torch.roll(ids, -1, dims=1)
    segment = torch.arange(rows, device=device).unsqueeze(1).expand(rows, length).contiguous()
    return ids, reasoning, predict, targets, segment


def logprob_pass(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        return torch.log_softmax(logits.float(), -1).gather(-1, torch.roll(ids, -1, 1).unsqueeze(-1)).squeeze(-1)


def oar_g(model, ids, reasoning, predict, targets, segment, objective: str, fused: bool = True):
    """OAR-G as engines.fsdp.gradient runs it: an embedding hook, logits only where they predict the answer."""
    cfg = GradientConfig(objective=objective, outcome="mean")
    embedding = model.get_input_embeddings()
    keep_cols = predict.any(dim=0).nonzero().squeeze(1)
    outputs = {}

    def run(transform, **extra):
        handle = embedding.register_forward_hook(lambda _m, _i, out: transform(out))
        try:
            return model(input_ids=ids, use_cache=False, **extra)
        finally:
            handle.remove()

    def forward(transform):
        if objective == "loglik" and fused:  # this pass is also the log-prob pass: every position
            logits = run(transform).logits
            with torch.no_grad():
                outputs["log_probs"] = torch.log_softmax(logits.detach().float(), -1)
            return logits[predict].float()
        return run(transform, logits_to_keep=keep_cols).logits[predict[:, keep_cols]].float()

    clean = None
    if objective == "noisy_kl" and fused:
        with torch.no_grad():
            logits = run(lambda e: e).logits
            outputs["log_probs"] = torch.log_softmax(logits.float(), -1)
            clean = logits[predict].float()
            del logits
    with torch.enable_grad():
        importance = gradient_importance_in_forward(
            forward, reasoning, predict, targets, segment, ids.shape[0], cfg,
            generator=torch.Generator(device=ids.device).manual_seed(0), clean_logits=clean,
        )
    return importance


def oar_p(model, ids, reasoning, predict, budget_tokens: int, mode: str = "chunk"):
    """OAR-P as the engines run it: copies of all rows sharing calls (``core.batched_perturbation``)."""
    cfg = PerturbationConfig(outcome="mean", mode=mode, budget=16)
    answer = torch.roll(predict, 1, dims=1)  # the tokens the predicting positions predict
    return list(hf_importance(model, ids, reasoning, answer, cfg, neutral_id=NEUTRAL_ID, max_tokens=budget_tokens))


def oar_p_per_sample(model, ids, reasoning, predict, budget_tokens: int):
    """The path before cross-sample batching: each row alone, its copies grouped within it."""
    cfg = PerturbationConfig(outcome="mean", mode="chunk", budget=16)
    positions = torch.arange(ids.shape[1], device=ids.device)
    return [perturbation_importance(HFPrefixModel(model), ids[b], positions, occlusion_spans(reasoning[b], "chunk", 16),
                                    predict[b], NEUTRAL_ID, cfg, max_tokens=budget_tokens)[0]
            for b in range(ids.shape[0])]


def measure(fn, repeats: int, device: str) -> tuple[float, float]:
    """(median seconds, peak MiB allocated above what was allocated before) of ``fn``."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    samples = []
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        sync()
        samples.append(time.perf_counter() - start)
        del result
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else float("nan")
    return statistics.median(samples), peak


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra, rb = a.argsort().argsort().double(), b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def top_overlap(a: torch.Tensor, b: torch.Tensor, frac: float = 0.1) -> float:
    k = max(1, int(frac * a.numel()))
    return len(set(a.topk(k).indices.tolist()) & set(b.topk(k).indices.tolist())) / k


def run_model(name: str, args, device: str) -> dict:
    shape = SHAPES[name]
    prompt, response = (16, 48) if name == "tiny" else (PROMPT, RESPONSE)
    rows = max(1, shape["budget"] // (prompt + response))
    print(f"[gpu_scale] {name}: building (bf16, {device})", flush=True)
    model = build(shape, torch.bfloat16, device)
    weights_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    data = batch(rows, prompt, response, shape["vocab_size"], device)
    ids, reasoning, predict, targets, segment = data
    result = {"rows": rows, "tokens_per_row": prompt + response, "weights_mib": round(weights_mib)}
    rows_to_time = {
        "logprob": lambda: logprob_pass(model, ids),
        "oar_g_fused": lambda: oar_g(model, *data, objective="noisy_kl"),
        "oar_g_loglik_fused": lambda: oar_g(model, *data, objective="loglik"),
        "oar_p_chunk16": lambda: oar_p(model, ids, reasoning, predict, shape["budget"]),
        "oar_p_chunk16_per_sample": lambda: oar_p_per_sample(model, ids, reasoning, predict, shape["budget"]),
        "oar_p_hierarchical": lambda: oar_p(model, ids, reasoning, predict, shape["budget"], mode="hierarchical"),
    }
    for key, fn in rows_to_time.items():
        seconds, peak = measure(fn, args.repeats, device)
        result[key] = {"seconds": round(seconds, 4), "peak_mib_above_weights": None if math.isnan(peak) else round(peak)}
        print(f"[gpu_scale] {name} {key}: {seconds * 1e3:.1f} ms, peak {peak:.0f} MiB above weights", flush=True)
    base = result["logprob"]["seconds"]
    for key in rows_to_time:
        result[key]["x_logprob"] = round(result[key]["seconds"] / base, 2)
    if args.agreement and name != "7b":
        one = tuple(t[:1] for t in data)
        bf16 = oar_g(model, *one, objective="noisy_kl")[0][one[1][0]].float().cpu()
        del model
        model32 = build(shape, torch.float32, device)
        fp32 = oar_g(model32, *one, objective="noisy_kl")[0][one[1][0]].float().cpu()
        result["agreement_bf16_vs_fp32_oar_g"] = {
            "spearman": round(spearman(bf16, fp32), 3), "top10_overlap": round(top_overlap(bf16, fp32), 3)}
        print(f"[gpu_scale] {name} bf16 vs fp32 OAR-G: {result['agreement_bf16_vs_fp32_oar_g']}", flush=True)
        del model32
    else:
        del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def check_exact(device: str) -> dict:
    """Max |exact - naive| / max |naive| of OAR-P exact importance, per dtype, on a small model."""
    shape = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=False)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = build(shape, dtype, device)
        ids, reasoning, predict, _, _ = batch(1, 32, 160, shape["vocab_size"], device)
        positions = torch.arange(ids.shape[1], device=device)
        span = occlusion_spans(reasoning[0], "exact", 16)
        cfg = PerturbationConfig(outcome="mean", mode="exact")
        ours, _ = perturbation_importance(HFPrefixModel(model), ids[0], positions, span, predict[0], NEUTRAL_ID, cfg,
                                          max_tokens=4096)
        keep = predict[0].nonzero().squeeze(1)

        def logits_fn(x, keep=keep, model=model):
            kept = model(input_ids=x, use_cache=False, logits_to_keep=keep).logits
            full = kept.new_zeros(x.shape[0], x.shape[1], kept.shape[-1])
            full[:, keep] = kept
            return full

        naive = naive_perturbation_importance(logits_fn, ids[0], span, predict[0], NEUTRAL_ID, "mean")
        # the batched path: this row among three shorter ones (its copies share calls with theirs, padded)
        others, other_reasoning, _, _, _ = batch(3, 32, 96, shape["vocab_size"], device)
        answer = torch.roll(predict, 1, dims=1)
        padded_ids = torch.cat([ids, torch.nn.functional.pad(others, (0, ids.shape[1] - others.shape[1]))])
        mask = torch.zeros_like(padded_ids)
        mask[0], mask[1:, : others.shape[1]] = 1, 1
        rows_reasoning = torch.cat([reasoning, torch.nn.functional.pad(other_reasoning, (0, ids.shape[1] - others.shape[1]))])
        rows_answer = torch.zeros_like(rows_reasoning)
        rows_answer[0] = answer[0]
        rows_answer[1:, others.shape[1] - ANSWER : others.shape[1]] = True
        batched = hf_importance(model, padded_ids, rows_reasoning, rows_answer, cfg, attention_mask=mask,
                                neutral_id=NEUTRAL_ID, max_tokens=4096)[0]
        sel = reasoning[0]
        err = float((ours[sel] - naive[sel]).abs().max() / naive[sel].abs().max().clamp_min(1e-30))
        batched_err = float((batched[sel] - naive[sel]).abs().max() / naive[sel].abs().max().clamp_min(1e-30))
        out[str(dtype).removeprefix("torch.")] = {"max_rel_err": err, "batched_max_rel_err": batched_err,
                                                  "spearman": round(spearman(ours[sel].cpu(), naive[sel].cpu()), 4),
                                                  "batched_spearman": round(spearman(batched[sel].cpu(), naive[sel].cpu()), 4),
                                                  "scale": float(naive[sel].abs().max())}
        print(f"[gpu_scale] OAR-P exact vs naive, {dtype}: {out[str(dtype).removeprefix('torch.')]}", flush=True)
        del model
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="1.5b,7b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--check-exact", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU (smoke run of this script)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_scale: no CUDA device; use --tiny for a CPU smoke run", file=sys.stderr)
        return 2
    models = ["tiny"] if args.tiny else args.models.split(",")
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    if args.check_exact:
        try:
            results["oar_p_exact_vs_naive"] = check_exact(device)
        except Exception as exc:  # report and go on to the timings
            results["oar_p_exact_vs_naive"] = {"error": repr(exc)}
            print(f"[gpu_scale] OAR-P exact check failed: {exc!r}", flush=True)
    for name in models:
        results[name] = run_model(name, args, device)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
