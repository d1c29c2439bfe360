"""The real-model demo: SmolLM2-135M-Instruct (Q4_1 dequantized, fp32) through verl's real trainer on CPU, the
counterfactual test on a handful of its own responses, their heatmaps, and one HTML report.

    python -m verl_oar.app.real_demo [--out oar_real_demo] [--steps 2] [--methods grpo,oar_g] [--responses 16]
        [--scored 4] [--rollout auto|hf|vllm]

In order, each stage printed with a progress bar:

1. the model, prepared once and cached (``verl-oar prepare-model smollm2``);
2. ``--steps`` steps of each method through ``python -m verl.trainer.main_ppo`` on the ``sum1`` task
   (``real_model.launch``: 4 prompts x 4 responses of up to 128 tokens, AdamW at 1e-6), sampled by the ``--rollout``
   engine (``auto``: verl's vLLM rollout where vLLM's CPU build is installed, else CPU mode's hf rollout; the summary
   and the page name the one used); each step's training reward and seconds;
3. ``--responses`` responses of the untrained model to test problems (``real_model.sampling``: transformers
   ``generate`` at temperature 1), graded by the package's math reward; the first ``--scored`` whose answer training
   would locate are ranked (``real_model.counterfactual``: OAR-G, OAR-P chunk, OAR-P exact, entropy, random) and
   their top 10% deleted: the change of the answer's log-probability per ranking;
4. heatmaps (``verl-oar heatmap``, training's settings) of one right and one wrong response, when there are;
5. ``summary.json`` and ``index.html`` in ``--out``, the report rendered from the summary.

A handful of responses shows what the measurement is, not a result: the committed test of 125 responses is
``benchmarks/real_model_counterfactual.py`` (docs/real-model.md). At the defaults: 31 minutes on 2 cores shared with
other jobs; plan on 16 GB of free memory.
"""

from __future__ import annotations

import argparse
import html
import json
import shutil
import sys
import time
from pathlib import Path

__all__ = ["main"]

RANKED = ("oar_g", "oar_p_chunk", "oar_p_exact", "entropy", "random")
STAGES = ("model", "training", "sampling", "counterfactual", "heatmaps", "report")


def _progress(stage: str, detail: str = "") -> None:
    done = STAGES.index(stage)
    bar = "#" * (4 * done) + "." * (4 * (len(STAGES) - done))
    print(f"[verl-oar real demo {time.strftime('%H:%M:%S')}] [{bar}] {done + 1}/{len(STAGES)} {stage}"
          f"{': ' + detail if detail else ''}", flush=True)


def _read_metrics(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    keep = ("critic/score/mean", "response_length/mean", "timing_s/step", "oar/fallback/no_answer")
    return [{"step": r["step"], **{k: r["data"][k] for k in keep if k in r["data"]}}
            for r in rows if "critic/score/mean" in r.get("data", {})]  # training steps (not validation)


def train(out: Path, methods: list[str], steps: int, rollout: str) -> dict:
    """``steps`` steps of each method through main_ppo, sampled by ``rollout`` (resolved: hf or vllm)."""
    from verl_oar.real_model.launch import run

    runs = {}
    for i, method in enumerate(methods):
        _progress("training",
                  f"{method} ({i + 1} of {len(methods)}), {steps} steps through main_ppo, {rollout} rollout")
        began = time.time()
        rc, metrics = run(out / "runs" / method, steps=steps, adv_estimator=method, experiment_name=method,
                          rollout=rollout)
        runs[method] = {"exit_code": rc, "rollout": rollout, "seconds": round(time.time() - began),
                        "steps": _read_metrics(metrics), "log": str(metrics)}
        if rc != 0:
            raise SystemExit(f"verl-oar real demo: {method} failed (exit {rc}); its metric file: {metrics}")
    return runs


def sample(out: Path, folder: Path, n: int) -> tuple[list[dict], object, object]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_oar.data.arithmetic import problems, prompt_text
    from verl_oar.real_model.launch import TASK
    from verl_oar.real_model.sampling import SAMPLER, generate
    from verl_oar.rewards.math_reward import compute_score

    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    chosen = [problems(TASK, "test")[i % len(problems(TASK, "test"))] for i in range(n)]
    prompts = [prompt_text(p.question, TASK.example, TASK.brief, TASK.answer) for p in chosen]
    _progress("sampling", f"{n} responses ({SAMPLER})")
    texts = generate(model, tokenizer, prompts, samples=1, greedy=False, max_new_tokens=128, seed=0, batch=n)
    rows = [{"row": i, "prompt": prompt, "response": text, "answer": p.answer, "arithmetic": p.arithmetic,
             "score": compute_score("verl_oar/arithmetic", text, str(p.answer))["score"], "tokens": tokens}
            for i, (p, prompt, (text, tokens, _)) in enumerate(zip(chosen, prompts, texts, strict=True))]
    path = out / "responses.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows, model, tokenizer


def counterfactual(rows: list[dict], model, tokenizer, scored: int) -> list[dict]:
    from verl_oar.core.config import OARConfig, neutral_token_id
    from verl_oar.real_model import counterfactual as cf
    from verl_oar.tools.heatmap import HeatmapInputError, make_sample

    neutral = neutral_token_id(OARConfig(), tokenizer)
    results = []
    for r in rows:
        if len(results) == scored:
            break
        try:
            s = make_sample(r["row"], [{"role": "user", "content": r["prompt"]}], r["response"], tokenizer, True)
        except HeatmapInputError:
            continue  # no answer training would locate: nothing to rank against
        if sum(s.reasoning) < 3:
            continue
        _progress("counterfactual", f"response {r['row']} ({len(results) + 1} of {scored})")
        scores = cf.rankings(model, s, neutral_id=neutral, seed=r["row"], names=RANKED, tokenizer=tokenizer)
        change = cf.answer_change(model, s, scores, neutral_id=neutral, seed=r["row"])
        results.append({"row": r["row"], "score": r["score"], "reasoning_tokens": sum(s.reasoning),
                        "delete_top_10%": {k: change[k]["delete"][0.1] for k in RANKED}})
    return results


def heatmaps(out: Path, folder: Path, rows: list[dict], ranked: list[dict]) -> list[dict]:
    from verl_oar.tools.heatmap import main as heatmap

    located = {r["row"] for r in ranked}
    picks = [next((r for r in rows if r["row"] in located and r["score"] == want), None) for want in (1.0, 0.0)]
    made = []
    for label, r in zip(("right", "wrong"), picks, strict=True):
        if r is None:
            continue
        _progress("heatmaps", f"the {label} response {r['row']}")
        target = out / f"heatmap_{label}"
        heatmap(["--model", str(folder), "--rollouts", str(out / "responses.jsonl"), "--rows", str(r["row"]),
                 "--estimators", "oar_g,oar_p", "--device", "cpu", "--out", str(target)])
        made.append({"label": label, "row": r["row"], "png": f"heatmap_{label}/heatmap_{r['row']}.png"})
    return made


def render(summary: dict) -> str:
    """index.html from ``summary.json`` alone."""
    e = html.escape
    parts = [f"<h1>verl-oar on a real model: {e(summary['model'])}</h1>",
             f"<p>{e(summary['command'])}<br>{e(json.dumps(summary['machine']))}</p>",
             f"<h2>Training (main_ppo, {e(summary['rollout'])} rollout)</h2>"]
    for method, run in summary["training"].items():
        parts.append(f"<h3>{e(method)}: {run['seconds']} s</h3><table border=1><tr><th>step</th><th>reward</th>"
                     "<th>response tokens</th><th>seconds</th></tr>")
        for s in run["steps"]:
            parts.append(f"<tr><td>{s['step']}</td><td>{s.get('critic/score/mean', float('nan')):.3f}</td>"
                         f"<td>{s.get('response_length/mean', float('nan')):.1f}</td>"
                         f"<td>{s.get('timing_s/step', float('nan')):.1f}</td></tr>")
        parts.append("</table>")
    s = summary["sampling"]
    parts.append(f"<h2>Counterfactual test on {len(summary['counterfactual'])} of its own responses</h2><p>"
                 f"{s['responses']} sampled ({e(s['sampler'])}), {s['right']} right. Change of the answer's "
                 "log-probability (nats) when each ranking's top 10% of the reasoning tokens is deleted; a handful of "
                 "responses, not a result (docs/real-model.md has the committed test).</p><table border=1><tr>"
                 "<th>response</th><th>right</th>" + "".join(f"<th>{e(k)}</th>" for k in RANKED) + "</tr>")
    for r in summary["counterfactual"]:
        parts.append(f"<tr><td>{r['row']}</td><td>{r['score']:.0f}</td>"
                     + "".join(f"<td>{r['delete_top_10%'][k]:+.2f}</td>" for k in RANKED) + "</tr>")
    parts.append("</table><h2>Heatmaps (training's settings: OAR-G, OAR-P chunk K=16)</h2>")
    for h in summary["heatmaps"]:
        parts.append(f"<h3>a {e(h['label'])} response (row {h['row']})</h3><img src='{e(h['png'])}' width='100%'>")
    return "<!doctype html><meta charset='utf-8'><title>verl-oar real-model demo</title>" + "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    from verl_oar.real_model.launch import ROLLOUT_CHOICES, resolve_rollout

    p = argparse.ArgumentParser(prog="python -m verl_oar.app.real_demo", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("oar_real_demo"), help="report folder")
    p.add_argument("--steps", type=int, default=2, help="training steps per method (0: no training)")
    p.add_argument("--methods", default="grpo,oar_g", help="estimators trained, comma-separated")
    p.add_argument("--responses", type=int, default=16, help="responses sampled for the counterfactual test")
    p.add_argument("--scored", type=int, default=4, help="responses ranked and edited (of those with an answer)")
    p.add_argument("--rollout", choices=ROLLOUT_CHOICES, default="auto",
                   help="training's rollout: auto (verl's vLLM rollout where vLLM's CPU build is installed, else hf), "
                        "hf (CPU mode's transformers rollout) or vllm")
    args = p.parse_args(argv)
    from verl_oar.testbed.machine import machine_info
    from verl_oar.tools.prepare_model import prepare

    rollout = resolve_rollout(args.rollout)  # vllm without vLLM's CPU build stops here, naming the install command

    began = time.time()
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    _progress("model", "prepare-model smollm2 (cached after the first time)")
    folder = Path(prepare("smollm2"))
    methods = [m for m in args.methods.split(",") if m]
    runs = train(out, methods, args.steps, rollout) if args.steps > 0 else {}
    rows, model, tokenizer = sample(out, folder, args.responses)
    ranked = counterfactual(rows, model, tokenizer, args.scored)
    made = heatmaps(out, folder, rows, ranked)
    _progress("report")
    from verl_oar.real_model.sampling import SAMPLER

    summary = {"model": "SmolLM2-135M-Instruct (Q4_1 dequantized, fp32)",
               "command": "python -m verl_oar.app.real_demo " + " ".join(sys.argv[1:] if argv is None else argv),
               "machine": machine_info(), "rollout": rollout, "training": runs,
               "sampling": {"responses": len(rows), "right": sum(r["score"] == 1.0 for r in rows), "sampler": SAMPLER},
               "counterfactual": ranked, "heatmaps": made, "seconds": round(time.time() - began)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "index.html").write_text(render(summary), encoding="utf-8")
    print(f"verl-oar real demo: {out / 'index.html'} ({summary['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
