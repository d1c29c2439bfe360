"""GPU only: OAR importance through verl's real Megatron engine (TP = 1, one rank) vs plain transformers.

    python -m pytest tests/gpu -q -rs                        # the test; skips cleanly without the stack
    python tests/gpu/test_megatron_importance.py OUT_DIR     # the check itself: one JSON line per case

Needs a CUDA GPU, megatron-core, Transformer Engine and Megatron-Bridge (or the legacy ``mbridge``),
the stack verl's Megatron engine is built on; a few minutes on one GPU (a tiny Qwen2, two engine
builds). What it checks, with THD packing (``use_remove_padding=True``) and BSHD:

* OAR-G ``loglik`` and ``noisy_kl`` (static and dynamic batch size) against ``importance.gradient`` on
  plain transformers per sequence -- the FSDP test's reference -- run in fp32 on the engine's
  bf16-rounded weights: the engine is bf16 (verl's Megatron engine has no fp32 mode), so the
  comparison is loose (relative error and cosine), strict enough to catch a token, shard or
  vocabulary mapping error. ``noisy_kl`` uses an absolute noise_std=0.05 so that the noise is not bf16 rounding;
* the fused old-log-prob pass: verl's own log-probs and entropy unchanged, same importance;
* OAR-P (AS-JOINT, 3 chunks) against the naive per-copy loop on plain transformers;
* parameters, their ``main_grad`` (filled with a marker first, as mid-step), ``.grad`` and
  ``requires_grad`` are left exactly as found;
* THD and BSHD agree.
Tensor / sequence parallelism > 1 needs several GPUs and is not covered here (on the CPU,
``tests/engine/test_megatron_real_on_cpu.py`` runs the same code on real megatron-core with TP = 2 and
sequence parallelism in the padded layout, and ``tests/engine/test_megatron_engine_on_cpu.py`` the packed
layout on a toy model on a simulated TP = 2 group).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(HERE), "engine")   # the engine check scripts this test reuses


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (verl's Megatron engine runs on megatron-core, which needs CUDA)"
    missing = [m for m in ("megatron.core", "transformer_engine") if not _has(m)]
    if not (_has("megatron.bridge") or _has("mbridge")):
        missing.append("megatron.bridge (or mbridge)")
    if missing:
        return f"needs verl's Megatron stack; missing: {', '.join(missing)}"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_gpu")
    env = {**os.environ, "VERL_PLATFORM": "nvidia", "NVIDIA_TF32_OVERRIDE": "0"}
    proc = subprocess.run([sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=1200,
                          env=env, cwd=TESTS)
    lines = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CASE ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-6000:])
    return {c["name"]: c for c in lines}


def test_megatron_oar_g_matches_plain_transformers(cases):
    for name, c in cases.items():
        if c["kind"] != "oar_g":
            continue
        assert c["scale"] > 0 and c["answers_found"] == 5 and c["nonzero_rows"] == 4, (name, c)
        loose = 0.1 if c["objective"] == "loglik" else 0.25
        assert c["max_abs_err"] <= loose * c["scale"], (name, c)
        assert c["cosine"] >= (0.99 if c["objective"] == "loglik" else 0.95), (name, c)


def test_megatron_fused_log_prob_pass_is_verls_and_gives_the_same_importance(cases):
    for name, c in cases.items():
        if c["kind"] == "fused":
            assert c["log_prob_err"] <= 1e-5 and c["entropy_err"] <= 1e-5, (name, c)
            assert c["importance_err"] <= 1e-2 * c["scale"], (name, c)


def test_megatron_oar_p_matches_the_naive_loop(cases):
    for name, c in cases.items():
        if c["kind"] == "oar_p":
            assert c["scale"] > 0 and c["max_abs_err"] <= 0.25 * c["scale"] and c["cosine"] >= 0.95, (name, c)


def test_megatron_importance_leaves_parameters_and_main_grads_untouched(cases):
    for name, c in cases.items():
        if c["kind"] == "state":
            assert c["unchanged"], (name, c)


def test_megatron_thd_and_bshd_agree(cases):
    thd, bshd = cases["thd/oar_g/loglik"], cases["bshd/oar_g/loglik"]
    assert thd["row_lengths"] == bshd["row_lengths"]
    got_thd, got_bshd = torch.tensor(thd["flat"]), torch.tensor(bshd["flat"])
    assert float(torch.nn.functional.cosine_similarity(got_thd, got_bshd, dim=0)) >= 0.99


# --------------------------------------------------------------------------------------------------
# the check, in its own process (torch.distributed's group is process-global)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_megatron_worker(model_dir: str, use_remove_padding: bool):
    from _verl_config import compose_ppo_config

    from verl_oar.integration.worker import OARActorRolloutRefWorker

    megatron = "actor_rollout_ref.actor.megatron"
    bridge = [] if _has("megatron.bridge") else [f"{megatron}.vanilla_mbridge=True"]
    config = compose_ppo_config([
        "model_engine=megatron",
        "algorithm.adv_estimator=oar_g",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.use_remove_padding={use_remove_padding}",
        f"{megatron}.tensor_model_parallel_size=1",
        f"{megatron}.override_transformer_config.attention_backend=auto",
        *bridge,
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=96",
        "trainer.n_gpus_per_node=1",
    ])
    worker = OARActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor")
    worker.init_model()
    return worker


def mark_and_snapshot(engine, mark: bool) -> dict:
    """Parameters, ``main_grad`` (optionally filled with a marker first), ``.grad`` and flags, on the CPU."""
    params = list(engine.module[0].named_parameters())
    if mark:
        with torch.no_grad():
            for i, (_, p) in enumerate(params):
                if getattr(p, "main_grad", None) is not None:
                    p.main_grad.fill_(1e-3 * (i + 1))
    return {
        "params": {n: p.detach().float().cpu().clone() for n, p in params},
        "main_grad": {n: p.main_grad.float().cpu().clone() for n, p in params if getattr(p, "main_grad", None) is not None},
        "grad": {n: None if p.grad is None else p.grad.float().cpu().clone() for n, p in params},
        "requires": {n: p.requires_grad for n, p in params},
    }


def same_state(a: dict, b: dict) -> bool:
    for key in a:
        for name, x in a[key].items():
            y = b[key][name]
            if torch.is_tensor(x) or torch.is_tensor(y):
                if x is None or y is None or not torch.equal(x, y):
                    return False
            elif x != y:
                return False
    return True


def compare(got: list, want: list) -> dict:
    g = torch.cat([t.float().flatten() for t in got])
    w = torch.cat([t.float().flatten() for t in want])
    return {
        "max_abs_err": float((g - w).abs().max()),
        "scale": float(w.abs().max()),
        "cosine": float(torch.nn.functional.cosine_similarity(g, w, dim=0)) if float(w.norm()) > 0 else 0.0,
    }


def main(out_dir: str) -> None:
    os.environ.setdefault("VERL_PLATFORM", "nvidia")
    for key, val in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}.items():
        os.environ.setdefault(key, val)
    sys.path.insert(0, TESTS)
    import engine_importance_check as base
    import engine_perturbation_check as pert
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils import tensordict_utils as tu

    model_dir = base.build_model_dir(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ref_dir = os.path.join(out_dir, "bf16_weights")  # the reference runs in fp32 on the engine's bf16 weights
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hf.save_pretrained(ref_dir)
    tokenizer.save_pretrained(ref_dir)

    def emit(**case):
        print("CASE " + json.dumps(case), flush=True)

    step = 3
    for layout in ("thd", "bshd"):
        worker = build_megatron_worker(model_dir, use_remove_padding=layout == "thd")
        engine = worker.actor.engine
        before = mark_and_snapshot(engine, mark=True)

        settings = [
            ("loglik", dict(objective="loglik"), {}),
            ("noisy_kl", dict(objective="noisy_kl", noise_std=0.05, noise_relative=False), {}),
            ("noisy_kl_dynamic", dict(objective="noisy_kl", noise_std=0.05, noise_relative=False),
             dict(use_dynamic_bsz=True, max_token_len_per_gpu=96)),
        ]
        separate = {}
        for label, oar, extra in settings:
            oar = dict(oar, saliency="grad_x_input", outcome="mean")
            data, prompts, responses = base.make_batch(tokenizer, oar, step)
            if extra:
                tu.assign_non_tensor(data, **extra)
            output = worker.compute_token_importance(data)
            got = [t.float() for t in output["oar_importance"].unbind()]
            separate[label] = output
            want = base.hf_reference(ref_dir, tokenizer, prompts, responses, oar, step)
            emit(name=f"{layout}/oar_g/{label}", kind="oar_g", objective=oar["objective"], **compare(got, want),
                 answers_found=int(sum(int(a.any()) for a in output["oar_answer_mask"].unbind())),
                 nonzero_rows=int(sum(int(g.abs().sum() > 0) for g in got)),
                 row_lengths=[len(g) for g in got], flat=torch.cat(got).tolist())

        # the fused path: verl's old-log-prob pass that also yields importance
        oar = dict(objective="noisy_kl", noise_std=0.05, noise_relative=False, saliency="grad_x_input", outcome="mean")
        plain_data, _, _ = base.make_batch(tokenizer, oar, step)
        fused_data, _, _ = base.make_batch(tokenizer, oar, step)
        for d in (plain_data, fused_data):
            tu.assign_non_tensor(d, calculate_entropy=True, compute_loss=False)
        tu.assign_non_tensor(fused_data, oar_fused=True)
        plain = worker.compute_log_prob(plain_data)
        fused = worker.compute_log_prob(fused_data)

        def maxdiff(a, b):
            return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a.unbind(), b.unbind()))

        emit(name=f"{layout}/fused", kind="fused", log_prob_err=maxdiff(fused["log_probs"], plain["log_probs"]),
             entropy_err=maxdiff(fused["entropy"], plain["entropy"]),
             importance_err=maxdiff(fused["oar_importance"], separate["noisy_kl"]["oar_importance"]),
             scale=float(separate["noisy_kl"]["oar_importance"].values().abs().max()))

        # OAR-P: AS-JOINT over 3 chunks (larger effects than single tokens: bf16 logits)
        oar = dict(outcome="joint", perturb_mode="chunk", perturb_budget=3)
        data, prompts, responses = base.make_batch(tokenizer, oar, step)
        tu.assign_non_tensor(data, oar_method="perturbation")
        output = worker.compute_token_importance(data)
        want = pert.naive_reference(ref_dir, tokenizer, prompts, responses, oar, temperature=1.0)
        emit(name=f"{layout}/oar_p", kind="oar_p", **compare([t.float() for t in output["oar_importance"].unbind()], want),
             copies=output["oar_perturb_copies"].tolist())

        emit(name=f"{layout}/state", kind="state", unchanged=same_state(before, mark_and_snapshot(engine, mark=False)))
        del worker, engine


if __name__ == "__main__":
    main(sys.argv[1])
