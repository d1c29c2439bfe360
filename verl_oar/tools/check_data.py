"""``verl-oar check``'s data half: a sample of ``data.train_files`` (parquet) and of model responses, graded
with the package's own parts: how many ground truths verl-oar's math reward can parse
(``rewards.math_reward.verify_answer``: math-verify on ``\\boxed{ground_truth}``), how many answers the
answer locator finds (``algorithm.oar.answer_locator``, default ``core.answer_span.find_answer_span``).

Plain values out (dicts of ints and strings); nothing here stops a run except a train file that verl could
not read (missing prompt column), which :func:`sample_train_file` reports as ``refusal``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

GROUND_TRUTH = ("reward_model", "ground_truth")
"""where verl's RL dataset keeps a row's ground truth (``row["reward_model"]["ground_truth"]``)"""
REMOTE_PREFIXES = ("hdfs://", "s3://", "gs://", "http://", "https://")


def train_files(config) -> list[str]:
    """``data.train_files`` as a list of strings (verl takes a path or a list)."""
    files = config.data.get("train_files", None)
    if files is None:
        return []
    if isinstance(files, str):
        return [files]
    return [str(f) for f in files]


def read_rows(path: str | os.PathLike, limit: int, columns: list[str] | None = None) -> list[dict]:
    """The first ``limit`` rows of a parquet file as dicts (only ``columns`` when given and present)."""
    import pyarrow.parquet as pq

    handle = pq.ParquetFile(str(path))
    names = handle.schema_arrow.names
    wanted = [c for c in columns if c in names] if columns else None
    rows: list[dict] = []
    for batch in handle.iter_batches(batch_size=max(1, limit), columns=wanted):
        rows.extend(batch.to_pylist())
        if len(rows) >= limit:
            break
    return rows[:limit]


def ground_truth_of(row: dict) -> Any:
    node = row.get(GROUND_TRUTH[0])
    return node.get(GROUND_TRUTH[1]) if isinstance(node, dict) else None


def grade_ground_truths(truths: list[Any]) -> dict[str, int]:
    """{"math_verify": parsed by math-verify, "exact_only": non-empty but only gradable by exact string match,
    "missing": None or empty} over ``truths``. The reward's own rule: ``compute_score`` first compares stripped
    strings, then math-verify; ``verify_answer(t, t)`` is True exactly when math-verify parses ``\\boxed{t}``."""
    from verl_oar.rewards.verify_pool import verify_answer

    counts = {"math_verify": 0, "exact_only": 0, "missing": 0}
    for truth in truths:
        text = "" if truth is None else str(truth).strip()
        if not text:
            counts["missing"] += 1
        elif verify_answer(text, text):
            counts["math_verify"] += 1
        else:
            counts["exact_only"] += 1
    return counts


def sample_train_file(config, sample: int) -> dict:
    """The data section of the report: ``{"file", "rows", "ground_truths": {...}, "notes": [...],
    "refusal": str | None}``; ``file`` None when ``data.train_files`` is unset."""
    files = train_files(config)
    out: dict = {"file": files[0] if files else None, "files": len(files), "rows": 0, "ground_truths": None,
                 "notes": [], "refusal": None}
    if not files:
        out["notes"].append("data.train_files is not set: no data to sample")
        return out
    first = files[0]
    if first.startswith(REMOTE_PREFIXES):
        out["notes"].append(f"{first} is remote: not read here (verl copies it to local disk at start-up)")
        return out
    path = Path(os.path.expanduser(first))
    if not path.is_file():
        out["notes"].append(f"{first} is not a file on this machine: not sampled (the run fails at start-up if the "
                            "trainer's node cannot read it either)")
        return out
    try:
        rows = read_rows(path, sample)
    except Exception as err:  # noqa: BLE001 - any unreadable file is reported, not raised
        out["refusal"] = (f"data.train_files: {first} cannot be read as parquet ({type(err).__name__}: {err}). verl's RL "
                          "dataset reads parquet files; convert the data (e.g. python -m verl_oar.data.prepare_math).")
        return out
    out["rows"] = len(rows)
    prompt_key = str(config.data.get("prompt_key", "prompt") or "prompt")
    if rows and prompt_key not in rows[0]:
        out["refusal"] = (f"data.train_files: {first} has no column {prompt_key!r} (data.prompt_key), which verl's RL "
                          f"dataset reads the prompt from; its columns: {sorted(rows[0])}. Set data.prompt_key to the "
                          "prompt column, or rewrite the file with a chat-format 'prompt' column.")
        return out
    if rows and GROUND_TRUTH[0] not in rows[0]:
        out["notes"].append(f"no '{GROUND_TRUTH[0]}' column: verl's reward gets no ground truth (every response scores 0 "
                            "with verl-oar's math reward); add reward_model={'ground_truth': ...} to each row")
    out["ground_truths"] = grade_ground_truths([ground_truth_of(r) for r in rows])
    if len(files) > 1:
        out["notes"].append(f"sampled the first of {len(files)} train files")
    reward = str((config.get("reward", None) or {}).get("custom_reward_function", {}).get("path", None) or "")
    if "verl_oar.rewards.math_reward" not in reward:
        out["notes"].append("this run's reward is not verl-oar's math reward "
                            f"(reward.custom_reward_function.path={reward or 'unset: verl default'}): the counts say what "
                            "verl-oar's math reward would parse")
    return out


def read_responses(path: str | os.PathLike, key: str, limit: int) -> list[str]:
    """Up to ``limit`` texts of column / key ``key`` from a ``.parquet`` or a JSON-lines file."""
    path = Path(os.path.expanduser(str(path)))
    if not path.is_file():
        raise ValueError(f"--responses {path}: no such file. Give a .jsonl (one JSON object per line with a "
                         f"{key!r} key) or a .parquet file with a {key!r} column.")
    if path.suffix == ".parquet":
        rows = read_rows(path, limit, [key])
    else:
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"--responses {path}: line {number} is not JSON ({err.msg}). Give one JSON object "
                                 f"per line, e.g. {{\"{key}\": \"... \\\\boxed{{42}}\"}}, or a .parquet file.") from None
            if len(rows) >= limit:
                break
    if rows and not all(isinstance(r, dict) and key in r for r in rows):
        bad = next(i for i, r in enumerate(rows) if not (isinstance(r, dict) and key in r))
        raise ValueError(f"--responses {path}: row {bad + 1} has no {key!r} field. Name the field with --response-key.")
    return ["" if r[key] is None else str(r[key]) for r in rows]


def locate_answers(texts: list[str], locator_spec: str | None) -> dict:
    """{"responses", "found", "locator"}: how many ``texts`` the answer locator finds an answer in."""
    from verl_oar.core.answer_locator import load_answer_locator

    locate = load_answer_locator(locator_spec)
    found = sum(1 for t in texts if locate(t) is not None)
    name = (locator_spec or "").strip() or "built-in find_answer_span"
    return {"responses": len(texts), "found": found, "locator": name}
