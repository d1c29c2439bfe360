"""Rollouts mode (``--model``): recompute each estimator's credit of given responses with a Hugging Face causal LM,
with the run's settings (``--config``), and draw it.

    verl-oar heatmap --model HF_DIR --config RUN_CONFIG --rollouts FILE [--rows 0,3,5]
    verl-oar heatmap --model HF_DIR --prompt TEXT --response TEXT [--estimators oar_g,oar_p,cscr,oppo,acpo]

Per response, in the order :func:`run` goes:

1. the responses: ``--prompt`` / ``--response``, or rows of ``--rollouts`` (:func:`items_to_score`); prompt and
   response ids and the answer masks (``inputs``: the chat template as verl's dataset applies it, the answer located
   by ``core.answer_span`` with the run's ``algorithm.oar.answer_locator``); a response with no answer is reported
   and skipped;
2. the settings (``settings.resolve_settings``): flags, else the run's config, else training's defaults, each
   printed with its source on stderr;
3. each estimator's scores and weights (``scoring.score_sample``); OPPO needs the reference answer (``--ground-truth``
   or the rollouts' ``--ground-truth-key`` column) and the response's reward (``--reward``); ACPO the response's
   GRPO advantage (``--advantage``). CoDaPO is refused here: its value needs the question's whole group (``--dump``
   shows it);
4. an oracle (``main(oracle=...)`` or ``--oracle MODULE:FUNCTION``), drawn under the scores;
5. the files (``outputs``).

From verl's checkpoint to the folder ``--model`` reads (verl 0.9.1, ``verl/model_merger``; checked on a
2-rank FSDP2 checkpoint saved by verl's ``FSDPCheckpointManager``, tests/unit/test_heatmap_checkpoint_on_cpu.py)::

    python -m verl.model_merger merge --backend fsdp \
        --local_dir <trainer.default_local_dir>/global_step_N/actor --target_dir <hf_dir>
    # Megatron: --backend megatron (add --tie-word-embedding for tied models)

The merger writes the weights in bfloat16 (it casts every shard), with the config and tokenizer from the
checkpoint's ``huggingface/`` folder; ``--dtype float32`` upcasts them on load.

Departures from a training step, stated:

1. The response is re-tokenised from its text, so its ids can differ from the sampled ones where
   a tokenizer has several encodings of one text. verl's rollout dump (``trainer.rollout_data_dir``,
   keys ``input`` / ``output``) decodes with ``skip_special_tokens=True``: its ``input`` is the
   prompt after the chat template minus the special tokens, so it is tokenised as raw text (the
   template is not applied again) and the role markers the policy saw are missing.
2. OAR-G's noise comes from one generator seeded with ``--seed``, not from the worker's per-sequence
   draws of (seed, step, tokens): the same sequence gets other noise than in training.
3. The OAR-P neutral token defaults to the worker's (the pad token, else eos); ``space`` occludes
   with a space, as the testbed's quality report does.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from verl_oar.core.answer_locator import load_answer_locator
from verl_oar.core.privileged_prompt import ground_truth
from verl_oar.tools.heatmap.inputs import (
    DUMP_PROMPT_KEY,
    GROUND_TRUTH_KEYS,
    HeatmapInputError,
    load_tokenizer,
    make_sample,
    parse_rows,
    pick_key,
    read_records,
    read_rollouts,
)
from verl_oar.tools.heatmap.outputs import View, write_report
from verl_oar.tools.heatmap.scoring import DEFAULT_ESTIMATORS, Oracle, neutral_id, run_estimators, score_sample
from verl_oar.tools.heatmap.settings import flag_name, print_settings, resolve_settings
from verl_oar.tools.heatmap.run_config import RunConfig
from verl_oar.tools.heatmap.modal import CODAPO_NEEDS_GROUP
from verl_oar.tools.heatmap.privileged import PRIVILEGED

__all__ = ["items_to_score", "load_oracle", "run"]


def items_to_score(args, estimators: Sequence[str] = ()) -> tuple[list[tuple[int, Any, Any]], bool]:
    """(row, prompt, response) to score and whether text prompts get the chat template."""
    if args.rollouts is None:
        if args.prompt is None or args.response is None:
            raise HeatmapInputError("give --prompt TEXT and --response TEXT, or --rollouts FILE")
        if args.rows or args.prompt_key or args.response_key or args.ground_truth_key:
            raise HeatmapInputError("--rows / --prompt-key / --response-key / --ground-truth-key only apply to --rollouts")
        return [(0, args.prompt, args.response)], args.chat_template is not False
    if args.prompt is not None or args.response is not None or args.ground_truth is not None:
        raise HeatmapInputError("give either --prompt/--response (and --ground-truth) or --rollouts, not both")
    items, p_key = read_rollouts(args.rollouts, parse_rows(args.rows), args.prompt_key, args.response_key)
    if p_key == DUMP_PROMPT_KEY and set(estimators) & set(PRIVILEGED):
        raise HeatmapInputError(
            f"--rollouts {args.rollouts}: its prompt column {DUMP_PROMPT_KEY!r} (verl's rollout dump) holds the prompt "
            "after the chat template, and cscr/oppo rewrite the prompt's user turn; give a file whose prompt column "
            "holds the chat messages (e.g. the training parquet's 'prompt' beside a 'response' column), or "
            "--prompt/--response, or drop cscr/oppo from --estimators")
    default = p_key != DUMP_PROMPT_KEY  # verl's dump is already templated (departure 1)
    return items, default if args.chat_template is None else args.chat_template


def _ground_truths(args, rows: Sequence[int]) -> dict[int, str]:
    """OPPO's reference answer per row: --ground-truth, or the rollouts' column (verl's ``reward_model``
    dicts included)."""
    if args.rollouts is None:
        if args.ground_truth is None:
            raise HeatmapInputError("--estimators oppo needs the reference answer: give --ground-truth TEXT")
        return {row: args.ground_truth for row in rows}
    path = Path(args.rollouts)
    records = read_records(path)
    key = pick_key(records, args.ground_truth_key, GROUND_TRUTH_KEYS, "--ground-truth-key", path)
    out = {}
    for row in rows:
        value = records[row][key]
        try:
            out[row] = ground_truth(value) if isinstance(value, dict) else str(value)
        except ValueError as err:
            raise HeatmapInputError(f"--rollouts {path}: row {row}: {err}") from None
    return out


def load_oracle(spec: str) -> Oracle:
    """The oracle named ``MODULE:FUNCTION`` (see ``scoring.Oracle``), imported."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise HeatmapInputError(f"--oracle {spec!r}: give MODULE:FUNCTION, e.g. "
                                "verl_oar.testbed.pick_max:heatmap_oracle")
    try:
        oracle = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise HeatmapInputError(f"--oracle {spec!r}: cannot load it ({err})") from None
    if not callable(oracle):
        raise HeatmapInputError(f"--oracle {spec!r}: {name} is not a function")
    return oracle


def _load_model(path: str, dtype: str, device: str | None):
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise HeatmapInputError("--device cuda: no CUDA device is available; use --device cpu")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as err:
        raise HeatmapInputError(f"--model {path}: cannot load a causal LM ({err})") from None
    return model.to(device).eval()


def run(args, run_config: RunConfig | None, oracle: Oracle | None = None) -> dict:
    """Score, draw and write; returns the JSON content. ``run_config``: the ``--config`` files read (None without);
    ``oracle``: see ``scoring.Oracle`` (default: the one ``--oracle`` names, if any). Raises
    :class:`HeatmapInputError` on bad input, before any model is loaded where it can."""
    estimators, estimators_source = run_estimators(args.estimators, run_config and run_config.adv_estimator,
                                                   DEFAULT_ESTIMATORS)
    if "codapo" in estimators:
        raise HeatmapInputError(CODAPO_NEEDS_GROUP)
    for flag in ("oar_p_budget", "oar_p_max_tokens", "oar_p_refine_top", "oar_p_refine_unit"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise HeatmapInputError(f"{flag_name(flag)} {getattr(args, flag)}: must be >= 1")
    if args.temperature is not None and not args.temperature > 0:
        raise HeatmapInputError(f"--temperature {args.temperature}: must be > 0")
    if not 0.0 <= args.reward <= 1.0:
        raise HeatmapInputError(f"--reward {args.reward}: OPPO reads it as the response's success probability, in [0, 1]")
    settings = resolve_settings(args, run_config, estimators)
    settings.sources = {"estimators": {"value": ",".join(estimators), "source": estimators_source},
                        **settings.sources}
    print_settings(settings.sources)
    if "oppo" in estimators and settings.oppo.oracle != "self":
        print(f"verl_oar.tools.heatmap: the run's OPPO oracle is {settings.oppo.oracle!r} (algorithm.oppo.teacher: "
              f"{settings.oppo.teacher_path}); this heatmap scores the oracle prompt with --model {args.model} itself: "
              "give the teacher's folder as --model to see the teacher's evidence", file=sys.stderr)
    items, chat_template = items_to_score(args, estimators)  # file, keys and rows are checked before any model loads
    answers = _ground_truths(args, [row for row, _, _ in items]) if "oppo" in estimators else {}
    tokenizer = load_tokenizer(args.model)
    neutral = neutral_id(tokenizer, settings.neutral) if "oar_p" in estimators else None
    if oracle is None and args.oracle:
        oracle = load_oracle(args.oracle)
    try:
        locator = load_answer_locator(settings.answer_locator)
    except ValueError as err:
        raise HeatmapInputError(str(err)) from None
    samples, skipped = [], []
    for row, prompt, response in items:
        try:
            samples.append(make_sample(row, prompt, response, tokenizer, chat_template, locator))
        except HeatmapInputError as err:
            skipped.append({"row": row, "reason": str(err)})
            print(f"verl_oar.tools.heatmap: row {row} skipped: {err}", file=sys.stderr)
    if not samples:
        raise HeatmapInputError(
            f"no response could be scored ({len(skipped)} skipped): " + "; ".join(
                f"row {s['row']}: {s['reason']}" for s in skipped
            )
        )
    model = _load_model(args.model, args.dtype, args.device)
    with torch.no_grad():  # OAR-G re-enables grad for its own pass
        records = [score_sample(model, tokenizer, s, estimators, settings, neutral, oracle=oracle,
                                answer=answers.get(s.row), reward=args.reward, advantage=args.advantage)
                   for s in samples]
    report = {
        "model": args.model,
        "config": {
            "estimators": estimators, "oar_p_mode": settings.oar.perturb_mode,
            "oar_p_budget": settings.oar.perturb_budget, "neutral": settings.neutral, "neutral_id": neutral,
            "temperature": settings.temperature, "seed": settings.seed,
            "reward": args.reward if "oppo" in estimators else None,
            "advantage": args.advantage if "acpo" in estimators else None,
            "run_config": args.config, "settings": settings.sources,
            "oracle": args.oracle or (oracle and getattr(oracle, "__qualname__", repr(oracle))), "dtype": args.dtype,
            "device": str(next(model.parameters()).device),
            "gradient": asdict(settings.oar.gradient_config()), "reshape": asdict(settings.oar.reshape_config()),
        },
        "rows": records,
        "skipped": skipped,
    }
    model_name = args.model if len(args.model) <= 60 else "…" + args.model[-59:]
    write_report(report, [_view(record, estimators, model_name) for record in records], Path(args.out), args.wrap,
                 f"OAR token importance: {args.model}")
    return report


def _view(record: dict, estimators: list[str], model: str) -> View:
    """One response's figure: every estimator's scores and weights, the reasoning / answer / oracle masks."""
    rows = [(name, record["scores"][name]) for name in estimators]
    weights = [(f"w~ {name}", record["weights"][name]) for name in estimators]
    masks = [("reasoning", record["reasoning"]), ("answer", record["answer"])]
    if record.get("oracle"):
        masks += [(f"oracle {name}", mask) for name, mask in record["oracle"].items()]
    prompt = " ".join(record["prompt"].split())
    fallback = ", ".join(f"{k}: {v}" for k, v in record["fallback"].items() if v != "NONE")
    lines = [f"row {record['row']} | {model} | {sum(record['reasoning'])} reasoning tokens | answer "
             f"{record['answer_text']!r}" + (f" | fallback {fallback}" if fallback else ""),
             f"prompt: {prompt if len(prompt) <= 120 else '…' + prompt[-119:]}"]
    return rows, weights, masks, "\n".join(lines + [f"note: {n}" for n in record["notes"]])
