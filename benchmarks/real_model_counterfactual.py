"""The counterfactual test of importance on a real model's own text (SmolLM2-135M-Instruct, Q4_1 dequantized, fp32):
which response tokens each ranking puts on top, and how much removing them lowers the answer's log-probability.

    python benchmarks/real_model_counterfactual.py sample --responses 120     # the model's own responses (resumable)
    python benchmarks/real_model_counterfactual.py score [--limit 20]        # rankings and edits, per response
    python benchmarks/real_model_counterfactual.py worked --problems 60      # teacher-forced worked solutions
    python benchmarks/real_model_counterfactual.py collect       # the results JSON, the figure, the docs' tables

Every step appends to its file under ``--store`` (default: the folder ``real_model_counterfactual`` beside this
script, committed) and skips what is there, so it runs in blocks and resumes.

``sample``: the real-model task's problems (``verl_oar.real_model.launch.TASK``: ``sum1`` with one worked example,
train and test), sampled at temperature 1 (no top-k / top-p) up to 128 new tokens, one torch thread, seeds by
batch; a response is kept when the training worker finds its answer (``tools.heatmap.make_sample``: the
re-encoded text, its reasoning and answer tokens) and it has at least 3 reasoning tokens; the rest are counted.
Each kept response is graded by the package's math reward (right or wrong: both kept).

``score``: per kept response, the rankings of ``verl_oar.real_model.counterfactual`` in fp32 and the four OAR
rankings again in bf16 (the model cast, as a bf16 run holds it); the edits (delete, or replace by OAR-P's neutral
token, the top 5, 10 and 20% of the reasoning tokens of each fp32 ranking) scored by the fp32 model; every
token's category. ``worked``: solutions of 2- to 4-step word problems with filler sentences
(``data.worked_solutions``) after the same prompt, teacher-forced; per ranking, the recall of the labelled results
in its top 5, 10 and 20%.

``collect``: means over responses with 95% bootstrap intervals (10,000 resamples, seed 0, nearest rank;
``testbed.measures``), each ranking's answer change paired against the random ranking's (signed, and its size
``|change|``: OAR's importance is a divergence, blind to the direction), the categories of the top
10% against their share of all reasoning tokens, the bf16 rankings' agreement with fp32 (top-10% overlap,
Spearman), and the worked solutions' recall. ``--table`` prints docs/real-model.md's tables from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORE = ROOT / "benchmarks" / "real_model_counterfactual"
MIN_REASONING = 3
TOP = 0.10
NAMES = {"oar_p_exact": "OAR-P exact", "oar_p_chunk": "OAR-P chunk (K=16)", "oar_g": "OAR-G",
         "oar_g_loglik": "OAR-G log-lik.", "entropy": "entropy", "random": "random"}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _mine(index: int, args) -> bool:
    """Whether this process scores item ``index`` (``--shard I/N``: the items whose index is I modulo N)."""
    i, n = (int(x) for x in args.shard.split("/"))
    return index % n == i


def _append(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _load(dtype_name: str = "float32"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_oar.tools.prepare_model import prepare

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    folder = prepare("smollm2", log=lambda _: None)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype_name)).eval()
    return folder, tokenizer, model


def _problems():
    from verl_oar.data.arithmetic import problems
    from verl_oar.real_model.launch import TASK

    return [(split, p) for split in ("train", "test") for p in problems(TASK, split)]


def _numbers(arithmetic: str) -> list[int]:
    return [int(x) for x in arithmetic.replace("-", "+").split("+")]


def cmd_sample(args) -> None:
    from verl_oar.data.arithmetic import prompt_text
    from verl_oar.real_model.launch import TASK
    from verl_oar.real_model.sampling import generate
    from verl_oar.rewards.math_reward import compute_score
    from verl_oar.tools.heatmap import HeatmapInputError, make_sample

    path, skipped_path = args.store / "responses.jsonl", args.store / "sampling.json"
    kept = _jsonl(path)
    counts = json.loads(skipped_path.read_text()) if skipped_path.exists() else {"batches": 0, "sampled": 0,
                                                                                 "no_answer": 0, "short": 0}
    _, tokenizer, model = _load()
    problems = _problems()
    while len(kept) < args.responses:
        batch = counts["batches"]
        chosen = [problems[(batch * args.batch + i) % len(problems)] for i in range(args.batch)]
        prompts = [prompt_text(p.question, TASK.example, TASK.brief, TASK.answer) for _, p in chosen]
        began = time.time()
        texts = generate(model, tokenizer, prompts, samples=1, greedy=False, max_new_tokens=128, seed=1000 + batch,
                         batch=args.batch)
        for (split, p), prompt, (text, n_tokens, cut) in zip(chosen, prompts, texts):
            counts["sampled"] += 1
            try:
                s = make_sample(0, [{"role": "user", "content": prompt}], text, tokenizer, chat_template=True)
            except HeatmapInputError:
                counts["no_answer"] += 1
                continue
            if sum(s.reasoning) < MIN_REASONING:
                counts["short"] += 1
                continue
            score = compute_score("verl_oar/arithmetic", text, str(p.answer))["score"]
            record = {"index": len(kept), "batch": batch, "split": split, "question": p.question,
                      "arithmetic": p.arithmetic, "answer": p.answer, "prompt": prompt, "response": text,
                      "sampled_tokens": n_tokens, "cut": cut, "score": score}
            kept.append(record)
            _append(path, record)
        counts["batches"] += 1
        skipped_path.write_text(json.dumps(counts, indent=1) + "\n")
        print(f"[sample] batch {batch}: {len(kept)} kept of {counts['sampled']} ({time.time() - began:.0f} s)",
              flush=True)


def _round(row) -> list[float]:
    return [float(f"{v:.4g}") for v in row.tolist()]


def cmd_score(args) -> None:
    import torch

    from verl_oar.core.config import OARConfig, neutral_token_id
    from verl_oar.real_model import counterfactual as cf
    from verl_oar.tools.heatmap import make_sample

    done = {r["index"] for r in _jsonl(args.store / "scores.jsonl")}
    todo = [r for r in _jsonl(args.store / "responses.jsonl") if r["index"] not in done and _mine(r["index"], args)]
    todo = todo[: args.limit]
    if not todo:
        print("[score] nothing left to score")
        return
    _, tokenizer, model = _load()
    half = _load("bfloat16")[2]
    neutral = neutral_token_id(OARConfig(), tokenizer)
    for r in todo:
        began = time.time()
        s = make_sample(r["index"], [{"role": "user", "content": r["prompt"]}], r["response"], tokenizer, True)
        scores = cf.rankings(model, s, neutral_id=neutral, seed=r["index"], tokenizer=tokenizer)
        half_scores = cf.rankings(half, s, neutral_id=neutral, seed=r["index"], names=cf.IMPORTANCE_RANKINGS,
                                  tokenizer=tokenizer)
        changes = cf.answer_change(model, s, scores, neutral_id=neutral, seed=r["index"])
        reasoning = torch.tensor(s.reasoning)
        record = {
            "index": r["index"], "score": r["score"], "tokens": len(s.response_ids),
            "reasoning_tokens": int(reasoning.sum()), "answer_tokens": sum(s.answer),
            "categories": cf.token_categories(s.response_ids, tokenizer, _numbers(r["arithmetic"])),
            "reasoning": s.reasoning,
            "scores": {k: _round(v) for k, v in scores.items()},
            "bf16_scores": {k: _round(v) for k, v in half_scores.items()},
            "bf16_agreement": {k: {"top10_overlap": cf.top_overlap(scores[k], half_scores[k], reasoning, TOP,
                                                                   r["index"]),
                                   "spearman": cf.spearman(scores[k], half_scores[k], reasoning)}
                               for k in cf.IMPORTANCE_RANKINGS},
            "answer_change": {k: {e: {str(f): v for f, v in d.items()} for e, d in by_edit.items()}
                              for k, by_edit in changes.items()},
            "seconds": round(time.time() - began, 1),
        }
        _append(args.store / "scores.jsonl", record)
        print(f"[score] response {r['index']}: {record['tokens']} tokens, {record['seconds']} s", flush=True)


def cmd_worked(args) -> None:
    import torch

    from verl_oar.core.config import OARConfig, neutral_token_id
    from verl_oar.core.token_ranking import recall_at
    from verl_oar.data.arithmetic import prompt_text
    from verl_oar.data.worked_solutions import worked_solutions
    from verl_oar.real_model import counterfactual as cf
    from verl_oar.real_model.launch import TASK
    from verl_oar.tools.heatmap import make_sample

    path = args.store / "worked.jsonl"
    done = {r["index"] for r in _jsonl(path)}
    problems = [(i, p) for i, p in enumerate(worked_solutions(args.problems, seed=0)) if i not in done
                and _mine(i, args)]
    if not problems:
        print("[worked] nothing left to score")
        return
    _, tokenizer, model = _load()
    neutral = neutral_token_id(OARConfig(), tokenizer)
    for i, p in problems:
        began = time.time()
        prompt = prompt_text(p.question, TASK.example, TASK.brief, TASK.answer)
        s = make_sample(i, [{"role": "user", "content": prompt}], p.solution, tokenizer, True)
        labelled = cf.labelled_tokens(s.response_ids, tokenizer, p.results, p.solution)
        reasoning = torch.tensor(s.reasoning)
        scores = cf.rankings(model, s, neutral_id=neutral, seed=i, tokenizer=tokenizer)
        recall = {k: {str(f): v for f, v in recall_at(row, reasoning, labelled, cf.FRACS,
                                                        torch.Generator().manual_seed(i)).items()}
                  for k, row in scores.items()}
        _append(path, {"index": i, "steps": len(p.results), "tokens": len(s.response_ids),
                       "reasoning_tokens": int(reasoning.sum()), "labelled_tokens": int(labelled.sum()),
                       "recall": recall, "scores": {k: _round(v) for k, v in scores.items()},
                       "seconds": round(time.time() - began, 1)})
        print(f"[worked] problem {i}: {len(p.results)} steps, {time.time() - began:.0f} s", flush=True)


RESAMPLES = 10_000


def _interval(values, paired=None, resamples: int = RESAMPLES) -> dict:
    from verl_oar.testbed.measures import bootstrap, paired_bootstrap

    iv = (bootstrap(values, resamples=resamples) if paired is None
          else paired_bootstrap(values, paired, resamples=resamples))
    return {"mean": iv.estimate, "low": iv.low, "high": iv.high, "n": iv.n}


def collect(store: Path, resamples: int = RESAMPLES) -> dict:
    """The results JSON from the store's files (every scored response and worked problem counted); ``resamples``
    per bootstrap interval."""
    import functools

    import torch

    from verl_oar.core.token_ranking import top_fraction_mask
    from verl_oar.real_model import counterfactual as cf

    interval = functools.partial(_interval, resamples=resamples)
    scored = sorted(_jsonl(store / "scores.jsonl"), key=lambda r: r["index"])
    worked = sorted(_jsonl(store / "worked.jsonl"), key=lambda r: r["index"])
    sampling = json.loads((store / "sampling.json").read_text())
    changes: dict = {}
    for name in cf.RANKINGS:
        for edit in cf.EDITS:
            for frac in cf.FRACS:
                values = [r["answer_change"][name][edit][str(frac)] for r in scored]
                base = [r["answer_change"]["random"][edit][str(frac)] for r in scored]
                size, base_size = [abs(v) for v in values], [abs(v) for v in base]
                changes.setdefault(name, {}).setdefault(edit, {})[str(frac)] = {
                    **interval(values), "minus_random": interval(values, base),
                    "absolute": {**interval(size), "minus_random": interval(size, base_size)}}
    categories: dict = {"all reasoning tokens": dict.fromkeys(cf.CATEGORIES, 0)}
    for r in scored:
        reasoning = torch.tensor(r["reasoning"])
        for c, is_reasoning in zip(r["categories"], r["reasoning"]):
            categories["all reasoning tokens"][c] += is_reasoning
        for name in cf.RANKINGS:
            top = top_fraction_mask(torch.tensor(r["scores"][name]), reasoning, TOP,
                                    torch.Generator().manual_seed(r["index"]))
            counts = categories.setdefault(name, dict.fromkeys(cf.CATEGORIES, 0))
            for position in top.nonzero().squeeze(1).tolist():
                counts[r["categories"][position]] += 1
    shares = {k: {c: v / max(1, sum(counts.values())) for c, v in counts.items()} for k, counts in categories.items()}
    agreement = {k: {m: interval([r["bf16_agreement"][k][m] for r in scored
                                   if r["bf16_agreement"][k][m] == r["bf16_agreement"][k][m]])
                     for m in ("top10_overlap", "spearman")} for k in cf.IMPORTANCE_RANKINGS}
    recall = {k: {str(f): interval([r["recall"][k][str(f)] for r in worked]) for f in cf.FRACS}
              for k in cf.RANKINGS} if worked else {}
    return {
        "responses": {"scored": len(scored), "right": sum(r["score"] == 1.0 for r in scored),
                      "mean_tokens": sum(r["tokens"] for r in scored) / max(1, len(scored)),
                      "mean_reasoning_tokens": sum(r["reasoning_tokens"] for r in scored) / max(1, len(scored)),
                      "sampling": sampling},
        "answer_change": changes,
        "top10_categories": {"shares": shares, "counts": categories},
        "bf16_agreement": agreement,
        "worked": {"problems": len(worked), "recall": recall,
                   "mean_tokens": sum(r["tokens"] for r in worked) / max(1, len(worked)),
                   "mean_labelled_tokens": sum(r["labelled_tokens"] for r in worked) / max(1, len(worked))},
        "seconds": {"score_median": _median([r["seconds"] for r in scored]),
                    "worked_median": _median([r["seconds"] for r in worked])},
    }


def _median(values):
    values = sorted(values)
    return values[len(values) // 2] if values else None


def _fmt(iv: dict, digits: int = 2) -> str:
    if iv["low"] is None:
        return f"{iv['mean']:+.{digits}f}"
    return f"{iv['mean']:+.{digits}f} [{iv['low']:+.{digits}f}, {iv['high']:+.{digits}f}]"


def tables(results: dict) -> str:
    """docs/real-model.md's counterfactual tables, from the results JSON (a test keeps the page equal to it)."""
    from verl_oar.real_model.counterfactual import CATEGORIES, FRACS, IMPORTANCE_RANKINGS, RANKINGS

    out = ["| ranking | " + " | ".join(f"delete top {int(f * 100)}%" for f in FRACS) + " | replace top 10% | "
           "delete top 10% minus random | size of the change, delete top 10%, minus random |",
           "|---" * (len(FRACS) + 4) + "|"]
    for name in RANKINGS:
        c = results["answer_change"][name]
        out.append(f"| {NAMES[name]} | " + " | ".join(_fmt(c["delete"][str(f)]) for f in FRACS)
                   + f" | {_fmt(c['replace']['0.1'])} | {_fmt(c['delete']['0.1']['minus_random'])} | "
                   f"{_fmt(c['delete']['0.1']['absolute']['minus_random'])} |")
    shares = results["top10_categories"]["shares"]
    out += ["", "| tokens | " + " | ".join(CATEGORIES) + " |", "|---" * (len(CATEGORIES) + 1) + "|"]
    for name in ("all reasoning tokens", *RANKINGS):
        label = name if name not in NAMES else f"top 10%, {NAMES[name]}"
        out.append(f"| {label} | " + " | ".join(f"{shares[name][c]:.2f}" for c in CATEGORIES) + " |")
    out += ["", "| ranking | top-10% overlap, bf16 vs fp32 | Spearman, bf16 vs fp32 | worked solutions: recall@10% "
            "of the results |", "|---|---|---|---|"]
    for name in RANKINGS:
        a = results["bf16_agreement"].get(name)
        bf16 = (f"{_fmt(a['top10_overlap'])} | {_fmt(a['spearman'])}" if name in IMPORTANCE_RANKINGS else "- | -")
        recall = results["worked"]["recall"].get(name, {}).get("0.1")
        out.append(f"| {NAMES[name]} | {bf16} | {_fmt(recall) if recall else '-'} |")
    return "\n".join(out)


def _errors(ivs: list[dict]) -> list[list[float]]:
    """matplotlib's yerr of intervals (0 where there is none: fewer than 2 responses)."""
    return [[iv["mean"] - iv["low"] if iv["low"] is not None else 0.0 for iv in ivs],
            [iv["high"] - iv["mean"] if iv["high"] is not None else 0.0 for iv in ivs]]


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from verl_oar.real_model.counterfactual import RANKINGS

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    x = range(len(RANKINGS))
    for offset, edit in ((-0.2, "delete"), (0.2, "replace")):
        ivs = [results["answer_change"][k][edit]["0.1"] for k in RANKINGS]
        axes[0].bar([i + offset for i in x], [iv["mean"] for iv in ivs], width=0.4, label=f"{edit} top 10%",
                    yerr=_errors(ivs), capsize=3)
    axes[0].axhline(0, color="black", lw=0.6)
    axes[0].set_ylabel("change in the answer's log-prob (nats)")
    axes[0].set_title(f"{results['responses']['scored']} own responses: remove a ranking's top 10%")
    axes[0].legend(fontsize=8)
    if results["worked"]["recall"]:
        ivs = [results["worked"]["recall"][k]["0.1"] for k in RANKINGS]
        axes[1].bar(list(x), [iv["mean"] for iv in ivs],
                    yerr=_errors(ivs), capsize=3)
    axes[1].set_ylim(0, 1)
    axes[1].set_title(f"{results['worked']['problems']} worked solutions: results in the top 10%")
    axes[1].set_ylabel("recall@10%")
    for ax in axes:
        ax.set_xticks(list(x), [NAMES[k] for k in RANKINGS], rotation=25, ha="right", fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct (Q4_1 dequantized, fp32), CPU; 95% bootstrap intervals", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("step", choices=("sample", "score", "worked", "collect"))
    p.add_argument("--store", type=Path, default=STORE)
    p.add_argument("--responses", type=int, default=120, help="sample: keep this many responses")
    p.add_argument("--batch", type=int, default=16, help="sample: prompts per generate call")
    p.add_argument("--limit", type=int, default=None, help="score: at most this many responses in this call")
    p.add_argument("--problems", type=int, default=60, help="worked: this many worked solutions")
    p.add_argument("--shard", default="0/1", help="score, worked: I/N, this process takes the items whose index is "
                                                  "I modulo N (two processes on 2 cores: 0/2 and 1/2)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results_real_model_counterfactual_cpu.json")
    p.add_argument("--figure", type=Path, default=ROOT / "docs" / "figures" / "real_model" / "counterfactual.png")
    p.add_argument("--table", action="store_true", help="collect: print --out's tables and exit")
    args = p.parse_args(argv)
    if args.step == "sample":
        cmd_sample(args)
    elif args.step == "score":
        cmd_score(args)
    elif args.step == "worked":
        cmd_worked(args)
    elif args.table:
        print(tables(json.loads(args.out.read_text())))
    else:
        from verl_oar.real_model.sampling import SAMPLER
        from verl_oar.testbed.machine import cpu_id, machine_info

        results = collect(args.store)
        record = json.loads((Path(os.environ.get("VERL_OAR_CACHE", "~/.cache/verl_oar")).expanduser()
                             / "models" / "smollm2" / "verl_oar_model.json").read_text())
        results = {"what": "the counterfactual test of token rankings on SmolLM2-135M-Instruct's own responses "
                           "(Q4_1 dequantized, fp32; bf16 rankings beside)",
                   "commands": [f"python benchmarks/real_model_counterfactual.py {s}" for s in
                                ("sample --responses 120", "score", "worked --problems 60", "collect")],
                   "model": {"source": record["source"], "parameters": record["parameters"]},
                   "sampler": SAMPLER,
                   "machine": {**machine_info(), "cpu_id": cpu_id()}, **results}
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        figure(results, args.figure)
        print(tables(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
