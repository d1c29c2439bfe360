"""scripts/gpu_acceptance.sh --tiny: every GPU-only check runs on CPU at tiny sizes, so the script cannot rot before a
GPU is lent. Checks the JSON's shape (machine, versions, each check's status / seconds / budget / reason) and the text
summary; that nothing on the script's path imports verl; that a check not run says why.

About 45 s on 2 shared cores (27 s for the main run: torch + transformers imports ~10 s, then the eight checks that run at
tiny sizes, the exactness check's naive loops and the two cost rows most of it; ~7 s for each of two short
processes, now one process shared by the last two tests); up to ~65 s while other test runs share the cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECKS = ["oar_p_exact", "oar_g_noise_device", "oar_cost_1.5b", "acpo_top1", "privileged_noise_floor",
          "memory_estimate", "oar_cost_7b", "oar_g_checkpointing", "verl_engine_multi_gpu",
          "megatron_gpu"]
ALWAYS_SKIPPED = {"verl_engine_multi_gpu", "megatron_gpu"}
"""need verl (and two GPUs, or TransformerEngine): skipped on the device machine too, with their reasons"""
STATUSES = {"ok", "failed", "skipped"}


def _run(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_acceptance.sh"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _entries_well_formed(report: dict) -> None:
    assert report["schema"] == 1 and report["order"] == CHECKS and list(report["checks"]) == CHECKS
    for name, entry in report["checks"].items():
        assert entry["status"] in STATUSES, (name, entry)
        assert isinstance(entry["seconds"], (int, float)) and entry["seconds"] >= 0, (name, entry)
        assert entry["budget_s"] > 0 and entry["question"], (name, entry)
        if entry["status"] != "ok":
            assert entry["reason"], (name, entry)  # skipped or failed: always with its reason
        if entry["status"] != "skipped":
            assert entry["result"]["headline"], (name, entry)


def test_every_check_runs_at_tiny_sizes_and_reports(tmp_path):
    out = tmp_path / "acceptance.json"
    proc = _run("--tiny", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    _entries_well_formed(report)
    failed = {n: e.get("reason") for n, e in report["checks"].items() if e["status"] != "ok" and n not in ALWAYS_SKIPPED}
    assert not failed, failed
    for name, where in (("verl_engine_multi_gpu", "test_engine_multirank_on_cpu.py"),
                        ("megatron_gpu", "test_megatron_real_on_cpu.py")):   # each says where the CPU checks it
        assert report["checks"][name]["status"] == "skipped", report["checks"][name]
        assert "needs verl" in report["checks"][name]["reason"] and where in report["checks"][name]["reason"]
    assert report["finished"] and report["tiny"] and report["running"] is None
    assert report["verl_modules_loaded"] == []  # the device machine has no verl
    machine = report["machine"]
    for key in ("torch", "transformers", "python", "cpu", "device", "flash_attn", "attentions"):
        assert key in machine, key
    assert sum(c["budget_s"] for c in report["checks"].values()) <= report["budget_s"] - 20  # start-up margin
    # the results the lead quotes
    checks = {n: e["result"] for n, e in report["checks"].items() if n not in ALWAYS_SKIPPED}
    assert checks["oar_p_exact"]["cases"]["float64_sdpa"]["mean"]["max_rel_err"] <= 1e-6
    assert checks["oar_g_noise_device"]["bit_identical"] and all(checks["oar_g_noise_device"]["bit_identical"].values())
    for cost in ("oar_cost_1.5b", "oar_cost_7b"):
        assert {"logprob", "oar_g_fused", "oar_p_chunk16", "oar_p_hierarchical", "target"} <= set(checks[cost])
    assert checks["privileged_noise_floor"]["identity_template_equal"]
    assert set(checks["memory_estimate"]["cases"]) >= {"oar_g_noisy_kl", "oar_p_chunk", "acpo_blocks"}
    text = out.with_suffix(".txt").read_text().splitlines()
    assert "8 ok, 0 failed, 2 skipped of 10" in text[0] and len(text) == 1 + len(CHECKS)


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """One process for the two tests below (each process start imports torch and transformers): first the import
    guard, an unknown ``--only`` name and ``--only`` one check; then ``--budget-s 1`` and a runner whose one check
    overruns its budget. Returns (the finished process, {name: JSON path})."""
    tmp = tmp_path_factory.mktemp("acceptance")
    paths = {name: tmp / f"{name}.json" for name in ("one", "none", "stopped")}
    code = ("import sys, time; sys.path.insert(0, 'benchmarks'); import gpu_acceptance as g\n"
            "try:\n    import verl.utils\nexcept ModuleNotFoundError as e:\n    print('REFUSED', e)\n"
            "try:\n    g.main(['--tiny', '--only', 'no_such_check'])\n"
            "except SystemExit as e:\n    print('EXIT', e.code)\n"
            "print('RC-ONLY', g.main(['--tiny', '--only', 'oar_g_noise_device', '--out', sys.argv[1]]))\n"
            "print('RC', g.main(['--tiny', '--budget-s', '1', '--out', sys.argv[2]]))\n"
            "def slow(ctx):\n    ctx.partial['first_row'] = 1.5\n    time.sleep(60)\n"
            "g.CHECKS[:] = [g.Check('slow', 1, 'overruns', slow)]\n"
            "t = time.monotonic()\n"
            "print('RC', g.main(['--tiny', '--budget-s', str(t - g.START + 2), '--out', sys.argv[3]]))\n")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run([sys.executable, "-c", code, *(str(p) for p in paths.values())], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    return proc, paths


def test_checks_not_run_say_why_and_verl_is_refused(short_runs):
    """The import guard (a check that imported verl fails here as on the device machine), an unknown ``--only`` name
    refused with the list, and ``--only`` running one check, the others skipped with the reason."""
    proc, paths = short_runs
    out = paths["one"]
    assert "REFUSED" in proc.stdout and "verl_oar.core" in proc.stdout, proc.stdout + proc.stderr
    assert "EXIT 2" in proc.stdout and "unknown check(s)" in proc.stderr and "oar_p_exact" in proc.stderr
    assert "RC-ONLY 0" in proc.stdout, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    _entries_well_formed(report)
    assert [n for n, e in report["checks"].items() if e["status"] == "ok"] == ["oar_g_noise_device"]
    assert all(e["reason"] == "not selected (--only)" for n, e in report["checks"].items() if n != "oar_g_noise_device")


def test_budget_skips_what_no_longer_fits_and_stops_an_overrunning_check_keeping_its_rows(short_runs):
    """``--budget-s 1`` starts no check (each skipped, the summary's retry line lists them all); then a runner whose
    one check overruns the budget: stopped by the alarm, reported failed with the rows it had."""
    proc, paths = short_runs
    none, stopped = paths["none"], paths["stopped"]
    assert proc.stdout.count("RC ") == 2 and "RC 0" in proc.stdout and "RC 1" in proc.stdout, proc.stdout + proc.stderr
    report = json.loads(none.read_text())
    _entries_well_formed(report)
    assert all(e["status"] == "skipped" and e["reason"].startswith("not started:") for e in report["checks"].values())
    text = none.with_suffix(".txt").read_text()
    assert "0 ok, 0 failed, 10 skipped of 10" in text
    retry = f"retry: bash scripts/gpu_acceptance.sh --only {','.join(CHECKS)} --out {none.parent / 'none'}_retry.json"
    assert retry in text
    entry = json.loads(stopped.read_text())["checks"]["slow"]
    assert entry["status"] == "failed" and entry["reason"].startswith("stopped: ran past"), entry
    assert entry["partial_result"] == {"first_row": 1.5} and entry["seconds"] < 10
