"""Two data-parallel ranks of verl's real FSDP2 engine (gloo, CPU) whose numbers of model calls
differ -- different response lengths, and on one rank a micro-batch with no answer (nothing to score)
-- for OAR-P (chunk and hierarchical) and OAR-G (non-fused; fused into verl's old-log-prob pass with
noisy KL and with log-likelihood), in fp32 with packed rows and in bf16 mixed precision with padded rows.
By default the parameters stay sharded: both ranks make the same forwards and the same all-gathers (a
mismatch would crash or hang: the run has a timeout), no reduce-scatter, and the largest parameter bytes
unsharded at once stay at verl's own old-log-prob forward's; with ``algorithm.oar.gather_params`` the whole
model is gathered once per pass (one all-gather per FSDP2 module; the unsharded count is then the whole
model, which shows the count sees such a gather), with the same bits. OAR-G runs with verl's default gradient
checkpointing (its backward recomputes each sharded layer, inside the all-gather FSDP2 makes for the backward
anyway): the same bits and the same all-gathers as with it switched off. Each rank's fp32 importance equals a
one-process plain-transformers reference, the fused log-probs and entropy are verl's own bit for bit, and
parameters, grads and optimizer state come back unchanged and sharded.

With ``OAR_MULTIRANK_CUDA=1`` the same checks run on two GPUs under NCCL (needs a machine with two).

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
WORKERS = ("fp32", "bf16")  # fp32 packed rows (use_remove_padding) and bf16 padded rows


def _plain(worker: dict) -> list[str]:
    return [name for name in worker["passes"] if name.endswith("_plain")]


def _sharded(worker: dict) -> list[str]:
    return [name for name in worker["passes"] if not name.endswith(("_gathered", "verl_log_prob"))]


def _gathered(worker: dict) -> list[str]:
    return [name for name in worker["passes"] if name.endswith("_gathered")]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_multirank")
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    cuda = ["--cuda"] if os.environ.get("OAR_MULTIRANK_CUDA") == "1" else []  # 2 GPUs, NCCL (see the check)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "engine_multirank_check.py"), str(out), "240", *cuda],
        capture_output=True, text=True, timeout=300, env=env, cwd=HERE, check=False,
    )
    lines = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("RANK ")]
    assert proc.returncode == 0 and len(lines) == 2, (proc.stdout[-3000:], proc.stderr[-5000:])
    return sorted(lines, key=lambda r: r["rank"])


def test_ranks_really_make_different_numbers_of_model_calls(ranks):
    first, second = (r["fp32"]["results"] for r in ranks)
    assert first["p_chunk"]["copies"] != second["p_chunk"]["copies"], ranks
    assert first["p_hier"]["copies"] != second["p_hier"]["copies"], ranks
    assert first["g_noisy"]["answers"] == [1, 1] and second["g_noisy"]["answers"] == [0, 1], ranks
    for worker in WORKERS:  # left to themselves (gathered parameters), the ranks' forwards differ
        for name in _gathered(ranks[0][worker]):
            assert ranks[0][worker]["passes"][name]["forwards"] != ranks[1][worker]["passes"][name]["forwards"], name


def test_each_rank_equals_the_one_process_reference(ranks):
    for r in ranks:
        results = r["fp32"]["results"]
        assert len([n for n in results if "err" in results[n]]) == 8, results
        for name, result in results.items():
            tolerance = 1e-2 if name.startswith("p_") else 1e-3
            assert result["scale"] > 0 and result["err"] <= tolerance * result["scale"], (r["rank"], name, result)


def test_sharded_and_gathered_passes_give_the_same_bits(ranks):
    for r in ranks:
        for worker in WORKERS:
            gathered = _gathered(r[worker])
            assert gathered and all(r[worker]["results"][n]["identical_to_sharded"] for n in gathered), r[worker]


def test_fused_log_probs_are_verls_own(ranks):
    for r in ranks:
        for worker in WORKERS:
            fused = [n for n, x in r[worker]["results"].items() if "log_probs_identical" in x]
            assert fused, r[worker]
            for name in fused:
                result = r[worker]["results"][name]
                assert result["log_probs_identical"] and result["entropy_identical"], (worker, name, result)


def test_sharded_passes_make_the_same_calls_on_every_rank(ranks):
    for worker in WORKERS:
        for name in _sharded(ranks[0][worker]):
            first, second = ranks[0][worker]["passes"][name], ranks[1][worker]["passes"][name]
            assert first["forwards"] == second["forwards"] > 0, (worker, name, first, second)
            assert first["collectives"] == second["collectives"], (worker, name, first, second)
            assert set(first["collectives"]) == {"all_gather_single"}, (worker, name, first)  # no reduce-scatter


def test_sharded_passes_unshard_no_more_than_verls_own_forward(ranks):
    for r in ranks:
        for worker in WORKERS:
            w = r[worker]
            forward_level = w["passes"][f"{'bf16_' if worker == 'bf16' else ''}verl_log_prob"]["peak_bytes"]
            assert 0 < forward_level < w["whole_model_bytes"], w
            for name in _sharded(w):
                assert 0 < w["passes"][name]["peak_bytes"] <= forward_level, (r["rank"], name, w["passes"][name])


def test_gathered_passes_gather_the_whole_model_once(ranks):
    for r in ranks:
        for worker in WORKERS:
            w = r[worker]
            for name in _gathered(w):
                assert w["passes"][name]["collectives"] == {"all_gather_single": w["fsdp_modules"]}, (name, w)
                assert w["passes"][name]["peak_bytes"] == w["whole_model_bytes"], (name, w)


def test_parameters_unchanged_and_sharded_again(ranks):
    for r in ranks:
        for worker in WORKERS:
            assert r[worker]["state_unchanged"] and r[worker]["sharded_after"], (r["rank"], worker)


def test_gradient_checkpointing_changes_no_bit_and_no_all_gather(ranks):
    for r in ranks:
        for worker in WORKERS:
            w = r[worker]
            assert w["checkpointed_layers"] == 2 and _plain(w), w  # verl's default: every OAR-G pass checkpointed
            for name in _plain(w):
                checkpointed = name[: -len("_plain")]
                assert w["results"][name]["identical_to_checkpointed"], (r["rank"], worker, name)
                assert w["passes"][name]["collectives"] == w["passes"][checkpointed]["collectives"], (name, w["passes"])
                assert w["passes"][name]["forwards"] == w["passes"][checkpointed]["forwards"], (name, w["passes"])
                # the checkpointed backward recomputed the layers: their attention ran once more per layer in each
                # of the 2 micro-batches' backwards (one sample each; rank 1's first one on a stand-in)
                recomputed = w["passes"][checkpointed]["attention_calls"] - w["passes"][name]["attention_calls"]
                assert recomputed == w["checkpointed_layers"] * 2, (r["rank"], name, w["passes"])


def test_hsdp_with_dynamic_batch_size_equals_the_reference_and_fuses_into_verls_own_pass(ranks):
    """fsdp_size=1 on 2 ranks: a (ddp 2, fsdp 1) mesh, every rank a replica (HSDP), with use_dynamic_bsz: the
    importance of each rank's rows equals the one-process reference, the fused pass's log-probs and entropy are verl's
    own bit for bit, and the parameters come back unchanged."""
    for r in ranks:
        w = r["hsdp"]
        assert w["mesh"] == {"shape": [2, 1], "names": ["ddp", "fsdp"]}, w["mesh"]
        results = w["results"]
        assert {n for n in results if "err" in results[n]} == {"hsdp_p_chunk", "hsdp_g_noisy", "hsdp_g_fused_noisy"}
        for name, result in results.items():
            tolerance = 1e-2 if "_p_" in name else 1e-3
            assert result["scale"] > 0 and result["err"] <= tolerance * result["scale"], (r["rank"], name, result)
        fused = results["hsdp_g_fused_noisy"]
        assert fused["log_probs_identical"] and fused["entropy_identical"], (r["rank"], fused)
        assert w["state_unchanged"], r["rank"]
        # dynamic batch size packs both rows into one micro-batch of <= 1024 tokens; the fixed micro-batch of 1 row makes
        # one forward per row; one replica of the whole model per rank: no all-gather
        assert w["passes"]["hsdp_verl_log_prob"]["forwards"] < r["fp32"]["passes"]["verl_log_prob"]["forwards"], (
            w["passes"]["hsdp_verl_log_prob"], r["fp32"]["passes"]["verl_log_prob"])
        assert all(p["collectives"] == {} for p in w["passes"].values()), w["passes"]
