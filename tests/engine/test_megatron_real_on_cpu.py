"""OAR on a real megatron-core ``GPTModel`` on the CPU, through verl's own Megatron forward.

megatron-core 0.16.1 (the ``test`` extra) runs here once ``verl_oar.cpu.megatron_patches`` routes five CUDA
assumptions to the CPU. One spawn of two gloo ranks (``tests/engine/megatron_real_check.py``) runs, for
fp32 and bf16, TP = 1, TP = 2 and TP = 2 with sequence parallelism on a tiny local-spec ``GPTModel``
(hidden 64, 2 layers, vocabulary 128; the same weights split differently): OAR-G (``noisy_kl``,
``loglik``, plain and fused with verl's log-prob pass) and OAR-P (exact, chunk) through
``engines.megatron`` and verl's ``gptmodel_forward_model_engine`` in the padded (BSHD) layout, against
per-sequence references at TP = 1 and against TP = 1 at TP = 2. About 30-50 s on 2 busy cores.

What only a GPU checks (``tests/gpu``): the packed (THD) layout (TransformerEngine's attention, CUDA;
refused here with a message, tested below), verl's ``MegatronEngine`` itself (its construction needs
CUDA: the check drives the plugin's path with a stand-in holding the attributes it reads and verl's own
``_lm_head_logits_processor``), TransformerEngine layers and FP8, pipeline parallelism (refused by the
plugin anyway), NCCL. The THD packing arithmetic is covered by the toy model in
``tests/engine/test_megatron_engine_on_cpu.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
LAYOUTS = ("tp1", "tp2", "tp2_sp")
G = ("g_noisy_kl", "g_noisy_kl_fused", "g_loglik", "g_loglik_fused")
P = ("p_exact", "p_chunk")
FUSED = ("g_noisy_kl_fused", "g_loglik_fused")

# Tolerances, as a fraction of the reference's largest score (OAR-G, OAR-P) or absolute (log-probs, entropy: nats).
# fp32: the engine and the reference differ only in padding and in how matmuls are split (rows of different
# lengths; heads, MLP and vocabulary split over TP ranks), i.e. in float32 summation order. Measured (fraction of
# the scale, worst of TP = 1 vs the reference and TP = 2 with or without SP vs TP = 1): OAR-G noisy_kl 1.2e-6,
# loglik 2.1e-7; OAR-P exact 1.0e-5 (a divergence of nearly equal log-probs of magnitude ~5: a few float32
# ulps of a log-prob, relative to a small score), chunk 2.0e-6; log-probs / entropy 1.4e-6 nats. Bounds 8-14x above.
# bf16: every matmul output is rounded to 8 significant bits (relative 2^-9), and the scores are differences of
# nearly equal quantities. Measured: up to 1.3e-2 of the scale (OAR-G noisy_kl and OAR-P chunk, TP = 2 vs TP = 1;
# padded and unpadded bf16 agreed exactly for loglik and OAR-P at TP = 1), entropy 0.031 nats, log-probs 0.004.
# Bounds 3-4x above: loose, but a wrong token, shard or vocabulary slice moves scores by their own size.
REL_TOL = {"fp32": {"g": 1e-5, "p": 1e-4}, "bf16": {"g": 5e-2, "p": 5e-2}}
NATS_TOL = {"fp32": 2e-5, "bf16": 0.1}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from _fresh_process import free_port

    out = tmp_path_factory.mktemp("megatron_real")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}   # the CPU path also on a GPU machine (the patches step aside under CUDA)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(HERE / "megatron_real_check.py"), str(r), "2", port, str(out)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]
    logs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [log[1][-4000:] for log in logs]
    return {
        "probes": [torch.load(out / f"probes_rank{r}.pt") for r in range(2)],
        **{(dtype, layout, r): torch.load(out / f"{dtype}_{layout}_rank{r}.pt")
           for dtype in ("fp32", "bf16") for layout in LAYOUTS for r in range(2)},
    }


def _max_diff(a: list, b: list) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _scale(rows: list) -> float:
    return max(float(x.abs().max()) for x in rows)


def _log_probs(rows: list) -> list:
    """verl's log-prob of the last position is that of a wrapped label: not a token's, dropped."""
    return [r[:-1] for r in rows]


def test_each_megatron_cpu_patch_is_still_needed_and_works(results):
    from verl_oar.cpu.megatron_patches import PATCHES

    for probes in results["probes"]:
        assert list(probes) == [p.name for p in PATCHES]
        for name, probe in probes.items():
            # "raised": the unpatched call still fails on the CPU, so the patch is still needed
            assert probe["before"].startswith("raised"), (name, probe)
            assert probe["after"] == "ran" and probe["applied"], (name, probe)


def test_a_missing_megatron_patch_target_fails_loudly_with_its_name():
    from verl_oar.cpu.megatron_patches import PATCHES, MegatronPatch, MegatronPatchError

    for patch in PATCHES:
        assert patch.target() is not None   # every target exists in this megatron-core
    gone = MegatronPatch(name="gone", module="megatron.core.transformer.utils", attribute="no_such_function",
                         why="a test", apply=lambda m: None)
    with pytest.raises(MegatronPatchError, match="'gone'.*no_such_function"):
        gone.target()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_importance_at_tp1_equals_the_per_sequence_reference(results, dtype):
    got = results[dtype, "tp1", 0]
    ref = got["reference"]
    for name in G + P:
        want = ref[name.replace("_fused", "")]
        assert _scale(want) > 0, name
        tol = REL_TOL[dtype][name[0]] * _scale(want)
        assert _max_diff(got[name], want) <= tol, (name, _max_diff(got[name], want), tol)
        # 4 samples, one without an answer: nothing to score there
        assert sum(bool(r.abs().sum() > 0) for r in got[name]) == 3, name
    for name in FUSED:
        for kind in ("log_probs", "entropy"):
            want = ref[kind]   # the reference's log-probs stop at the last real label
            have = _log_probs(got[f"{name}_{kind}"]) if kind == "log_probs" else got[f"{name}_{kind}"]
            assert _max_diff(have, want) <= NATS_TOL[dtype], (name, kind, _max_diff(have, want))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_importance_at_tp2_equals_tp1(results, dtype, layout):
    one, two = results[dtype, "tp1", 0], results[dtype, layout, 0]
    for name in G + P:
        tol = REL_TOL[dtype][name[0]] * _scale(one[name])
        assert _max_diff(two[name], one[name]) <= tol, (name, _max_diff(two[name], one[name]), tol)
    for name in FUSED:
        assert _max_diff(_log_probs(two[f"{name}_log_probs"]), _log_probs(one[f"{name}_log_probs"])) <= NATS_TOL[dtype]
        assert _max_diff(two[f"{name}_entropy"], one[f"{name}_entropy"]) <= NATS_TOL[dtype]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_rank_gets_the_same_scores_and_fusing_changes_none(results, dtype):
    for layout in LAYOUTS:
        zero, one = results[dtype, layout, 0], results[dtype, layout, 1]
        for name in G + P:
            assert _max_diff(zero[name], one[name]) == 0, (layout, name)
        for plain in ("g_noisy_kl", "g_loglik"):   # the fused pass scores with the same logits
            assert _max_diff(zero[plain], zero[f"{plain}_fused"]) == 0, (layout, plain)


def test_parameters_and_gradients_are_left_as_found(results):
    for key, result in results.items():
        if key != "probes":
            assert result["untouched"], key


def test_the_packed_layout_is_refused_on_the_cpu_naming_the_padded_one(results):
    refusal = results["fp32", "tp1", 0]["thd_refusal"]
    assert refusal.startswith("raised ValueError"), refusal
    assert "padded (BSHD) layout" in refusal and "use_remove_padding=False" in refusal, refusal
