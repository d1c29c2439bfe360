"""OAR-G and OAR-P chunk passes on a real architecture, as ratios of verl's old-log-prob pass: SmolLM2-135M-Instruct
(Q4_1 dequantized, fp32) on verl's real FSDP2 engine (one rank, gloo, CPU), 8 sequences of 512 and of 1024 tokens.

    python benchmarks/real_model_cost.py [--sizes 8x512,8x1024] [--rounds 3] [--out FILE]

Per size, one process (``OMP_NUM_THREADS``, default 2: the whole machine) builds the plugin's worker as the trainer
does (``engine_worker.build_worker``, the privileged-cost benchmark's settings but verl's dynamic batch size with
``log_prob_max_token_len_per_gpu=8192``, so 8 x 1024 tokens is one micro-batch, as a GPU recipe's budget holds it)
and times, after one warm-up of each, ``--rounds`` round-robin rounds of:

- ``old-log-prob pass``: verl's ``compute_log_prob`` (with entropy), the unit;
- ``OAR-G, fused``: the same call with the trainer's ``oar_fused`` mark (training's default: the log-probs and
  OAR-G's importance from one pass; defaults: AS-MEAN, noisy KL, grad x input); its extra cost over the unit is
  what OAR-G adds to a step;
- ``OAR-G, own pass``: ``compute_token_importance`` with OAR-G (``algorithm.oar.fuse_log_prob=false``);
- ``OAR-P chunk K=16``: ``compute_token_importance`` with OAR-P (training's default mode), its own pass.

Nothing is sampled: every pass scores the same fixed texts, teacher-forced, on a worker built with the actor role
alone, so no rollout engine takes part (the results record ``"rollout": "none"``, ``ROLLOUT``).

Ratios are medians of per-round ratios to the same round's unit. Peak memory: the process's resident set sampled
every 2 ms during each call, minus its size just before the call (the pass's own working memory; the model and
optimizer are resident before), median over rounds. The text is real: worked solutions of word problems
(``verl_oar.data.worked_solutions``) after the real-model task's prompt, filler sentences added up to
the size's token count (the last one cut at a word), each ending with its ``\\boxed{}`` answer (what OAR locates).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNIT = "old-log-prob pass"
ROWS = (UNIT, "OAR-G, fused", "OAR-G, own pass", "OAR-P chunk K=16")
PAGE = os.sysconf("SC_PAGE_SIZE")
ROLLOUT = "none"
"""the rollout engine behind these numbers: none (fixed texts scored by the actor's passes; nothing sampled)"""
ROLLOUT_NOTE = ("no rollout engine: the passes score fixed worked-solution texts (teacher-forced) on an actor-only "
                "worker; nothing is sampled, so hf and vllm give the same numbers")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _Peak:
    """Peak resident bytes above the size at entry, sampled every 2 ms on a thread."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.extra = self.peak - self.base


def texts(tokenizer, rows: int, tokens: int) -> tuple[list[str], list[str]]:
    """Chat-rendered prompts and responses of ``tokens`` tokens in all (prompt + response + EOS), each response a
    worked solution with filler sentences, ending with its boxed answer."""
    from verl_oar.data.arithmetic import prompt_text
    from verl_oar.data.worked_solutions import FILLER, worked_solutions
    from verl_oar.real_model.launch import TASK

    prompts, responses = [], []
    for problem in worked_solutions(rows, seed=0):
        messages = [{"role": "user", "content": prompt_text(problem.question, TASK.example, TASK.brief, TASK.answer)}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        body, tail = problem.solution.rsplit(" The answer is", 1)
        tail = " The answer is" + tail
        room = tokens - len(tokenizer.encode(prompt)) - 1
        added = 0
        while len(tokenizer.encode(body + tail)) < room:
            body += " " + FILLER[added % len(FILLER)]
            added += 1
        while len(tokenizer.encode(body + tail)) > room:  # trim the filler back word by word to the exact size
            body = body.rsplit(" ", 1)[0]
        response = body + tail
        prompts.append(prompt)
        responses.append(response)
    return prompts, responses


def run_cell(size: str, rounds: int, model_dir: str) -> dict:
    os.environ.update(VERL_PLATFORM="cpu", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    import torch
    from engine_worker import build_worker, text_rows
    from transformers import AutoTokenizer

    from verl_oar.core.config import OARConfig

    rows, tokens = (int(x) for x in size.split("x"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, responses = texts(tokenizer, rows, tokens)
    worker = build_worker(Path(model_dir), rows, 8192, dynamic_bsz=True)
    oar = OARConfig().to_dict()
    batch = lambda **mark: text_rows(tokenizer, prompts, responses, **mark)  # noqa: E731
    calls = {
        UNIT: lambda: worker.compute_log_prob(batch()),
        "OAR-G, fused": lambda: worker.compute_log_prob(batch(oar=oar, method="gradient", fused=True)),
        "OAR-G, own pass": lambda: worker.compute_token_importance(batch(oar=oar, method="gradient")),
        "OAR-P chunk K=16": lambda: worker.compute_token_importance(batch(oar=oar, method="perturbation")),
    }
    sample = batch()
    lengths = [len(x) for x in sample["input_ids"].unbind()]
    response_lengths = [len(x) for x in sample["responses"].unbind()]
    checks = {}
    for name, call in calls.items():  # warm-up, and the output checked once: every row's answer found, importance set
        out = call()
        if name != UNIT:
            importance, answer = out["oar_importance"].unbind(), out["oar_answer_mask"].unbind()
            checks[name] = {"rows_with_importance": sum(bool((row != 0).any()) for row in importance),
                            "rows_with_answer": sum(bool(row.any()) for row in answer)}
            if checks[name]["rows_with_answer"] < rows:
                raise SystemExit(f"{name}: the answer was located in {checks[name]['rows_with_answer']} of {rows} rows; "
                                 "a row without one scores nothing and would make the pass look cheap")
    times = {name: [] for name in calls}
    peaks = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            with _Peak() as peak:
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
            peaks[name].append(peak.extra)
    return {"size": size, "sequence_tokens": lengths, "response_tokens": response_lengths, "times": times,
            "peak_extra_bytes": peaks, "checks": checks, "torch_threads": torch.get_num_threads()}


def summary(cell: dict) -> dict:
    unit = cell["times"][UNIT]
    rows = {}
    for name in ROWS:
        t = cell["times"][name]
        ratio = [x / u for x, u in zip(t, unit)]
        rows[name] = {"median_s": round(statistics.median(t), 3), "x_log_prob": round(statistics.median(ratio), 3),
                      "x_log_prob_range": [round(min(ratio), 3), round(max(ratio), 3)],
                      "peak_extra_mib": round(statistics.median(cell["peak_extra_bytes"][name]) / 2**20, 1)}
    rows["OAR-G, fused"]["extra_x_log_prob"] = round(rows["OAR-G, fused"]["x_log_prob"] - 1, 3)
    return {"size": cell["size"], "rows": rows, "checks": cell["checks"], "torch_threads": cell["torch_threads"],
            "mean_response_tokens": statistics.mean(cell["response_tokens"]),
            "sequence_tokens": cell["sequence_tokens"]}


def table(results: dict) -> str:
    """The docs' table: per size and pass, median seconds, x the log-prob pass [range over rounds], peak MiB."""
    out = ["| batch | pass | median s | x log-prob pass [min, max over rounds] | peak working memory MiB |",
           "|---|---|---|---|---|"]
    for cell in results["cells"]:
        for name in ROWS:
            r = cell["rows"][name]
            lo, hi = r["x_log_prob_range"]
            out.append(f"| {cell['size'].replace('x', ' x ')} | {name} | {r['median_s']:.2f} | "
                       f"{r['x_log_prob']:.2f} [{lo:.2f}, {hi:.2f}] | {r['peak_extra_mib']:.0f} |")
    return "\n".join(out)


def results_record(command: str, model_record: dict, machine: dict, rounds: int, cells: list[dict]) -> dict:
    """The results JSON: what was measured, the command, the model, the rollout engine (``ROLLOUT``), the machine."""
    return {"what": "OAR-G and OAR-P chunk passes on SmolLM2-135M-Instruct through verl's FSDP2 engine, as ratios "
                    "of the old-log-prob pass (medians over rounds)",
            "command": command,
            "model": {"source": model_record["source"], "parameters": model_record["parameters"], "dtype": "fp32"},
            "rollout": ROLLOUT, "rollout_note": ROLLOUT_NOTE, "machine": machine, "rounds": rounds, "cells": cells}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="8x512,8x1024", help="ROWSxTOKENS per batch, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    parser.add_argument("--table", type=Path, default=None, help="print the docs table of this results JSON")
    parser.add_argument("--cell", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    if args.cell:
        print("CELL " + json.dumps(run_cell(args.cell, args.rounds, args.model_dir)), flush=True)
        return 0

    from verl_oar.testbed.machine import cpu_id, machine_info
    from verl_oar.tools.prepare_model import prepare

    folder = prepare("smollm2", log=lambda _: None)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    cells = []
    load_before = os.getloadavg()
    for size in args.sizes.split(","):
        began = time.time()
        proc = subprocess.run([sys.executable, __file__, "--cell", size, "--rounds", str(args.rounds),
                               "--model-dir", str(folder)], capture_output=True, text=True, env=env)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-6000:])
            return 1
        cell = next(json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CELL "))
        cells.append({**summary(cell), "raw": cell, "seconds": round(time.time() - began)})
        print(f"[cost] {size}: {json.dumps(cells[-1]['rows'])}", flush=True)
    record = json.loads((Path(folder) / "verl_oar_model.json").read_text())
    machine = {**machine_info(), "cpu_id": cpu_id(), "torch_threads": int(env["OMP_NUM_THREADS"]),
               "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]}
    results = results_record("python benchmarks/real_model_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
                             record, machine, args.rounds, cells)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
