"""Two data-parallel ranks of verl's real FSDP2 engine (gloo, CPU) whose numbers of model calls
differ -- different response lengths, and on one rank a micro-batch with no answer (nothing to score)
-- for OAR-P (chunk and hierarchical) and OAR-G (non-fused; fused into verl's old-log-prob pass with
noisy KL and with log-likelihood). By default the parameters stay sharded: both ranks make the same
forwards and the same all-gathers (a mismatch would crash or hang: the run has a timeout), no
reduce-scatter, and the largest parameter bytes unsharded at once stay at verl's own old-log-prob
forward's; with ``algorithm.oar.gather_params`` the whole model is gathered once per pass (one all-gather
per FSDP2 module; the unsharded count is then the whole model, which shows the count can see it). Each
rank's importance equals a one-process plain-transformers reference, the fused log-probs and entropy are
verl's own bit for bit, and parameters, grads and optimizer state come back unchanged and sharded.

Tolerance as in test_engine_perturbation_on_cpu.py (OAR-P, 1e-2 x scale) and
test_engine_importance_on_cpu.py (OAR-G, 1e-3 x scale).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(__file__)
SHARDED = ("p_chunk", "p_hier", "g_noisy", "g_fused_noisy", "g_fused_loglik")
GATHERED = ("p_gathered", "g_gathered")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_multirank")
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "engine_multirank_check.py"), str(out), "240"],
        capture_output=True, text=True, timeout=300, env=env, cwd=HERE, check=False,
    )
    lines = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("RANK ")]
    assert proc.returncode == 0 and len(lines) == 2, (proc.stdout[-3000:], proc.stderr[-5000:])
    return sorted(lines, key=lambda r: r["rank"])


def test_ranks_really_make_different_numbers_of_model_calls(ranks):
    first, second = (r["results"] for r in ranks)
    assert first["p_chunk"]["copies"] != second["p_chunk"]["copies"], ranks
    assert first["p_hier"]["copies"] != second["p_hier"]["copies"], ranks
    assert first["g_noisy"]["answers"] == [1, 1] and second["g_noisy"]["answers"] == [0, 1], ranks
    for name in GATHERED:  # left to themselves (gathered parameters), the ranks' forwards differ
        assert ranks[0]["passes"][name]["forwards"] != ranks[1]["passes"][name]["forwards"], name


def test_each_rank_equals_the_one_process_reference(ranks):
    for r in ranks:
        for name, result in r["results"].items():
            tolerance = 1e-2 if name.startswith("p_") else 1e-3
            assert result["scale"] > 0 and result["err"] <= tolerance * result["scale"], (r["rank"], name, result)


def test_fused_log_probs_are_verls_own(ranks):
    for r in ranks:
        for name in ("g_fused_noisy", "g_fused_loglik"):
            assert r["results"][name]["log_probs_identical"] and r["results"][name]["entropy_identical"], r


def test_sharded_passes_make_the_same_calls_on_every_rank(ranks):
    for name in SHARDED:
        first, second = ranks[0]["passes"][name], ranks[1]["passes"][name]
        assert first["forwards"] == second["forwards"] > 0, (name, first, second)
        assert first["collectives"] == second["collectives"], (name, first, second)
        assert set(first["collectives"]) == {"all_gather_single"}, (name, first)  # no reduce-scatter


def test_sharded_passes_unshard_no_more_than_verls_own_forward(ranks):
    for r in ranks:
        forward_level = r["passes"]["verl_log_prob"]["peak_bytes"]
        assert 0 < forward_level < r["whole_model_bytes"], r
        for name in SHARDED:
            assert 0 < r["passes"][name]["peak_bytes"] <= forward_level, (r["rank"], name, r["passes"][name])


def test_gathered_passes_gather_the_whole_model_once(ranks):
    for r in ranks:
        for name in GATHERED:
            assert r["passes"][name]["collectives"] == {"all_gather_single": r["fsdp_modules"]}, (name, r)
            assert r["passes"][name]["peak_bytes"] == r["whole_model_bytes"], (name, r)


def test_parameters_unchanged_and_sharded_again(ranks):
    for r in ranks:
        assert r["state_unchanged"] and r["sharded_after"], r
