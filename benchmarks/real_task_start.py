"""Start statistics of a real pretrained model on the arithmetic task designs (verl_oar/data/arithmetic.py), to choose
the design the real-model experiments train on (docs/real-model.md).

    python benchmarks/real_task_start.py --out benchmarks/results_real_task_start_cpu.json \
        [--designs word1,word1:no-example,word2,sum1] [--problems 32] [--samples 8] [--max-new-tokens 128]

Per design (``KIND[:no-example][:brief][:label]``: kind, without the worked example, asking for one short sentence,
the answer after an ``Answer:`` label instead of in ``\boxed{}``): the first ``--problems`` test problems, each sampled
``--samples`` times at temperature 1 (no top-k / top-p) and once greedily, up to ``--max-new-tokens`` tokens, with
plain transformers ``generate`` on the prepared model (``verl-oar prepare-model smollm2``; fp32, one torch thread,
seed 0), each response graded by ``verl_oar.rewards.math_reward.compute_score`` against the problem's answer.
Reports pass@1 (mean over samples), pass@k (a problem with any right sample), the rate of a gradable answer (the
reward found one), the mean response length in tokens, the rate of responses cut at the token limit, greedy pass@1,
and seconds. The model is SmolLM2-135M-Instruct dequantized from Q4_1, not the original checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_design(text: str):
    from verl_oar.data.arithmetic import TaskSpec

    kind, *flags = text.split(":")
    if set(flags) - {"no-example", "brief", "label"}:
        raise SystemExit(f"real_task_start: design {text!r}: KIND[:no-example][:brief][:label]")
    return TaskSpec(kind=kind, example="no-example" not in flags, brief="brief" in flags,
                    answer="label" if "label" in flags else "boxed")


def measure(model, tokenizer, spec, args) -> dict:
    from verl_oar.data.arithmetic import problems, prompt_text
    from verl_oar.real_model.sampling import generate
    from verl_oar.rewards.math_reward import compute_score

    chosen = problems(spec, "test")[: args.problems]
    prompts = [prompt_text(p.question, spec.example, spec.brief, spec.answer) for p in chosen]
    began = time.time()
    sampled = generate(model, tokenizer, prompts, samples=args.samples, greedy=False,
                       max_new_tokens=args.max_new_tokens, seed=0, batch=args.batch)
    greedy = generate(model, tokenizer, prompts, samples=1, greedy=True, max_new_tokens=args.max_new_tokens, seed=0,
                      batch=args.batch)
    seconds = time.time() - began

    def grade(text: str, answer: int) -> tuple[float, bool]:
        result = compute_score("verl_oar/arithmetic", text, str(answer))
        return result["score"], result["pred"] != ""

    rights, gradable, per_problem = [], [], []
    for i, p in enumerate(chosen):
        graded = [grade(text, p.answer) for text, _, _ in sampled[i * args.samples:(i + 1) * args.samples]]
        rights += [s for s, _ in graded]
        gradable += [g for _, g in graded]
        per_problem.append(any(s == 1.0 for s, _ in graded))
    n = len(rights)
    return {
        "kind": spec.kind, "example": spec.example, "brief": spec.brief, "answer": spec.answer,
        "problems": len(chosen), "samples_per_problem": args.samples,
        "pass_at_1": sum(rights) / n, f"pass_at_{args.samples}": sum(per_problem) / len(chosen),
        "gradable_rate": sum(gradable) / n, "mean_response_tokens": sum(t for _, t, _ in sampled) / n,
        "cut_rate": sum(c for _, _, c in sampled) / n,
        "greedy_pass_at_1": sum(grade(t, p.answer)[0] for (t, _, _), p in zip(greedy, chosen)) / len(chosen),
        "seconds": round(seconds, 1),
        "example_responses": [{"question": p.question, "answer": p.answer, "response": sampled[i * args.samples][0]}
                              for i, p in enumerate(chosen[:3])],
    }


def table(results: dict) -> str:
    """docs/real-model.md's table of the designs, from a results file (a test keeps the page equal to it)."""
    def name(d: dict) -> str:
        parts = [f"`{d['kind']}`", "worked example" if d["example"] else "no example"]
        parts += ["brief"] * d["brief"] + ["`Answer:` line"] * (d.get("answer") == "label")
        return ", ".join(parts)

    k = results["settings"]["samples"]
    lines = [f"| design | pass@1 (T=1) | pass@{k} | gradable answer | mean tokens | cut at "
             f"{results['settings']['max_new_tokens']} | greedy pass@1 |", "|---|---|---|---|---|---|---|"]
    for d in sorted(results["designs"], key=lambda d: (d["kind"], -d["pass_at_1"])):
        lines.append(f"| {name(d)} | {d['pass_at_1']:.3f} | {d[f'pass_at_{k}']:.3f} | {d['gradable_rate']:.3f} | "
                     f"{d['mean_response_tokens']:.0f} | {d['cut_rate']:.3f} | {d['greedy_pass_at_1']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--designs", default="word1,word1:no-example,word2,sum1")
    p.add_argument("--problems", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--model", default=None, help="a prepared folder (default: verl-oar prepare-model smollm2's)")
    p.add_argument("--append", action="store_true", help="add these designs to --out's (same settings), keeping its own")
    p.add_argument("--table", action="store_true", help="print --out's table (docs/real-model.md) and exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_oar.testbed.machine import cpu_id, machine_info
    from verl_oar.tools.prepare_model import prepare

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    folder = Path(args.model) if args.model else prepare("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    for design in args.designs.split(","):
        spec = parse_design(design)
        results.append(measure(model, tokenizer, spec, args))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "example_responses"}), flush=True)
    record = json.loads((folder / "verl_oar_model.json").read_text())
    command = "python benchmarks/real_task_start.py " + " ".join(argv if argv is not None else sys.argv[1:])
    settings = {"problems": args.problems, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
                "temperature": 1.0, "seed": 0}
    commands = []
    if args.append:
        earlier = json.loads(Path(args.out).read_text())
        if earlier["settings"] != settings or earlier["model"]["source"] != record["source"]:
            raise SystemExit(f"real_task_start: --append needs {args.out}'s settings and model: {earlier['settings']}")
        commands, results = earlier["commands"], earlier["designs"] + results
    Path(args.out).write_text(json.dumps({
        "what": "start statistics of the arithmetic task designs on SmolLM2-135M-Instruct (Q4_1 dequantized, fp32)",
        "commands": commands + [command],
        "model": {"source": record["source"], "parameters": record["parameters"]},
        "machine": {**machine_info(), "cpu_id": cpu_id(), "torch_threads": torch.get_num_threads()},
        "settings": settings,
        "designs": results,
    }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
