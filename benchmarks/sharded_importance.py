"""OAR-P and OAR-G passes on two data-parallel ranks of verl's real FSDP2 engine (gloo, CPU): parameters kept
sharded with equal model calls (the default, ``engines.fsdp.lockstep``) vs the whole model gathered once per
pass (``algorithm.oar.gather_params=True``), same batches, same run.

    python benchmarks/sharded_importance.py [--rows 4] [--mean-response 160] [--hidden 128] [--layers 4]
        [--budget 16] [--rounds 7] [--out FILE]

Two rank processes (one core each on a 2-core machine, ``OMP_NUM_THREADS=1``) score different random batches
(response lengths drawn per rank, so their OAR-P call counts differ), one sequence per micro-batch. Rows, each
timed from a barrier to the slower rank's end (medians over ``--rounds`` round-robin rounds after a warm-up,
so a slow spell of the machine hits every row of a round alike):

- ``OAR-P chunk K=<budget>, sharded`` / ``gathered``: ``compute_token_importance`` with OAR-P (AS-MEAN);
- ``OAR-G noisy_kl, sharded`` / ``gathered``: the same with OAR-G, not fused;
- ``old-log-prob pass``: verl's own ``compute_log_prob`` on the same batch, the unit.

Also per rank: the model's forwards per pass (sharded: equal on both ranks, the lighter one padding; gathered:
each its own) and FSDP2's all-gathers per pass. gloo on CPU is not NCCL on GPUs: here an all-gather is a copy
through local sockets between two processes on one machine, with no compute/communication overlap and a
one-core forward, so the ratios say how the two modes' extra work compares on this machine, not what a GPU run
pays (there the per-layer all-gathers of a sharded pass run on NCCL beside compute, and the gathered pass's one
gather is ~2 bytes x parameters per GPU of memory, which is its real cost).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _responses(rank: int, rows: int, mean_response: int) -> tuple[list[str], list[str]]:
    """Prompts and responses in words, each response ending with its boxed answer; lengths drawn per rank."""
    rng = random.Random(1000 + rank)
    words = ["add", "the", "units", "carry", "one", "then", "tens", "so", "we", "get", "next", "check"]
    prompts, responses = [], []
    for _ in range(rows):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        length = max(24, int(rng.lognormvariate(0, 0.6) * mean_response / 1.2))
        text = ""
        while len(text) < length:
            text += rng.choice(words) + " "
        prompts.append(f"Compute {a} + {b}.")
        responses.append(text + f"so \\boxed{{{a + b}}}")
    return prompts, responses


def run_rank(args, rank: int, port: str, model_dir: str) -> None:
    os.environ.update(VERL_PLATFORM="cpu", RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    import torch.distributed as dist
    from engine_worker import build_worker, text_rows
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts, responses = _responses(rank, args.rows, args.mean_response)
    worker = build_worker(Path(model_dir), args.rows, 8192)
    engine = worker.actor.engine
    forwards, gathers = [0], [0]
    engine.module.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    original = dist.all_gather_single

    def counted(*a, **k):
        gathers[0] += 1
        return original(*a, **k)

    dist.all_gather_single = counted  # FSDP2 (torch 2.13) calls it through the module attribute

    p_oar = {"outcome": "mean", "perturb_mode": "chunk", "perturb_budget": args.budget}
    g_oar = {"objective": "noisy_kl", "saliency": "grad_x_input", "outcome": "mean"}
    p_name, g_name = f"OAR-P chunk K={args.budget}", "OAR-G noisy_kl"
    timers = {
        "old-log-prob pass": lambda: worker.compute_log_prob(text_rows(tokenizer, prompts, responses)),
        f"{p_name}, sharded": lambda: worker.compute_token_importance(
            text_rows(tokenizer, prompts, responses, p_oar, "perturbation")),
        f"{p_name}, gathered": lambda: worker.compute_token_importance(
            text_rows(tokenizer, prompts, responses, {**p_oar, "gather_params": True}, "perturbation")),
        f"{g_name}, sharded": lambda: worker.compute_token_importance(
            text_rows(tokenizer, prompts, responses, g_oar, "gradient")),
        f"{g_name}, gathered": lambda: worker.compute_token_importance(
            text_rows(tokenizer, prompts, responses, {**g_oar, "gather_params": True}, "gradient")),
    }
    counts: dict = {}

    def timed(name, fn) -> float:
        dist.barrier()
        forwards[0] = gathers[0] = 0
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        counts[name] = {"forwards": forwards[0], "all_gathers": gathers[0]}
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the pass ends when the slower rank ends
        return float(elapsed)

    for name, fn in timers.items():  # warm-up
        timed(name, fn)
    times: dict = {name: [] for name in timers}
    for _ in range(args.rounds):
        for name, fn in timers.items():
            times[name].append(timed(name, fn))
    lengths = [len(tokenizer.encode(p)) + len(tokenizer.encode(r)) + 1 for p, r in zip(prompts, responses)]
    print("RANK " + json.dumps({"rank": rank, "times": times, "counts": counts, "lengths": lengths}), flush=True)
    dist.destroy_process_group()


def _summary(ranks: list[dict], args) -> dict:
    times = ranks[0]["times"]  # equal on both ranks (all-reduced)
    unit = statistics.median(times["old-log-prob pass"])
    rows = {name: {"median_s": round(statistics.median(t), 4), "x_log_prob": round(statistics.median(t) / unit, 3)}
            for name, t in times.items()}
    ratios = {}
    for method in (f"OAR-P chunk K={args.budget}", "OAR-G noisy_kl"):
        paired = [s / g for s, g in zip(times[f"{method}, sharded"], times[f"{method}, gathered"])]
        ratios[f"{method}: sharded / gathered"] = {
            "median": round(statistics.median(paired), 3), "min": round(min(paired), 3), "max": round(max(paired), 3),
            "per_round": [round(x, 3) for x in paired]}
    return {"rows": rows, "paired_ratios": ratios,
            "per_rank": [{"rank": r["rank"], "sequence_tokens": r["lengths"], "per_pass": r["counts"]} for r in ranks]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4, help="sequences per rank")
    parser.add_argument("--mean-response", type=int, default=160, help="mean response length (characters = tokens)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--budget", type=int, default=16, help="OAR-P chunk K")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        run_rank(args, args.rank, args.port, args.model_dir)
        return

    os.environ.setdefault("VERL_PLATFORM", "cpu")
    sys.path.insert(0, str(Path(__file__).parent))
    from privileged_cost import build_model_dir

    from verl_oar.testbed.machine import machine_info

    model_dir = build_model_dir(Path(tempfile.mkdtemp(prefix="sharded_importance_")), "model", args.hidden,
                                args.layers, seed=0)
    port = str(_free_port())
    passthrough = [f"--rows={args.rows}", f"--mean-response={args.mean_response}", f"--budget={args.budget}",
                   f"--rounds={args.rounds}"]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    load_before = os.getloadavg()
    procs = [subprocess.Popen([sys.executable, __file__, *passthrough, "--rank", str(r), "--port", port,
                               "--model-dir", str(model_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for r in range(WORLD)]
    outputs = [p.communicate() for p in procs]
    if any(p.returncode for p in procs):
        for r, (_, err) in enumerate(outputs):
            sys.stderr.write(f"--- rank {r} ---\n{err[-4000:]}\n")
        sys.exit(1)
    ranks = sorted((json.loads(line[5:]) for out, _ in outputs for line in out.splitlines()
                    if line.startswith("RANK ")), key=lambda r: r["rank"])
    result = {
        "command": "python benchmarks/sharded_importance.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {**machine_info(), "torch_threads_per_rank": int(env["OMP_NUM_THREADS"]),
                    "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)]},
        "shape": {"ranks": WORLD, "rows_per_rank": args.rows, "hidden": args.hidden, "layers": args.layers,
                  "param_dtype": "fp32", "backend": "gloo (CPU)"},
        "rounds": args.rounds,
        **_summary(ranks, args),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
