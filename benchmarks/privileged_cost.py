"""Cost of CSCR's and OPPO's privileged re-scoring pass as a ratio to the old-log-prob pass, through
verl's real FSDP2 engine (in-process worker, one-rank gloo group, CPU), same batch, same run.

    python benchmarks/privileged_cost.py [--rows 16] [--prompt-chars 600] [--mean-response 2400]
        [--hidden 128] [--layers 4] [--teacher-hidden 256] [--rounds 7] [--out FILE]

Rows (each the median over ``--rounds`` round-robin rounds, divided by the old-log-prob pass's):

- ``old-log-prob pass``: the worker's ``compute_log_prob`` on the rollout rows (what verl's
  old-log-prob step runs; the baseline, 1.0);
- ``OPPO self``: the pass as ``integration.privileged_signal.rescore`` runs it minus the TransferQueue
  round trip: the rows built by ``privileged_rows`` (verl's rollout token builder renders every
  rewritten prompt) and one ``compute_log_prob`` call at the rollout temperature;
- ``CSCR (2 conditions, one call)``: the same with CSCR's two templates, 2x the rows in one call;
- ``CSCR, one call per condition``: what batching the two conditions saves;
- ``OPPO teacher``: OPPO's teacher oracle, a frozen model built beside the actor (``integration.teacher``,
  hidden ``--teacher-hidden``, the actor's layers and tokenizer: about (teacher/actor hidden)^2 the
  actor's parameters, reported), scoring the rollout prompt and the oracle prompt in one call.

``x tokens`` is the tokens the pass feeds the model over the rollout rows' tokens: the time ratio
divided by it is what the pass costs beyond its tokens.

One sequence per micro-batch (``log_prob_micro_batch_size_per_gpu=1``, no dynamic batch size): CPU
has no variable-length attention kernel, and packing several sequences into one forward here costs
attention over the whole pack, which a GPU's varlen kernels do not; one sequence per forward keeps the
cost per sequence as on a GPU. The model is a random tiny Qwen2 with the CPU workspace's byte tokenizer (one token per character).
Every length is in characters, so the shares carry over to a BPE tokenizer at ~4 characters per token
(Qwen's on English math text; not measured here): the default 600-character question and 2400-character
mean response stand for ~150 + ~600 BPE tokens (a MATH prompt and a mid-length response), and CSCR's
conditions (~87 characters added) and OPPO's hint (~35) for ~20 and ~9 tokens. Prompts are a system
turn and a math question padded to ``--prompt-chars``; response lengths are drawn like a rollout's
(log-normal around ``--mean-response``, many short, a few long), fixed by a seed. Absolute times depend on the machine (reported); the ratios are the finding.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_worker import build_worker  # noqa: E402  (the benchmarks' one engine worker)


def _one_rank_env() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    for key, val in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        os.environ.setdefault(key, val)


def build_model_dir(root: Path, name: str, hidden: int, layers: int, seed: int, vocab: int | None = None) -> Path:
    """A random tiny Qwen2 (``hidden``, ``layers``) with the CPU workspace's byte tokenizer, in ``root/name``:
    the actor (seed 0) and OPPO's teacher stand-in (another size and seed, the same tokenizer). ``vocab``: the
    output layer's size (None: the tokenizer's; larger, the ids used stay the tokenizer's)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_oar.cpu.workspace import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab or len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False, torch_dtype="float32",
    )
    Qwen2ForCausalLM(config).save_pretrained(root / name)
    tokenizer.save_pretrained(root / name)
    return root / name


def rollout(tokenizer, rows: int, prompt_chars: int, mean_response: int, seed: int):
    """(messages, prompt ids, response ids, answers): chat-rendered prompts, random responses."""
    rng = random.Random(seed)
    messages, prompts, responses, answers = [], [], [], []
    for i in range(rows):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        question = f"Compute {a} + {b}. " + "Show every step of the computation. " * (prompt_chars // 30 + 1)
        m = [{"role": "system", "content": "Please reason step by step."},
             {"role": "user", "content": question[:prompt_chars]}]
        messages.append(m)
        prompts.append(torch.tensor(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                                  return_dict=False), dtype=torch.long))
        length = max(8, min(8 * mean_response, int(rng.lognormvariate(0, 0.8) * mean_response / 1.38)))
        responses.append(torch.randint(3, len(tokenizer) - 3, (length,), generator=torch.Generator().manual_seed(i)))
        answers.append(str(a + b))
    return messages, prompts, responses, answers


def add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """The rollout's and the model's shape (``--rows``, ``--prompt-chars``, ``--mean-response``, ``--hidden``,
    ``--layers``), the same here and in ``modal_cost``, which times its pass on these rows and model."""
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-chars", type=int, default=600)
    parser.add_argument("--mean-response", type=int, default=2400)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--teacher-hidden", type=int, default=256, help="hidden size of OPPO's teacher stand-in")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    _one_rank_env()

    from transformers import AutoTokenizer
    from verl.utils import tensordict_utils as tu
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from verl_oar.core.privileged_prompt import CSCR_NEGATIVE, CSCR_POSITIVE, OPPO_ORACLE
    from verl_oar.integration.privileged_signal import RescoreStats, privileged_rows
    from verl_oar.testbed.machine import machine_info

    root = Path(tempfile.mkdtemp(prefix="privileged_cost_"))
    model_dir = build_model_dir(root, "model", args.hidden, args.layers, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages, prompts, responses, answers = rollout(tokenizer, args.rows, args.prompt_chars, args.mean_response, 0)
    longest = max(len(p) + len(r) for p, r in zip(prompts, responses)) + 128
    teacher_dir = build_model_dir(root, "teacher", args.teacher_hidden, args.layers, seed=1)
    worker = build_worker(model_dir, args.rows, max(4096, longest), teacher_dir)
    builder = create_continuous_token_builder(tokenizer, hf_model_type="qwen2", chat_template_kwargs={})
    keys = [f"k{i}" for i in range(args.rows)]
    masks = [torch.ones_like(r) for r in responses]
    added: dict[str, list[int]] = {}
    fed: dict[str, int] = {}
    """tokens fed to the model per pass, by row name"""

    def score(rows: list[dict], teacher: bool = False) -> None:
        data = tu.list_of_dict_to_tensordict(rows)
        tu.assign_non_tensor(data, temperature=1.0, calculate_entropy=False, compute_loss=False)
        (worker.compute_teacher_log_prob if teacher else worker.compute_log_prob)(data)

    def rollout_pass() -> None:
        score([{"prompts": p, "responses": r, "response_mask": m, "loss_mask": m, "input_ids": torch.cat([p, r]),
                "position_ids": torch.arange(len(p) + len(r))} for p, r, m in zip(prompts, responses, masks)])

    def privileged(name: str, method: str, templates: list, calls: int = 1, teacher: bool = False):
        def run() -> None:
            tokens = 0
            for group in ([templates] if calls == 1 else [[t] for t in templates]):
                stats = RescoreStats()
                built = privileged_rows(group, keys, messages, prompts, responses, masks, answers, [False] * len(keys),
                                        builder.build_initial_tokens, float("inf"), "truncate", stats)
                added[method] = stats.prompt_tokens_added
                tokens += sum(len(row["input_ids"]) for row in built.rows)
                score(built.rows, teacher)
            fed[name] = tokens
        return run

    timers = {
        "old-log-prob pass": rollout_pass,
        "OPPO self": privileged("OPPO self", "OPPO", [OPPO_ORACLE]),
        "CSCR (2 conditions, one call)": privileged("CSCR (2 conditions, one call)", "CSCR", [CSCR_POSITIVE, CSCR_NEGATIVE]),
        "CSCR, one call per condition": privileged("CSCR, one call per condition", "CSCR", [CSCR_POSITIVE, CSCR_NEGATIVE],
                                                   calls=2),
        "OPPO teacher": privileged("OPPO teacher", "OPPO", [None, OPPO_ORACLE], teacher=True),
    }
    times = round_robin(timers, args.rounds)
    base = statistics.median(times["old-log-prob pass"])
    rollout_tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    fed["old-log-prob pass"] = rollout_tokens
    result = {
        "command": "python benchmarks/privileged_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
        "shape": {"rows": args.rows, "hidden": args.hidden, "layers": args.layers, "teacher_hidden": args.teacher_hidden,
                  "teacher_to_actor_parameters": round(_parameters(teacher_dir) / _parameters(model_dir), 2),
                  "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
                  "response_tokens_mean": statistics.mean(len(r) for r in responses),
                  "response_tokens_max": max(len(r) for r in responses), "rollout_tokens": rollout_tokens,
                  "prompt_tokens_added_mean": {k: statistics.mean(v) for k, v in added.items()}},
        "rounds": args.rounds,
        "rows": {name: {"median_s": round(statistics.median(ts), 4), "ratio": round(statistics.median(ts) / base, 3),
                        "min_ratio": round(min(ts) / base, 3), "max_ratio": round(max(ts) / base, 3),
                        "token_ratio": round(fed[name] / rollout_tokens, 3)}
                 for name, ts in times.items()},
    }
    print(f"{'row':34s} {'median s':>9s} {'x old-log-prob':>15s}  {'(range)':>11s} {'x tokens':>9s}")
    for name, row in result["rows"].items():
        print(f"{name:34s} {row['median_s']:9.3f} {row['ratio']:15.3f}  ({row['min_ratio']:.2f}-{row['max_ratio']:.2f})"
              f" {row['token_ratio']:9.3f}")
    print(json.dumps(result["shape"]))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def round_robin(timers: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each timer's call per round: one warm-up call each, then ``rounds`` rounds calling every
    timer once, in order (so a slow spell of the machine hits every row of a round alike)."""
    for fn in timers.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, fn in timers.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _parameters(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


if __name__ == "__main__":
    main()
