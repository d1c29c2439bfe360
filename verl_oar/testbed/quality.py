"""Importance quality on the pick_max testbed: does each estimator find the tokens the answer depends on?

    python -m verl_oar.testbed.quality [--testbed DIR] [--samples N] [--seed S] [--fracs 0.05,0.1,0.2]
        [--out results.json]

Steps, in the order they run:

1. load the committed testbed (``workspace.committed_testbed``), or the one in ``--testbed``;
2. sample N val prompts (cycled if N > n_val) and one response each at temperature 1
   (transformers ``generate``), seeded by ``--seed``;
3. read the oracle from each response's text (``pick_max.oracle_batch``); responses without one
   (no answer) are skipped and counted;
4. score the reasoning tokens of the rest with every estimator (below) on the same model, one
   padded batch (OAR-G, entropy) or one sequence at a time (OAR-P);
5. recall@K% of the ``causal`` oracle (the picks) per estimator (``core.token_ranking.mean_recall``);
6. counterfactual accuracy drop per estimator: occlude its top-K% reasoning tokens with a space and
   greedily decode the answer after the modified reasoning and ``\\boxed{``
   (``importance_quality.accuracy_drop``); ``answer_flip``: the same, with the model's own greedy
   answer after the unmodified reasoning as the truth, i.e. how often occlusion changes the answer
   (an accuracy drop needs right answers to drop; a weak model has few).

Estimators: ``oar_g_noisy_kl`` (OAR-G, AS-MEAN, grad x input, sigma 1e-3), ``oar_g_loglik`` (OAR-G
with J = answer log-likelihood), ``oar_p_exact`` (OAR-P, one occlusion per token, AS-MEAN),
``oar_p_chunk8`` (OAR-P, 8 contiguous chunks), ``entropy`` (policy entropy at each token), ``random``,
and ``oracle`` (a sanity row: the causal tokens first).

Choices, stated:

1. Neutral token: a space (byte 32), for OAR-P's occlusion and for the counterfactual. Filler words
   are separated by spaces, so a space is in-distribution and carries no digit; the worker's
   default (the pad token ``<|endoftext|>``) never appears in the warm-start data, so its
   embedding is untrained and occluding with it measures an out-of-distribution input as much as
   a missing token. ``--neutral pad`` uses the pad token for both instead.
2. Importance is computed with the rollout temperature 1 and the logits of the sampled sequence,
   as the worker would; the answer tokens are the boxed content (``answer_span``), so the outcome is
   the model's prediction of that content given the sampled reasoning.
3. Seeds: ``--seed`` seeds sampling; ``seed + 1`` OAR-G's noise; ``seed + 2`` the random ranking;
   ``seed + 3`` the tie-breaking of every ranking (one generator per estimator, same seed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from verl_oar.core.gradient import GradientConfig
from verl_oar.core.hf import hf_importance
from verl_oar.core.perturbation import PerturbationConfig
from verl_oar.testbed.pick_max import ORACLES, oracle_batch
from verl_oar.core.token_ranking import entropy_scores, mean_recall, random_scores, top_count
from verl_oar.testbed.importance_quality import CounterfactualExample, accuracy_drop, greedy_answer
from verl_oar.testbed.workspace import (
    MANIFEST,
    TESTBED_VERSION,
    Testbed,
    committed_testbed,
    max_response_tokens,
    sample_responses,
)

ESTIMATORS = ("oar_g_noisy_kl", "oar_g_loglik", "oar_p_exact", "oar_p_chunk8", "entropy", "random", "oracle")
"""Rows of the table, in order."""
ANSWER_MARKER = "\\boxed{"
OAR_P_MAX_TOKENS = 8192
"""OAR-P token budget per model call (rows x tokens)"""


# ---------------------------------------------------------------------------------------------------
# 1. Samples and their oracle, as one padded batch
# ---------------------------------------------------------------------------------------------------


@dataclass
class Batch:
    """The readable samples: full sequences (prompt + response) right-padded, and the oracle.

    Full-sequence position of response token t of row b: ``prompt_len[b] + t``.
    """

    ids: Tensor
    """(B, L) long, prompt + response, right-padded with the pad id"""
    attention: Tensor
    """(B, L) long 0/1"""
    prompt_len: Tensor
    """(B,) long"""
    response_len: Tensor
    """(B,) long"""
    oracle: dict[str, Tensor]
    """``oracle_batch`` of the responses: "reasoning", "answer", "causal" (B, T) bool; "found" (B,)"""
    truths: list[str]
    """the right answer, per row"""

    def to_full(self, response_mask: Tensor) -> Tensor:
        """(B, T) response-coordinate bool -> (B, L) full-sequence bool."""
        out = torch.zeros(self.ids.shape, dtype=torch.bool)
        for b in range(self.ids.shape[0]):
            p, t = int(self.prompt_len[b]), int(self.response_len[b])
            out[b, p : p + t] = response_mask[b, :t]
        return out

    def to_response(self, full: Tensor) -> Tensor:
        """(B, L) full-sequence float scores -> (B, T) response-coordinate float32 (0 on padding)."""
        width = self.oracle["reasoning"].shape[1]
        out = torch.zeros(full.shape[0], width, dtype=torch.float32)
        for b in range(full.shape[0]):
            p, t = int(self.prompt_len[b]), int(self.response_len[b])
            out[b, :t] = full[b, p : p + t].float()
        return out


def make_batch(samples: Sequence[tuple[list[int], list[int]]], truths: Sequence[str], tokenizer) -> tuple[Batch, int]:
    """Keep the samples with an oracle (a boxed answer, non-empty reasoning and answer) as a Batch;
    return it and the number skipped."""
    width = max(len(r) for _, r in samples)
    responses = torch.full((len(samples), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for b, (_, r) in enumerate(samples):
        responses[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        mask[b, : len(r)] = True
    oracle = oracle_batch(responses, mask, tokenizer)
    keep = [
        b for b in range(len(samples))
        if oracle["found"][b] and oracle["reasoning"][b].any() and oracle["answer"][b].any()
    ]
    if not keep:
        raise RuntimeError(
            f"none of the {len(samples)} sampled responses has a boxed answer; the testbed model "
            "is not warm-started enough (rebuild with more warm_start_steps)"
        )
    length = max(len(samples[b][0]) + len(samples[b][1]) for b in keep)
    ids = torch.full((len(keep), length), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(keep), length), dtype=torch.long)
    for row, b in enumerate(keep):
        full = samples[b][0] + samples[b][1]
        ids[row, : len(full)] = torch.tensor(full)
        attention[row, : len(full)] = 1
    batch = Batch(
        ids=ids,
        attention=attention,
        prompt_len=torch.tensor([len(samples[b][0]) for b in keep]),
        response_len=torch.tensor([len(samples[b][1]) for b in keep]),
        oracle={name: tensor[keep] for name, tensor in oracle.items()},
        truths=[truths[b] for b in keep],
    )
    return batch, len(samples) - len(keep)


# ---------------------------------------------------------------------------------------------------
# 2. Estimators: (B, L) float scores over the full sequences, 0 off the reasoning tokens
# ---------------------------------------------------------------------------------------------------


def oar_g_scores(model, batch: Batch, cfg: GradientConfig, seed: int, clean_logits: Tensor | None) -> Tensor:
    """OAR-G importance (B, L) float32 of the whole batch in one gradient pass."""
    return hf_importance(
        model, batch.ids, batch.to_full(batch.oracle["reasoning"]), batch.to_full(batch.oracle["answer"]), cfg,
        attention_mask=batch.attention, generator=torch.Generator().manual_seed(seed),
        clean_logits=clean_logits if cfg.objective == "noisy_kl" else None,
    )


def oar_p_scores(model, batch: Batch, mode: str, budget: int, neutral_id: int) -> Tensor:
    """OAR-P importance (B, L) float32, one sequence at a time (AS-MEAN, prefix sharing)."""
    return hf_importance(
        model, batch.ids, batch.to_full(batch.oracle["reasoning"]), batch.to_full(batch.oracle["answer"]),
        PerturbationConfig(outcome="mean", mode=mode, budget=budget), attention_mask=batch.attention,
        neutral_id=neutral_id, max_tokens=OAR_P_MAX_TOKENS,
    )


def oracle_scores(batch: Batch) -> Tensor:
    """(B, L) float32: 1 on causal tokens, 0 elsewhere (sanity row)."""
    return batch.to_full(batch.oracle["causal"]).float()


def all_scores(model, batch: Batch, neutral_id: int, seed: int) -> tuple[dict[str, Tensor], dict[str, float]]:
    """Every estimator's (B, T) response-coordinate scores, and the seconds each took."""
    seconds: dict[str, float] = {}
    full: dict[str, Tensor] = {}

    def timed(name: str, fn: Callable[[], Tensor]) -> None:
        start = time.perf_counter()
        full[name] = fn()
        seconds[name] = round(time.perf_counter() - start, 2)

    with torch.no_grad():
        start = time.perf_counter()
        clean_logits = model(input_ids=batch.ids, attention_mask=batch.attention, use_cache=False).logits
        clean_seconds = time.perf_counter() - start
    timed("oar_g_noisy_kl", lambda: oar_g_scores(model, batch, GradientConfig(objective="noisy_kl"), seed + 1, clean_logits))
    seconds["oar_g_noisy_kl"] = round(seconds["oar_g_noisy_kl"] + clean_seconds, 2)  # its clean pass
    timed("oar_g_loglik", lambda: oar_g_scores(model, batch, GradientConfig(objective="loglik"), seed + 1, None))
    timed("oar_p_exact", lambda: oar_p_scores(model, batch, "exact", 1, neutral_id))
    timed("oar_p_chunk8", lambda: oar_p_scores(model, batch, "chunk", 8, neutral_id))
    timed("entropy", lambda: entropy_scores(clean_logits))
    seconds["entropy"] = round(seconds["entropy"] + clean_seconds, 2)
    timed("random", lambda: random_scores(batch.ids.shape, torch.Generator().manual_seed(seed + 2)))
    timed("oracle", lambda: oracle_scores(batch))
    return {name: batch.to_response(full[name]) for name in ESTIMATORS}, seconds


# ---------------------------------------------------------------------------------------------------
# 3. Measures
# ---------------------------------------------------------------------------------------------------


def expected_random_recall(batch: Batch, fracs: Sequence[float]) -> dict[float, float]:
    """E[recall] of a uniformly random ranking: mean over rows of top_count(frac, R) / R (any oracle)."""
    sizes = batch.oracle["reasoning"].sum(1).tolist()
    return {f: sum(top_count(f, r) / r for r in sizes) / len(sizes) for f in fracs}


def counterfactual_examples(batch: Batch) -> list[CounterfactualExample]:
    """One example per row: prompt ids, the reasoning tokens (a prefix of the response), the right answer."""
    examples = []
    for b in range(batch.ids.shape[0]):
        p = int(batch.prompt_len[b])
        reasoning = batch.oracle["reasoning"][b]
        r = int(reasoning.sum())
        if not bool(reasoning[:r].all()):
            raise ValueError(f"row {b}: the reasoning tokens are not a prefix of the response")
        examples.append(CounterfactualExample(batch.ids[b, :p], batch.ids[b, p : p + r], batch.truths[b]))
    return examples


def measure(model, tokenizer, batch: Batch, scores: dict[str, Tensor], fracs: Sequence[float], *, neutral_id: int,
            seed: int) -> dict[str, dict]:
    """Per estimator: recall of each oracle, and the counterfactual accuracy drop (occlusion)."""
    examples = counterfactual_examples(batch)
    marker = tokenizer.encode(ANSWER_MARKER, add_special_tokens=False)
    decode = lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)
    reasoning = batch.oracle["reasoning"]
    # the model's own greedy answer after the unmodified reasoning: "answer_flip" is how often
    # occlusion changes it (accuracy drop with this answer as the truth), informative even when the
    # model is wrong
    own_answers = [
        greedy_answer(model, torch.cat([e.prompt_ids, e.reasoning_ids, e.prompt_ids.new_tensor(marker)]), decode)
        for e in examples
    ]
    answered = [b for b, a in enumerate(own_answers) if a is not None and a.strip()]
    own = [CounterfactualExample(e.prompt_ids, e.reasoning_ids, a or "") for e, a in zip(examples, own_answers)]
    results = {}
    for name in ESTIMATORS:
        row: dict = {"recall": {}}
        for oracle in ORACLES:
            summary = mean_recall(scores[name], reasoning, batch.oracle[oracle], batch.oracle["found"], fracs,
                                  torch.Generator().manual_seed(seed + 3))
            row["recall"][oracle] = {str(f): v for f, v in summary.recall.items()}
            row["counted"], row["skipped"] = summary.counted, summary.skipped
        per_example = [scores[name][b, : int(reasoning[b].sum())] for b in range(len(examples))]
        drop = accuracy_drop(
            model, examples, per_example, fracs, perturb="occlude", answer_marker_ids=marker, decode=decode,
            neutral_id=neutral_id, generator=torch.Generator().manual_seed(seed + 3),
        )
        row["accuracy_original"] = drop.original
        row["accuracy_occluded"] = {str(f): v for f, v in drop.modified.items()}
        row["accuracy_drop"] = {str(f): v for f, v in drop.drop.items()}
        row["answer_flip"], row["answer_flip_counted"] = {str(f): math.nan for f in fracs}, 0
        if answered:
            flips = accuracy_drop(
                model, [own[b] for b in answered], [per_example[b] for b in answered], fracs, perturb="occlude",
                answer_marker_ids=marker, decode=decode, neutral_id=neutral_id,
                generator=torch.Generator().manual_seed(seed + 3),
            )
            row["answer_flip"], row["answer_flip_counted"] = {str(f): v for f, v in flips.drop.items()}, flips.count
        results[name] = row
    return results


# ---------------------------------------------------------------------------------------------------
# 4. CLI
# ---------------------------------------------------------------------------------------------------


def load_testbed(directory: str | os.PathLike) -> Testbed:
    """The testbed built in ``directory`` (by this version of ``workspace.build_testbed``)."""
    from verl_oar.cpu.workspace import read_manifest

    root = Path(directory).expanduser().resolve()
    manifest = read_manifest(root, MANIFEST)
    if manifest is None or manifest.get("version") != TESTBED_VERSION:
        raise SystemExit(f"{root} holds no pick_max testbed of version {TESTBED_VERSION}; build one with "
                         f"python -m verl_oar.testbed.workspace {root}")
    return Testbed(root, manifest)


def print_table(report: dict) -> None:
    """Recall@frac of the causal oracle and accuracy drop per estimator, as text."""
    fracs = report["config"]["fracs"]
    head = " | ".join(f"{f:>5}" for f in fracs)
    columns = (("recall causal @", "recall", "causal"),
               ("acc drop @", "accuracy_drop", None), ("answer flip @", "answer_flip", None))
    print("\n" + " | ".join([f"{'estimator':<16}", *(f"{label:>15} {head}" for label, _, _ in columns), "seconds"]))
    for name, row in report["estimators"].items():
        cells = [" | ".join(f"{(row[k][o] if o else row[k])[str(f)]:>5.2f}" for f in fracs) for _, k, o in columns]
        print(" | ".join([f"{name:<16}", *(f"{'':>15} {c}" for c in cells), f"{row['seconds']:>7.2f}"]))
    expected = " | ".join(f"{report['expected_random_recall'][str(f)]:>5.2f}" for f in fracs)
    print(" | ".join([f"{'E[random]':<16}", f"{'':>15} {expected}", f"{'':>15} {expected}"]))
    s = report["samples"]
    print(f"samples {s['total']}: {s['counted']} with an oracle, {s['skipped']} skipped; sampled accuracy "
          f"{s['sampled_accuracy']:.2f}; greedy answer after the sampled reasoning "
          f"{report['estimators']['random']['accuracy_original']:.2f}; answer flips counted on "
          f"{report['estimators']['random']['answer_flip_counted']}; {report['seconds']} s")


@dataclass
class QualityResult:
    """``run_quality``'s output: the JSON-ready report, and what it was computed on (for heatmaps)."""

    report: dict
    batch: Batch
    scores: dict[str, Tensor]
    """estimator -> (B, T) response-coordinate scores of ``batch``'s rows"""
    tokenizer: object


def run_quality(
    bed: Testbed, *, samples: int = 48, seed: int = 0, fracs: Sequence[float] = (0.05, 0.1, 0.2), neutral: str = "space"
) -> QualityResult:
    """Steps 2-6 of the module docstring on the testbed's warm-started model."""
    from transformers import AutoModelForCausalLM

    from verl_oar.core.answer_span import find_answer_span
    from verl_oar.cpu.workspace import build_tokenizer

    if samples < 1 or not all(0 < f <= 1 for f in fracs):
        raise ValueError(f"samples must be >= 1 and every fraction in (0, 1]; got {samples}, {list(fracs)}")
    start = time.time()
    tokenizer = build_tokenizer()  # the testbed's tokenizer, rebuilt (identical by construction)
    model = AutoModelForCausalLM.from_pretrained(bed.model_dir, dtype=torch.float32).eval()
    neutral_id = tokenizer.encode(" ", add_special_tokens=False)[0] if neutral == "space" else tokenizer.pad_token_id

    import pandas as pd

    val = pd.read_parquet(bed.val_file)
    rows = [val.iloc[i % len(val)] for i in range(samples)]
    prompts = [r["extra_info"]["question"] for r in rows]
    truths = [str(r["reward_model"]["ground_truth"]) for r in rows]
    sampled = sample_responses(model, tokenizer, prompts, seed=seed, max_new_tokens=max_response_tokens(bed.spec))
    texts = [tokenizer.decode(r, skip_special_tokens=True) for _, r in sampled]

    def correct(text: str, truth: str) -> bool:
        span = find_answer_span(text)
        return span is not None and text[span.start : span.end].strip() == truth

    sampled_accuracy = sum(correct(t, s) for t, s in zip(texts, truths)) / len(texts)
    batch, skipped = make_batch(sampled, truths, tokenizer)

    scores, seconds = all_scores(model, batch, neutral_id, seed)
    estimators = measure(model, tokenizer, batch, scores, fracs, neutral_id=neutral_id, seed=seed)
    for name in ESTIMATORS:
        estimators[name]["seconds"] = seconds[name]
    report = {
        "config": {"workdir": str(bed.root), "samples": samples, "seed": seed, "fracs": list(fracs),
                   "neutral": neutral, "neutral_id": neutral_id,
                   "seeds": {"sampling": seed, "oar_g_noise": seed + 1, "random": seed + 2,
                             "tie_breaking": seed + 3}},
        "testbed": {"spec": bed.manifest["spec"], "warm_start": bed.manifest["warm_start"],
                    "val_samples": bed.manifest["val_samples"]},
        "samples": {"total": samples, "counted": int(batch.ids.shape[0]), "skipped": skipped,
                    "sampled_accuracy": sampled_accuracy,
                    "mean_reasoning_tokens": float(batch.oracle["reasoning"].sum(1).float().mean()),
                    "mean_causal_tokens": float(batch.oracle["causal"].sum(1).float().mean())},
        "expected_random_recall": {str(f): v for f, v in expected_random_recall(batch, fracs).items()},
        "estimators": estimators,
        "seconds": round(time.time() - start, 1),
    }
    return QualityResult(report, batch, scores, tokenizer)


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--testbed", default=None, help="a testbed directory (default: the committed one)")
    parser.add_argument("--samples", type=int, default=48, help="responses sampled (one per val prompt)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fracs", default="0.05,0.1,0.2", help="top fractions K%% of the reasoning tokens")
    parser.add_argument("--neutral", choices=("space", "pad"), default="space", help="occlusion token (docstring, 1)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    fracs = [float(f) for f in args.fracs.split(",")]
    if args.samples < 1 or not all(0 < f <= 1 for f in fracs):
        parser.error("--samples must be >= 1 and every --fracs value in (0, 1]")
    bed = committed_testbed() if args.testbed is None else load_testbed(args.testbed)
    report = run_quality(bed, samples=args.samples, seed=args.seed, fracs=fracs,
                         neutral=args.neutral).report
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
