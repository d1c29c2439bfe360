"""Write the math train and eval sets of OAR recipes as verl RL parquet files.

    python -m verl_oar.data.prepare_math --out DIR [--source NAME=PATH_OR_HUB ...]
                                         [--only train|eval] [--max-rows N]

Outputs (fixed names the recipes use), rows in verl's RL format (``math_sources.make_row``):

    DIR/train.parquet       MATH levels 3-5 (train split) + GSM8K train, shuffled (seed 0)
    DIR/math500.parquet     MATH-500
    DIR/aime24.parquet      AIME 2024
    DIR/amc23.parquet       AMC 2023
    DIR/minerva.parquet     Minerva Math
    DIR/gsm8k_test.parquet  GSM8K test

Sources (names in ``math_sources.SOURCES``: math_l3to5, gsm8k, math500, aime24, amc23, minerva,
gsm8k_test) are read from their default hub dataset unless ``--source NAME=VALUE`` says otherwise.
VALUE is one of:

- a single ``.parquet`` / ``.json`` / ``.jsonl`` file: all its rows are the source (no split);
- a directory written by ``datasets.save_to_disk``: a ``Dataset``, or a ``DatasetDict`` from which
  the source's split is taken;
- another directory of parquet/json/jsonl files (e.g. a clone of the hub repo): read with
  ``datasets.load_dataset(DIR)``, splits inferred from file names; if it has a sub-directory named
  like the source's config (``main/`` of ``openai/gsm8k``) that sub-directory is read. The source's
  split is used, or the only split there is;
- a hub dataset id (``owner/name``), read with the source's config and split.

``--max-rows N`` reads at most the first N rows of each source (before any filtering).
Rows whose answer cannot be read, or whose problem is empty, are dropped and counted; MATH rows
outside levels 3-5 are filtered and counted. The summary prints every count.
Errors in the input (unknown source name, missing file, missing column, missing split) stop the
run with a message that names the problem and the fix, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_oar.data.math_sources import (
    EVAL_OUTPUTS,
    OUTPUTS,
    SOURCES,
    TRAIN_OUTPUTS,
    MathSource,
    ground_truth_of,
    make_row,
    parse_level,
)

SHUFFLE_SEED = 0
"""seed of the train-set shuffle (fixed: the same inputs always give the same file)"""

FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}
"""single-file extensions and the ``datasets`` builder that reads them"""


class PrepareError(Exception):
    """Bad input: the message names the problem and the fix."""


# ---------------------------------------------------------------------------------------------
# 1. Reading a source
# ---------------------------------------------------------------------------------------------


def _looks_like_path(value: str) -> bool:
    return (
        value.startswith(("/", "~", "."))
        or value.count("/") != 1
        or Path(value).suffix in FILE_BUILDERS
    )


def _pick_split(dataset_dict: Any, source: MathSource, where: str):
    splits = list(dataset_dict.keys())
    if source.split in splits:
        return dataset_dict[source.split], source.split
    if len(splits) == 1:
        return dataset_dict[splits[0]], splits[0]
    raise PrepareError(
        f"source {source.name!r} ({where}): no split {source.split!r}; the splits there are {splits}. "
        f"Fix: pass a dataset holding the {source.split!r} split, or a single parquet/json/jsonl file "
        f"with only this source's rows."
    )


@contextlib.contextmanager
def _unreadable(source: MathSource, path: Path):
    """Turn a failure to read a local file or folder into a PrepareError that names it."""
    try:
        yield
    except PrepareError:
        raise
    except Exception as error:  # datasets raises many types here (no data files, bad JSON, ...)
        raise PrepareError(
            f"source {source.name!r}: cannot read {path} as a dataset ({type(error).__name__}: {error}). "
            f"Fix: pass a parquet/json/jsonl file, a folder of them, or a datasets.save_to_disk directory."
        ) from error


def load_source(source: MathSource, value: str | None) -> tuple[Any, str]:
    """Load one source: ``(datasets.Dataset, description of where it came from)``."""
    import datasets

    if value is None:
        value = source.hub
    path = Path(value).expanduser()
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise PrepareError(
                f"source {source.name!r}: {path} is not a .parquet, .json or .jsonl file. "
                f"Fix: convert it to one of those, or pass a datasets.save_to_disk directory."
            )
        with _unreadable(source, path):
            return datasets.load_dataset(builder, data_files=str(path), split="train"), f"file {path}"
    if path.is_dir():
        if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
            with _unreadable(source, path):
                loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                dataset, split = _pick_split(loaded, source, str(path))
                return dataset, f"save_to_disk {path} [{split}]"
            return loaded, f"save_to_disk {path}"
        folder = path / source.config if source.config and (path / source.config).is_dir() else path
        with _unreadable(source, folder):
            loaded = datasets.load_dataset(str(folder))
        dataset, split = _pick_split(loaded, source, str(folder))
        return dataset, f"folder {folder} [{split}]"
    if _looks_like_path(value):
        raise PrepareError(
            f"source {source.name!r}: no such file or directory: {value}. "
            f"Fix: pass an existing file or directory, or a hub dataset id such as {source.hub!r}."
        )
    try:
        dataset = datasets.load_dataset(value, source.config, split=source.split)
    except Exception as error:  # network, authentication, missing config or split: say which source
        raise PrepareError(
            f"source {source.name!r}: could not load hub dataset {value!r} (config={source.config!r}, "
            f"split={source.split!r}): {type(error).__name__}: {error}. Fix: check the id and the "
            f"network, or download it elsewhere (datasets.load_dataset(...).save_to_disk(DIR)) and "
            f"pass --source {source.name}=DIR."
        ) from error
    return dataset, f"hub {value} [{source.split}]"


def _column(source: MathSource, columns: list[str], candidates: tuple[str, ...], what: str, where: str) -> str:
    for name in candidates:
        if name in columns:
            return name
    raise PrepareError(
        f"source {source.name!r} ({where}): no {what} column; expected one of {list(candidates)}, "
        f"the columns are {columns}. Fix: pass a dataset in the schema of {source.hub!r} "
        f"(rename the column), or check that --source {source.name}=... names the right dataset."
    )


# ---------------------------------------------------------------------------------------------
# 2. Rows of a source
# ---------------------------------------------------------------------------------------------


@dataclass
class SourceCounts:
    """What happened to the rows of one source."""

    where: str = ""
    read: int = 0
    kept: int = 0
    filtered_level: int = 0
    """MATH rows outside the wanted levels (including an unreadable level such as ``Level ?``)"""
    dropped: Counter = field(default_factory=Counter)
    """dropped rows by reason: ``no_answer``, ``empty_problem``"""


def source_rows(source: MathSource, value: str | None, max_rows: int | None) -> tuple[list[dict], SourceCounts]:
    """verl rows of one source and the counts of what was kept, filtered and dropped."""
    dataset, where = load_source(source, value)
    columns = list(dataset.column_names)
    problem_col = _column(source, columns, source.problem_fields, "problem", where)
    answer_col = _column(source, columns, source.answer_fields, "answer", where)
    level_col = _column(source, columns, source.level_fields, "level", where) if source.levels else None
    if max_rows is not None:
        dataset = dataset.select(range(min(max_rows, len(dataset))))

    counts = SourceCounts(where=where)
    rows = []
    for index, record in enumerate(dataset):
        counts.read += 1
        level = parse_level(record[level_col]) if level_col else None
        if source.levels is not None and level not in source.levels:
            counts.filtered_level += 1
            continue
        problem = record[problem_col]
        problem = problem.strip() if isinstance(problem, str) else ""
        if not problem:
            counts.dropped["empty_problem"] += 1
            continue
        ground_truth = ground_truth_of(source, record[answer_col])
        if ground_truth is None:
            counts.dropped["no_answer"] += 1
            continue
        if level is None and "level" in columns:
            level = parse_level(record["level"])
        rows.append(make_row(source, problem=problem, ground_truth=ground_truth,
                             raw_answer=record[answer_col], index=index, level=level))
        counts.kept += 1
    return rows, counts


# ---------------------------------------------------------------------------------------------
# 3. Files and the summary
# ---------------------------------------------------------------------------------------------


def row_features():
    """The parquet schema of every output file (``math_sources.make_row``), stated so that a file
    whose rows all lack a level still has ``extra_info.level: int64``."""
    from datasets import Features, List, Value

    text = Value("string")
    return Features({
        "data_source": text,
        "prompt": List({"role": text, "content": text}),
        "ability": text,
        "reward_model": {"style": text, "ground_truth": text},
        "extra_info": {"split": text, "index": Value("int64"), "question": text, "answer": text,
                       "level": Value("int64")},
    })


def write_parquet(rows: list[dict], path: Path) -> None:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows, features=row_features()).to_parquet(str(path))


def prepare(out: Path, overrides: dict[str, str], only: str | None, max_rows: int | None) -> dict[str, dict]:
    """Write the output files; return ``{output: {"path", "rows", "sources": {name: SourceCounts}}}``."""
    outputs = {"train": TRAIN_OUTPUTS, "eval": EVAL_OUTPUTS, None: TRAIN_OUTPUTS + EVAL_OUTPUTS}[only]
    report: dict[str, dict] = {}
    for output in outputs:
        rows, per_source = [], {}
        for name in OUTPUTS[output]:
            source_rows_, counts = source_rows(SOURCES[name], overrides.get(name), max_rows)
            rows += source_rows_
            per_source[name] = counts
        if output in TRAIN_OUTPUTS:
            random.Random(SHUFFLE_SEED).shuffle(rows)
        if not rows:
            raise PrepareError(
                f"{output}.parquet would be empty: every row of {list(OUTPUTS[output])} was filtered or "
                f"dropped ({ {n: _count_text(c) for n, c in per_source.items()} }). "
                f"Fix: check that the sources are the datasets named in verl_oar.data.math_sources."
            )
        path = out / f"{output}.parquet"
        write_parquet(rows, path)
        report[output] = {"path": path, "rows": len(rows), "sources": per_source}
    return report


def _count_text(counts: SourceCounts) -> str:
    parts = [f"read {counts.read}", f"kept {counts.kept}"]
    if counts.filtered_level:
        parts.append(f"filtered by level {counts.filtered_level}")
    parts += [f"dropped ({reason}) {n}" for reason, n in sorted(counts.dropped.items())]
    return ", ".join(parts)


def format_summary(report: dict[str, dict]) -> str:
    lines = ["[prepare_math] rows written:"]
    for entry in report.values():
        lines.append(f"  {entry['path']}: {entry['rows']} rows")
        for name, counts in entry["sources"].items():
            lines.append(f"    {name:<11} {_count_text(counts)}  <- {counts.where}")
    return "\n".join(lines)


def parse_overrides(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise PrepareError(f"--source {item!r} is not NAME=PATH_OR_HUB. Fix: e.g. --source gsm8k=/data/gsm8k")
        if name not in SOURCES:
            raise PrepareError(
                f"--source {item!r}: unknown source {name!r}. Fix: use one of {list(SOURCES)}."
            )
        overrides[name] = value
    return overrides


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m verl_oar.data.prepare_math",
        description="Write OAR's math train/eval sets as verl RL parquet files.",
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--source", action="append", default=[], metavar="NAME=PATH_OR_HUB",
                        help=f"where a source is read from (default: its hub dataset); NAME in {list(SOURCES)}")
    parser.add_argument("--only", choices=("train", "eval"), default=None, help="write only these files")
    parser.add_argument("--max-rows", type=int, default=None, metavar="N",
                        help="read at most the first N rows of each source")
    return parser


def main(argv: list[str] | None = None) -> int:
    import datasets

    args = build_parser().parse_args(argv)
    datasets.disable_progress_bars()
    try:
        if args.max_rows is not None and args.max_rows < 1:
            raise PrepareError(f"--max-rows {args.max_rows}: must be at least 1. Fix: omit it to read every row.")
        report = prepare(args.out.expanduser(), parse_overrides(args.source), args.only, args.max_rows)
    except PrepareError as error:
        print(f"[prepare_math] error: {error}", file=sys.stderr)
        return 2
    print(format_summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
