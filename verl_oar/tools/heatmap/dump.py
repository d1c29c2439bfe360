"""Dump mode (``--dump``): the credit a run actually applied, read from one of its per-step dumps
(``+algorithm.oar.dump_dir``), drawn per response without any model forward.

    verl-oar heatmap --dump DIR/step_N.pt --config RUN_CONFIG [--rows 0,3,5]   # or --tokenizer MODEL_PATH

:func:`run` is the mode: the tokenizer from ``--tokenizer``, ``--model`` or the run's
``actor_rollout_ref.model.path``; the estimator from the dump's keys, checked against the run's
``algorithm.adv_estimator``; one view per row (below), written by ``outputs``.

A dump ``{dump_dir}/step_N.pt`` (``integration.dump.dump_step``) holds, every per-token tensor (bs, R) padded
to the batch's response length, on CPU:

* always: ``step``, ``keys``, ``prompts`` (a list of id lists, unpadded), ``responses`` (bs, R) ids,
  ``response_mask`` (bs, R), ``advantages`` (the advantages the policy loss received, after any composer),
  ``weights`` (the estimator's token weights w~), ``grpo_advantages`` (every estimator of verl-oar reads or keeps
  it), ``real_rows`` (bs,) bool when verl padded the batch;
* ``oar_g`` / ``oar_p``: ``oar_importance``, ``oar_reasoning_mask``, ``oar_answer_mask``, ``fallback``
  (``core.reshape.Fallback`` per row); the two are not told apart by their dumps (``--config`` names the
  run's ``algorithm.adv_estimator``);
* ``cscr``: ``cscr_pos_shift``, ``cscr_neg_shift``, ``cscr_scored``, ``sensitivity``;
* ``oppo``: ``oppo_evidence`` (nats, signed), ``oppo_scored``, ``rewards``, ``groups``, ``values`` (bs, R + 1): V_0
  (the prior) then the value after each token;
  ``weights`` = A_t * T / (R - V_0) (1 = GRPO's even credit, 0 on rows with R = V_0);
* ``acpo``: ``acpo_surrogate`` (H~, nats), ``acpo_entropy`` (verl's entropy; all 0 in bypass mode);
* ``codapo``: ``old_log_probs``, ``rm_scores``, ``codapo_value`` (bs,) v_q, ``rewards`` (verifier), ``weights``
  = v_q flat over the response;
* ``+algorithm.codapo.compose=true`` over any of the above: the inner estimator's keys plus CoDaPO's,
  ``inner_advantages`` (before the value) and ``advantages`` = v_q * inner. Under compose with OPPO, ``rewards``
  is CoDaPO's verifier reward (written last), not OPPO's ``token_level_rewards`` sum.

What one response's view shows (rows over its valid response tokens):

* score rows (each divided by its own max; negative values show as 0, the JSON keeps the signed values): the
  estimator's token signal: ``oar_importance``; ``sensitivity`` with ``|cscr_pos_shift|`` and
  ``|cscr_neg_shift|``; ``|oppo_evidence|`` and ``V_t after token``; ``acpo_surrogate``; CoDaPO's ``-old_log_probs``
  (the surprisal its confidence averages);
* w~ rows (centred at 1 = GRPO's even credit): the dumped ``weights`` of the estimator (``w~ <estimator>``), and
  ``w~ applied`` = A / A_grpo: the advantage the policy loss received divided by GRPO's advantage (1 where GRPO's
  is 0), i.e. the credit relative to GRPO's that the run applied (with compose: v_q times the inner weights; OPPO:
  its own scale, R - V_0 spread by the evidence, against GRPO's normalised advantage);
* masks: OAR's reasoning and answer tokens (OAR dumps only);
* the title: the row's GRPO advantage, reward, CoDaPO value, OAR fallback and OPPO/CSCR scored flags.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from verl_oar.tools.heatmap.inputs import DEFAULT_ROWS, HeatmapInputError, load_tokenizer, parse_rows
from verl_oar.tools.heatmap.outputs import View, write_report
from verl_oar.tools.heatmap.run_config import RunConfig

__all__ = ["DUMP_VIEWS", "DumpError", "dump_estimator", "dump_records", "load_dump", "run", "write_dump_outputs"]

DUMP_VIEWS = ("oar", "cscr", "oppo", "acpo", "codapo")
"""what a dump can show: OAR (``oar_g`` and ``oar_p`` dump the same keys), CSCR, OPPO, ACPO, CoDaPO"""
_SIGNATURE = (("oar", "oar_importance"), ("cscr", "cscr_pos_shift"), ("oppo", "oppo_evidence"),
              ("acpo", "acpo_surrogate"))
"""the key that marks each token estimator's dump, checked in this order"""
REQUIRED = ("responses", "response_mask", "prompts")


class DumpError(ValueError):
    """A dump that cannot be drawn; the message names the problem and the fix."""


def load_dump(path: str | Path) -> dict[str, Any]:
    """The dict ``dump_step`` saved; :class:`DumpError` if it is missing, unreadable or not a step dump."""
    path = Path(path)
    if not path.is_file():
        raise DumpError(f"--dump {path}: no such file. Give a step_N.pt written by the run's +algorithm.oar.dump_dir.")
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or foreign file: torch raises several kinds
        raise DumpError(f"--dump {path}: cannot be read by torch.load ({type(err).__name__}: {err}); give a step_N.pt "
                        "written by +algorithm.oar.dump_dir") from None
    missing = [k for k in REQUIRED if not isinstance(data, dict) or k not in data]
    if missing:
        raise DumpError(f"--dump {path}: not a verl-oar step dump (no {', '.join(missing)}); give a step_N.pt written "
                        "by +algorithm.oar.dump_dir (verl_oar.integration.dump)")
    return data


def dump_estimator(data: dict[str, Any], adv_estimator: str | None = None) -> tuple[str, bool]:
    """(view, composed): which estimator wrote ``data`` (one of :data:`DUMP_VIEWS`) and whether CoDaPO's value
    was composed over it. ``adv_estimator`` (the run's ``algorithm.adv_estimator``, from ``--config``) must agree."""
    composed = "inner_advantages" in data
    view = next((name for name, key in _SIGNATURE if key in data), "codapo" if "codapo_value" in data else None)
    if view is None:
        raise DumpError("the dump holds no estimator's token signal (oar_importance, cscr_pos_shift, oppo_evidence, "
                        "acpo_surrogate or codapo_value): it was not written by a verl-oar estimator step")
    if adv_estimator:
        expected = "oar" if adv_estimator in ("oar_g", "oar_p") else adv_estimator
        if expected != view:
            raise DumpError(f"--config says algorithm.adv_estimator={adv_estimator}, but the dump holds {view}'s "
                            "signals: give the config of the run that wrote this dump")
    return view, composed


def _per_row(data: dict, key: str, row: int, mask: torch.Tensor) -> list[float] | None:
    """``data[key]`` of one row at its valid response tokens (float64 list); OPPO's ``values`` (bs, R + 1) hold V_0
    first: the value after each token is ``values[:, 1:]``."""
    value = data.get(key)
    if not torch.is_tensor(value) or value.dim() != 2:
        return None
    if key == "values" and value.shape[1] == mask.shape[0] + 1:
        value = value[:, 1:]
    return value[row][mask].double().tolist()


def _scalar(data: dict, key: str, row: int) -> float | None:
    value = data.get(key)
    if torch.is_tensor(value) and value.dim() == 1 and len(value) > row:
        return float(value[row])
    return None


def _relative(applied: list[float], grpo: list[float]) -> list[float]:
    """applied / grpo per token; 1.0 where GRPO's advantage is 0 (both give no credit)."""
    return [a / g if g != 0 else 1.0 for a, g in zip(applied, grpo)]


def _scores(data: dict, view: str, row: int, mask: torch.Tensor) -> tuple[dict, dict]:
    """(heat rows shown by magnitude, their signed values) of one row's token signal."""
    names = {"oar": [("oar_importance", "oar_importance")],
             "cscr": [("sensitivity", "sensitivity"), ("|cscr_pos_shift|", "cscr_pos_shift"),
                      ("|cscr_neg_shift|", "cscr_neg_shift")],
             "oppo": [("|oppo_evidence|", "oppo_evidence"), ("V_t after token", "values")],
             "acpo": [("acpo_surrogate", "acpo_surrogate")],
             "codapo": [("-old_log_probs", "old_log_probs")]}[view]
    shown, signed = {}, {}
    for label, key in names:
        values = _per_row(data, key, row, mask)
        if values is None:
            continue
        if key == "old_log_probs":
            values = [-v for v in values]
        signed[label] = values
        shown[label] = [abs(v) for v in values] if label.startswith("|") else values
    return shown, signed


def dump_records(data: dict[str, Any], tokenizer, rows: Sequence[int] | None = None,
                 adv_estimator: str | None = None) -> tuple[list[dict], dict]:
    """One record per selected row (``rows``: dump row numbers; None: the first :data:`DEFAULT_ROWS` real rows)
    and a summary {estimator, composed, step, rows}. Each record holds ``tokens`` (T texts of the valid response
    tokens), ``scores`` / ``signed_scores`` / ``weights`` ({label: T floats}), ``masks`` ({label: T bools}),
    ``values`` (per-row numbers) and ``notes``."""
    view, composed = dump_estimator(data, adv_estimator)
    responses, response_mask = data["responses"], data["response_mask"].bool()
    bs = responses.shape[0]
    real = data.get("real_rows")
    real = torch.ones(bs, dtype=torch.bool) if real is None else torch.as_tensor(real).bool()
    if rows is None:
        rows = [r for r in range(bs) if real[r]][:DEFAULT_ROWS]
    bad = [r for r in rows if not 0 <= r < bs]
    if bad:
        raise DumpError(f"--rows {','.join(map(str, bad))}: out of range, the dump has {bs} rows (0..{bs - 1})")
    from verl_oar.core.answer_span import token_texts

    records = []
    for row in rows:
        mask = response_mask[row]
        ids = responses[row][mask].tolist()
        notes = [] if real[row] else ["a synthetic padding row verl appended (is_padding): not trained on"]
        grpo = _per_row(data, "grpo_advantages", row, mask)
        applied = _per_row(data, "advantages", row, mask)
        scores, signed = _scores(data, view, row, mask)
        weights = {}
        dumped = _per_row(data, "weights", row, mask)
        if dumped is not None:
            weights[f"w~ {view}"] = dumped
        if applied is not None and grpo is not None:
            weights["w~ applied"] = _relative(applied, grpo)
        masks = {}
        if view == "oar":
            for label, key in (("reasoning", "oar_reasoning_mask"), ("answer", "oar_answer_mask")):
                values = _per_row(data, key, row, mask)
                if values is not None:
                    masks[label] = [bool(v) for v in values]
        values = {
            "grpo_advantage": next((g for g in grpo or [] if g != 0), 0.0) if grpo is not None else None,
            "reward": _scalar(data, "rewards", row),
            "codapo_value": _scalar(data, "codapo_value", row),
        }
        if view == "oppo" and torch.is_tensor(data.get("values")):
            values["V_0"] = float(data["values"][row, 0])
        if view == "oar" and _scalar(data, "fallback", row) is not None:
            from verl_oar.core.reshape import Fallback

            values["fallback"] = Fallback(int(_scalar(data, "fallback", row))).name
        for flag in ("cscr_scored", "oppo_scored"):
            if flag in data:
                values[flag.split("_")[0] + "_scored"] = bool(data[flag][row].bool().any())
        if view == "codapo" or composed:
            notes.append("CoDaPO's value v_q is one number per question (group): it scales every token alike")
        prompt_ids = data["prompts"][row]
        prompt_ids = prompt_ids.tolist() if torch.is_tensor(prompt_ids) else list(prompt_ids)
        records.append({
            "row": row, "real": bool(real[row]), "prompt_ids": prompt_ids, "response_ids": ids,
            "prompt": tokenizer.decode(prompt_ids, skip_special_tokens=False),
            "response": tokenizer.decode(ids, skip_special_tokens=False),
            "tokens": token_texts(ids, tokenizer), "scores": scores, "signed_scores": signed, "weights": weights,
            "advantages": applied, "grpo_advantages": grpo,
            "inner_advantages": _per_row(data, "inner_advantages", row, mask), "masks": masks,
            "values": {k: v for k, v in values.items() if v is not None}, "notes": notes,
        })
    step = data.get("step")
    summary = {"estimator": view, "composed": composed, "step": None if step is None else int(step),
               "batch_rows": bs, "rows": list(rows)}
    return records, summary


def _view(record: dict, summary: dict, source: str) -> View:
    """One response's figure: its score rows, w~ rows and masks as dumped, and a title with its values."""
    name = summary["estimator"] + (" + codapo.compose" if summary["composed"] else "")
    values = " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record["values"].items())
    prompt = " ".join(record["prompt"].split())
    lines = [f"step {summary['step']} row {record['row']} | {name} | {source}" + (f" | {values}" if values else ""),
             f"prompt: {prompt if len(prompt) <= 120 else '…' + prompt[-119:]}"]
    title = "\n".join(lines + [f"note: {n}" for n in record["notes"]])
    return list(record["scores"].items()), list(record["weights"].items()), list(record["masks"].items()), title


def write_dump_outputs(report: dict, out: Path, wrap: int) -> None:
    """heatmap_<row>.png, heatmap.html and heatmap.json in ``out``; their paths go into ``report["files"]``."""
    source = report["dump"] if len(report["dump"]) <= 60 else "…" + report["dump"][-59:]
    views = [_view(record, report["config"], source) for record in report["rows"]]
    write_report(report, views, out, wrap, f"Credit applied: {report['dump']}")


def run(args, run_config: RunConfig | None) -> dict:
    """``--dump``: the credit the run applied, per row, from its step dump; no model. The tokenizer: ``--tokenizer``,
    else ``--model``, else the run's ``actor_rollout_ref.model.path``; the estimator's name: the dump's keys, checked
    against the run's ``algorithm.adv_estimator`` (which also tells ``oar_g`` from ``oar_p``)."""
    path = args.tokenizer or args.model or (run_config.model_path if run_config is not None else None)
    if not path:
        raise HeatmapInputError("--dump needs a tokenizer to decode the dumped token ids: give --tokenizer PATH "
                                "(the run's actor_rollout_ref.model.path)")
    try:
        data = load_dump(args.dump)
        tokenizer = load_tokenizer(path)
        records, summary = dump_records(data, tokenizer, parse_rows(args.rows),
                                        run_config.adv_estimator if run_config is not None else None)
    except DumpError as err:
        raise HeatmapInputError(str(err)) from None
    if run_config is not None and summary["estimator"] == "oar" and run_config.adv_estimator in ("oar_g", "oar_p"):
        summary["estimator"] = run_config.adv_estimator
    report = {"dump": str(args.dump), "tokenizer": path, "config": {**summary, "run_config": args.config},
              "rows": records}
    write_dump_outputs(report, Path(args.out), args.wrap)
    return report
