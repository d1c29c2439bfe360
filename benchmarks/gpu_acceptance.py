"""Every check only a GPU can answer, in one run on one GPU with torch and transformers only (no verl, Ray, vLLM).

    bash scripts/gpu_acceptance.sh --out $OUT/gpu_acceptance_h200.json     # on the lent GPU, <= 8 minutes on an H200
    bash scripts/gpu_acceptance.sh --tiny --out /tmp/acceptance.json       # the same checks at tiny sizes on CPU

Writes one JSON (``--out``: the machine, the versions, each check's status ``ok`` / ``failed`` / ``skipped`` with its
reason, seconds, budget and result) and a short text summary beside it (``.txt``), both rewritten after every check
(and before each, naming the check in flight), so a run cut short still leaves what it measured. Checks run in order
of value per second; one whose budget no longer fits in ``--budget-s`` is skipped with that reason, and a check that
runs past what is left of the budget is stopped (SIGALRM) and reported failed, with the rows it had measured
(``partial_result``). Exit status: 0 when no check failed.

The checks (name: question; budget on one H200 and how it was estimated):

1. ``oar_p_exact`` (20 s): does batched OAR-P (the engines' path: prompts once, rows of several samples and prefix
   lengths per call, padded in the middle) equal the naive loop on the GPU's kernels? float64 / fp32 / bf16 with
   SDPA, bf16 with flash-attention where installed, against the float64 naive loop (``gpu_scale.check_exact``).
   Estimate: a 4-layer hidden-256 model, ~250 copies; each naive copy is one ~2 ms forward, 5 loops per case.
2. ``oar_g_noise_device`` (5 s): is OAR-G's noise drawn on the GPU the same for the same (seed, step, tokens)
   whatever the batch composition (alone, packed, padded, reordered, duplicated, a mask with holes)? At the 7B's
   hidden size, 4 sequences of up to 4k tokens: ~0.25 GB of normals per layout, milliseconds.
3. ``oar_cost_1.5b`` (90 s): OAR-G and OAR-P cost and peak memory at Qwen2.5-Math-1.5B's shape (random weights,
   bf16, 4 x (1024 + 3072) tokens), OAR-P batched across samples, chunk K=16 and hierarchical, each as a ratio to
   the log-prob pass in the same process; the target: chunk K=16 <= 4x
   (``gpu_scale.run_model``). Estimate: benchmarks/results_gpu_scale_h200.json (log-prob 0.14 s, OAR-G 0.44 s,
   chunk K=16 2.0 s on the per-sample path) x 4 runs per row (a warm-up + 3): ~20 s; hierarchical (K=16, m=4, u=4)
   feeds ~930k tokens per sample (docs/benchmarks.md, ~24x chunk mode), so it runs once on one of the 4 rows and
   is scaled by 4: ~57 log-prob passes' tokens, ~10 s; + the build: ~35 s, x2.5.
4. ``acpo_top1`` (20 s): ACPO's top-1 log-prob (``engines.fsdp.modal.top1_log_probs``) at Qwen's 151,936-token
   vocabulary over the 1.5B's log-prob budget: cost against the log-prob pass, peak memory, error against fp32
   ``log_softmax``. Estimate: one memory-bound pass over 5 GB of bf16 logits (~15 ms) beside a 0.14 s pass, 12 runs.
5. ``privileged_noise_floor`` (30 s): the floor under CSCR's shifts and OPPO's evidence: the identity template's
   rows re-scored in the re-scoring pass's packing (CSCR's two conditions in one packed call, flash-attention
   varlen or SDPA with packed position ids) against the plain pass's packing, bf16 and fp32, 1.5B shape.
   Estimate: ~50k tokens through the 1.5B in each dtype (fp32 at ~50 TFLOP/s: ~3 s) + 2 model builds.
6. ``memory_estimate`` (75 s): ``core.memory_estimate`` against ``torch.cuda.max_memory_allocated`` of each
   estimator's pass (tests/gpu/test_memory_estimate.py's cases, band ``BAND``). Its docstring: about a minute.
7. ``oar_cost_7b`` (120 s): row 3 at Qwen2.5-Math-7B's shape (2 x 4096 tokens), 2 repeats. Estimate:
   results_gpu_scale_h200.json (log-prob 0.23 s, OAR-G 0.75 s, chunk K=16 2.3 s) x 3 runs: ~20 s; hierarchical on
   one row (~114 calls of the 8192-token budget at ~0.23 s): ~26 s; a 15 GB build: ~60 s, x2.
8. ``oar_g_checkpointing`` (60 s): OAR-G's pass with and without verl's gradient checkpointing at the 1.5B's full
   shape, 4k / 8k / 16k tokens, bf16, flash-attention where installed (``benchmarks/oar_g_checkpointing.py``): peak
   against the estimate, and the importance bit for bit. Estimate: ~25 forward+backward passes of <= 16k tokens
   (~0.4 s each at 16k) + builds.
9. ``verl_engine_multi_gpu`` (1 s): HSDP and dynamic batch size with the fused importance pass, on verl's FSDP2 engine
   under NCCL. Always skipped here, with its reason, so that every report counts it: it needs verl and two GPUs.
   On CPU it runs on two gloo ranks (tests/engine/test_engine_multirank_on_cpu.py); flash-attention with padding in
   the middle of a row is check 1's bf16 flash-attention case.
10. ``megatron_gpu`` (1 s): OAR on verl's own ``MegatronEngine`` (TransformerEngine layers, the packed THD layout,
   NCCL). Always skipped here, with its reason: it needs verl, megatron-core, TransformerEngine and CUDA. What the
   CPU runs instead and what stays refused is in the reason.

Sum 422 s + ~20 s of imports and CUDA start-up: 442 s of the 480 s (8 minutes); ``--budget-s`` (default 470) keeps
a margin under scripts/gpu_acceptance.sh's hard ``timeout``. ``--tiny``: every check on CPU at tiny sizes (the test
tests/unit/test_gpu_acceptance_on_cpu.py), performance targets and memory bands reported but not judged.

Nothing on this script's path imports verl (the device machine has none): a finder refuses ``import verl`` and the
JSON records ``verl_modules_loaded`` (empty).
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import json
import math
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

START = time.monotonic()
ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "benchmarks", ROOT / "tests" / "gpu"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


class _NoVerl(importlib.abc.MetaPathFinder):
    """Refuses ``import verl``: the device machine has no verl, so a check that needs it must fail here too."""

    def find_spec(self, name, path=None, target=None):
        if name == "verl" or name.startswith("verl."):
            raise ModuleNotFoundError(f"benchmarks/gpu_acceptance.py must not import {name}: the GPU machine has "
                                      "only torch and transformers; import from verl_oar.core (verl-free) instead")
        return None


sys.meta_path.insert(0, _NoVerl())

import torch  # noqa: E402

import gpu_scale  # noqa: E402

SCHEMA = 1
STATUSES = ("ok", "failed", "skipped")


class Skip(Exception):
    """A check that cannot run here (the reason says why)."""


class _Timeout(Exception):
    pass


@dataclass
class Context:
    device: str
    tiny: bool
    attentions: tuple[str, ...]
    """attention implementations to try: sdpa, and flash_attention_2 where flash_attn is installed (CUDA)"""
    partial: dict | None = None
    """what the running check measured so far (a check fills it as it goes): kept when the check fails mid-way"""

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def fast_attention(self) -> str:
        """flash_attention_2 where installed (the recipes' setting), else sdpa"""
        return self.attentions[-1]


@dataclass
class Check:
    name: str
    budget_s: float
    question: str
    run: Callable[[Context], dict]
    """returns the result: ``ok`` (bool, False: failed with ``reason``) and ``headline`` (one line)"""


# ---------------------------------------------------------------------------------------------------------- checks


def check_oar_p_exact(ctx: Context) -> dict:
    result = gpu_scale.check_exact(ctx.device, ctx.attentions, tiny=ctx.tiny)
    worst = {name: max(c["max_rel_err"] for c in case.values()) if "skipped" not in case else "skipped"
             for name, case in result["cases"].items()}
    result["headline"] = "max |batched - float64 naive| / max: " + ", ".join(
        f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in worst.items())
    if not result["ok"]:
        result["reason"] = "batched OAR-P left the tolerance: " + result["headline"]
    return result


def check_noise(ctx: Context) -> dict:
    from verl_oar.core.noise import layout_noise, sequence_noise

    hidden = 16 if ctx.tiny else 3584  # Qwen2.5-Math-7B's hidden size
    lengths = [40, 25, 57, 33] if ctx.tiny else [4096, 1500, 3000, 2200]
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(1, 151936, (n,), generator=g).to(ctx.device) for n in lengths]
    masks = []
    for i, n in enumerate(lengths):
        mask = torch.zeros(n, dtype=torch.bool, device=ctx.device)
        mask[n // 4 : n - 16] = True
        if i == 1:
            mask[n // 2 : n // 2 + 5] = False  # a reasoning mask with a hole: the scattered path
        masks.append(mask)
    seed, step = 7, 3
    alone = sequence_noise(seqs, hidden, seed, step, where=masks, device=ctx.device)

    def packed(order):
        layout = torch.cat([masks[i] for i in order])[None]
        out = layout_noise([seqs[i] for i in order], [masks[i] for i in order], layout, hidden, seed, step)[0]
        return list(zip(order, out.split([lengths[i] for i in order])))

    def padded(order):
        width = max(lengths[i] for i in order)
        layout = torch.zeros(len(order), width, dtype=torch.bool, device=ctx.device)
        for j, i in enumerate(order):
            layout[j, : lengths[i]] = masks[i]
        out = layout_noise([seqs[i] for i in order], [masks[i] for i in order], layout, hidden, seed, step)
        return list(zip(order, (out[j, : lengths[i]] for j, i in enumerate(order))))

    compositions = {
        "each_alone_packed": [pair for i in range(len(seqs)) for pair in packed([i])],
        "all_packed": packed([0, 1, 2, 3]),
        "reversed_packed": packed([3, 2, 1, 0]),
        "all_padded": padded([0, 1, 2, 3]),
        "subset_with_duplicate_padded": padded([2, 0, 0]),
        "subset_with_duplicate_packed": packed([1, 3, 1]),
    }
    equal = {name: all(torch.equal(rows, alone[i]) for i, rows in pairs) for name, pairs in compositions.items()}
    other_step = sequence_noise(seqs[:1], hidden, seed, step + 1, where=masks[:1], device=ctx.device)[0]
    on_cpu = sequence_noise([seqs[0].cpu()], hidden, seed, step, where=[masks[0].cpu()], device="cpu")[0]
    result = {"hidden": hidden, "lengths": lengths, "drawn_on": str(alone[0].device), "bit_identical": equal,
              "changes_with_step": not torch.equal(other_step, alone[0]),
              "same_as_cpu_draws": bool(torch.equal(on_cpu, alone[0].cpu())),
              "ok": all(equal.values()) and not torch.equal(other_step, alone[0])}
    result["headline"] = (f"noise on {result['drawn_on']} bit-identical across {sum(equal.values())}/{len(equal)} "
                          f"batch compositions; changes with the step: {result['changes_with_step']}")
    if not result["ok"]:
        result["reason"] = f"noise differs across compositions: {equal}"
    return result


def _cost(name: str, repeats: int, ctx: Context) -> dict:
    result = gpu_scale.run_model("tiny" if ctx.tiny else name, 1 if ctx.tiny else repeats, ctx.device,
                                 hierarchical_rows=1, out=ctx.partial)
    result["ok"] = ctx.tiny or result["target"]["met"]
    rows = ("oar_g_fused", "oar_g_loglik_fused", "oar_p_chunk16", "oar_p_hierarchical")
    result["headline"] = "x log-prob pass: " + ", ".join(f"{k} {result[k]['x_logprob']}" for k in rows)
    if ctx.cuda:
        result["headline"] += "; peak GiB above weights: " + ", ".join(
            f"{k} {result[k]['peak_mib_above_weights'] / 1024:.1f}" for k in ("logprob",) + rows)
    if not result["ok"]:
        result["reason"] = (f"performance target missed: OAR-P chunk K=16 = {result['oar_p_chunk16']['x_logprob']}x "
                            f"the log-prob pass (target <= {gpu_scale.TARGET_X_LOGPROB}x)")
    return result


def check_acpo(ctx: Context) -> dict:
    from verl_oar.engines.fsdp.modal import BLOCK_BYTES, DEFAULT_BLOCK_BYTES, top1_log_probs

    name = "tiny" if ctx.tiny else "1.5b"
    shape = gpu_scale.SHAPES[name]
    length = 64 if ctx.tiny else gpu_scale.PROMPT + gpu_scale.RESPONSE
    rows = max(1, shape["budget"] // length)
    model = gpu_scale.build(shape, torch.bfloat16, ctx.device)
    ids = gpu_scale.batch(rows, length // 4, length - length // 4, shape["vocab_size"], ctx.device)[0]
    vocab = shape["vocab_size"]

    def with_top1():
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.roll(ids, -1, 1).unsqueeze(-1)).squeeze(-1)
            return lp, top1_log_probs(logits.view(-1, vocab), 1.0)

    plain_s, plain_peak = gpu_scale.measure(lambda: gpu_scale.logprob_pass(model, ids), 3, ctx.device)
    top_s, top_peak = gpu_scale.measure(with_top1, 3, ctx.device)
    with torch.no_grad():
        flat = model(input_ids=ids, use_cache=False).logits.view(-1, vocab)
    alone_s, alone_peak = gpu_scale.measure(lambda: top1_log_probs(flat, 1.0), 3, ctx.device)
    got = top1_log_probs(flat, 1.0)
    want = torch.log_softmax(flat[:2048].float(), -1).amax(-1)
    err = float((got[:2048] - want).abs().max())
    nan = lambda x: None if math.isnan(x) else round(x)  # noqa: E731
    result = {"vocab": vocab, "tokens": int(ids.numel()), "logprob_s": round(plain_s, 4),
              "logprob_with_top1_s": round(top_s, 4), "x_logprob": round(top_s / plain_s, 3),
              "top1_alone_s": round(alone_s, 4), "top1_alone_x_logprob": round(alone_s / plain_s, 3),
              "peak_mib": {"logprob": nan(plain_peak), "logprob_with_top1": nan(top_peak),
                           "top1_alone_above_logits": nan(alone_peak)},
              "block_bytes": BLOCK_BYTES.get(ctx.device, DEFAULT_BLOCK_BYTES),
              "max_abs_err_vs_fp32_log_softmax": err, "finite": bool(torch.isfinite(got).all())}
    result["ok"] = result["finite"] and err < 1e-3
    result["headline"] = (f"log-prob pass + top-1 = {result['x_logprob']}x the pass at V={vocab} "
                          f"(top-1 alone {result['top1_alone_x_logprob']}x); peak above logits "
                          f"{result['peak_mib']['top1_alone_above_logits']} MiB; err {err:.1e}")
    if not result["ok"]:
        result["reason"] = (f"top-1 log-prob wrong: max abs err {err} against fp32 log_softmax, "
                            f"finite {result['finite']}")
    del model, flat
    return result


def _packed_log_probs(model, rows: list[tuple[torch.Tensor, torch.Tensor]], budget: int) -> list[torch.Tensor]:
    """Response log-probs of each (prompt, response) row, rows packed in order into calls of <= ``budget`` tokens:
    one (1, total) sequence with position ids restarting per row (verl's remove-padding layout; flash-attention
    varlen, or SDPA's block-diagonal mask from the position ids), no cache."""
    out, group = [], []

    def flush():
        ids = torch.cat([torch.cat(r) for r in group])[None]
        positions = torch.cat([torch.arange(len(p) + len(r), device=ids.device) for p, r in group])[None]
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        start = 0
        for p, r in group:
            pred = logits[start + len(p) - 1 : start + len(p) + len(r) - 1].float()
            out.append(torch.log_softmax(pred, -1).gather(-1, r[:, None]).squeeze(1))
            start += len(p) + len(r)
        group.clear()

    for row in rows:
        if group and sum(len(p) + len(r) for p, r in group) + len(row[0]) + len(row[1]) > budget:
            flush()
        group.append(row)
    if group:
        flush()
    return out


def check_privileged_floor(ctx: Context) -> dict:
    from verl_oar.core.privileged_prompt import CSCR_POSITIVE, rewrite_messages

    messages = [{"role": "system", "content": "Please reason step by step."}, {"role": "user", "content": "6 x 7?"}]
    identity_equal = rewrite_messages(messages, "{question}") == messages
    cscr_text = rewrite_messages(messages, CSCR_POSITIVE)[-1]["content"]
    name = "tiny" if ctx.tiny else "1.5b"
    shape = gpu_scale.SHAPES[name]
    g = torch.Generator().manual_seed(11)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    tok = lambda n: torch.randint(1, shape["vocab_size"], (n,), generator=g).to(ctx.device)  # noqa: E731
    rows, added = [], 3 if ctx.tiny else 20  # CSCR's condition: ~20 BPE tokens
    for _ in range(4):  # 4 prompts, 2 responses each (many short, a few long, as a rollout's)
        prompt = tok(rnd(4, 10) if ctx.tiny else rnd(150, 700))
        rows += [(prompt, tok(rnd(8, 40) if ctx.tiny else min(3072, int(200 * math.exp(rnd(0, 270) / 100)))))
                 for _ in range(2)]
    suffix = tok(added)
    privileged = [row for p, r in rows for row in ((p, r), (torch.cat([p, suffix]), r))]  # identity, CSCR's c+
    result = {"identity_template_equal": identity_equal, "cscr_condition_text": cscr_text,
              "attention": ctx.fast_attention, "rows": len(rows), "budget_tokens": shape["budget"],
              "response_tokens": sum(len(r) for _, r in rows), "dtypes": {}}
    for dtype in (torch.bfloat16, torch.float32):
        model = gpu_scale.build(shape, dtype, ctx.device, attention=ctx.fast_attention if dtype != torch.float32
                                else "sdpa")
        plain = _packed_log_probs(model, rows, shape["budget"])
        identity = _packed_log_probs(model, privileged, shape["budget"])[0::2]
        diff = torch.cat([(a - b).abs() for a, b in zip(identity, plain)])
        shifts = torch.stack([(a - b).mean().abs() for a, b in zip(identity, plain)])
        result["dtypes"][str(dtype).removeprefix("torch.")] = {
            "max_abs": float(diff.max()), "p99_abs": float(diff.quantile(0.99)), "mean_abs": float(diff.mean()),
            "max_abs_mean_shift_per_response": float(shifts.max()),
            "rows_bit_identical": sum(bool(torch.equal(a, b)) for a, b in zip(identity, plain)),
            "finite": all(bool(torch.isfinite(a).all()) for a in identity)}
        del model
        if ctx.cuda:
            torch.cuda.empty_cache()
    fp32, bf16 = result["dtypes"]["float32"], result["dtypes"]["bfloat16"]
    # packing must isolate the rows: a leak across rows moves log-probs by O(1), fp32's kernels by ~1e-5
    result["ok"] = identity_equal and fp32["finite"] and bf16["finite"] and fp32["max_abs"] < 1e-2
    result["headline"] = (f"identity re-scoring vs plain pass, |d log p| per token: bf16 mean {bf16['mean_abs']:.2e} "
                          f"p99 {bf16['p99_abs']:.2e} max {bf16['max_abs']:.2e}; fp32 max {fp32['max_abs']:.1e} "
                          f"({ctx.fast_attention}, packed)")
    if not result["ok"]:
        result["reason"] = ("the identity template's re-scoring left the plain pass: identity template equal "
                            f"{identity_equal}, fp32 max |d log p| {fp32['max_abs']} (packing leaks across rows?)")
    return result


def check_memory_estimate(ctx: Context) -> dict:
    import test_memory_estimate as tme

    tme.configure(ctx.device, tiny=ctx.tiny)
    report = tme.run_cases()
    errors = {n: c["error"] for n, c in report["cases"].items() if "error" in c}
    off = [n for n, c in report["cases"].items() if not c["ok"] and "error" not in c]
    report["ok"] = not errors and (ctx.tiny or not off)
    report["headline"] = "estimate / measured: " + ", ".join(
        f"{n} {c.get('ratio', 'error')}" for n, c in report["cases"].items())
    if errors:
        report["reason"] = f"cases raised: {errors}"
    elif not report["ok"]:
        report["reason"] = f"outside the band {tme.BAND}: {off}"
    return report


def check_checkpointing(ctx: Context) -> dict:
    import oar_g_checkpointing as ogc

    out = Path(tempfile.mkdtemp(prefix="gpu_acceptance_")) / "checkpointing.json"
    if ctx.tiny:
        ogc.SHAPE = dict(ogc.SHAPE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, vocab_size=512)
        argv = ["--tokens", "512", "--dtypes", "float32"]
    else:
        argv = ["--device", "cuda", "--attention", ctx.fast_attention, "--dtypes", "bfloat16", "--full-shape",
                "--tokens", "4096,8192,16384"]
    ogc.main(argv + ["--threads", str(torch.get_num_threads()), "--out", str(out)])
    result = json.loads(out.read_text())
    import test_memory_estimate as tme

    for row in result["rows"]:
        row["estimate_over_peak"] = round(row["estimate_mib"] / max(row["peak_mib"], 1e-9), 3)
    band = [tme.BAND[0] <= r["estimate_over_peak"] <= tme.BAND[1] for r in result["rows"]]
    pairs = [r for r in result["rows"] if r["checkpointed"]]
    result["ok"] = ctx.tiny or all(band)
    result["headline"] = "checkpointed / plain peak: " + ", ".join(
        f"{r['tokens']} tok {r['checkpointed_over_plain']} (bit-identical {r['bit_identical']})" for r in pairs) + \
        "; estimate / peak: " + ", ".join(str(r["estimate_over_peak"]) for r in result["rows"])
    if not result["ok"]:
        result["reason"] = f"estimate outside the band {tme.BAND} of the measured peak: {result['headline']}"
    return result


def check_verl_engine_multi_gpu(ctx: Context) -> dict:
    """Always skipped here, and counted: it needs verl and two GPUs, and this script runs without verl on one."""
    raise Skip("needs verl and two GPUs (this script runs on one GPU without verl). On CPU it runs on 2 gloo ranks: "
               "tests/engine/test_engine_multirank_on_cpu.py (HSDP with fsdp_size=1, use_dynamic_bsz, fused OAR-G); "
               "on a machine with two GPUs and verl: OAR_MULTIRANK_CUDA=1 python -m pytest "
               "tests/engine/test_engine_multirank_on_cpu.py")


def check_megatron_gpu(ctx: Context) -> dict:
    """Always skipped here, and counted: verl's Megatron engine needs verl, TransformerEngine and CUDA."""
    raise Skip("needs verl, megatron-core and TransformerEngine on CUDA (this script runs without verl). Never run on "
               "a GPU: verl's MegatronEngine itself, TransformerEngine layers and FP8, the packed (THD) layout. On CPU "
               "real megatron-core 0.16.1 runs the plugin's Megatron path in the padded layout at TP=1/2 with "
               "sequence parallel (tests/engine/test_megatron_real_on_cpu.py, "
               "tests/engine/test_megatron_llama_on_cpu.py); the packed layout is refused on CPU naming the padded "
               "one, pipeline and context parallelism are refused at start-up everywhere. On a GPU machine with "
               "verl and megatron-core: python -m pytest tests/gpu/test_megatron_importance.py")


CHECKS = [
    Check("oar_p_exact", 20, "Does batched OAR-P (per-row prefixes, middle padding) equal the naive loop on the GPU's "
          "kernels (float64/fp32/bf16 SDPA, bf16 flash-attention where installed)?", check_oar_p_exact),
    Check("oar_g_noise_device", 5, "Is OAR-G's noise drawn on the device the same for the same (seed, step, tokens) "
          "across batch compositions?", check_noise),
    Check("oar_cost_1.5b", 90, "OAR-G / OAR-P cost and peak memory at Qwen2.5-Math-1.5B's shape against the log-prob "
          "pass; OAR-P batched vs per sample, chunk K=16 (target <= 4x) and hierarchical",
          lambda c: _cost("1.5b", 3, c)),
    Check("acpo_top1", 20, "ACPO's top-1 log-prob at Qwen's 152k vocabulary: cost against the log-prob pass, peak "
          "memory", check_acpo),
    Check("privileged_noise_floor", 30, "CSCR/OPPO re-scoring: how far does the identity template, scored in bf16 in "
          "the re-scoring pass's packing, move log-probs from the plain pass (the floor under every shift)?",
          check_privileged_floor),
    Check("memory_estimate", 75, "Does the start-up memory estimate match torch.cuda.max_memory_allocated of each "
          "estimator's pass?", check_memory_estimate),
    Check("oar_cost_7b", 120, "Row oar_cost_1.5b at Qwen2.5-Math-7B's shape", lambda c: _cost("7b", 2, c)),
    Check("oar_g_checkpointing", 60, "OAR-G with verl's gradient checkpointing at the 1.5B's full shape: peak vs plain "
          "and vs the estimate, importance bit for bit", check_checkpointing),
    Check("verl_engine_multi_gpu", 1, "HSDP and dynamic batch size with the fused importance pass on verl's FSDP2 "
          "engine under NCCL", check_verl_engine_multi_gpu),
    Check("megatron_gpu", 1, "OAR on verl's own MegatronEngine (TransformerEngine, packed layout) under NCCL",
          check_megatron_gpu),
]


# ---------------------------------------------------------------------------------------------------------- runner


def machine(ctx: Context) -> dict:
    from importlib import metadata

    from verl_oar.testbed.machine import machine_info

    info = machine_info()
    info.pop("verl", None)  # installed here or not, never imported
    try:
        info["flash_attn"] = metadata.version("flash_attn")
    except metadata.PackageNotFoundError:
        info["flash_attn"] = None
    info["device"] = ctx.device
    if ctx.cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(), gpus_visible=torch.cuda.device_count())
    info["attentions"] = list(ctx.attentions)
    return info


def summary(report: dict) -> str:
    counts = {s: sum(c["status"] == s for c in report["checks"].values()) for s in STATUSES}
    m = report["machine"]
    head = (f"GPU acceptance on {m.get('gpu', m['device'])} (torch {m['torch']}, transformers {m['transformers']}, "
            f"flash-attn {m['flash_attn']}){' [tiny, CPU]' if report['tiny'] else ''}: "
            + ", ".join(f"{n} {s}" for s, n in counts.items())
            + f" of {len(report['order'])}, {report['seconds']:.0f} s of the {report['budget_s']:.0f} s budget"
            + (f"; running {report['running']}" if report.get("running") else ""))
    lines = [head]
    for name in report["order"]:
        c = report["checks"].get(name)
        if c is None:
            lines.append(f"  {'pending':8s} {name}")
            continue
        text = c.get("result", {}).get("headline", "") if c["status"] == "ok" else c.get("reason", "")
        lines.append(f"  {c['status']:8s} {name:24s} {c['seconds']:7.1f} s / {c['budget_s']:3.0f} s  {text}")
    retry = [n for n, c in report["checks"].items()
             if c["status"] == "failed" or (c["status"] == "skipped" and c["reason"].startswith("not started"))]
    if retry and report["finished"]:
        out = report.get("out", "gpu_acceptance.json").removesuffix(".json")
        lines.append(f"retry: bash scripts/gpu_acceptance.sh --only {','.join(retry)} --out {out}_retry.json")
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path) -> None:
    report["seconds"] = round(time.monotonic() - START, 1)
    report["verl_modules_loaded"] = sorted(m for m in sys.modules if m == "verl" or m.startswith("verl."))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    out.with_suffix(".txt").write_text(summary(report))


def _jsonable(value):
    return json.loads(json.dumps(value, default=str, allow_nan=True))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_acceptance.json"), help="the JSON (the .txt beside it)")
    parser.add_argument("--tiny", action="store_true", help="every check at tiny sizes on CPU (the test suite's run)")
    parser.add_argument("--budget-s", type=float, default=470.0, help="seconds for the whole run, start-up included")
    parser.add_argument("--only", default="", help="comma-separated check names to run (default: all)")
    args = parser.parse_args(argv)
    names = [c.name for c in CHECKS]
    only = [n for n in args.only.split(",") if n]
    if unknown := sorted(set(only) - set(names)):
        parser.error(f"--only {','.join(unknown)}: unknown check(s); the checks are {','.join(names)}")
    device = "cpu" if args.tiny else "cuda"
    cuda = device == "cuda" and torch.cuda.is_available()
    attentions = ("sdpa",)
    if cuda:
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            try:  # installed but built for another torch / CUDA: say so and run SDPA only
                import flash_attn  # noqa: F401

                attentions += ("flash_attention_2",)
            except Exception as exc:
                print(f"[gpu_acceptance] flash_attn is installed but does not import ({exc!r}): SDPA only", flush=True)
    ctx = Context(device, args.tiny, attentions)
    import transformers

    report = {"schema": SCHEMA, "command": "python benchmarks/gpu_acceptance.py " + " ".join(
        sys.argv[1:] if argv is None else argv), "tiny": args.tiny, "budget_s": args.budget_s,
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine(ctx), "transformers": transformers.__version__, "torch": torch.__version__},
        "out": str(args.out), "order": names, "checks": {}, "running": None, "finished": False}
    if device == "cuda" and not cuda:
        for check in CHECKS:
            report["checks"][check.name] = {"status": "skipped", "reason": "no CUDA device (use --tiny on CPU)",
                                            "seconds": 0.0, "budget_s": check.budget_s, "question": check.question}
        report["finished"] = True
        write(report, args.out)
        print(summary(report), end="")
        return 2

    def on_alarm(signum, frame):
        raise _Timeout()

    def on_term(signum, frame):  # scripts/gpu_acceptance.sh's timeout: record the check in flight, then stop
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    try:
        for check in CHECKS:
            entry = {"status": "skipped", "seconds": 0.0, "budget_s": check.budget_s, "question": check.question}
            left = args.budget_s - (time.monotonic() - START)
            if only and check.name not in only:
                entry["reason"] = "not selected (--only)"
            elif left < check.budget_s:  # budgets are an H200's seconds; a tiny run fits them too
                entry["reason"] = (f"not started: {left:.0f} s left of the {args.budget_s:.0f} s budget, "
                                   f"it needs ~{check.budget_s:.0f} s")
            else:
                report["running"] = check.name
                write(report, args.out)
                print(f"[gpu_acceptance] {check.name} (budget {check.budget_s:.0f} s, {left:.0f} s left)", flush=True)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.monotonic()
                ctx.partial = {}
                signal.alarm(max(1, int(left)))
                try:
                    result = _jsonable(check.run(ctx))
                    entry["status"] = "ok" if result.get("ok", True) else "failed"
                    if entry["status"] == "failed":
                        entry["reason"] = result.get("reason", "a criterion failed (see result)")
                    entry["result"] = result
                except Skip as exc:
                    entry["reason"] = str(exc)
                except _Timeout:
                    entry.update(status="failed", reason=f"stopped: ran past the {args.budget_s:.0f} s budget "
                                                         f"({left:.0f} s were left when it started)")
                except Exception as exc:  # report it and go on to the next check
                    import traceback

                    entry.update(status="failed", reason=f"{type(exc).__name__}: {exc}",
                                 traceback=traceback.format_exc(limit=-8))
                finally:
                    signal.alarm(0)
                if entry["status"] == "failed" and "result" not in entry and ctx.partial:
                    entry["partial_result"] = _jsonable(ctx.partial)  # the rows measured before it stopped
                entry["seconds"] = round(time.monotonic() - t0, 2)
                if cuda:
                    entry["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                report["running"] = None
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
            report["checks"][check.name] = entry
            write(report, args.out)
            print(f"[gpu_acceptance] {check.name}: {entry['status']} in {entry['seconds']} s "
                  f"{entry.get('reason', entry.get('result', {}).get('headline', ''))}", flush=True)
        report["finished"] = True
    finally:
        write(report, args.out)
    print(summary(report), end="")
    return 1 if any(c["status"] == "failed" for c in report["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
