"""OAR-P ``hierarchical`` mode against ``chunk`` and ``exact``: how much of exact mode's ranking does it
recover, for how many occluded copies (``verl_oar.core.perturbation.hierarchical_importance``).

    python benchmarks/hierarchical_quality.py [--testbed DIR] [--samples 48] [--long-lengths 256,512,1024]
        [--long-per-length 8] [--budgets 4,8,16,32,64] [--tops 1,2,4,8] [--units 1,2,4]
        [--chunks 4,8,16,32,64,128,256] [--seed 0] [--out benchmarks/results_hierarchical_quality_cpu.json]
        [--plot FILE.png]

Model: by default the committed pick_max testbed model (``verl_oar/testbed/start/model``: a 2-layer Qwen2, hidden
64, byte tokenizer, trained on ~75-token sequences, context 256); with ``--testbed DIR`` the model, tokenizer and
val prompts of that built testbed (``fast_runner.load_bed``), e.g. ``verl_oar/testbed/variants/fill32`` (same
shape and tokenizer, 32 filler words per gap, warm-started on ~400-token responses, context 512). float32, one
thread. Outcome AS-MEAN, neutral token a space (as ``verl_oar.testbed.quality``: the pad token's embedding is
untrained), temperature 1.

Sequences:

(a) ``testbed``: ``--samples`` val prompts, one response each sampled at temperature 1 (``sample_responses``,
    seed ``--seed``), reasoning and answer tokens from the response text (``pick_max.oracle_batch``), exactly
    as ``verl_oar.testbed.quality`` builds them (R ~ 27 reasoning tokens on the start, ~ 390 on fill32).
(b) ``long``: ``--long-per-length`` sequences per target length R in ``--long-lengths``: a pick_max prompt of
    two random pairs and a warm-start-format response (filler words, repeat probability 0.15, the two picks at
    the ends of the first and second third) stretched to about R reasoning tokens, then ``\\boxed{..}``. The
    committed start model was trained on ~75-token sequences (positions < 256): at these lengths it no longer
    solves the task (its answer probability falls to ~1e-4) and its exact importance is no longer on the
    picks, but it is still a trained network's heavy-tailed occlusion ranking over R ~ 256-1024 tokens,
    which is what is measured here: agreement with exact mode, not causality. With ``--testbed`` a length
    is skipped (and listed under ``long_skipped``) when its sequences do not fit the model's context
    (``max_position_embeddings``) or are no longer than the testbed's own responses (``max_response_tokens``):
    on fill32 every default length is skipped, and family (a) is the long measurement on a model trained on
    those lengths (there its answer follows its picks: the report's ``answer_prob``).

Per family, whether exact importance lands on the picks: ``exact_top2_are_picks`` = the share of sequences
with exactly two pick tokens (the ``causal`` oracle of family (a); the two digits placed in (b)) whose two
highest exact importances are those two tokens (per configuration, ``top2_are_picks``: the same share for
the method's importances); ``answer_prob`` = the clean probability of the answer tokens
(their product); ``correct`` = the share whose answer is the right one.

Per configuration and sequence: ``passes`` = occluded copies / R (exact = 1; the clean pass not counted);
``recall@f`` = the fraction of exact mode's top-f tokens (``core.token_ranking.top_fraction_mask``, ties broken
by a seeded random permutation) that are in the method's top-f; ``mass@0.1`` = the same recall weighted by
|exact importance| (the share of the top-10%'s |importance| that the method's top-10% holds: on fill32 the two
picks carry a median 99.7% of all |importance| and the other ~37 tokens of the top 10% are ~1e-5..1e-2 of a pick, so
recall@0.1 there is mostly agreement on near-zero tokens); ``spearman`` = rank correlation with exact
over the reasoning tokens (average ranks for ties). Summaries over sequences: mean with a 95% bootstrap CI
(2000 resamples), median, and the share of sequences with recall@0.1 >= 0.95.

Methods: ``exact``; ``chunk`` K for K in ``--chunks`` (every token carries its chunk's importance);
``hierarchical`` K/m/u for K in ``--budgets``, m in ``--tops`` (m <= K), u in ``--units``, with each way of
scoring unrefined tokens (``core.perturbation.FILLS``). Compute is shared: the scorer caches every occlusion
(a span's importance depends only on its token set), so a refined single-token unit reuses exact mode's
pass, and scores the occlusions it has not seen through the batched path (all sequences' new spans in one
``batched_perturbation_importance``); the costs reported are what each configuration scores on its own
(``HierarchicalStats.occlusions``).
``target`` per family: the configurations at mean passes <= 0.1, the best chunk and hierarchical one by mean
recall@0.1, and whether one reaches mean recall@0.1 >= 0.95 (``TARGET``).

fill32 (``--testbed verl_oar/testbed/variants/fill32 --long-lengths '' --samples 48``;
``results_hierarchical_quality_fill32_cpu.json``, 686 s on 2 shared cores): R = 388 on every response, inside
the model's context and at the length it was trained on; its answer follows its picks (answer probability
0.999; 40% of the sampled answers right: the warm start picks the larger digit ~47% of the time) and exact's top 2 are the two picks on 46/48 sequences (the other 2: both picks the same
digit, so either copy stands in for the other), which hold 98% of all |importance| (mean; median 99.7%).
At <= 0.1 R copies no configuration reaches recall@0.1 0.95 (best hierarchical K=8 m=2 u=4 share 0.359
[0.334, 0.383], best chunk K=32 0.292 [0.277, 0.306]; no sequence >= 0.95), though both hold the picks in their
top 10% (mass@0.1 0.996); singling out both picks takes single-token refinement: K=32 m=2 u=1, 0.144 R, 45/48.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from verl_oar.core.hf import HFRowsModel
from verl_oar.core.outcome import padded_predicting_positions
from verl_oar.core.perturbation import (
    FILLS,
    PerturbationConfig,
    Sample,
    batched_perturbation_importance,
    hierarchical_importance,
    occlusion_spans,
)
from verl_oar.core.token_ranking import top_fraction_mask
from verl_oar.testbed.machine import machine_info

FRACS = (0.05, 0.1, 0.2)
TARGET = {"recall@0.1": 0.95, "passes": 0.1}
MAX_TOKENS = 8192


class Sequence_:
    """One scored sequence: ids (L,) long, positions, predicting positions, reasoning / answer / picks (L,) bool
    masks (picks: the pick digits, the tokens the answer depends on), whether the answer is right."""

    def __init__(self, ids, reasoning, answer, family: str, picks=None, correct: bool | None = None):
        self.ids = ids
        self.positions = torch.arange(ids.numel())
        self.reasoning = reasoning
        self.answer = answer
        self.predict = padded_predicting_positions(ids[None], answer[None])[0][0]
        self.family = family
        self.R = int(reasoning.sum())
        self.picks = picks
        self.correct = correct


class CachedScorer:
    """``score_spans`` over ``batched_perturbation_importance``, caching every occlusion: each call scores the
    spans no earlier call scored, of all sequences in one batched pass."""

    def __init__(self, model, sequences, neutral_id: int, cfg: PerturbationConfig):
        self.model = HFRowsModel(model, pad_id=neutral_id)
        self.sequences = sequences
        self.neutral_id = neutral_id
        self.cfg = cfg
        self.cache: list[dict[tuple[int, ...], float]] = [{} for _ in sequences]
        self.computed = 0

    def __call__(self, spans):
        keys, todos, samples = [], [], []
        for seq, cache, span in zip(self.sequences, self.cache, spans, strict=True):
            num = int(span.max()) + 1 if span.numel() else 0
            keys.append([tuple((span == s).nonzero().squeeze(1).tolist()) for s in range(num)])
            todos.append([s for s in range(num) if keys[-1][s] not in cache])
            sub = torch.full_like(span, -1)
            for j, s in enumerate(todos[-1]):  # span ids are in position order, so todo is too
                sub[span == s] = j
            first = seq.reasoning.nonzero()
            samples.append(Sample(seq.ids, seq.positions, sub, seq.predict,
                                  prompt_len=int(first[0]) if first.numel() else 0))
        if any(todos):
            importance, _, cost = batched_perturbation_importance(self.model, samples, self.neutral_id, self.cfg,
                                                                  MAX_TOKENS)
            self.computed += cost.copies
            for cache, key, todo, sample, imp in zip(self.cache, keys, todos, samples, importance, strict=True):
                for j, s in enumerate(todo):
                    cache[key[s]] = float(imp[sample.span == j][0])
        out = []
        for cache, key, span in zip(self.cache, keys, spans, strict=True):
            scored = torch.zeros(span.shape, dtype=torch.float32)
            for s in range(len(key)):
                scored[span == s] = cache[key[s]]
            out.append(scored)
        return out


def rankdata(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share their mean rank)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = rankdata(a), rankdata(b)
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def sequence_measures(method: torch.Tensor, exact: torch.Tensor, seq: Sequence_, seed: int) -> dict:
    out = {}
    for f in FRACS:
        want = top_fraction_mask(exact, seq.reasoning, f, torch.Generator().manual_seed(seed))
        got = top_fraction_mask(method, seq.reasoning, f, torch.Generator().manual_seed(seed))
        out[f"recall@{f}"] = float((want & got).sum()) / float(want.sum())
        if f == 0.1:
            weight = exact.double().abs()
            total = float(weight[want].sum())
            out["mass@0.1"] = float(weight[want & got].sum()) / total if total > 0 else 1.0
    out["spearman"] = spearman(method[seq.reasoning].double().numpy(), exact[seq.reasoning].double().numpy())
    return out


def summarise(values: list[float], rng: np.random.Generator) -> dict:
    v = np.asarray(values, dtype=float)
    boots = rng.choice(v, size=(2000, len(v)), replace=True).mean(1)
    return {"mean": round(float(v.mean()), 4), "ci95": [round(float(np.quantile(boots, 0.025)), 4),
                                                       round(float(np.quantile(boots, 0.975)), 4)],
            "median": round(float(np.median(v)), 4)}


# ---------------------------------------------------------------------------------------------------
# Sequences
# ---------------------------------------------------------------------------------------------------


def testbed_sequences(model, tokenizer, bed, samples: int, seed: int) -> list[Sequence_]:
    import pandas as pd

    from verl_oar.testbed.quality import make_batch
    from verl_oar.testbed.workspace import max_response_tokens, sample_responses

    val = pd.read_parquet(bed.val_file)
    rows = [val.iloc[i % len(val)] for i in range(samples)]
    sampled = sample_responses(model, tokenizer, [r["extra_info"]["question"] for r in rows], seed=seed,
                               max_new_tokens=max_response_tokens(bed.spec))
    batch, _ = make_batch(sampled, [str(r["reward_model"]["ground_truth"]) for r in rows], tokenizer)
    reasoning, answer = batch.to_full(batch.oracle["reasoning"]), batch.to_full(batch.oracle["answer"])
    picks = batch.to_full(batch.oracle["causal"])
    out = []
    for b in range(batch.ids.shape[0]):
        n = int(batch.attention[b].sum())
        text = tokenizer.decode(batch.ids[b, :n][answer[b, :n]].tolist(), skip_special_tokens=True)
        correct = text.replace(" ", "") == batch.truths[b].replace(" ", "")
        out.append(Sequence_(batch.ids[b, :n], reasoning[b, :n], answer[b, :n], "testbed", picks[b, :n], correct))
    return out


def long_sequences(tokenizer, lengths: list[int], per_length: int, seed: int) -> list[Sequence_]:
    from verl_oar.testbed.pick_max import filler_gap
    from verl_oar.testbed.workspace import chat_prompt_ids

    rng = random.Random(f"{seed}/long")
    out = []
    for target in lengths:
        for _ in range(per_length):
            pairs = [tuple(rng.sample(range(10), 2)) for _ in range(2)]
            picks = [max(p) for p in pairs]
            words = max(1, round(target / 3 / 4))  # three gaps of `words` 3-letter words and a space each
            items = filler_gap(words, 3, rng, 0.15)
            pick_items = []
            for pick in picks:
                pick_items.append(len(items))
                items += [str(pick), *filler_gap(words, 3, rng, 0.15)]
            reasoning_text = " ".join(items) + " "
            pick_chars = [len(" ".join(items[:i])) + (i > 0) for i in pick_items]
            answer_text = "".join(map(str, picks))
            prompt = chat_prompt_ids(tokenizer, "max: " + " | ".join(f"{a} {b}" for a, b in pairs))
            r_ids = tokenizer.encode(reasoning_text, add_special_tokens=False)
            box = tokenizer.encode("\\boxed{", add_special_tokens=False)
            a_ids = tokenizer.encode(answer_text, add_special_tokens=False)
            tail = tokenizer.encode("}", add_special_tokens=False) + [tokenizer.eos_token_id]
            ids = torch.tensor(prompt + r_ids + box + a_ids + tail)
            reasoning = torch.zeros(ids.numel(), dtype=torch.bool)
            reasoning[len(prompt) : len(prompt) + len(r_ids)] = True
            answer = torch.zeros(ids.numel(), dtype=torch.bool)
            start = len(prompt) + len(r_ids) + len(box)
            answer[start : start + len(a_ids)] = True
            pick_mask = None
            if len(r_ids) == len(reasoning_text):  # one token per character (the byte tokenizer)
                pick_mask = torch.zeros(ids.numel(), dtype=torch.bool)
                pick_mask[[len(prompt) + c for c in pick_chars]] = True
            out.append(Sequence_(ids, reasoning, answer, f"long{target}", pick_mask, True))
    return out


def fitting_long(sequences: list[Sequence_], context: int, own_tokens: int) -> tuple[list[Sequence_], dict]:
    """The long sequences a ``--testbed`` run keeps: within the model's ``context`` (tokens) and longer in R
    than the testbed's own responses (``own_tokens``); the skipped lengths with the reason."""
    keep, skipped = [], {}
    for s in sequences:
        if s.ids.numel() > context:
            skipped[s.family] = f"{s.ids.numel()} tokens > the model's context {context}"
        elif s.R <= own_tokens:
            skipped[s.family] = f"R {s.R} <= the testbed's own responses ({own_tokens} tokens): family testbed"
        else:
            keep.append(s)
    return keep, skipped


# ---------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------


@torch.no_grad()
def answer_prob(model, seq: Sequence_) -> float:
    """Clean probability of the answer tokens (product over them), plain transformers forward."""
    logp = torch.log_softmax(model(seq.ids[None]).logits[0].double(), -1)
    at = seq.answer.nonzero().squeeze(1)
    return float(logp[at - 1, seq.ids[at]].sum().exp())


def top2_are_picks(exact: torch.Tensor, seq: Sequence_) -> bool | None:
    """Whether the two highest importances (``exact`` or a method's) over the reasoning are the two pick tokens (None unless the
    sequence has exactly two; a tie at the second place counts as not)."""
    if seq.picks is None or int((seq.picks & seq.reasoning).sum()) != 2:
        return None
    values = exact[seq.reasoning]
    top = torch.sort(values, descending=True).values
    if values.numel() > 2 and top[1] == top[2]:
        return False
    return bool(values[seq.picks[seq.reasoning]].min() >= top[1])


def target_summary(rows: list[dict]) -> dict:
    """Configurations at mean passes <= TARGET["passes"]: the best chunk and hierarchical one by mean recall@0.1,
    and whether any reaches TARGET["recall@0.1"]."""
    cheap = [r for r in rows if r["method"] != "exact" and r["passes"]["mean"] <= TARGET["passes"]]
    out = {"configurations": len(cheap)}
    for method in ("chunk", "hierarchical"):
        mine = [r for r in cheap if r["method"] == method]
        if mine:
            best = max(mine, key=lambda r: r["recall@0.1"]["mean"])
            out[f"best_{method}"] = {"label": label(best), "passes": best["passes"]["mean"],
                                     "recall@0.1": best["recall@0.1"],
                                     "share_recall@0.1>=0.95": best["share_recall@0.1>=0.95"],
                                     "mass@0.1": best["mass@0.1"], "top2_are_picks": best["top2_are_picks"]}
    out["met"] = any(r["recall@0.1"]["mean"] >= TARGET["recall@0.1"] for r in cheap)
    return out


def measure_family(model, sequences, neutral_id, args, rng) -> dict:
    cfg = PerturbationConfig(outcome="mean")
    scorer = CachedScorer(model, sequences, neutral_id, cfg)
    start = time.perf_counter()
    exact = scorer([occlusion_spans(s.reasoning, "exact", 1) for s in sequences])
    exact_seconds = time.perf_counter() - start
    rows: list[dict] = []
    extra_rng = np.random.default_rng(args.seed + 11)  # the measures added later bootstrap on their own generator,
    # so the rows' other CIs stay those of the runs before they existed

    def add(method: str, params: dict, scores, passes) -> None:
        per = [sequence_measures(m, e, s, args.seed + 3) for m, e, s in zip(scores, exact, sequences)]
        row = {"method": method, **params}
        row["passes"] = summarise([p / s.R for p, s in zip(passes, sequences)], rng)
        for key in per[0]:
            row[key] = summarise([p[key] for p in per], extra_rng if key == "mass@0.1" else rng)
        row["share_recall@0.1>=0.95"] = round(float(np.mean([p["recall@0.1"] >= 0.95 for p in per])), 4)
        on_picks = [v for v in (top2_are_picks(m, s) for m, s in zip(scores, sequences)) if v is not None]
        row["top2_are_picks"] = round(float(np.mean(on_picks)), 4) if on_picks else None
        rows.append(row)

    add("exact", {}, exact, [s.R for s in sequences])
    for k in args.chunks:
        add("chunk", {"K": k}, scorer([occlusion_spans(s.reasoning, "chunk", k) for s in sequences]),
            [min(k, s.R) for s in sequences])
    for k in args.budgets:
        for m in (t for t in args.tops if t <= k):
            for u in args.units:
                hcfg = PerturbationConfig(outcome="mean", mode="hierarchical", budget=k, refine_top=m, refine_unit=u)
                for fill in FILLS:
                    scores, stats = hierarchical_importance(scorer, [s.reasoning for s in sequences], hcfg, fill=fill)
                    add("hierarchical", {"K": k, "m": m, "u": u, "fill": fill}, scores, stats.occlusions)
    on_picks = [top2_are_picks(e, s) for e, s in zip(exact, sequences)]
    on_picks = [v for v in on_picks if v is not None]
    return {
        "sequences": len(sequences),
        "exact_top2_are_picks": {"share": round(float(np.mean(on_picks)), 4) if on_picks else None,
                                 "sequences": len(on_picks)},
        # its own bootstrap generator: the rows' CIs stay those of the runs before this measure existed
        "answer_prob": summarise([answer_prob(model, s) for s in sequences], np.random.default_rng(args.seed + 7)),
        "correct": round(float(np.mean([bool(s.correct) for s in sequences])), 4),
        "reasoning_tokens": summarise([s.R for s in sequences], rng),
        "reasoning_tokens_range": [min(s.R for s in sequences), max(s.R for s in sequences)],
        "exact_seconds": round(exact_seconds, 1),
        "copies_computed": scorer.computed,
        "rows": rows,
    }


def frontier(rows: list[dict], key: str = "recall@0.1") -> list[dict]:
    """Rows not dominated in (mean passes lower, mean recall higher)."""
    pts = sorted(rows, key=lambda r: (r["passes"]["mean"], -r[key]["mean"]))
    out, best = [], -1.0
    for r in pts:
        if r[key]["mean"] > best:
            out.append(r)
            best = r[key]["mean"]
    return out


def label(row: dict) -> str:
    if row["method"] == "exact":
        return "exact"
    if row["method"] == "chunk":
        return f"chunk K={row['K']}"
    return f"hier K={row['K']} m={row['m']} u={row['u']} {row['fill']}"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = list(report["families"])
    fig, axes = plt.subplots(1, len(families), figsize=(6.5 * len(families), 5), squeeze=False)
    markers = {1: "o", 2: "s", 4: "^", 8: "D"}
    for ax, fam in zip(axes[0], families):
        rows = report["families"][fam]["rows"]
        ch = [r for r in rows if r["method"] == "chunk"]
        ax.plot([r["passes"]["mean"] for r in ch], [r["recall@0.1"]["mean"] for r in ch], "k.-", label="chunk K")
        for u in sorted({r["u"] for r in rows if r["method"] == "hierarchical"}):
            hs = [r for r in rows if r["method"] == "hierarchical" and r["u"] == u and r["fill"] == "share"]
            ax.scatter([r["passes"]["mean"] for r in hs], [r["recall@0.1"]["mean"] for r in hs],
                       marker=markers.get(u, "x"), label=f"hierarchical u={u} (share)", alpha=0.8)
        hs = [r for r in rows if r["method"] == "hierarchical" and r["fill"] == "span"]
        ax.scatter([r["passes"]["mean"] for r in hs], [r["recall@0.1"]["mean"] for r in hs], marker="x",
                   color="grey", alpha=0.5, label="hierarchical (span fill)")
        ax.scatter([1.0], [1.0], marker="*", s=150, color="red", label="exact")
        ax.axvline(TARGET["passes"], color="red", lw=0.8, ls="--")
        ax.axhline(TARGET["recall@0.1"], color="red", lw=0.8, ls="--")
        ax.set_xscale("log")
        ax.set_xlabel("occluded copies per sequence / R (mean)")
        ax.set_ylabel("recall of exact's top-10% (mean)")
        rt = report["families"][fam]["reasoning_tokens_range"]
        ax.set_title(f"{fam}: {report['families'][fam]['sequences']} sequences, R {rt[0]}-{rt[1]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--testbed", default=None,
                        help="a built testbed folder (model, tokenizer, val prompts; e.g. "
                             "verl_oar/testbed/variants/fill32); default: the committed start")
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--long-lengths", default="256,512,1024")
    parser.add_argument("--long-per-length", type=int, default=8)
    parser.add_argument("--budgets", default="4,8,16,32,64")
    parser.add_argument("--tops", default="1,2,4,8")
    parser.add_argument("--units", default="1,2,4")
    parser.add_argument("--chunks", default="4,8,16,32,64,128,256")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results_hierarchical_quality_cpu.json")
    parser.add_argument("--plot", default="benchmarks/hierarchical_quality_frontier_cpu.png")
    parser.add_argument("--print-fills", action="store_true", help="print every fill's rows (default: share only)")
    args = parser.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",") if x]
    args.budgets, args.tops, args.units, args.chunks = map(ints, (args.budgets, args.tops, args.units, args.chunks))
    lengths = ints(args.long_lengths)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_oar.cpu.workspace import build_tokenizer
    from verl_oar.testbed.fast_runner import load_bed
    from verl_oar.testbed.workspace import committed_testbed, max_response_tokens

    torch.set_num_threads(1)
    start = time.time()
    if args.testbed is None:
        bed, tokenizer = committed_testbed(), build_tokenizer()
    else:
        bed = load_bed(args.testbed)
        tokenizer = AutoTokenizer.from_pretrained(bed.model_dir)
    model = AutoModelForCausalLM.from_pretrained(bed.model_dir, dtype=torch.float32).eval()
    context = int(model.config.max_position_embeddings)
    neutral_id = tokenizer.encode(" ", add_special_tokens=False)[0]
    rng = np.random.default_rng(args.seed)
    families = {}
    if args.samples > 0:
        families["testbed"] = measure_family(model, testbed_sequences(model, tokenizer, bed, args.samples, args.seed),
                                             neutral_id, args, rng)
        print(f"testbed done {time.time() - start:.0f}s", file=sys.stderr)
    long_skipped: dict[str, str] = {}
    if lengths and args.long_per_length > 0:
        longs = long_sequences(tokenizer, lengths, args.long_per_length, args.seed)
        if args.testbed is not None:
            longs, long_skipped = fitting_long(longs, context, max_response_tokens(bed.spec))
            for fam, why in long_skipped.items():
                print(f"skipping {fam}: {why}", file=sys.stderr)
        if longs:
            families["long"] = measure_family(model, longs, neutral_id, args, rng)
            print(f"long done {time.time() - start:.0f}s", file=sys.stderr)
    for fam in families.values():
        fam["frontier_recall@0.1"] = [label(r) for r in frontier(fam["rows"])]
        fam["target"] = target_summary(fam["rows"])
    cfg = model.config
    try:
        where = str(bed.root.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        where = str(bed.root)
    report = {
        "command": "python " + shlex.join(["benchmarks/hierarchical_quality.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "model": f"{where}/model ({cfg.num_hidden_layers}-layer Qwen2, hidden {cfg.hidden_size}, byte tokenizer, "
                 f"context {context}), float32, 1 thread",
        "testbed": {"dir": where, "fingerprint": bed.manifest.get("fingerprint"),
                    "filler_words": bed.spec.filler_words, "max_response_tokens": max_response_tokens(bed.spec),
                    "context": context},
        "long_skipped": long_skipped,
        "outcome": "mean", "neutral": "space", "fracs": list(FRACS), "target": TARGET,
        "seconds": round(time.time() - start, 1),
        "families": families,
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot(report, Path(args.plot))
    for name, fam in families.items():
        print(f"\n== {name}: {fam['sequences']} sequences, R {fam['reasoning_tokens_range']}, answer prob "
              f"{fam['answer_prob']['mean']:.3f} (median {fam['answer_prob']['median']:.3f}), correct {fam['correct']:.2f}, "
              f"exact top-2 = the picks {fam['exact_top2_are_picks']['share']} "
              f"(of {fam['exact_top2_are_picks']['sequences']})")
        print(f"{'method':<40} {'passes/R':>9} {'rec@.1':>7} {'95% CI':>15} {'rho':>6} {'>=.95':>6} {'mass':>6} "
              f"{'picks':>6}")
        for r in fam["rows"]:
            if r["method"] == "hierarchical" and r["fill"] not in ("share",) and not args.print_fills:
                continue
            ci = r["recall@0.1"]["ci95"]
            print(f"{label(r):<40} {r['passes']['mean']:>9.3f} {r['recall@0.1']['mean']:>7.3f} "
                  f"{f'[{ci[0]:.3f}, {ci[1]:.3f}]':>15} {r['spearman']['mean']:>6.3f} {r['share_recall@0.1>=0.95']:>6.2f} "
                  f"{r['mass@0.1']['mean']:>6.3f} {'-' if r['top2_are_picks'] is None else format(r['top2_are_picks'], '.2f'):>6}")
        t = fam["target"]
        for method in ("chunk", "hierarchical"):
            if f"best_{method}" in t:
                b = t[f"best_{method}"]
                print(f"best {method} at passes <= {TARGET['passes']}: {b['label']} passes {b['passes']:.3f} "
                      f"recall@0.1 {b['recall@0.1']['mean']:.3f} {b['recall@0.1']['ci95']} share>=.95 "
                      f"{b['share_recall@0.1>=0.95']:.2f} mass@0.1 {b['mass@0.1']['mean']:.3f} top-2 = picks "
                      f"{b['top2_are_picks']}")
        print(f"target (recall@0.1 >= {TARGET['recall@0.1']} at passes <= {TARGET['passes']}): "
              f"{'met' if t['met'] else 'not met'}")
    return report


if __name__ == "__main__":
    main()
