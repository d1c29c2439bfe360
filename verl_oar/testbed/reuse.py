"""Reuse finished runs instead of training them again: the long run grows one method at a time.

``--reuse SOURCE`` takes the runs of SOURCE that have the same method and seed, when the run settings
and the testbed's spec are the same as this command's:

- SOURCE a finished demo folder: its metric files, logs and dumps are copied, and every measure is
  recomputed from them as for a run trained here;
- SOURCE a summary file (``summary.json``, or the committed ``benchmarks/results_testbed_long_run_cpu.json``,
  whose folder is gone): the runs' curves and credit are taken as that summary has them; what needs a
  run's files comes from the summary too: the concentration quartiles of a method whose runs are all
  reused, and the same-response heatmap rows (kept where every run trained here that dumps has the same
  step-1 response, with its weights added).

Either way the new summary's ``reused`` says which runs came from where and the command that made them
(``earlier``: the reuse that command did in turn).
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from verl_oar.testbed.training_runs import Run, RunSettings, read_records
from verl_oar.testbed.workspace import Testbed

__all__ = ["merge_same_response", "reuse_runs"]


def reuse_runs(runs: Sequence[Run], source: Path, settings: RunSettings, bed: Testbed) -> tuple[dict, dict | None]:
    """Mark as finished the runs of ``runs`` that ``source`` (module docstring) already has. Returns
    ({"from", "command", "runs": [labels], "files", "earlier"?} for the summary, empty when nothing
    matched; the earlier summary when ``source`` is a summary file, else None)."""
    source = Path(source).expanduser().resolve()
    from_file = source.is_file()
    old = json.loads((source if from_file else source / "summary.json").read_text())
    if {k: old["settings"].get(k) for k in vars(settings)} != vars(settings) or old["testbed"]["spec"] != bed.manifest["spec"]:
        raise SystemExit(f"verl_oar.testbed.demo: --reuse {source}: its run settings or testbed differ from this run's; "
                         "its runs cannot stand in for these")
    labels = []
    for run in runs:
        previous = next((r for r in old["runs"].get(run.method, []) if r["seed"] == run.seed), None)
        if previous is None:
            continue
        if from_file:
            run.summary = copy.deepcopy(previous)
        else:
            name = f"{run.method}_seed{run.seed}"
            if not (source / "metrics" / f"{name}.jsonl").exists():
                continue
            run.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            run.log_path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source / "metrics" / f"{name}.jsonl", run.metrics_path)
            shutil.copyfile(source / "logs" / f"{name}.log", run.log_path)
            if run.dump_dir is not None:
                shutil.copytree(source / "dumps" / name, run.dump_dir, dirs_exist_ok=True)
            run.records = read_records(run.metrics_path)
        run.returncode = 0
        run.started, run.finished = 0.0, float(previous["seconds"])
        labels.append(run.label)
    if not labels:
        return {}, None
    reused = {"from": str(source), "command": old["command"], "runs": labels, "files": not from_file}
    if old.get("reused"):
        reused["earlier"] = old["reused"]
    return reused, (old if from_file else None)


def merge_same_response(earlier_rows: Sequence[dict], loaded: dict[str, dict], tokenizer) -> list[dict]:
    """The earlier summary's same-response rows with the weights of the runs trained here (``loaded``:
    method -> its step-1 dump, same seed as the rows) added; a row is kept only where every such dump has
    its response (same tokens)."""
    def index(dump) -> dict[tuple[str, ...], int]:
        out = {}
        for b in range(dump["responses"].shape[0]):
            seq = dump["responses"][b][dump["response_mask"][b].bool()].tolist()
            out.setdefault(tuple(tokenizer.decode([t]) for t in seq), b)
        return out

    indexes = {m: index(d) for m, d in loaded.items()}
    rows = []
    for row in earlier_rows:
        key = tuple(row["tokens"])
        if all(key in indexes[m] for m in loaded):
            row = copy.deepcopy(row)
            for m, dump in loaded.items():
                row["weights"][m] = dump["weights"][indexes[m][key], : len(key)].tolist()
            rows.append(row)
    return rows
