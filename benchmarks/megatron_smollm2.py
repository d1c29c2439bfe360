"""SmolLM2-135M-Instruct in megatron-core's ``GPTModel`` on the CPU: logits against transformers, and OAR-G / OAR-P
chunk importance of the model's own responses against verl's FSDP2 engine on the same rows.

    python benchmarks/megatron_smollm2.py [--model DIR] [--rows 3] [--max-new-tokens 96] [--out FILE]

The model is the folder ``verl-oar prepare-model smollm2`` writes (default ``$VERL_OAR_CACHE/models/smollm2``).
Its own responses: word problems of the real-model task (``data.arithmetic``, the worked example in the prompt,
through the chat template), sampled at temperature 1 (``transformers`` ``generate``, seeded), kept while the
answer locator finds an answer, up to ``--rows``. Then ``tests/engine/megatron_llama_check.py`` on three gloo ranks
(the test's check, on the real model): the rows on verl's FSDP2 engine through the plugin's worker (fp32, packed
rows, parameters sharded over the three ranks), then on ``verl_oar.cpu.megatron_llama``'s ``GPTModel`` at TP = 1
(data parallel 3), TP = 3 and TP = 3 with sequence parallelism, fp32 and bf16: the logits of every token against
``LlamaForCausalLM`` per row, and (fp32, TP = 3 with and without sequence parallelism) OAR-G (AS-MEAN, noisy KL,
grad x input) and OAR-P chunk (K = 16) through the plugin's Megatron pass against the FSDP engine's.

Why TP = 3 and not 2: megatron splits attention heads and query groups over the TP ranks, and SmolLM2 has 9 heads
in 3 query groups, so its TP size is 1 or 3 (``megatron_llama_model`` refuses 2, naming why).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "tests" / "engine" / "megatron_llama_check.py"
WORLD = 3
LAYOUTS = ("tp1", "tp3", "tp3_sp")
SCORED = ("tp3", "tp3_sp")


def own_responses(model_dir: Path, rows: int, max_new_tokens: int, seed: int) -> tuple[dict, list[str]]:
    """{"prompts": [[id]], "responses": [[id]]} of ``rows`` sampled responses with a located answer, and their text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_oar.core.answer_span import locate_answer_tokens
    from verl_oar.data.arithmetic import TaskSpec, problems, prompt_text

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    out, texts = {"prompts": [], "responses": []}, []
    for problem in problems(TaskSpec(), "test"):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt_text(problem.question, True)}],
                                               tokenize=False, add_generation_prompt=True)
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            sampled = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        response = sampled[0, ids.shape[1]:].tolist()
        if tokenizer.eos_token_id not in response or locate_answer_tokens(response, tokenizer) is None:
            continue   # cut, or no answer to ground on: zero importance on both engines, nothing to compare
        response = response[: response.index(tokenizer.eos_token_id) + 1]
        out["prompts"].append(ids[0].tolist())
        out["responses"].append(response)
        texts.append(tokenizer.decode(response, skip_special_tokens=True))
        if len(texts) == rows:
            return out, texts
    raise RuntimeError(f"only {len(texts)} of {rows} sampled responses had an answer; raise --max-new-tokens")


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def main(argv=None) -> int:
    from verl_oar.testbed.machine import cpu_id, machine_info
    from verl_oar.tools.prepare_model import RECORD, default_out

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=default_out("smollm2"))
    p.add_argument("--rows", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results_megatron_smollm2_cpu.json")
    args = p.parse_args(argv)
    if not (args.model / RECORD).exists():
        raise SystemExit(f"no prepared model in {args.model}: run `verl-oar prepare-model smollm2` first")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    start = time.perf_counter()
    rows, texts = own_responses(args.model, args.rows, args.max_new_tokens, args.seed)
    sampled = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
        s.close()
        rows_path = Path(tmp) / "rows.json"
        rows_path.write_text(json.dumps(rows))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "CUDA_VISIBLE_DEVICES": "", "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"}
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, str(CHECK), str(r), str(WORLD), port, str(args.model),
                                   str(rows_path), tmp, ",".join(SCORED)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for r in range(WORLD)]
        logs = [proc.communicate(timeout=3600) for proc in procs]
        if any(proc.returncode for proc in procs):
            raise SystemExit("\n".join(log[1][-4000:] for log in logs))
        checked = time.perf_counter() - start
        fsdp = [torch.load(Path(tmp) / f"fsdp_rank{r}.pt") for r in range(WORLD)]
        fsdp_bf16 = torch.load(Path(tmp) / "fsdp_bf16_rank0.pt")
        ranks = {(d, layout, r): torch.load(Path(tmp) / f"{d}_{layout}_rank{r}.pt")
                 for d in ("fp32", "bf16") for layout in LAYOUTS for r in range(WORLD)}
    results = {}
    for (d, layout, r), got in ranks.items():
        if r:
            continue
        row = {k: got[k] for k in ("vocab_columns", "logits_err", "logits_scale", "logits_err_vs_hf_bf16",
                                   "hf_bf16_err", "wrong_layouts", "importance_seconds") if k in got}
        row["logits_err_same_on_every_rank"] = all(ranks[d, layout, q]["logits_err"] == got["logits_err"]
                                                   for q in range(WORLD))
        for case in ("g", "p_chunk"):
            if case in got:
                scale = max(float(w.abs().max()) for w in fsdp[0][case])
                row[f"{case}_max_abs_err"] = max(_max_diff(ranks[d, layout, q][case], fsdp[0][case])
                                                 for q in range(WORLD))
                row[f"{case}_scale"] = scale
                row[f"{case}_rel_err"] = row[f"{case}_max_abs_err"] / scale
                if d == "bf16":   # how far bf16 alone moves the FSDP engine's scores, for scale
                    row[f"{case}_fsdp_bf16_rel_err"] = _max_diff(fsdp_bf16[case], fsdp[0][case]) / scale
        results[f"{d}_{layout}"] = row
    record = json.loads((args.model / RECORD).read_text())
    out = {
        "what": __doc__.split("\n\n")[0],
        "command": " ".join(["OMP_NUM_THREADS=1 python benchmarks/megatron_smollm2.py",
                             f"--rows {args.rows} --max-new-tokens {args.max_new_tokens} --seed {args.seed}"]),
        "load": "2 cores shared with other test jobs (load average about 7) while it ran",
        "model": {"name": record["model"], "source": record["source"],
                  "safetensors_sha256": record["files"]["model.safetensors"],
                  "prepared_by": "verl-oar prepare-model smollm2"},
        "machine": {**machine_info(), "cpu_id": cpu_id()},
        "rows": {"n": len(texts), "prompt_tokens": [len(x) for x in rows["prompts"]],
                 "response_tokens": [len(x) for x in rows["responses"]], "responses": texts,
                 "sampler": "transformers generate (temperature 1, no top-k / top-p), seed " + str(args.seed)},
        "fsdp": {"ranks_equal": all(_max_diff(f[c], fsdp[0][c]) == 0 for f in fsdp for c in ("g", "p_chunk")),
                 "seconds_rank0": fsdp[0]["seconds"],
                 "reasoning_tokens": [int(x.sum()) for x in fsdp[0]["g_reasoning"]]},
        "results": results,
        "seconds": {"sampling": round(sampled, 1), "check_3_ranks": round(checked, 1)},
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["results"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
