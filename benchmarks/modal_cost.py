"""Cost of ACPO's modal surrogate: verl's old-log-prob pass with the top-1 log-prob (``engines.fsdp.modal``)
as a ratio to the same pass without it, through verl's real FSDP2 engine (in-process worker, one-rank gloo
group, CPU), same batch, same run.

    python benchmarks/modal_cost.py [--rows 16] [--mean-response 2400] [--hidden 128] [--layers 4]
        [--vocabs 0,12672] [--rounds 7] [--out FILE]

For each output-layer size in ``--vocabs`` (0: the byte tokenizer's 260 ids; 12672 = 99 x hidden, Qwen2.5-Math-1.5B's
vocabulary-to-hidden ratio, 151936 / 1536), rows (medians over ``--rounds`` round-robin rounds):

- ``old-log-prob pass``: the worker's ``compute_log_prob`` with ``calculate_entropy=True`` at temperature 1,
  what verl's old-log-prob step runs (the baseline, 1.0);
- ``with the top-1 log-prob``: the same call marked ``oar_acpo_modal`` (what ACPO's ``surrogate=modal`` runs).

The extra work is one max and one logsumexp over the vocabulary per position, so its share grows with the
vocabulary relative to the model: the byte-vocabulary row is a lower bound, the 12672 row (vocabulary / parameters
about 30x Qwen2.5-Math-1.5B's, since the tiny model's body is small) a pessimistic one. Batch shape, model and
one sequence per micro-batch as ``benchmarks/privileged_cost.py`` (its docstring says why). Absolute times depend on
the machine (reported); the ratios are the finding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_worker import build_worker  # noqa: E402
from privileged_cost import (  # noqa: E402
    _one_rank_env,
    _parameters,
    add_shape_arguments,
    build_model_dir,
    rollout,
    round_robin,
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(parser)
    parser.add_argument("--vocabs", default="0,12672", help="output-layer sizes, comma-separated (0: the tokenizer's)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    _one_rank_env()

    from transformers import AutoTokenizer
    from verl.utils import tensordict_utils as tu

    from verl_oar.testbed.machine import machine_info

    root = Path(tempfile.mkdtemp(prefix="modal_cost_"))
    shapes = {}
    for vocab in (int(v) for v in args.vocabs.split(",")):
        model_dir = build_model_dir(root, f"model_{vocab}", args.hidden, args.layers, seed=0, vocab=vocab or None)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        _, prompts, responses, _ = rollout(tokenizer, args.rows, args.prompt_chars, args.mean_response, 0)
        longest = max(len(p) + len(r) for p, r in zip(prompts, responses)) + 128
        worker = build_worker(model_dir, args.rows, max(4096, longest), None)
        rows = [{"prompts": p, "responses": r, "response_mask": torch.ones_like(r), "loss_mask": torch.ones_like(r),
                 "input_ids": torch.cat([p, r]), "position_ids": torch.arange(len(p) + len(r))}
                for p, r in zip(prompts, responses)]

        def run(modal: bool) -> None:
            data = tu.list_of_dict_to_tensordict(rows)
            tu.assign_non_tensor(data, temperature=1.0, calculate_entropy=True, compute_loss=False)
            if modal:
                tu.assign_non_tensor(data, oar_acpo_modal=True)
            worker.compute_log_prob(data)

        times = round_robin({"old-log-prob pass": lambda: run(False), "with the top-1 log-prob": lambda: run(True)},
                            args.rounds)
        base = statistics.median(times["old-log-prob pass"])
        config = json.loads((model_dir / "config.json").read_text())
        shapes[str(config["vocab_size"])] = {
            "vocab": config["vocab_size"], "parameters": _parameters(model_dir),
            "rows": {name: {"median_s": round(statistics.median(ts), 4), "ratio": round(statistics.median(ts) / base, 3),
                            "min_ratio": round(min(ts) / base, 3), "max_ratio": round(max(ts) / base, 3)}
                     for name, ts in times.items()},
            # per round, pass with / pass without (the pairs ran back to back)
            "paired_ratios": [round(b / a, 3) for a, b in zip(times["old-log-prob pass"], times["with the top-1 log-prob"])],
        }
        worker = None  # free the engine before the next vocabulary's
    result = {
        "command": "python benchmarks/modal_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
        "shape": {"rows": args.rows, "hidden": args.hidden, "layers": args.layers,
                  "prompt_tokens_mean": statistics.mean(len(p) for p in prompts),
                  "response_tokens_mean": statistics.mean(len(r) for r in responses)},
        "rounds": args.rounds,
        "vocabularies": shapes,
    }
    print(f"{'vocab':>7s} {'row':26s} {'median s':>9s} {'x old-log-prob':>15s}  (range)   paired ratios")
    for vocab, shape in shapes.items():
        for name, row in shape["rows"].items():
            paired = shape["paired_ratios"] if name != "old-log-prob pass" else ""
            print(f"{vocab:>7s} {name:26s} {row['median_s']:9.3f} {row['ratio']:15.3f}  "
                  f"({row['min_ratio']:.2f}-{row['max_ratio']:.2f}) {paired}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
